"""The strategy registry, and what the cost model prices a strategy's call with.

A strategy lives in one module: its ``_check`` (local validation that needs the strategy's rules),
``_forward``, ``_backward``, its byte formulas and its cost, and it registers one :class:`Strategy` holding
them all at import. The one custom op ``autoshard::attention`` (see :mod:`.api`) and its backward op
look the strategy up by name, so every algorithm gets the same autograd wiring, fake implementation and
argument checks (each receives one :class:`.call.Call`); :func:`bytes_sent` and :func:`bytes_sent_by_rank` answer
bytes, :mod:`autoshard.cost` prices and ranks the registered strategies, and :mod:`autoshard.strategy` picks among
them, without naming any. Adding a strategy is one new module here plus its line in the package's import list
(``__init__``), whose order is the order the cost model lists the strategies in.

Pricing. A strategy's cost function receives one :class:`Pricing`: the call's :class:`AttentionShape`, the ranks,
the hardware profile (:class:`~autoshard.hardware.HardwareProfile`) and the terms the strategies share (the per-rank
compute, the ring's steps, bytes from the strategy's formulas, the working set of the inputs); it returns a
:class:`StrategyCost`. They live here, below the strategies, because a strategy and its pricing refer to each other:
the strategies import this module, :mod:`autoshard.cost` imports the strategies, and nothing here imports either.

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

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

import sympy
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ...hardware import HardwareProfile
from . import formulas
from .formulas import Sizes
from .masks import MaskSpec
from ..symbolic import hint_of

__all__ = ["Strategy", "STRATEGIES", "register", "bytes_sent", "bytes_sent_by_rank", "contiguous_layout",
           "zigzag_layout", "zigzag_layout_when_causal", "AttentionShape", "StrategyCost", "Pricing",
           "attention_seconds", "DOCUMENT_IMBALANCE"]


@dataclass(frozen=True, kw_only=True)
class AttentionShape:
    """What the cost of one attention depends on."""

    batch: int
    """Batch rows."""
    seq: int
    """The global sequence length."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads."""
    head_dim: int
    """The query/key head dim."""
    dtype: torch.dtype = torch.bfloat16
    """The dtype the attention computes in."""
    mask: MaskSpec = MaskSpec()
    """The position mask (causal, window, chunks)."""
    key_mask: bool = False
    """Whether a key-padding mask travels with the keys."""
    segment_ids_dtype: torch.dtype | None = None
    """The dtype of the packed documents' segment ids (None: no documents)."""
    value_head_dim: int = 0
    """``v``'s head dim when it is not ``head_dim`` (multi-head latent attention); 0: ``head_dim``."""

    @property
    def dv(self) -> int:
        """The value head dim."""
        return self.value_head_dim or self.head_dim

    @property
    def kv_dims(self) -> int:
        """The head dims of one key and one value row together."""
        return self.head_dim + self.dv

    def flops(self) -> float:
        """Forward FLOPs of the whole attention (every rank together), from the visible pairs of an interior row
        times the rows (the mask's edges are not counted out: an estimate, where :meth:`.masks.MaskSpec.
        visible_pairs` counts)."""
        pairs = self.seq * self.seq
        window, causal = self.mask.window_arg, self.mask.causal
        if window is not None:
            left, right = window
            span = (self.seq if left < 0 else left + 1) + (0 if right == 0 else (self.seq if right < 0 else right))
            pairs = self.seq * min(self.seq, span)
        elif causal:
            pairs = self.seq * (self.seq + 1) / 2
        if self.mask.chunk:
            chunk = min(self.mask.chunk, self.seq)
            pairs = min(pairs, self.seq * ((chunk + 1) / 2 if causal else chunk))
        return 2.0 * self.batch * self.heads * pairs * self.kv_dims


@dataclass
class StrategyCost:
    """One strategy's estimated cost for one attention call (forward + backward, per rank)."""

    strategy: str
    feasible: bool
    why_not: str = ""
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    latency_s: float = 0.0
    total_s: float = math.inf
    bytes_forward: int = 0
    bytes_backward: int = 0
    memory_bytes: int = 0
    """The attention's working set on a rank (inputs, output, K/V in flight or gathered)."""
    layout: str = "contiguous"
    mesh: tuple[int, int] | None = None
    """(ring axis, ulysses axis) sizes, for the hybrid."""

    def summary(self) -> str:
        if not self.feasible:
            return f"{self.strategy}: not possible ({self.why_not})"
        return (f"{self.strategy}: {self.total_s * 1e3:.3f} ms (compute {self.compute_s * 1e3:.3f}, exposed comm "
                f"{self.exposed_comm_s * 1e3:.3f}, latency {self.latency_s * 1e3:.3f}; sends "
                f"{(self.bytes_forward + self.bytes_backward) / 2**20:.1f} MiB)")


def contiguous_layout(shape: AttentionShape, world: int) -> str:
    """Layout preference of a strategy indifferent to the layout."""
    return "contiguous"


