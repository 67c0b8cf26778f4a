"""Small helpers for editing dynamo graphs while keeping their example values."""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator

import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from .ops import value_of

__all__ = ["new_node", "fake_mode_of", "mutates", "has_side_effects", "eliminate_dead_code",
           "unused_with_side_effects"]

_IN_PLACE_OPERATORS = (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv)
_RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli",
           "multinomial", "normal", "poisson", "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
           "feature_alpha_dropout"}
"""Names of ops that draw from the generator: dropping an unused one would shift every later draw."""


@functools.lru_cache(maxsize=None)
def _signature(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _name(node: fx.Node) -> str:
    return node.target if node.op == "call_method" else getattr(node.target, "__name__", "")


def _inplace_flag(node: fx.Node) -> bool:
    """Whether a call passes ``inplace=True`` (by keyword or position: ``F.relu(x, True)``)."""
    if node.kwargs.get("inplace") is True:
        return True
    signature = _signature(node.target) if node.op == "call_function" and callable(node.target) else None
    if signature is None or "inplace" not in signature.parameters:
        return False
    try:
        return signature.bind(*node.args, **node.kwargs).arguments.get("inplace") is True
    except TypeError:
        return False


def mutates(node: fx.Node) -> bool:
    """True for ops that change their first argument in place (``x.add_(y)``, ``x[i] = y``, ``x /= y``,
    ``F.dropout(x, inplace=True)``)."""
    name = _name(node)
    return ((name.endswith("_") and not name.endswith("__")) or name in ("setitem", "__setitem__")
            or node.target in _IN_PLACE_OPERATORS or _inplace_flag(node))


def has_side_effects(node: fx.Node) -> bool:
    """Whether ``node`` must stay even when nothing uses its value: FX's impure ops, in-place ops (FX counts
    every ``call_method`` as pure, ``x.mul_(3)`` included) and random draws."""
    return node.is_impure() or (node.op in ("call_function", "call_method") and (mutates(node) or _name(node) in _RANDOM))


def eliminate_dead_code(graph: fx.Graph, keep: set[fx.Node] | None = None) -> None:
    """Remove the nodes nothing uses, keeping those with side effects (:func:`has_side_effects`), or, given
    ``keep``, FX's impure nodes and ``keep`` (a pass that replaces a pattern passes the side-effect nodes that
    were unused before it: a dropout it folded into the replacement goes, a user's ``x.mul_(3)`` stays)."""
    graph.eliminate_dead_code(is_impure_node=has_side_effects if keep is None else
                              lambda node: node.is_impure() or node in keep)


def unused_with_side_effects(graph: fx.Graph) -> set[fx.Node]:
    """The nodes nothing uses that :func:`eliminate_dead_code` must keep."""
    return {node for node in graph.nodes if not node.users and has_side_effects(node)}


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
