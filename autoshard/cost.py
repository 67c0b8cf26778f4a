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
:func:`attention_costs` prices every registered strategy through a
:class:`~autoshard.runtime.attention.base.Pricing` -- the call (its
:class:`~autoshard.runtime.attention.base.AttentionShape`), the ranks, the hardware profile
(:class:`~autoshard.hardware.HardwareProfile`), and the terms the strategies share (the per-rank compute, the
ring's steps, bytes from the strategy's formulas, the working set of the inputs). Those live with the strategy
registry, below the strategies; this module sits above them.
"""

from __future__ import annotations

from .hardware import HardwareProfile
from .runtime.attention import STRATEGIES
from .runtime.attention.base import AttentionShape, Pricing, StrategyCost

__all__ = ["attention_costs", "choose_strategy", "preferred_layout", "NEAR_TIE"]


def preferred_layout(strategy: str, shape: AttentionShape, world: int) -> str:
    """The sequence layout ``strategy`` runs best on (its registered preference): zigzag balances a causal mask
    for the zigzag ring, the all-gather and the hybrid (whose ring spans the flattened mesh) once the sequence
    has 2P positions; the contiguous ring and Ulysses (each rank attends whole sequences of its heads) take
    the contiguous layout."""
    return STRATEGIES[strategy].preferred_layout(shape, world)


def attention_costs(shape: AttentionShape, world: int, hardware: HardwareProfile = HardwareProfile(), *,
                    hybrid_possible: bool = True, memory_budget: int | None = None,
                    head_chunks: int = 1) -> list[StrategyCost]:
    """The cost of every registered strategy for ``shape`` on ``world`` ranks of ``hardware``, in registry order;
    one whose working set (its head groups ``head_chunks`` at a time) exceeds the budget (default: the profile's
    memory) is not feasible."""
    budget = memory_budget if memory_budget is not None else hardware.memory_bytes
    costs = [strategy.cost(Pricing(strategy, shape, world, hardware, hybrid_possible, head_chunks))
             for strategy in STRATEGIES.values()]
    for c in costs:
        if c.feasible and c.memory_bytes > budget:
            c.feasible, c.why_not = False, (f"needs {c.memory_bytes / 2**30:.1f} GiB for attention, over the "
                                            f"{budget / 2**30:.1f} GiB budget")
    return costs


NEAR_TIE = 0.02
"""How close to the fastest strategy's time another's must be to count as a tie when memory decides (with head
groups on: the memory policy's attention lever)."""


def choose_strategy(costs: list[StrategyCost], *, lean: bool = False) -> tuple[StrategyCost, str]:
    """The fastest feasible strategy and a sentence saying why (ties go to the simpler strategy: the lower
    registered rank, ring, zigzag, ulysses, allgather, hybrid). ``lean`` (head groups on: memory is short):
    among the strategies within :data:`NEAR_TIE` of the fastest, the one whose working set is the smallest."""
    feasible = sorted((c for c in costs if c.feasible),
                      key=lambda c: (round(c.total_s, 12), STRATEGIES[c.strategy].rank))
    if not feasible:
        raise ValueError("autoshard: no distributed attention strategy fits: "
                         + "; ".join(c.summary() for c in costs))
    best = feasible[0]
    if lean:
        best = min((c for c in feasible if c.total_s <= feasible[0].total_s * (1 + NEAR_TIE)),
                   key=lambda c: (c.memory_bytes, c.total_s))
    others = [c for c in costs if c is not best]
    rivals = ", ".join(f"{c.strategy} {c.total_s * 1e3:.3f} ms" if c.feasible else f"{c.strategy} impossible ({c.why_not})"
                       for c in others)
    why = STRATEGIES[best.strategy].reason
    if best is not feasible[0]:
        why = (f"within {NEAR_TIE:.0%} of the fastest, it holds the least for attention "
               f"({best.memory_bytes / 2**30:.1f} GiB with its head groups)")
    return best, f"{best.strategy} ({best.total_s * 1e3:.3f} ms per call): {why}; vs {rivals}"
