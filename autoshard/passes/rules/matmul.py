"""Matrix products: linear, matmul/bmm/mm, addmm/baddbmm.

Rows of a product are positions of the left operand, columns positions of the right one, and the
contracted dim is shared. So a sequence split on rows (tokens through a linear layer, GPT-2's
``Conv1D`` addmm over merged batch*sequence rows) stays split and the weight is used whole (its
gradient is this rank's share, summed by ``grad_sync``). When the contracted dim is the split one
(token mixing, ``probs @ v`` of an attention that was not captured), both operands are taken split and
the result is a partial sum; a bias is added once, after the all-reduce, in the product's dtype (under
autocast the lower precision, as one device's linear / addmm casts it). When the output is split on one
operand's positions and the other operand carries a split of its own (its rows are another sequence
dim), that operand is gathered.
"""

from __future__ import annotations

import torch

from ...placements import REPLICATE, Partial, Shard
from ..ops import numel, shape_of, value_of
from . import register

__all__: list[str] = []  # the rules register themselves on import; nothing here is called from outside


def _matmul_dims(a_shape, b_shape, out_shape):
    """Per output dim: ((input, dim) of a, (input, dim) of b) that carry its positions; and the k dims."""
    a_nd, b_nd, o_nd = len(a_shape), len(b_shape), len(out_shape)
    a_k = a_nd - 1
    b_k = b_nd - 2 if b_nd >= 2 else 0
    maps: list[list[tuple[str, int]]] = [[] for _ in range(o_nd)]
    if a_nd >= 2:
        maps[o_nd - (2 if b_nd >= 2 else 1)].append(("a", a_nd - 2))
    if b_nd >= 2:
        maps[o_nd - 1].append(("b", b_nd - 1))
    batch_o = o_nd - (a_nd >= 2) - (b_nd >= 2)
    for d in range(batch_o):
        for name, shape in (("a", a_shape), ("b", b_shape)):
            nd = len(shape) - 2
            dd = d - (batch_o - nd)
            if nd > 0 and dd >= 0 and shape[dd] == out_shape[d]:
                maps[d].append((name, dd))
    return maps, a_k, b_k


def _link_product(ctx, node, a, b, extra=None):
    a_shape, b_shape, out_shape = shape_of(a), shape_of(b), shape_of(node)
    maps, a_k, b_k = _matmul_dims(a_shape, b_shape, out_shape)
    inputs = {"a": a, "b": b}
    factors = []
    for d, sources in enumerate(maps):
        factors.append(list(ctx.factorization(inputs[sources[0][0]])[sources[0][1]]) if sources else [out_shape[d]])
    ctx.set_factorization(node, factors)
    for d, sources in enumerate(maps):
        for name, dd in sources:
            ctx.link_dims(node, d, inputs[name], dd)
    if a_shape[a_k] == b_shape[b_k]:
        ctx.link_dims(a, a_k, b, b_k)
    if extra is not None:  # a bias broadcast over the output
        from .pointwise import link_broadcast

        link_broadcast(ctx, node, [extra], set_factors=False)


def _product_inputs(rw, node, a, b):
    """(placement of a, of b, output placement) for a product node."""
    out = rw.out_shard(node)
    maps, a_k, b_k = _matmul_dims(shape_of(a), shape_of(b), shape_of(node))
    if out is not None:
        wants = {"a": None, "b": None}
        for name, dd in maps[out.dim]:
            wants[name] = out.moved(dd)
        return wants["a"], wants["b"], out
    sa, sb = rw.out_shard(a), rw.out_shard(b)
    if sa is not None and sb is not None and sa.dim == a_k and sb.dim == b_k and sa.layout == sb.layout:
        return sa, sb, Partial()
    return None, None, REPLICATE


def link_matmul(ctx, node, op):
    _link_product(ctx, node, op["a"], op["b"])


def rewrite_matmul(rw, node, op):
    a, b = op["a"], op["b"]
    want_a, want_b, out = _product_inputs(rw, node, a, b)
    pg = out != REPLICATE
    new_a = rw.input(a, want_a or REPLICATE, partial_grad=pg and want_a is None)
    new_b = rw.input(b, want_b or REPLICATE, partial_grad=pg and want_b is None)
    rw.done(node, rw.call(torch.matmul, new_a, new_b), out)


