"""Ring attention: K/V blocks travel around a ring of P ranks while each rank attends its queries to them.

Forward, on rank ``r`` at step ``t = 0 .. P-1``: the rank holds the K/V block (with its ``key_mask`` and
``segment_ids``, when given) of rank ``r - t``. It first *posts* the transfer of that block to ``r + 1``
(and the receipt of the next one from ``r - 1``), then attends its queries to the block it holds, then
waits: the transfer of block ``t + 1`` overlaps the compute of block ``t``. Blocks are the layout's
intervals at their global offsets, so any layout works, and (query piece, key piece) pairs the mask
hides are never computed -- the ring still forwards the data. Partial results merge through the LSE
(:mod:`.merge`).

Backward (the standard ring-flash-attention backward): with the final ``out``/``lse`` and
``delta = rowsum(dout * out)``, each rank computes its queries' contribution to every K/V block as the
blocks travel again, and the dK/dV accumulator of a block follows it one step behind: it starts on the
rank after the block's owner, collects every rank's contribution and reaches the owner after ``P - 1``
hops, where the owner adds its own (computed at step 0). Accumulators travel in fp32 (fp64 for fp64).

Bytes sent per rank (:func:`ring_bytes`, in the symbols of :mod:`.formulas`): forward ``P - 1`` blocks of
K, V (and masks); backward ``P - 1`` blocks of K, V (and masks) plus ``P - 1`` blocks of dK, dV.

Cost: the blocks' traffic overlaps their compute (:meth:`.base.Pricing.ring`); on the contiguous
layout a causal mask leaves the last rank the most work.

The ring core (:func:`ring_forward`, :func:`ring_backward`) takes the pieces every ring rank holds and a
head plan, so the zigzag strategy (this ring over the zigzag layout) and the hybrid strategy (this ring
across Ulysses groups) reuse it unchanged.
"""

from __future__ import annotations

from typing import Sequence

import sympy
import torch
import torch.distributed as dist

from ..collectives import RingCommunicator
from .api import attention
from .base import AttentionShape, Pricing, Strategy, StrategyCost, register
from .blocks import HeadSegment, Piece, attend, attend_backward, empty_result, pieces
from .call import AttentionInputError, Call, Scoring
from .formulas import B, D, Dv, Hkv, M, P, S, Sizes, a, e
from .local import compute_dtype, row_delta

__all__ = ["ring_working_set", "ring_attention", "ring_forward", "ring_backward", "block_source", "ring_terms",
           "ring_bytes", "ring_rank_bytes", "RING"]


def _block(k, v, key_mask, segment_ids) -> list[torch.Tensor]:
    """What travels with a K/V block: K, V, and the key-side masks that are given."""
    return [t for t in (k, v, key_mask, segment_ids) if t is not None]


def _unpack(block: list[torch.Tensor], key_mask, segment_ids):
    k, v, *rest = block
    km = rest.pop(0) if key_mask is not None else None
    seg = rest.pop(0) if segment_ids is not None else None
    return k, v, km, seg


def _like(tensors: Sequence[torch.Tensor], length: int) -> list[tuple[list[int], torch.Tensor]]:
    """Receive buffers shaped like ``tensors`` with ``length`` positions (dim 2 of [B, H, S, D], dim 1 of [B, S])."""
    out = []
    for t in tensors:
        shape = list(t.shape)
        shape[2 if t.dim() == 4 else 1] = length
        out.append((shape, t))
    return out


def _length(block_pieces: Sequence[Piece]) -> int:
    return sum(p.length for p in block_pieces)


def block_source(rank: int, step: int, world: int) -> int:
    """The ring rank whose K/V block ``rank`` holds at ``step`` (blocks move one rank forward per step)."""
    return (rank - step) % world


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                 segment_ids: torch.Tensor | None, *, pg: dist.ProcessGroup | None,
                 block_pieces: Sequence[Sequence[Piece]], heads: Sequence[HeadSegment],
                 scoring: Scoring) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of this rank's queries over every ring rank's K/V (compute dtype).

    ``pg``: the ring (``None``: a ring of one, no communication); ``block_pieces[i]``: the pieces ring rank
    ``i`` holds (its queries and its K/V block alike).
    """
    world, rank = (1, 0) if pg is None else (pg.size(), pg.rank())
    out, lse = empty_result(q, v)
    block = _block(k, v, key_mask, segment_ids)
    comm = RingCommunicator(pg) if world > 1 else None
    for step in range(world):
        source = block_source(rank, step, world)
        if step < world - 1:
            comm.start(block, _like(block, _length(block_pieces[block_source(rank, step + 1, world)])))
        kb, vb, kmb, segb = _unpack(block, key_mask, segment_ids)
        attend(out, lse, q, kb, vb, block_pieces[rank], block_pieces[source], heads=heads, key_mask=kmb,
               seg_q=segment_ids, seg_k=segb, scoring=scoring)
        if step < world - 1:
            block = comm.wait()
    return out, lse


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, key_mask: torch.Tensor | None, segment_ids: torch.Tensor | None, *,
                  pg: dist.ProcessGroup | None, block_pieces: Sequence[Sequence[Piece]],
                  heads: Sequence[HeadSegment], scoring: Scoring) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` (compute dtype) of :func:`ring_forward`, given its final ``out`` and ``lse``."""
    world, rank = (1, 0) if pg is None else (pg.size(), pg.rank())
    ct = compute_dtype(q.dtype)
    delta = row_delta(dout, out)
    dq = q.new_zeros(q.shape, dtype=ct)
    block = _block(k, v, key_mask, segment_ids)
    kv_comm = RingCommunicator(pg) if world > 1 else None
    grad_comm = RingCommunicator(pg) if world > 1 else None
    own = None
    for step in range(world):
        source = block_source(rank, step, world)
        upcoming = _length(block_pieces[block_source(rank, step + 1, world)])
        if step < world - 1:
            kv_comm.start(block, _like(block, upcoming))
        kb, vb, kmb, segb = _unpack(block, key_mask, segment_ids)
        dk, dv = kb.new_zeros(kb.shape, dtype=ct), vb.new_zeros(vb.shape, dtype=ct)
        attend_backward(dq, dk, dv, dout, q, kb, vb, out, lse, delta, block_pieces[rank], block_pieces[source],
                        heads=heads, key_mask=kmb, seg_q=segment_ids, seg_k=segb, scoring=scoring)
        if step == 0:
            own = dk, dv
        else:
            if step > 1:  # the accumulator of this block, from the previous rank
                acc_k, acc_v = grad_comm.wait()
                dk += acc_k
                dv += acc_v
            grad_comm.start([dk, dv], _like([dk, dv], upcoming))
        if step < world - 1:
            block = kv_comm.wait()
    dk, dv = own
    if world > 1:  # every other rank's contribution to this rank's block
        acc_k, acc_v = grad_comm.wait()
        dk += acc_k
        dv += acc_v
    return dq, dk, dv


