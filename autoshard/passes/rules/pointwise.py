"""Elementwise ops, casts, identity-like ops, dropout, and picking outputs of multi-output ops.

Elementwise ops broadcast their inputs (aligned from the right): an input dim of the output's size is
the same positions as the output dim; a size-1 or missing dim is broadcast. So on shards:

* output split on dim d: every input that has d (not broadcast) is taken split the same way (a
  replicated one is sliced for free), broadcast inputs are taken whole;
* partial inputs stay partial through linear ops (``a + b`` of two partial sums, ``p * r``, ``p / r``,
  ``-p``, casts); any other op first reduces them.

Dropout on a split value multiplies this rank's part of the one-process dropout factor, which every
rank draws whole (``runtime/random.py``); alpha dropout, whose noise is not a factor, runs on the
gathered value.
"""

from __future__ import annotations

import functools
import operator
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...placements import REPLICATE, Partial, Replicate, Shard
from ...runtime import random as _random  # noqa: F401 -- defines autoshard::sequence_draw
from ..ops import is_tensor_node, op_of, shape_of, value_of
from .registry import register

__all__ = ["OUTPUT_WHOLE", "TUPLE_LINKS", "link_broadcast", "link_identity", "link_nothing", "link_same",
           "mapped_args", "rewrite_same", "run_whole", "when_output_split", "want_broadcast", "whole_args"]

_LINEAR_IN_EVERY_INPUT = {"add", "sub"}
_LINEAR_IN_ONE_INPUT = {"mul"}
_LINEAR_IN_FIRST_INPUT = {"div", "true_divide", "neg", "positive"}

OUTPUT_WHOLE = "output not split"
"""Why a rule gathers a split input of a node whose output inference left whole (a link refused, a position the
output does not keep): the rules mark it an expected gather."""


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if is_tensor_node(n)]


def _aligned_dim(out_ndim: int, inp: fx.Node, out_dim: int, out_size: int) -> int | None:
    """The dim of ``inp`` that broadcasts into output dim ``out_dim``, if it is not a broadcast dim."""
    shape = shape_of(inp)
    d = out_dim - (out_ndim - len(shape))
    if d < 0 or shape[d] != out_size:
        return None
    return d


def link_broadcast(ctx, node: fx.Node, inputs: list[fx.Node], set_factors: bool = True) -> None:
    """Link every non-broadcast input dim to its output dim; the output takes the first input's factors
    (unless ``set_factors`` is False: the output's factors were set by the op's own rule)."""
    out_shape = shape_of(node)
    factors = []
    for d, size in enumerate(out_shape):
        chosen = [size]
        for inp in inputs:
            d_in = _aligned_dim(len(out_shape), inp, d, size)
            if d_in is not None:
                chosen = list(ctx.factorization(inp)[d_in])
                break
        factors.append(chosen)
    if set_factors:
        ctx.set_factorization(node, factors)
    for inp in inputs:
        for d, size in enumerate(out_shape):
            d_in = _aligned_dim(len(out_shape), inp, d, size)
            if d_in is not None:
                ctx.link_dims(node, d, inp, d_in)


def want_broadcast(rw, node: fx.Node, inp: fx.Node, out: Shard):
    """(placement, partial_grad) in which ``inp`` must arrive when ``node``'s output is ``out``."""
    d_in = _aligned_dim(len(shape_of(node)), inp, out.dim, shape_of(node)[out.dim])
    if d_in is None:
        return REPLICATE, True
    return out.moved(d_in), False


def rewrite_broadcast(rw, node: fx.Node, out: Shard | None) -> fx.Node:
    """Re-emit ``node`` with its tensor inputs in the placements an elementwise op needs for ``out``."""
    if out is None:
        return rw.reemit(node, *whole_args(rw, node, OUTPUT_WHOLE, expected=True))

    def convert(n):
        want, partial_grad = want_broadcast(rw, node, n, out)
        return rw.input(n, want, partial_grad=partial_grad)

    return rw.reemit(node, *mapped_args(node, convert))


