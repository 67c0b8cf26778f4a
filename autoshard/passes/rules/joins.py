"""Ops that join or cut along a dim: ``split`` / ``chunk`` / ``unbind``, ``cat``, ``stack`` and ``pad``.

Concatenation and padding along the sequence place the new positions on the ranks that hold their neighbours (the
CLS token goes to the rank holding position 0), so no data moves: each input (or the unpadded value) takes the
positions of its range in a layout derived from the output's (:meth:`~autoshard.runtime.layouts.SequenceLayout.
derive`). Splitting along the sequence (a DiT's joint ``[text; image]`` sequence split back into its parts) is the
converse: each piece holds the positions of its range this rank holds, in a layout derived from the source's.
Along any other dim these ops keep the split as it is; across a merged split dim (factors) they gather.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...placements import Shard
from ..ops import Op, as_size, is_tensor_node, shape_of, value_of
from .pointwise import TUPLE_LINKS, link_nothing, when_output_split
from .registry import register
from .views import local_range

__all__ = ["link_cat", "link_pad", "link_split_piece", "link_stack"]


# ============================================================================= split / chunk / unbind


def _split_pieces(node: fx.Node, op: Op) -> tuple[int, list[int] | None]:
    """(dim, piece sizes) of a split-like node, from its outputs; the sizes are None for ``unbind``, whose
    pieces drop the dim."""
    src_shape = shape_of(op["input"])
    if node.target in ("unbind", torch.unbind):
        dim = op["dim"] if op["dim"] is not None else (op["args"][0] if op["args"] else 0)
        return dim % len(src_shape), None
    outs = value_of(node)
    dims = [d for d in range(len(src_shape)) if any(o.shape[d] != src_shape[d] for o in outs)]
    dim = dims[0] if dims else (op["dim"] if op["dim"] is not None else (op["args"][1] if len(op["args"]) > 1 else 0))
    return dim % len(src_shape), [as_size(o.shape[dim]) for o in outs]


def link_split_piece(ctx, producer, producer_op, index, node):
    src = producer_op["input"]
    dim, sizes = _split_pieces(producer, producer_op)
    factors = [list(f) for f in ctx.factorization(src)]
    if sizes is None:  # unbind: piece dim d is source dim d, or d + 1 past the unbound dim
        del factors[dim]
        ctx.set_factorization(node, factors)
        for d in range(len(factors)):
            ctx.link_dims(node, d, src, d + (d >= dim))
        return
    factors[dim] = [sizes[index]]
    ctx.set_factorization(node, factors)
    for d in range(len(factors)):
        ctx.link_dims(node, d, src, d, sum(sizes[:index]) if d == dim else 0)


def rewrite_split(rw, node, op):
    """Pieces cut along another dim than the split one keep the split (``unbind`` drops its dim, so a later
    split dim moves down by one); pieces cut along the split dim hold the positions of their range this rank
    holds (a joint ``[text; image]`` sequence split back into its parts); unbinding it, or cutting a merged
    split dim, gathers."""
    src = op["input"]
    dim, sizes = _split_pieces(node, op)
    have = rw.out_shard(src) or rw.placement(src)
    n = len(value_of(node))
    if isinstance(have, Shard) and have.dim != dim:
        piece = have if sizes is not None else have.moved(have.dim - (have.dim > dim))
        rw.done(node, rw.reemit(node, (rw.input(src, have),) + tuple(node.args[1:]), dict(node.kwargs)),
                tuple(piece for _ in range(n)))
    elif isinstance(have, Shard) and sizes is not None and not have.factors:
        # each piece holds the positions of its range this rank holds, in a layout derived from the source's
        offsets = [sum(sizes[:i]) for i in range(n)]
        local = [_count_local(have, rw.rank, o, o + size) for o, size in zip(offsets, sizes)]
        placements = tuple(Shard(dim, have.layout.derive(o, size)) for o, size in zip(offsets, sizes))
        rw.done(node, rw.call(torch.split, rw.input(src, have), local, dim), placements)
    elif isinstance(have, Shard):
        rw.fallback(node, "unbinding the split sequence dim, or cutting a merged one")
    else:  # partial (a whole source: the rewriter re-emits the split itself)
        rw.done(node, rw.reemit(node), tuple(have for _ in range(n)))


register("split", link=link_nothing, rewrite=rewrite_split)
TUPLE_LINKS["split"] = link_split_piece


# ============================================================================= cat / stack


def _cat_inputs(op: Op) -> list[fx.Node]:
    """Inputs that take part (legacy ``cat`` skips 1-D empty tensors)."""
    return [t for t in op["tensors"] if not (is_tensor_node(t) and shape_of(t) == (0,))]


def link_cat(ctx, node, op):
    out_shape = shape_of(node)
    dim = op["dim"] % len(out_shape)
    inputs = _cat_inputs(op)
    factors = [[s] for s in out_shape]
    for d in range(len(out_shape)):
        if d != dim and inputs:
            factors[d] = list(ctx.factorization(inputs[0])[d])
    ctx.set_factorization(node, factors)
    offset = 0
    for t in inputs:
        for d in range(len(out_shape)):
            ctx.link_dims(node, d, t, d, -offset if d == dim else 0)
        offset += shape_of(t)[dim]


@when_output_split
def rewrite_cat(rw, node, op, out):
    dim = op["dim"] % len(shape_of(node))
    inputs = _cat_inputs(op)
    if out.dim != dim or len(inputs) == 1:  # (a list of one: QwenImage's per-video positions)
        new = [rw.input(t, out) for t in inputs]
    elif out.factors:
        rw.fallback(node, "concatenating along a merged split dim")
        return
    else:
        new, offset = [], 0
        for t in inputs:
            length = shape_of(t)[dim]
            new.append(rw.input(t, Shard(dim, out.layout.derive(offset, length)), partial_grad=False))
            offset += length
    rw.done(node, rw.call(torch.cat, new, dim), out)


register("cat", link=link_cat, rewrite=rewrite_cat)


def link_stack(ctx, node, op):
    out_shape = shape_of(node)
    dim = op["dim"] % len(out_shape)
    inputs = op["tensors"]
    factors = [[s] for s in out_shape]
    for d in range(len(out_shape)):
        if d != dim:
            factors[d] = list(ctx.factorization(inputs[0])[d - (d > dim)])
    ctx.set_factorization(node, factors)
    for t in inputs:
        for d in range(len(out_shape)):
            if d != dim:
                ctx.link_dims(node, d, t, d - (d > dim))


@when_output_split
def rewrite_stack(rw, node, op, out):
    dim = op["dim"] % len(shape_of(node))
    new = [rw.input(t, out.moved(out.dim - (out.dim > dim))) for t in op["tensors"]]
    rw.done(node, rw.call(torch.stack, new, dim), out)


register("stack", link=link_stack, rewrite=rewrite_stack)


# ============================================================================= pad


def _pad_pairs(op: Op, ndim: int) -> dict[int, tuple[int, int]]:
    pad = op["pad"]
    return {ndim - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)}


def link_pad(ctx, node, op):
    src = op["input"]
    ndim = len(shape_of(node))
    pairs = _pad_pairs(op, ndim)
    factors = [list(f) for f in ctx.factorization(src)]
    for d, (left, right) in pairs.items():
        if left or right:
            factors[d] = [shape_of(node)[d]]
    ctx.set_factorization(node, factors)
    if op["mode"] != "constant":
        return
    for d in range(ndim):
        left = pairs.get(d, (0, 0))[0]
        ctx.link_dims(node, d, src, d, -left)


@when_output_split
def rewrite_pad(rw, node, op, out):
    src = op["input"]
    ndim = len(shape_of(node))
    pairs = _pad_pairs(op, ndim)
    left, right = pairs.get(out.dim, (0, 0))
    if not (left or right):
        x = rw.input(src, out)
        rw.done(node, rw.reemit(node, (x,) + tuple(node.args[1:]), dict(node.kwargs)), out)
        return
    if op["mode"] != "constant" or out.factors or left < 0 or right < 0:
        rw.fallback(node, f"{op['mode']} padding of the split dim")
        return
    length = shape_of(src)[out.dim]
    x = rw.input(src, Shard(out.dim, out.layout.derive(left, length)))
    local_left = _count_local(out, rw.rank, 0, left)
    local_right = _count_local(out, rw.rank, left + length, left + length + right)
    pad = list(op["pad"])
    i = ndim - 1 - out.dim
    pad[2 * i], pad[2 * i + 1] = local_left, local_right
    rw.done(node, rw.call(F.pad, x, pad, op["mode"], op["value"]), out)


def _count_local(shard: Shard, rank: int, start: int, stop: int) -> int:
    lo, hi = local_range(shard, rank, start, stop)
    return hi - lo


register("pad", link=link_pad, rewrite=rewrite_pad)
