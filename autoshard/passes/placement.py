"""What a compiled rank graph allows of a data placement (:mod:`autoshard.runtime.placement`).

A call may run a graph under a placement -- the packed documents placed by their lengths, its layouts swapped for
placed ones of the same local lengths -- only where every ``autoshard`` op of the graph reads its layout as
intervals, whatever they are (:func:`reads_any_layout`). The graph that places them prices a placement with the
documents' attention (:func:`documents_of`: its layout's kind, mask and the elements a position moves), its own or
that of a later graph.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch.fx as fx

from ..runtime.attention.api import OpConfig
from ..runtime.attention.masks import MaskSpec
from ..runtime.head_groups import grouped_attention
from ..runtime.layouts import LAYOUTS
from ..runtime.placement import PLACEABLE_OPS, Documents
from .ops import value_of
from .pipeline import CompiledGraph

__all__ = ["reads_any_layout", "documents_of"]


def reads_any_layout(gm: fx.GraphModule) -> bool:
    """Whether every ``autoshard`` op of a rank graph and of the graphs it calls (checkpointed regions, tiles)
    reads its layout as intervals, whatever they are (:data:`~autoshard.runtime.placement.PLACEABLE_OPS`, attention
    only by all-gather, in head groups or not): the graph may run under a placement."""
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is grouped_attention:  # an attention with its projections: its op's arguments
                attention_args = inspect.signature(grouped_attention).bind(*node.args).arguments["attention_args"]
                if _config(attention_args).strategy != "allgather":
                    return False
                continue
            if getattr(node.target, "namespace", None) != "autoshard":
                continue
            if node.target._opname not in PLACEABLE_OPS:
                return False
            if node.target._opname == "attention" and _config(node.args).strategy != "allgather":
                return False
    return True


def _config(args) -> OpConfig:
    """The arguments after the tensors of an ``autoshard::attention`` call (its arguments, or the attention
    arguments a head-grouped call holds)."""
    return OpConfig(*args[-len(dataclasses.fields(OpConfig)):])


def documents_of(compiled: CompiledGraph, world_size: int) -> Documents | None:
    """The packed documents of a compiled graph (:class:`~autoshard.runtime.placement.Documents`): its attentions
    that read segment ids, of one layout kind, mask and shape; None where there are none, or several."""
    found = {(a["layout"], MaskSpec.of(a["causal"], a["window"], a["chunk"])) for a in compiled.report.attention
             if a.get("segment_ids") and a["strategy"] == "allgather"}
    shapes = {tuple(tuple(value_of(t).shape[1::2]) for t in node.args[:3]) for node in compiled.strategies}
    if len(found) != 1 or len(shapes) != 1 or world_size < 2:
        return None
    (kind, spec), ((heads, head_dim), (kv_heads, _), (_, value_dim)) = found.pop(), shapes.pop()
    if kind not in LAYOUTS:
        return None
    return Documents(kind, world_size, spec, key_row=kv_heads * (head_dim + value_dim), query_row=heads * head_dim,
                     result_row=heads * (value_dim + 1))
