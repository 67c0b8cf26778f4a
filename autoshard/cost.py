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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .runtime.attention import formulas

__all__ = ["Topology", "StrategyCost", "attention_costs", "choose_strategy", "AttentionShape", "preferred_layout"]


@dataclass(frozen=True, kw_only=True)
class Topology:
    """A cluster, as the cost model sees it. Defaults: 8-GPU NVLink nodes on InfiniBand (H100-class)."""

    ranks_per_node: int = 8
    """Ranks that share the fast intra-node links."""
    intra_node_bandwidth: float = 450e9
    """Bytes per second a rank sends to ranks of its node."""
    inter_node_bandwidth: float = 50e9
    """Bytes per second a rank sends to other nodes."""
    intra_node_latency: float = 3e-6
    """Seconds per message inside a node."""
    inter_node_latency: float = 10e-6
    """Seconds per message between nodes."""
    attention_flops: float = 400e12
    """Attention FLOP/s a rank sustains."""
    step_overhead: float = 20e-6
    """Seconds each ring step costs beyond its compute and traffic (launches, synchronization)."""
    memory_bandwidth: float = 3.0e12
    """Bytes per second of device memory (a ring merges every block's partial output through it)."""
    memory_bytes: int = 80 * 2**30
    """Memory per rank."""

    def __post_init__(self):
        rates = (self.intra_node_bandwidth, self.inter_node_bandwidth, self.attention_flops, self.memory_bandwidth,
                 self.memory_bytes)
        times = (self.intra_node_latency, self.inter_node_latency, self.step_overhead)
        if self.ranks_per_node < 1 or min(rates) <= 0 or min(times) < 0:
            raise ValueError(f"Topology: ranks per node, bandwidths, FLOP/s and memory must be positive and "
                             f"latencies not negative: {self}")

    def bandwidth(self, ranks: int) -> float:
        """Bandwidth of a collective over ``ranks`` consecutive ranks."""
        return self.intra_node_bandwidth if ranks <= self.ranks_per_node else self.inter_node_bandwidth

    def latency(self, ranks: int) -> float:
        """Seconds per message of a collective over ``ranks`` consecutive ranks."""
        return self.intra_node_latency if ranks <= self.ranks_per_node else self.inter_node_latency


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
    """The sequence layout ``strategy`` runs best on. Zigzag balances a causal mask for the zigzag ring,
    the all-gather and the hybrid (whose ring spans the flattened mesh) once the sequence has 2P
    positions; the contiguous ring and Ulysses (each rank attends whole sequences of its heads) take
    the contiguous layout."""
    balances = strategy == "zigzag" or (strategy in ("allgather", "hybrid") and shape.causal)
    return "zigzag" if balances and shape.seq >= 2 * world else "contiguous"


