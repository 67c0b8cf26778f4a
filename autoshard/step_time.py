"""Step time: how long one training step of a plan takes on a hardware profile, and where it goes.

    plan = autoshard.plan(model, args, kwargs, world_size=8, hardware="h100")
    plan.step_seconds, plan.step_time.tokens_per_second, plan.step_time.layers[0]

The planner already runs every per-rank graph forward and backward on fake tensors to follow its memory
(:mod:`autoshard.planner`); :class:`OpTimer` rides along in the same run and prices every op it dispatches on the
profile (:class:`~autoshard.hardware.HardwareProfile`), the way the per-operator predictors of the literature
do (a calibrated cost per op class, collectives by latency and bandwidth, overlap as it really happens):

* **matrix multiplies** (``mm``, ``addmm``, ``bmm``, ``baddbmm``): ``2 M N K`` FLOPs over the profile's rate in their
  dtype;
* **attention** (``autoshard::attention`` and its backward): the cost model's price of the call for the strategy
  the compiler chose (:func:`autoshard.cost.attention_costs`: the rank's share of the work, its imbalance on the
  layout, the exposed part of its communication, the ring's per-step latency and merges), forward 1 / 3.5 of its
  compute, backward the rest, the communication by the bytes each direction sends (this module registers that
  price in the op registry, :mod:`autoshard.runtime.op_info`: it needs the cost model);
* **ops that declare their work** in the op registry (the chunked LM head + loss, ``autoshard::linear_cross_entropy``:
  its products of ``[tokens, H] x [H, V]`` and its softmax passes over the ``[tokens, V]`` values): their FLOPs over
  the profile's rate in their dtype plus the bytes they stream over the memory bandwidth;
* **everything else**: the bytes it reads and writes over the memory bandwidth; views cost nothing; every op also
  pays :attr:`~autoshard.hardware.HardwareProfile.op_overhead`. A CPU rank that shares its cores
  (:meth:`~autoshard.hardware.HardwareProfile.slowdown`) computes that much slower.

What runs again runs again: checkpointed regions are recomputed in the simulated backward, their ops priced a
second time. Each op's time is booked to the layer it belongs to -- forward, the layer of the graph node that runs
it (dynamo's module stack, as :func:`autoshard.passes.recompute.layer_of` reads it); backward, the layer whose
forward made the autograd node that runs (matched by autograd's sequence numbers) -- or to ``rest`` (embedding, LM
head, loss).

On top of the ops, from the plan's counts: the collectives outside attention (gradient sync buckets, loss
reductions, realigns) at ``(P - 1)`` latencies plus their bytes over the link, exposed; FSDP2's per-unit
all-gathers (forward and backward) and reduce-scatters, hidden behind the layer's compute up to it (prefetch); the
offload copies (their own stream): prefetched (``offload_prefetch``), both ways hidden behind the step's
compute up to it (the first copy back is not, left out); else each copy back exposed, after what of the copies out
forward's compute did not hide; and the optimizer's pass over its
states.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .cost import attention_costs
from .hardware import HardwareProfile
from .passes.recompute import layer_of
from .runtime.attention.api import attention_op_shape
from .runtime.attention.base import AttentionShape
from .runtime.op_info import Arguments, lookup, register

__all__ = ["StepTime", "LayerTime", "OpTimer", "run_timed", "step_time"]

REST = "rest"
"""The bucket of ops outside every layer (embedding, final norm, LM head and loss)."""

_MATMULS = {torch.ops.aten.mm.default: 0, torch.ops.aten.addmm.default: 1, torch.ops.aten.bmm.default: 0,
            torch.ops.aten.baddbmm.default: 1}
"""Matrix multiplies -> the position of their first factor (after the added term of ``addmm`` / ``baddbmm``)."""
_FREE_NAMESPACES = ("prim",)
"""Ops that exist only on fake tensors (a device query)."""


@dataclass
class LayerTime:
    """One layer's share of a step on one rank (forward + backward, recomputation included)."""

    layer: str
    """The layer's module path, or ``rest``."""
    compute_s: float = 0.0
    """Seconds of its ops (matmuls, elementwise, attention's compute)."""
    attention_s: float = 0.0
    """Of which attention's compute."""
    comm_s: float = 0.0
    """Seconds of its communication (attention's, FSDP2's for its unit)."""
    exposed_s: float = 0.0
    """Of which not hidden behind compute."""

    @property
    def seconds(self) -> float:
        """What the layer adds to the step: its compute and its exposed communication."""
        return self.compute_s + self.exposed_s

    def add(self, *, compute: float = 0.0, attention: float = 0.0, comm: float = 0.0, exposed: float = 0.0) -> None:
        """Book ``compute`` seconds of other ops, ``attention`` of attention's, ``comm`` of communication of which
        ``exposed`` not hidden."""
        self.compute_s += compute + attention
        self.attention_s += attention
        self.comm_s += comm
        self.exposed_s += exposed


