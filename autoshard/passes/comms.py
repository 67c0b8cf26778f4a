"""Every communication a compiled graph performs, predicted per rank from the collectives the rewrite emitted.

The rewrite emits collectives as calls in the per-rank graph and books nothing. Once the graph is built,
:func:`derive_comms` walks it and asks every call whose target has a *traffic declaration* (the ``traffic`` of its
entry in the op registry, :mod:`autoshard.runtime.op_info`, registered with :func:`declares` beside the rule that
emits the call: a declaration reads the compiler's graphs, which the runtime that defines the ops cannot import)
what that call sends: a :class:`Comm` for the forward, and one for the backward its autograd formula implies when
the value it serves needs a gradient, each with the bytes *every* rank sends (the accountant's convention, computed
with the same functions the runtime records with) and a sympy formula in the planner's symbols (``S`` the sequence
length, ``P`` the ranks, and the attention shapes ``B``, ``H``, ``Hkv``, ``D``). The formula is exact for values aligned with their family's
layout; values the layout reaches through a shift (shifted labels, a CLS token) have exact byte counts and
the formula of the aligned value.

A declaration reads a :class:`Call`: the emitted node's constant arguments (dims, layouts, windows) and the
original-graph value the call serves, whose fake value (``node.meta["val"]``) holds the global shape and
dtype. The rewriter marks what each emitted node serves (``SERVES``; by default the node whose rewrite
emitted it) and which node's rewrite emitted it (``EMITTED_BY``); a rule may attach why it communicates
(``REASON``), nothing else. :func:`derive_comms` consumes both marks.

Order: the graph's (the order the rewrite emitted the collectives), gradient buckets last (their all-reduce
ends the backward). A checkpointed region (:mod:`.regions`) reruns in backward, collectives included: the
forward collectives a region's node emitted are booked a second time right after that node's, phase
``backward``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import sympy
import torch
import torch.fx as fx

from ..runtime.accounting import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
from ..runtime.attention.formulas import P as P_SYMBOL
from ..runtime.attention.formulas import S as S_SYMBOL
from ..runtime.conv_halo import decode_windows, window_bytes
from ..runtime.layouts import SequenceLayout
from ..runtime.op_info import arguments, lookup, register
from ..runtime.redistribute import cumsum_totals_bytes, grad_sync, grad_sync_bucket, realign_bytes, reduce_partial
from .ops import hint_of, numel, op_of, value_of
from .regions import REGION

__all__ = ["Comm", "CommBook", "Call", "declares", "derive_comms", "max_local_formula", "SERVES",
           "EMITTED_BY", "REASON", "LAYOUT"]

SERVES = "autoshard_serves"
"""``node.meta`` key of an emitted collective: the original-graph node whose value it moves or computes."""
EMITTED_BY = "autoshard_emitted_by"
"""``node.meta`` key of every emitted node: the original-graph node whose rewrite emitted it."""
REASON = "autoshard_reason"
"""``node.meta`` key of an emitted collective: why the rule communicates (the report shows it)."""
LAYOUT = "autoshard_layout"
"""``node.meta`` key of an emitted gather or slice: the :class:`SequenceLayout` its layout argument encodes."""


@dataclass
class Comm:
    """One collective, in one direction, as every rank performs it."""

    kind: str
    """``all_gather``, ``reduce_scatter``, ``all_reduce``, ``realign``, ``halo_exchange`` or an attention strategy's
    traffic."""
    node: str
    """The graph value it serves."""
    phase: str
    """``"forward"`` or ``"backward"``."""
    bytes_by_rank: list[int]
    """Bytes each rank sends."""
    formula: sympy.Expr | None = None
    """Bytes a rank sends, in the planner's symbols."""
    reason: str = ""
    region: int | None = None
    """The checkpointed region whose recomputation in backward sends it again (None: not a recomputation's)."""


def max_local_formula(layout: SequenceLayout, length) -> sympy.Expr:
    """The largest shard of a ``length``-position sequence (a sympy expression) under ``layout``'s kind."""
    p = P_SYMBOL
    if layout.kind == "zigzag":
        rem = sympy.Mod(length, 2 * p)
        return 2 * sympy.floor(length / (2 * p)) + sympy.Min(rem, 1) + sympy.Piecewise((1, rem > p), (0, True))
    return sympy.ceiling(length / p)


