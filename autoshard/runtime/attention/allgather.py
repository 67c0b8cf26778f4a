"""All-gather K/V attention (Llama-3 style context parallelism).

Forward: all-gather every rank's K and V (with ``key_mask`` / ``segment_ids`` gathered alongside), then
attend this rank's queries to the whole sequence in chunks: the gathered tensor is the concatenation of
every rank's shard, i.e. a list of pieces of the global sequence, and each visible (query piece, key
piece) pair is one :func:`~.local.local_attention` call at its global offsets (chunks the mask hides are
skipped). Uneven shards are fine: the all-gather pads to the largest shard and drops the padding.

Backward: all-gather K/V again (the custom op keeps only its inputs and outputs, not the gathered copy),
compute dQ locally and the dK/dV of the *whole* sequence in fp32, then reduce-scatter dK/dV back to
their owners.

Bytes sent per rank (:func:`allgather_bytes`, in the symbols of :mod:`.formulas`): forward ``(P - 1)``
padded shards of K, V and masks; backward the same plus ``(P - 1)`` padded shards of dK, dV (fp32).

Cost: the gathers are exposed (before the compute) but few; the rank holds the whole K/V.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import sympy
import torch

from ..accounting import all_gather_bytes, reduce_scatter_bytes
from ..collectives import all_gather_impl, reduce_scatter_impl
from . import ring
from .api import attention
from .base import Call, Strategy, register, zigzag_layout_when_causal
from .blocks import HeadSegment, attend, attend_backward, empty_result, pieces
from .formulas import B, D, Dv, Hkv, M, P, S, Sizes, a, e
from .local import compute_dtype, row_delta

if TYPE_CHECKING:
    from ...cost import Pricing, StrategyCost

__all__ = ["allgather_attention", "allgather_bytes"]


def _gather(k, v, key_mask, segment_ids, call: Call):
    """Every rank's K, V and key-side masks, concatenated in rank order (one all-gather each)."""
    pg, sizes = call.pg, list(call.layout.local_lengths)
    return [None if t is None else all_gather_impl(t, 2 if t.dim() == 4 else 1, sizes, pg)
            for t in (k, v, key_mask, segment_ids)]


def _forward(q, k, v, key_mask, segment_ids, call: Call):
    all_k, all_v, all_keys_mask, all_segments = _gather(k, v, key_mask, segment_ids, call)
    layout, rank = call.layout, call.pg.rank()
    out, lse = empty_result(q, v)
    attend(out, lse, q, all_k, all_v, pieces(layout, [rank]), pieces(layout, range(layout.world_size)),
           heads=HeadSegment.all(q.size(1), k.size(1)), spec=call.spec, key_mask=all_keys_mask,
           seg_q=segment_ids, seg_k=all_segments, scale=call.scale, softcap=call.softcap,
           terms=call.terms, kernels=call.kernels)
    return out, lse


def _backward(dout, q, k, v, out, lse, key_mask, segment_ids, call: Call):
    all_k, all_v, all_keys_mask, all_segments = _gather(k, v, key_mask, segment_ids, call)
    layout, rank = call.layout, call.pg.rank()
    ct = compute_dtype(q.dtype)
    dq = q.new_zeros(q.shape, dtype=ct)
    dk, dv = all_k.new_zeros(all_k.shape, dtype=ct), all_v.new_zeros(all_v.shape, dtype=ct)
    delta = row_delta(dout, out)
    attend_backward(dq, dk, dv, dout, q, all_k, all_v, out, lse, delta, pieces(layout, [rank]),
                    pieces(layout, range(layout.world_size)), heads=HeadSegment.all(q.size(1), k.size(1)),
                    spec=call.spec, key_mask=all_keys_mask, seg_q=segment_ids, seg_k=all_segments,
                    scale=call.scale, softcap=call.softcap, terms=call.terms, kernels=call.kernels)
    del all_k, all_v
    sizes = list(layout.local_lengths)
    return dq, reduce_scatter_impl(dk, 2, sizes, call.pg), reduce_scatter_impl(dv, 2, sizes, call.pg)


# ---------------------------------------------------------------------------- bytes and cost


def allgather_bytes(backward: bool = False) -> sympy.Expr:
    """``allgather``: all-gather of K, V (and masks), ``(P - 1)`` padded shards; the backward gathers them again
    and reduce-scatters dK, dV (``a`` bytes per element)."""
    per_token = Hkv * (D + Dv) * e + M + (Hkv * (D + Dv) * a if backward else 0)
    return (P - 1) * sympy.ceiling(S / P) * B * per_token


def _bytes_by_rank(lengths: list[int], n: Sizes, backward: bool, P_u: int | None = None) -> list[int]:
    """Every rank alike: K, V and masks all-gathered (padded to the largest shard); backward again, plus dK, dV
    reduce-scattered in the compute dtype."""
    world, longest = len(lengths), max(lengths)
    sent = sum(all_gather_bytes(n.B * n.Hkv * longest * dim * n.e, world) for dim in (n.D, n.Dv))
    sent += all_gather_bytes(n.B * longest * n.M, world)
    if backward:
        sent += sum(reduce_scatter_bytes(n.B * n.Hkv * longest * dim * n.a, world) for dim in (n.D, n.Dv))
    return [sent] * world


def _cost(p: Pricing) -> StrategyCost:
    s, world, topology = p.shape, p.world, p.topology
    sent = p.sent({"P": world})
    gathered = s.batch * s.seq * s.kv_heads * s.kv_dims * p.item
    comm = sum(sent) / topology.bandwidth(world)
    latency = 4 * topology.latency(world) * max(1, math.ceil(math.log2(max(world, 2))))
    return p.cost(compute=p.balanced, comm=comm, exposed=comm, latency=latency, sent=sent,
                  memory=p.inputs_bytes + gathered)


register(Strategy(name="allgather", check=ring.RING.check, forward=_forward, backward=_backward,
                  bytes_sent=allgather_bytes, bytes_by_rank=_bytes_by_rank, cost=_cost,
                  preferred_layout=zigzag_layout_when_causal, rank=3, reason="gathering K/V once is cheapest here"))


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
    """:func:`~autoshard.runtime.attention.attention` with ``strategy="allgather"`` (same keywords)."""
    return attention(q, k, v, strategy="allgather", **options)