def zigzag_layout(shape: AttentionShape, world: int) -> str:
    """Layout preference of a strategy that balances every mask on the zigzag layout (``2P`` positions needed)."""
    return "zigzag" if shape.seq >= 2 * world else "contiguous"


def zigzag_layout_when_causal(shape: AttentionShape, world: int) -> str:
    """Layout preference of a strategy that the zigzag layout balances under a causal mask."""
    return zigzag_layout(shape, world) if shape.mask.causal else "contiguous"


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """One distributed attention algorithm over a sequence layout: everything the op, the byte formulas, the
    cost model and the planner know of it."""

    name: str
    """The name users, the op's ``strategy`` argument and the plan carry."""
    check: Callable
    """``check(q, k, v, call)`` (a :class:`.call.Call`): raise :class:`.call.AttentionInputError` for inputs this
    algorithm cannot serve; returns this rank's sequence rank (the layout rank whose positions it holds)."""
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
    """``cost(pricing) -> StrategyCost``: the cost of one call (:class:`Pricing`), or why it is not possible."""
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


def _backward(direction: str) -> bool:
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    return direction == "backward"


def bytes_sent(strategy: str, direction: str = "forward") -> sympy.Expr:
    """Bytes one rank sends in the ``"forward"`` or ``"backward"`` of one call of ``strategy``, in the symbols of
    :mod:`.formulas`."""
    return STRATEGIES[strategy].bytes_sent(_backward(direction))


def bytes_sent_by_rank(strategy: str, direction: str, lengths: Sequence[int], *, B: int, H: int, Hkv: int, D: int,
                       Dv: int | None = None, dtype: torch.dtype = torch.float32, key_mask: bool = False,
                       segment_ids_dtype: torch.dtype | None = None, P_u: int | None = None) -> list[int]:
    """Bytes every sequence rank sends in the ``"forward"`` or ``"backward"`` of one call of ``strategy``, exactly
    (see :mod:`.formulas` for where :func:`bytes_sent` is exact too).

    ``lengths``: the shard length of every sequence rank (``layout.local_lengths``); ``Dv``: the value head dim
    (default ``D``); ``P_u``: the Ulysses axis size of a strategy over a 2-D mesh (``hybrid``; the others ignore
    it). The list is in sequence-rank order (the flattened rank of a ``(ring, ulysses)`` mesh).
    """
    backward = _backward(direction)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {sorted(STRATEGIES)}")
    sizes = Sizes.of(B=B, H=H, Hkv=Hkv, D=D, Dv=Dv, dtype=dtype, key_mask=key_mask,
                     segment_ids_dtype=segment_ids_dtype)
    return STRATEGIES[strategy].bytes_by_rank([hint_of(n) for n in lengths], sizes, backward, P_u)


# ---------------------------------------------------------------------------- pricing


def attention_seconds(shape: AttentionShape, hardware: HardwareProfile) -> float:
    """Seconds of the whole attention's forward + backward (2.5x the forward) on one rank of ``hardware``: its FLOPs,
    and the per-pair cost beyond them (:attr:`~autoshard.hardware.HardwareProfile.attention_pair_flops`), at the
    attention rate."""
    per_pair = hardware.attention_pair_flops / (2 * shape.kv_dims)  # a pair is 2 kv_dims forward FLOPs per head
    return shape.flops() * (3.5 + per_pair) / hardware.attention_rate(shape.dtype)


DOCUMENT_IMBALANCE = 1.4
"""What packed documents cost a ring, whose ranks' work is where the layout puts their queries: max/mean over ranks
measured 1.2-2.2 on either layout for 13 to 23 documents of log-normal lengths (mean ~800 tokens) at P=4 and
S=16384, 1.2-2.1 at S=4096 (``python benchmarks/packed.py``, its second table). The documents are data the plan does
not see, so the cost model charges a typical value."""


