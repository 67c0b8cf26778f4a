"""Reductions and scans.

A reduction over dims that do not include the split one is local (the output stays split). Over the
split dim:

* ``sum`` / ``count_nonzero`` give a partial sum; ``mean`` is the local sum scaled by one over the
  *global* count, also a partial sum -- exact for uneven shards;
* ``amax`` / ``amin``, ``logsumexp``, ``var`` / ``std``, ``all`` / ``any``: all-reduced, by the functions of
  :mod:`autoshard.runtime.reductions` (the gradient of an extreme goes to every position that holds it, split
  evenly across ranks exactly as one device splits it among ties);
* ``argmax`` / ``argmin`` and ``max`` / ``min`` with indices: every rank's extreme and its global
  position, all-gathered (:func:`~autoshard.passes.rules.selection.arg_extreme`);
* others (``prod``, ``norm``, ``argmax`` of the flattened input) gather, recorded as fallbacks.

A rank's shard may be empty (a slice of the sequence can leave a rank no position of it). Every rank
still joins every all-reduce, with the reduction's identity as its part: ``-inf`` for a maximum, zero for
sums, true for ``all`` and false for ``any`` (what torch's own reductions of an empty tensor give), so the
all-reduced answer is the one over the ranks that hold positions.

A partial input stays partial through ``sum`` and ``mean`` (they are linear). ``cumsum`` along the
split dim adds the sums of all earlier positions held by other ranks (``seq_cumsum``).
"""

from __future__ import annotations

import operator

import torch

from ...placements import REPLICATE, Partial, Shard
from ...runtime.reductions import extreme_over_split, logsumexp_over_split, truth_over_split, var_over_split
from ..comms import declares
from ..ops import shape_of, value_of
from .registry import register
from .pointwise import OUTPUT_WHOLE, TUPLE_LINKS, link_same, run_whole, when_output_split
from .selection import arg_extreme

__all__: list[str] = []  # the rules register themselves on import; the runtime functions are in runtime/reductions


