"""Bytes each rank sends in one distributed attention call, as sympy expressions (for the planner).

    from autoshard.runtime.attention.formulas import bytes_sent, values
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

:func:`bytes_sent_by_rank` gives the exact bytes of every rank for any shard lengths and head split, in
integers, from the sizes the strategies themselves use (the Ulysses head plan and groups, the ring's
block schedule, the accountant's all-gather convention); where the formulas are exact the two agree.

    from autoshard.runtime.attention.formulas import bytes_sent_by_rank
    bytes_sent_by_rank("ring", "backward", SequenceLayout.contiguous(17, 4).local_lengths,
                       B=1, H=32, Hkv=8, D=128, dtype=torch.bfloat16)   # [sent by rank 0, 1, 2, 3]
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import sympy
import torch

from ..accounting import all_gather_bytes, reduce_scatter_bytes
from .local import compute_dtype
from .ring import block_source
from .ulysses import group_members, head_plan

__all__ = ["B", "S", "H", "Hkv", "D", "Dv", "P", "P_r", "P_u", "e", "a", "M", "SYMBOLS", "STRATEGY_FORMULAS", "bytes_sent",
           "ring_bytes", "allgather_bytes", "ulysses_bytes", "hybrid_bytes", "mask_bytes_per_token", "values",
           "bytes_sent_by_rank"]

B, S, H, Hkv, D, Dv, P, P_r, P_u, e, a, M = sympy.symbols("B S H Hkv D Dv P P_r P_u e a M", positive=True,
                                                           integer=True)
SYMBOLS = {symbol.name: symbol for symbol in (B, S, H, Hkv, D, Dv, P, P_r, P_u, e, a, M)}
"""Every symbol by name."""


def _ring(ranks, tokens, kv_heads, backward: bool) -> sympy.Expr:
    """A ring of ``ranks`` blocks of ``tokens`` tokens: every rank forwards ``ranks - 1`` K/V blocks (with their
    masks); the backward forwards them again plus ``ranks - 1`` dK/dV accumulators."""
    per_token = kv_heads * (D + Dv) * e + M + (kv_heads * (D + Dv) * a if backward else 0)
    return (ranks - 1) * tokens * B * per_token


def _ulysses(ranks, tokens, backward: bool) -> sympy.Expr:
    """An all-to-all group of ``ranks`` ranks holding ``tokens`` tokens each, ``H`` heads split over it."""
    heads_out = H - H / ranks  # heads of this rank's tokens that leave it
    rows = B * tokens * heads_out * e  # per unit of head dim: one [B, H, tokens, *] tensor to head-split (or back)
    kv = B * tokens * (ranks - 1) * sympy.ceiling(Hkv / ranks) * (D + Dv) * e  # K and V, kv heads each rank needs
    lse = B * tokens * heads_out * a
    masks = (ranks - 1) * sympy.ceiling(S / P) * B * M  # all-gathered, padded to the largest shard
    if backward:  # q, out, dout and K, V, lse to head-split; dq and dK, dV back
        return rows * (2 * D + 2 * Dv) + 2 * kv + lse + masks
    return rows * (D + Dv) + kv + lse + masks  # q and K, V to head-split; out and lse back


def ring_bytes(backward: bool = False) -> sympy.Expr:
    """``ring`` (and ``zigzag``): ``P - 1`` K/V blocks of ``S / P`` tokens (plus masks); backward adds as many
    dK/dV blocks."""
    return _ring(P, S / P, Hkv, backward)


def allgather_bytes(backward: bool = False) -> sympy.Expr:
    """``allgather``: all-gather of K, V (and masks), ``(P - 1)`` padded shards; the backward gathers them again
    and reduce-scatters dK, dV (``a`` bytes per element)."""
    per_token = Hkv * (D + Dv) * e + M + (Hkv * (D + Dv) * a if backward else 0)
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


class _Sizes(NamedTuple):
    """The sizes of one attention call: shapes, element sizes (``e`` inputs, ``a`` compute) and mask bytes per token."""

    B: int
    H: int
    Hkv: int
    D: int
    Dv: int
    e: int
    a: int
    M: int


def bytes_sent_by_rank(strategy: str, direction: str, lengths: Sequence[int], *, B: int, H: int, Hkv: int, D: int,
                       Dv: int | None = None, dtype: torch.dtype = torch.float32, key_mask: bool = False,
                       segment_ids_dtype: torch.dtype | None = None, P_u: int | None = None) -> list[int]:
    """Bytes every sequence rank sends in the ``"forward"`` or ``"backward"`` of one call of ``strategy``, exactly.

    ``lengths``: the shard length of every sequence rank (``layout.local_lengths``); ``Dv``: the value head dim
    (default ``D``); ``P_u``: the Ulysses axis size of ``hybrid``. The list is in sequence-rank order (the flattened
    rank of a ``(ring, ulysses)`` mesh).
    """
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    if strategy not in STRATEGY_FORMULAS:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {sorted(STRATEGY_FORMULAS)}")
    lengths = [int(n) for n in lengths]
    sizes = _Sizes(B, H, Hkv, D, Dv or D, *_element_sizes(dtype), mask_bytes_per_token(key_mask, segment_ids_dtype))
    backward = direction == "backward"
    if strategy == "allgather":
        return [_allgather_rank(lengths, sizes, backward)] * len(lengths)
    if strategy == "hybrid":
        if P_u is None or P_u < 1 or len(lengths) % P_u:
            raise ValueError(f"hybrid needs P_u, a Ulysses axis size dividing the {len(lengths)} ranks; got {P_u}")
        ulysses_ranks = P_u
    else:  # the two axes of hybrid: ring and zigzag are a ring of Ulysses groups of one, ulysses one group
        ulysses_ranks = len(lengths) if strategy == "ulysses" else 1
    return _ulysses_ring(lengths, ulysses_ranks, sizes, backward)


def _allgather_rank(lengths: list[int], n: _Sizes, backward: bool) -> int:
    """Every rank: K, V and masks all-gathered (padded to the largest shard); backward again, plus dK, dV
    reduce-scattered in the compute dtype."""
    world, longest = len(lengths), max(lengths)
    sent = sum(all_gather_bytes(n.B * n.Hkv * longest * dim * n.e, world) for dim in (n.D, n.Dv))
    sent += all_gather_bytes(n.B * longest * n.M, world)
    if backward:
        sent += sum(reduce_scatter_bytes(n.B * n.Hkv * longest * dim * n.a, world) for dim in (n.D, n.Dv))
    return sent


def _ulysses_ring(lengths: list[int], ulysses_ranks: int, n: _Sizes, backward: bool) -> list[int]:
    """Every sequence rank of Ulysses groups of ``ulysses_ranks`` ranks joined by a ring (:mod:`.ulysses`)."""
    groups = group_members(len(lengths) // ulysses_ranks, ulysses_ranks)
    shares = head_plan(n.H, n.Hkv, ulysses_ranks)
    kv_heads = _head_counts(shares)[1]
    union_lengths = [sum(lengths[s] for s in group) for group in groups]  # the ring's blocks
    return [_ulysses_rank([lengths[s] for s in group], member, shares, n, backward)
            + _ring_rank(union_lengths, ring_rank, kv_heads[member], n, backward)
            for ring_rank, group in enumerate(groups) for member in range(ulysses_ranks)]


def _ulysses_rank(lengths: list[int], member: int, shares, n: _Sizes, backward: bool) -> int:
    """One member of a Ulysses group whose members hold ``lengths`` tokens: the heads other members compute leave
    with this member's tokens (q, K, V; backward also out, dout, LSE), this member's heads of the other members'
    tokens go back to them (out, LSE; backward dq, dK, dV), and the masks are all-gathered."""
    q_heads, kv_heads = _head_counts(shares)
    own, others = lengths[member], sum(lengths) - lengths[member]
    q_out = (n.H - q_heads[member]) * own  # (head, token) rows that leave for head-split
    kv_out = (sum(kv_heads) - kv_heads[member]) * own  # a kv head goes to every member whose query heads read it
    q_back, kv_back = q_heads[member] * others, kv_heads[member] * others  # rows that go back to sequence-split
    qk, v, kv, lse = n.B * n.D * n.e, n.B * n.Dv * n.e, n.B * (n.D + n.Dv) * n.e, n.B * n.a  # bytes of one row
    masks = all_gather_bytes(n.B * max(lengths) * n.M, len(lengths))
    if backward:  # q, out, dout, LSE and K, V out; dq, dK, dV back
        return (qk + 2 * v + lse) * q_out + kv * kv_out + qk * q_back + kv * kv_back + masks
    return qk * q_out + kv * kv_out + (v + lse) * q_back + masks  # q, K, V out; out, LSE back


def _ring_rank(block_lengths: list[int], rank: int, kv_heads: int, n: _Sizes, backward: bool) -> int:
    """One rank of a ring over blocks of ``block_lengths`` tokens (:mod:`.ring`): it forwards the K/V block (and
    masks) it holds at every step but the last; backward again, plus the dK/dV accumulator (compute dtype) of the
    block it holds at every step but the first."""
    world = len(block_lengths)
    forwarded = sum(block_lengths[block_source(rank, step, world)] for step in range(world - 1))
    sent = forwarded * n.B * (kv_heads * (n.D + n.Dv) * n.e + n.M)
    if backward:
        accumulated = sum(block_lengths[block_source(rank, step, world)] for step in range(1, world))
        sent += accumulated * n.B * kv_heads * (n.D + n.Dv) * n.a
    return sent


def _head_counts(shares) -> tuple[list[int], list[int]]:
    """Query and kv heads of every member of a Ulysses group (:func:`~.ulysses.head_plan`)."""
    return [s.q[1] - s.q[0] for s in shares], [s.kv[1] - s.kv[0] for s in shares]
