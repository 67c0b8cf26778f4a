"""Packed documents placed by their lengths: short documents whole on one rank, long ones split over several.

The compiled layout (zigzag or contiguous) cuts a packed row by position, whatever its documents: a short document
that straddles a cut fetches keys from its neighbour, and a long one lands wherever the row put it, so the ranks
holding its tail carry most of the attention work and the dispatch moves their queries (and the keys those need)
to the others. :func:`document_layout` places the row by its documents instead, for every call from the
``position_ids`` it is given (each restart begins a document, the rule transformers uses), identically on every
rank (integer arithmetic on the replicated ids, no agreement collective):

* a document whose attention work exceeds a rank's share, or whose tokens exceed a rank's, is split over the
  fewest ranks that carry it (those with the most room left), zigzag inside that group (its ``2k`` chunks, member
  ``j`` holding chunks ``j`` and ``2k - 1 - j``), so each member does the same share of its causal work;
* every other document goes whole to the rank with the least work that has room for it; one that fits nowhere
  fills the ranks with room left (the only documents cut).

Every rank keeps exactly as many tokens as the compiled layout gives it, so the compiled graph's shapes hold and a
new placement never compiles again: :func:`~autoshard.runtime.layouts.placing` makes every op of the call read the
placed layout where it was compiled with the static one (:class:`Placement`). The layouts derived from the static
one (labels shifted by one, a token prepended: found from their cuts, :class:`_Swaps`) are swapped for the same
derivation of the placed one; the :data:`PINNED` first and last positions keep their rank, so those keep their
local lengths too.

A graph runs under a placement only where every ``autoshard`` op it holds reads its layout as intervals, whatever
they are (:data:`PLACEABLE_OPS`; attention only by all-gather, the strategy whose keys follow the documents). The
graph that takes ``position_ids`` (replicated, and nothing split from an earlier graph) places them
(:func:`placing_documents`), priced with its own attention's :class:`Documents` or, for a graph before the layers'
graphs (an embedding, per-layer FSDP2 graphs, a graph break), those of a later graph compiled for its layout, from
the call after that one compiled. What leaves split carries the placement
(:attr:`~autoshard.runtime.split_tensor.SplitTensor.placed`; the layout dynamo guards stays the compiled one), so the
next graph runs under it, or takes it realigned to its compiled layout where one of its ops is not in the table (a
convolution's halo); a user who reads it gets the caller's order. A graph of a length class places each call over
the compiled layout of that call's length. Not placed: batches of several rows.

Backward: the ops' gradients read their layouts again when autograd runs them, after the call returned. The call's
outputs pass through :class:`_Placed`, an identity whose backward, which autograd runs before any gradient of the
call, restores the call's placement until that backward pass ends (a callback of the autograd engine), so the
backward (and any forward a checkpoint recomputes) reads the layout its forward read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from .attention.dispatch import balance
from .attention.masks import MaskSpec
from .attention.visible_keys import key_fetch
from .layouts import SequenceLayout, current_swaps, placing, set_swaps, split_sizes
from .symbolic import is_symbolic as _symbolic

__all__ = ["Placement", "Documents", "document_layout", "placing_documents", "marked", "last_placement", "segments_of",
           "PLACE", "PLACEABLE_OPS"]

PLACE = True
"""Place packed documents by their lengths (False: every call runs its compiled layout; for benchmarks)."""

PINNED = 16
"""Positions at each end of the row that keep their compiled rank, so that a layout derived from the compiled one by
up to this many positions (labels shifted, tokens prepended) keeps its local lengths under the placement."""

PLACEABLE_OPS = frozenset({
    "seq_shard", "seq_unshard", "seq_reduce_scatter", "seq_unshard_for_local_use",  # pieces of the intervals
    "seq_realign",  # moves between any two layouts
    "seq_cumsum",  # per-interval totals, summed in global order
    "seq_local_index", "seq_arg_extreme", "sequence_draw",  # global positions of the local rows
    "attention",  # the all-gather strategy only: its keys, dispatch and masks go by position
    "check_runs", "check_band",  # checks of values, not of a layout
})
"""The ``autoshard`` ops a placed graph may hold: each reads its layout as intervals, whatever they are."""


@dataclass(frozen=True)
class Placement:
    """One call's placement: the static layout it replaces, the placed one, and the swaps every op reads."""

    root: SequenceLayout
    """The compiled layout of the packed row."""
    layout: SequenceLayout
    """Where the documents go."""
    swaps: dict = field(compare=False, repr=False)
    """Compiled layout -> placed layout: ``root`` and every layout derived from it."""
    ids: torch.Tensor = field(compare=False, repr=False)
    """The documents (``[1, S]`` segment ids) it was computed from."""

    @staticmethod
    def of(documents: "Documents", ids: torch.Tensor) -> "Placement | None":
        """The placement of the documents ``ids`` (``[1, S]``) over the ranks of the compiled layout of ``S``
        positions, or None where it would send no less for this batch (:meth:`Documents.busiest_elements`): the call then runs
        the compiled layout. The latest is reused for the same ids (every graph call of a step)."""
        global _last
        root = documents.root(ids.size(-1))
        if _last is not None and _last.root == root and torch.equal(_last.ids, ids):
            return _last if _last.swaps else None
        layout = document_layout(root, ids)
        swaps = _Swaps(root, layout) if layout is not None else {}
        if swaps and documents.busiest_elements(root, ids) <= documents.busiest_elements(layout, ids):  # the placed one last: the call's
            swaps = {}
        _last = Placement(root, layout, swaps, ids)
        return _last if swaps else None

    def summary(self) -> str:
        """Tokens and documents per rank, for ``explain()``."""
        if not self.swaps:
            return ("compiled layout kept (placing the documents by length would send more, or change a layout's "
                    "local lengths)")
        runs = _documents(self.ids)
        whole = [sum(1 for s, e in runs if any(a <= s and e <= b for a, b in self.layout.local_intervals(r)))
                 for r in range(self.layout.world_size)]
        split = sum(1 for s, e in runs if not any(a <= s and e <= b for a, b, _ in self.layout.spans))
        return (f"documents placed by length: {len(runs)} documents, {split} split over ranks; whole documents per "
                f"rank {', '.join(map(str, whole))}; tokens per rank {', '.join(map(str, self.layout.local_lengths))}")


