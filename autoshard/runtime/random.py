"""Randomness on sequence-split values: every rank gets exactly its part of the one-process draw.

A model on one process draws a dropout mask (or ``torch.rand`` values) over the whole activation
from the default generator. Split over ranks, the program must give the same result: the tokens a
rank holds are dropped exactly as the one-process run drops them, and the default generator ends in
the same state on every rank -- and as on one process -- so the replicated randomness that follows
stays in step.

torch's generators are not counter-based (the CPU Mersenne Twister is sequential; how a CUDA Philox
stream maps numbers to elements depends on the kernel's launch shape), so a rank cannot draw only
its part. Every rank makes the whole draw instead -- the one-process call, on the global shape, dtype
and device -- keeps the positions it holds and frees the rest: one global-size draw of transient
memory and time per random op, no communication. On CPU the masks are bitwise the one-process masks
for contiguous inputs (tested); on CUDA the draw is the same call, but a low-precision dropout may
differ in the last bit, since the one-process fused kernel scales in float32 (not tested).

The draw is the custom op ``autoshard::sequence_draw`` so that AOTAutograd and Inductor trace it
through its fake implementation rather than into the generator calls. It has no tensor inputs (its
output is noise, not a function of a differentiable value, so it needs no autograd formula) and is
tagged ``nondeterministic_seeded``: partitioners save its output instead of recomputing it in the
backward, and constant folding leaves it alone. Its ``site`` argument (the graph node it serves)
keeps two draws with otherwise equal arguments apart under common-subexpression elimination, which
merges calls of pure ops by their arguments.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .layouts import SequenceLayout
from .op_info import declare

__all__ = ["DRAWS", "sequence_draw"]


def _dropout_factor(dropout):
    """The draw of ``dropout``'s factor: ``dropout`` applied to ones (0 or ``1 / (1 - p)`` per element)."""
    return lambda shape, p, dtype, device: dropout(torch.ones(shape, dtype=dtype, device=device), p, True)


DRAWS = {
    "dropout": _dropout_factor(F.dropout),
    "dropout1d": _dropout_factor(F.dropout1d),
    "dropout2d": _dropout_factor(F.dropout2d),
    "rand": lambda shape, p, dtype, device: torch.rand(shape, dtype=dtype, device=device),
    "randn": lambda shape, p, dtype, device: torch.randn(shape, dtype=dtype, device=device),
}
"""Kind -> the one-process draw of a global ``shape``: for a dropout kind the factor its input is multiplied
by (broadcast to ``shape``); ``p`` is ignored by ``rand``/``randn``."""


def _local_shape(shape: list[int], dim: int, factors: list[int], factor: int, length: int) -> list[int]:
    """``shape`` with the sequence factor of ``dim`` cut to ``length`` positions."""
    sizes = list(factors) if factors else [shape[dim]]
    sizes[factor] = length
    return shape[:dim] + [math.prod(sizes)] + shape[dim + 1:]


@torch.library.custom_op("autoshard::sequence_draw", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def sequence_draw(kind: str, p: float, shape: list[int], dim: int, factors: list[int], factor: int,
                  layout: list[int], rank: int, site: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's part of the one-process draw ``DRAWS[kind]`` of global ``shape``, split on ``dim`` as a
    :class:`~autoshard.placements.Shard` (``factors``/``factor``: the sizes merged into ``dim`` and which of
    them is the sequence) under the encoded ``layout``."""
    whole = DRAWS[kind](shape, p, dtype, device)
    seq = dim + factor
    if factors:
        whole = whole.reshape(shape[:dim] + list(factors) + shape[dim + 1:])
    positions = SequenceLayout.decode(layout).positions(rank, device=device)
    local = whole.index_select(seq, positions)
    return local.reshape(_local_shape(shape, dim, factors, factor, len(positions)))


@sequence_draw.register_fake
def _(kind, p, shape, dim, factors, factor, layout, rank, site, dtype, device):
    length = SequenceLayout.decode(layout).local_length(rank)
    return torch.empty(_local_shape(shape, dim, factors, factor, length), dtype=dtype, device=device)


declare(torch.ops.autoshard.sequence_draw.default)
