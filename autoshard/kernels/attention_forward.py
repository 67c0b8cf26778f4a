"""The attention forward kernel and its launcher :func:`_forward`: out and the natural-log lse of one query block
over one key block at global offsets.

``_attn_fwd_kernel`` runs one program per (query tile, head, batch), the last query tiles first (under causal
masks they see the most keys, so the long programs start early). Each walks the key tiles of its rows' band,
chunks and documents in the three phases of :mod:`.attention_tiles`, ``_fwd_key_tiles`` being its tile loop:
online softmax in base 2 (``exp2`` with ``log2(e)`` folded into the scale) with fp32 accumulation; a row with no
visible key gives out 0 and lse -inf without NaN. With dropout, the dropped probabilities are left out of the
accumulator but not of the row sum (lse is of the probabilities before dropout), and out is scaled by
``1 / (1 - p)`` at the end.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from .attention_problem import _kernel_args, _Problem, _strides
from .attention_tiles import (_dot, _dropout_keep, _LOG2E, _phase_tiles, _query_key_tiles, _query_terms,
                              _tile_scores)
from .autotune import RUNTIME_INTS, TUNING_KEY, configs, pruner
from .common import aligned_empty, load_tile, store_tile

__all__ = ["_attn_fwd_kernel", "_forward"]

_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _fwd_key_tiles(acc, m_i, l_i, q, q_idx, seg_q, K_head, V_head, KeyMask, SegK, k_offsets, v_offsets,
                   start, end, stride_ks, stride_vs, Sk, q_offset, k_offset, left, right, chunk, qk_scale, qk_cap,
                   slope2, row_hash, drop_threshold, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
                   HAS_SEG: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """Online-softmax update of (acc, m_i, l_i) over the key tiles starting in [start, end). With HAS_ALIBI,
    ``slope2`` (this head's slope times log2(e)) biases the base-2 scores after the cap, before the mask. With
    HAS_DROPOUT, the dropped probabilities (``_dropout_keep`` of the rows' ``row_hash``) are left out of acc but
    not of l_i: the row normalization (and lse) is of the probabilities before dropout; the caller scales out by
    ``1 / (1 - p)``."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        k_idx = start_n + offs_n
        k = load_tile(K_head + tl.cast(start_n, tl.int64) * stride_ks + k_offsets, k_idx, Sk, offs_d,
                      HEAD_DIM, BLOCK_D, PARTIAL)
        s, _ = _tile_scores(q, k, q_idx, k_idx, seg_q, KeyMask, SegK, Sk, q_offset, k_offset, left, right, chunk,
                            qk_scale, qk_cap, slope2, 0, PARTIAL, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_KEY_MASK,
                            HAS_SEG, SOFTCAP, HAS_ALIBI, DOT_PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
        if PARTIAL or HAS_KEY_MASK or HAS_SEG:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:  # after the row sum: lse is of the probabilities before dropout
            p = tl.where(_dropout_keep(row_hash, k_offset + k_idx, drop_threshold, 0), p, 0.0)
        v = load_tile(V_head + tl.cast(start_n, tl.int64) * stride_vs + v_offsets, k_idx, Sk, offs_dv,
                      V_DIM, BLOCK_DV, PARTIAL)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.autotune(configs=configs("fwd"), key=TUNING_KEY,
                 prune_configs_by={"early_config_prune": pruner("fwd")})
@triton.jit(do_not_specialize=RUNTIME_INTS)
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, KeyMask, SegQ, SegK, SegSorted, Alibi, Seed,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
    num_heads, kv_group, Sq, Sk, q_offset, k_offset, left, right, chunk, scale, qk_cap, SQ_BUCKET, SK_BUCKET,
    drop_head_offset, drop_threshold, drop_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, HAS_SEG: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out and lse of one query tile over the visible key tiles: ``s = scale * cap(q k^T) + bias`` masked, online
    softmax ``p = exp(s - lse)`` with ``lse = log(sum_j exp(s_j))``, ``out = sum_j p_j z_j v_j`` (``z`` the dropout
    factors, 1 without dropout)."""
    # Last query tiles first: under causal masks they see the most keys, so the long programs start early.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    row = (b * num_heads + h).to(tl.int64) * Sq  # this (batch, head)'s rows of lse / delta
    hk = h // kv_group
    q_start = pid_m * BLOCK_M
    q_idx = q_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    Q_head = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    K_head = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    V_head = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    q = load_tile(Q_head + q_idx[:, None].to(tl.int64) * stride_qs + offs_d[None, :], q_idx, Sq, offs_d,
                  HEAD_DIM, BLOCK_D, True)
    seg_q = q_idx
    if HAS_SEG:
        seg_q = tl.load(SegQ + b * Sq + q_idx, mask=q_idx < Sq, other=0)
    KeyMask_b = KeyMask + b * Sk
    SegK_b = SegK + b * Sk
    k_offsets = offs_n[:, None] * stride_ks + offs_d[None, :]
    v_offsets = offs_n[:, None] * stride_vs + offs_dv[None, :]
    qk_scale = scale * _LOG2E
    slope2, row_hash = _query_terms(Alibi, Seed, b, h, drop_head_offset, q_offset, q_idx, HAS_ALIBI, HAS_DROPOUT)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _query_key_tiles(q_start, q_idx, seg_q, q_offset, Sq, k_offset, Sk, left, right, chunk,
                                                SegK_b, SegSorted, b, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                                                HAS_SEG)
    for phase in tl.static_range(3):
        start, end = _phase_tiles(lo, full_lo, full_hi, hi, phase)
        acc, m_i, l_i = _fwd_key_tiles(acc, m_i, l_i, q, q_idx, seg_q, K_head, V_head, KeyMask_b, SegK_b,
                                       k_offsets, v_offsets, start, end, stride_ks, stride_vs, Sk, q_offset,
                                       k_offset, left, right, chunk, qk_scale, qk_cap, slope2, row_hash,
                                       drop_threshold, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV, BLOCK_N, phase != 1,
                                       HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_KEY_MASK, HAS_SEG, SOFTCAP, HAS_ALIBI,
                                       HAS_DROPOUT, DOT_PRECISION)

    has_keys = l_i > 0.0
    l_ref = tl.where(has_keys, l_i, 1.0)
    out = acc / l_ref[:, None]  # acc is 0 where nothing was visible
    if HAS_DROPOUT:  # the kept probabilities times 1 / (1 - p)
        out = out * drop_scale
    lse = tl.where(has_keys, (m_i + tl.log2(l_ref)) * _LN2, float("-inf"))
    O_head = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    store_tile(O_head + q_idx[:, None].to(tl.int64) * stride_os + offs_dv[None, :], out, q_idx, Sq, offs_dv, V_DIM)
    tl.store(Lse + row + q_idx, lse, mask=q_idx < Sq)


def _forward(p: _Problem, out_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    batch, heads, kv_heads, sq, sk, head_dim = p.shape
    out = aligned_empty(p.out_shape, out_dtype, p.q.device)
    lse = torch.empty((batch, heads, sq), dtype=torch.float32, device=p.q.device)
    if p.hidden or sk == 0 or out.numel() == 0:  # nothing visible: out 0, lse -inf
        return out.zero_(), lse.fill_(float("-inf"))
    grid = lambda meta: (triton.cdiv(sq, meta["BLOCK_M"]), heads, batch)  # noqa: E731
    _attn_fwd_kernel[grid](
        Q=p.q, K=p.k, V=p.v, Out=out, Lse=lse,
        **_strides("q", p.q), **_strides("k", p.k), **_strides("v", p.v), **_strides("o", out), **_kernel_args(p),
    )
    return out.contiguous(), lse