class _Swaps(dict):
    """Compiled layout -> placed layout: the root, and every layout derived from it (position ``i`` on the rank of the
    root's ``i + offset``: labels shifted, a token prepended; :meth:`~autoshard.runtime.layouts.SequenceLayout.derive`)
    swapped for the same derivation of the placed root, found from its cuts when first read; any other layout is
    itself."""

    def __init__(self, root: SequenceLayout, placed: SequenceLayout):
        super().__init__({root: placed})
        self.root, self.placed = root, placed

    def get(self, layout, default=None):
        if layout not in self:
            offset = _offset(self.root, layout)
            swap = layout if offset is None else _derive(self.placed, offset, layout.length)
            if swap.local_lengths != layout.local_lengths:
                raise ValueError(
                    f"autoshard: packed documents placed by length move {layout!r}'s tokens between ranks (local "
                    f"lengths {swap.local_lengths}, compiled {layout.local_lengths}: a derivation by {offset} "
                    f"positions, more than the {PINNED} kept at each end); autoshard.runtime.placement.PLACE = False "
                    f"runs every call in its compiled layout")
            self[layout] = swap
        return self[layout]


def _offset(root: SequenceLayout, layout: SequenceLayout) -> int | None:
    """The ``offset`` with ``root.derive(offset, layout.length) == layout``, or None (the root itself, a built-in
    layout, one of other cuts). A derivation keeps the root's cuts between ranks, moved by ``-offset``: the first
    cut of ``layout`` names the candidates."""
    if layout.kind != "derived" or layout.world_size != root.world_size or _symbolic(layout.length):
        return None
    cuts = [s for s, _, _ in layout.spans[1:]]
    candidates = [s - cuts[0] for s, _, _ in root.spans[1:]] if cuts else []
    found = [o for o in candidates if _derive(root, o, layout.length) == layout]
    return found[0] if len(found) == 1 else None


