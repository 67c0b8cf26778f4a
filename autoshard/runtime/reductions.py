"""Reductions along a dim split over ranks, as the compiled graph runs them.

The rules (:mod:`autoshard.passes.rules.reductions`, ``norms``, ``loss``) decide when a reduction spans the split
sequence and emit calls of these functions; each combines this rank's part with all-reduces and is exact for
uneven shards:

* ``amax`` / ``amin`` (:func:`extreme_over_split`): the extreme all-reduced, its gradient shared among every
  position that holds it, on every rank, as one device splits it among ties;
* ``logsumexp``, ``var`` / ``std``, ``all`` / ``any``: all-reduced maximum / mean, then all-reduced sums
  or flags;
* softmax / log-softmax (:func:`softmax_over_split`): all-reduced maximum and normalizer;
* a loss's ``"mean"`` (:func:`mean_of_sums`): every rank's partial sum over every rank's partial denominator
  (:func:`loss_denominator`).

A rank's shard may be empty (a slice of the sequence can leave a rank no position of it). Every rank still joins
every all-reduce, with the reduction's identity as its part (:func:`extreme_identity`; zero for sums), so the
all-reduced answer is the one over the ranks that hold positions. Which collectives each function runs is declared
beside the rule that emits it (:mod:`autoshard.runtime.op_info`).
"""

from __future__ import annotations

import math

import torch

from .collectives import all_reduce
from .redistribute import reduce_partial

__all__ = ["extreme_identity", "local_extreme", "extreme_over_split", "logsumexp_over_split", "var_over_split",
           "truth_over_split", "softmax_over_split", "loss_denominator", "mean_of_sums"]


def extreme_identity(dtype: torch.dtype, largest: bool) -> float | int | bool:
    """The identity of a maximum (``largest``) or minimum of ``dtype`` values: what a rank without positions
    offers."""
    if dtype.is_floating_point:
        return -math.inf if largest else math.inf
    if dtype == torch.bool:
        return not largest
    return torch.iinfo(dtype).min if largest else torch.iinfo(dtype).max


def local_extreme(x: torch.Tensor, dims: list[int], largest: bool = True) -> torch.Tensor:
    """This rank's part of an amax (``largest``) / amin over ``dims`` (keepdim, no gradient); where the shard
    has no position along a reduced dim, the all-reduce's identity, which torch's amax refuses to give."""
    x = x.detach()
    if all(x.size(d) for d in dims):
        return x.amax(dims, keepdim=True) if largest else x.amin(dims, keepdim=True)
    return x.new_full([1 if d in dims else n for d, n in enumerate(x.shape)], extreme_identity(x.dtype, largest))


def extreme_over_split(x: torch.Tensor, dims: list[int], keepdim: bool, largest: bool, group: str) -> torch.Tensor:
    """amax / amin over dims one of which is split: value all-reduced, gradient shared among all ties."""
    value = reduce_partial(local_extreme(x, dims, largest), "max" if largest else "min", group)
    hit = (x == value).to(x.dtype)
    count = reduce_partial(hit.sum(dims, keepdim=True), "sum", group)
    picked = reduce_partial((x * hit).sum(dims, keepdim=True), "sum", group) / count
    out = value + (picked - picked.detach())  # exactly the extreme; gradient 1/count to each tie
    return out if keepdim else out.squeeze(dims)


def logsumexp_over_split(x: torch.Tensor, dims: list[int], keepdim: bool, group: str) -> torch.Tensor:
    m = reduce_partial(local_extreme(x, dims), "max", group)
    total = reduce_partial((x - m).exp().sum(dims, keepdim=True), "sum", group)
    out = total.log() + m
    return out if keepdim else out.squeeze(dims)


def var_over_split(x: torch.Tensor, dims: list[int], keepdim: bool, correction: int, count: int, std: bool,
                   group: str) -> torch.Tensor:
    # the mean feeds this rank's positions: its gradient is a share, summed by all_reduce's backward
    mean = all_reduce(x.sum(dims, keepdim=True), "sum", group=group) / count
    sq = reduce_partial((x - mean).square().sum(dims, keepdim=True), "sum", group)
    out = sq / max(count - correction, 0)
    out = out.sqrt() if std else out
    return out if keepdim else out.squeeze(dims)


def truth_over_split(x: torch.Tensor, dims: list[int], keepdim: bool, every: bool, group: str) -> torch.Tensor:
    local = (x.all(dims[0], keepdim=True) if every else x.any(dims[0], keepdim=True))
    for d in dims[1:]:
        local = local.all(d, keepdim=True) if every else local.any(d, keepdim=True)
    flag = local.to(torch.int32)
    merged = reduce_partial(1 - flag if every else flag, "max", group)
    out = (merged == 0) if every else (merged > 0)
    return out if keepdim else out.squeeze(dims)


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


def loss_denominator(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """What ``reduction="mean"`` divides by: the counted targets, or their summed class weights."""
    valid = target != ignore_index
    if weight is None:
        return valid.sum().to(torch.float32 if not torch.is_floating_point(target) else target.dtype)
    safe = torch.where(valid, target, torch.zeros_like(target))
    return torch.where(valid, weight[safe], torch.zeros((), dtype=weight.dtype, device=weight.device)).sum()


def mean_of_sums(total: torch.Tensor, denominator: torch.Tensor, group: str) -> torch.Tensor:
    """The global mean from every rank's partial sum and partial denominator."""
    return reduce_partial(total, "sum", group) / reduce_partial(denominator, "sum", group).to(total.dtype)
