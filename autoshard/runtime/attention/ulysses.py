"""Ulysses attention (DeepSpeed-Ulysses): all-to-all from sequence-split to head-split and back.

Forward: an all-to-all turns every rank's ``[B, H, S_local, D]`` shard into ``[B, h_r, S, D]``: all
positions of the rank's share of the heads. Attention over the whole sequence is then local (the
gathered tensor is every rank's shard in rank order, i.e. pieces of the global sequence, computed
piece by piece at global offsets like every other strategy); an all-to-all brings the output (and the
LSE) back to sequence-split. Per-token masks (``key_mask``, ``segment_ids``) are all-gathered.

Heads. Query heads are split as evenly as the group allows (``H`` need not be divisible by ``P``; sizes
differ by at most one). A rank receives exactly the kv heads its query heads read: a contiguous range
``[first // G, last // G]`` with ``G = H // Hkv``. When ``Hkv`` is smaller than ``P`` (or a group is cut by
the split) a kv head goes to every rank that needs it and to no other -- the least duplication the
split allows -- and the backward sums the duplicated dK/dV on the kv head's owner. A rank whose heads
span GQA groups unevenly computes them as up to three uniform head segments
(:class:`~.blocks.HeadSegment`). The only constraint is ``H >= P`` (every rank needs a head).

Backward: the custom op keeps only its inputs and outputs, so the backward moves ``q``, ``out``, ``dout``,
``k``, ``v`` and the LSE to head-split again, runs the local backward, and moves dQ, dK, dV back (in the
input dtype; duplicated kv heads are summed in fp32 after arrival). Tensors move one per all-to-all,
which keeps the transient copies an all-to-all makes small.

:func:`ulysses_forward` / :func:`ulysses_backward` take an optional ring group: with it, the attention
in head space is the ring of :mod:`.ring` across Ulysses groups -- the hybrid strategy. So do the byte
counts: :func:`ulysses_terms` and :func:`ulysses_ring_bytes` serve both.

Cost: the all-to-alls are exposed (before and after the compute); the uneven head split sets the compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch
import torch.distributed as dist

from ..accounting import all_gather_bytes
from ..collectives import all_gather_impl, all_to_all_impl
from ..layouts import SequenceLayout, split_sizes
from . import ring
from .api import attention
from .base import AttentionShape, Pricing, Strategy, StrategyCost, register
from .blocks import HeadSegment, pieces
from .call import AttentionInputError, Call, Scoring
from .formulas import B, D, Dv, H, Hkv, M, P, S, Sizes, a, e
from .local import compute_dtype

__all__ = ["ulysses_attention", "HeadShare", "head_plan", "group_members", "ulysses_forward", "ulysses_backward",
           "ulysses_terms", "ulysses_bytes", "ulysses_ring_bytes", "ulysses_working_set"]


@dataclass(frozen=True)
class HeadShare:
    """The heads one rank of a Ulysses group computes."""

    q: tuple[int, int]
    """Query heads ``[lo, hi)``."""
    kv: tuple[int, int]
    """The kv heads ``[lo, hi)`` those query heads read."""

    def segments(self, group_size: int) -> tuple[HeadSegment, ...]:
        """Uniform GQA segments of the local heads (local indices): a partial group at either end, whole
        groups in between."""
        q_lo, q_hi = self.q
        out: list[HeadSegment] = []
        for g in range(*self.kv):
            a, b = max(q_lo, g * group_size), min(q_hi, (g + 1) * group_size)
            seg = HeadSegment(a - q_lo, b - q_lo, g - self.kv[0], g - self.kv[0] + 1)
            prev = out[-1] if out else None
            if prev and b - a == group_size and prev.q_hi - prev.q_lo == group_size * (prev.kv_hi - prev.kv_lo):
                out[-1] = HeadSegment(prev.q_lo, seg.q_hi, prev.kv_lo, seg.kv_hi)
            else:
                out.append(seg)
        return tuple(out)


def head_plan(heads: int, kv_heads: int, world: int) -> tuple[HeadShare, ...]:
    """How a Ulysses group of ``world`` ranks splits ``heads`` query heads reading ``kv_heads`` kv heads."""
    group = heads // kv_heads
    bounds = [0]
    for n in split_sizes(heads, world):
        bounds.append(bounds[-1] + n)
    return tuple(HeadShare((lo, hi), (lo // group, (hi - 1) // group + 1)) for lo, hi in zip(bounds, bounds[1:]))


def group_members(ring_world: int, world: int) -> list[list[int]]:
    """The sequence ranks of every Ulysses group of ``world`` ranks: group ``i`` (ring rank ``i`` of ``ring_world``)
    holds sequence ranks ``i * world + j``, its member ``j`` first to last."""
    return [[i * world + j for j in range(world)] for i in range(ring_world)]


def check_heads(heads: int, world: int, what: str) -> None:
    """Raise when ``world`` ranks cannot split ``heads`` query heads."""
    if heads < world:
        raise AttentionInputError(
            f"autoshard.attention: {what} splits the {heads} query heads over {world} ranks and needs at least "
            f"one head per rank (H >= P); use strategy 'ring' or 'zigzag', or 'hybrid' with a Ulysses axis of at "
            f"most {heads} ranks")


# ---------------------------------------------------------------------------- moving between splits


def _move(x: torch.Tensor, to_heads: bool, head_sizes, lengths, pg) -> torch.Tensor:
    """All-to-all of a [B, heads, S(, D)] tensor from sequence-split to head-split (or back)."""
    if to_heads:
        return all_to_all_impl(x, 1, 2, list(head_sizes), list(lengths), pg)
    return all_to_all_impl(x, 2, 1, list(lengths), list(head_sizes), pg)


@dataclass(frozen=True)
class _Plan:
    """Everything one rank needs to move its tensors for a Ulysses group."""

    pg: dist.ProcessGroup
    shares: tuple[HeadShare, ...]
    lengths: tuple[int, ...]
    """Sequence length of every rank of the Ulysses group."""
    kv_index: torch.Tensor | None
    """The kv heads sent, destination by destination (None: each kv head goes to exactly one rank)."""
    block_pieces: tuple[tuple, ...]
    """The pieces of the gathered sequence of every ring rank (one entry without a ring)."""

    @property
    def share(self) -> HeadShare:
        return self.shares[self.pg.rank()]

    @property
    def q_sizes(self) -> list[int]:
        return [s.q[1] - s.q[0] for s in self.shares]

    @property
    def kv_sizes(self) -> list[int]:
        return [s.kv[1] - s.kv[0] for s in self.shares]


def _plan(heads: int, kv_heads: int, pg, ring_pg, layout: SequenceLayout) -> _Plan:
    world = pg.size()
    ring_world, ring_rank = (1, 0) if ring_pg is None else (ring_pg.size(), ring_pg.rank())
    members = group_members(ring_world, world)
    shares = head_plan(heads, kv_heads, world)
    index = [h for s in shares for h in range(*s.kv)]
    kv_index = None if index == list(range(kv_heads)) else torch.tensor(index)
    return _Plan(pg, shares, tuple(layout.local_length(r) for r in members[ring_rank]), kv_index,
                 tuple(pieces(layout, m) for m in members))


def _kv_to_heads(x: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """K or V to head-split: every rank receives the kv heads its query heads read."""
    if plan.kv_index is not None:
        x = x.index_select(1, plan.kv_index.to(x.device))
    return _move(x, True, plan.kv_sizes, plan.lengths, plan.pg)


def _kv_to_sequence(x: torch.Tensor, plan: _Plan, like: torch.Tensor) -> torch.Tensor:
    """dK or dV back to sequence-split in ``like``'s dtype, the copies of duplicated kv heads summed in fp32."""
    x = _move(x.to(like.dtype), False, plan.kv_sizes, plan.lengths, plan.pg)
    if plan.kv_index is None:
        return x
    summed = x.new_zeros(like.shape, dtype=compute_dtype(like.dtype))
    return summed.index_add_(1, plan.kv_index.to(x.device), x.to(summed.dtype))