@dataclass(frozen=True)
class Documents:
    """What placing a compiled graph's packed documents needs: the layout their attention was compiled for, its mask,
    and the elements per position it moves."""

    kind: str
    """The compiled layout's kind (``"zigzag"`` or ``"contiguous"``), at every length of a graph of a length class."""
    world_size: int
    """Ranks."""
    spec: MaskSpec
    """The position mask."""
    key_row: int
    """Elements of one position's K and V."""
    query_row: int
    """Elements of one position's queries."""
    result_row: int
    """Elements of one position's output and log-sum-exp."""

    def root(self, length: int) -> SequenceLayout:
        """The compiled layout of ``length`` positions (what a placement replaces)."""
        return SequenceLayout.of(self.kind, length, self.world_size)

    def busiest_elements(self, layout: SequenceLayout, ids: torch.Tensor) -> int:
        """Elements the busiest rank sends in the forward of one attention over ``layout``: the keys it fetches
        for others and the queries it dispatches and results it returns (the backward sends in proportion)."""
        dispatched = balance(layout, ids, self.spec)
        fetch = key_fetch(layout, ids, self.spec, dispatched)
        keys = (fetch.bytes_by_rank(self.key_row, 0, False) if fetch.worth_it else
                [(layout.world_size - 1) * n * self.key_row for n in layout.local_lengths])
        moved = dispatched.bytes_by_rank(self.query_row, self.result_row, False)
        return max(k + m for k, m in zip(keys, moved))


def _derive(layout: SequenceLayout, offset: int, length: int) -> SequenceLayout:
    with placing({}):  # a placement's derived layouts are not compiled ones
        return layout.derive(offset, length)


_last: Placement | None = None


def last_placement() -> Placement | None:
    """The placement considered for the latest call with documents to place on this process (what ``explain()``
    reports; its ``swaps`` empty where the call kept its compiled layout), or None."""
    return _last


def _shares(length: int, room: list[int]) -> list[int] | None:
    """Tokens of a ``length``-token document each member of its group holds: even, as far as each one's ``room``
    allows (a member whose room is short gives the rest to the others); None where the group's room is short."""
    shares = [min(n, r) for n, r in zip(split_sizes(length, len(room)), room)]
    left = length - sum(shares)
    for j, r in enumerate(room):
        more = min(left, r - shares[j])
        shares[j] += more
        left -= more
    return None if left else shares


def _documents(ids: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of every run of equal ids in row 0."""
    row = ids[0]
    cuts = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
    bounds = [0] + cuts + [row.numel()]
    return list(zip(bounds[:-1], bounds[1:]))


def _work(length: int) -> int:
    return length * (length + 1) // 2


def document_layout(root: SequenceLayout, ids: torch.Tensor) -> SequenceLayout | None:
    """The documents ``ids`` (``[1, S]`` segment ids, global order) placed over ``root``'s ranks, every rank holding
    as many tokens as in ``root`` and the :data:`PINNED` first and last positions on their ``root`` rank; None where
    the documents do not allow that (the call keeps ``root``)."""
    if ids.shape != (1, root.length):
        return None
    world = root.world_size
    docs = _documents(ids)
    room = list(root.local_lengths)
    share, total = max(room), sum(_work(e - s) for s, e in docs)
    ends = {pos: root.owner(pos) for pos in (*range(min(PINNED, root.length)),
                                             *range(max(0, root.length - PINNED), root.length))}
    load = [0] * world
    held: list[list[tuple[int, int]]] = [[] for _ in range(world)]

    def take(rank: int, start: int, end: int, work: int) -> None:
        held[rank].append((start, end))
        room[rank] -= end - start
        load[rank] += work

    def pins(start: int, end: int) -> list[int]:
        return list(dict.fromkeys(rank for pos, rank in ends.items() if start <= pos < end))

    def parts(start: int, end: int) -> int:
        return min(world, max(-(-(end - start) // share), -(-_work(end - start) * world // total)))

    short = sorted((d for d in docs if parts(*d) == 1), key=lambda d: (not pins(*d), d[0] - d[1], d[0]))
    long = sorted((d for d in docs if parts(*d) > 1), key=lambda d: (d[0] - d[1], d[0]))
    for start, end in [d for d in short if pins(*d)]:  # the first and last documents, on their ranks
        rank = pins(start, end)
        if len(rank) > 1 or room[rank[0]] < end - start:
            return None
        take(rank[0], start, end, _work(end - start))
    for start, end in long:  # zigzag over the ranks with the most room
        k, pinned = parts(start, end), pins(start, end)
        if len(pinned) > 1:
            return None  # chunks 0 and 2k-1 both pinned: one member holds both, only where root does too
        group = (pinned + sorted((r for r in range(world) if r not in pinned), key=lambda r: (-room[r], load[r], r)))
        shares = None
        while shares is None and k <= world:  # a group whose room is short grows
            shares = _shares(end - start, [room[r] for r in group[:k]])
            k += shares is None
        if shares is None:
            return None
        sizes = [0] * (2 * k)
        for j, n in enumerate(shares):  # member j: chunk j early in the document, chunk 2k-1-j as late
            sizes[j], sizes[2 * k - 1 - j] = n // 2, n - n // 2
        bounds = [start]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        for j, rank in enumerate(group[:k]):
            for c in (j, 2 * k - 1 - j):
                if bounds[c + 1] > bounds[c]:
                    take(rank, bounds[c], bounds[c + 1], _work(bounds[c + 1] - start) - _work(bounds[c] - start))
    for start, end in [d for d in short if not pins(*d)]:  # whole where there is room, least work first
        fits = [r for r in range(world) if room[r] >= end - start]
        if fits:
            take(min(fits, key=lambda r: (load[r], r)), start, end, _work(end - start))
            continue
        for rank in sorted(range(world), key=lambda r: (-room[r], r)):  # fits nowhere: cut over the room left
            n = min(room[rank], end - start)
            if n:
                take(rank, start, start + n, _work(n))
                start += n
    if any(room):
        return None
    layout = SequenceLayout.from_intervals(root.length, held)
    return layout if all(layout.owner(pos) == rank for pos, rank in ends.items()) else None


class _Placed(torch.autograd.Function):
    """Identity on a call's outputs; its backward (autograd runs it before any gradient of the call) restores the
    call's placement until the backward pass ends."""

    @staticmethod
    def forward(ctx, swaps, *outputs):
        ctx.swaps = swaps
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        set_swaps(ctx.swaps)
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(set_swaps, {}))
        return (None, *grads)