def _reduced_dims(op, ndim: int) -> list[int]:
    dim = op["dim"]
    if dim is None:
        return list(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted(d % ndim for d in dims) if dims else list(range(ndim))


def link_reduce(ctx, node, op):
    src = op["input"]
    if not isinstance(value_of(node), torch.Tensor):
        return
    ndim = len(shape_of(src))
    reduced = _reduced_dims(op, ndim)
    in_factors = ctx.factorization(src)
    factors, mapping = [], []
    for d in range(ndim):
        if d in reduced:
            if op["keepdim"]:
                factors.append([1])
        else:
            mapping.append((len(factors), d))
            factors.append(list(in_factors[d]))
    ctx.set_factorization(node, factors)
    for od, d in mapping:
        ctx.link_dims(node, od, src, d)


def _source_shard(op, out: Shard | None, ndim: int, reduced: list[int]) -> Shard | None:
    """The input placement that gives a split output (split on a dim the reduction keeps)."""
    if out is None:
        return None
    kept = [d for d in range(ndim) if d not in reduced or op["keepdim"]]
    return out.moved(kept[out.dim])


def rewrite_reduce(rw, node, op):
    src, kind = op["input"], op["kind"]
    if not isinstance(value_of(node), torch.Tensor):  # max / min with indices
        have = rw.out_shard(src) or rw.placement(src)
        reduced = _reduced_dims(op, len(shape_of(src)))
        if getattr(have, "dim", None) is not None and have.dim not in reduced:
            kept = have.moved(have.dim - sum(1 for d in reduced if d < have.dim and not op["keepdim"]))
            new = rw.reemit(node, (rw.input(src, have),) + tuple(node.args[1:]), dict(node.kwargs))
            rw.done(node, new, (kept, kept))
        elif isinstance(have, Shard) and not have.factors:
            rw.done(node, arg_extreme(rw, src, have, bool(op["keepdim"]), kind == "max"), (REPLICATE, REPLICATE))
        else:
            rw.fallback(node, f"{kind} with indices over the split sequence")
        return
    ndim = len(shape_of(src))
    reduced = _reduced_dims(op, ndim)
    out = rw.out_shard(node)
    have = _source_shard(op, out, ndim, reduced) or rw.out_shard(src) or rw.placement(src)
    if isinstance(have, Partial) and kind in ("sum", "mean") and have.op == "sum":
        rw.done(node, rw.reemit(node), have)
        return
    if not isinstance(have, Shard):
        run_whole(rw, node, OUTPUT_WHOLE, expected=True)
        return
    x = rw.input(src, have)
    if have.dim not in reduced:
        rw.done(node, rw.reemit(node, (x,) + tuple(node.args[1:]), dict(node.kwargs)), out or REPLICATE)
        return
    keepdim = bool(op["keepdim"])
    dims = reduced
    count = 1
    for d in dims:
        count *= shape_of(src)[d]
    group = rw.groups.sequence
    if kind in ("sum", "nansum", "count_nonzero"):
        rw.done(node, rw.reemit(node, (x,) + tuple(node.args[1:]), dict(node.kwargs)), Partial())
    elif kind == "mean":
        local_sum = rw.call(torch.sum, x, dims, keepdim, dtype=value_of(node).dtype)
        rw.done(node, rw.call(torch.mul, local_sum, 1.0 / count), Partial())
    elif kind in ("amax", "amin") or (kind in ("max", "min") and op["dim"] is None):
        rw.done(node, rw.call(extreme_over_split, x, dims, keepdim, kind in ("amax", "max"), group), REPLICATE)
    elif kind == "logsumexp":
        rw.done(node, rw.call(logsumexp_over_split, x, dims, keepdim, group), REPLICATE)
    elif kind in ("var", "std"):
        correction = op.get("correction", 1)
        rw.done(node, rw.call(var_over_split, x, dims, keepdim, correction, count, kind == "std", group), REPLICATE)
    elif kind in ("argmax", "argmin") and op["dim"] is not None and not have.factors:
        pair = arg_extreme(rw, src, have, keepdim, kind == "argmax")
        rw.done(node, rw.call(operator.getitem, pair, 1), REPLICATE)
    elif kind in ("all", "any"):
        rw.done(node, rw.call(truth_over_split, x, dims, keepdim, kind == "all", group), REPLICATE)
    else:
        rw.fallback(node, f"{kind} over the split sequence")


_HELPER_ALL_REDUCES = {
    extreme_over_split: (("extreme", "tie count", "picked"), ()),
    logsumexp_over_split: (("maximum", "sum"), ()),
    var_over_split: (("mean", "squares"), ("mean",)),
    truth_over_split: (("truth",), ()),
}
"""Reduction helper -> the all-reduces it runs forward and those its backward adds, each named by what it reduces."""


@declares(*_HELPER_ALL_REDUCES)
def _helper_traffic(book, call) -> None:
    """A reduction helper's all-reduces, each of the result's size (``all`` / ``any`` reduce int32 flags)."""
    forward, backward = _HELPER_ALL_REDUCES[call.node.target]
    v = value_of(call.value)
    itemsize = 4 if call.node.target is truth_over_split else v.element_size()
    for what in forward:
        book.all_reduce(call.value.name, v.numel(), itemsize, "forward", what)
    for what in backward if call.needs_grad else ():
        book.all_reduce(call.value.name, v.numel(), itemsize, "backward", what)


def link_reduce_with_indices(ctx, producer, producer_op, index, node):
    """``max(x, dim)`` / ``min(x, dim)``: values and indices keep the other dims."""
    link_reduce(ctx, node, producer_op)


register("reduce", link=link_reduce, rewrite=rewrite_reduce)
TUPLE_LINKS["reduce"] = link_reduce_with_indices


@when_output_split
def rewrite_cumsum(rw, node, op, out):
    src = op["input"]
    dim = op["dim"] % len(shape_of(node))
    x = rw.input(src, out)
    if out.dim != dim:
        rw.done(node, rw.reemit(node, (x,) + tuple(node.args[1:]), dict(node.kwargs)), out)
        return
    if out.factors:
        rw.fallback(node, "cumsum over a merged split dim")
        return
    out_dtype = value_of(node).dtype
    if value_of(src).dtype != out_dtype:  # cumsum of bool / int promotes
        x = rw.method("to", x, out_dtype)
    rw.done(node, rw.call(torch.ops.autoshard.seq_cumsum.default, x, dim, out.layout.encode(), False,
                          rw.groups.sequence), out)


register("cumsum", link=link_same, rewrite=rewrite_cumsum)