@dataclass(frozen=True)
class Pricing:
    """What a strategy's cost function (:attr:`Strategy.cost`) prices: one call of ``shape`` on ``world`` ranks of
    ``hardware``, and the terms the strategies share."""

    strategy: Strategy
    """The strategy priced."""
    shape: AttentionShape
    """The call."""
    world: int
    """Ranks of the sequence group."""
    hardware: HardwareProfile
    """What a rank computes, moves and holds per second."""
    hybrid_possible: bool
    """Whether a 2-D mesh is there to run a strategy over (or may be planned)."""
    head_chunks: int = 1
    """Head groups the call runs one at a time (``BackendConfig.head_chunks``)."""

    @cached_property
    def item(self) -> int:
        """Bytes per element of the inputs."""
        return torch.empty((), dtype=self.shape.dtype).element_size()

    @cached_property
    def local(self) -> int:
        """Positions per rank (the largest shard)."""
        return -(-self.shape.seq // self.world)

    @cached_property
    def inputs_bytes(self) -> int:
        """This rank's q, k, v and output: the working set every strategy holds."""
        s = self.shape
        return s.batch * self.local * (s.heads + s.kv_heads) * s.kv_dims * self.item

    @cached_property
    def memory(self) -> int:
        """This rank's inputs and output and the strategy's working set, forward or backward, whichever is larger
        (:attr:`Strategy.working_set`)."""
        return self.inputs_bytes + max(self.strategy.working_set(self.shape, self.world, self.head_chunks, backward)
                                       for backward in (False, True))

    def busiest(self, imbalance: float) -> float:
        """Seconds of forward + backward (2.5x) compute of the most loaded rank, which does ``imbalance`` times the
        mean. Ranks that share a node's cores (:meth:`~autoshard.hardware.HardwareProfile.slowdown`) take turns: the
        step then lasts at least the mean work at the rank's share of the cores, and the idle ranks' turns go to the
        busy ones."""
        mean = attention_seconds(self.shape, self.hardware) / self.world
        return mean * max(imbalance, self.hardware.slowdown(self.world))

    @cached_property
    def balanced(self) -> float:
        """:meth:`busiest` of the work split evenly."""
        return self.busiest(1.0)

    @cached_property
    def contiguous(self) -> float:
        """:meth:`busiest` on the contiguous layout: a causal mask without window or chunks leaves the last rank's
        queries the most keys; packed documents at least :data:`DOCUMENT_IMBALANCE`."""
        mask = self.shape.mask
        plain_causal = mask.causal and mask.window_arg is None and not mask.chunk
        causal = (2 * self.world - 1) / self.world if plain_causal else 1.0
        return self.busiest(max(causal, self.documents))

    @cached_property
    def documents(self) -> float:
        """The work of the most loaded rank over the mean where a layout alone places the queries (the rings): with
        packed documents (segment ids), :data:`DOCUMENT_IMBALANCE`; 1 otherwise. The all-gather's dispatch and
        Ulysses' head split balance whatever the documents."""
        return DOCUMENT_IMBALANCE if self.shape.segment_ids_dtype is not None else 1.0

    def merge_time(self, steps: int) -> float:
        """Seconds a ring spends merging ``steps`` partial results per rank (fp32 read, read, write)."""
        s = self.shape
        out = s.batch * s.heads * self.local * (s.dv + 1) * 4 * 3
        grads = s.batch * s.kv_heads * self.local * s.kv_dims * 4 * 3
        return steps * (out + grads) / self.hardware.memory_bandwidth

    def sent(self, sizes: dict, bytes_sent: Callable[[bool], sympy.Expr] | None = None,
             shape: AttentionShape | None = None) -> tuple[int, int]:
        """``(forward, backward)`` bytes a rank sends by the strategy's formulas (or ``bytes_sent``'s) for ``shape``
        (default: the call's) and the rank counts ``sizes``."""
        shape = shape or self.shape
        formula = bytes_sent or self.strategy.bytes_sent
        subs = formulas.values(dtype=shape.dtype, key_mask=shape.key_mask, segment_ids_dtype=shape.segment_ids_dtype,
                               B=shape.batch, S=shape.seq, H=shape.heads, Hkv=shape.kv_heads, D=shape.head_dim,
                               Dv=shape.dv, **sizes)
        return tuple(int(math.ceil(float(formula(backward).subs(subs)))) for backward in (False, True))

    def impossible(self, why: str) -> StrategyCost:
        """The strategy cannot run this call, for the reason ``why``."""
        return StrategyCost(self.strategy.name, False, why)

    def cost(self, *, compute: float, comm: float, exposed: float, latency: float, sent: tuple[int, int],
             memory: int, mesh: tuple[int, int] | None = None) -> StrategyCost:
        """A feasible cost: ``compute`` + the ``exposed`` part of the communication ``comm`` + ``latency`` seconds, on
        the strategy's preferred layout."""
        return StrategyCost(self.strategy.name, True, compute_s=compute, comm_s=comm, exposed_comm_s=exposed,
                            latency_s=latency, total_s=compute + exposed + latency, bytes_forward=sent[0],
                            bytes_backward=sent[1], memory_bytes=memory,
                            layout=self.strategy.preferred_layout(self.shape, self.world), mesh=mesh)

    def ring(self, compute: float) -> StrategyCost:
        """A ring over all ranks: K/V blocks travel while the previous block is computed (``compute`` seconds in
        all), so only the traffic beyond the compute is exposed; every step pays latency, overhead and a merge."""
        world, hardware = self.world, self.hardware
        sent = self.sent({"P": world})
        comm = sum(sent) / hardware.bandwidth(world)
        latency = 2 * world * (hardware.latency(world) + hardware.step_overhead) + self.merge_time(world)
        return self.cost(compute=compute, comm=comm, exposed=max(0.0, comm - compute), latency=latency, sent=sent,
                         memory=self.memory)
