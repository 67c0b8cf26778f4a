"""Normalize: give every node its canonical op (``annotate``), and decompose the few composites rules need
no table for (``decompose``; it runs after attention capture, which reads masks in their original form).

``torch.diff(x, prepend=p)`` along a dim becomes ``X = cat(p, x); X[1:] - X[:-1]``: slices and a
subtraction, whose rules already know how to shift positions across ranks (the two slices are offset
by one, so the subtraction re-aligns one of them with a one-position halo exchange).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph import new_node
from .ops import OP_KEY, canonical, op_of, shape_of

__all__ = ["annotate", "decompose"]


def _slice_along(graph: fx.Graph, x: fx.Node, dim: int, start, stop) -> fx.Node:
    index = (slice(None),) * dim + (slice(start, stop),)
    return new_node(graph, operator.getitem, (x, index))


def _decompose_diff(graph: fx.Graph, node: fx.Node, op) -> fx.Node:
    x = op["input"]
    dim = op["dim"] % len(shape_of(x))
    with graph.inserting_before(node):
        parts = [p for p in (op["prepend"], x, op["append"]) if p is not None]
        out = new_node(graph, torch.cat, (parts, dim)) if len(parts) > 1 else x
        for _ in range(op["n"]):
            out = new_node(graph, operator.sub, (_slice_along(graph, out, dim, 1, None),
                                                  _slice_along(graph, out, dim, None, -1)))
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return out


def annotate(gm: fx.GraphModule) -> None:
    """Record ``node.meta[OP_KEY]``, the canonical op, for every node."""
    for node in gm.graph.nodes:
        node.meta[OP_KEY] = canonical(node)


def decompose(gm: fx.GraphModule) -> None:
    """Rewrite composites into ops with rules (``diff``); new nodes get their canonical op on first use."""
    graph = gm.graph
    for node in list(graph.nodes):
        op = op_of(node)
        if op is not None and op.name == "diff" and isinstance(op["n"], int):
            _decompose_diff(graph, node, op)
