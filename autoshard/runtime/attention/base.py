"""What every strategy receives, and the registry the custom op, the byte formulas and the cost model read.

A strategy lives in one module: its ``_check`` (local validation that needs the strategy's rules),
``_forward``, ``_backward``, its byte formulas and its cost, and it registers one :class:`Strategy` holding
them all at import. The one custom op ``autoshard::attention`` (see :mod:`.api`) and its backward op
look the strategy up by name, so every algorithm gets the same autograd wiring, fake implementation and
argument checks; :mod:`.formulas` answers bytes, :mod:`autoshard.cost` prices and ranks the registered
strategies, and :mod:`autoshard.strategy` picks among them, without naming any. Adding a strategy is one
new module here plus its line in the package's import list (``__init__``), whose order is the order the
cost model lists the strategies in.

Strategy x layout. An algorithm and the sequence layout it runs over are two axes: the zigzag ring is the
ring over the zigzag layout. The registry records that as :attr:`Strategy.algorithm` and
:attr:`Strategy.layout` (``zigzag`` is ``algorithm="ring", layout="zigzag"``), which is how the planner moves a
ring onto a family's layout (:meth:`Strategy.on_layout`). ``zigzag`` nevertheless stays a registered strategy
of its own rather than a layout option of ``ring``: it is a name users, the configuration, the op's
``strategy`` argument and the plan all carry, and it differs from the ring in everything the registry holds
besides the algorithm -- the layout check, the balanced cost and its feasibility (``2P`` positions), its
reason and its tie-break rank. A layout option would have to rebuild each of those per (algorithm, layout)
pair and map the pair back to the name for the op and the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from ..groups import resolve_group
from ..layouts import SequenceLayout
from .dropout import AttentionDropout
from .masks import MaskSpec
from .terms import ScoreTerms

if TYPE_CHECKING:
    import sympy

    from ...cost import AttentionShape
    from torch.distributed.device_mesh import DeviceMesh

    from ...cost import AttentionShape, Pricing, StrategyCost
    from .formulas import Sizes

__all__ = ["Call", "Strategy", "STRATEGIES", "register", "AttentionInputError", "contiguous_layout",
           "zigzag_layout", "zigzag_layout_when_causal"]


class AttentionInputError(ValueError):
    """Inputs that distributed attention cannot serve; the message names the constraint and the fix."""


@dataclass(frozen=True, kw_only=True)
class Call:
    """The configuration of one distributed attention call (everything but the tensors)."""

    strategy: str
    """The algorithm's registered name."""
    layout: SequenceLayout
    """Which global positions each sequence rank holds (its length is the global length)."""
    group: str
    """Process-group name: the sequence group, or for ``hybrid`` the Ulysses (all-to-all) axis."""
    ring_group: str = ""
    """For ``hybrid``: the ring axis' process-group name; empty otherwise."""
    spec: MaskSpec = MaskSpec()
    """Causal / window / chunk mask."""
    scale: float
    """Softmax scale."""
    softcap: float = 0.0
    """Scores soft-cap: ``softcap * tanh(s / softcap)`` on the scaled scores before the mask (0: none)."""
    alibi_slopes: torch.Tensor | None = None
    """ALiBi: ``[H]`` float32 slopes; every score gets ``slope[h] * (k_pos - q_pos)`` of its global positions, after
    the cap and before the mask (None: none)."""
    dropout_p: float = 0.0
    """Dropout on the attention probabilities (0: none), by a mask hashed from ``dropout_seed`` and global positions
    (see :mod:`.dropout`)."""
    dropout_seed: torch.Tensor | None = None
    """The call's dropout seed, a 0-d int64 tensor (with ``dropout_p``)."""
    position_bias: torch.Tensor | None = None
    """A relative-position bias ``[H, 2R + 1]``: every score gets ``position_bias[h, k_pos - q_pos + R]`` (None:
    none)."""
    position_bias_grad: torch.Tensor | None = None
    """In the backward: the accumulator of ``position_bias``'s gradient."""
    kernels: str = "auto"
    """``"auto"``, ``"torch"`` or ``"triton"`` (see :mod:`.backend`)."""
    head_chunks: int = 1
    """Head groups run one at a time (:mod:`.head_chunks`)."""

    @property
    def terms(self) -> ScoreTerms:
        """The call's score terms, for tensors holding every query head."""
        return ScoreTerms(self.alibi_slopes, self.position_bias, self.position_bias_grad,
                          AttentionDropout(self.dropout_p, self.dropout_seed) if self.dropout_p else None)

    @property
    def pg(self) -> dist.ProcessGroup:
        return resolve_group(self.group)

    @property
    def ring_pg(self) -> dist.ProcessGroup:
        return resolve_group(self.ring_group)


