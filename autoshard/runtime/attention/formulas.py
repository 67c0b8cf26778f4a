"""Bytes each rank sends in one distributed attention call, as sympy expressions (for the planner).

    from autoshard.runtime.attention.formulas import bytes_sent, values
    expr = bytes_sent("zigzag", "backward")                 # a sympy expression
    int(expr.subs(values(B=1, S=1 << 20, H=32, Hkv=8, D=128, P=64, dtype=torch.bfloat16)))

Symbols (:data:`B`, :data:`S`, ...): batch ``B``, global sequence length ``S``, query heads ``H``, kv heads
``Hkv``, head dim ``D``, ranks ``P`` (for ``hybrid`` ``P = P_r * P_u``: ring axis ``P_r``, Ulysses axis ``P_u``),
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
built-in layouts), hold on every rank.
"""

from __future__ import annotations

import sympy
import torch

__all__ = ["B", "S", "H", "Hkv", "D", "P", "P_r", "P_u", "e", "a", "M", "SYMBOLS", "STRATEGY_FORMULAS", "bytes_sent",
           "ring_bytes", "allgather_bytes", "ulysses_bytes", "hybrid_bytes", "mask_bytes_per_token", "values"]

B, S, H, Hkv, D, P, P_r, P_u, e, a, M = sympy.symbols("B S H Hkv D P P_r P_u e a M", positive=True, integer=True)
SYMBOLS = {symbol.name: symbol for symbol in (B, S, H, Hkv, D, P, P_r, P_u, e, a, M)}
"""Every symbol by name."""


def _ring(ranks, tokens, kv_heads, backward: bool) -> sympy.Expr:
    """A ring of ``ranks`` blocks of ``tokens`` tokens: every rank forwards ``ranks - 1`` K/V blocks (with their
    masks); the backward forwards them again plus ``ranks - 1`` dK/dV accumulators."""
    per_token = 2 * kv_heads * D * e + M + (2 * kv_heads * D * a if backward else 0)
    return (ranks - 1) * tokens * B * per_token


def _ulysses(ranks, tokens, backward: bool) -> sympy.Expr:
    """An all-to-all group of ``ranks`` ranks holding ``tokens`` tokens each, ``H`` heads split over it."""
    heads_out = H - H / ranks  # heads of this rank's tokens that leave it
    q = B * tokens * heads_out * D * e  # one [B, H, tokens, D] tensor to head-split (or back)
    kv = 2 * B * tokens * (ranks - 1) * sympy.ceiling(Hkv / ranks) * D * e  # K and V, kv heads each rank needs
    lse = B * tokens * heads_out * a
    masks = (ranks - 1) * sympy.ceiling(S / P) * B * M  # all-gathered, padded to the largest shard
    if backward:  # q, out, dout and K, V, lse to head-split; dq and dK, dV back
        return 4 * q + 2 * kv + lse + masks
    return 2 * q + kv + lse + masks  # q and K, V to head-split; out and lse back


def ring_bytes(backward: bool = False) -> sympy.Expr:
    """``ring`` (and ``zigzag``): ``P - 1`` K/V blocks of ``S / P`` tokens (plus masks); backward adds as many
    dK/dV blocks."""
    return _ring(P, S / P, Hkv, backward)


def allgather_bytes(backward: bool = False) -> sympy.Expr:
    """``allgather``: all-gather of K, V (and masks), ``(P - 1)`` padded shards; the backward gathers them again
    and reduce-scatters dK, dV (``a`` bytes per element)."""
    per_token = 2 * Hkv * D * e + M + (2 * Hkv * D * a if backward else 0)
    return (P - 1) * sympy.ceiling(S / P) * B * per_token


def ulysses_bytes(backward: bool = False) -> sympy.Expr:
    """``ulysses``: all-to-alls of q, K, V to head-split and of out, lse back (masks all-gathered); the
    backward moves q, out, dout, K, V, lse to head-split and dq, dK, dV back."""
    return _ulysses(P, S / P, backward)


def hybrid_bytes(backward: bool = False) -> sympy.Expr:
    """``hybrid``: Ulysses inside groups of ``P_u`` ranks (``S / P`` tokens each, ``P = P_r * P_u``), then a ring of
    ``P_r`` blocks of ``S / P_r`` tokens with the ``ceiling(Hkv / P_u)`` kv heads a rank holds."""
    total = P_r * P_u
    return (_ulysses(P_u, S / total, backward) + _ring(P_r, S / P_r, sympy.ceiling(Hkv / P_u), backward)).subs(P, total)


STRATEGY_FORMULAS = {
    "ring": ring_bytes,
    "zigzag": ring_bytes,
    "allgather": allgather_bytes,
    "ulysses": ulysses_bytes,
    "hybrid": hybrid_bytes,
}
"""Strategy name -> ``f(backward: bool) -> sympy.Expr``."""


def bytes_sent(strategy: str, direction: str = "forward") -> sympy.Expr:
    """Bytes one rank sends in the ``"forward"`` or ``"backward"`` of one call of ``strategy``."""
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    return STRATEGY_FORMULAS[strategy](direction == "backward")


def mask_bytes_per_token(key_mask: bool = False, segment_ids_dtype: torch.dtype | None = None) -> int:
    """``M``: bytes per token of the per-token masks that travel with K/V."""
    seg = 0 if segment_ids_dtype is None else torch.empty((), dtype=segment_ids_dtype).element_size()
    return int(key_mask) + seg


def values(*, dtype: torch.dtype = torch.float32, key_mask: bool = False,
           segment_ids_dtype: torch.dtype | None = None, **sizes: int) -> dict:
    """A substitution dict for the formulas: ``sizes`` gives ``B``, ``S``, ``H``, ``Hkv``, ``D`` and ``P`` (or ``P_r``
    and ``P_u``); ``e``, ``a`` and ``M`` follow from ``dtype`` and the masks."""
    unknown = set(sizes) - {"B", "S", "H", "Hkv", "D", "P", "P_r", "P_u"}
    if unknown:
        raise ValueError(f"values: unknown sizes {sorted(unknown)}")
    if "P" not in sizes and "P_r" in sizes and "P_u" in sizes:
        sizes["P"] = sizes["P_r"] * sizes["P_u"]
    out = {SYMBOLS[name]: int(value) for name, value in sizes.items()}
    out[e] = torch.empty((), dtype=dtype).element_size()
    out[a] = 8 if dtype == torch.float64 else 4
    out[M] = mask_bytes_per_token(key_mask, segment_ids_dtype)
    return out
