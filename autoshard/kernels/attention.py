"""Triton attention kernels for one (query block, key block) pair at global offsets, with natural-log LSE.

One kernel family serves every ring step: the caller passes the GLOBAL position of the first query row
(``q_offset``) and of the first key column (``k_offset``), and every mask is evaluated from positions
inside the kernel, never materialized (the contract of :func:`autoshard.runtime.attention.local.local_attention`):

- causal ``j_pos <= i_pos``; window ``(left, right)``: ``i_pos - left <= j_pos <= i_pos + right``
  (``-1`` = unbounded). Both are one *band* ``i_pos - L <= j_pos <= i_pos + R`` with ``R = min(right, 0)``
  under causal; the host drops a bound no pair of this block can violate and skips a block the band
  hides entirely, so a ring step whose keys all lie in the past runs the unmasked specialization.
- chunked local attention ``chunk=C`` (Llama-4): ``i_pos // C == j_pos // C``. Each tile narrows its range
  of the other axis to the chunks of its own rows (``_band_tiles``: a chunk mask is block-diagonal, so tiles
  outside those chunks are never loaded), fully visible tiles exist only for a tile inside one chunk, and
  tiles that straddle a chunk boundary are masked from positions. The host drops the chunk when the whole
  block lies in one chunk and skips a block whose queries and keys share no chunk.
- ``key_mask`` ``[B, Sk]`` (True = may be attended) and ``segment_ids`` ``(seg_q [B, Sq], seg_k [B, Sk])``.

Soft-capping (``softcap > 0``, Gemma2): the scaled scores ``s`` become ``softcap * tanh(s / softcap)``
before the mask. The kernels cap the raw ``q.k`` tile with ``qk_cap = softcap / scale`` (``_soft_cap``), so
the scale and the base-2 softmax that follow are unchanged; the backward recomputes the tanh and
multiplies ``dS`` by ``1 - tanh^2``. ``SOFTCAP`` is a compile-time flag: kernels without a cap are the
same code as before. (The autotuner's register estimates were calibrated without the cap; the
backward's extra tanh tile is not in them.)

ALiBi (``alibi_slopes`` float32 [H], one slope per QUERY head; Bloom, MPT, Falcon): every score gets
``slope[h] * (j_pos - i_pos)`` from GLOBAL positions, added after the cap and before the mask, so ring steps
need nothing but their offsets; lse includes the bias. In the kernels' base-2 domain the bias is
``slope * log2(e) * (j_pos - i_pos)`` (``_alibi_bias``); the backward recomputes it (it is a constant: no
gradient for the slopes, dS unchanged). ``HAS_ALIBI`` is a compile-time flag: kernels without it are the
same code as before. (Nor is the bias tile in the autotuner's register estimates.)

Dropout (``dropout_p > 0`` with ``dropout_seed``, a 0-d int64 tensor on q's device read in the kernels, and
``dropout_head_offset``): the probabilities are dropped by the counter-based hash of
:mod:`autoshard.runtime.attention.dropout` (seed, ``b * 2**16 + dropout_head_offset + h``, ``q_offset + i``,
``k_offset + j``), the same mask bit for bit as the torch path's ``AttentionDropout.keep``; it is computed in
uint32 arithmetic by one shared helper (``_dropout_row_hash`` once per query row, ``_dropout_keep`` per tile) in the
forward, the dk/dv and the dq kernels. The row normalization and lse are of the probabilities before dropout:
``out = sum_j p_ij z_ij v_j`` with ``z`` 0 or ``1 / (1 - p)``; the backward takes ``dv += (p z)^T dout``,
``dP = (dout v^T) z`` and ``dS = P (dP - delta)`` as before. ``HAS_DROPOUT`` is a compile-time flag: kernels
without it are the same code as before (the autotuner counts the hash tile like a data mask).

Kernels (``@triton.jit`` functions below; ``_forward`` / ``_backward`` launch them on a grid of (tile, head,
batch) programs; the LSE merge that combines ring steps is :mod:`.merge`, the autotuning policy :mod:`.autotune`,
and the tile loads and block sizes they share :mod:`.common`):

- ``_attn_fwd_kernel``: one program per (query tile, batch*head). It walks the key tiles in three
  phases from ``_band_tiles``: band-edge tiles [lo, full_lo), fully visible tiles [full_lo, full_hi)
  and band-edge / ragged-tail tiles [full_hi, hi). Tiles outside [lo, hi) are never loaded. Fully
  visible tiles skip the position arithmetic and the bounds checks (and, without key_mask / segment
  ids, all masking). Online softmax in base 2 (``exp2`` with ``log2(e)`` folded into the scale), fp32
  accumulation; a row with no visible key gives out 0 and lse -inf without NaN.
- ``_attn_bwd_delta_kernel``: ``delta = rowsum(dout * out)`` (skipped when the caller passes delta).
- ``_attn_bwd_dkdv_kernel``: one program per (key tile, batch*kv head), looping over the query heads
  of its GQA group and over the query tiles the band lets see it (same three phases, mirrored), so
  dk/dv of a kv head are summed in registers: no atomics, deterministic.
- ``_attn_bwd_dq_kernel``: one program per (query tile, batch*head) over the same key tiles as the
  forward. The backward uses the FINAL (merged) out / lse, so a ring step's dq/dk/dv for a key block
  that is not local are exactly that block's share and the caller can accumulate them.

Shared ``@triton.jit`` helpers keep the forward and the two backward kernels from duplicating logic:
``_band_tiles`` (which tiles to visit, which are fully visible), ``_document_tiles`` (packed documents: when a
batch row's segment ids are sorted, the range narrows to the other axis' positions whose ids lie within the
tile's, found by a binary search of the ids, so the tiles of other documents are never loaded), ``_tile_visibility``
(the tile mask from positions, key_mask and segment ids, for either orientation) and :func:`.common.load_tile`.

Shapes: q [B, H, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] with H % Hkv == 0 (GQA / MQA). The value head
dim Dv may differ from the query / key head dim D (MLA, e.g. DeepSeek-V3's D = 192, Dv = 128): out, dout and
dv are [.., Dv], dq and dk [.., D]. Tiles of q / k / dq / dk have ``BLOCK_D`` columns and tiles of v / out /
dout / dv ``BLOCK_DV``; when Dv == D the two are one constant and the kernels are the same code.

Specialization: both head dims (each padded to a power of two >= 16; any head dim up to 256 works, columns past
it are masked), the band and chunk flags, key_mask / segment presence, soft-capping, ALiBi, dropout and the input
dtype are compile-time constants. Offsets, band widths, sequence lengths and the dropout's head offset and threshold
are runtime values excluded from Triton's integer specialization, so ring steps reuse one compiled kernel. Block
sizes / warps / stages are autotuned per (head dims, bucketed sequence lengths, mask kind, dtype), pruned to
configurations whose shared memory and register estimates fit the device (:mod:`.autotune`).

Precision: fp16 / bf16 inputs use tensor-core dots (wgmma on Hopper) with fp32 accumulation; fp32
inputs use exact ``input_precision="ieee"`` dots (no tf32) on small tiles, a correctness path that
matches a float64 reference to ~1e-6. Outputs of the contract functions are float32;
``TritonAttentionFunction`` (single-block use) writes out and the gradients in the input dtype.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .autotune import RUNTIME_INTS, TUNING_KEY, configs, pruner, seq_bucket
from .common import (INTERPRET, check_like, last_dim_contiguous, load_tile, padded_dim, row_block, store_tile,
                     triton_available)

__all__ = [
    "MAX_HEAD_DIM",
    "TritonAttentionFunction",
    "triton_attention",
    "triton_attention_backward",
    "triton_attention_forward",
]

MAX_HEAD_DIM = 256
_MAX_POSITION = 1 << 30  # positions and band widths stay far from int32 overflow inside the kernels
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)





# ----------------------------------------------------------------------------------------------------
# Shared @triton.jit helpers.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _band_tiles(first_pos, last_pos, other_offset, other_len, before, after, chunk,
                BLOCK: tl.constexpr, HAS_BEFORE: tl.constexpr, HAS_AFTER: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """Tiles of the other axis seen by rows at global positions [first_pos, last_pos].

    A row at position p sees other-axis positions [p - before, p + after] (a missing bound is
    unbounded) and, with HAS_CHUNK, only those of its own chunk [p // chunk * chunk, (p // chunk + 1) *
    chunk): the rows see the chunks from first_pos's to last_pos's, and fully visible tiles exist only
    when the rows lie in one chunk. Returns (lo, full_lo, full_hi, hi), local indices of the other axis,
    lo/full_lo/full_hi multiples of BLOCK: tiles starting in [lo, hi) hold every visible pair, and the tiles
    [full_lo, full_hi) lie inside the band for every row and inside [0, other_len).
    """
    lo = 0
    full_lo = 0
    hi = other_len
    full_hi = other_len // BLOCK * BLOCK
    if HAS_BEFORE:
        lo = tl.maximum(first_pos - before - other_offset, 0)
        full_lo = (tl.maximum(last_pos - before - other_offset, 0) + BLOCK - 1) // BLOCK * BLOCK
    if HAS_AFTER:
        hi = tl.minimum(tl.maximum(last_pos + after - other_offset + 1, 0), other_len)
        full_hi = tl.minimum(full_hi, tl.maximum(first_pos + after - other_offset + 1, 0) // BLOCK * BLOCK)
    if HAS_CHUNK:
        chunk_lo = first_pos // chunk * chunk - other_offset  # the first row's chunk starts here
        chunk_hi = (last_pos // chunk + 1) * chunk - other_offset  # the last row's chunk ends before here
        lo = tl.maximum(lo, chunk_lo)
        hi = tl.minimum(hi, tl.maximum(chunk_hi, 0))
        full_lo = tl.maximum(full_lo, (tl.maximum(chunk_lo, 0) + BLOCK - 1) // BLOCK * BLOCK)
        one_chunk = first_pos // chunk == last_pos // chunk
        full_hi = tl.where(one_chunk, tl.minimum(full_hi, tl.maximum(chunk_hi, 0) // BLOCK * BLOCK), 0)
    visible = lo < hi
    lo = lo // BLOCK * BLOCK
    hi = tl.where(visible, hi, lo)  # nothing visible: every range below is empty
    hi_tiles = (hi + BLOCK - 1) // BLOCK * BLOCK
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi_tiles)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi_tiles)
    return lo, full_lo, full_hi, hi


@triton.jit
def _search(Seg, n, value, AFTER: tl.constexpr):
    """The first index of the sorted ids ``Seg[0:n)`` holding an id ``>= value`` (``> value`` with AFTER); n if
    none. A binary search of scalar loads."""
    lo = n * 0
    hi = n + 0
    while lo < hi:
        mid = (lo + hi) // 2
        found = tl.load(Seg + mid)
        if AFTER:
            right = found <= value
        else:
            right = found < value
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _document_tiles(lo, full_lo, full_hi, hi, seg_rows, rows_valid, SegOther, other_len, Sorted, b,
                    BLOCK: tl.constexpr):
    """Narrow a tile range from :func:`_band_tiles` to the other axis' positions whose segment ids lie between the
    rows' smallest and largest id (packed documents: the tiles of other documents are never visited). Only when
    this batch row's ids are sorted on both axes (``Sorted[b]``, computed on the device by the launcher);
    otherwise the range is unchanged and the ids mask every tile."""
    first_valid = tl.max(tl.where(rows_valid, seg_rows, tl.min(seg_rows, 0)), 0)  # any valid row's id
    ids = tl.where(rows_valid, seg_rows, first_valid)
    doc_lo = _search(SegOther, other_len, tl.min(ids, 0), False)
    doc_hi = _search(SegOther, other_len, tl.max(ids, 0), True)
    narrow = tl.load(Sorted + b) != 0
    new_lo = tl.where(narrow, tl.maximum(lo, doc_lo // BLOCK * BLOCK), lo)
    new_hi = tl.where(narrow, tl.minimum(hi, doc_hi), hi)
    new_hi = tl.where(new_lo < new_hi, new_hi, new_lo)
    hi_tiles = (new_hi + BLOCK - 1) // BLOCK * BLOCK
    full_lo = tl.minimum(tl.maximum(full_lo, new_lo), hi_tiles)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi_tiles)
    return new_lo, full_lo, full_hi, new_hi


@triton.jit
def _tile_visibility(q_idx, k_idx, q_offset, k_offset, Sk, left, right, chunk, seg_q, KeyMask, SegK,
                     Q_AXIS: tl.constexpr, PARTIAL: tl.constexpr, HAS_LEFT: tl.constexpr,
                     HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
                     HAS_SEG: tl.constexpr):
    """Boolean tile mask: queries along axis Q_AXIS (0: [queries, keys], 1: [keys, queries]).

    PARTIAL tiles check key bounds, the band and the chunks from positions; key_mask / segment ids apply to
    every tile where present. KeyMask / SegK point at this batch row; seg_q holds the query segments.
    """
    visible = tl.expand_dims(k_idx < Sk, Q_AXIS)
    if PARTIAL:
        q_pos = tl.expand_dims(q_offset + q_idx, 1 - Q_AXIS)
        k_pos = tl.expand_dims(k_offset + k_idx, Q_AXIS)
        if HAS_RIGHT:
            visible = visible & (k_pos <= q_pos + right)
        if HAS_LEFT:
            visible = visible & (k_pos >= q_pos - left)
        if HAS_CHUNK:  # positions are >= 0: // is the floor
            visible = visible & (k_pos // chunk == q_pos // chunk)
    if HAS_KEY_MASK:
        key_ok = tl.load(KeyMask + k_idx, mask=k_idx < Sk, other=0) != 0
        visible = visible & tl.expand_dims(key_ok, Q_AXIS)
    if HAS_SEG:
        seg_k = tl.load(SegK + k_idx, mask=k_idx < Sk, other=0)
        visible = visible & (tl.expand_dims(seg_q, 1 - Q_AXIS) == tl.expand_dims(seg_k, Q_AXIS))
    return visible


@triton.jit
def _soft_cap(qk, qk_cap):
    """``(qk_cap * tanh(qk / qk_cap), tanh(qk / qk_cap))`` of raw ``q.k`` scores. ``qk_cap`` is the cap divided
    by the scale, so the capped raw scores times the scale are the capped scaled scores. tanh is written
    with exp2 (libdevice's tanh does not run under TRITON_INTERPRET): ``1 - 2 / (exp(2x) + 1)`` goes to +-1
    for large ``|x|`` without overflowing into NaN."""
    tanh = 1.0 - 2.0 / (tl.exp2(qk * (2.0 * _LOG2E / qk_cap)) + 1.0)
    return qk_cap * tanh, tanh


@triton.jit
def _alibi_bias(slope2, q_idx, k_idx, q_offset, k_offset, Q_AXIS: tl.constexpr):
    """ALiBi bias tile in the base-2 domain: ``slope2 * (k_pos - q_pos)`` from GLOBAL positions, with
    ``slope2 = slope * log2(e)`` (the scores are ``s * log2(e)``). Queries along axis Q_AXIS, as in
    ``_tile_visibility``. Positions are < 2**30 in magnitude, so the int32 difference cannot overflow."""
    q_pos = tl.expand_dims(q_offset + q_idx, 1 - Q_AXIS)
    k_pos = tl.expand_dims(k_offset + k_idx, Q_AXIS)
    return slope2 * (k_pos - q_pos).to(tl.float32)


@triton.jit
def _fmix32(x):
    """MurmurHash3's 32-bit finalizer of a uint32 tensor: logical shifts, multiplication modulo 2**32 (the
    constants are >= 2**31, so Triton types them uint32: nothing is promoted to int64)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _dropout_row_hash(seed, batch_head, q_pos):
    """The first two rounds of the dropout hash (:mod:`autoshard.runtime.attention.dropout`), uint32 per query:
    ``fmix32(fmix32(seed + batch_head * 0x9E3779B9) ^ (q_pos * 0x85EBCA77))``, ``batch_head = b * 2**16 + h``
    (``h`` the global query head), ``q_pos`` the global query positions; all modulo 2**32 (int casts to uint32
    keep the low 32 bits, as the torch reference's ``& 0xFFFFFFFF``)."""
    x = _fmix32(seed.to(tl.uint32) + batch_head.to(tl.uint32) * 0x9E3779B9)
    return _fmix32(x ^ (q_pos.to(tl.uint32) * 0x85EBCA77))


