"""The attention backward kernels and their launcher :func:`_backward`: dq, dk and dv of one key block's share of
attention, from the FINAL (merged) out and lse over all key blocks, so that a ring step's gradients for a key
block that is not local are exactly that block's share and the caller can accumulate them.

With ``delta = rowsum(dout * out)``, ``p = exp(s - lse)`` recomputed from the scaled, capped, biased scores and
``z`` the dropout factors (1 without dropout): ``dv += (p z)^T dout``, ``dp = (dout v^T) z``, ``ds = p (dp -
delta)``, ``dq += scale * ds k`` and ``dk += scale * ds^T q``. Soft-capping multiplies ``ds`` by ``1 - tanh^2``
of the recomputed cap; the ALiBi bias is a constant of the scores (it only enters ``p``; no gradient for the
slopes); the dropout mask is recomputed from the seed by the forward's hash (:mod:`.attention_tiles`).

- ``_attn_bwd_delta_kernel`` (launched by :func:`_delta`): ``delta``, skipped when the caller passes it.
- ``_attn_bwd_dkdv_kernel``: one program per (key tile, kv head, batch), looping over the query heads of its GQA
  group and over the query tiles the band lets see it (``_band_tiles`` with the bounds swapped, the three phases
  mirrored; ``_dkdv_query_tiles`` is its tile loop), so dk/dv of a kv head are summed in registers: no atomics,
  deterministic.
- ``_attn_bwd_dq_kernel``: one program per (query tile, head, batch) over the same key tiles as the forward
  (``_dq_key_tiles`` is its tile loop).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_problem import _kernel_args, _Problem, _strides
from .attention_tiles import (_band_tiles, _document_tiles, _dot, _dropout_keep, _dropout_row_hash, _LOG2E,
                              _phase_tiles, _query_key_tiles, _query_terms, _tile_scores)
from .autotune import RUNTIME_INTS, TUNING_KEY, configs, pruner
from .common import aligned_empty, aligned_rows, check_like, load_tile, padded_dim, row_block, store_tile

__all__ = ["_attn_bwd_delta_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel", "_delta", "_backward"]


@triton.jit
def _load_row_stats(Lse, Delta, rows, n_rows, CHECK_ROWS: tl.constexpr):
    """LSE in base 2 and delta of query rows; rows with lse = -inf (nothing visible) or out of bounds
    get +inf, so exp2(s - lse) is 0 there and the row contributes nothing (no NaN)."""
    if CHECK_ROWS:
        lse = tl.load(Lse + rows, mask=rows < n_rows, other=float("inf"))
        delta = tl.load(Delta + rows, mask=rows < n_rows, other=0.0)
    else:
        lse = tl.load(Lse + rows)
        delta = tl.load(Delta + rows)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    return lse2, delta


@triton.jit
def _attn_bwd_delta_kernel(Out, DO, Delta, stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos,
                           num_heads, Sq, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[b, h, i] = sum_d dout[b, h, i, d] * out[b, h, i, d] in fp32."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    o = load_tile(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                  + rows[:, None].to(tl.int64) * stride_os + cols[None, :], rows, Sq, cols, HEAD_DIM, BLOCK_D, True)
    do = load_tile(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
                   + rows[:, None].to(tl.int64) * stride_dos + cols[None, :], rows, Sq, cols, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + (b * num_heads + h).to(tl.int64) * Sq + rows, delta, mask=rows < Sq)


@triton.jit
def _dkdv_query_tiles(dk, dv, k, v, k_idx, Q_b, DO_b, Lse_b, Delta_b, SegQ_b, KeyMask, SegK,
                      q_offsets, do_offsets, start, end, first_head, kv_group, stride_qh, stride_qs, stride_doh,
                      stride_dos, Sq, Sk, q_offset, k_offset, left, right, chunk, qk_scale, qk_cap, Alibi,
                      seed, drop_bh, drop_threshold, drop_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
                      BLOCK_M: tl.constexpr, PARTIAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                      HAS_CHUNK: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_SEG: tl.constexpr,
                      SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """Accumulate dk (unscaled) and dv of one key tile over the query tiles starting in [start, end) of
    every query head of the kv head's group. Heads and tiles form one flat loop (not two nested ones),
    which keeps the loop-carried state, and so the register pressure, that of a single loop. With
    HAS_ALIBI, Alibi holds the slopes per QUERY head (loaded per head of the group). With HAS_DROPOUT, the
    kept probabilities (``drop_bh + h`` the hash's ``b * 2**16 + h``) enter dv (scaled by ``1 / (1 - p)`` by the
    caller) and dP is ``(v . dout) * z``."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    tiles = (end - start + BLOCK_M - 1) // BLOCK_M
    for it in range(0, kv_group * tiles):
        g = it // tiles
        start_m = start + (it - g * tiles) * BLOCK_M
        h = tl.cast(first_head + g, tl.int64)
        q_idx = start_m + offs_m
        q = load_tile(Q_b + h * stride_qh + tl.cast(start_m, tl.int64) * stride_qs + q_offsets, q_idx, Sq, offs_d,
                      HEAD_DIM, BLOCK_D, PARTIAL)
        do = load_tile(DO_b + h * stride_doh + tl.cast(start_m, tl.int64) * stride_dos + do_offsets, q_idx, Sq,
                       offs_dv, V_DIM, BLOCK_DV, PARTIAL).to(v.dtype)
        lse2, delta = _load_row_stats(Lse_b + h * Sq, Delta_b + h * Sq, q_idx, Sq, PARTIAL)
        seg_q = q_idx
        if HAS_SEG:
            seg_q = tl.load(SegQ_b + q_idx, mask=q_idx < Sq, other=0)
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(Alibi + h) * _LOG2E
        s_t, tanh_t = _tile_scores(k, q, q_idx, k_idx, seg_q, KeyMask, SegK, Sk, q_offset, k_offset, left, right,
                                   chunk, qk_scale, qk_cap, slope2, 1, PARTIAL, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                                   HAS_KEY_MASK, HAS_SEG, SOFTCAP, HAS_ALIBI, DOT_PRECISION)  # [keys, queries]
        p_t = tl.exp2(s_t - lse2[None, :])
        if HAS_DROPOUT:
            keep_t = _dropout_keep(_dropout_row_hash(seed, drop_bh + h, q_offset + q_idx), k_offset + k_idx,
                                   drop_threshold, 1)
            dv = _dot(tl.where(keep_t, p_t, 0.0).to(do.dtype), do, dv, DOT_PRECISION)
        else:
            dv = _dot(p_t.to(do.dtype), do, dv, DOT_PRECISION)
        dp_t = _dot(v, tl.trans(do), None, DOT_PRECISION)
        if HAS_DROPOUT:
            dp_t = tl.where(keep_t, dp_t * drop_scale, 0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:  # through the cap: d(c * tanh(x / c)) / dx = 1 - tanh^2
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)
        dk = _dot(ds_t.to(q.dtype), q, dk, DOT_PRECISION)
    return dk, dv