def _merge_time(shape: AttentionShape, world: int, steps: int, topology: Topology) -> float:
    """Seconds a ring spends merging ``steps`` partial results per rank (fp32 read, read, write)."""
    local = -(-shape.seq // world)
    out = shape.batch * shape.heads * local * (shape.dv + 1) * 4 * 3
    grads = shape.batch * shape.kv_heads * local * shape.kv_dims * 4 * 3
    return steps * (out + grads) / topology.memory_bandwidth


def _bytes(strategy: str, shape: AttentionShape, sizes: dict) -> tuple[int, int]:
    subs = formulas.values(dtype=shape.dtype, key_mask=shape.key_mask, segment_ids_dtype=shape.segment_ids_dtype,
                           B=shape.batch, S=shape.seq, H=shape.heads, Hkv=shape.kv_heads, D=shape.head_dim,
                           Dv=shape.dv, **sizes)
    return tuple(int(math.ceil(float(formulas.bytes_sent(strategy, d).subs(subs)))) for d in ("forward", "backward"))


def attention_costs(shape: AttentionShape, world: int, topology: Topology = Topology(), *,
                    hybrid_possible: bool = True, memory_budget: int | None = None) -> list[StrategyCost]:
    """The cost of every strategy for ``shape`` on ``world`` ranks of ``topology``."""
    total_flops = shape.flops() * 3.5  # forward + backward (2.5x)
    item = torch.empty((), dtype=shape.dtype).element_size()
    local = -(-shape.seq // world)
    qkvo = shape.batch * local * (shape.heads + shape.kv_heads) * shape.kv_dims * item
    budget = memory_budget if memory_budget is not None else topology.memory_bytes
    costs = []

    def ring_like(name: str, layout: str, compute: float):
        """A ring over all ``world`` ranks: K/V blocks travel while the previous block is computed."""
        fwd, bwd = _bytes(name, shape, {"P": world})
        comm = (fwd + bwd) / topology.bandwidth(world)
        exposed = max(0.0, comm - compute)
        latency = 2 * world * (topology.latency(world) + topology.step_overhead) + _merge_time(shape, world, world,
                                                                                              topology)
        memory = qkvo + 2 * shape.batch * local * shape.kv_heads * shape.kv_dims * item
        costs.append(StrategyCost(name, True, compute_s=compute, comm_s=comm, exposed_comm_s=exposed,
                                  latency_s=latency, total_s=compute + exposed + latency, bytes_forward=fwd,
                                  bytes_backward=bwd, memory_bytes=memory, layout=layout))

    balanced = total_flops / world / topology.attention_flops
    imbalanced = balanced * ((2 * world - 1) / world if shape.causal and shape.window is None and not shape.chunk
                             else 1.0)

    ring_like("ring", "contiguous", imbalanced)
    if shape.seq >= 2 * world:
        ring_like("zigzag", "zigzag", balanced)
    else:
        costs.append(StrategyCost("zigzag", False, f"the zigzag layout needs 2P = {2 * world} positions, the sequence "
                                                   f"has {shape.seq}"))

    fwd, bwd = _bytes("allgather", shape, {"P": world})
    gathered = shape.batch * shape.seq * shape.kv_heads * shape.kv_dims * item
    comm = (fwd + bwd) / topology.bandwidth(world)
    latency = 4 * topology.latency(world) * max(1, math.ceil(math.log2(max(world, 2))))
    costs.append(StrategyCost("allgather", True, compute_s=balanced, comm_s=comm, exposed_comm_s=comm,
                              latency_s=latency, total_s=balanced + comm + latency, bytes_forward=fwd,
                              bytes_backward=bwd, memory_bytes=qkvo + gathered,
                              layout=preferred_layout("allgather", shape, world)))

    if shape.heads >= world:
        fwd, bwd = _bytes("ulysses", shape, {"P": world})
        heads_share = math.ceil(shape.heads / world) / (shape.heads / world)
        compute = balanced * heads_share
        comm = (fwd + bwd) / topology.bandwidth(world)
        latency = 10 * topology.latency(world)
        costs.append(StrategyCost("ulysses", True, compute_s=compute, comm_s=comm, exposed_comm_s=comm,
                                  latency_s=latency, total_s=compute + comm + latency, bytes_forward=fwd,
                                  bytes_backward=bwd, memory_bytes=qkvo))
    else:
        costs.append(StrategyCost("ulysses", False, f"{shape.heads} heads cannot cover {world} ranks; the all-to-all "
                                                    "splits heads"))

    inner = math.gcd(topology.ranks_per_node, world)
    while inner > 1 and shape.heads % inner:
        inner //= 2
    if not hybrid_possible:
        costs.append(StrategyCost("hybrid", False, "needs a 2-D device mesh (ring axis, ulysses axis)"))
    elif world <= topology.ranks_per_node or inner <= 1:
        costs.append(StrategyCost("hybrid", False, "the group fits in one node (Ulysses alone is the inner part)"
                                  if world <= topology.ranks_per_node else "no node-sized head split"))
    else:
        outer = world // inner
        sizes = {"P_r": outer, "P_u": inner}
        fwd, bwd = _bytes("hybrid", shape, sizes)
        # Ulysses inside the node (fast, exposed), the ring across nodes (slow, overlapped)
        u_fwd, u_bwd = _bytes("ulysses", AttentionShape(shape.batch, shape.seq // outer, shape.heads, shape.kv_heads,
                                                        shape.head_dim, shape.dtype, value_head_dim=shape.dv),
                              {"P": inner})
        inner_comm = (u_fwd + u_bwd) / topology.intra_node_bandwidth
        ring_comm = max(0, fwd + bwd - u_fwd - u_bwd) / topology.inter_node_bandwidth
        compute = balanced
        exposed = inner_comm + max(0.0, ring_comm - compute)
        latency = (10 * topology.intra_node_latency + 2 * outer * (topology.inter_node_latency + topology.step_overhead)
                   + _merge_time(shape, world, outer, topology))
        costs.append(StrategyCost("hybrid", True, compute_s=compute, comm_s=inner_comm + ring_comm, exposed_comm_s=exposed,
                                  latency_s=latency, total_s=compute + exposed + latency, bytes_forward=fwd,
                                  bytes_backward=bwd, memory_bytes=qkvo,
                                  layout=preferred_layout("hybrid", shape, world), mesh=(outer, inner)))

    for c in costs:
        if c.feasible and c.memory_bytes > budget:
            c.feasible, c.why_not = False, (f"needs {c.memory_bytes / 2**30:.1f} GiB for attention, over the "
                                            f"{budget / 2**30:.1f} GiB budget")
    return costs


def choose_strategy(costs: list[StrategyCost]) -> tuple[StrategyCost, str]:
    """The fastest feasible strategy and a sentence saying why (ties go to the simpler strategy, in
    the order ring, zigzag, ulysses, allgather, hybrid)."""
    order = {"ring": 0, "zigzag": 1, "ulysses": 2, "allgather": 3, "hybrid": 4}
    feasible = sorted((c for c in costs if c.feasible), key=lambda c: (round(c.total_s, 12), order[c.strategy]))
    if not feasible:
        raise ValueError("autoshard: no distributed attention strategy fits: "
                         + "; ".join(c.summary() for c in costs))
    best = feasible[0]
    others = [c for c in costs if c is not best]
    rivals = ", ".join(f"{c.strategy} {c.total_s * 1e3:.3f} ms" if c.feasible else f"{c.strategy} impossible ({c.why_not})"
                       for c in others)
    why = {
        "ulysses": "the heads split evenly enough and the all-to-alls are cheap at this bandwidth",
        "zigzag": "a ring hides its traffic behind computation, and the zigzag layout balances the causal mask",
        "ring": "a ring hides its traffic behind computation",
        "allgather": "gathering K/V once is cheapest here",
        "hybrid": "the group spans nodes: all-to-all inside a node, ring across nodes",
    }[best.strategy]
    return best, f"{best.strategy} ({best.total_s * 1e3:.3f} ms per call): {why}; vs {rivals}"
