"""Tensors made from nothing: ``arange`` and friends.

A factory has no inputs to follow; its output joins a sequence family when a consumer links it (RoPE
positions multiplied into the split queries, an ``arange`` of token positions). Split factories are
built directly at their local size, so no rank ever materializes the whole sequence:

* ``arange(start, end, step)`` gives ``start + step * p`` for the global positions ``p`` this rank holds;
* ``zeros`` / ``ones`` / ``full`` / ``empty`` and their ``new_*`` / ``*_like`` forms use the local shape;
* ``rand`` / ``randn`` / ``rand_like`` / ``randn_like`` give this rank's part of the one-process draw (``autoshard::sequence_draw``, see
  :mod:`autoshard.runtime.random`): the same numbers the tokens get on one process.
"""

from __future__ import annotations

import torch

from ...runtime import random as _random  # noqa: F401 -- defines autoshard::sequence_draw
from ...runtime.sequence_ops import local_arange
from ..ops import is_tensor_node, shape_of, value_of
from .registry import register
from .pointwise import link_identity, when_output_split, whole_args

__all__: list[str] = []  # the rules register themselves on import

_FILLS = {"zeros": 0, "ones": 1, "new_zeros": 0, "new_ones": 1, "zeros_like": 0, "ones_like": 1}
_RANDOM_KINDS = {"rand": "rand", "randn": "randn", "rand_like": "rand", "randn_like": "randn"}
"""Random factories -> the ``sequence_draw`` kind that gives this rank its part of their one-process draw."""


def _name(node) -> str:
    return node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))


def link_factory(ctx, node, op):
    if _name(node).endswith("_like") and is_tensor_node(node.args[0]) and shape_of(node.args[0]) == shape_of(node):
        link_identity(ctx, node, node.args[0])


@when_output_split
def rewrite_factory(rw, node, op, out):
    name = _name(node)
    val = value_of(node)
    local = rw.local_shape(node, out)
    start, step = rw.value(op.get("start")), rw.value(op.get("step"))  # arange's bounds (ops.py binds them)
    if name == "arange" and node in rw.families.token_local:  # per-position code: it enumerates the local tokens
        new = rw.call(torch.arange, start, start + step * local[0], step, dtype=val.dtype, device=val.device)
    elif name == "arange" and not out.factors:
        new = rw.call(local_arange, start, step, out.layout.encode(), rw.rank, val.dtype, val.device)
    elif name in _RANDOM_KINDS:
        new = rw.call(torch.ops.autoshard.sequence_draw.default, _RANDOM_KINDS[name], 0.0, list(val.shape), out.dim,
                      list(out.factors), out.factor, out.layout.encode(), rw.rank, node.name, val.dtype, val.device)
    elif name.endswith("_like") and name != "randint_like":  # randint_like is drawn whole, below
        template = rw.input(node.args[0], out)
        new = rw.reemit(node, (template,) + tuple(rw.value(a) for a in node.args[1:]), rw.value(node.kwargs))
    elif name in _FILLS or name in ("full", "new_full", "empty", "new_empty"):
        fill = _FILLS.get(name)
        if fill is None and "full" in name:
            fill = node.args[-1] if "fill_value" not in node.kwargs else node.kwargs["fill_value"]
        if fill is None:
            new = rw.call(torch.empty, local, dtype=val.dtype, device=val.device)
        else:
            new = rw.call(torch.full, local, fill, dtype=val.dtype, device=val.device)
    else:
        made = rw.reemit(node, *whole_args(rw, node, f"{name} is made whole, as on one process", expected=True))
        new = rw.shard_value(node, made, out)
    rw.done(node, new, out)


register("factory", link=link_factory, rewrite=rewrite_factory)