@triton.jit
def _query_terms(Alibi, Seed, b, h, drop_head_offset, q_offset, q_idx, HAS_ALIBI: tl.constexpr,
                 HAS_DROPOUT: tl.constexpr):
    """``(slope2, row_hash)`` of a program's query rows (one query head): the head's ALiBi slope in base 2 (0.0
    without ALiBi) and the rows' part of the dropout hash (the rows themselves without dropout), once per
    program of the forward and the dq kernels."""
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(Alibi + h) * _LOG2E
    row_hash = q_idx
    if HAS_DROPOUT:
        row_hash = _dropout_row_hash(tl.load(Seed), b * 65536 + drop_head_offset + h, q_offset + q_idx)
    return slope2, row_hash


@triton.jit
def _dropout_keep(row_hash, k_pos, threshold, Q_AXIS: tl.constexpr):
    """Keep mask (True = kept) of a tile from its queries' ``_dropout_row_hash`` and the keys' global positions:
    ``(fmix32(row_hash ^ (k_pos * 0xC2B2AE3D)) >> 8) >= threshold`` with ``threshold = round(p * 2**24)``.
    Queries along axis Q_AXIS, as in ``_tile_visibility``. The one shared definition of the mask: the forward,
    the dk/dv and the dq kernels all call it, so the backward drops exactly what the forward dropped."""
    k_hash = k_pos.to(tl.uint32) * 0xC2B2AE3D
    x = _fmix32(tl.expand_dims(row_hash, 1 - Q_AXIS) ^ tl.expand_dims(k_hash, Q_AXIS))
    return (x >> 8).to(tl.int32) >= threshold


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    """tl.dot with fp32 accumulation. DOT_PRECISION "ieee" (fp32 inputs), "tf32" (ignored for 16-bit
    inputs), or "upcast": bf16 under TRITON_INTERPRET, whose dot multiplies bf16 bit patterns as
    integers (Triton 3.9), so the operands go through fp32; bf16 products are exact in fp32, so this
    matches the tensor-core result up to summation order."""
    if DOT_PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


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


