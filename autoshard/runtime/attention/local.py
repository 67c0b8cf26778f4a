"""The local attention primitive every distributed strategy computes through.

    out, lse = local_attention(q, k, v, q_offset=..., k_offset=..., causal=..., window=..., chunk=...,
                               key_mask=..., segment_ids=..., scale=...)
    dq, dk, dv = local_attention_backward(dout, q, k, v, out, lse, the same keywords)

Both take the keywords of :class:`BlockOptions`, declared once with a docstring each; inside, the two directions
resolve them into one private ``_Block`` (mask, score terms, scale, visibility, implementation) and follow the same
dispatch.

One block of queries against one block of keys, both placed by their **global** offsets, so the same
function serves every step of every strategy: a block the mask hides entirely returns at once, a fully
visible one needs no mask tensor, a diagonal one is masked tile by tile. Shapes follow
``F.scaled_dot_product_attention``: ``q [B, H, Sq, D]``, ``k``/``v`` ``[B, Hkv, Sk, D]`` with ``H`` divisible
by ``Hkv``; query head ``h`` reads kv head ``h // (H // Hkv)``. ``v``'s head dim ``Dv`` may differ from ``D``
(multi-head latent attention: qk 192, v 128); ``out`` and ``dv`` have ``Dv``. GQA groups the query heads of a kv head
into one matrix (``[B, Hkv, G * rows, D]``); K and V are never repeated.

Soft-capping (``softcap > 0``, Gemma2's attention logit cap): the scaled scores ``s = scale * q.k`` become
``softcap * tanh(s / softcap)`` before the mask and the softmax. It is elementwise on the scores, so a
block's ``lse`` and the merge of blocks stay what they are for any other scores.

ALiBi (``alibi_slopes``, ``[H]`` float32, Bloom / MPT / Falcon): every score then gets ``slope[h] * (k_pos -
q_pos)`` from the **global** positions of the block (``q_offset + i``, ``k_offset + j``), after the cap and
before the mask. Models that add ``slope[h] * k_pos`` (Bloom) differ by ``slope[h] * q_pos``, a constant per row
that the softmax cancels. The slopes are constants: they get no gradient.

A relative-position bias (``position_bias``, ``[H, 2R + 1]``, T5's learned buckets tabulated per distance): every
score gets ``position_bias[h, k_pos - q_pos + R]`` after the cap. It is learned: the backward adds the sum of the
scores' gradients along each distance into ``position_bias_grad`` (an accumulator the caller owns). The torch
path computes it; the Triton kernels do not take it.

Dropout (``dropout``, an :class:`~.dropout.AttentionDropout`): the probabilities are dropped by a mask that is
a hash of the call's seed and the elements' global indices (see :mod:`.dropout`), after the row
normalization: ``out`` is ``sum_j p_ij z_ij v_j`` with ``z`` 0 or ``1 / (1 - p)``, ``lse`` that of the
probabilities before dropout, so blocks merge as without it; the backward uses the same mask.

Outputs: ``out`` (float32, or float64 for float64 inputs) and ``lse``, the **natural** log (base e) of
each row's sum of ``exp(s)`` (the capped scores when capping) over its visible keys. A row with no visible key has ``out = 0``
and ``lse = -inf``, and its gradients are 0 (``F.scaled_dot_product_attention`` in current torch also gives
0 there; older versions and some kernels give NaN).

The backward takes the *final* ``out`` and ``lse`` of the rows (merged over every key block, as a ring
needs) and ``delta = rowsum(dout * out)``, computed here when not given; ``dk``/``dv`` come back with
``Hkv`` heads (summed over each group).

Implementations (``kernels``, see :mod:`.backend`): the Triton kernels of
:mod:`autoshard.kernels.attention`, or the torch path here, which never materializes the
``[Sq x Sk]`` scores of a long block:

* packed documents (``segment_ids``) are computed one document rectangle at a time (:mod:`.documents`): each
  (query run, key run) of one id is a block of its own at its global offsets, without the data mask, so the
  pairs between documents are never computed and each rectangle reaches the fused kernel below;
* blocks without data masks (``key_mask``, ``segment_ids``) or soft-capping whose keys split into a fully
  visible range and an aligned causal diagonal go to torch's fused CPU flash-attention kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu``: tiled, returns the LSE, takes GQA as is),
  one call per range, merged through the LSE;
* everything else runs the tiled online softmax below: ``TILE_Q x TILE_K`` tiles, tiles the mask hides
  skipped (and, with segment ids too fragmented for rectangles, tiles whose id ranges do not meet), mask
  tensors built only for partly visible tiles; peak extra memory is O(S * D) per (batch, head) plus one tile
  of scores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch

from .backend import triton_attention_backward, triton_attention_forward, use_triton
from .documents import DocumentBlock, DocumentGroup, document_groups, fragmented, tile_ranges, visible_pairs
from .flops import counting_flops, record_flops
from .dropout import AttentionDropout
from .masks import MaskSpec, Visibility
from .terms import ScoreTerms
from .merge import merge_attention_

__all__ = [
    "local_attention", "local_attention_backward", "BlockOptions", "compute_dtype", "without_autocast", "row_delta",
    "empty_result", "TILE_Q", "TILE_K", "FUSED_BLOCKS", "DOCUMENT_BLOCKS",
]

TILE_Q = 512
"""Query rows per tile of the torch path (times the GQA group size)."""
TILE_K = 512
"""Key columns per tile of the torch path."""
FUSED_BLOCKS = True
"""Use torch's fused CPU flash-attention kernel for blocks it fits (set False to force the tiled path)."""
DOCUMENT_BLOCKS = True
"""Compute packed documents by their rectangles and skip the tiles between them (False: every pair of a block is
computed and the segment ids only mask, as before documents were read; for benchmarks)."""