@dataclass
class StepTime:
    """A step's predicted time on one rank (the slowest: the plan's rank is priced at the largest share)."""

    hardware: str
    """The profile's name."""
    seconds: float
    """Forward + backward (+ the optimizer's step when the plan counts one)."""
    forward_s: float
    """Of which the forward pass (its ops, attention, exposed communication)."""
    backward_s: float
    """Of which the backward pass (recomputation included) and what waits after it (gradient buckets, FSDP2,
    offload copies not hidden)."""
    optimizer_s: float
    """Of which the optimizer's pass over its states and the parameters."""
    tokens_per_second: float
    """Tokens of the global batch per second per rank."""
    layers: list[LayerTime] = field(default_factory=list)
    comm_s: float = 0.0
    """All communication (attention, other collectives, FSDP2), hidden or not."""
    exposed_comm_s: float = 0.0
    """The part of it the step waits for."""

    def attention_scaled(self, ratio: float) -> "StepTime":
        """The same step with every layer's attention compute ``ratio`` times what it was (what packed documents
        make of it, known once the plan has read them), forward 1 / 3.5 of the change."""
        layers, change = [], 0.0
        for row in self.layers:
            delta = row.attention_s * (ratio - 1)
            change += delta
            layers.append(dataclasses.replace(row, compute_s=row.compute_s + delta, attention_s=row.attention_s + delta))
        seconds = self.seconds + change
        return dataclasses.replace(self, seconds=seconds, forward_s=self.forward_s + change / 3.5,
                                   backward_s=self.backward_s + change * 2.5 / 3.5, layers=layers,
                                   tokens_per_second=self.tokens_per_second * self.seconds / seconds)

    def attention_comm_added(self, seconds: float, forward: float) -> "StepTime":
        """The same step with ``seconds`` more exposed attention communication (``forward`` of them in the forward;
        negative: less), spread over the layers by their attention time: what packed documents' traffic makes of
        the all-gather's, known once the plan has read them."""
        total = sum(row.attention_s for row in self.layers)
        layers = [dataclasses.replace(row, comm_s=row.comm_s + seconds * row.attention_s / total,
                                      exposed_s=row.exposed_s + seconds * row.attention_s / total)
                  for row in self.layers] if total else self.layers
        step = self.seconds + seconds
        return dataclasses.replace(self, seconds=step, forward_s=self.forward_s + forward,
                                   backward_s=self.backward_s + seconds - forward, layers=layers,
                                   comm_s=self.comm_s + seconds, exposed_comm_s=self.exposed_comm_s + seconds,
                                   tokens_per_second=self.tokens_per_second * self.seconds / step)

    def describe(self) -> str:
        """One line: the time, its split and the throughput."""
        return (f"{self.seconds:.3f} s on {self.hardware} (forward {self.forward_s:.3f}, backward {self.backward_s:.3f}"
                + (f", optimizer {self.optimizer_s:.3f}" if self.optimizer_s else "")
                + f"; communication {self.comm_s:.3f} s, {self.exposed_comm_s:.3f} exposed); "
                  f"{self.tokens_per_second:,.0f} tokens/s per rank")


@lru_cache(maxsize=256)
def _attention_cost(shape: AttentionShape, world: int, topology: HardwareProfile, strategy: str):
    return next(c for c in attention_costs(shape, world, topology) if c.strategy == strategy)