def mapped_args(node: fx.Node, fn):
    """``node``'s args and kwargs with every node replaced by ``fn(node)``."""
    return fx.node.map_arg(node.args, fn), fx.node.map_arg(node.kwargs, fn)


def whole_args(rw, node: fx.Node, reason: str = "", expected: bool = False):
    """``node``'s args and kwargs with every tensor taken whole: a partial one reduced, a split one gathered. A
    gather needs a ``reason``; it is a fallback in the report, or with ``expected`` a planned transition."""
    def whole(n):
        if not reason and is_tensor_node(n) and isinstance(rw.placement(n), Shard):
            raise ValueError(f"the rule gathers the split {n.name} without a reason")
        return rw.input(n, REPLICATE, expected=expected, reason=reason)

    return mapped_args(node, whole)


def run_whole(rw, node: fx.Node, reason: str, expected: bool = False) -> None:
    """``node`` on whole inputs (:func:`whole_args`), replicated."""
    rw.done(node, rw.reemit(node, *whole_args(rw, node, reason, expected)), REPLICATE)


def when_output_split(rewrite: Callable) -> Callable:
    """The rewrite rule calling ``rewrite(rw, node, op, out)`` when ``node``'s output is split (as ``out``), and
    running ``node`` whole when inference left its output whole."""
    @functools.wraps(rewrite)
    def rule(rw, node: fx.Node, op) -> None:
        out = rw.out_shard(node)
        if out is None:
            run_whole(rw, node, OUTPUT_WHOLE, expected=True)
        else:
            rewrite(rw, node, op, out)
    return rule


def _partial_result(rw, node: fx.Node, fn: str) -> Partial | None:
    """The partial placement of ``node`` when it is linear in its partial inputs, else None."""
    inputs = _tensor_inputs(node)
    partial = [n for n in inputs if isinstance(rw.placement(n), Partial)]
    if not partial or any(rw.placement(n).op != "sum" for n in partial):
        return None
    scalars_or_tensors = [a for a in node.args if a is not None]
    if fn in _LINEAR_IN_EVERY_INPUT:
        return Partial() if len(partial) == len(scalars_or_tensors) else None
    if fn in _LINEAR_IN_ONE_INPUT:
        others = [n for n in inputs if n not in partial]
        return Partial() if len(partial) == 1 and all(isinstance(rw.placement(n), Replicate) for n in others) else None
    if fn in _LINEAR_IN_FIRST_INPUT:
        first = node.args[0]
        rest = [n for n in inputs if n is not first]
        return Partial() if partial == [first] and all(isinstance(rw.placement(n), Replicate) for n in rest) else None
    return None


# ----------------------------------------------------------------------------- pointwise


def link_pointwise(ctx, node, op):
    link_broadcast(ctx, node, _tensor_inputs(node))


def rewrite_pointwise(rw, node, op):
    out = rw.out_shard(node)
    if out is None:
        partial = _partial_result(rw, node, op["fn"])
        if partial is not None:
            rw.done(node, rw.reemit(node), partial)
            return
    rw.done(node, rewrite_broadcast(rw, node, out), out or REPLICATE)


register("pointwise", link=link_pointwise, rewrite=rewrite_pointwise)


# ----------------------------------------------------------------------------- same shape, same positions


def link_same(ctx, node, op):
    link_identity(ctx, node, op["input"])


def link_identity(ctx, node: fx.Node, src) -> None:
    """``node`` holds ``src``'s positions, dim for dim."""
    if not is_tensor_node(src) or not is_tensor_node(node):
        return
    ctx.set_factorization(node, [list(f) for f in ctx.factorization(src)])
    for d in range(len(shape_of(node))):
        ctx.link_dims(node, d, src, d)


def rewrite_same(rw, node, op):
    """The value keeps its input's placement (split, whole or partial); other tensor args (``type_as``'s
    template) are only read for their dtype and go in as they are."""
    src = op["input"]
    out = rw.out_shard(node)
    if out is not None:
        new_src, placement = rw.input(src, out), out
    elif isinstance(rw.placement(src), Partial):
        new_src, placement = rw.env[src], rw.placement(src)
    else:
        new_src, placement = rw.input(src, REPLICATE), REPLICATE
    args = (new_src,) + tuple(rw.value(a) for a in node.args[1:])
    rw.done(node, rw.reemit(node, args, rw.value(node.kwargs)), placement)


