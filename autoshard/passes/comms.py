"""Every communication a compiled graph performs, predicted per rank while the graph is rewritten.

The rewriter and the rules record a :class:`Comm` for each collective they emit -- forward, and the
backward its autograd formula implies when the value needs a gradient -- with the bytes *every* rank
sends (the accountant's convention, computed with the same functions the runtime records with) and
a sympy formula in the planner's symbols (``S`` the sequence length, ``P`` the ranks, and the
attention shapes ``B``, ``H``, ``Hkv``, ``D``). The formula is exact for values aligned with their
family's layout; values the layout reaches through a shift (shifted labels, a CLS token) have exact
byte counts and the formula of the aligned value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy

from ..placements import Shard
from ..runtime.accounting import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
from ..runtime.attention.formulas import P as P_SYMBOL
from ..runtime.attention.formulas import S as S_SYMBOL
from ..runtime.conv_halo import window_bytes
from ..runtime.layouts import SequenceLayout
from ..runtime.redistribute import realign_plan

__all__ = ["Comm", "CommBook", "max_local_formula"]


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


def max_local_formula(layout: SequenceLayout, length) -> sympy.Expr:
    """The largest shard of a ``length``-position sequence (a sympy expression) under ``layout``'s kind."""
    p = P_SYMBOL
    if layout.kind == "zigzag":
        rem = sympy.Mod(length, 2 * p)
        return 2 * sympy.floor(length / (2 * p)) + sympy.Min(rem, 1) + sympy.Piecewise((1, rem > p), (0, True))
    return sympy.ceiling(length / p)


@dataclass
class CommBook:
    """The communications of one rank's compile (see the module docstring)."""

    world: int
    roots: dict = field(default_factory=dict)
    """Family root length -> the sympy symbol of that sequence (``S``, ``S1``, ...)."""
    comms: list[Comm] = field(default_factory=list)

    def length_formula(self, shard: Shard, root_length: int):
        symbol = self.roots.setdefault(root_length, S_SYMBOL if not self.roots else sympy.Symbol(
            f"S{len(self.roots)}", positive=True, integer=True))
        return symbol + (shard.layout.length - root_length)

    def _shard_bytes(self, shard: Shard, shape, itemsize: int, root_length: int):
        """(largest local shard in bytes, formula of it) of a value of global ``shape`` split as ``shard``."""
        rest = math.prod(int(s) for d, s in enumerate(shape) if d != shard.dim)
        other = math.prod(f for i, f in enumerate(shard.factors) if i != shard.factor)
        largest = shard.layout.max_local_length * other * rest * itemsize
        formula = max_local_formula(shard.layout, self.length_formula(shard, root_length)) * other * rest * itemsize
        return largest, formula

    def gather(self, kind: str, node: str, shard: Shard, shape, itemsize: int, root_length: int, phase: str,
               reason: str = "") -> None:
        """An all-gather (or reduce-scatter) of a value split as ``shard``."""
        largest, formula = self._shard_bytes(shard, shape, itemsize, root_length)
        fn = all_gather_bytes if kind == "all_gather" else reduce_scatter_bytes
        self.comms.append(Comm(kind, node, phase, [fn(largest, self.world)] * self.world,
                               (P_SYMBOL - 1) * formula, reason=reason))

    def all_reduce(self, node: str, numel: int, itemsize: int, phase: str, numel_formula=None,
                   reason: str = "") -> None:
        """An all-reduce of ``numel`` elements."""
        numel_formula = numel if numel_formula is None else numel_formula
        self.comms.append(Comm("all_reduce", node, phase, [all_reduce_bytes(numel, itemsize, self.world)] * self.world,
                               2 * (P_SYMBOL - 1) * sympy.ceiling(numel_formula / P_SYMBOL) * itemsize, reason=reason))

    def realign(self, node: str, src: SequenceLayout, dst: SequenceLayout, row_bytes: int, phase: str) -> None:
        """Point-to-point moves of the positions ``dst`` places elsewhere than ``src``; backward reverses them."""
        per_rank = []
        for rank in range(self.world):
            _, sends, recvs = realign_plan(src, dst, rank)
            runs = sends if phase == "forward" else recvs
            per_rank.append(sum(n for peer_runs in runs.values() for _, n in peer_runs) * row_bytes)
        self.comms.append(Comm("realign", node, phase, per_rank, None, reason="positions moved"))

    def windows(self, node: str, layout: SequenceLayout, windows, row_bytes: int, phase: str) -> None:
        """Point-to-point fetch of the positions of every rank's ``windows`` (a convolution's halos) that other
        ranks hold under ``layout``; backward returns their gradients."""
        self.comms.append(Comm("halo_exchange", node, phase, window_bytes(layout, windows, row_bytes, phase), None,
                               reason="convolution halos"))

    def attention(self, node: str, strategy: str, phase: str, bytes_by_rank: list[int], formula: sympy.Expr) -> None:
        """A distributed attention's own traffic: exact bytes of every rank, and the strategy's formula."""
        if len(bytes_by_rank) != self.world:
            raise ValueError(f"attention {node}: {len(bytes_by_rank)} byte counts for {self.world} ranks")
        self.comms.append(Comm(strategy, node, phase, list(bytes_by_rank), formula))
