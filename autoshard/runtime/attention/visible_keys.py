"""Packed documents: every rank fetches only the keys its queries see (the all-gather, restricted by the documents).

The all-gather strategy gives every rank every key. With packed documents a query sees only keys of its own document
(under a causal mask, those before it), so a rank computes with the keys of the documents its queries touch and no
other: a document that sits whole on the rank computing its queries needs no key from anywhere. :func:`key_fetch`
computes, on every rank alike from the segment ids every rank holds after their all-gather (integer arithmetic, no
agreement collective), the runs of global key positions every rank needs and does not hold: those visible, under
the position mask and the documents, to the query ranges it computes (its own queries as the dispatch of
:mod:`.dispatch` keeps them, and the chunks it computes for other ranks), less its own shard.

Forward: one all-to-all per tensor sends every rank the K and V rows it fetches; the rank attends to its own shard
followed by the fetched rows (:meth:`KeyFetch.pieces`). Backward: the rows are fetched again (the op keeps only its
inputs), and the fetched rows' dK/dV go back to their owners by the inverse all-to-all and are added there (where
the all-gather reduce-scatters the dK/dV of the whole sequence). The bytes depend on the data: they are counted as
``"key_fetch"``, and a batch of documents that each sit whole on one rank sends none.

It works over whatever layout the call reads: the compiled one (then a document that straddles two ranks' shards
fetches its earlier part, and a long document's queries that the dispatch moves for balance fetch the keys before
them), or the documents placed by their lengths (:mod:`~autoshard.runtime.placement`: short documents whole on one
rank, long ones zigzag over a group), where only the split documents fetch keys.

When the documents are so long that the busiest rank would fetch most of the sequence anyway, the all-gather moves
as much in a cheaper collective: :attr:`KeyFetch.worth_it` chooses, per call and on every rank alike, and
``explain()`` reports the latest choice and its rows.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..layouts import Interval, SequenceLayout
from .blocks import Piece, pieces
from .dispatch import Dispatch
from .documents import row_runs, runs_by_id
from .masks import MaskSpec

__all__ = ["KeyFetch", "key_fetch", "last_fetch", "FETCH", "FETCH_SHARE"]

FETCH = True
"""Fetch packed documents' visible keys (False: the all-gather brings every key, as before; for benchmarks)."""

FETCH_SHARE = 0.75
"""Fetch the visible keys when the busiest rank receives at most this share of the rows an all-gather would bring it
(above it the all-gather's one collective moves about as much, more cheaply)."""


