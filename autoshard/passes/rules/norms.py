"""Normalizations and softmax.

Norms over the hidden dims (LayerNorm, RMSNorm) are per token: they stay local and their weights are
used whole. Softmax / log-softmax over a dim other than the sequence are per token too; over the
sequence itself they become collective: the maximum and the sum of exponentials are all-reduced
(:func:`~autoshard.runtime.reductions.softmax_over_split`). Norms whose statistics span the sequence
(group norm over a split spatial dim, batch norm over a split length) gather their input, recorded as a
fallback.
"""

from __future__ import annotations

from ...placements import REPLICATE
from ...runtime.reductions import softmax_over_split
from ..comms import declares
from ..ops import numel, shape_of, value_of
from .registry import register
from .pointwise import link_broadcast, link_same, mapped_args, when_output_split

__all__: list[str] = []  # the rules register themselves on import


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


@when_output_split
def rewrite_norm(rw, node, op, out):
    if out.dim in _normalized_dims(node, op) and not (op.name == "batch_norm" and not op["training"]):
        rw.fallback(node, f"{op.name} statistics over the split sequence")
        return
    src = op["input"]
    convert = lambda n: rw.input(n, out) if n is src else rw.input(n, REPLICATE, partial_grad=True)  # noqa: E731
    rw.done(node, rw.reemit(node, *mapped_args(node, convert)), out)


register("layer_norm", "rms_norm", "group_norm", "batch_norm", link=link_norm, rewrite=rewrite_norm)


@when_output_split
def rewrite_softmax(rw, node, op, out):
    dim = op["dim"] % len(shape_of(node))
    x = rw.input(op["input"], out)
    if dim != out.dim:
        rw.done(node, rw.reemit(node, (x,) + tuple(node.args[1:]), dict(node.kwargs)), out)
        return
    if out.factors:
        rw.fallback(node, "softmax over a merged split dim")
        return
    log = "log_softmax" in str(getattr(node.target, "__name__", node.target))
    rw.done(node, rw.call(softmax_over_split, x, dim, log, value_of(node).dtype, rw.groups.sequence), out)


@declares(softmax_over_split)
def _softmax_traffic(book, call) -> None:
    """The maximum's all-reduce, and the normalizer's, whose backward sums its gradient shares."""
    v, dim = value_of(call.value), call.arguments["dim"]
    reduced = numel(v.shape) // v.shape[dim]
    book.all_reduce(call.value.name, reduced, v.element_size(), "forward", "softmax maximum")
    for phase in call.phases:
        book.all_reduce(call.value.name, reduced, v.element_size(), phase, "softmax normalizer")


register("softmax", link=link_same, rewrite=rewrite_softmax)