# ----------------------------------------------------------------------------------------------------
# Forward.
# ----------------------------------------------------------------------------------------------------


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
        qk = _dot(q, tl.trans(k), None, DOT_PRECISION)
        if SOFTCAP:
            qk, _ = _soft_cap(qk, qk_cap)
        if PARTIAL or HAS_KEY_MASK or HAS_SEG:
            visible = _tile_visibility(q_idx, k_idx, q_offset, k_offset, Sk, left, right, chunk, seg_q, KeyMask, SegK,
                                       0, PARTIAL, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_KEY_MASK, HAS_SEG)
            if HAS_ALIBI:
                s = tl.where(visible, qk * qk_scale + _alibi_bias(slope2, q_idx, k_idx, q_offset, k_offset, 0),
                             float("-inf"))
            else:
                s = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            p = tl.exp2(s - m_ref[:, None])
        elif HAS_ALIBI:
            s = qk * qk_scale + _alibi_bias(slope2, q_idx, k_idx, q_offset, k_offset, 0)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = m_new
            p = tl.exp2(s - m_ref[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_ref = m_new
            p = tl.exp2(qk * qk_scale - m_ref[:, None])
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
    lo, full_lo, full_hi, hi = _band_tiles(q_offset + q_start, q_offset + tl.minimum(q_start + BLOCK_M, Sq) - 1,
                                           k_offset, Sk, left, right, chunk, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                                           HAS_CHUNK)
    if HAS_SEG:
        lo, full_lo, full_hi, hi = _document_tiles(lo, full_lo, full_hi, hi, seg_q, q_idx < Sq, SegK_b, Sk,
                                                   SegSorted, b, BLOCK_N)
    acc, m_i, l_i = _fwd_key_tiles(acc, m_i, l_i, q, q_idx, seg_q, K_head, V_head, KeyMask_b, SegK_b,
                                   k_offsets, v_offsets, lo, full_lo, stride_ks, stride_vs, Sk, q_offset,
                                   k_offset, left, right, chunk, qk_scale, qk_cap, slope2, row_hash, drop_threshold,
                                   HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                                   HAS_KEY_MASK, HAS_SEG, SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
    acc, m_i, l_i = _fwd_key_tiles(acc, m_i, l_i, q, q_idx, seg_q, K_head, V_head, KeyMask_b, SegK_b,
                                   k_offsets, v_offsets, full_lo, full_hi, stride_ks, stride_vs, Sk, q_offset,
                                   k_offset, left, right, chunk, qk_scale, qk_cap, slope2, row_hash, drop_threshold,
                                   HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV, BLOCK_N, False, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                                   HAS_KEY_MASK, HAS_SEG, SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
    acc, m_i, l_i = _fwd_key_tiles(acc, m_i, l_i, q, q_idx, seg_q, K_head, V_head, KeyMask_b, SegK_b,
                                   k_offsets, v_offsets, full_hi, hi, stride_ks, stride_vs, Sk, q_offset,
                                   k_offset, left, right, chunk, qk_scale, qk_cap, slope2, row_hash, drop_threshold,
                                   HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV, BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_CHUNK,
                                   HAS_KEY_MASK, HAS_SEG, SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)

    has_keys = l_i > 0.0
    l_ref = tl.where(has_keys, l_i, 1.0)
    out = acc / l_ref[:, None]  # acc is 0 where nothing was visible
    if HAS_DROPOUT:  # the kept probabilities times 1 / (1 - p)
        out = out * drop_scale
    lse = tl.where(has_keys, (m_i + tl.log2(l_ref)) * _LN2, float("-inf"))
    O_head = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    store_tile(O_head + q_idx[:, None].to(tl.int64) * stride_os + offs_dv[None, :], out, q_idx, Sq, offs_dv, V_DIM)
    tl.store(Lse + row + q_idx, lse, mask=q_idx < Sq)


# ----------------------------------------------------------------------------------------------------
# Backward.
# ----------------------------------------------------------------------------------------------------


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
        qk_t = _dot(k, tl.trans(q), None, DOT_PRECISION)  # [keys, queries]
        if SOFTCAP:
            qk_t, tanh_t = _soft_cap(qk_t, qk_cap)
        if PARTIAL or HAS_KEY_MASK or HAS_SEG:
            seg_q = q_idx
            if HAS_SEG:
                seg_q = tl.load(SegQ_b + q_idx, mask=q_idx < Sq, other=0)
            visible = _tile_visibility(q_idx, k_idx, q_offset, k_offset, Sk, left, right, chunk, seg_q, KeyMask, SegK,
                                       1, PARTIAL, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_KEY_MASK, HAS_SEG)
            if HAS_ALIBI:
                s_t = qk_t * qk_scale + _alibi_bias(tl.load(Alibi + h) * _LOG2E, q_idx, k_idx, q_offset, k_offset, 1)
                p_t = tl.exp2(tl.where(visible, s_t, float("-inf")) - lse2[None, :])
            else:
                p_t = tl.exp2(tl.where(visible, qk_t * qk_scale, float("-inf")) - lse2[None, :])
        elif HAS_ALIBI:
            s_t = qk_t * qk_scale + _alibi_bias(tl.load(Alibi + h) * _LOG2E, q_idx, k_idx, q_offset, k_offset, 1)
            p_t = tl.exp2(s_t - lse2[None, :])
        else:
            p_t = tl.exp2(qk_t * qk_scale - lse2[None, :])
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
    dk, dv = _dkdv_query_tiles(dk, dv, k, v, k_idx, Q_b, DO_b, Lse_b, Delta_b, SegQ_b, KeyMask_b, SegK_b,
                               q_offsets, do_offsets, lo, full_lo, first_head, kv_group, stride_qh, stride_qs,
                               stride_doh, stride_dos, Sq, Sk, q_offset, k_offset, left, right, chunk, qk_scale, qk_cap,
                               Alibi, seed, drop_bh, drop_threshold, drop_scale, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV,
                               BLOCK_M, True, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_KEY_MASK, HAS_SEG, SOFTCAP, HAS_ALIBI,
                               HAS_DROPOUT, DOT_PRECISION)
    dk, dv = _dkdv_query_tiles(dk, dv, k, v, k_idx, Q_b, DO_b, Lse_b, Delta_b, SegQ_b, KeyMask_b, SegK_b,
                               q_offsets, do_offsets, full_lo, full_hi, first_head, kv_group, stride_qh, stride_qs,
                               stride_doh, stride_dos, Sq, Sk, q_offset, k_offset, left, right, chunk, qk_scale, qk_cap,
                               Alibi, seed, drop_bh, drop_threshold, drop_scale, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV,
                               BLOCK_M, False, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_KEY_MASK, HAS_SEG, SOFTCAP,
                               HAS_ALIBI, HAS_DROPOUT, DOT_PRECISION)
    dk, dv = _dkdv_query_tiles(dk, dv, k, v, k_idx, Q_b, DO_b, Lse_b, Delta_b, SegQ_b, KeyMask_b, SegK_b,
                               q_offsets, do_offsets, full_hi, hi, first_head, kv_group, stride_qh, stride_qs,
                               stride_doh, stride_dos, Sq, Sk, q_offset, k_offset, left, right, chunk, qk_scale, qk_cap,
                               Alibi, seed, drop_bh, drop_threshold, drop_scale, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV,
                               BLOCK_M, True, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_KEY_MASK, HAS_SEG, SOFTCAP, HAS_ALIBI,
                               HAS_DROPOUT, DOT_PRECISION)

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
        qk = _dot(q, tl.trans(k), None, DOT_PRECISION)
        if SOFTCAP:
            qk, tanh = _soft_cap(qk, qk_cap)
        if PARTIAL or HAS_KEY_MASK or HAS_SEG:
            visible = _tile_visibility(q_idx, k_idx, q_offset, k_offset, Sk, left, right, chunk, seg_q, KeyMask, SegK,
                                       0, PARTIAL, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_KEY_MASK, HAS_SEG)
            if HAS_ALIBI:
                s = qk * qk_scale + _alibi_bias(slope2, q_idx, k_idx, q_offset, k_offset, 0)
                p = tl.exp2(tl.where(visible, s, float("-inf")) - lse2[:, None])
            else:
                p = tl.exp2(tl.where(visible, qk * qk_scale, float("-inf")) - lse2[:, None])
        elif HAS_ALIBI:
            p = tl.exp2(qk * qk_scale + _alibi_bias(slope2, q_idx, k_idx, q_offset, k_offset, 0) - lse2[:, None])
        else:
            p = tl.exp2(qk * qk_scale - lse2[:, None])
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
    lo, full_lo, full_hi, hi = _band_tiles(q_offset + q_start, q_offset + tl.minimum(q_start + BLOCK_M, Sq) - 1,
                                           k_offset, Sk, left, right, chunk, BLOCK_N, HAS_LEFT, HAS_RIGHT,
                                           HAS_CHUNK)
    if HAS_SEG:
        lo, full_lo, full_hi, hi = _document_tiles(lo, full_lo, full_hi, hi, seg_q, q_idx < Sq, SegK_b, Sk,
                                                   SegSorted, b, BLOCK_N)
    dq = _dq_key_tiles(dq, q, do, lse2, delta, q_idx, seg_q, K_head, V_head, KeyMask_b, SegK_b, k_offsets, v_offsets,
                       lo, full_lo, stride_ks, stride_vs, Sk, q_offset, k_offset, left, right, chunk, qk_scale, qk_cap,
                       slope2, row_hash, drop_threshold, drop_scale, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV,
                       BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_KEY_MASK, HAS_SEG, SOFTCAP, HAS_ALIBI,
                       HAS_DROPOUT, DOT_PRECISION)
    dq = _dq_key_tiles(dq, q, do, lse2, delta, q_idx, seg_q, K_head, V_head, KeyMask_b, SegK_b, k_offsets, v_offsets,
                       full_lo, full_hi, stride_ks, stride_vs, Sk, q_offset, k_offset, left, right, chunk, qk_scale,
                       qk_cap, slope2, row_hash, drop_threshold, drop_scale, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV,
                       BLOCK_N, False, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_KEY_MASK, HAS_SEG, SOFTCAP, HAS_ALIBI,
                       HAS_DROPOUT, DOT_PRECISION)
    dq = _dq_key_tiles(dq, q, do, lse2, delta, q_idx, seg_q, K_head, V_head, KeyMask_b, SegK_b, k_offsets, v_offsets,
                       full_hi, hi, stride_ks, stride_vs, Sk, q_offset, k_offset, left, right, chunk, qk_scale, qk_cap,
                       slope2, row_hash, drop_threshold, drop_scale, HEAD_DIM, BLOCK_D, V_DIM, BLOCK_DV,
                       BLOCK_N, True, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_KEY_MASK, HAS_SEG, SOFTCAP, HAS_ALIBI,
                       HAS_DROPOUT, DOT_PRECISION)
    store_tile(DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
               + q_idx[:, None].to(tl.int64) * stride_dqs + offs_d[None, :], dq * scale, q_idx, Sq, offs_d, HEAD_DIM)


# ----------------------------------------------------------------------------------------------------
# Host side: validation, mask normalization, launchers.
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Problem:
    """Validated inputs of one (query block, key block) pair, with the masks normalized for the kernels."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_mask: Optional[torch.Tensor]  # uint8 [B, Sk], contiguous
    seg_q: Optional[torch.Tensor]  # int [B, Sq], contiguous
    seg_k: Optional[torch.Tensor]  # int [B, Sk], contiguous
    q_offset: int
    k_offset: int
    left: int  # band: i_pos - left <= j_pos (when has_left)
    right: int  # band: j_pos <= i_pos + right (when has_right)
    has_left: bool
    has_right: bool
    chunk: int  # chunked local attention: j_pos // chunk == i_pos // chunk (when has_chunk)
    has_chunk: bool
    hidden: bool  # the band or the chunks hide every pair of the block: nothing to compute
    scale: float
    softcap: float  # scaled scores s become softcap * tanh(s / softcap); 0: no capping
    alibi: Optional[torch.Tensor] = None  # float32 [H], contiguous: ALiBi slope per query head
    dropout_p: float = 0.0  # probability of dropping an attention probability; 0: no dropout
    dropout_seed: Optional[torch.Tensor] = None  # 0-d int64 on q's device (when dropout_p > 0)
    dropout_head_offset: int = 0  # global index of q's first head in the dropout hash

    @property
    def shape(self):
        batch, heads, sq, head_dim = self.q.shape
        return batch, heads, self.k.shape[1], sq, self.k.shape[2], head_dim

    @property
    def out_shape(self):
        """Shape of out / dout: [B, H, Sq, Dv], v's head dim."""
        return (*self.q.shape[:3], self.v.shape[3])


def _check_int(name: str, value) -> int:
    value = operator.index(value)  # TypeError for anything that is not an integer
    if abs(value) >= _MAX_POSITION:
        raise ValueError(f"{name}={value} is out of the supported range (|{name}| < 2**30)")
    return value


def _band(causal, window, q_offset: int, sq: int, k_offset: int, sk: int):
    """(left, right, has_left, has_right, hidden) of the band i_pos - left <= j_pos <= i_pos + right
    for this block: a bound no pair of the block can violate is dropped (no masking work for it), and
    hidden is True when the band excludes every pair."""
    left = right = -1
    if window is not None:
        if len(window) != 2:
            raise ValueError(f"window must be a (left, right) pair, got {window!r}")
        left, right = (_check_int("window", w) for w in window)
        if left < -1 or right < -1:
            raise ValueError(f"window bounds must be >= 0, or -1 for unbounded; got {window!r}")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    max_ahead = (k_offset + sk - 1) - q_offset  # largest j_pos - i_pos in the block
    max_behind = (q_offset + sq - 1) - k_offset  # largest i_pos - j_pos
    has_right = 0 <= right < max_ahead
    has_left = 0 <= left < max_behind
    hidden = (right >= 0 and -max_behind > right) or (left >= 0 and -max_ahead > left)
    return max(left, 0), max(right, 0), has_left, has_right, hidden


def _chunks(chunk, q_offset: int, sq: int, k_offset: int, sk: int):
    """(chunk, has_chunk, hidden) of a chunk mask for this block: dropped when every query and key lies in one
    chunk, hidden when the queries and the keys share no chunk."""
    chunk = _check_int("chunk", chunk)
    if chunk < 0:
        raise ValueError(f"chunk must be >= 0 (0: no chunks), got {chunk}")
    if not chunk or sq == 0 or sk == 0:
        return max(chunk, 1), False, False
    q_first, q_last = q_offset // chunk, (q_offset + sq - 1) // chunk
    k_first, k_last = k_offset // chunk, (k_offset + sk - 1) // chunk
    hidden = k_first > q_last or k_last < q_first
    return chunk, not (q_first == q_last == k_first == k_last), hidden


def _key_mask(key_mask, batch: int, sk: int, device):
    if key_mask is None:
        return None
    if key_mask.dtype != torch.bool or tuple(key_mask.shape) != (batch, sk):
        raise ValueError(f"key_mask must be a bool tensor [B, Sk] = {(batch, sk)}, got "
                         f"{key_mask.dtype} {tuple(key_mask.shape)}")
    return key_mask.to(device).contiguous().view(torch.uint8)


def _segments(segment_ids, batch: int, sq: int, sk: int, device):
    if segment_ids is None:
        return None, None
    if len(segment_ids) != 2:
        raise ValueError("segment_ids must be a (seg_q, seg_k) pair")
    seg_q, seg_k = segment_ids
    for seg in (seg_q, seg_k):
        if seg.dtype.is_floating_point or seg.dtype.is_complex or seg.dtype == torch.bool:
            raise TypeError(f"segment ids must be integer tensors, got {seg_q.dtype}, {seg_k.dtype}")
    if tuple(seg_q.shape) != (batch, sq) or tuple(seg_k.shape) != (batch, sk):
        raise ValueError(f"segment_ids must be [B, Sq] = {(batch, sq)} and [B, Sk] = {(batch, sk)}, got "
                         f"{tuple(seg_q.shape)} and {tuple(seg_k.shape)}")
    if seg_q.dtype != seg_k.dtype:
        seg_q, seg_k = seg_q.long(), seg_k.long()
    return seg_q.to(device).contiguous(), seg_k.to(device).contiguous()


def _sorted_rows(seg_q: torch.Tensor, seg_k: torch.Tensor) -> torch.Tensor:
    """``[B]`` uint8, 1 where a batch row's query and key ids are both non-decreasing (packed documents): the kernels
    then visit only the tiles of the rows' documents. Computed on the device, without a sync."""
    def rising(seg):
        return (seg[:, 1:] >= seg[:, :-1]).all(1)

    return (rising(seg_q) & rising(seg_k)).to(torch.uint8)


def _alibi_slopes(alibi_slopes, heads: int, device):
    if alibi_slopes is None:
        return None
    if (not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32
            or tuple(alibi_slopes.shape) != (heads,) or alibi_slopes.device != device):
        got = (f"{alibi_slopes.dtype} {tuple(alibi_slopes.shape)} on {alibi_slopes.device}"
               if isinstance(alibi_slopes, torch.Tensor) else type(alibi_slopes).__name__)
        raise ValueError(f"alibi_slopes must be a 1-D float32 tensor [H] = ({heads},) (one slope per query head) "
                         f"on {device}, got {got}")
    return alibi_slopes.detach().contiguous()


def _dropout(dropout_p, dropout_seed, dropout_head_offset, device):
    """(p, seed, head_offset) of the dropout, validated; p 0 turns it off (the seed is then ignored)."""
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1) (0: no dropout), got {dropout_p}")
    if p == 0.0:
        return 0.0, None, 0
    if (not isinstance(dropout_seed, torch.Tensor) or dropout_seed.dtype != torch.int64 or dropout_seed.dim() != 0
            or dropout_seed.device != device):
        got = (f"{dropout_seed.dtype} {tuple(dropout_seed.shape)} on {dropout_seed.device}"
               if isinstance(dropout_seed, torch.Tensor) else type(dropout_seed).__name__)
        raise ValueError(f"dropout_seed must be a 0-d int64 tensor on {device} when dropout_p > 0, got {got}")
    head_offset = _check_int("dropout_head_offset", dropout_head_offset)
    if head_offset < 0:
        raise ValueError(f"dropout_head_offset must be >= 0, got {head_offset}")
    return p, dropout_seed.detach(), head_offset


def _prepare(q, k, v, *, q_offset, k_offset, causal, window, chunk, key_mask, segment_ids, scale,
             softcap, alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_head_offset=0) -> _Problem:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, heads, S, D], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"Triton attention supports float16, bfloat16 and float32 inputs; {name} is {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not triton_available(q.device):
        raise RuntimeError(f"Triton attention kernels cannot run on {q.device}: they need a CUDA device, or "
                           "TRITON_INTERPRET=1 set before autoshard.kernels.attention is imported (CPU)")
    batch, heads, sq, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k must be [B, Hkv, Sk, D] and v [B, Hkv, Sk, Dv] matching q {tuple(q.shape)}, got "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    kv_heads, sk = k.shape[1], k.shape[2]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"the number of query heads ({heads}) must be a multiple of the kv heads ({kv_heads})")
    for name, dim in (("head dim", head_dim), ("v head dim", v.shape[3])):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name} {dim} is not supported by the Triton kernels (1..{MAX_HEAD_DIM}; "
                             f"non-powers of two are padded); use kernels='torch'")
    q_offset = _check_int("q_offset", q_offset)
    k_offset = _check_int("k_offset", k_offset)
    _check_int("q_offset + Sq", q_offset + sq)
    _check_int("k_offset + Sk", k_offset + sk)
    left, right, has_left, has_right, hidden = _band(causal, window, q_offset, sq, k_offset, sk)
    chunk, has_chunk, chunks_hidden = _chunks(chunk, q_offset, sq, k_offset, sk)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not scale > 0.0 or not math.isfinite(scale):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    softcap = float(softcap)
    if not (softcap >= 0.0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be a finite number >= 0 (0: no capping), got {softcap}")
    seg_q, seg_k = _segments(segment_ids, batch, sq, sk, q.device)
    alibi = _alibi_slopes(alibi_slopes, heads, q.device)
    dropout_p, dropout_seed, dropout_head_offset = _dropout(dropout_p, dropout_seed, dropout_head_offset, q.device)
    return _Problem(q=last_dim_contiguous(q), k=last_dim_contiguous(k), v=last_dim_contiguous(v),
                    key_mask=_key_mask(key_mask, batch, sk, q.device), seg_q=seg_q, seg_k=seg_k,
                    q_offset=q_offset, k_offset=k_offset, left=left, right=right, has_left=has_left,
                    has_right=has_right, chunk=chunk, has_chunk=has_chunk, hidden=hidden or chunks_hidden,
                    scale=scale, softcap=softcap, alibi=alibi, dropout_p=dropout_p, dropout_seed=dropout_seed,
                    dropout_head_offset=dropout_head_offset)


def _kernel_args(p: _Problem):
    """Keyword arguments shared by the forward and both backward kernels."""
    batch, heads, kv_heads, sq, sk, head_dim = p.shape
    v_dim = p.out_shape[3]
    placeholder = p.q  # never dereferenced when the matching HAS_* flag is off
    return dict(
        KeyMask=p.key_mask if p.key_mask is not None else placeholder,
        SegQ=p.seg_q if p.seg_q is not None else placeholder,
        SegK=p.seg_k if p.seg_k is not None else placeholder,
        SegSorted=_sorted_rows(p.seg_q, p.seg_k) if p.seg_q is not None else placeholder,
        Alibi=p.alibi if p.alibi is not None else placeholder,
        Seed=p.dropout_seed if p.dropout_seed is not None else placeholder,
        num_heads=heads, kv_group=heads // kv_heads, Sq=sq, Sk=sk, q_offset=p.q_offset, k_offset=p.k_offset,
        left=p.left, right=p.right, chunk=p.chunk, scale=p.scale, qk_cap=p.softcap / p.scale if p.softcap else 1.0,
        SQ_BUCKET=seq_bucket(sq), SK_BUCKET=seq_bucket(sk),
        drop_head_offset=p.dropout_head_offset, drop_threshold=round(p.dropout_p * 2**24),
        drop_scale=1.0 / (1.0 - p.dropout_p), HEAD_DIM=head_dim, BLOCK_D=padded_dim(head_dim),
        V_DIM=v_dim, BLOCK_DV=padded_dim(v_dim),
        HAS_LEFT=p.has_left, HAS_RIGHT=p.has_right, HAS_CHUNK=p.has_chunk, HAS_KEY_MASK=p.key_mask is not None,
        HAS_SEG=p.seg_q is not None, SOFTCAP=p.softcap > 0.0, HAS_ALIBI=p.alibi is not None,
        HAS_DROPOUT=p.dropout_p > 0.0,
        DOT_PRECISION=_dot_precision(p.q.dtype),
    )


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if INTERPRET and dtype == torch.bfloat16 else "tf32"


def _strides(prefix: str, x: torch.Tensor):
    return {f"stride_{prefix}b": x.stride(0), f"stride_{prefix}h": x.stride(1), f"stride_{prefix}s": x.stride(2)}


def _forward(p: _Problem, out_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    batch, heads, kv_heads, sq, sk, head_dim = p.shape
    out = torch.empty(p.out_shape, dtype=out_dtype, device=p.q.device)
    lse = torch.empty((batch, heads, sq), dtype=torch.float32, device=p.q.device)
    if p.hidden or sk == 0 or out.numel() == 0:  # nothing visible: out 0, lse -inf
        return out.zero_(), lse.fill_(float("-inf"))
    grid = lambda meta: (triton.cdiv(sq, meta["BLOCK_M"]), heads, batch)  # noqa: E731
    _attn_fwd_kernel[grid](
        Q=p.q, K=p.k, V=p.v, Out=out, Lse=lse,
        **_strides("q", p.q), **_strides("k", p.k), **_strides("v", p.v), **_strides("o", out), **_kernel_args(p),
    )
    return out, lse


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
    dq = torch.empty(p.q.shape, dtype=grad_dtype, device=device)
    dk = torch.empty(p.k.shape, dtype=grad_dtype, device=device)
    dv = torch.empty(p.v.shape, dtype=grad_dtype, device=device)
    if p.hidden or sk == 0 or dq.numel() == 0:  # no visible pair: all gradients are 0
        return dq.zero_(), dk.zero_(), dv.zero_()
    dout = last_dim_contiguous(dout)
    if delta is None:
        check_like("out", out, p.out_shape, device)
        delta = _delta(last_dim_contiguous(out), dout)
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
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------
# Public functions (the contract with autoshard.runtime.attention.local) and the autograd Function.
# ----------------------------------------------------------------------------------------------------


def triton_attention_forward(q, k, v, *, q_offset=0, k_offset=0, causal=False, window=None, chunk=0, key_mask=None,
                             segment_ids=None, scale=None, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                             dropout_seed=None, dropout_head_offset=0):
    """Attention of one query block over one key block at global offsets.

    q [B, H, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (fp16 / bf16 / fp32, H % Hkv == 0; Dv may differ
    from D, as in MLA). Returns (out float32 [B, H, Sq, Dv], lse float32 [B, H, Sq], natural log); rows with
    no visible key get out 0, lse -inf. The default scale is 1 / sqrt(D).
    softcap > 0 caps the scaled scores s to softcap * tanh(s / softcap) before the mask; chunk > 0 keeps
    only the pairs with i_pos // chunk == j_pos // chunk.
    alibi_slopes (float32 [H] on q's device, one slope per QUERY head) adds the ALiBi bias
    slope[h] * (j_pos - i_pos) from global positions to the (capped) scores before the mask; lse includes it.
    dropout_p > 0 drops the probabilities by the hashed mask of :mod:`autoshard.runtime.attention.dropout`
    (``dropout_seed``: the call's 0-d int64 seed on q's device, read in the kernels; ``dropout_head_offset``: the
    global index of q's first head) and scales the kept ones by 1 / (1 - dropout_p); lse is of the
    probabilities before dropout.
    """
    p = _prepare(q, k, v, q_offset=q_offset, k_offset=k_offset, causal=causal, window=window, chunk=chunk,
                 key_mask=key_mask, segment_ids=segment_ids, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
                 dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_head_offset=dropout_head_offset)
    return _forward(p, torch.float32)


def triton_attention_backward(dout, q, k, v, out, lse, *, delta=None, q_offset=0, k_offset=0, causal=False,
                              window=None, chunk=0, key_mask=None, segment_ids=None, scale=None, softcap=0.0,
                              alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_head_offset=0):
    """Gradients (dq [B, H, Sq, D], dk [B, Hkv, Sk, D], dv [B, Hkv, Sk, Dv]), float32, of one key block's
    share of attention; dout and out are [B, H, Sq, Dv].

    out / lse are the FINAL values over all key blocks (so ring steps can sum the results); delta =
    rowsum(dout * out) float32 [B, H, Sq] is computed from out when None. Rows with lse -inf contribute
    nothing. alibi_slopes must be those of the forward; the bias is a constant (no gradient for the slopes).
    dropout_p / dropout_seed / dropout_head_offset must be those of the forward: the same mask is recomputed.
    """
    p = _prepare(q, k, v, q_offset=q_offset, k_offset=k_offset, causal=causal, window=window, chunk=chunk,
                 key_mask=key_mask, segment_ids=segment_ids, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
                 dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_head_offset=dropout_head_offset)
    return _backward(p, dout, out, lse, delta, torch.float32)


class TritonAttentionFunction(torch.autograd.Function):
    """Differentiable single-block attention: ``apply(q, k, v, q_offset, k_offset, causal, window, key_mask,
    segment_ids, scale, softcap, chunk, alibi_slopes=None, dropout_p=0.0, dropout_seed=None,
    dropout_head_offset=0)`` returns out in q's dtype; gradients are written in the input dtypes (none for the
    ALiBi slopes or the dropout seed). The backward recomputes the forward's dropout mask from the seed."""

    @staticmethod
    def forward(ctx, q, k, v, q_offset, k_offset, causal, window, key_mask, segment_ids, scale, softcap, chunk,
                alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_head_offset=0):
        p = _prepare(q, k, v, q_offset=q_offset, k_offset=k_offset, causal=causal, window=window, chunk=chunk,
                     key_mask=key_mask, segment_ids=segment_ids, scale=scale, softcap=softcap,
                     alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                     dropout_head_offset=dropout_head_offset)
        out, lse = _forward(p, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, key_mask,
                              *(segment_ids if segment_ids is not None else (None, None)), p.alibi, p.dropout_seed)
        ctx.mask_args = dict(q_offset=q_offset, k_offset=k_offset, causal=causal, window=window, chunk=chunk,
                             scale=scale, softcap=softcap, dropout_p=p.dropout_p,
                             dropout_head_offset=p.dropout_head_offset)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, key_mask, seg_q, seg_k, alibi, seed = ctx.saved_tensors
        p = _prepare(q, k, v, key_mask=key_mask, segment_ids=None if seg_q is None else (seg_q, seg_k),
                     alibi_slopes=alibi, dropout_seed=seed, **ctx.mask_args)
        dq, dk, dv = _backward(p, dout, out, lse, None, q.dtype)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None, None


def triton_attention(q, k, v, *, q_offset=0, k_offset=0, causal=False, window=None, chunk=0, key_mask=None,
                     segment_ids=None, scale=None, softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None,
                     dropout_head_offset=0):
    """Differentiable attention through the Triton kernels; out in q's dtype (see TritonAttentionFunction)."""
    return TritonAttentionFunction.apply(q, k, v, q_offset, k_offset, causal, window, key_mask, segment_ids, scale,
                                         softcap, chunk, alibi_slopes, dropout_p, dropout_seed, dropout_head_offset)
