"""Lookups: embedding, gather, index_select, and gather's inverse, scatter.

A lookup's output has the positions of its *indices*; the table it reads is data and is used whole.
So token ids split along the sequence give split embeddings (the table's gradient is this rank's
share), and positions split along the sequence read a whole position table or buffer (GPT-2's
``wpe``, BERT's token-type buffer) at the right rows.

``scatter`` (``scatter_add``, ``scatter_reduce``; the in-place forms arrive here functionalized) writes
along ``dim`` at the index's positions of every other dim: where the index and the source span a dim
fully, the output's positions along it are theirs, so a split along it (not ``dim``) is computed on every
rank's own positions -- a MoE router's ``zeros_like(scores).scatter_(-1, topk, 1)``, a one-hot over
features. A scatter along the split dim itself runs on the gathered values (a fallback in the report).
"""

from __future__ import annotations

from ...placements import REPLICATE, Shard
from ..ops import shape_of
from .registry import register
from .pointwise import mapped_args, when_output_split

__all__: list[str] = []  # the rules register themselves on import; nothing here is called from outside


def link_embedding(ctx, node, op):
    idx = op["input"]
    idx_shape = shape_of(idx)
    ctx.set_factorization(node, [list(f) for f in ctx.factorization(idx)] + [[shape_of(node)[-1]]])
    for d in range(len(idx_shape)):
        ctx.link_dims(node, d, idx, d)


@when_output_split
def rewrite_embedding(rw, node, op, out):
    if op.get("max_norm") is not None:  # renormalizes the table in place from looked-up rows
        rw.fallback(node, "embedding with max_norm (renormalizes the table from this rank's rows)")
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


@when_output_split
def rewrite_gather(rw, node, op, out):
    src, idx = op["input"], op["index"]
    dim = op["dim"] % len(shape_of(node))
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


@when_output_split
def rewrite_index_select(rw, node, op, out):
    src, idx = op["input"], op["index"]
    if out.dim == op["dim"] % len(shape_of(node)):
        convert = lambda n: rw.input(n, Shard(0, out.layout)) if n is idx else rw.input(n, REPLICATE, partial_grad=True)  # noqa: E731
    else:
        convert = lambda n: rw.input(n, out) if n is src else rw.input(n, REPLICATE)  # noqa: E731
    rw.done(node, rw.reemit(node, *mapped_args(node, convert)), out)


register("index_select", link=link_index_select, rewrite=rewrite_index_select)


def _scatter_inputs(op) -> list:
    return [n for n in (op["index"], op.get("src")) if n is not None and not isinstance(n, (int, float, bool))]


def _spans(node, inp, d: int) -> bool:
    return shape_of(inp)[d] == shape_of(node)[d]


def link_scatter(ctx, node, op):
    dim = op["dim"] % len(shape_of(node))
    ctx.set_factorization(node, [list(f) for f in ctx.factorization(op["input"])])
    for d in range(len(shape_of(node))):
        ctx.link_dims(node, d, op["input"], d)
        if d != dim:
            for inp in _scatter_inputs(op):
                if _spans(node, inp, d):
                    ctx.link_dims(node, d, inp, d)


@when_output_split
def rewrite_scatter(rw, node, op, out):
    if out.dim == op["dim"] % len(shape_of(node)) or not all(_spans(node, n, out.dim) for n in _scatter_inputs(op)):
        rw.fallback(node, "scatter along the split dim (or an index that does not span it)")
        return
    rw.done(node, rw.reemit(node, *mapped_args(node, lambda n: rw.input(n, out))), out)


register("scatter", link=link_scatter, rewrite=rewrite_scatter)
