"""Ops that reorder or select along one dim and keep the others: ``topk``, ``sort``, ``argsort``,
``cummax`` / ``cummin`` (and ``max`` / ``min`` with indices, through the reduction rule).

Along any dim but the sequence they act on every position separately (a router's top-k over experts,
a per-token sort), so they run on shards and every output keeps the input's split. Along the split
sequence itself ``topk`` and the sorts need every position: the input is gathered (a fallback).

``max`` / ``min`` with indices and ``argmax`` / ``argmin`` along the split sequence (a CLIP text encoder
pools at ``(ids == eos).int().argmax(-1)``) are exact with one small collective
(:func:`arg_extreme`): every rank offers its shard's extreme and its global position, an all-gather of
those ``(value, int64 index)`` pairs -- the size of the output, never of the sequence -- and every rank
picks the same winner (``autoshard::seq_arg_extreme``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ...placements import Partial, Shard
from ...runtime import sequence_ops as _sequence_ops  # noqa: F401 -- defines autoshard::seq_arg_extreme
from ...runtime.attention.formulas import P
from ..comms import declares
from ..ops import is_tensor_node, numel, op_of, shape_of, value_of
from .registry import register
from .pointwise import TUPLE_LINKS

__all__ = ["arg_extreme"]


def arg_extreme(rw, src: fx.Node, have: Shard, keepdim: bool, largest: bool) -> fx.Node:
    """(values, global indices) of the max (``largest``) / min of ``src``, split as ``have``, along its split
    dim; replicated."""
    return rw.call(torch.ops.autoshard.seq_arg_extreme.default, rw.input(src, have), have.dim, keepdim, largest,
                   have.layout.encode(), rw.groups.sequence)


@declares(torch.ops.autoshard.seq_arg_extreme.default)
def _candidates(book, call) -> None:
    """The all-gather of every rank's candidates: a value and an int64 index per output element."""
    src, dim = op_of(call.value)["input"], call.arguments["dim"]
    shape = shape_of(src)
    row = numel(shape) // shape[dim] * (value_of(src).element_size() + 8)
    book.all_gather_rows(call.value.name, row, "forward", "extreme candidates", (P - 1) * row)


def _outputs(node) -> list:
    v = value_of(node)
    return list(v) if isinstance(v, (tuple, list)) else [v]


def _link_output(ctx, node, op, out_node):
    src = op["input"]
    dim = op["dim"] % len(shape_of(src))
    ctx.set_factorization(out_node, [list(f) if d != dim else [shape_of(out_node)[d]]
                                     for d, f in enumerate(ctx.factorization(src))])
    for d in range(len(shape_of(src))):
        if d != dim:
            ctx.link_dims(out_node, d, src, d)


def link_along_dim(ctx, node, op):
    if is_tensor_node(node):
        _link_output(ctx, node, op, node)


def rewrite_along_dim(rw, node, op):
    src = op["input"]
    dim = op["dim"] % len(shape_of(src))
    have = rw.out_shard(src) or rw.placement(src)
    if isinstance(have, Partial) or (getattr(have, "dim", None) == dim):
        rw.fallback(node, f"{getattr(node.target, '__name__', node.target)} along the split sequence"
                    if not isinstance(have, Partial) else "of a partial value")
        return
    x = rw.input(src, have)
    new = rw.reemit(node, (x,) + tuple(rw.value(a) for a in node.args[1:]), rw.value(node.kwargs))
    rw.done(node, new, have if is_tensor_node(node) else tuple(have for _ in _outputs(node)))


register("along_dim", link=link_along_dim, rewrite=rewrite_along_dim)
TUPLE_LINKS["along_dim"] = lambda ctx, producer, producer_op, index, node: _link_output(ctx, producer, producer_op, node)