@dataclass
class Call:
    """An emitted collective, as its traffic declaration reads it."""

    node: fx.Node
    """The call in the per-rank graph (its arguments: new-graph values and constants)."""
    value: fx.Node
    """The original-graph node it serves: the report names it, its fake value has the global shape and dtype."""

    @property
    def arguments(self) -> dict:
        """The call's arguments by parameter name (a custom op's schema names, a function's parameters)."""
        return arguments(self.node.target, self.node.args, self.node.kwargs)

    def layout(self, name: str = "layout") -> SequenceLayout:
        """The layout the call's argument ``name`` encodes: the one the emitter attached (``LAYOUT``) when it did,
        whose kind (the encoding drops it) picks the byte formula."""
        layout = SequenceLayout.decode(self.arguments[name])
        attached = self.node.meta.get(LAYOUT)
        return (attached if attached == layout else layout).at_hint()

    @property
    def reason(self) -> str:
        """What the rule that emitted it attached (``REASON``), or empty."""
        return self.node.meta.get(REASON, "")

    @property
    def needs_grad(self) -> bool:
        """Whether the value it serves needs a gradient, so the call's backward runs."""
        v = value_of(self.value)
        values = v if isinstance(v, (tuple, list)) else [v]  # a recurrence's (output, final state)
        return any(isinstance(t, torch.Tensor) and t.requires_grad for t in values)

    @property
    def phases(self) -> tuple[str, ...]:
        """``("forward", "backward")`` when the backward runs, else ``("forward",)``."""
        return ("forward", "backward") if self.needs_grad else ("forward",)

    @property
    def itemsize(self) -> int:
        return value_of(self.value).element_size()

    def row_bytes(self, layout: SequenceLayout) -> int:
        """Bytes of one sequence position of the value (from its global shape: a rank's shard may be empty)."""
        return hint_of(numel(value_of(self.value).shape)) // layout.length * self.itemsize


@dataclass
class CommBook:
    """The communications of one rank's compile (see the module docstring)."""

    world: int
    root_length: Callable[[SequenceLayout], int] = lambda layout: layout.length
    """The length of the family root a layout derives from (whose symbol its formulas use)."""
    heads_axis_size: int | None = None
    """Ranks of the heads axis of a hybrid attention's mesh."""
    roots: dict = field(default_factory=dict)
    """Family root length -> the sympy symbol of that sequence (``S``, ``S1``, ...)."""
    comms: list[Comm] = field(default_factory=list)

    def length_formula(self, layout: SequenceLayout):
        root_length = self.root_length(layout)
        symbol = self.roots.setdefault(root_length, S_SYMBOL if not self.roots else sympy.Symbol(
            f"S{len(self.roots)}", positive=True, integer=True))
        return symbol + (layout.length - root_length)

    def gather(self, kind: str, node: str, layout: SequenceLayout, row_bytes: int, phase: str,
               reason: str = "") -> None:
        """An all-gather (or reduce-scatter) of a value split as ``layout``, ``row_bytes`` a position."""
        fn = all_gather_bytes if kind == "all_gather" else reduce_scatter_bytes
        formula = max_local_formula(layout, self.length_formula(layout)) * row_bytes
        self.comms.append(Comm(kind, node, phase, [fn(layout.max_local_length * row_bytes, self.world)] * self.world,
                               (P_SYMBOL - 1) * formula, reason=reason))

    def all_reduce(self, node: str, numel: int, itemsize: int, phase: str, reason: str = "") -> None:
        """An all-reduce of ``numel`` elements."""
        self.comms.append(Comm("all_reduce", node, phase, [all_reduce_bytes(numel, itemsize, self.world)] * self.world,
                               2 * (P_SYMBOL - 1) * sympy.ceiling(numel / P_SYMBOL) * itemsize, reason=reason))

    def all_gather_rows(self, node: str, row_bytes: int, phase: str, reason: str, formula=None) -> None:
        """An all-gather of ``row_bytes`` from every rank (no sequence: per-rank candidates, totals)."""
        self.comms.append(Comm("all_gather", node, phase, [all_gather_bytes(row_bytes, self.world)] * self.world,
                               formula, reason=reason))

    def point_to_point(self, kind: str, node: str, phase: str, bytes_by_rank: list[int], reason: str) -> None:
        """Point-to-point moves (a realignment, a convolution's halos): every rank's bytes, no formula."""
        self.comms.append(Comm(kind, node, phase, list(bytes_by_rank), None, reason=reason))

    def attention(self, node: str, strategy: str, phase: str, bytes_by_rank: list[int], formula: sympy.Expr) -> None:
        """A distributed attention's own traffic: exact bytes of every rank, and the strategy's formula."""
        if len(bytes_by_rank) != self.world:
            raise ValueError(f"attention {node}: {len(bytes_by_rank)} byte counts for {self.world} ranks")
        self.comms.append(Comm(strategy, node, phase, list(bytes_by_rank), formula))


# ---------------------------------------------------------------------------- traffic declarations

def declares(*targets) -> Callable[[Callable[[CommBook, Call], None]], Callable]:
    """Register the decorated function, ``(book, call)`` booking what a call sends, as the traffic of ``targets``
    in the op registry."""
    return register("traffic", *targets)


def _traffic(target) -> Callable[[CommBook, Call], None] | None:
    info = lookup(target)
    return info.traffic if info is not None else None


@declares(torch.ops.autoshard.seq_shard.default)
def _sliced(book: CommBook, call: Call) -> None:
    """A slice of a whole value: its backward gathers the gradient shards."""
    if call.needs_grad:
        layout = call.layout()
        book.gather("all_gather", call.value.name, layout, call.row_bytes(layout), "backward",
                    "gradient of a split value used whole")


