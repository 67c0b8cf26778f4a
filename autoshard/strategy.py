"""Choosing a distributed-attention strategy per attention and a layout per sequence family.

An explicit ``strategy`` option wins. Otherwise the cost model (:mod:`autoshard.cost`) prices every
strategy on the configured topology (default: 8-GPU NVLink nodes on InfiniBand) and the fastest
feasible one is taken -- Ulysses when the heads cover the ranks and bandwidth is high, the zigzag ring
for causal attention when ranks outnumber heads, the hybrid when the group spans nodes (it runs only
on a 2-D mesh: with a 1-D group it is reported as what a 2-D mesh would gain). All attentions of a
family share its layout: an explicit ``layout``, or zigzag when any of them runs best on it (the
zigzag ring; the all-gather and the hybrid under a causal mask: :func:`~autoshard.cost.preferred_layout`),
contiguous otherwise; each attention then runs its algorithm's strategy for that layout (the ring and the
zigzag ring swap: :meth:`~autoshard.runtime.attention.base.Strategy.on_layout`). Strategies are read from the
registry (:mod:`autoshard.runtime.attention.base`), never named here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from .config import BackendConfig
from .cost import attention_costs, choose_strategy, preferred_layout
from .hardware import HardwareProfile
from .passes.ops import op_of, value_of
from .runtime.attention import STRATEGIES
from .runtime.attention.base import AttentionShape
from .runtime.attention.masks import MaskSpec
from .runtime.layouts import SequenceLayout
from .runtime.symbolic import hint_of, is_symbolic, size_key

if TYPE_CHECKING:
    from .passes.infer import Families

__all__ = ["choose", "attention_shape", "LONGEST", "LengthClass", "deciding", "length_class"]


def attention_shape(node, length: int) -> AttentionShape:
    """What the cost model needs of the attention ``node`` over a sequence of ``length`` positions. The dtype is
    the one it computes in, its output's (under autocast its inputs may differ; the rewrite casts them)."""
    op = op_of(node)
    q, k, v = value_of(op["q"]), value_of(op["k"]), value_of(op["v"])
    seg = op.get("segment_ids")
    return AttentionShape(batch=q.shape[0], seq=length, heads=q.shape[1], kv_heads=k.shape[1], head_dim=q.shape[3],
                          dtype=value_of(node).dtype,
                          mask=MaskSpec.of(op.get("causal"), op.get("window"), op.get("chunk") or 0),
                          key_mask=op.get("key_mask") is not None,
                          segment_ids_dtype=value_of(seg).dtype if seg is not None else None,
                          value_head_dim=v.shape[3] if v.shape[3] != q.shape[3] else 0)


LONGEST = 1 << 40
"""The longest sequence a length class reaches (a bound the probe of :func:`length_class` stops at)."""


def _at_hint(shape: AttentionShape) -> AttentionShape:
    """``shape`` with its symbolic sizes (a graph compiled for every length) at the call's values: the cost
    model prices concrete lengths."""
    sizes = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)}
    return dataclasses.replace(shape, **{name: hint_of(v) for name, v in sizes.items() if is_symbolic(v)})


def _choice(cost) -> tuple:
    return cost.strategy, cost.layout, cost.mesh


@dataclasses.dataclass(frozen=True, kw_only=True)
class LengthClass:
    """The lengths around a call's over which the cost model's choice for an attention stays the same: what one
    compilation of a graph of symbolic lengths serves for it (a length outside compiles a class of its own)."""

    low: int
    """The shortest length of the class (1: none shorter is different)."""
    high: int
    """The longest (:data:`LONGEST`: none longer is different)."""
    below: str
    """The strategy chosen just below :attr:`low`, with its layout where only that changes (``"allgather on the
    contiguous layout"``); ``""`` where there is none, or where none fits there."""
    above: str
    """The same just above :attr:`high`."""


def deciding(shape: AttentionShape, world: int, topology: HardwareProfile, config: BackendConfig, *,
             hybrid_possible: bool):
    """The cost model's choice for ``shape`` as a function of its length: ``length -> (best cost, why)``
    (:func:`~autoshard.cost.choose_strategy`; raises ValueError where no strategy fits)."""
    def decide(length: int):
        return choose_strategy(attention_costs(dataclasses.replace(shape, seq=length), world, topology,
                                               hybrid_possible=hybrid_possible, memory_budget=config.memory_budget,
                                               head_chunks=config.head_chunks),
                               lean=config.head_chunks > 1)
    return decide