def _gather_masks(key_mask, segment_ids, plan: _Plan):
    return [None if m is None else all_gather_impl(m, 1, list(plan.lengths), plan.pg) for m in (key_mask, segment_ids)]


def ulysses_forward(q, k, v, key_mask, segment_ids, *, pg, ring_pg, layout: SequenceLayout,
                    scoring: Scoring) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of this rank's shard: all-to-all to head-split, attention over the gathered sequence
    (a ring across ``ring_pg`` when given), all-to-all back. ``out`` has ``q``'s dtype."""
    plan = _plan(q.size(1), k.size(1), pg, ring_pg, layout)
    qh = _move(q, True, plan.q_sizes, plan.lengths, pg)
    kh, vh = _kv_to_heads(k, plan), _kv_to_heads(v, plan)
    all_keys_mask, all_segments = _gather_masks(key_mask, segment_ids, plan)
    out_h, lse_h = ring.ring_forward(qh, kh, vh, all_keys_mask, all_segments, pg=ring_pg,
                                     block_pieces=plan.block_pieces, heads=plan.share.segments(q.size(1) // k.size(1)),
                                     scoring=scoring.heads(*plan.share.q))
    out = _move(out_h.to(q.dtype), False, plan.q_sizes, plan.lengths, pg)
    lse = _move(lse_h, False, plan.q_sizes, plan.lengths, pg)
    return out, lse


def ulysses_backward(dout, q, k, v, out, lse, key_mask, segment_ids, *, pg, ring_pg, layout: SequenceLayout,
                     scoring: Scoring) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`ulysses_forward` (``dq`` in ``q``'s dtype, ``dk``/``dv`` in the compute dtype)."""
    plan = _plan(q.size(1), k.size(1), pg, ring_pg, layout)
    # one tensor per all-to-all: each holds a few transient copies of its input, so moving them one by one
    # keeps the peak low
    qh, out_h, dout_h, lse_h = (_move(t, True, plan.q_sizes, plan.lengths, pg)
                                for t in (q, out.to(q.dtype), dout.to(q.dtype), lse))
    kh, vh = _kv_to_heads(k, plan), _kv_to_heads(v, plan)
    all_keys_mask, all_segments = _gather_masks(key_mask, segment_ids, plan)
    dqh, dkh, dvh = ring.ring_backward(dout_h, qh, kh, vh, out_h, lse_h, all_keys_mask, all_segments,
                                       pg=ring_pg, block_pieces=plan.block_pieces,
                                       heads=plan.share.segments(q.size(1) // k.size(1)),
                                       scoring=scoring.heads(*plan.share.q))
    del qh, out_h, dout_h, lse_h, kh, vh  # free the head-split copies before the all-to-alls back
    dq = _move(dqh.to(q.dtype), False, plan.q_sizes, plan.lengths, pg)
    return dq, _kv_to_sequence(dkh, plan, k), _kv_to_sequence(dvh, plan, v)


# ---------------------------------------------------------------------------- bytes


def ulysses_terms(ranks, tokens, backward: bool) -> sympy.Expr:
    """An all-to-all group of ``ranks`` ranks holding ``tokens`` tokens each, ``H`` heads split over it."""
    heads_out = H - H / ranks  # heads of this rank's tokens that leave it
    rows = B * tokens * heads_out * e  # per unit of head dim: one [B, H, tokens, *] tensor to head-split (or back)
    kv = B * tokens * (ranks - 1) * sympy.ceiling(Hkv / ranks) * (D + Dv) * e  # K and V, kv heads each rank needs
    lse = B * tokens * heads_out * a
    masks = (ranks - 1) * sympy.ceiling(S / P) * B * M  # all-gathered, padded to the largest shard
    if backward:  # q, out, dout and K, V, lse to head-split; dq and dK, dV back
        return rows * (2 * D + 2 * Dv) + 2 * kv + lse + masks
    return rows * (D + Dv) + kv + lse + masks  # q and K, V to head-split; out and lse back


def ulysses_bytes(backward: bool = False) -> sympy.Expr:
    """``ulysses``: all-to-alls of q, K, V to head-split and of out, lse back (masks all-gathered); the
    backward moves q, out, dout, K, V, lse to head-split and dq, dK, dV back."""
    return ulysses_terms(P, S / P, backward)


def ulysses_ring_bytes(lengths: list[int], ulysses_ranks: int, n: Sizes, backward: bool) -> list[int]:
    """Every sequence rank of Ulysses groups of ``ulysses_ranks`` ranks joined by a ring, exactly."""
    groups = group_members(len(lengths) // ulysses_ranks, ulysses_ranks)
    shares = head_plan(n.H, n.Hkv, ulysses_ranks)
    kv_heads = _head_counts(shares)[1]
    union_lengths = [sum(lengths[s] for s in group) for group in groups]  # the ring's blocks
    return [_member_bytes([lengths[s] for s in group], member, shares, n, backward)
            + ring.ring_rank_bytes(union_lengths, ring_rank, kv_heads[member], n, backward)
            for ring_rank, group in enumerate(groups) for member in range(ulysses_ranks)]


def _member_bytes(lengths: list[int], member: int, shares, n: Sizes, backward: bool) -> int:
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


def _head_counts(shares) -> tuple[list[int], list[int]]:
    """Query and kv heads of every member of a Ulysses group (:func:`head_plan`)."""
    return [s.q[1] - s.q[0] for s in shares], [s.kv[1] - s.kv[0] for s in shares]


def _bytes_by_rank(lengths: list[int], n: Sizes, backward: bool, P_u: int | None = None) -> list[int]:
    return ulysses_ring_bytes(lengths, len(lengths), n, backward)  # one group, no ring


# ---------------------------------------------------------------------------- the strategy


def _check(q, k, v, call: Call) -> int:
    rank = ring.RING.check(q, k, v, call)
    check_heads(q.size(1), call.pg.size(), "strategy 'ulysses'")
    return rank


def _forward(q, k, v, key_mask, segment_ids, call: Call):
    return ulysses_forward(q, k, v, key_mask, segment_ids, pg=call.pg, ring_pg=None, layout=call.layout,
                           scoring=call.scoring)


def _backward(dout, q, k, v, out, lse, key_mask, segment_ids, call: Call):
    return ulysses_backward(dout, q, k, v, out, lse, key_mask, segment_ids, pg=call.pg, ring_pg=None,
                            layout=call.layout, scoring=call.scoring)


def _cost(p: Pricing) -> StrategyCost:
    s, world, hardware = p.shape, p.world, p.hardware
    if s.heads < world:
        return p.impossible(f"{s.heads} heads cannot cover {world} ranks; the all-to-all splits heads")
    sent = p.sent({"P": world})
    compute = p.busiest(math.ceil(s.heads / world) / (s.heads / world))  # the rank with the most heads
    comm = sum(sent) / hardware.bandwidth(world)
    return p.cost(compute=compute, comm=comm, exposed=comm, latency=10 * hardware.latency(world), sent=sent,
                  memory=p.memory)


def ulysses_working_set(shape: AttentionShape, world: int, head_chunks: int, backward: bool) -> int:
    """The head-split copies of one head group over the whole sequence: q, K, V and the float32 out, LSE (and out
    cast back before its all-to-all); backward q, out, dout, K, V, LSE and the float32 dQ, dK, dV. ``world``: the
    ranks the heads are split over (a hybrid's Ulysses axis holds as many bytes: a ring's share of the sequence,
    a Ulysses axis's share of the heads)."""
    e, c = shape.dtype.itemsize, compute_dtype(shape.dtype).itemsize
    heads = -(-shape.heads // (head_chunks * world))
    kv_heads = -(-shape.kv_heads // (head_chunks * world))  # at least one: a kv head goes to every rank reading it
    rows = shape.batch * shape.seq
    kv = rows * kv_heads * shape.kv_dims
    if backward:
        return rows * heads * ((shape.head_dim + 2 * shape.dv) * e + c) + kv * e + \
            (rows * heads * shape.head_dim + kv) * c
    return rows * heads * (shape.head_dim * e + (shape.dv + 1) * c + shape.dv * e) + kv * e


register(Strategy(name="ulysses", check=_check, forward=_forward, backward=_backward, bytes_sent=ulysses_bytes,
                  bytes_by_rank=_bytes_by_rank, cost=_cost, working_set=ulysses_working_set, splits_heads=True, rank=2,
                  reason="the heads split evenly enough and the all-to-alls are cheap at this bandwidth"))


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
    """:func:`~autoshard.runtime.attention.attention` with ``strategy="ulysses"`` (same keywords)."""
    return attention(q, k, v, strategy="ulysses", **options)
