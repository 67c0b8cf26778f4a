"""Small helpers for editing dynamo graphs while keeping their example values.

Dead code: a pass removes only what it made dead (the nodes of a pattern it replaced) or what is
*provably pure* (:func:`is_pure`: an op of the canonical vocabulary that neither mutates nor draws, a
size query, arithmetic on sizes). Anything else -- an op the vocabulary does not know, such as the
``_vmap_increment_nesting`` / ``_vmap_decrement_nesting`` pair dynamo emits around an inlined
``torch.vmap`` -- may act through state its value does not show, so it stays even when nothing uses it.

Module state: dynamo lifts parameters, buffers and other tensor attributes of modules into placeholders
it marks as unguarded static inputs, and drops their real values (``meta["grapharg"]``) once the backend
returns. :func:`keep_real_values` keeps a weak reference to them for graphs compiled later (one per
length of a dynamic graph, dry-run plans); :func:`real_value` reads either.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import operator
from typing import Callable, Iterable, Iterator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import TensorWeakRef

from .ops import canonical, is_tensor_node, value_of

__all__ = ["new_node", "user_line", "where", "reachable", "fake_mode_of", "mutates", "storage_of", "has_side_effects",
           "is_pure", "eliminate_dead_code", "unused_impure", "is_module_state", "keep_real_values", "real_value",
           "REAL_VALUE"]

REAL_VALUE = "autoshard_real_value"
"""``node.meta`` key: a weak reference to the real value of a module-state placeholder (:func:`keep_real_values`)."""

_IN_PLACE_OPERATORS = (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.iand,
                       operator.ior, operator.ixor)
_RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm", "bernoulli",
           "multinomial", "normal", "poisson", "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
           "feature_alpha_dropout"}
"""Names of ops that draw from the generator: dropping an unused one would shift every later draw."""
_SIZE_QUERIES = {"size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "get_device"}
"""Tensor methods that only read metadata."""
_PURE_FUNCTIONS = {builtins.getattr, builtins.len, torch.Size, torch.sym_int, torch.sym_float, torch.sym_max,
                   torch.sym_min, torch.sym_not, torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default,
                   torch.ops.aten.sym_stride.int, torch.ops.aten.sym_storage_offset.default}
"""Functions of sizes and metadata (what dynamic-shape graphs compute their sizes with)."""


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
    if node.op == "call_function" and node.target in vars(operator).values():  # operator.and_ is not in place
        return node.target in _IN_PLACE_OPERATORS
    name = _name(node)
    return ((name.endswith("_") and not name.endswith("__")) or name in ("setitem", "__setitem__")
            or _inplace_flag(node))


def storage_of(node: fx.Node) -> StorageWeakRef | None:
    """The storage of ``node``'s example value (views of one value share it), or None: not a tensor, or one
    without storage (vmap's batched tensors)."""
    if not is_tensor_node(node):
        return None
    try:
        return StorageWeakRef(value_of(node).untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


def has_side_effects(node: fx.Node) -> bool:
    """Whether ``node`` must stay even when nothing uses its value: FX's impure ops, in-place ops (FX counts
    every ``call_method`` as pure, ``x.mul_(3)`` included) and random draws."""
    return node.is_impure() or (node.op in ("call_function", "call_method") and (mutates(node) or _name(node) in _RANDOM))


def is_pure(node: fx.Node) -> bool:
    """Whether an unused ``node`` can go without changing anything: a call of the canonical vocabulary
    (:mod:`.ops`) that neither mutates nor draws, or a size / metadata query (see the module docstring)."""
    if node.op not in ("call_function", "call_method") or has_side_effects(node):
        return False
    if node.op == "call_method" and node.target in _SIZE_QUERIES:
        return True
    if node.op == "call_function" and (node.target in _PURE_FUNCTIONS
                                       or getattr(node.target, "__module__", None) == "math"):
        return True
    op = canonical(node)
    return op is not None and op.name != "noop"


def eliminate_dead_code(graph: fx.Graph, keep: set[fx.Node] | None = None) -> None:
    """Remove the nodes nothing uses that are pure (:func:`is_pure`); given ``keep``, every unused node but
    FX's impure nodes and ``keep`` (a pass that replaces a pattern passes :func:`unused_impure` from before
    it: a dropout it folded into the replacement goes, a user's ``x.mul_(3)`` or a vmap level stays)."""
    graph.eliminate_dead_code(is_impure_node=(lambda node: not is_pure(node)) if keep is None else
                              lambda node: node.is_impure() or node in keep)


def unused_impure(graph: fx.Graph) -> set[fx.Node]:
    """The nodes nothing uses that are not pure: what a pass's :func:`eliminate_dead_code` must keep."""
    return {node for node in graph.nodes if not node.users and not is_pure(node)}


def is_module_state(node: fx.Node) -> bool:
    """Whether the placeholder ``node`` is a module's parameter, buffer or tensor attribute (dynamo's unguarded
    static input)."""
    static = node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
    return node.op == "placeholder" and static == "unguarded"


def keep_real_values(gm: fx.GraphModule, inputs: list) -> None:
    """Keep a weak reference to the real value of every module-state placeholder of ``gm``, ``inputs`` being
    the graph's inputs in placeholder order (see the module docstring)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, inputs):
        if is_module_state(node) and isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            node.meta[REAL_VALUE] = TensorWeakRef(value)


def real_value(node: fx.Node) -> torch.Tensor | None:
    """The real value of a module-state placeholder: dynamo's while the backend runs, else the one
    :func:`keep_real_values` kept; None when neither is known (or it was freed)."""
    if not is_module_state(node):
        return None
    arg = node.meta.get("grapharg")
    if arg is not None:
        return arg.example
    ref = node.meta.get(REAL_VALUE)
    return ref() if ref is not None else None


def fake_mode_of(graph: fx.Graph):
    """The fake mode of the graph's example values (dynamo's), or None for graphs without them."""
    for node in graph.nodes:
        v = value_of(node)
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return None


def new_node(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None, op: str = "call_function", *,
             example_value=None) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insertion point, with ``meta["example_value"]``
    computed from the inputs' example values (under their fake mode, so nothing real is allocated), or
    ``example_value`` when given: the value of a node the new one replaces, which dynamo recorded under the
    autocast state of its place in the graph (an autocast region inside the graph is not in effect here)."""
    kwargs = dict(kwargs or {})
    node = graph.create_node(op, target, tuple(args), kwargs)
    if example_value is not None:
        node.meta["example_value"] = example_value
        return node
    vals, kvals = fx.node.map_arg(tuple(args), value_of), fx.node.map_arg(kwargs, value_of)
    mode = fake_mode_of(graph)
    with mode if mode is not None else contextlib.nullcontext():
        fn = getattr(vals[0], target) if op == "call_method" else target
        node.meta["example_value"] = fn(*vals[1:], **kvals) if op == "call_method" else fn(*vals, **kvals)
    return node


def reachable(start: fx.Node, step: Callable[[fx.Node], Iterable[fx.Node]]) -> Iterator[fx.Node]:
    """Every node reachable from ``start`` (itself included) through ``step`` (``lambda n: n.all_input_nodes``:
    what it is computed from; ``lambda n: n.users``: what reads it), each once, depth first. A caller that stops
    early walks no further."""
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(step(node))


def user_line(node: fx.Node) -> str:
    """The user's source line that made ``node`` (the last of its stack trace, with where it is), or "unknown"."""
    lines = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()
             if line.strip().strip("^~")]  # not the carets under the expression
    code = [i for i, line in enumerate(lines) if not line.startswith("File ")]
    if not code:
        return "unknown"
    where = f"  ({lines[code[-1] - 1]})" if code[-1] and lines[code[-1] - 1].startswith("File ") else ""
    return lines[code[-1]] + where


def where(node: fx.Node) -> str:
    """Where ``node`` comes from, for a message: the module that made it (the innermost of dynamo's module stack, as
    ``model.layers[0].self_attn``) and the user's source line (:func:`user_line`)."""
    stack = node.meta.get("nn_module_stack") or {}
    module = next(reversed(stack.values()))[0] if stack else ""
    module = module.removeprefix("L['self'].").removeprefix("L['self']")
    return (f"module {module}, " if module else "") + user_line(node)
