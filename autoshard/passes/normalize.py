"""Normalize: give every node its canonical op (``canonicalize``), and decompose the few composites rules need
no table for (``decompose``; it runs after attention capture, which reads masks in their original form).

``torch.diff(x, prepend=p)`` along a dim becomes ``X = cat(p, x); X[1:] - X[:-1]``: slices and a
subtraction, whose rules already know how to shift positions across ranks (the two slices are offset
by one, so the subtraction re-aligns one of them with a one-position halo exchange).

``torch.outer(a, b)`` becomes ``a[:, None] * b[None, :]``: an elementwise product, so RoPE's angles
``outer(arange(S), inv_freq)`` are built for the local positions only.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph import new_node
from .ops import OP_KEY, canonical, op_of, shape_of

__all__ = ["canonicalize", "decompose"]


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
    return _replace(graph, node, out)


def _replace(graph: fx.Graph, node: fx.Node, out: fx.Node) -> fx.Node:
    """``node`` replaced by ``out``; its users' canonical ops are bound again (they named ``node``)."""
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    for user in out.users:
        user.meta[OP_KEY] = canonical(user)
    return out


def _decompose_outer(graph: fx.Graph, node: fx.Node, op) -> fx.Node:
    with graph.inserting_before(node):
        column = new_node(graph, operator.getitem, (op["a"], (slice(None), None)))
        row = new_node(graph, operator.getitem, (op["b"], (None, slice(None))))
        out = new_node(graph, operator.mul, (column, row))
    return _replace(graph, node, out)


def canonicalize(gm: fx.GraphModule) -> None:
    """Record ``node.meta[OP_KEY]``, the canonical op, for every node."""
    for node in gm.graph.nodes:
        node.meta[OP_KEY] = canonical(node)


def decompose(gm: fx.GraphModule) -> None:
    """Rewrite composites into ops with rules (``diff``, ``outer``); new nodes get their canonical op on first
    use."""
    graph = gm.graph
    for node in list(graph.nodes):
        op = op_of(node)
        if op is not None and op.name == "diff" and isinstance(op["n"], int):
            _decompose_diff(graph, node, op)
        elif op is not None and op.name == "outer":
            _decompose_outer(graph, node, op)
