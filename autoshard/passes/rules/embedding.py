"""Lookups: embedding, gather, index_select.

A lookup's output has the positions of its *indices*; the table it reads is data and is used whole.
So token ids split along the sequence give split embeddings (the table's gradient is this rank's
share), and positions split along the sequence read a whole position table or buffer (GPT-2's
``wpe``, BERT's token-type buffer) at the right rows.
"""

from __future__ import annotations

from ...placements import REPLICATE, Shard
from ..ops import shape_of
from . import register
from .pointwise import mapped_args, whole_args

__all__: list[str] = []  # the rules register themselves on import; nothing here is called from outside


def link_embedding(ctx, node, op):
    idx = op["input"]
    idx_shape = shape_of(idx)
    ctx.set_factorization(node, [list(f) for f in ctx.factorization(idx)] + [[shape_of(node)[-1]]])
    for d in range(len(idx_shape)):
        ctx.link_dims(node, d, idx, d)


def rewrite_embedding(rw, node, op):
    out = rw.out_shard(node)
    if out is not None and op.get("max_norm") is not None:  # renormalizes the table in place from looked-up rows
        rw.fallback(node, "embedding with max_norm (renormalizes the table from this rank's rows)")
        return
    if out is None:
        rw.done(node, rw.reemit(node, *whole_args(rw, node)), REPLICATE)
        return
    idx = op["input"]
    convert = lambda n: rw.input(n, out) if n is idx else rw.input(n, REPLICATE, partial_grad=True)  # noqa: E731
    rw.done(node, rw.reemit(node, *mapped_args(node, convert)), out)


register("embedding", link=link_embedding, rewrite=rewrite_embedding)


def link_gather(ctx, node, op):
    src, idx = op["input"], op["index"]
    dim = op["dim"] % len(shape_of(node))
    ctx.set_factorization(node, [list(f) for f in ctx.factorization(idx)])
    for d in range(len(shape_of(node))):
        ctx.link_dims(node, d, idx, d)
        if d != dim and shape_of(src)[d] == shape_of(node)[d]:
            ctx.link_dims(node, d, src, d)


def rewrite_gather(rw, node, op):
    out = rw.out_shard(node)
    src, idx = op["input"], op["index"]
    dim = op["dim"] % len(shape_of(node))
    if out is None:
        rw.done(node, rw.reemit(node, *whole_args(rw, node)), REPLICATE)
        return
    src_want = out if (out.dim != dim and shape_of(src)[out.dim] == shape_of(node)[out.dim]) else REPLICATE
    convert = lambda n: (rw.input(n, out) if n is idx else  # noqa: E731
                         rw.input(n, src_want, partial_grad=src_want is REPLICATE))
    rw.done(node, rw.reemit(node, *mapped_args(node, convert)), out)


register("gather", link=link_gather, rewrite=rewrite_gather)


def link_index_select(ctx, node, op):
    src, idx = op["input"], op["index"]
    dim = op["dim"] % len(shape_of(node))
    for d in range(len(shape_of(node))):
        if d == dim:
            ctx.link_dims(node, d, idx, 0)
        else:
            ctx.link_dims(node, d, src, d)


def rewrite_index_select(rw, node, op):
    out = rw.out_shard(node)
    src, idx = op["input"], op["index"]
    dim = op["dim"] % len(shape_of(node))
    if out is None:
        rw.done(node, rw.reemit(node, *whole_args(rw, node)), REPLICATE)
        return
    if out.dim == dim:
        convert = lambda n: rw.input(n, Shard(0, out.layout)) if n is idx else rw.input(n, REPLICATE, partial_grad=True)  # noqa: E731
    else:
        convert = lambda n: rw.input(n, out) if n is src else rw.input(n, REPLICATE)  # noqa: E731
    rw.done(node, rw.reemit(node, *mapped_args(node, convert)), out)


register("index_select", link=link_index_select, rewrite=rewrite_index_select)