@dataclass(frozen=True)
class KeyFetch:
    """The key rows every rank computes with and another rank holds."""

    layout: SequenceLayout
    runs: tuple[tuple[Interval, ...], ...]
    """``runs[r]``: the sorted, disjoint runs ``[start, end)`` of global positions rank ``r`` fetches."""
    ids: torch.Tensor = field(compare=False)
    """The documents (``[B, S]`` segment ids in global order) it was computed from."""

    @functools.cached_property
    def _by_sender(self) -> tuple[tuple[tuple[tuple[int, int, int], ...], ...], ...]:
        """``[receiver][sender]``: ``(global start, length, sender's local row)`` of every run piece, in global
        order: each fetched run cut where the layout's shards change owner."""
        layout = self.layout
        spans = layout.spans
        local_start, seen = {}, [0] * layout.world_size
        for rank in range(layout.world_size):
            for start, end in layout.local_intervals(rank):
                local_start[start] = seen[rank]
                seen[rank] += end - start
        starts = [s for s, _, _ in spans]
        out = []
        for runs in self.runs:
            per_sender: list[list[tuple[int, int, int]]] = [[] for _ in range(layout.world_size)]
            for lo, hi in runs:
                n = bisect.bisect_right(starts, lo) - 1
                while lo < hi:
                    s, e, owner = spans[n]
                    cut = min(e, hi)
                    per_sender[owner].append((lo, cut - lo, local_start[s] + lo - s))
                    lo, n = cut, n + 1
            out.append(tuple(tuple(p) for p in per_sender))
        return tuple(out)

    @functools.cached_property
    def rows(self) -> tuple[int, ...]:
        """Rows every rank fetches."""
        return tuple(sum(e - s for s, e in runs) for runs in self.runs)

    @property
    def worth_it(self) -> bool:
        """Whether fetching beats the all-gather (:data:`FETCH_SHARE`): the same decision on every rank."""
        gathered = (self.layout.world_size - 1) * self.layout.max_local_length
        return FETCH and max(self.rows) <= FETCH_SHARE * gathered

    def received_sizes(self, rank: int) -> list[int]:
        """Rows ``rank`` receives from every rank (rank order)."""
        return [sum(n for _, n, _ in sender) for sender in self._by_sender[rank]]

    def sent_sizes(self, rank: int) -> list[int]:
        """Rows ``rank`` sends to every rank (rank order)."""
        return [sum(n for _, n, _ in self._by_sender[receiver][rank]) for receiver in range(self.layout.world_size)]

    def sent_rows(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The local rows of ``rank``'s shard it sends, receiver after receiver (the all-to-all's order)."""
        return self._sent_rows[rank].to(device)

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """The pieces of ``rank``'s keys: its own shard, then the fetched rows in the order the all-to-all
        delivers them (sender after sender, each sender's in global order)."""
        return self._pieces[rank]

    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The global position of every key row of ``rank`` (its :meth:`pieces`, in order)."""
        return self._positions[rank].to(device)

    @functools.cached_property
    def _sent_rows(self) -> tuple[torch.Tensor, ...]:
        world = self.layout.world_size
        return tuple(_indices([(local, n) for receiver in range(world) for _, n, local in self._by_sender[receiver][r]])
                     for r in range(world))

    @functools.cached_property
    def _pieces(self) -> tuple[tuple[Piece, ...], ...]:
        out = []
        for rank, senders in enumerate(self._by_sender):
            local, fetched = self.layout.local_length(rank), []
            for sender in senders:
                for start, n, _ in sender:
                    fetched.append(Piece(local, start, n))
                    local += n
            out.append(pieces(self.layout, [rank]) + tuple(fetched))
        return tuple(out)

    @functools.cached_property
    def _positions(self) -> tuple[torch.Tensor, ...]:
        return tuple(_indices([(p.start, p.length) for p in rank_pieces]) for rank_pieces in self._pieces)

    def bytes_by_rank(self, row: int, gradient_row: int, backward: bool) -> list[int]:
        """Bytes every rank sends fetching: its rows others fetch (``row`` bytes each: K and V of the batch), and
        ``backward`` the same again plus the gradients of the rows it fetched (``gradient_row`` bytes each)."""
        world = self.layout.world_size
        sent = [sum(self.sent_sizes(r)) * row for r in range(world)]
        if backward:
            sent = [n + sum(self.received_sizes(r)) * gradient_row for r, n in enumerate(sent)]
        return sent

    def summary(self) -> str:
        """The rows every rank fetched, against what the all-gather brings each."""
        gathered = (self.layout.world_size - 1) * self.layout.max_local_length
        choice = ("fetched" if self.worth_it else "all-gathered" + (
            f" (the busiest rank needs > {FETCH_SHARE:.0%} of them)" if FETCH else ""))
        return (f"key rows fetched per rank {', '.join(f'{n:,}' for n in self.rows)} of {gathered:,} an all-gather "
                f"brings: {choice}")


def _indices(runs: list[tuple[int, int]]) -> torch.Tensor:
    """The indices of the runs ``(start, length)``, concatenated, on the host (a call copies them to its device once;
    every attention of a step reuses them)."""
    parts = [torch.arange(start, start + n) for start, n in runs]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


def _key_window(spec: MaskSpec, start: int, end: int, length: int) -> Interval:
    """The keys the position mask lets the queries ``[start, end)`` see, as one range (a superset under chunks)."""
    lo = 0 if spec.lower is None else max(0, start - spec.lower)
    hi = length if spec.upper is None else min(length, end + spec.upper)
    if spec.chunk:
        lo, hi = max(lo, start // spec.chunk * spec.chunk), min(hi, ((end - 1) // spec.chunk + 1) * spec.chunk)
    return lo, hi


def _merged(runs: list[Interval]) -> list[Interval]:
    out: list[list[int]] = []
    for lo, hi in sorted(runs):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _minus(runs: list[Interval], held: Sequence[Interval]) -> tuple[Interval, ...]:
    """``runs`` less the positions of ``held`` (both sorted and disjoint)."""
    out = []
    for lo, hi in runs:
        for s, e in held:
            if e <= lo or s >= hi:
                continue
            if s > lo:
                out.append((lo, s))
            lo = max(lo, e)
            if lo >= hi:
                break
        if lo < hi:
            out.append((lo, hi))
    return tuple(out)


def _needed(ranges: Sequence[Interval], groups, spec: MaskSpec, length: int) -> list[Interval]:
    """The keys visible to the queries of ``ranges`` under ``spec`` and the documents (``groups``: per group of
    batch rows, the runs and their starts and runs by id)."""
    out = []
    for runs, starts, by_id in groups:
        for start, end in ranges:
            window_lo, window_hi = _key_window(spec, start, end, length)
            n = max(0, bisect.bisect_right(starts, start) - 1)
            while n < len(runs) and runs[n][1] < end:
                for lo, hi in by_id[runs[n][0]]:
                    lo, hi = max(lo, window_lo), min(hi, window_hi)
                    if lo < hi:
                        out.append((lo, hi))
                n += 1
    return _merged(out)


def key_fetch(layout: SequenceLayout, ids: torch.Tensor, spec: MaskSpec, dispatch: Dispatch | None) -> KeyFetch:
    """The keys every rank fetches for the documents ``ids`` (``[B, S]``, global order) under ``spec``, its queries
    computed as ``dispatch`` says (None: every rank its own). The latest is reused when asked for again (every
    attention of a step sees the same documents)."""
    global _last
    if (_last is not None and _last[0].layout == layout and _last[1:] == (spec, dispatch)
            and torch.equal(_last[0].ids, ids)):
        return _last[0]
    groups = [(runs, [lo for _, lo, _ in runs], runs_by_id(runs)) for _, runs in row_runs(ids)]
    fetched = []
    for rank in range(layout.world_size):
        if dispatch is None:
            ranges = list(layout.local_intervals(rank))
        else:
            computed = dispatch.kept(rank) + tuple(c for chunks in dispatch.received(rank, layout.world_size)
                                                   for c in chunks)
            ranges = [(p.start, p.start + p.length) for p in computed]
        fetched.append(_minus(_needed(ranges, groups, spec, ids.size(1)), layout.local_intervals(rank)))
    _last = (KeyFetch(layout, tuple(fetched), ids), spec, dispatch)
    return _last[0]


_last: tuple[KeyFetch, MaskSpec, Dispatch | None] | None = None


def last_fetch() -> KeyFetch | None:
    """The key fetch of the latest attention call with packed documents on this process (what ``explain()``
    reports), or None."""
    return None if _last is None else _last[0]