@declares(torch.ops.autoshard.seq_unshard.default, torch.ops.autoshard.seq_unshard_for_local_use.default)
def _gathered(book: CommBook, call: Call) -> None:
    """A split value gathered; one feeding this rank's share of the work reduce-scatters its gradient shares."""
    layout = call.layout()
    book.gather("all_gather", call.value.name, layout, call.row_bytes(layout), "forward", call.reason)
    if call.node.target is torch.ops.autoshard.seq_unshard_for_local_use.default and call.needs_grad:
        book.gather("reduce_scatter", call.value.name, layout, call.row_bytes(layout), "backward",
                    "gradient shares of a gathered value")


@declares(torch.ops.autoshard.seq_realign.default)
def _realigned(book: CommBook, call: Call) -> None:
    src, dst = call.layout("src"), call.layout("dst")
    for phase in call.phases:
        book.point_to_point("realign", call.value.name, phase, realign_bytes(src, dst, call.row_bytes(src), phase),
                            "positions moved")


@declares(reduce_partial, torch.ops.autoshard.reduce_partial.default)
def _reduced(book: CommBook, call: Call) -> None:
    book.all_reduce(call.value.name, numel(value_of(call.value).shape), call.itemsize, "forward", call.reason)


@declares(grad_sync)
def _gradient_shares(book: CommBook, call: Call) -> None:
    book.all_reduce(call.value.name, numel(value_of(call.value).shape), call.itemsize, "backward", "gradient shares")


@declares(grad_sync_bucket)
def _gradient_bucket(book: CommBook, call: Call) -> None:
    """One all-reduce of every parameter gradient in the bucket (its arguments are the parameters' placeholders)."""
    params = [value_of(p) for p in call.arguments["xs"]]
    book.all_reduce(call.node.name, sum(p.numel() for p in params), params[0].element_size(), "backward",
                    "parameter gradients")


@declares(torch.ops.autoshard.seq_cumsum.default)
def _cumsum_prefix(book: CommBook, call: Call) -> None:
    """The all-gather of every rank's per-interval totals."""
    dim, layout = call.arguments["dim"], call.layout()
    row = numel(value_of(call.value).shape) // value_of(call.value).shape[dim] * call.itemsize
    for phase in call.phases:
        book.all_gather_rows(call.value.name, cumsum_totals_bytes(layout, row), phase, "cumsum prefix")


@declares(torch.ops.autoshard.seq_windows.default)
def _windows(book: CommBook, call: Call) -> None:
    """The positions of every rank's windows (a convolution's halos) that other ranks hold; backward returns their
    gradients. The halos are the convolution's input's: the report names that value."""
    src = Call(call.node, op_of(call.value)["input"])
    layout = call.layout()
    windows = decode_windows(tuple(map(hint_of, call.arguments["windows"])), layout.world_size)  # at the call's sizes
    for phase in src.phases:
        book.point_to_point("halo_exchange", src.value.name, phase,
                            window_bytes(layout, windows, src.row_bytes(layout), phase), "convolution halos")


# ---------------------------------------------------------------------------- the derivation


def derive_comms(graph: fx.Graph, book: CommBook, rank: int) -> dict[int, int]:
    """Book every collective of the per-rank ``graph`` (see the module docstring) and consume the rewriter's marks;
    returns, per checkpointed region, the bytes ``rank`` sends again when backward recomputes it."""
    recomputed: dict[int, int] = {}
    last: list[Call] = []
    for region, calls in _by_emitter(graph):
        start = len(book.comms)
        for call in calls:
            if call.node.target is grad_sync_bucket:
                last.append(call)
            else:
                _traffic(call.node.target)(book, call)
        if region is not None:
            again = [dataclasses.replace(c, phase="backward", reason="recomputed (activation checkpointing)",
                                         region=region) for c in book.comms[start:] if c.phase == "forward"]
            book.comms.extend(again)
            recomputed[region] = recomputed.get(region, 0) + sum(c.bytes_by_rank[rank] for c in again)
    for call in last:
        _traffic(call.node.target)(book, call)
    for node in graph.nodes:  # the marks hold original-graph nodes: they must not outlive the derivation
        for key in (EMITTED_BY, SERVES, LAYOUT):
            node.meta.pop(key, None)
    return recomputed


def _by_emitter(graph: fx.Graph):
    """(region, collective calls) of every run of nodes one original node's rewrite emitted, in graph order."""
    runs: list[tuple[object, int | None, list[Call]]] = []
    for node in graph.nodes:
        emitter = node.meta.get(EMITTED_BY)
        served = node.meta.get(SERVES, emitter)
        if not runs or runs[-1][0] is not emitter:
            runs.append((emitter, node.meta.get(REGION) if emitter is not None else None, []))
        if node.op == "call_function" and _traffic(node.target) is not None:
            runs[-1][2].append(Call(node, served))
    return [(region, calls) for _, region, calls in runs]