@register("seconds", torch.ops.autoshard.attention.default, torch.ops.autoshard.attention_backward.default)
def _attention_seconds(a: Arguments, topology: HardwareProfile, world: int) -> tuple[float, float, float]:
    """(compute, communication, exposed communication) seconds of one attention op (see the module docstring)."""
    shape, config, backward = attention_op_shape(a)
    cost = _attention_cost(shape, world, topology, config.strategy)
    share = 2.5 / 3.5 if backward else 1 / 3.5
    sent = cost.bytes_forward + cost.bytes_backward
    part = (cost.bytes_backward if backward else cost.bytes_forward) / sent if sent else 0.5
    exposed = cost.total_s - cost.compute_s  # the exposed traffic, the latencies and the ring's merges
    return cost.compute_s * share, cost.comm_s * part, exposed * part


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class OpTimer(TorchDispatchMode):
    """Prices every op dispatched under it on ``topology`` for a rank of ``world`` (see the module docstring),
    booked to :attr:`layer` in :attr:`phase` (set by :func:`run_timed`)."""

    def __init__(self, topology: HardwareProfile, world: int):
        super().__init__()
        self.topology, self.world = topology, world
        self.slowdown = topology.slowdown(world)
        self.phase = "forward"
        self.layer = REST
        self.layers: dict[str, LayerTime] = {}
        self.phases = {"forward": 0.0, "backward": 0.0}
        self.sequence: list[int] = []  # autograd sequence numbers, sorted, with the layer whose node made them
        self.sequence_layers: list[str] = []

    def made(self, value: Any, layer: str) -> None:
        """Note the autograd nodes behind ``value`` (an fx node's outputs) as ``layer``'s."""
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                number = t.grad_fn._sequence_nr()
                if not self.sequence or number > self.sequence[-1]:
                    self.sequence.append(number)
                    self.sequence_layers.append(layer)

    def _current_layer(self) -> str:
        if self.phase == "forward":
            return self.layer
        node = torch._C._current_autograd_node()
        if node is None:
            return REST
        i = bisect.bisect_left(self.sequence, node._sequence_nr())
        return self.sequence_layers[i] if i < len(self.sequence) else REST

    def book(self, layer: str, *, compute: float = 0.0, attention: float = 0.0, comm: float = 0.0,
             exposed: float = 0.0) -> None:
        self.layers.setdefault(layer, LayerTime(layer)).add(compute=compute, attention=attention, comm=comm,
                                                            exposed=exposed)
        self.phases[self.phase] += compute + attention + exposed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in _FREE_NAMESPACES:
            return out
        layer, t, info = self._current_layer(), self.topology, lookup(func)
        if info is not None and info.seconds is not None:
            compute, comm, exposed = info.seconds(info.arguments(args, kwargs), t, self.world)
            self.book(layer, attention=compute, comm=comm, exposed=exposed)
            return out
        if func in _MATMULS:
            a, b = args[_MATMULS[func]:_MATMULS[func] + 2]
            flops = 2 * a.numel() * b.shape[-1]
            seconds = flops / t.matmul_rate(a.dtype)
        elif info is not None and info.flops is not None:
            seconds = info.flops(info.arguments(args, kwargs)).seconds(t)
        else:
            seconds = self._memory_seconds(func, args, kwargs, out)
        self.book(layer, compute=(seconds + t.op_overhead) * self.slowdown)
        return out

    def _memory_seconds(self, func, args, kwargs, out) -> float:
        """An op's bytes over the bandwidth; 0 for a view (its outputs share an input's storage and it writes
        nothing)."""
        inputs = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        outputs = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
        if not func._schema.is_mutable:
            storages = {x.untyped_storage()._cdata for x in inputs}
            if outputs and all(x.untyped_storage()._cdata in storages for x in outputs):
                return 0.0
        return (_nbytes(inputs) + _nbytes(outputs)) / self.topology.memory_bandwidth


