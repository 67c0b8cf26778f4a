"""The ``@triton.jit`` helpers the attention kernels share (:mod:`.attention_forward`, :mod:`.attention_backward`),
so that no kernel duplicates logic: which tiles a program visits, the tile mask, the soft-cap, the ALiBi bias, the
dropout hash and the dots.

Tile ranges. A program holds one tile of rows of one axis (queries in the forward and dq kernels, keys in the dk/dv
kernel) and walks the tiles of the other axis that ``_band_tiles`` gives: [lo, hi) holds every visible pair, so
tiles outside it are never loaded, and [full_lo, full_hi) inside it the tiles every row sees entirely. A chunk
mask is block-diagonal: the range narrows to the chunks of the program's rows, fully visible tiles exist only for
a tile of rows inside one chunk, and tiles that straddle a chunk boundary are masked from positions. With packed
documents, ``_document_tiles`` narrows the range further: when a batch row's segment ids are sorted, to the other
axis' positions whose ids lie within the rows' ids, found by a binary search of the ids (``_search``), so the tiles
of other documents are never loaded either.

The tile loop. Every kernel walks its range in three phases (``_phase_tiles``): band-edge tiles [lo, full_lo),
fully visible tiles [full_lo, full_hi) and band-edge / ragged-tail tiles [full_hi, hi). Its tile loop has one
call site, in a ``tl.static_range(3)`` over the phases: the phase is a compile-time constant, so the loop is
compiled three times, with ``PARTIAL = phase != 1``. Fully visible tiles skip the position arithmetic and the
bounds checks (and, without key_mask / segment ids, all masking); partial tiles are masked by
``_tile_visibility`` (positions, key_mask and segment ids, for either orientation of the tile).

Soft-capping: the kernels cap the raw ``q.k`` tile with ``qk_cap = softcap / scale`` (``_soft_cap``), so the
scale and the base-2 softmax that follow are unchanged. ALiBi: in the kernels' base-2 domain the bias is
``slope * log2(e) * (j_pos - i_pos)`` (``_alibi_bias``). Dropout: the mask is computed in uint32 arithmetic by
one shared definition (``_dropout_row_hash`` once per query row, ``_dropout_keep`` per tile) in the forward, the
dk/dv and the dq kernels, so the backward drops exactly what the forward dropped. ``SOFTCAP``, ``HAS_ALIBI`` and
``HAS_DROPOUT`` are compile-time flags: kernels without them hold none of their code. (The autotuner's register
estimates leave out the cap's tiles, among them the backward's extra tanh tile, and the bias tile; they count the
dropout hash tile like a data mask.)

Tiles of q / k / dq / dk have ``BLOCK_D`` columns and tiles of v / out / dout / dv ``BLOCK_DV``; when the head
dims are equal the two are one constant and the kernels are the same code. Precision (``_dot``): fp16 / bf16
inputs use tensor-core dots (wgmma on Hopper) with fp32 accumulation; fp32 inputs use exact
``input_precision="ieee"`` dots (no tf32) on small tiles, a correctness path that matches a float64 reference to
~1e-6.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_LOG2E", "_band_tiles", "_document_tiles", "_phase_tiles", "_tile_visibility", "_soft_cap", "_alibi_bias",
           "_dropout_row_hash", "_query_terms", "_dropout_keep", "_dot"]

_LOG2E = tl.constexpr(1.4426950408889634)


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
def _query_key_tiles(q_start, q_idx, seg_q, q_offset, Sq, k_offset, Sk, left, right, chunk, SegK, SegSorted, b,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                     HAS_CHUNK: tl.constexpr, HAS_SEG: tl.constexpr):
    """``(lo, full_lo, full_hi, hi)`` of one query tile's key tiles: its band and chunks (``_band_tiles``), narrowed
    to its documents (``_document_tiles``) with segments. The forward and dq programs walk the same ones."""
    lo, full_lo, full_hi, hi = _band_tiles(q_offset + q_start, q_offset + tl.minimum(q_start + BLOCK_M, Sq) - 1,
                                           k_offset, Sk, left, right, chunk, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_CHUNK)
    if HAS_SEG:
        lo, full_lo, full_hi, hi = _document_tiles(lo, full_lo, full_hi, hi, seg_q, q_idx < Sq, SegK, Sk, SegSorted,
                                                   b, BLOCK_N)
    return lo, full_lo, full_hi, hi


@triton.jit
def _phase_tiles(lo, full_lo, full_hi, hi, PHASE: tl.constexpr):
    """[start, end) of phase PHASE of a tile range from :func:`_band_tiles` / :func:`_document_tiles`: 0 the partial
    tiles before the fully visible ones, 1 the fully visible tiles, 2 the partial tiles after them. A kernel's tile
    loop runs once per phase (``tl.static_range(3)``) with ``PARTIAL = PHASE != 1``."""
    if PHASE == 0:
        start, end = lo, full_lo
    elif PHASE == 1:
        start, end = full_lo, full_hi
    else:
        start, end = full_hi, hi
    return start, end


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
def _tile_scores(a, b, q_idx, k_idx, seg_q, KeyMask, SegK, Sk, q_offset, k_offset, left, right, chunk, qk_scale,
                 qk_cap, slope2, Q_AXIS: tl.constexpr, PARTIAL: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_KEY_MASK: tl.constexpr, HAS_SEG: tl.constexpr,
                 SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``(s, tanh)`` of one tile, the one definition of the scores the forward, dk/dv and dq kernels share: the
    base-2 scores ``s = qk_scale * cap(a b^T) + bias``, -inf where not visible (only tiles that need the check:
    PARTIAL, key mask, segments), and ``tanh`` of the cap for the backward's chain rule (the raw dot without a cap;
    unused, so compiled away, where nothing reads it). ``a b^T`` is ``q k^T`` (Q_AXIS 0) or ``k q^T`` (Q_AXIS 1);
    ``slope2`` is the head's ALiBi slope in base 2 (read only with HAS_ALIBI)."""
    qk = _dot(a, tl.trans(b), None, DOT_PRECISION)
    tanh = qk
    if SOFTCAP:
        qk, tanh = _soft_cap(qk, qk_cap)
    s = qk * qk_scale
    if HAS_ALIBI:
        s = s + _alibi_bias(slope2, q_idx, k_idx, q_offset, k_offset, Q_AXIS)
    if PARTIAL or HAS_KEY_MASK or HAS_SEG:
        visible = _tile_visibility(q_idx, k_idx, q_offset, k_offset, Sk, left, right, chunk, seg_q, KeyMask, SegK,
                                   Q_AXIS, PARTIAL, HAS_LEFT, HAS_RIGHT, HAS_CHUNK, HAS_KEY_MASK, HAS_SEG)
        s = tl.where(visible, s, float("-inf"))
    return s, tanh


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
