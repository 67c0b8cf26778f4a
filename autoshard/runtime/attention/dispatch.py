"""Balancing packed documents: which rank computes which chunk of queries (all-gather attention).

A rank's attention work is the number of visible (query, key) pairs of its queries. The zigzag layout evens it
out for one causal sequence, but packed documents make the work depend on where the documents fall: the rank
holding the long documents' tails does the most. The all-gather strategy holds every key on every rank, so any
rank can compute any query; :func:`balance` moves work without changing who holds which tokens:

1. every rank's queries are cut into chunks of at most :func:`chunk_size` positions, each inside one interval of
   the layout (so a chunk has one owner and is a run of global positions);
2. each chunk is priced by its visible pairs under the position mask and the documents (the segment ids every
   rank holds after the all-gather, :func:`.documents.range_work`);
3. chunks start with their owners; while the most loaded rank holds a chunk whose cost is below its gap to the
   least loaded rank, the chunk whose cost is closest to half the gap moves there (each move lowers the larger of
   the two loads, so the loop ends, and a batch already balanced moves nothing).

Moved chunks' queries travel to their new rank by one all-to-all and their ``(out, lse)`` come back by another
(:class:`Dispatch` gives every rank's sends and receives); the backward sends ``q``, ``dout``, ``out`` and ``lse``
of the same chunks and returns their ``dq``, while ``dk``/``dv`` are reduce-scattered as the all-gather always does.

Why chunks of queries and not a data-dependent token layout (per-document zigzag): the layout of the whole model
(embeddings, norms, MLP, loss) is static in the compiled graph, and attention is the one op whose cost depends on
the documents. Moving queries inside it leaves every other op, positions, labels and shifted losses as they are,
and a new packing needs no recompilation. Every rank computes the same dispatch from the same gathered ids in
integer arithmetic, so no collective has to agree it; the bytes the all-to-alls send depend on the data, and are
counted as ``"dispatch"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..layouts import SequenceLayout
from .blocks import Piece, pieces
from .documents import range_work
from .masks import MaskSpec

__all__ = ["Chunk", "Dispatch", "balance", "chunk_size", "global_ids", "last_dispatch", "BALANCE", "CHUNKS_PER_RANK", "MIN_CHUNK"]

CHUNKS_PER_RANK = 16
"""Chunks every rank's queries are cut into (finer chunks balance closer, at more kernel calls)."""
MIN_CHUNK = 32
"""The smallest chunk, in positions."""
BALANCE = True
"""Dispatch packed documents' queries by work (False: every rank computes its own queries; for benchmarks)."""


@dataclass(frozen=True)
class Chunk(Piece):
    """A piece of one rank's queries (``local`` in the owner's shard): the unit the dispatch moves."""

    owner: int