def length_class(length: int, decide) -> LengthClass:
    """The :class:`LengthClass` of ``length`` under ``decide`` (:func:`deciding`): the range around it where the
    choice (strategy, layout, mesh) stays the same, probed by doubling and bisection. The strategies are all exact,
    so a choice that changed and changed back inside a probed step only costs time."""
    def choice_at(n: int):
        try:
            return _choice(decide(n)[0])
        except ValueError:  # no strategy fits at n (the memory budget): a class ends before
            return None

    want = choice_at(length)

    def edge(same: int, step) -> int:
        other = same
        while True:
            nxt = step(other)
            if nxt == other:
                return other
            if choice_at(nxt) != want:
                break
            same = other = nxt
        other = nxt
        while abs(other - same) > 1:
            mid = (same + other) // 2
            if choice_at(mid) == want:
                same = mid
            else:
                other = mid
        return same

    low = edge(length, lambda n: max(1, n // 2))
    high = edge(length, lambda n: min(LONGEST, n * 2))
    def named(other) -> str:  # the strategy, and its layout where only that changed
        if other is None:
            return ""
        return other[0] if want is None or other[1] == want[1] else f"{other[0]} on the {other[1]} layout"

    return LengthClass(low=low, high=high, below=named(choice_at(low - 1)) if low > 1 else "",
                       above=named(choice_at(high + 1)) if high < LONGEST else "")


def _guard_same_choice(length: torch.SymInt, decide) -> None:
    """Guard a symbolic ``length`` to its :func:`length_class`: a graph compiled for every length serves that range,
    and a length outside compiles the graph of its own class."""
    lengths = length_class(hint_of(length), decide)
    if lengths.low > 1 and not length >= lengths.low:  # the guards are recorded here; they hold at the hint
        raise AssertionError("unreachable")
    if lengths.high < LONGEST and not length <= lengths.high:
        raise AssertionError("unreachable")


def _planned_mesh(strategy: str, shape: AttentionShape, world: int, topology: HardwareProfile) -> tuple[int, int]:
    """The (ring, ulysses) mesh a plan of a strategy over a 2-D mesh (``strategy="hybrid"``) without one assumes:
    the one the cost model prices for ``topology`` (Ulysses inside a node)."""
    cost = next(c for c in attention_costs(shape, world, topology) if c.strategy == strategy)
    if not cost.feasible:
        raise ValueError(f"autoshard: strategy={strategy!r} cannot be planned on {world} ranks: {cost.why_not}. Pass "
                         f"topology=autoshard.HardwareProfile(ranks_per_node=...) with nodes smaller than the group")
    return cost.mesh


def choose(families: Families, *, config: BackendConfig, world: int, heads_axis_size: int | None = None,
           topology: HardwareProfile | None = None, planning: bool = False,
           carried_layouts: dict[int, str] | None = None) -> tuple[dict[int, SequenceLayout], dict, dict, int | None]:
    """(root layout per family index, strategy per attention node, reason per attention node, Ulysses axis
    size of the hybrid). ``planning``: the hybrid may be chosen without a 2-D mesh (the plan then says
    which mesh to build). ``carried_layouts``: family index -> the layout kind a value an earlier graph
    returned split arrives in; under ``layout="auto"`` the family keeps it (no re-alignment)."""
    topology = topology or config.topology or HardwareProfile()
    layouts, strategies, reasons = {}, {}, {}
    decided = {}  # (shape, hybrid possible) -> (best, why): the layers of a model share a few shapes
    guarded = set()  # (that key, a symbolic length) whose class range is guarded
    for fam in families.families:
        chosen, wanted_layouts = {}, set()
        for node in fam.attention_nodes:
            shape = attention_shape(node, fam.length)
            if config.strategy != "auto":
                chosen[node] = config.strategy
                reasons[node] = f"{config.strategy}: chosen by the strategy option"
                wanted_layouts.add(preferred_layout(config.strategy, shape, world))
                if STRATEGIES[config.strategy].mesh_groups is not None and heads_axis_size is None:
                    heads_axis_size = _planned_mesh(config.strategy, shape, world, topology)[1]
                    reasons[node] += f"; planned on a 2-D mesh (ring {world // heads_axis_size}, ulysses {heads_axis_size})"
                continue
            hybrid_possible = heads_axis_size is not None or planning
            key = (_at_hint(shape), hybrid_possible)
            decide = deciding(key[0], world, topology, config, hybrid_possible=hybrid_possible)
            if key not in decided:
                decided[key] = decide(key[0].seq)
            if is_symbolic(shape.seq) and (key, size_key(shape.seq)) not in guarded:  # each length's own class
                guarded.add((key, size_key(shape.seq)))
                _guard_same_choice(shape.seq, decide)
            best, why = decided[key]
            chosen[node], reasons[node] = best.strategy, why
            wanted_layouts.add(best.layout)
            if best.mesh is not None and heads_axis_size is None:
                heads_axis_size = best.mesh[1]
                reasons[node] += f"; build a 2-D mesh (ring {best.mesh[0]}, ulysses {best.mesh[1]}) to run it"
        kind = config.layout
        if kind == "auto" and (carried_layouts or {}).get(fam.index) in ("contiguous", "zigzag"):
            kind = carried_layouts[fam.index]
        if kind == "auto":
            kind = "zigzag" if "zigzag" in wanted_layouts and fam.length >= 2 * world else "contiguous"
        chosen = {n: STRATEGIES[s].on_layout(kind).name for n, s in chosen.items()}  # ring <-> zigzag ring
        layouts[fam.index] = SequenceLayout.of(kind, fam.length, world)
        strategies.update(chosen)
    return layouts, strategies, reasons, heads_axis_size