def _node_layer(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The layer of a top-level node: its module stack's (``rest`` outside every layer); for a call of an outlined
    region (a checkpoint), that of the first node inside with one; None for a node the passes made without a
    module stack (it runs amid the nodes of the one before it)."""
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            sub = getattr(gm, arg.target, None)
            if isinstance(sub, fx.GraphModule):
                return next((found for n in sub.graph.nodes if (found := layer_of(n)) is not None), REST)
    if "nn_module_stack" not in node.meta:
        return None
    return layer_of(node) or REST


class _Timed(fx.Interpreter):
    """Runs a graph node by node, telling the timer which layer runs."""

    def __init__(self, gm: fx.GraphModule, timer: OpTimer):
        super().__init__(gm)
        self.timer = timer

    def run_node(self, n: fx.Node):
        layer = _node_layer(self.module, n) if n.op != "placeholder" else REST
        if layer is not None:
            self.timer.layer = layer
        out = super().run_node(n)
        self.timer.made(out, self.timer.layer)
        return out


def run_timed(gm: fx.GraphModule, inputs: list, timer: OpTimer):
    """``gm(*inputs)`` with ``timer`` told the layer of each node."""
    return _Timed(gm, timer).run(*inputs)


def step_time(timers: list[OpTimer], *, topology: HardwareProfile, world: int, tokens: int, collectives: list,
              attention_nodes: set[str], fsdp: list[int] | None, dp_shard: int, host_bytes: int,
              optimizer_bytes: int, host_prefetched: bool = True) -> StepTime:
    """The step's time from the timers of its graph calls and the plan's counts (see the module docstring).
    ``collectives``: the plan's :class:`~autoshard.planner.Collective` entries, those of ``attention_nodes`` already
    priced with their calls; ``fsdp``: the bytes of each FSDP2 unit's parameters (None: no FSDP2), the largest the
    layers'; ``host_bytes``: offloaded bytes (``host_prefetched``: copied back prefetched); ``optimizer_bytes``:
    what the optimizer reads and writes."""
    layers: dict[str, LayerTime] = {}
    forward = backward = 0.0
    for call, timer in enumerate(timers):
        # a graph that is one layer (FSDP2's per-layer graphs, a block compiled alone) has no layer list inside
        one_layer = set(timer.layers) == {REST} and timer.layers[REST].attention_s > 0
        for name, row in timer.layers.items():
            name = f"graph call {call}" if one_layer else name
            layers.setdefault(name, LayerTime(name)).add(compute=row.compute_s - row.attention_s,
                                                         attention=row.attention_s, comm=row.comm_s,
                                                         exposed=row.exposed_s)
        forward += timer.phases["forward"]
        backward += timer.phases["backward"]
    forward_compute = forward
    others = sum(topology.collective_seconds(c.bytes_per_rank, world) for c in collectives
                 if c.node not in attention_nodes)
    rest = layers.setdefault(REST, LayerTime(REST))
    rest.add(comm=others, exposed=others)
    backward += others  # the gradient buckets dominate; the loss's all-reduces are a few bytes
    named = [row for name, row in layers.items() if name != REST]
    if fsdp and dp_shard > 1:
        # per unit: all-gathered in forward and again in backward, its gradients reduce-scattered: each moves
        # (dp - 1) / dp of the unit; prefetch hides it behind the layer's compute, not the root's first gather
        for i, unit in enumerate(sorted(fsdp, reverse=True)):
            row = named[i] if i < len(named) else rest
            comm = 3 * topology.collective_seconds(unit * (dp_shard - 1) / dp_shard, dp_shard)
            exposed = comm - (min(comm, row.compute_s) if row is not rest else 0.0)
            row.add(comm=comm, exposed=exposed)
            backward += exposed
    compute = sum(row.compute_s for row in layers.values())
    if host_bytes:  # the copy stream's work, behind the compute it overlaps; the compute stream waits only for what
        one_way = host_bytes / topology.host_bandwidth  # backward copies back
        if host_prefetched:  # each layer's copy back runs during the layer before it in backward
            exposed = max(0.0, 2 * one_way - compute)
        else:  # each copy back waits in full, after whatever of the copies out forward's compute did not hide
            exposed = one_way + max(0.0, one_way - forward_compute)
        rest.add(comm=2 * one_way, exposed=exposed)
        backward += exposed
    optimizer = optimizer_bytes / topology.memory_bandwidth * topology.slowdown(world)
    seconds = forward + backward + optimizer
    rows = [row for name, row in layers.items() if name != REST] + ([rest] if rest.seconds or rest.comm_s else [])
    return StepTime(hardware=topology.name, seconds=seconds, forward_s=forward, backward_s=backward,
                    optimizer_s=optimizer, tokens_per_second=tokens / world / seconds if seconds else 0.0,
                    layers=rows, comm_s=sum(r.comm_s for r in rows), exposed_comm_s=sum(r.exposed_s for r in rows))
