"""Losses, made exact over the split sequence.

``cross_entropy`` / ``nll_loss`` with ``reduction="mean"`` divide a sum by the number of counted targets
(or, with class weights, by their summed weights); ``ignore_index`` targets count for nothing. A rank's
own mean is therefore *not* a share of the global mean when ranks hold different numbers of counted
targets (padding, uneven shards, shifted labels). Every rank computes its local sum and its local
denominator, both are all-reduced, and the loss is their quotient -- the one-device value on every
rank. ``reduction="sum"`` is a partial sum; ``"none"`` stays split.

Elementwise losses (MSE, L1, smooth L1, Huber, BCE) run on each rank's positions with every argument
they were given: scalars (``beta``, ``delta``) as they are, tensors (``weight``, ``pos_weight``) split
like the input where they span the sequence, whole where they broadcast along it. Their mean divides by
the global element count -- or, for a weighted ``mse_loss`` / ``l1_loss``, by the all-reduced summed
weights. A split input broadcast to a larger loss runs whole (a fallback in the plan).

The chunked LM head + loss (``linear_cross_entropy``, made by :mod:`autoshard.passes.chunking`) is a
cross-entropy whose input is the head's input ``h [N, H]``: its tokens are the targets' tokens. Each rank
runs it on its own tokens in the same number of chunks (from the largest rank's share), and its ``"mean"``
is the same exact quotient of all-reduced sums and denominators.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...placements import REPLICATE, Partial
from ...runtime.chunked_loss import chunks_for
from ...runtime.reductions import loss_denominator, mean_of_sums
from ..comms import declares
from ..ops import is_tensor_node, numel, op_of, shape_of, value_of
from .registry import register
from .pointwise import OUTPUT_WHOLE, link_broadcast, run_whole, want_broadcast

__all__: list[str] = []  # the rules register themselves on import


def link_cross_entropy(ctx, node, op):
    inp, tgt = op["input"], op["target"]
    in_shape, t_shape = shape_of(inp), shape_of(tgt)
    if len(in_shape) < 2:
        return
    if value_of(tgt).is_floating_point() and t_shape == in_shape:  # class probabilities
        for d in (0,) + tuple(range(2, len(in_shape))):
            ctx.link_dims(inp, d, tgt, d)
        return
    for d in range(len(t_shape)):
        ctx.link_dims(tgt, d, inp, 0 if d == 0 else d + 1)
    if op["reduction"] == "none":
        ctx.set_factorization(node, [list(f) for f in ctx.factorization(tgt)])
        for d in range(len(t_shape)):
            ctx.link_dims(node, d, tgt, d)


_CLASS_WEIGHT = {"cross_entropy": "weight", "linear_cross_entropy": "class_weight"}
"""Loss op -> its class-weight argument: its mean divides by the summed class weights, or by a float32 count."""


@declares(mean_of_sums)
def _mean_traffic(book, call) -> None:
    """The all-reduces of the loss sum and of the denominator: a count or summed class weights, or (an elementwise
    loss) summed weights in the loss's dtype."""
    op, itemsize = op_of(call.value), call.itemsize
    book.all_reduce(call.value.name, 1, itemsize, "forward", "loss sum")
    if op.name in _CLASS_WEIGHT:
        weight = op[_CLASS_WEIGHT[op.name]]
        itemsize = 4 if weight is None else value_of(weight).element_size()
    book.all_reduce(call.value.name, 1, itemsize, "forward", "loss denominator")


def _local_sum(rw, node, op, args: tuple, kwargs: dict, split):
    """The loss over this rank's positions: with ``reduction="none"`` done, split as ``split``, and with
    ``"sum"`` done as a partial sum (None returned); with ``"mean"`` this rank's sum, for the caller to divide."""
    reduction = op["reduction"]
    if reduction == "none":
        rw.done(node, rw.call(node.target, *args, reduction="none", **kwargs), split)
        return None
    total = rw.call(node.target, *args, reduction="sum", **kwargs)
    if reduction == "sum":
        rw.done(node, total, Partial())
        return None
    return total


def rewrite_cross_entropy(rw, node, op):
    inp, tgt = op["input"], op["target"]
    s_in, s_t = rw.out_shard(inp), rw.out_shard(tgt)
    soft = value_of(tgt).is_floating_point() and shape_of(tgt) == shape_of(inp)
    if (s_in is None and s_t is None) or len(shape_of(inp)) < 2:
        run_whole(rw, node, OUTPUT_WHOLE, expected=True)
        return
    if s_in is not None:
        if s_in.dim == 1:
            rw.fallback(node, "cross_entropy with the class dim split")
            return
        want_in, want_t = s_in, s_in if soft else s_in.moved(0 if s_in.dim == 0 else s_in.dim - 1)
    else:
        want_t, want_in = s_t, s_t if soft else s_t.moved(0 if s_t.dim == 0 else s_t.dim + 1)
    x, t = rw.input(inp, want_in), rw.input(tgt, want_t)
    weight = op["weight"]
    w = rw.input(weight, REPLICATE, partial_grad=True) if weight is not None else None
    kwargs = {"weight": w, "ignore_index": op["ignore_index"]}
    if op["label_smoothing"]:
        kwargs["label_smoothing"] = op["label_smoothing"]
    total = _local_sum(rw, node, op, (x, t), kwargs, want_t)
    if total is None:
        return
    if soft:
        rows = numel(shape_of(inp)) // shape_of(inp)[1]
        rw.done(node, rw.call(torch.mul, total, 1.0 / rows), Partial())
        return
    denom = rw.call(loss_denominator, t, w, op["ignore_index"])
    rw.done(node, rw.call(mean_of_sums, total, denom, rw.groups.sequence), REPLICATE)