register("matmul", link=link_matmul, rewrite=rewrite_matmul, always=True)  # emits torch.matmul, unnamed


def _reduced(rw, node, partial):
    """The all-reduced sum of ``partial``, this rank's part of ``node``'s product (before its bias), booked."""
    rw.book.all_reduce(node.name, numel(shape_of(node)), value_of(node).element_size(), "forward",
                       reason="product over the split dim")
    return rw.call(torch.ops.autoshard.reduce_partial.default, partial, "sum", rw.group)


def link_addmm(ctx, node, op):
    _link_product(ctx, node, op["a"], op["b"], extra=op["bias"])


def rewrite_addmm(rw, node, op):
    a, b, bias = op["a"], op["b"], op["bias"]
    want_a, want_b, out = _product_inputs(rw, node, a, b)
    if isinstance(out, Partial):  # the bias must be added once: reduce the product first
        prod = rw.call(torch.matmul, rw.input(a, want_a), rw.input(b, want_b))
        summed = _reduced(rw, node, prod)
        scaled = rw.call(torch.mul, summed, op["alpha"]) if op["alpha"] != 1 else summed
        base = rw.in_dtype_of(node, bias, rw.input(bias, REPLICATE))
        base = rw.call(torch.mul, base, op["beta"]) if op["beta"] != 1 else base
        rw.done(node, rw.call(torch.add, base, scaled), REPLICATE)
        return
    pg = out != REPLICATE
    new_a = rw.input(a, want_a or REPLICATE, partial_grad=pg and want_a is None)
    new_b = rw.input(b, want_b or REPLICATE, partial_grad=pg and want_b is None)
    if isinstance(out, Shard):
        from .pointwise import want_broadcast

        bias_want, bias_pg = want_broadcast(rw, node, bias, out)
        new_bias = rw.input(bias, bias_want, partial_grad=bias_pg)
    else:
        new_bias = rw.input(bias, REPLICATE)
    rw.done(node, rw.reemit(node, (new_bias, new_a, new_b), rw.value(node.kwargs)), out)


register("addmm", link=link_addmm, rewrite=rewrite_addmm)


def link_linear(ctx, node, op):
    x, w = op["input"], op["weight"]
    x_shape = shape_of(x)
    factors = [list(f) for f in ctx.factorization(x)[:-1]] + [[shape_of(node)[-1]]]
    ctx.set_factorization(node, factors)
    for d in range(len(x_shape) - 1):
        ctx.link_dims(node, d, x, d)
    ctx.link_dims(x, len(x_shape) - 1, w, len(shape_of(w)) - 1)


def rewrite_linear(rw, node, op):
    x, w, bias = op["input"], op["weight"], op["bias"]
    out = rw.out_shard(node)
    sx = rw.out_shard(x)
    last = len(shape_of(x)) - 1
    if out is None and sx is not None and sx.dim == last:  # contracting over the split dim
        part = rw.call(torch.nn.functional.linear, rw.input(x, sx), rw.input(w, sx.moved(len(shape_of(w)) - 1)))
        if bias is None:
            rw.done(node, part, Partial())
            return
        summed = _reduced(rw, node, part)
        rw.done(node, rw.call(torch.add, summed, rw.in_dtype_of(node, bias, rw.input(bias, REPLICATE))), REPLICATE)
        return
    if out is None:
        args = [rw.input(x, REPLICATE), rw.input(w, REPLICATE), rw.input(bias, REPLICATE) if bias is not None else None]
        rw.done(node, rw.call(torch.nn.functional.linear, *args), REPLICATE)
        return
    new_x = rw.input(x, out)
    new_w = rw.input(w, REPLICATE, partial_grad=True)
    new_b = rw.input(bias, REPLICATE, partial_grad=True) if bias is not None else None
    rw.done(node, rw.call(torch.nn.functional.linear, new_x, new_w, new_b), out)


register("linear", link=link_linear, rewrite=rewrite_linear, always=True)  # emits F.linear, unnamed