@dataclass(frozen=True)
class Dispatch:
    """Which rank computes every chunk, and the work (visible pairs) every rank gets."""

    chunks: tuple[Chunk, ...]
    assignee: tuple[int, ...]
    """``assignee[n]``: the rank that computes ``chunks[n]``."""
    work: tuple[int, ...]
    """Visible pairs every rank computes under this dispatch."""
    owner_work: tuple[int, ...]
    """Visible pairs every rank would compute on its own queries."""
    layout: SequenceLayout = field(compare=False)
    spec: MaskSpec = field(compare=False)
    ids: torch.Tensor = field(compare=False)
    """The documents it balances (``[B, S]`` segment ids in global order)."""

    def ids_of(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """The segment ids of ``chunks``' positions, concatenated (``[B, total length]``)."""
        return torch.cat([self.ids[:, c.start:c.start + c.length] for c in chunks] or [self.ids[:, :0]], 1)

    @property
    def moves(self) -> bool:
        """Whether any chunk leaves its owner (otherwise nothing is exchanged)."""
        return any(c.owner != a for c, a in zip(self.chunks, self.assignee))

    def kept(self, rank: int) -> tuple[Piece, ...]:
        """The pieces of ``rank``'s own queries it computes itself (adjacent chunks joined)."""
        out: list[Piece] = []
        for chunk, assignee in zip(self.chunks, self.assignee):
            if chunk.owner == rank and assignee == rank:
                last = out[-1] if out else None
                if last is not None and last.local + last.length == chunk.local and last.start + last.length == chunk.start:
                    out[-1] = Piece(last.local, last.start, last.length + chunk.length)
                else:
                    out.append(Piece(chunk.local, chunk.start, chunk.length))
        return tuple(out)

    def sent(self, rank: int, world: int) -> list[list[Chunk]]:
        """``sent(rank)[j]``: the chunks of ``rank`` that rank ``j != rank`` computes, in chunk order."""
        out: list[list[Chunk]] = [[] for _ in range(world)]
        for chunk, assignee in zip(self.chunks, self.assignee):
            if chunk.owner == rank and assignee != rank:
                out[assignee].append(chunk)
        return out

    def received(self, rank: int, world: int) -> list[list[Chunk]]:
        """``received(rank)[i]``: the chunks of rank ``i != rank`` that ``rank`` computes, in chunk order."""
        out: list[list[Chunk]] = [[] for _ in range(world)]
        for chunk, assignee in zip(self.chunks, self.assignee):
            if assignee == rank and chunk.owner != rank:
                out[chunk.owner].append(chunk)
        return out

    def bytes_by_rank(self, query_row: int, result_row: int, backward: bool, gradient_row: int = 0) -> list[int]:
        """Bytes every rank sends moving chunks: forward its chunks' queries (``query_row`` bytes a position) and
        the results of the chunks it computed for others (``result_row``: out and lse); backward its chunks'
        ``query_row`` bytes (q, dout, out and lse) and the others' gradients (``gradient_row``: dq)."""
        world = self.layout.world_size
        out_rows = [sum(c.length for chunks in self.sent(r, world) for c in chunks) for r in range(world)]
        in_rows = [sum(c.length for chunks in self.received(r, world) for c in chunks) for r in range(world)]
        back = gradient_row if backward else result_row
        return [n * query_row + m * back for n, m in zip(out_rows, in_rows)]

    def imbalance(self) -> float:
        """max / mean of the ranks' work under this dispatch."""
        return _imbalance(self.work)

    def summary(self) -> str:
        """The ranks' work, its imbalance with and without the dispatch, and the positions moved."""
        moved = sum(c.length for c, a in zip(self.chunks, self.assignee) if c.owner != a)
        work = ", ".join(f"{w:,}" for w in self.work)
        return (f"attention work per rank (visible pairs): {work}; max/mean {self.imbalance():.2f} "
                f"(as laid out {_imbalance(self.owner_work):.2f}); {moved} query positions computed on another rank")


def _imbalance(work: Sequence[int]) -> float:
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0


def chunk_size(layout: SequenceLayout) -> int:
    """Positions per chunk: every rank's shard in about :data:`CHUNKS_PER_RANK` chunks, at least :data:`MIN_CHUNK`."""
    return max(MIN_CHUNK, math.ceil(layout.max_local_length / CHUNKS_PER_RANK))


def _chunks(layout: SequenceLayout, size: int) -> list[Chunk]:
    out = []
    for rank in range(layout.world_size):
        local = 0
        for start, end in layout.local_intervals(rank):
            for lo in range(start, end, size):
                length = min(size, end - lo)
                out.append(Chunk(local, lo, length, owner=rank))
                local += length
    return out


def global_ids(gathered: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """Segment ids ``[B, S]`` in global order, from their all-gather (every rank's shard in rank order)."""
    ids = torch.empty_like(gathered)
    for piece in pieces(layout, range(layout.world_size)):
        ids[:, piece.start:piece.start + piece.length] = gathered[:, piece.rows]
    return ids


def balance(layout: SequenceLayout, ids: torch.Tensor, spec: MaskSpec) -> Dispatch:
    """The dispatch of ``layout``'s queries for the documents ``ids`` (``[B, S]``, global order) under ``spec``.
    Every attention of a step sees the same documents (every layer, forward and backward): the latest dispatch is
    reused when its layout, mask and ids are those asked for."""
    global _last
    if _last is not None and (_last.layout, _last.spec) == (layout, spec) and torch.equal(_last.ids, ids):
        return _last
    world = layout.world_size
    chunks = _chunks(layout, chunk_size(layout))
    cost = range_work(spec, ids, [(c.start, c.start + c.length) for c in chunks])
    assignee = [c.owner for c in chunks]
    load = [0] * world
    for chunk, price in zip(chunks, cost):
        load[chunk.owner] += price
    owner_work = tuple(load)
    for _ in range(len(chunks) * world):  # every move lowers sum(load^2): a bound, never reached in practice
        heavy = max(range(world), key=lambda r: (load[r], -r))
        light = min(range(world), key=lambda r: (load[r], r))
        gap = load[heavy] - load[light]
        movable = [n for n, a in enumerate(assignee) if a == heavy and 0 < cost[n] < gap]
        if not movable:
            break
        best = min(movable, key=lambda n: (abs(2 * cost[n] - gap), n))
        assignee[best] = light
        load[heavy] -= cost[best]
        load[light] += cost[best]
    _last = Dispatch(tuple(chunks), tuple(assignee), tuple(load), owner_work, layout, spec, ids)
    return _last


_last: Dispatch | None = None


def last_dispatch() -> Dispatch | None:
    """The dispatch of the latest attention call with packed documents on this process (what ``explain()`` reports),
    or None."""
    return _last
