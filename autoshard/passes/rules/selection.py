"""Ops that reorder or select along one dim and keep the others: ``topk``, ``sort``, ``argsort``,
``cummax`` / ``cummin`` (and ``max`` / ``min`` with indices, through the reduction rule).

Along any dim but the sequence they act on every position separately (a router's top-k over experts,
a per-token sort), so they run on shards and every output keeps the input's split. Along the split
sequence itself they need every position: the input is gathered (a fallback).
"""

from __future__ import annotations

from ...placements import Partial
from ..ops import is_tensor_node, shape_of, value_of
from . import register
from .pointwise import TUPLE_LINKS

__all__: list[str] = []  # the rules register themselves on import; nothing here is called from outside


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


def link_reduce_with_indices(ctx, producer, producer_op, index, node):
    """``max(x, dim)`` / ``min(x, dim)``: values and indices keep the other dims."""
    from .reductions import link_reduce

    link_reduce(ctx, node, producer_op)


TUPLE_LINKS["reduce"] = link_reduce_with_indices