_NEG_INF = float("-inf")
_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention accumulates in for inputs of ``dtype``: float64 stays, the rest is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def without_autocast(t: torch.Tensor):
    """Autocast off on ``t``'s device type, around the body of an attention op: like a fused kernel, the op
    computes in the dtype of its inputs and accumulates in :func:`compute_dtype` (autocast would run its
    matmuls in the lower precision); its callers cast the inputs (see :mod:`.api`)."""
    available = torch.amp.is_autocast_available(t.device.type)
    return torch.autocast(t.device.type, enabled=False) if available else contextlib.nullcontext()


def row_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``delta = rowsum(dout * out)`` (``[B, H, S]``, compute dtype): the backward's per-row correction."""
    ct = compute_dtype(out.dtype)
    return (dout.to(ct) * out.to(ct)).sum(-1)


def empty_result(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulators before any key block: ``out = 0`` (``q``'s rows, ``v``'s head dim), ``lse = -inf`` (in the
    compute dtype); also the result of a block the mask hides."""
    ct = compute_dtype(q.dtype)
    return q.new_zeros((*q.shape[:-1], v.size(-1)), dtype=ct), q.new_full(q.shape[:-1], _NEG_INF, dtype=ct)


@dataclass(frozen=True, kw_only=True)
class BlockOptions:
    """The keywords of :func:`local_attention`, which :func:`local_attention_backward` takes too (with the forward's
    values): where the block sits, what hides its pairs, how it scores them and which kernels compute it."""

    q_offset: int = 0
    """Global position of the first query."""
    k_offset: int = 0
    """Global position of the first key."""
    causal: bool = False
    """Position mask (:class:`.masks.MaskSpec`): query ``i`` sees no key after it."""
    window: tuple[int, int] | None = None
    """Position mask: ``(left, right)``, how far before and after its position a query sees (None: unbounded)."""
    chunk: int = 0
    """Position mask: query ``i`` sees key ``j`` only if ``i // chunk == j // chunk`` (0: no chunks); the torch path
    skips the tiles outside the chunks and masks the tiles that straddle a chunk boundary."""
    key_mask: torch.Tensor | None = None
    """``[B, Sk]`` bool, True where the key may be attended."""
    segment_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    """The pair ``(seg_q [B, Sq], seg_k [B, Sk])``; a key is visible only within the query's segment."""
    scale: float | None = None
    """Softmax scale (None: ``1 / sqrt(D)``)."""
    softcap: float = 0.0
    """When positive, the scaled scores ``s`` become ``softcap * tanh(s / softcap)`` before the mask and the softmax
    (0: no capping)."""
    alibi_slopes: torch.Tensor | None = None
    """ALiBi's per-head slopes, ``[H]`` float32 (see the module docstring)."""
    position_bias: torch.Tensor | None = None
    """A relative-position bias, ``[H, 2R + 1]`` (see the module docstring)."""
    dropout: AttentionDropout | None = None
    """The call's dropout (see the module docstring)."""
    kernels: str = "auto"
    """``"auto"``, ``"torch"`` or ``"triton"`` (see :mod:`.backend`)."""


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query block against one key block at global offsets; returns ``(out, lse)``.

    ``options``: the keywords of :class:`BlockOptions` (see the module docstring for the score terms and the
    outputs).
    """
    return _forward(q, k, v, BlockOptions(**options))


def local_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, *, delta: torch.Tensor | None = None,
                             position_bias_grad: torch.Tensor | None = None,
                             **options) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of one block (float32, or float64 for float64 inputs).

    ``out``/``lse``: the rows' final values over all key blocks; ``delta``: ``rowsum(dout * out)``
    (``[B, H, Sq]``), computed when ``None``; ``position_bias_grad``: where the bias's gradient is added;
    ``options``: the keywords of :class:`BlockOptions`, as the forward took them.
    """
    return _backward(dout, q, k, v, out, lse, delta, position_bias_grad, BlockOptions(**options))


@dataclass(frozen=True)
class _Block:
    """A block's options resolved against its tensors, once for either direction: the mask, the score terms, the
    scale, how much of the block the mask shows and, when it shows any, which implementation computes it."""

    options: BlockOptions
    spec: MaskSpec
    terms: ScoreTerms
    scale: float
    visibility: Visibility
    triton: bool = False
    """The Triton kernels compute it (else the torch path)."""
    groups: list[DocumentGroup] | None = None
    """Its document rectangles, where someone reads them (see :func:`_documents`)."""

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions,
           position_bias_grad: torch.Tensor | None = None) -> _Block:
        spec = MaskSpec.of(options.causal, options.window, options.chunk)
        terms = ScoreTerms(options.alibi_slopes, options.position_bias, position_bias_grad, options.dropout)
        _check(q, k, v, options, terms)
        scale = 1.0 / math.sqrt(q.size(-1)) if options.scale is None else float(options.scale)
        visibility = spec.classify(options.q_offset, q.size(2), options.k_offset, k.size(2))
        if visibility is Visibility.HIDDEN:
            return cls(options, spec, terms, scale, visibility)
        triton = _triton(options.kernels, q, terms)
        return cls(options, spec, terms, scale, visibility, triton, _documents(options.segment_ids, triton))

    def by_document(self, q_len: int) -> bool:
        """Whether the torch path computes the block one document rectangle at a time. Dropout hashes the batch
        index, so rows with different documents (one group per row) keep it on the tiled path."""
        return (self.groups is not None and not self.triton and not fragmented(self.groups, q_len)
                and (self.terms.dropout is None or len(self.groups) == 1))

    def record_flops(self, direction: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        (B, H, Sq, D), Sk = q.shape, k.size(2)
        pairs = visible_pairs(self.spec, self.options.q_offset, Sq, self.options.k_offset, Sk, B, self.groups)
        record_flops(direction, pairs, H, D, v.size(-1))

    def triton_kwargs(self) -> dict:
        """The keyword arguments of the Triton kernels (forward and backward) this block is."""
        o, spec, dropout = self.options, self.spec, self.terms.dropout
        dropout_kwargs = {} if dropout is None else {
            "dropout_p": dropout.p, "dropout_seed": dropout.seed, "dropout_head_offset": dropout.head_offset}
        return dict(q_offset=o.q_offset, k_offset=o.k_offset, causal=spec.causal, window=spec.window_arg,
                    chunk=spec.chunk, key_mask=o.key_mask, segment_ids=o.segment_ids, scale=self.scale,
                    softcap=o.softcap, alibi_slopes=o.alibi_slopes, **dropout_kwargs)


def _forward(q, k, v, options: BlockOptions) -> tuple[torch.Tensor, torch.Tensor]:
    block = _Block.of(q, k, v, options)
    if block.visibility is Visibility.HIDDEN:
        return empty_result(q, v)
    if block.by_document(q.size(2)):
        return _documents_forward(q, k, v, block)
    block.record_flops("forward", q, k, v)
    if block.triton:
        return triton_attention_forward(q, k, v, **block.triton_kwargs())
    parts = _fused_parts(block, q, v, k.size(2))
    if parts is not None:
        return _fused_forward(q, k, v, parts, block.scale)
    return _tiled_forward(q, k, v, block)


def _backward(dout, q, k, v, out, lse, delta, position_bias_grad,
              options: BlockOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    block = _Block.of(q, k, v, options, position_bias_grad)
    if block.visibility is Visibility.HIDDEN:
        ct = compute_dtype(q.dtype)
        return (q.new_zeros(q.shape, dtype=ct), k.new_zeros(k.shape, dtype=ct), v.new_zeros(v.shape, dtype=ct))
    if block.by_document(q.size(2)):
        return _documents_backward(dout, q, k, v, out, lse, delta, block)
    block.record_flops("backward", q, k, v)
    if block.triton:
        return triton_attention_backward(dout, q, k, v, out, lse, delta=delta, **block.triton_kwargs())
    parts = _fused_parts(block, q, v, k.size(2))
    if parts is not None:
        return _fused_backward(dout, q, k, v, out, lse, parts, block.scale)
    return _tiled_backward(dout, q, k, v, out, lse, delta, block)


def _triton(kernels: str, q: torch.Tensor, terms: ScoreTerms) -> bool:
    """Whether the Triton kernels compute this block (they do not take a relative-position bias)."""
    if terms.position_bias is not None:
        if kernels == "triton":
            raise ValueError("local_attention: the Triton kernels do not take a relative-position bias; use "
                             "kernels='auto' or 'torch'")
        return False
    return use_triton(kernels, q)


# ---------------------------------------------------------------------------- packed documents


def _documents(segment_ids, triton: bool) -> list[DocumentGroup] | None:
    """The block's document rectangles (:mod:`.documents`), when there are segment ids and someone reads them: the
    torch path always, the Triton kernels (which find their documents per tile on the device) only to count
    FLOPs."""
    if segment_ids is None or not DOCUMENT_BLOCKS or (triton and not counting_flops()):
        return None
    return document_groups(segment_ids)


def _rectangle(options: BlockOptions, group: DocumentGroup, rectangle: DocumentBlock) -> BlockOptions:
    """The options of one document rectangle of ``group``'s batch rows: its global offsets, its keys' mask, no
    segment ids (the rectangle is one document)."""
    return dataclasses.replace(
        options, q_offset=options.q_offset + rectangle.q_lo, k_offset=options.k_offset + rectangle.k_lo,
        key_mask=None if options.key_mask is None else options.key_mask[group.batch, rectangle.cols], segment_ids=None)


def _documents_forward(q, k, v, block: _Block):
    """``(out, lse)`` of a block computed one document rectangle at a time (rows of no rectangle: empty)."""
    out, lse = empty_result(q, v)
    for group in block.groups:
        rows = group.batch
        for b in group.blocks:
            part_out, part_lse = _forward(q[rows, :, b.rows], k[rows, :, b.cols], v[rows, :, b.cols],
                                          _rectangle(block.options, group, b))
            merge_attention_(out[rows, :, b.rows], lse[rows, :, b.rows], part_out, part_lse, kernels="torch")
    return out, lse


def _documents_backward(dout, q, k, v, out, lse, delta, block: _Block):
    """The gradients of :func:`_documents_forward`'s rectangles, summed."""
    ct = compute_dtype(q.dtype)
    delta = row_delta(dout, out) if delta is None else delta
    dq, dk, dv = (t.new_zeros(t.shape, dtype=ct) for t in (q, k, v))
    for group in block.groups:
        rows = group.batch
        for b in group.blocks:
            at_rows, at_cols = (rows, slice(None), b.rows), (rows, slice(None), b.cols)
            gq, gk, gv = _backward(dout[at_rows], q[at_rows], k[at_cols], v[at_cols], out[at_rows], lse[at_rows],
                                   delta[at_rows], block.terms.position_bias_grad, _rectangle(block.options, group, b))
            dq[at_rows] += gq
            dk[at_cols] += gk
            dv[at_cols] += gv
    return dq, dk, dv


# ---------------------------------------------------------------------------- checks


def _check(q, k, v, options: BlockOptions, terms: ScoreTerms) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"local_attention: q, k, v must be [B, H, S, D], got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if (k.shape[:3] != v.shape[:3] or q.size(0) != k.size(0) or q.size(3) != k.size(3) or q.size(1) % k.size(1)
            or not v.size(3)):
        raise ValueError(f"local_attention: need q [B, H, Sq, D], k [B, Hkv, Sk, D] and v [B, Hkv, Sk, Dv] with H "
                         f"divisible by Hkv, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, Sq, Sk = q.size(0), q.size(2), k.size(2)
    key_mask, segment_ids, softcap = options.key_mask, options.segment_ids, options.softcap
    if key_mask is not None and (key_mask.shape != (B, Sk) or key_mask.dtype != torch.bool):
        raise ValueError(f"local_attention: key_mask must be a [B, Sk] = [{B}, {Sk}] bool tensor, got "
                         f"{tuple(key_mask.shape)} {key_mask.dtype}")
    if segment_ids is not None and (segment_ids[0].shape != (B, Sq) or segment_ids[1].shape != (B, Sk)):
        raise ValueError(f"local_attention: segment_ids must be the pair ([B, Sq], [B, Sk]) = ([{B}, {Sq}], "
                         f"[{B}, {Sk}]), got {tuple(segment_ids[0].shape)}, {tuple(segment_ids[1].shape)}")
    if not (softcap >= 0.0 and math.isfinite(softcap)):
        raise ValueError(f"local_attention: softcap must be a finite number >= 0 (0: no capping), got {softcap}")
    slopes, bias = terms.alibi_slopes, terms.position_bias
    if slopes is not None and (slopes.shape != (q.size(1),) or slopes.dtype != torch.float32):
        raise ValueError(f"local_attention: alibi_slopes must be a [H] = [{q.size(1)}] float32 tensor, got "
                         f"{tuple(slopes.shape)} {slopes.dtype}")
    if bias is not None:
        reach = (bias.size(-1) - 1) // 2 if bias.dim() == 2 else -1
        farthest = max(options.k_offset + Sk - 1 - options.q_offset, options.q_offset + Sq - 1 - options.k_offset)
        if bias.dim() != 2 or bias.size(0) != q.size(1) or bias.size(1) % 2 == 0 or farthest > reach:
            raise ValueError(f"local_attention: position_bias must be [H, 2R + 1] with H = {q.size(1)} and R at least "
                             f"the block's farthest distance {farthest}, got {tuple(bias.shape)}")


# ---------------------------------------------------------------------------- fused CPU kernel


def _fused_parts(block: _Block, q: torch.Tensor, v: torch.Tensor, k_len: int) -> list[tuple[int, int, bool]] | None:
    """Key ranges ``(lo, hi, causal)`` (local indices) that torch's fused kernel computes exactly, or None.

    A fully visible block is one range; under a plain causal mask the keys before the queries are one
    fully visible range and the keys at the queries' own positions one aligned causal diagonal (keys
    after them are hidden). Other blocks (windows, chunks, data masks, a diagonal cut by the block's edge) and
    soft-capped scores, score terms (the kernel has none of them) and a value head dim other than the query's are
    left to the tiled path.
    """
    o = block.options
    if (not FUSED_BLOCKS or q.device.type != "cpu" or o.key_mask is not None or o.segment_ids is not None
            or o.softcap or block.terms.positional or v.size(-1) != q.size(-1)):
        return None
    if block.visibility is Visibility.FULL:
        return [(0, k_len, False)]
    if not block.spec.is_plain_causal:
        return None
    diagonal, q_len = o.q_offset - o.k_offset, q.size(2)
    if diagonal < 0 or diagonal + q_len > k_len:
        return None
    return ([(0, diagonal, False)] if diagonal else []) + [(diagonal, diagonal + q_len, True)]


def _fused_forward(q, k, v, parts, scale):
    ct = compute_dtype(q.dtype)
    q, k, v = q.to(ct), k.to(ct), v.to(ct)
    out = lse = None
    for lo, hi, causal in parts:
        part_out, part_lse = _flash_forward(q, k[:, :, lo:hi], v[:, :, lo:hi], 0.0, causal, scale=scale)
        if out is None:
            out, lse = part_out, part_lse
        else:
            merge_attention_(out, lse, part_out, part_lse, kernels="torch")
    return out, lse


def _fused_backward(dout, q, k, v, out, lse, parts, scale):
    ct = compute_dtype(q.dtype)
    dout, q, k, v, out, lse = (t.to(ct) for t in (dout, q, k, v, out, lse))
    if len(parts) == 1 and parts[0][:2] == (0, k.size(2)):  # one range over all keys: the kernel's grads as they are
        return _flash_backward(dout, q, k, v, out, lse, 0.0, parts[0][2], scale=scale)
    dq, dk, dv = None, torch.zeros_like(k), torch.zeros_like(v)
    for lo, hi, causal in parts:
        gq, dk[:, :, lo:hi], dv[:, :, lo:hi] = _flash_backward(dout, q, k[:, :, lo:hi], v[:, :, lo:hi], out, lse,
                                                               0.0, causal, scale=scale)
        dq = gq if dq is None else dq.add_(gq)
    return dq, dk, dv


# ---------------------------------------------------------------------------- tiled torch path


def _tiles(spec: MaskSpec, q_start: int, q_len: int, k_start: int, k_len: int, q_outer: bool, segment_ids=None):
    """The visible tiles ``(i, tq, j, tk, visibility)`` of a block (local row/column starts), grouped by
    query tile when ``q_outer`` (forward) and by key tile otherwise (backward). With ``segment_ids``, tiles whose
    queries and keys share no id are hidden too."""
    rows = [(i, min(TILE_Q, q_len - i)) for i in range(0, q_len, TILE_Q)]
    cols = [(j, min(TILE_K, k_len - j)) for j in range(0, k_len, TILE_K)]
    if segment_ids is not None:
        q_ids, k_ids = tile_ranges(segment_ids[0], TILE_Q), tile_ranges(segment_ids[1], TILE_K)
    outer, inner = (rows, cols) if q_outer else (cols, rows)
    for a, na in outer:
        group = []
        for b, nb in inner:
            (i, tq), (j, tk) = ((a, na), (b, nb)) if q_outer else ((b, nb), (a, na))
            if segment_ids is not None:
                (q_low, q_high), (k_low, k_high) = q_ids[i // TILE_Q], k_ids[j // TILE_K]
                if q_high < k_low or k_high < q_low:
                    continue
            visibility = spec.classify(q_start + i, tq, k_start + j, tk)
            if visibility is not Visibility.HIDDEN:
                group.append((i, tq, j, tk, visibility))
        if group:
            yield group


def _tile_mask(spec, visibility, q_start, i, tq, k_start, j, tk, key_mask, segment_ids, device):
    """The visibility of one tile, broadcastable to ``[B, Hkv, G, tq, tk]``, or None when all is visible."""
    mask = spec.visible(q_start + i, tq, k_start + j, tk, device) if visibility is Visibility.PARTIAL else None
    if key_mask is not None:
        keys = key_mask[:, None, None, None, j:j + tk]
        mask = keys if mask is None else mask & keys
    if segment_ids is not None:
        seg_q, seg_k = segment_ids
        same = seg_q[:, None, None, i:i + tq, None] == seg_k[:, None, None, None, j:j + tk]
        mask = same if mask is None else mask & same
    return mask


def _soft_cap(s: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(softcap * tanh(s / softcap), tanh(s / softcap))`` for scaled scores ``s`` (overwritten), or ``(s, None)``
    when ``softcap`` is 0. The backward takes the tanh for the cap's derivative, ``1 - tanh^2``."""
    if not softcap:
        return s, None
    t = s.div_(softcap).tanh_()
    return t * softcap, t


def _distance(q_start: int, tq: int, k_start: int, tk: int, device) -> torch.Tensor:
    """``k_pos - q_pos`` of a tile, ``[tq, tk]`` int64."""
    return (torch.arange(k_start, k_start + tk, device=device)
            - torch.arange(q_start, q_start + tq, device=device)[:, None])


def _biased(scores: torch.Tensor, terms: ScoreTerms, q_start: int, tq: int, k_start: int, tk: int) -> torch.Tensor:
    """Add ALiBi's ``slope[h] * (k_pos - q_pos)`` and the relative-position bias in place to a tile's scores
    ``[B, Hkv, G * tq, tk]``."""
    if terms.alibi_slopes is None and terms.position_bias is None:
        return scores
    B, Hkv, G = scores.size(0), scores.size(1), scores.size(2) // tq
    grouped = scores.view(B, Hkv, G, tq, tk)
    distance = _distance(q_start, tq, k_start, tk, scores.device)
    if terms.alibi_slopes is not None:
        grouped.add_(terms.alibi_slopes.to(scores.dtype).view(1, Hkv, G, 1, 1) * distance.to(scores.dtype))
    if terms.position_bias is not None:
        reach = (terms.position_bias.size(1) - 1) // 2
        grouped.add_(terms.position_bias[:, distance + reach].to(scores.dtype).view(1, Hkv, G, tq, tk))
    return scores


def _add_bias_grad(ds: torch.Tensor, terms: ScoreTerms, q_start: int, tq: int, k_start: int, tk: int) -> None:
    """Add a tile's score gradients ``[B, Hkv, G * tq, tk]`` into the bias gradient, by distance."""
    grad = terms.position_bias_grad
    if grad is None:
        return
    heads = grad.size(0)
    index = _distance(q_start, tq, k_start, tk, ds.device) + (grad.size(1) - 1) // 2
    grad.index_add_(1, index.reshape(-1), ds.sum(0).reshape(heads, tq * tk).to(grad.dtype))


def _drop_factor(p: torch.Tensor, dropout: AttentionDropout | None, q_start: int, tq: int, k_start: int,
                 tk: int) -> torch.Tensor | None:
    """The dropout factor of a tile of probabilities ``[B, Hkv, G * tq, tk]``: 0 where dropped, ``1 / (1 - p)``
    where kept (None without dropout)."""
    if dropout is None:
        return None
    B, Hkv, G = p.size(0), p.size(1), p.size(2) // tq
    keep = dropout.keep(B, Hkv * G, q_start, tq, k_start, tk).view(B, Hkv, G * tq, tk)
    return keep.to(p.dtype) * dropout.scale


def _tiled_forward(q, k, v, block: _Block):
    spec, terms, scale, o = block.spec, block.terms, block.scale, block.options
    q_offset, k_offset, key_mask, segment_ids, softcap = o.q_offset, o.k_offset, o.key_mask, o.segment_ids, o.softcap
    (B, H, Sq, D), (Hkv, Sk), Dv = q.shape, k.shape[1:3], v.size(-1)
    G, ct = H // Hkv, compute_dtype(q.dtype)
    out = q.new_zeros((B, Hkv, G, Sq, Dv), dtype=ct)
    lse = q.new_full((B, Hkv, G, Sq), _NEG_INF, dtype=ct)
    grouped = q.unflatten(1, (Hkv, G))
    for tiles in _tiles(spec, q_offset, Sq, k_offset, Sk, q_outer=True, segment_ids=segment_ids if DOCUMENT_BLOCKS else None):
        i, tq = tiles[0][:2]
        rows = (grouped[:, :, :, i:i + tq].to(ct) * scale).reshape(B, Hkv, G * tq, D)
        row_max = row_sum = acc = None
        for _, _, j, tk, visibility in tiles:
            s, _ = _soft_cap(rows @ k[:, :, j:j + tk].to(ct).transpose(-1, -2), softcap)
            s = _biased(s, terms, q_offset + i, tq, k_offset + j, tk)
            mask = _tile_mask(spec, visibility, q_offset, i, tq, k_offset, j, tk, key_mask, segment_ids, q.device)
            if mask is not None:
                s.view(B, Hkv, G, tq, tk).masked_fill_(~mask, _NEG_INF)
            tile_max = s.amax(-1)
            new_max = tile_max if row_max is None else torch.maximum(row_max, tile_max)
            shift = new_max.masked_fill(new_max == _NEG_INF, 0.0)  # rows with nothing visible yet
            p = s.sub_(shift.unsqueeze(-1)).exp_()
            factor = _drop_factor(p, terms.dropout, q_offset + i, tq, k_offset + j, tk)
            pv = (p if factor is None else p * factor) @ v[:, :, j:j + tk].to(ct)
            if row_max is None:
                row_sum, acc = p.sum(-1), pv
            else:
                alpha = torch.exp(row_max - shift)
                row_sum = row_sum.mul_(alpha).add_(p.sum(-1))
                acc = acc.mul_(alpha.unsqueeze(-1)).add_(pv)
            row_max = new_max
        empty = row_sum == 0  # no visible key in the whole block
        out[:, :, :, i:i + tq] = (acc / row_sum.masked_fill(empty, 1.0).unsqueeze(-1)).view(B, Hkv, G, tq, Dv)
        lse[:, :, :, i:i + tq] = (shift + row_sum.log()).view(B, Hkv, G, tq)
    return out.view(B, H, Sq, Dv), lse.view(B, H, Sq)


def _tiled_backward(dout, q, k, v, out, lse, delta, block: _Block):
    spec, terms, scale, o = block.spec, block.terms, block.scale, block.options
    q_offset, k_offset, key_mask, segment_ids, softcap = o.q_offset, o.k_offset, o.key_mask, o.segment_ids, o.softcap
    (B, H, Sq, D), (Hkv, Sk) = q.shape, k.shape[1:3]
    G, ct = H // Hkv, compute_dtype(q.dtype)
    if delta is None:
        delta = row_delta(dout, out)
    # Rows with no visible key anywhere (lse = -inf) get lse = +inf, so every p = exp(s - lse) is 0.
    lse = lse.to(ct).masked_fill(lse == _NEG_INF, float("inf")).reshape(B, Hkv, G, Sq)
    delta = delta.to(ct).reshape(B, Hkv, G, Sq)
    q_grouped, dout_grouped, Dv = q.unflatten(1, (Hkv, G)), dout.unflatten(1, (Hkv, G)), v.size(-1)
    dq = q.new_zeros((B, Hkv, G, Sq, D), dtype=ct)
    dk, dv = k.new_zeros(k.shape, dtype=ct), v.new_zeros(v.shape, dtype=ct)
    for tiles in _tiles(spec, q_offset, Sq, k_offset, Sk, q_outer=False, segment_ids=segment_ids if DOCUMENT_BLOCKS else None):
        j, tk = tiles[0][2:4]
        keys, values = k[:, :, j:j + tk].to(ct), v[:, :, j:j + tk].to(ct)
        for i, tq, _, _, visibility in tiles:
            rows = (q_grouped[:, :, :, i:i + tq].to(ct) * scale).reshape(B, Hkv, G * tq, D)
            grad_rows = dout_grouped[:, :, :, i:i + tq].to(ct).reshape(B, Hkv, G * tq, Dv)
            s, tanh = _soft_cap(rows @ keys.transpose(-1, -2), softcap)
            s = _biased(s, terms, q_offset + i, tq, k_offset + j, tk)
            mask = _tile_mask(spec, visibility, q_offset, i, tq, k_offset, j, tk, key_mask, segment_ids, q.device)
            if mask is not None:
                s.view(B, Hkv, G, tq, tk).masked_fill_(~mask, _NEG_INF)
            p = s.sub_(lse[:, :, :, i:i + tq].reshape(B, Hkv, G * tq, 1)).exp_()
            factor = _drop_factor(p, terms.dropout, q_offset + i, tq, k_offset + j, tk)
            dv[:, :, j:j + tk] += (p if factor is None else p * factor).transpose(-1, -2) @ grad_rows
            dp = grad_rows @ values.transpose(-1, -2)
            if factor is not None:  # out = sum_j p_j z_j v_j: d out / d p_j = z_j v_j
                dp.mul_(factor)
            ds = p.mul_(dp.sub_(delta[:, :, :, i:i + tq].reshape(B, Hkv, G * tq, 1)))
            _add_bias_grad(ds, terms, q_offset + i, tq, k_offset + j, tk)  # the bias is added after the cap
            if tanh is not None:  # through the cap: d(c * tanh(s / c)) / ds = 1 - tanh^2
                ds.mul_(1.0 - tanh.square_())
            dq[:, :, :, i:i + tq] += (ds @ keys).mul_(scale).view(B, Hkv, G, tq, D)
            dk[:, :, j:j + tk] += ds.transpose(-1, -2) @ rows
    return dq.view(B, H, Sq, D), dk, dv
