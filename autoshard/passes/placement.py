"""What a compiled rank graph allows of a data placement (:mod:`autoshard.runtime.placement`).

A call may run a graph under a placement -- the packed documents placed by their lengths, its layouts swapped for
placed ones of the same local lengths -- only where every ``autoshard`` op of the graph reads its layout as
intervals, whatever they are (:func:`reads_any_layout`). The graph that places them prices a placement with the
documents' attention (:func:`documents_of`: its layout's kind, mask and the elements a position moves), its own or
that of a later graph.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from ..runtime.attention.api import OpConfig
from ..runtime.attention.masks import MaskSpec
from ..runtime.layouts import LAYOUTS
from ..runtime.placement import PLACEABLE_OPS, Documents
from .ops import value_of
from .pipeline import CompiledGraph

__all__ = ["reads_any_layout", "documents_of"]


def reads_any_layout(gm: fx.GraphModule) -> bool:
    """Whether every ``autoshard`` op of a rank graph reads its layout as intervals, whatever they are
    (:data:`~autoshard.runtime.placement.PLACEABLE_OPS`, attention only by all-gather): the graph may run under a
    placement."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", None) != "autoshard":
            continue
        if node.target._opname not in PLACEABLE_OPS:
            return False
        if node.target._opname == "attention" and _config(node).strategy != "allgather":
            return False
    return True


def _config(node: fx.Node) -> OpConfig:
    """The arguments after the tensors of an ``autoshard::attention`` node."""
    return OpConfig(*node.args[-len(dataclasses.fields(OpConfig)):])


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
