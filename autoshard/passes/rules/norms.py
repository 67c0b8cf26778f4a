"""Normalizations and softmax.

Norms over the hidden dims (LayerNorm, RMSNorm) are per token: they stay local and their weights are
used whole. Softmax / log-softmax over a dim other than the sequence are per token too; over the
sequence itself they become collective: the maximum and the sum of exponentials are all-reduced
(:func:`softmax_over_split`). Norms whose statistics span the sequence (group norm over a split
spatial dim, batch norm over a split length) gather their input, recorded as a fallback.
"""

from __future__ import annotations

import torch

from ...placements import REPLICATE
from ...runtime.collectives import all_reduce
from ...runtime.redistribute import reduce_partial
from ..comms import declares
from ..ops import numel, shape_of, value_of
from . import register
from .reductions import local_extreme
from .pointwise import OUTPUT_WHOLE, link_broadcast, link_same, mapped_args, run_whole

__all__ = ["softmax_over_split"]


def link_norm(ctx, node, op):
    link_same(ctx, node, op)
    extras = [op.get(k) for k in ("weight", "bias")]
    link_broadcast(ctx, node, [e for e in extras if e is not None], set_factors=False)


def _normalized_dims(node, op) -> set[int]:
    ndim = len(shape_of(node))
    if op.name in ("layer_norm", "rms_norm"):
        return set(range(ndim - len(op["normalized_shape"]), ndim))
    if op.name == "group_norm":
        return set(range(1, ndim))
    return {0} | set(range(2, ndim))  # batch_norm: statistics over batch and spatial dims


def rewrite_norm(rw, node, op):
    out = rw.out_shard(node)
    if out is None:
        run_whole(rw, node, OUTPUT_WHOLE, expected=True)
        return
    if out.dim in _normalized_dims(node, op) and not (op.name == "batch_norm" and not op["training"]):
        rw.fallback(node, f"{op.name} statistics over the split sequence")
        return
    src = op["input"]
    convert = lambda n: rw.input(n, out) if n is src else rw.input(n, REPLICATE, partial_grad=True)  # noqa: E731
    rw.done(node, rw.reemit(node, *mapped_args(node, convert)), out)


register("layer_norm", "rms_norm", "group_norm", "batch_norm", link=link_norm, rewrite=rewrite_norm)


def softmax_over_split(x: torch.Tensor, dim: int, log: bool, dtype: torch.dtype, group: str) -> torch.Tensor:
    """(log-)softmax along a dim split over ranks: the max and the normalizer are all-reduced. Computed in
    ``dtype``, the one-device softmax's output dtype: its ``dtype=`` argument, or float32 where autocast
    runs softmax in float32 (CUDA)."""
    x = x.to(dtype)
    m = reduce_partial(local_extreme(x, [dim]), "max", group)  # an empty shard joins with -inf
    shifted = x - m
    # the normalizer feeds this rank's positions: its gradient is a share, summed by all_reduce's backward
    total = all_reduce(shifted.exp().sum(dim, keepdim=True), "sum", group=group)
    return shifted - total.log() if log else shifted.exp() / total


def rewrite_softmax(rw, node, op):
    out = rw.out_shard(node)
    if out is None:
        run_whole(rw, node, OUTPUT_WHOLE, expected=True)
        return
    dim = op["dim"] % len(shape_of(node))
    x = rw.input(op["input"], out)
    if dim != out.dim:
        rw.done(node, rw.reemit(node, (x,) + tuple(node.args[1:]), dict(node.kwargs)), out)
        return
    if out.factors:
        rw.fallback(node, "softmax over a merged split dim")
        return
    log = "log_softmax" in str(getattr(node.target, "__name__", node.target))
    rw.done(node, rw.call(softmax_over_split, x, dim, log, value_of(node).dtype, rw.group), out)


@declares(softmax_over_split)
def _softmax_traffic(book, call) -> None:
    """The maximum's all-reduce, and the normalizer's, whose backward sums its gradient shares."""
    v, dim = value_of(call.value), call.arguments["dim"]
    reduced = numel(v.shape) // v.shape[dim]
    book.all_reduce(call.value.name, reduced, v.element_size(), "forward", "softmax maximum")
    for phase in call.phases:
        book.all_reduce(call.value.name, reduced, v.element_size(), phase, "softmax normalizer")


register("softmax", link=link_same, rewrite=rewrite_softmax)