register("identity", "to", link=link_same, rewrite=rewrite_same)


_DROPOUT_DRAWS = {F.dropout: "dropout", torch.dropout: "dropout", F.dropout1d: "dropout1d", F.dropout2d: "dropout2d"}
"""Dropout functions whose output is the input times a random factor -> their draw in ``runtime/random.py``."""


@when_output_split
def rewrite_dropout(rw, node, op, out):
    if not op["training"] or op["p"] == 0.0:  # the identity, drawing nothing
        rw.done(node, rw.input(op["input"], out), out)
        return
    kind = _DROPOUT_DRAWS.get(node.target)
    if kind is None:
        whole = rw.reemit(node, *whole_args(rw, node, f"{node.target.__name__} is drawn on the whole value"))
        rw.done(node, rw.shard_value(node, whole, out), out)
        return
    if op["inplace"]:
        _rewrite_dropout_in_place(rw, node, op, kind, out)
        return
    rw.done(node, rw.call(operator.mul, rw.input(op["input"], out), _draw(rw, node, op, kind, out)), out)


def _draw(rw, node, op, kind: str, out):
    """This rank's part of the one-process dropout factor of ``node`` (split as ``out``)."""
    val = value_of(node)
    return rw.call(torch.ops.autoshard.sequence_draw.default, kind, float(op["p"]), list(val.shape), out.dim,
                   list(out.factors), out.factor, out.layout.encode(), rw.rank, node.name, val.dtype, val.device)


def _rewrite_dropout_in_place(rw, node, op, kind: str, out):
    """``dropout(x, inplace=True)``: later uses of ``x`` see the dropped value, as on one process. A split ``x``
    is multiplied in place by its part of the factor; a whole ``x`` (an input passed whole) is dropped whole,
    in place (every rank draws the one-process mask), and this rank keeps its part of the result."""
    source = op["input"]
    have = rw.placement(source)
    if have == out:
        result = rw.call(torch.Tensor.mul_, rw.input(source, out), _draw(rw, node, op, kind, out))
    elif isinstance(have, Replicate):
        result = rw.shard_value(node, rw.reemit(node, *whole_args(rw, node)), out)
    else:
        raise RuntimeError(f"autoshard: {node.format_node()} drops {source.name} in place, but {source.name} is split "
                           f"as {have}, not as its result ({out}); write it out of place (inplace=False)")
    rw.changed_in_place(source)
    rw.done(node, result, out)


register("dropout", link=link_same, rewrite=rewrite_dropout)


# ----------------------------------------------------------------------------- nodes without tensors


def link_nothing(ctx, node, op):
    """The link rule of a node whose output shares no positions with its inputs (or has no tensor inputs)."""
    return None


def rewrite_noop(rw, node, op):
    rw.done(node, rw.reemit(node), REPLICATE)


register("noop", link=link_nothing, rewrite=rewrite_noop)


# ----------------------------------------------------------------------------- picking from tuple outputs

TUPLE_LINKS: dict[str, callable] = {}
"""Producer op name -> ``link(ctx, producer, producer_op, index, node)`` for its ``index``-th output."""


def link_tuple_get(ctx, node, op):
    producer = op["input"]
    producer_op = op_of(producer)
    if producer_op is not None and producer_op.name in TUPLE_LINKS and isinstance(op["index"], int):
        TUPLE_LINKS[producer_op.name](ctx, producer, producer_op, op["index"], node)


def rewrite_tuple_get(rw, node, op):
    producer = op["input"]
    placements = rw.placement(producer)
    index = op["index"]
    placement = placements[index] if isinstance(placements, tuple) else REPLICATE
    rw.done(node, rw.call(node.target, rw.env[producer], index), placement)


register("tuple_get", link=link_tuple_get, rewrite=rewrite_tuple_get, always=True)  # emits an unnamed getitem
