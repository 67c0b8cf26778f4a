"""Placements: how one value of the graph lives on the ranks of the sequence group.

Three kinds, as in DTensor, with short string forms for plans and dumps:

``R`` -- :class:`Replicate`
    every rank holds the whole value.
``S(d)`` -- :class:`Shard`
    the value is split along the sequence: tensor dim ``d`` holds it. Which positions each rank holds
    is a :class:`~autoshard.runtime.layouts.SequenceLayout` (contiguous, zigzag or derived from
    them; uneven shards allowed). A dim may be a *merge* of several factors, e.g. logits viewed from
    ``[B, S, V]`` to ``[B*S, V]``: ``factors`` lists the merged sizes (outer to inner) and ``factor`` says
    which one is the sequence; the local dim then holds ``B * S_local`` rows. Written ``S(0:1/2)``.
``P(op)`` -- :class:`Partial`
    every rank holds a partial result; the value is their ``op`` (sum or max) over ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

from .runtime.layouts import SequenceLayout
from .runtime.symbolic import size_key

__all__ = ["Placement", "Replicate", "Shard", "Partial", "REPLICATE"]


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole value."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a partial value; the true value is the reduction ``op`` over ranks."""

    op: str = "sum"
    """``"sum"`` or ``"max"``."""

    def __str__(self) -> str:
        return f"P({self.op})"


@dataclass(frozen=True)
class Shard:
    """Split along the sequence on tensor dim ``dim``."""

    dim: int
    """The tensor dim that holds the sequence (or a merge that contains it)."""
    layout: SequenceLayout
    """Which positions of the sequence factor each rank holds."""
    factors: tuple[int, ...] = ()
    """Global sizes of the factors merged into ``dim``, outer to inner; empty when ``dim`` is the sequence alone."""
    factor: int = 0
    """Index of the sequence factor in ``factors``."""

    def __hash__(self) -> int:  # symbolic factors (a graph compiled for every length) hash by their expressions
        return hash((self.dim, self.layout, size_key(self.factors), self.factor))

    def local_size(self, rank: int) -> int:
        """Size of ``dim`` on ``rank``."""
        n = self.layout.local_length(rank)
        for i, f in enumerate(self.factors):
            if i != self.factor:
                n *= f
        return n

    def local_shape(self, shape, rank: int) -> list[int]:
        """The local shape on ``rank`` of a value whose global shape is ``shape``."""
        out = list(shape)
        out[self.dim] = self.local_size(rank)
        return out

    def stores_like(self, other: "Placement") -> bool:
        """Whether a value split as ``self`` holds, on every rank, the elements it would hold split as ``other``, in
        the same order: the same dim and layout, and the same sizes merged before and after the sequence (the merge
        may be factored differently: ``[B, S, H]`` and ``[B, S, Hk, r]`` with ``H = Hk r``)."""
        return (isinstance(other, Shard) and self.dim == other.dim and self.layout == other.layout
                and size_key(self._merged_around()) == size_key(other._merged_around()))

    def _merged_around(self) -> tuple:
        """(the product of the factors merged before the sequence, the product of those after): (1, 1) unmerged."""
        if not self.factors:
            return 1, 1
        return math.prod(self.factors[:self.factor]), math.prod(self.factors[self.factor + 1:])

    def moved(self, dim: int) -> "Shard":
        """The same sharding on another tensor dim."""
        return Shard(dim, self.layout, self.factors, self.factor)

    def __str__(self) -> str:
        if self.factors:
            return f"S({self.dim}:{self.factor}/{len(self.factors)})"
        return f"S({self.dim})"


Placement = Union[Replicate, Shard, Partial]
REPLICATE = Replicate()