# ---------------------------------------------------------------------------- bytes


def ring_terms(ranks, tokens, kv_heads, backward: bool) -> sympy.Expr:
    """A ring of ``ranks`` blocks of ``tokens`` tokens: every rank forwards ``ranks - 1`` K/V blocks (with their
    masks); the backward forwards them again plus ``ranks - 1`` dK/dV accumulators."""
    per_token = kv_heads * (D + Dv) * e + M + (kv_heads * (D + Dv) * a if backward else 0)
    return (ranks - 1) * tokens * B * per_token


def ring_bytes(backward: bool = False) -> sympy.Expr:
    """``ring`` (and ``zigzag``): ``P - 1`` K/V blocks of ``S / P`` tokens (plus masks); backward adds as many
    dK/dV blocks."""
    return ring_terms(P, S / P, Hkv, backward)


def ring_rank_bytes(block_lengths: list[int], rank: int, kv_heads: int, n: Sizes, backward: bool) -> int:
    """One rank of a ring over blocks of ``block_lengths`` tokens: it forwards the K/V block (and masks) it holds
    at every step but the last; backward again, plus the dK/dV accumulator (compute dtype) of the block it holds
    at every step but the first."""
    world = len(block_lengths)
    forwarded = sum(block_lengths[block_source(rank, step, world)] for step in range(world - 1))
    sent = forwarded * n.B * (kv_heads * (n.D + n.Dv) * n.e + n.M)
    if backward:
        accumulated = sum(block_lengths[block_source(rank, step, world)] for step in range(1, world))
        sent += accumulated * n.B * kv_heads * (n.D + n.Dv) * n.a
    return sent


def _bytes_by_rank(lengths: list[int], n: Sizes, backward: bool, P_u: int | None = None) -> list[int]:
    return [ring_rank_bytes(lengths, rank, n.Hkv, n, backward) for rank in range(len(lengths))]


# ---------------------------------------------------------------------------- the strategy


def _check(q, k, v, call: Call) -> int:
    pg = call.pg
    if call.layout.world_size != pg.size():
        raise AttentionInputError(
            f"autoshard.attention: the layout places the sequence on {call.layout.world_size} ranks but the "
            f"group has {pg.size()}; build the layout for {pg.size()} ranks")
    return pg.rank()


def _shards(call: Call) -> list[tuple[Piece, ...]]:
    return [pieces(call.layout, [r]) for r in range(call.layout.world_size)]


def _forward(q, k, v, key_mask, segment_ids, call: Call):
    return ring_forward(q, k, v, key_mask, segment_ids, pg=call.pg, block_pieces=_shards(call),
                        heads=HeadSegment.all(q.size(1), k.size(1)), scoring=call.scoring)


def _backward(dout, q, k, v, out, lse, key_mask, segment_ids, call: Call):
    return ring_backward(dout, q, k, v, out, lse, key_mask, segment_ids, pg=call.pg, block_pieces=_shards(call),
                         heads=HeadSegment.all(q.size(1), k.size(1)), scoring=call.scoring)


def _cost(p: Pricing) -> StrategyCost:
    return p.ring(p.contiguous)


def ring_working_set(shape: AttentionShape, world: int, head_chunks: int, backward: bool) -> int:
    """Two K/V blocks (the one computed, the one arriving) and the float32 accumulators of this rank's queries
    (out and LSE; backward: dQ, and the dK/dV blocks travelling with their K/V), one head group at a time."""
    s, e, c = -(-shape.seq // world), shape.dtype.itemsize, compute_dtype(shape.dtype).itemsize
    heads, kv_heads = -(-shape.heads // head_chunks), -(-shape.kv_heads // head_chunks)
    blocks = 2 * shape.batch * s * kv_heads * shape.kv_dims
    if backward:
        return blocks * (e + c) + shape.batch * s * heads * shape.head_dim * c
    return blocks * e + shape.batch * s * heads * (shape.dv + 1) * c


RING = register(Strategy(name="ring", check=_check, forward=_forward, backward=_backward, bytes_sent=ring_bytes,
                         bytes_by_rank=_bytes_by_rank, cost=_cost, working_set=ring_working_set, rank=0,
                         reason="a ring hides its traffic behind computation"))
"""The ring over any layout (the zigzag ring derives from it)."""


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
    """:func:`~autoshard.runtime.attention.attention` with ``strategy="ring"`` (same keywords)."""
    return attention(q, k, v, strategy="ring", **options)
