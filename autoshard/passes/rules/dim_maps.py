"""Dim maps: what a shape op's output dims are made of, one declarative value per op.

A shape op (view, permute, expand, repeat_interleave, repeat, ...) moves elements without computing anything, so one
*dim map* says all there is to know about it (DTensor's ``_ops/_view_ops.py`` ``dim_maps`` is the model): one
entry per output dim, naming the input dims or factors it is made of. The link rule reads the edges of
:mod:`autoshard.passes.infer` off it, and the rewrite reads off it which input placement gives the output's.

Inference works on *factors* (a merged ``[B*S]`` dim has the factors ``B`` and ``S``), so the entries speak of
factors too:

=====================  ==================================================================================
``InputDim(d)``        input dim ``d``, factor for factor (permute, the dims expand and repeat keep)
``Factors(pieces)``    a run of input factors, merged (DTensor's ``Flatten``) or cut (``Split``): each piece is
                       ``(size, (input dim, input factor))``; a piece cut out of a factor is ``(size, None)``
``Repeat(d, times)``   input dim ``d`` with every element repeated: its factors, then an inner one of ``times``;
                       with ``whole=True`` the dim repeated whole (``repeat``): an outer ``times``, then its factors
``NewDim(size)``       positions no input position is (a size-1 dim, a cut factor): a split starts here
``Broadcast(size)``    every position a copy of the same input element (expand): the input is used whole
=====================  ==================================================================================

:func:`reshape_map` builds the map of any order-keeping reshape (view, flatten, unflatten, squeeze, unsqueeze)
from the input's factors and the output shape, as DTensor's ``view_groups`` does from the two shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ..ops import as_size

__all__ = ["InputDim", "Factors", "Repeat", "NewDim", "Broadcast", "DimSpec", "DimMap", "Piece", "pieces",
           "output_factors", "source_of", "reshape_map"]

Piece = tuple[int, Union[tuple[int, int], None]]
"""``(size, (input dim, input factor))`` of one factor of an output dim; the source is None when no input factor
is these positions."""


@dataclass(frozen=True)
class InputDim:
    """The output dim is input dim ``dim``, factor for factor."""

    dim: int


@dataclass(frozen=True)
class Factors:
    """The output dim is a run of input factors, merged or cut."""

    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class Repeat:
    """Input dim ``dim`` with every element repeated ``times`` times (``repeat_interleave``), or with the whole dim
    repeated ``times`` times (``whole``: ``repeat``, copy after copy)."""

    dim: int
    times: int
    whole: bool = False


@dataclass(frozen=True)
class NewDim:
    """Positions that are no input positions."""

    size: int


@dataclass(frozen=True)
class Broadcast:
    """Positions that are all copies of one input element."""

    size: int


DimSpec = Union[InputDim, Factors, Repeat, NewDim, Broadcast]
DimMap = tuple[DimSpec, ...]
"""One :data:`DimSpec` per output dim."""


def pieces(spec: DimSpec, in_factors: list[list[int]]) -> list[Piece]:
    """The factors of the output dim ``spec`` describes, each with the input factor it is."""
    if isinstance(spec, InputDim):
        return [(size, (spec.dim, f)) for f, size in enumerate(in_factors[spec.dim])]
    if isinstance(spec, Factors):
        return list(spec.pieces)
    if isinstance(spec, Repeat):
        kept = pieces(InputDim(spec.dim), in_factors)
        if spec.times == 1:
            return kept
        return [(spec.times, None)] + kept if spec.whole else kept + [(spec.times, None)]
    return [(spec.size, None)]


def output_factors(dim_map: DimMap, in_factors: list[list[int]]) -> list[list[int]]:
    """The factorization of the output."""
    return [[size for size, _ in pieces(spec, in_factors)] for spec in dim_map]


def source_of(dim_map: DimMap, in_factors: list[list[int]], dim: int, factor: int) -> tuple[int, int] | None:
    """The input ``(dim, factor)`` that factor ``factor`` of output dim ``dim`` is, or None."""
    found = pieces(dim_map[dim], in_factors)
    return found[factor][1] if factor < len(found) else None


def reshape_map(in_factors: list[list[int]], out_shape) -> DimMap:
    """The dim map of a reshape: the input's factors (size-1 ones left out) are matched in order against the output
    dims, each output dim taking a run of whole factors, or a piece cut out of one (a cut starts new, unfollowed
    factors). A shape the factors cannot be matched to is all new dims."""
    atoms = [(size, (d, f)) for d, fs in enumerate(in_factors) for f, size in enumerate(fs) if size != 1]
    unmatched = tuple(NewDim(as_size(s)) for s in out_shape)
    dim_map: list[DimSpec] = []
    i, carry = 0, None
    for s in out_shape:
        if s == 1:
            dim_map.append(NewDim(1))
            continue
        group, prod = [], 1
        while prod < s:
            if carry is not None:
                atom, carry = carry, None
            elif i < len(atoms):
                atom, i = atoms[i], i + 1
            else:
                return unmatched
            size = atom[0]
            if s % (prod * size) == 0:
                group.append(atom)
                prod *= size
            else:  # cut the factor: the part that completes this dim, the rest carried to the next
                need = s // prod
                if need <= 1 or size % need:
                    return unmatched
                group.append((need, None))
                carry = (size // need, None)
                prod *= need
        if prod != s:
            return unmatched
        dim_map.append(Factors(tuple(group)))
    return tuple(dim_map)
