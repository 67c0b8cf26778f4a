"""Bytes each rank sends in one distributed attention call, as sympy expressions (for the planner).

    from autoshard.runtime.attention.base import bytes_sent
    from autoshard.runtime.attention.formulas import values
    expr = bytes_sent("zigzag", "backward")                 # a sympy expression
    int(expr.subs(values(B=1, S=1 << 20, H=32, Hkv=8, D=128, P=64, dtype=torch.bfloat16)))

Symbols (:data:`B`, :data:`S`, ...): batch ``B``, global sequence length ``S``, query heads ``H``, kv heads
``Hkv``, query/key head dim ``D``, value head dim ``Dv`` (``D`` unless given: multi-head latent attention has
another), ranks ``P`` (for ``hybrid`` ``P = P_r * P_u``: ring axis ``P_r``, Ulysses axis ``P_u``),
bytes per element of the inputs ``e``, bytes per element of accumulated gradients and of the LSE ``a``
(4; 8 for float64 inputs), and ``M``, the extra bytes per token of the per-token masks that travel
(1 for a bool ``key_mask`` plus the element size of ``segment_ids``; 0 without them).

They follow the accountant's convention (:mod:`autoshard.runtime.accounting`): bytes *sent* by one
rank, point-to-point and all-to-all counting only what leaves the rank, all-gathers and
reduce-scatters ``(P - 1)`` padded shards. The accountant kind ``"metadata"`` (the public function's
one-off agreement check) is not part of them.

Exactness: every rank sends exactly these bytes when the layout splits the sequence evenly (``P``
divides ``S``; ``2P`` for zigzag), ``P`` divides ``H`` (``P_u`` for hybrid) and the kv heads split without
remainder (``P`` divides ``Hkv`` or ``Hkv`` divides ``P``, where a kv head goes to ``P / Hkv`` ranks). With
uneven shards (no padding anywhere but inside all-gathers) the terms in ``S / P`` hold for the **mean
over ranks** and the all-gather terms, written with ``ceiling(S / P)`` (the largest shard of the
built-in layouts), hold on every rank -- except ``hybrid``'s mask all-gather, which a Ulysses group pads to
its own largest shard, at most ``ceiling(S / P)``.

:func:`.base.bytes_sent_by_rank` gives the exact bytes of every rank for any shard lengths and head split, in
integers, from the sizes the strategies themselves use (the Ulysses head plan and groups, the ring's
block schedule, the accountant's all-gather convention); where the formulas are exact the two agree.

This module holds what the formulas share (symbols, substitutions, sizes); each strategy's own formulas
live in its module and are registered with it (:attr:`.base.Strategy.bytes_sent`,
:attr:`.base.Strategy.bytes_by_rank`), which :func:`.base.bytes_sent` and :func:`.base.bytes_sent_by_rank` look up.

    from autoshard.runtime.attention.base import bytes_sent_by_rank
    bytes_sent_by_rank("ring", "backward", SequenceLayout.contiguous(17, 4).local_lengths,
                       B=1, H=32, Hkv=8, D=128, dtype=torch.bfloat16)   # [sent by rank 0, 1, 2, 3]
"""

from __future__ import annotations

from typing import NamedTuple

import sympy
import torch

from .local import compute_dtype

__all__ = ["B", "S", "H", "Hkv", "D", "Dv", "P", "P_r", "P_u", "e", "a", "M", "SYMBOLS", "Sizes", "mask_bytes_per_token",
           "values"]

B, S, H, Hkv, D, Dv, P, P_r, P_u, e, a, M = sympy.symbols("B S H Hkv D Dv P P_r P_u e a M", positive=True,
                                                           integer=True)
SYMBOLS = {symbol.name: symbol for symbol in (B, S, H, Hkv, D, Dv, P, P_r, P_u, e, a, M)}
"""Every symbol by name."""


def mask_bytes_per_token(key_mask: bool = False, segment_ids_dtype: torch.dtype | None = None) -> int:
    """``M``: bytes per token of the per-token masks that travel with K/V."""
    seg = 0 if segment_ids_dtype is None else torch.empty((), dtype=segment_ids_dtype).element_size()
    return int(key_mask) + seg


def values(*, dtype: torch.dtype = torch.float32, key_mask: bool = False,
           segment_ids_dtype: torch.dtype | None = None, **sizes: int) -> dict:
    """A substitution dict for the formulas: ``sizes`` gives ``B``, ``S``, ``H``, ``Hkv``, ``D`` (``Dv``, when it is not
    ``D``) and ``P`` (or ``P_r`` and ``P_u``); ``e``, ``a`` and ``M`` follow from ``dtype`` and the masks."""
    unknown = set(sizes) - {"B", "S", "H", "Hkv", "D", "Dv", "P", "P_r", "P_u"}
    if unknown:
        raise ValueError(f"values: unknown sizes {sorted(unknown)}")
    if "P" not in sizes and "P_r" in sizes and "P_u" in sizes:
        sizes["P"] = sizes["P_r"] * sizes["P_u"]
    if "D" in sizes and not sizes.get("Dv"):
        sizes["Dv"] = sizes["D"]
    out = {SYMBOLS[name]: int(value) for name, value in sizes.items()}
    out[e], out[a] = _element_sizes(dtype)
    out[M] = mask_bytes_per_token(key_mask, segment_ids_dtype)
    return out


def _element_sizes(dtype: torch.dtype) -> tuple[int, int]:
    """``(e, a)``: bytes per element of the inputs and of the compute dtype (accumulators, LSE)."""
    return torch.empty((), dtype=dtype).element_size(), torch.empty((), dtype=compute_dtype(dtype)).element_size()


# ---------------------------------------------------------------------------- exact bytes of every rank


class Sizes(NamedTuple):
    """The sizes of one attention call: shapes, element sizes (``e`` inputs, ``a`` compute) and mask bytes per token."""

    B: int
    H: int
    Hkv: int
    D: int
    Dv: int
    e: int
    a: int
    M: int

    @staticmethod
    def of(*, B: int, H: int, Hkv: int, D: int, Dv: int | None = None, dtype: torch.dtype = torch.float32,
           key_mask: bool = False, segment_ids_dtype: torch.dtype | None = None) -> "Sizes":
        """The sizes of a call of these shapes (``Dv``: default ``D``), inputs of ``dtype`` and these masks."""
        return Sizes(B, H, Hkv, D, Dv or D, *_element_sizes(dtype), mask_bytes_per_token(key_mask, segment_ids_dtype))