@triton.autotune(configs=configs("dkdv"), key=TUNING_KEY,
                 prune_configs_by={"early_config_prune": pruner("dkdv")})
@triton.jit(do_not_specialize=RUNTIME_INTS)
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, KeyMask, SegQ, SegK, SegSorted, Alibi, Seed,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    num_heads, kv_group, Sq, Sk, q_offset, k_offset, left, right, chunk, scale, qk_cap, SQ_BUCKET, SK_BUCKET,
    drop_head_offset, drop_threshold, drop_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, HAS_SEG: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dk and dv of one key tile, summed over the query heads of its GQA group and the visible query tiles: with
    the final lse and ``delta = rowsum(dout * out)``, ``p = exp(s - lse)``, ``dv += (p z)^T dout``, ``dp = (dout
    v^T) z``, ``ds = p (dp - delta)`` (times ``1 - tanh^2`` of the cap when soft-capped) and ``dk += scale * ds^T
    q``."""
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)  # kv head
    b = tl.program_id(2)
    k_start = pid_n * BLOCK_N
    k_idx = k_start + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    k = load_tile(K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
                  + k_idx[:, None].to(tl.int64) * stride_ks + offs_d[None, :], k_idx, Sk, offs_d, HEAD_DIM, BLOCK_D, True)
    v = load_tile(V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
                  + k_idx[:, None].to(tl.int64) * stride_vs + offs_dv[None, :], k_idx, Sk, offs_dv, V_DIM, BLOCK_DV,
                  True)
    KeyMask_b = KeyMask + b * Sk
    SegK_b = SegK + b * Sk
    SegQ_b = SegQ + b * Sq
    q_offsets = offs_m[:, None] * stride_qs + offs_d[None, :]
    do_offsets = offs_m[:, None] * stride_dos + offs_dv[None, :]
    qk_scale = scale * _LOG2E

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # Queries at position p see keys [p - left, p + right], so a key at position k is seen by queries
    # [k - right, k + left]: the same band helper with the bounds swapped.
    lo, full_lo, full_hi, hi = _band_tiles(k_offset + k_start, k_offset + tl.minimum(k_start + BLOCK_N, Sk) - 1,
                                           q_offset, Sq, right, left, chunk, BLOCK_M, HAS_RIGHT, HAS_LEFT,
                                           HAS_CHUNK)
    if HAS_SEG:
        seg_k = tl.load(SegK + b * Sk + k_idx, mask=k_idx < Sk, other=0)
        lo, full_lo, full_hi, hi = _document_tiles(lo, full_lo, full_hi, hi, seg_k, k_idx < Sk, SegQ + b * Sq, Sq,
                                                   SegSorted, b, BLOCK_M)
    Q_b = Q + b.to(tl.int64) * stride_qb
    DO_b = DO + b.to(tl.int64) * stride_dob
    Lse_b = Lse + b.to(tl.int64) * num_heads * Sq
    Delta_b = Delta + b.to(tl.int64) * num_heads * Sq
    first_head = hk * kv_group
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(Seed)
    drop_bh = b * 65536 + drop_head_offset  # the dropout hash's b * 2**16 + h is drop_bh + (query head)
    for phase in tl.static_range(3):
        start, end = _phase_tiles(lo, full_lo, full_hi, hi, phase)
        dk, dv = _dkdv_query_tiles(dk, dv, k, v, k_idx, Q_b, DO_b, Lse_b, Delta_b, SegQ_b, KeyMask_b, SegK_b,
                                   q_offsets, do_offsets, start, end, first_head, kv_group, stride_qh, stride_qs,
                                   stride_doh, stride_dos, Sq, Sk, q_offset, k_offset, left, right, chunk, qk_scale,
                                   qk_cap, Alibi, seed, drop_bh, drop_threshold, drop_scale, HEAD_DIM, BLOCK_D, V_DIM,
                                   BLOCK_DV, BLOCK_M, phase != 1, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_KEY_MASK,
                                   HAS_SEG, SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)

    store_tile(DK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
               + k_idx[:, None].to(tl.int64) * stride_dks + offs_d[None, :], dk * scale, k_idx, Sk, offs_d, HEAD_DIM)
    if HAS_DROPOUT:  # the kept probabilities times 1 / (1 - p)
        dv = dv * drop_scale
    store_tile(DV + b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh
               + k_idx[:, None].to(tl.int64) * stride_dvs + offs_dv[None, :], dv, k_idx, Sk, offs_dv, V_DIM)


@triton.jit
def _dq_key_tiles(dq, q, do, lse2, delta, q_idx, seg_q, K_head, V_head, KeyMask, SegK, k_offsets, v_offsets,
                  start, end, stride_ks, stride_vs, Sk, q_offset, k_offset, left, right, chunk, qk_scale, qk_cap,
                  slope2, row_hash, drop_threshold, drop_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
                  HAS_SEG: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Accumulate dq (unscaled) of one query tile over the key tiles starting in [start, end). The ALiBi
    bias (``slope2``, as in ``_fwd_key_tiles``) is a constant of the scores: it only enters p. With dropout,
    ``out = sum_j p_j z_j v_j`` (z 0 or ``drop_scale``), so dP is ``(dout . v_j) * z_j``."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        k_idx = start_n + offs_n
        k = load_tile(K_head + tl.cast(start_n, tl.int64) * stride_ks + k_offsets, k_idx, Sk, offs_d,
                      HEAD_DIM, BLOCK_D, PARTIAL)
        v = load_tile(V_head + tl.cast(start_n, tl.int64) * stride_vs + v_offsets, k_idx, Sk, offs_dv,
                      V_DIM, BLOCK_DV, PARTIAL)
        s, tanh = _tile_scores(q, k, q_idx, k_idx, seg_q, KeyMask, SegK, Sk, q_offset, k_offset, left, right, chunk,
                               qk_scale, qk_cap, slope2, 0, PARTIAL, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_KEY_MASK,
                               HAS_SEG, SOFTCAP, HAS_ALIBI, DOT_PRECISION)
        p = tl.exp2(s - lse2[:, None])
        dp = _dot(do, tl.trans(v), None, DOT_PRECISION)
        if HAS_DROPOUT:
            dp = tl.where(_dropout_keep(row_hash, k_offset + k_idx, drop_threshold, 0), dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - tanh * tanh)
        dq = _dot(ds.to(k.dtype), k, dq, DOT_PRECISION)
    return dq


@triton.autotune(configs=configs("dq"), key=TUNING_KEY,
                 prune_configs_by={"early_config_prune": pruner("dq")})
@triton.jit(do_not_specialize=RUNTIME_INTS)
def _attn_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, KeyMask, SegQ, SegK, SegSorted, Alibi, Seed,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh, stride_dqs,
    num_heads, kv_group, Sq, Sk, q_offset, k_offset, left, right, chunk, scale, qk_cap, SQ_BUCKET, SK_BUCKET,
    drop_head_offset, drop_threshold, drop_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr,
    HAS_KEY_MASK: tl.constexpr, HAS_SEG: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dq of one query tile: with the final lse and ``delta = rowsum(dout * out)``, per visible key tile
    ``p = exp(s - lse)`` (``s`` the scaled, capped, biased scores), ``dp = (dout v^T) z`` (``z`` the dropout
    factors, 1 without dropout), ``ds = p (dp - delta)`` (times ``1 - tanh^2`` of the cap when soft-capped) and
    ``dq += scale * ds k``."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (causal) query tiles first
    h = tl.program_id(1)
    b = tl.program_id(2)
    row = (b * num_heads + h).to(tl.int64) * Sq  # this (batch, head)'s rows of lse / delta
    hk = h // kv_group
    q_start = pid_m * BLOCK_M
    q_idx = q_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q = load_tile(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
                  + q_idx[:, None].to(tl.int64) * stride_qs + offs_d[None, :], q_idx, Sq, offs_d, HEAD_DIM, BLOCK_D, True)
    do = load_tile(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
                   + q_idx[:, None].to(tl.int64) * stride_dos + offs_dv[None, :], q_idx, Sq, offs_dv,
                   V_DIM, BLOCK_DV, True).to(q.dtype)
    lse2, delta = _load_row_stats(Lse + row, Delta + row, q_idx, Sq, True)
    seg_q = q_idx
    if HAS_SEG:
        seg_q = tl.load(SegQ + b * Sq + q_idx, mask=q_idx < Sq, other=0)
    K_head = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    V_head = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    KeyMask_b = KeyMask + b * Sk
    SegK_b = SegK + b * Sk
    k_offsets = offs_n[:, None] * stride_ks + offs_d[None, :]
    v_offsets = offs_n[:, None] * stride_vs + offs_dv[None, :]
    qk_scale = scale * _LOG2E
    slope2, row_hash = _query_terms(Alibi, Seed, b, h, drop_head_offset, q_offset, q_idx, HAS_ALIBI, HAS_DROPOUT)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _query_key_tiles(q_start, q_idx, seg_q, q_offset, Sq, k_offset, Sk, left, right, chunk,
                                                SegK_b, SegSorted, b, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                                                HAS_SEG)
    for phase in tl.static_range(3):
        start, end = _phase_tiles(lo, full_lo, full_hi, hi, phase)
        dq = _dq_key_tiles(dq, q, do, lse2, delta, q_idx, seg_q, K_head, V_head, KeyMask_b, SegK_b, k_offsets,
                           v_offsets, start, end, stride_ks, stride_vs, Sk, q_offset, k_offset, left, right, chunk,
                           qk_scale, qk_cap, slope2, row_hash, drop_threshold, drop_scale, HEAD_DIM, BLOCK_D, V_DIM,
                           BLOCK_DV, BLOCK_N, phase != 1, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_KEY_MASK, HAS_SEG,
                           SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
    store_tile(DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
               + q_idx[:, None].to(tl.int64) * stride_dqs + offs_d[None, :], dq * scale, q_idx, Sq, offs_d, HEAD_DIM)


def _delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    batch, heads, sq, head_dim = out.shape
    delta = torch.empty((batch, heads, sq), dtype=torch.float32, device=out.device)
    block_d = padded_dim(head_dim)
    block_m = row_block(block_d)
    _attn_bwd_delta_kernel[(triton.cdiv(sq, block_m), heads, batch)](
        out, dout, delta, out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        heads, sq, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
    )
    return delta


def _backward(p: _Problem, dout, out, lse, delta, grad_dtype: torch.dtype):
    batch, heads, kv_heads, sq, sk, head_dim = p.shape
    device = p.q.device
    check_like("dout", dout, p.out_shape, device)
    check_like("lse", lse, (batch, heads, sq), device)
    dq, dk, dv = (aligned_empty(x.shape, grad_dtype, device) for x in (p.q, p.k, p.v))
    if p.hidden or sk == 0 or dq.numel() == 0:  # no visible pair: all gradients are 0
        return dq.zero_().contiguous(), dk.zero_().contiguous(), dv.zero_().contiguous()
    dout = aligned_rows(dout)
    if delta is None:
        check_like("out", out, p.out_shape, device)
        delta = _delta(aligned_rows(out), dout)
    else:
        check_like("delta", delta, (batch, heads, sq), device)
        delta = delta.float().contiguous()
    lse = lse.float().contiguous()
    common = dict(Q=p.q, K=p.k, V=p.v, DO=dout, Lse=lse, Delta=delta, **_strides("q", p.q), **_strides("k", p.k),
                  **_strides("v", p.v), **_strides("do", dout), **_kernel_args(p))
    _attn_bwd_dkdv_kernel[lambda meta: (triton.cdiv(sk, meta["BLOCK_N"]), kv_heads, batch)](
        DK=dk, DV=dv, **_strides("dk", dk), **_strides("dv", dv), **common)
    _attn_bwd_dq_kernel[lambda meta: (triton.cdiv(sq, meta["BLOCK_M"]), heads, batch)](
        DQ=dq, **_strides("dq", dq), **common)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()