def marked(run: Callable) -> Callable:
    """``run`` (a compiled rank graph) with its outputs passed through :class:`_Placed` when it runs under a
    placement, so that their backward runs under it too."""
    def call(*args):
        out = run(*args)
        swaps = current_swaps()
        if not swaps or not torch.is_grad_enabled():
            return out
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        grads = [i for i, o in enumerate(flat) if isinstance(o, torch.Tensor) and o.requires_grad]
        if grads:
            for i, o in zip(grads, _Placed.apply(swaps, *(flat[i] for i in grads))):
                flat[i] = o
        return type(out)(flat) if isinstance(out, (tuple, list)) else flat[0]
    return call


def placing_documents(run: Callable, documents: Callable[[], Documents | None],
                      positions_of: Callable[[tuple], torch.Tensor]) -> Callable:
    """``run`` (a compiled rank graph with the wrappers that hand on its carriers) with the documents of its
    ``position_ids`` placed by their lengths (:func:`document_layout`) in every call where that sends
    less: the call reads the placed layouts, what leaves split carries the placement
    (:attr:`~autoshard.runtime.split_tensor.SplitTensor.placed`), and :func:`marked` (around the graph itself) makes
    its backward read them too. ``documents()``: the documents' attention as known at the call (None: not yet);
    ``positions_of(args)``: the call's ``position_ids``."""
    def call(*args):
        positions, known = positions_of(args), documents()
        placement = None
        if PLACE and known is not None and isinstance(positions, torch.Tensor) and positions.dim() == 2 \
                and positions.size(0) == 1 and positions.size(1) >= 2 * known.world_size:
            placement = Placement.of(known, segments_of(positions))
        if placement is None:
            return run(*args)
        with placing(placement.swaps):
            return run(*args)
    return call


def segments_of(positions: torch.Tensor) -> torch.Tensor:
    """Segment ids (on the host) of ``position_ids``: a new document wherever a position is not its predecessor's
    plus one (how transformers finds packed sequences)."""
    restart = torch.ones_like(positions, dtype=torch.long)
    restart[:, 1:] = (positions[:, 1:] != positions[:, :-1] + 1).long()
    return restart.cumsum(1).cpu()
