"""Small helpers for editing dynamo graphs while keeping their example values."""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx

from .ops import value_of

__all__ = ["new_node"]


def new_node(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None, op: str = "call_function") -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insertion point, with ``meta["example_value"]``
    computed from the inputs' example values (under their fake mode, so nothing real is allocated)."""
    kwargs = dict(kwargs or {})
    node = graph.create_node(op, target, tuple(args), kwargs)
    vals, kvals = fx.node.map_arg(tuple(args), value_of), fx.node.map_arg(kwargs, value_of)
    tensors = [v for v in torch.utils._pytree.tree_leaves((vals, kvals)) if isinstance(v, torch.Tensor)]
    mode = torch._guards.detect_fake_mode(tensors)
    with mode if mode is not None else contextlib.nullcontext():
        fn = getattr(vals[0], target) if op == "call_method" else target
        node.meta["example_value"] = fn(*vals[1:], **kvals) if op == "call_method" else fn(*vals, **kvals)
    return node