def contiguous_layout(shape: AttentionShape, world: int) -> str:
    """Layout preference of a strategy indifferent to the layout."""
    return "contiguous"


def zigzag_layout(shape: AttentionShape, world: int) -> str:
    """Layout preference of a strategy that balances every mask on the zigzag layout (``2P`` positions needed)."""
    return "zigzag" if shape.seq >= 2 * world else "contiguous"


def zigzag_layout_when_causal(shape: AttentionShape, world: int) -> str:
    """Layout preference of a strategy that the zigzag layout balances under a causal mask."""
    return zigzag_layout(shape, world) if shape.causal else "contiguous"


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """One distributed attention algorithm over a sequence layout: everything the op, the byte formulas, the
    cost model and the planner know of it."""

    name: str
    """The name users, the op's ``strategy`` argument and the plan carry."""
    check: Callable
    """``check(q, k, v, call)``: raise :class:`AttentionInputError` for inputs this algorithm cannot serve;
    returns this rank's sequence rank (the layout rank whose positions it holds)."""
    forward: Callable
    """``forward(q, k, v, key_mask, segment_ids, call) -> (out, lse)`` in the compute dtype."""
    backward: Callable
    """``backward(dout, q, k, v, out, lse, key_mask, segment_ids, call) -> (dq, dk, dv)``."""
    bytes_sent: Callable[[bool], sympy.Expr]
    """``bytes_sent(backward) -> sympy.Expr``: bytes one rank sends in the forward (or backward) of one call, in the
    symbols of :mod:`.formulas`."""
    bytes_by_rank: Callable[[Sequence[int], Sizes, bool, int | None], list[int]]
    """``bytes_by_rank(lengths, sizes, backward, P_u) -> [bytes sent by every sequence rank]``, exactly, for the
    shard ``lengths`` of every sequence rank (``P_u``: the Ulysses axis size, for a 2-D mesh)."""
    cost: Callable[[Pricing], StrategyCost]
    """``cost(pricing) -> StrategyCost``: the cost of one call (:mod:`autoshard.cost`), or why it is not possible."""
    preferred_layout: Callable[[AttentionShape, int], str] = contiguous_layout
    """``preferred_layout(shape, world) -> "contiguous" | "zigzag"``: the layout this strategy runs best on."""
    rank: int
    """Tie-break order of the cost model: among equally fast strategies the lowest rank (the simplest) wins."""
    reason: str
    """Why the cost model picks it, as the plan says: the clause after the strategy's time."""
    algorithm: str = ""
    """The algorithm it runs (default: its name): strategies of one algorithm differ by :attr:`layout`."""
    layout: str | None = None
    """The layout kind it requires (None: any)."""
    splits_heads: bool = False
    """Whether it splits the heads over its group's ranks (Ulysses): every head group then needs a query head per
    rank (:mod:`.head_chunks`)."""
    working_set: Callable[[AttentionShape, int, int, bool], int]
    """``working_set(shape, world, head_chunks, backward) -> bytes``: what one rank's call holds at its peak beyond
    its inputs and outputs (in backward: beyond ``dout, q, k, v, out, lse`` and ``dq, dk, dv``), its heads run
    ``head_chunks`` groups at a time (:mod:`.head_chunks`): the gathered or head-split copies, the float32
    accumulators, the blocks in flight. The planner counts it while the op runs; the cost model drops a strategy
    whose inputs and working set exceed the memory budget."""
    mesh_groups: Callable[[DeviceMesh], list[dist.ProcessGroup]] | None = None
    """For a strategy over a 2-D mesh: ``mesh_groups(mesh) -> [all-to-all axis group, ring axis group]``; None: it
    runs over one group (a ProcessGroup or a 1-D mesh)."""

    def __post_init__(self):
        if not self.algorithm:
            object.__setattr__(self, "algorithm", self.name)

    def on_layout(self, kind: str) -> Strategy:
        """The strategy of this algorithm for a family laid out as ``kind``: the one requiring ``kind``, else the
        one requiring no layout, else this one."""
        same = [s for s in STRATEGIES.values() if s.algorithm == self.algorithm]
        return (next((s for s in same if s.layout == kind), None)
                or next((s for s in same if s.layout is None), self))


STRATEGIES: dict[str, Strategy] = {}
"""Every registered strategy by name, in registration order (the package's import order)."""


def register(strategy: Strategy) -> Strategy:
    """Make ``strategy`` available to ``attention(strategy=name)``, the custom op, the formulas and the cost model."""
    STRATEGIES[strategy.name] = strategy
    return strategy
