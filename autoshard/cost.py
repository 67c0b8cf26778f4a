"""The cost model: how long each distributed-attention strategy takes on a cluster, and which to use.

Per attention call (forward + backward, per rank):

* **compute** -- attention FLOPs (``4 B H S_q S_k D`` forward, 2.5x that backward, halved by a causal
  mask, narrowed by a window or by chunks) divided among the ranks as the strategy divides them: evenly for
  Ulysses and the zigzag ring, unevenly for a contiguous layout under a causal mask without chunks (the last
  rank's queries see the most keys; chunked local attention gives every chunk the same work), with
  Ulysses' uneven head split as it is;
* **communication** -- the bytes of :mod:`autoshard.runtime.attention.formulas` over the bandwidth of the
  links they cross: NVLink-class inside a node, InfiniBand-class between nodes (a ring or an all-to-all
  that spans nodes is paced by the inter-node links);
* **overlap** -- a ring computes one block while the next is in flight, so only the communication that
  exceeds the computation is exposed, but every step pays a launch/synchronization overhead and merges
  its partial output (and, backward, its K/V gradient accumulators) through device memory in fp32;
  Ulysses and all-gather communicate before and after computing, fully exposed;
* **latency** -- per message: ``P - 1`` ring steps each way, a handful of all-to-alls;
* **memory** -- the attention's working set on a rank (all-gather holds the whole K/V).

:func:`choose_strategy` takes the fastest feasible strategy and says why. Ulysses needs the heads to
cover the ranks (``H >= P``); the zigzag ring needs ``2P`` positions; the hybrid needs a group that
spans nodes (and a 2-D mesh to run on).

This module names no strategy: each registers its own cost function, layout preference, tie-break rank
and reason with its algorithm (:class:`autoshard.runtime.attention.base.Strategy`), and
:func:`attention_costs` prices every registered strategy through a :class:`Pricing` -- the call, the
ranks, the cluster, and the terms the strategies share (the per-rank compute, the ring's steps, bytes from
the strategy's formulas, the working set of the inputs).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import sympy
import torch

from .runtime.attention import STRATEGIES, formulas
from .runtime.attention.base import Strategy

__all__ = ["Topology", "StrategyCost", "attention_costs", "attention_seconds", "choose_strategy", "AttentionShape", "preferred_layout",
           "Pricing"]


@dataclass(frozen=True, kw_only=True)
class Topology:
    """A cluster, as the cost model and the step-time prediction see it: what one rank computes, moves and holds.
    The defaults are an H100 SXM node (``autoshard.hardware.PROFILES["h100"]`` says where each figure comes from);
    :func:`autoshard.hardware.hardware` gives the built-in profiles by name and reads calibrated ones from files
    (``python -m autoshard calibrate``)."""

    name: str = "h100"
    """What the profile describes (a built-in's name, or where it was calibrated)."""
    ranks_per_node: int = 8
    """Ranks that share the fast intra-node links."""
    intra_node_bandwidth: float = 450e9
    """Bytes per second a rank sends to ranks of its node."""
    inter_node_bandwidth: float = 50e9
    """Bytes per second a rank sends to other nodes."""
    intra_node_latency: float = 3e-6
    """Seconds per message inside a node (a collective over P ranks sends P - 1 of them)."""
    inter_node_latency: float = 10e-6
    """Seconds per message between nodes."""
    attention_flops: float = 400e12
    """Attention FLOP/s a rank sustains in 16-bit (forward and backward together, FLOPs counted as
    :class:`AttentionShape` does)."""
    attention_flops_fp32: float = 40e12
    """The same in float32 (and float64)."""
    attention_pair_flops: float = 0.0
    """What each visible (query, key) pair and head costs beyond the products' ``14 D`` FLOPs (forward + backward: the
    softmax's exponentials, the mask, the online rescaling), in FLOPs at the attention rate: it makes small head dims
    slower per FLOP. 0: folded into the rate (the built-in profiles, measured at head dim 128)."""
    matmul_flops: float = 700e12
    """Matrix-multiply FLOP/s a rank sustains in 16-bit (``2 M N K`` per product)."""
    matmul_flops_fp32: float = 50e12
    """The same in float32 (PyTorch's default: no TF32)."""
    step_overhead: float = 20e-6
    """Seconds each ring step costs beyond its compute and traffic (launches, synchronization)."""
    op_overhead: float = 4e-6
    """Seconds every other op costs beyond its arithmetic and memory traffic (a kernel launch; an eager CPU op's
    dispatch)."""
    memory_bandwidth: float = 3.0e12
    """Bytes per second of device memory an elementwise op sustains (reads and writes together; a ring merges
    every block's partial output through it)."""
    memory_bytes: int = 80 * 2**30
    """Memory per rank."""
    host_memory_bytes: int = 256 * 2**30
    """Host memory per rank (offloaded activations live there)."""
    host_bandwidth: float = 40e9
    """Bytes per second between a rank's device and pinned host memory, each way."""
    concurrent_ranks: int = 0
    """Ranks of a node that compute at full speed at once (a CPU's cores over each rank's threads); more ranks on
    a node share them, each computing that much slower. 0: every rank has its own device."""
    sharing_efficiency: float = 1.0
    """How much of the cores ranks beyond :attr:`concurrent_ranks` get when they share them (1: perfect time slicing;
    context switches and caches make it less)."""
    threads: int = 0
    """CPU threads per rank the compute figures were measured with (a CPU calibration's ``torch.get_num_threads()``;
    :meth:`with_threads` prices ranks with other threads). 0: each rank has a device whose speed its host's threads do
    not change (a GPU)."""

    def __post_init__(self):
        rates = (self.intra_node_bandwidth, self.inter_node_bandwidth, self.attention_flops, self.memory_bandwidth,
                 self.memory_bytes, self.attention_flops_fp32, self.matmul_flops, self.matmul_flops_fp32,
                 self.host_memory_bytes, self.host_bandwidth)
        times = (self.intra_node_latency, self.inter_node_latency, self.step_overhead, self.op_overhead)
        if (self.ranks_per_node < 1 or min(rates) <= 0 or min(times) < 0 or self.concurrent_ranks < 0
                or self.attention_pair_flops < 0 or not 0 < self.sharing_efficiency <= 1 or self.threads < 0):
            raise ValueError(f"Topology: ranks per node, bandwidths, FLOP/s and memory must be positive and "
                             f"latencies not negative: {self}")
        if self.threads and not self.concurrent_ranks:
            raise ValueError(f"Topology: a CPU profile (threads {self.threads}) needs its concurrent ranks (the cores "
                             f"over the threads): {self}")

    def bandwidth(self, ranks: int) -> float:
        """Bandwidth of a collective over ``ranks`` consecutive ranks."""
        return self.intra_node_bandwidth if ranks <= self.ranks_per_node else self.inter_node_bandwidth

    def latency(self, ranks: int) -> float:
        """Seconds per message of a collective over ``ranks`` consecutive ranks."""
        return self.intra_node_latency if ranks <= self.ranks_per_node else self.inter_node_latency

    def collective_seconds(self, nbytes: float, ranks: int) -> float:
        """Seconds of a collective over ``ranks`` ranks in which a rank sends ``nbytes``: ``P - 1`` messages' latency
        and the bytes over the links they cross (0 on one rank)."""
        if ranks <= 1:
            return 0.0
        return (ranks - 1) * self.latency(ranks) + nbytes / self.bandwidth(ranks)

    def slowdown(self, ranks: int) -> float:
        """How much slower a rank computes when ``ranks`` ranks run (:attr:`concurrent_ranks`): 1 with a device each."""
        sharing = min(ranks, self.ranks_per_node)
        if not self.concurrent_ranks or sharing <= self.concurrent_ranks:
            return 1.0
        return sharing / self.concurrent_ranks / self.sharing_efficiency

    def with_threads(self, threads: int | None = None, *, world: int = 1) -> "Topology":
        """This profile for a run whose ranks get ``threads`` CPU threads each (:attr:`threads`); None: what torchrun
        gives a rank of a ``world``-rank run -- ``OMP_NUM_THREADS`` when set, else one thread when several ranks run
        (torchrun sets it so for more than one rank per node, and :func:`autoshard.testing.run_on_ranks` runs one per
        rank), else the profile's own (a lone process keeps PyTorch's default, what a calibration in one process
        measured). A profile without threads (a GPU's) is returned as it is.

        The model, for a CPU rank on the cores the profile saw (:attr:`concurrent_ranks` x :attr:`threads`; threads
        beyond them add nothing):

        * matrix multiplies and attention split their work over the threads: their FLOP/s scale in proportion to
          them (measured on 2 cores, 1 -> 2 threads: float32 products x1.9, attention x2.1; assumed for 16-bit
          products too, though a CPU without 16-bit matrix units runs them on one thread: x1.0 on that machine);
        * memory-bound ops split their bytes over the threads but share one memory system: bandwidth scales as the
          square root of the threads (measured there: an add x1.6, noisy from x1.2 to x2.0);
        * an op's overhead (its dispatch, on one thread) does not change;
        * :attr:`concurrent_ranks` becomes the cores over the new threads (ranks beyond them share the cores,
          :meth:`slowdown`)."""
        if not self.threads:
            return self
        if threads is None:
            threads = int(os.environ.get("OMP_NUM_THREADS") or (1 if world > 1 else self.threads))
        if threads < 1:
            raise ValueError(f"Topology.with_threads: threads per rank must be positive, got {threads}")
        if threads == self.threads:
            return self
        cores = self.concurrent_ranks * self.threads
        compute = min(threads, cores) / self.threads
        memory = compute ** 0.5
        concurrent = max(1, cores // threads)
        return dataclasses.replace(
            self, name=f"{self.name}, at {threads} thread(s) per rank", threads=threads, concurrent_ranks=concurrent,
            ranks_per_node=max(self.ranks_per_node, concurrent), matmul_flops=self.matmul_flops * compute,
            matmul_flops_fp32=self.matmul_flops_fp32 * compute, attention_flops=self.attention_flops * compute,
            attention_flops_fp32=self.attention_flops_fp32 * compute, memory_bandwidth=self.memory_bandwidth * memory,
            host_bandwidth=self.host_bandwidth * memory)

    def matmul_rate(self, dtype: torch.dtype) -> float:
        """Matrix-multiply FLOP/s in ``dtype``."""
        return self.matmul_flops if _sixteen_bit(dtype) else self.matmul_flops_fp32

    def attention_rate(self, dtype: torch.dtype) -> float:
        """Attention FLOP/s in ``dtype``."""
        return self.attention_flops if _sixteen_bit(dtype) else self.attention_flops_fp32


def _sixteen_bit(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and torch.finfo(dtype).bits <= 16


@dataclass(frozen=True)
class AttentionShape:
    """What the cost of one attention depends on."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    causal: bool = False
    window: tuple[int, int] | None = None
    key_mask: bool = False
    segment_ids_dtype: torch.dtype | None = None
    chunk: int = 0
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
        """Forward FLOPs of the whole attention (every rank together)."""
        pairs = self.seq * self.seq
        if self.window is not None:
            left, right = self.window
            span = (self.seq if left < 0 else left + 1) + (0 if right == 0 else (self.seq if right < 0 else right))
            pairs = self.seq * min(self.seq, span)
        elif self.causal:
            pairs = self.seq * (self.seq + 1) / 2
        if self.chunk:
            chunk = min(self.chunk, self.seq)
            pairs = min(pairs, self.seq * ((chunk + 1) / 2 if self.causal else chunk))
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


def preferred_layout(strategy: str, shape: AttentionShape, world: int) -> str:
    """The sequence layout ``strategy`` runs best on (its registered preference): zigzag balances a causal mask
    for the zigzag ring, the all-gather and the hybrid (whose ring spans the flattened mesh) once the sequence
    has 2P positions; the contiguous ring and Ulysses (each rank attends whole sequences of its heads) take
    the contiguous layout."""
    return STRATEGIES[strategy].preferred_layout(shape, world)


def attention_seconds(shape: AttentionShape, topology: Topology) -> float:
    """Seconds of the whole attention's forward + backward (2.5x the forward) on one rank of ``topology``: its FLOPs,
    and the per-pair cost beyond them (:attr:`Topology.attention_pair_flops`), at the attention rate."""
    per_pair = topology.attention_pair_flops / (2 * shape.kv_dims)  # a pair is 2 kv_dims forward FLOPs per head
    return shape.flops() * (3.5 + per_pair) / topology.attention_rate(shape.dtype)


DOCUMENT_IMBALANCE = 1.4
"""What packed documents cost a ring, whose ranks' work is where the layout puts their queries: max/mean over ranks
measured 1.2-2.2 on either layout for 13 to 23 documents of log-normal lengths (mean ~800 tokens) at P=4 and
S=16384, 1.2-2.1 at S=4096 (``python benchmarks/packed.py``, its second table). The documents are data the plan does
not see, so the cost model charges a typical value."""


@dataclass(frozen=True)
class Pricing:
    """What a strategy's cost function (:attr:`~autoshard.runtime.attention.base.Strategy.cost`) prices: one call
    of ``shape`` on ``world`` ranks of ``topology``, and the terms the strategies share."""

    strategy: Strategy
    shape: AttentionShape
    world: int
    topology: Topology
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
        (:attr:`~autoshard.runtime.attention.base.Strategy.working_set`)."""
        return self.inputs_bytes + max(self.strategy.working_set(self.shape, self.world, self.head_chunks, backward)
                                       for backward in (False, True))

    def busiest(self, imbalance: float) -> float:
        """Seconds of forward + backward (2.5x) compute of the most loaded rank, which does ``imbalance`` times the
        mean. Ranks that share a node's cores (:meth:`Topology.slowdown`) take turns: the step then lasts at least
        the mean work at the rank's share of the cores, and the idle ranks' turns go to the busy ones."""
        mean = attention_seconds(self.shape, self.topology) / self.world
        return mean * max(imbalance, self.topology.slowdown(self.world))

    @cached_property
    def balanced(self) -> float:
        """:meth:`busiest` of the work split evenly."""
        return self.busiest(1.0)

    @cached_property
    def contiguous(self) -> float:
        """:meth:`busiest` on the contiguous layout: a causal mask without window or chunks leaves the last rank's
        queries the most keys; packed documents at least :data:`DOCUMENT_IMBALANCE`."""
        s = self.shape
        causal = (2 * self.world - 1) / self.world if s.causal and s.window is None and not s.chunk else 1.0
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
        return steps * (out + grads) / self.topology.memory_bandwidth

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
        world, topology = self.world, self.topology
        sent = self.sent({"P": world})
        comm = sum(sent) / topology.bandwidth(world)
        latency = 2 * world * (topology.latency(world) + topology.step_overhead) + self.merge_time(world)
        return self.cost(compute=compute, comm=comm, exposed=max(0.0, comm - compute), latency=latency, sent=sent,
                         memory=self.memory)


def attention_costs(shape: AttentionShape, world: int, topology: Topology = Topology(), *,
                    hybrid_possible: bool = True, memory_budget: int | None = None,
                    head_chunks: int = 1) -> list[StrategyCost]:
    """The cost of every registered strategy for ``shape`` on ``world`` ranks of ``topology``, in registry order;
    one whose working set (its head groups ``head_chunks`` at a time) exceeds the budget (default: the topology's
    memory) is not feasible."""
    budget = memory_budget if memory_budget is not None else topology.memory_bytes
    costs = [strategy.cost(Pricing(strategy, shape, world, topology, hybrid_possible, head_chunks))
             for strategy in STRATEGIES.values()]
    for c in costs:
        if c.feasible and c.memory_bytes > budget:
            c.feasible, c.why_not = False, (f"needs {c.memory_bytes / 2**30:.1f} GiB for attention, over the "
                                            f"{budget / 2**30:.1f} GiB budget")
    return costs


def choose_strategy(costs: list[StrategyCost]) -> tuple[StrategyCost, str]:
    """The fastest feasible strategy and a sentence saying why (ties go to the simpler strategy: the lower
    registered rank, ring, zigzag, ulysses, allgather, hybrid)."""
    feasible = sorted((c for c in costs if c.feasible),
                      key=lambda c: (round(c.total_s, 12), STRATEGIES[c.strategy].rank))
    if not feasible:
        raise ValueError("autoshard: no distributed attention strategy fits: "
                         + "; ".join(c.summary() for c in costs))
    best = feasible[0]
    others = [c for c in costs if c is not best]
    rivals = ", ".join(f"{c.strategy} {c.total_s * 1e3:.3f} ms" if c.feasible else f"{c.strategy} impossible ({c.why_not})"
                       for c in others)
    why = STRATEGIES[best.strategy].reason
    return best, f"{best.strategy} ({best.total_s * 1e3:.3f} ms per call): {why}; vs {rivals}"
