"""Packed documents: the (query run, key run) rectangles that share a document.

``segment_ids`` (the pair ``seg_q [B, Sq]``, ``seg_k [B, Sk]``) lets key ``j`` be seen by query ``i`` only when
``seg_q[i] == seg_k[j]``. Packed documents make the ids *runs*: a document is a run of equal ids, so the visible
pairs of a block are a few rectangles, one per (query run, key run) of the same id, each under the block's own
position mask. :func:`document_blocks` finds them from the ids (one ``unique_consecutive`` per row, read on the
host), and :func:`~.local.local_attention` computes each rectangle as a block of its own, at its global offsets
and without a data mask, so it reaches the fused kernels; everything between documents is never computed.

Ids need not be sorted or unique per run: an id that appears in several runs pairs every query run with every
key run of that id (the pieces merge through the LSE). A block whose ids are so fragmented that its rectangles
would be tiny (:data:`MIN_ROWS` query rows per rectangle on average) is left to the tiled path, which skips the
tiles whose id ranges do not meet (:func:`tile_ranges`) and masks the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .masks import MaskSpec

__all__ = ["DocumentBlock", "DocumentGroup", "document_groups", "fragmented", "tile_ranges", "visible_pairs", "range_work",
           "row_runs", "runs_by_id", "MIN_ROWS"]

MIN_ROWS = 16
"""Below this many query rows per rectangle on average, a block is computed tile by tile rather than by document."""


@dataclass(frozen=True)
class DocumentBlock:
    """Queries ``[q_lo, q_hi)`` and keys ``[k_lo, k_hi)`` (local indices) of one document."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int

    @property
    def rows(self) -> slice:
        return slice(self.q_lo, self.q_hi)

    @property
    def cols(self) -> slice:
        return slice(self.k_lo, self.k_hi)


@dataclass(frozen=True)
class DocumentGroup:
    """The batch rows ``batch`` share these document rectangles (every row when the ids of all rows are equal)."""

    batch: slice
    blocks: tuple[DocumentBlock, ...]


def _runs(ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(id, start, end)`` of every run of equal ids of a 1-D tensor."""
    values, counts = torch.unique_consecutive(ids, return_counts=True)
    ends = counts.cumsum(0).tolist()
    starts = [0] + ends[:-1]
    return list(zip(values.tolist(), starts, ends))


def runs_by_id(runs: list[tuple[int, int, int]]) -> dict[int, list[tuple[int, int]]]:
    """The ``(start, end)`` of the runs of every id."""
    by_id: dict[int, list[tuple[int, int]]] = {}
    for value, lo, hi in runs:
        by_id.setdefault(value, []).append((lo, hi))
    return by_id


def _blocks(q_runs: list[tuple[int, int, int]], k_by_id: dict[int, list[tuple[int, int]]]) -> tuple[DocumentBlock, ...]:
    """The rectangles of every query run with every key run of its id."""
    return tuple(DocumentBlock(q_lo, q_hi, k_lo, k_hi) for value, q_lo, q_hi in q_runs
                 for k_lo, k_hi in k_by_id.get(value, ()))


def document_groups(segment_ids: tuple[torch.Tensor, torch.Tensor]) -> list[DocumentGroup]:
    """The document rectangles of a block, per group of batch rows with equal ids (one group when all rows are
    equal, as in a packed batch of one row)."""
    seg_q, seg_k = segment_ids
    batch = seg_q.size(0)
    if batch == 1 or (bool((seg_q == seg_q[:1]).all()) and bool((seg_k == seg_k[:1]).all())):
        return [DocumentGroup(slice(None), _blocks(_runs(seg_q[0]), runs_by_id(_runs(seg_k[0]))))]
    return [DocumentGroup(slice(b, b + 1), _blocks(_runs(seg_q[b]), runs_by_id(_runs(seg_k[b])))) for b in range(batch)]


def fragmented(groups: list[DocumentGroup], q_len: int) -> bool:
    """Whether the rectangles are too small on average to be computed one by one."""
    return any(len(g.blocks) * MIN_ROWS > max(q_len, MIN_ROWS) for g in groups)


def visible_pairs(spec: MaskSpec, q_offset: int, q_len: int, k_offset: int, k_len: int, batch: int,
                  groups: list[DocumentGroup] | None = None) -> int:
    """The visible (query, key) pairs of the block of queries ``[q_offset, q_offset + q_len)`` against keys
    ``[k_offset, k_offset + k_len)`` under ``spec`` and, when ``groups`` gives them, its documents, summed over the
    ``batch`` rows: the one count of visible pairs (the FLOPs counted, :mod:`.flops`, and the dispatch's work,
    :mod:`.dispatch`), each rectangle counted by :meth:`.masks.MaskSpec.visible_pairs`."""
    if groups is None:
        return batch * spec.visible_pairs(q_offset, q_len, k_offset, k_len)
    total = 0
    for group in groups:
        rows = len(range(batch)[group.batch])
        total += rows * sum(spec.visible_pairs(q_offset + b.q_lo, b.q_hi - b.q_lo, k_offset + b.k_lo, b.k_hi - b.k_lo)
                            for b in group.blocks)
    return total


def tile_ranges(ids: torch.Tensor, tile: int) -> list[tuple[int, int]]:
    """``(min, max)`` of the ids ``[B, S]`` of every ``tile``-position tile (over all batch rows): two tiles whose
    ranges do not meet share no document."""
    length = ids.size(1)
    padded = torch.nn.functional.pad(ids, (0, -length % tile), value=0) if length % tile else ids
    tiles = padded.view(ids.size(0), -1, tile)
    last = length - (tiles.size(1) - 1) * tile  # the last tile's real width
    low, high = tiles.amin((0, 2)), tiles.amax((0, 2))
    if last < tile:  # the padding must not widen the last tile's range
        low[-1], high[-1] = ids[:, -last:].min(), ids[:, -last:].max()
    return list(zip(low.tolist(), high.tolist()))


def row_runs(ids: torch.Tensor) -> list[tuple[slice, list[tuple[int, int, int]]]]:
    """The runs ``(id, start, end)`` of the ids ``[B, S]`` per group of batch rows with equal ids: one group (every
    row) when all rows are equal, else one per row."""
    if ids.size(0) == 1 or bool((ids == ids[:1]).all()):
        return [(slice(None), _runs(ids[0]))]
    return [(slice(b, b + 1), _runs(ids[b])) for b in range(ids.size(0))]


def range_work(spec: MaskSpec, ids: torch.Tensor, ranges: list[tuple[int, int]]) -> list[int]:
    """The visible pairs of the queries at global positions ``[start, end)`` of every range against every key of the
    sequence, under ``spec`` and the documents of ``ids`` (``[B, S]``, in global order), summed over batch rows."""
    batch, length = ids.shape
    rows = row_runs(ids)
    by_id = [runs_by_id(runs) for _, runs in rows]
    work = []
    for start, end in ranges:
        groups = [DocumentGroup(at, _blocks([(value, max(lo, start) - start, min(hi, end) - start)
                                             for value, lo, hi in runs if max(lo, start) < min(hi, end)], keys))
                  for (at, runs), keys in zip(rows, by_id)]
        work.append(visible_pairs(spec, start, end - start, 0, length, batch, groups))
    return work