register("cross_entropy", link=link_cross_entropy, rewrite=rewrite_cross_entropy)


def link_linear_cross_entropy(ctx, node, op):
    h, tgt = op["input"], op["target"]
    for d in range(len(shape_of(tgt))):
        ctx.link_dims(tgt, d, h, d)
    if op["reduction"] == "none":
        ctx.set_factorization(node, [list(f) for f in ctx.factorization(tgt)])
        for d in range(len(shape_of(tgt))):
            ctx.link_dims(node, d, tgt, d)


def rewrite_linear_cross_entropy(rw, node, op):
    """This rank's tokens through the chunked head + loss: ``"none"`` split like the targets, ``"sum"`` a
    partial sum, ``"mean"`` the all-reduced sums over the all-reduced denominators."""
    h, tgt = op["input"], op["target"]
    s_h, s_t = rw.out_shard(h), rw.out_shard(tgt)
    if s_h is None and s_t is None:
        run_whole(rw, node, OUTPUT_WHOLE, expected=True)
        return
    want = s_h if s_h is not None else s_t
    if want.dim >= len(shape_of(tgt)):
        rw.fallback(node, "linear_cross_entropy with the hidden dim split")
        return
    x, t = rw.input(h, want), rw.input(tgt, want)
    weight, bias, class_weight = (rw.input(op[k], REPLICATE, partial_grad=True) if op[k] is not None else None
                                  for k in ("weight", "bias", "class_weight"))
    rows = numel(shape_of(tgt))
    chunks = chunks_for(-(-rows // rw.world), rw.config.chunk_loss) if rw.config.chunk_loss else op["chunks"]
    kwargs = {"class_weight": class_weight, "ignore_index": op["ignore_index"],
              "label_smoothing": op["label_smoothing"], "chunks": chunks, "out_dtype": op["out_dtype"]}
    total = _local_sum(rw, node, op, (x, weight, t, bias), kwargs, want)
    if total is None:
        return
    denom = rw.call(loss_denominator, t, class_weight, op["ignore_index"])
    rw.done(node, rw.call(mean_of_sums, total, denom, rw.groups.sequence), REPLICATE)


register("linear_cross_entropy", link=link_linear_cross_entropy, rewrite=rewrite_linear_cross_entropy)


_MEAN_OVER_WEIGHTS = (F.mse_loss, F.l1_loss)
"""Losses whose weighted mean divides by the summed weights; the others' means divide by the element count."""


def _tensor_options(op) -> list:
    """The loss's tensor arguments besides input and target (``weight``, ``pos_weight``)."""
    return [v for v in op["options"].values() if is_tensor_node(v)]


def link_elementwise_loss(ctx, node, op):
    others = [op["target"], *_tensor_options(op)]
    link_broadcast(ctx, op["input"], others, set_factors=False)
    if op["reduction"] == "none":
        link_broadcast(ctx, node, [op["input"], *others])


def _unsupported(node, op, anchor, loss_shape) -> str | None:
    """Why the loss cannot run on this rank's positions, or None."""
    if anchor is None:
        return "an elementwise loss broadcasting its split input"
    weight = op["options"].get("weight")
    if node.target in _MEAN_OVER_WEIGHTS and op["reduction"] == "mean" and is_tensor_node(weight) and \
            shape_of(weight) != loss_shape:
        return "a weighted mean over a broadcast weight"
    return None


def rewrite_elementwise_loss(rw, node, op):
    """Each rank's loss on its positions: tensor arguments split like the split one, or whole where they
    broadcast along it; ``"sum"`` and the element-count mean are partial sums, a weighted mean divides
    the all-reduced sums."""
    inp, tgt = op["input"], op["target"]
    split = [n for n in (inp, tgt) if rw.out_shard(n) is not None]
    if not split:
        run_whole(rw, node, OUTPUT_WHOLE, expected=True)
        return
    loss_shape = tuple(torch.broadcast_shapes(shape_of(inp), shape_of(tgt)))
    anchor = next((n for n in split if shape_of(n) == loss_shape), None)  # split as the loss is
    reason = _unsupported(node, op, anchor, loss_shape)
    if reason is not None:
        rw.fallback(node, reason)
        return
    s = rw.out_shard(anchor)

    def local(n):
        want, partial_grad = want_broadcast(rw, anchor, n, s)
        return rw.input(n, want, partial_grad=partial_grad)

    options = {k: local(v) if is_tensor_node(v) else v for k, v in op["options"].items()}
    total = _local_sum(rw, node, op, (local(inp), local(tgt)), options, s)
    if total is None:
        return
    if node.target in _MEAN_OVER_WEIGHTS and options.get("weight") is not None:
        weights = rw.call(torch.sum, options["weight"])
        rw.done(node, rw.call(mean_of_sums, total, weights, rw.groups.sequence), REPLICATE)
    else:
        rw.done(node, rw.call(torch.mul, total, 1.0 / numel(loss_shape)), Partial())


register("elementwise_loss", link=link_elementwise_loss, rewrite=rewrite_elementwise_loss)

