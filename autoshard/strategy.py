"""Choosing a distributed-attention strategy per attention and a layout per sequence family.

This is the first cost rule; the planner's cost model (``autoshard.plan``) refines it:

* an explicit ``strategy`` / ``layout`` option wins (checked for feasibility);
* otherwise Ulysses when the heads split evenly over the ranks (its all-to-alls move 4/P of the
  activations, independent of the ring's P-1 steps), else the zigzag ring for causal attention
  (balanced work) and the plain ring for the rest;
* a family's layout is zigzag when one of its attentions uses the zigzag ring and the sequence has at
  least 2P positions, contiguous otherwise (the ring over a zigzag layout *is* the zigzag strategy).
"""

from __future__ import annotations

from .config import BackendConfig
from .passes.infer import Families
from .passes.ops import op_of, shape_of
from .runtime.layouts import SequenceLayout

__all__ = ["choose"]


def _auto_strategy(heads: int, kv_heads: int, causal: bool, world: int) -> str:
    if heads % world == 0 and (kv_heads % world == 0 or world % kv_heads == 0):
        return "ulysses"
    return "zigzag" if causal else "ring"


def choose(families: Families, *, config: BackendConfig, world: int,
           heads_axis_size: int | None = None) -> tuple[dict[int, SequenceLayout], dict]:
    """(root layout per family index, strategy per attention node)."""
    layouts, strategies = {}, {}
    for fam in families.families:
        chosen = {}
        for node in fam.attention_nodes:
            op = op_of(node)
            heads, kv_heads = shape_of(op["q"])[1], shape_of(op["k"])[1]
            causal = bool(op.get("causal"))
            if config.strategy != "auto":
                chosen[node] = config.strategy
            else:
                chosen[node] = _auto_strategy(heads, kv_heads, causal, heads_axis_size or world)
        kind = config.layout
        if kind == "auto":
            wants_zigzag = any(s == "zigzag" for s in chosen.values())
            kind = "zigzag" if wants_zigzag and fam.length >= 2 * world else "contiguous"
        if kind == "contiguous":
            chosen = {n: ("ring" if s == "zigzag" else s) for n, s in chosen.items()}
        else:
            chosen = {n: ("zigzag" if s == "ring" else s) for n, s in chosen.items()}
        layouts[fam.index] = SequenceLayout.of(kind, fam.length, world)
        strategies.update(chosen)
    return layouts, strategies
