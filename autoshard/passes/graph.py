"""Small helpers for editing dynamo graphs while keeping their example values."""

from __future__ import annotations

import contextlib

import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from .ops import value_of

__all__ = ["new_node", "fake_mode_of"]


def fake_mode_of(graph: fx.Graph):
    """The fake mode of the graph's example values (dynamo's), or None for graphs without them."""
    for node in graph.nodes:
        v = value_of(node)
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return None


def new_node(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None, op: str = "call_function") -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insertion point, with ``meta["example_value"]``
    computed from the inputs' example values (under their fake mode, so nothing real is allocated)."""
    kwargs = dict(kwargs or {})
    node = graph.create_node(op, target, tuple(args), kwargs)
    vals, kvals = fx.node.map_arg(tuple(args), value_of), fx.node.map_arg(kwargs, value_of)
    mode = fake_mode_of(graph)
    with mode if mode is not None else contextlib.nullcontext():
        fn = getattr(vals[0], target) if op == "call_method" else target
        node.meta["example_value"] = fn(*vals[1:], **kvals) if op == "call_method" else fn(*vals, **kvals)
    return node
