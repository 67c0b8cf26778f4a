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

Packed documents (segment ids): the ranks' work then depends on where the documents fall, so the queries are
dispatched by work (:mod:`.dispatch`): chunks of the most loaded ranks' queries are computed by the least loaded,
their rows sent there and their results back by all-to-alls counted as ``"dispatch"`` (data-dependent bytes, none
when the batch is balanced as laid out); and every rank fetches only the keys its queries see (:mod:`.visible_keys`,
counted as ``"key_fetch"``: none for documents that sit whole on the rank computing them) instead of all of them,
unless the documents are so long that the all-gather moves about as much.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch

from ..accounting import all_gather_bytes, reduce_scatter_bytes
from ..collectives import all_gather_impl, exchange_impl, reduce_scatter_impl
from . import ring
from .api import attention
from .base import AttentionShape, Pricing, Strategy, StrategyCost, register, zigzag_layout_when_causal
from .blocks import HeadSegment, Piece, attend, attend_backward, empty_result, pieces
from .call import Call
from . import dispatch
from .dispatch import Chunk, Dispatch, balance, global_ids
from .visible_keys import KeyFetch, key_fetch
from .formulas import B, D, Dv, Hkv, M, P, S, Sizes, a, e
from .local import compute_dtype, row_delta

__all__ = ["allgather_attention", "allgather_bytes"]


def _gather(call: Call, *tensors):
    """Every rank's ``tensors`` (K, V: sequence dim 2; masks, ids: dim 1), concatenated in rank order (one
    all-gather each; None stays None)."""
    pg, sizes = call.pg, list(call.layout.local_lengths)
    return [None if t is None else all_gather_impl(t, 2 if t.dim() == 4 else 1, sizes, pg) for t in tensors]


@dataclass
class _Keys:
    """The keys this rank attends to: all-gathered, or with packed documents only the visible ones fetched."""

    k: torch.Tensor
    v: torch.Tensor
    key_mask: torch.Tensor | None
    segment_ids: torch.Tensor | None
    pieces: tuple[Piece, ...]
    """Where every key row sits in the global sequence."""
    dispatch: Dispatch | None
    """With packed documents: which rank computes which chunk of queries."""
    fetch: KeyFetch | None
    """With packed documents whose visible keys are fetched (:mod:`.visible_keys`): which rows came from where."""


def _keys(k, v, key_mask, segment_ids, call: Call) -> _Keys:
    layout, rank = call.layout, call.pg.rank()
    (all_segments,) = _gather(call, segment_ids)
    ids = None if all_segments is None or layout.world_size == 1 else global_ids(all_segments, layout)
    plan = None if ids is None or not dispatch.BALANCE else balance(layout, ids, call.spec)
    fetch = None if ids is None else key_fetch(layout, ids, call.spec, plan)
    if fetch is None or not fetch.worth_it:
        all_k, all_v, all_keys_mask = _gather(call, k, v, key_mask)
        return _Keys(all_k, all_v, all_keys_mask, all_segments, pieces(layout, range(layout.world_size)), plan, None)
    rows, send, receive = fetch.sent_rows(rank, k.device), fetch.sent_sizes(rank), fetch.received_sizes(rank)
    fetched = [torch.cat([t, exchange_impl(t.index_select(2, rows), 2, send, receive, call.pg, kind="key_fetch")], 2)
               for t in (k, v)]
    positions = fetch.positions(rank, k.device)
    if key_mask is not None:  # a few bits a key: gathered whole, read at the rows held
        (all_keys_mask,) = _gather(call, key_mask)
        key_mask = global_ids(all_keys_mask, layout)[:, positions]
    return _Keys(*fetched, key_mask, ids[:, positions], fetch.pieces(rank), plan, fetch)


def _forward(q, k, v, key_mask, segment_ids, call: Call):
    keys = _keys(k, v, key_mask, segment_ids, call)
    layout, rank, plan = call.layout, call.pg.rank(), keys.dispatch
    out, lse = empty_result(q, v)
    options = _attend_options(q, k, keys, call)
    attend(out, lse, q, keys.k, keys.v, plan.kept(rank) if plan else pieces(layout, [rank]), keys.pieces,
           seg_q=segment_ids, **options)
    if plan is not None and plan.moves:  # the queries this rank computes for others, and their results back
        incoming, q_in = _incoming(plan, call, q)
        out_in, lse_in = empty_result(q_in, v)
        attend(out_in, lse_in, q_in, keys.k, keys.v, _pieces(incoming), keys.pieces, seg_q=plan.ids_of(incoming),
               **options)
        for t, result in zip((out, lse), _returned(plan, call, out_in, lse_in)):
            for chunk, rows in result:
                t[:, :, chunk.rows] = rows
    return out, lse


def _backward(dout, q, k, v, out, lse, key_mask, segment_ids, call: Call):
    keys = _keys(k, v, key_mask, segment_ids, call)
    layout, rank, plan = call.layout, call.pg.rank(), keys.dispatch
    ct = compute_dtype(q.dtype)
    dq = q.new_zeros(q.shape, dtype=ct)
    dk, dv = keys.k.new_zeros(keys.k.shape, dtype=ct), keys.v.new_zeros(keys.v.shape, dtype=ct)
    options = _attend_options(q, k, keys, call)
    attend_backward(dq, dk, dv, dout, q, keys.k, keys.v, out, lse, row_delta(dout, out),
                    plan.kept(rank) if plan else pieces(layout, [rank]), keys.pieces, seg_q=segment_ids, **options)
    if plan is not None and plan.moves:
        incoming, q_in, dout_in, out_in, lse_in = _incoming(plan, call, q, dout, out, lse)
        dq_in = q_in.new_zeros(q_in.shape, dtype=ct)
        attend_backward(dq_in, dk, dv, dout_in, q_in, keys.k, keys.v, out_in, lse_in, row_delta(dout_in, out_in),
                        _pieces(incoming), keys.pieces, seg_q=plan.ids_of(incoming), **options)
        # Each moved row's dq has no other term and the op returns dq in q's dtype: sent in it, nothing changes.
        (result,) = _returned(plan, call, dq_in.to(q.dtype))
        for chunk, rows in result:
            dq[:, :, chunk.rows] += rows
    fetch = keys.fetch
    del keys
    if fetch is None:
        sizes = list(layout.local_lengths)
        return dq, reduce_scatter_impl(dk, 2, sizes, call.pg), reduce_scatter_impl(dv, 2, sizes, call.pg)
    return dq, *(_returned_keys(fetch, call, t) for t in (dk, dv))


def _returned_keys(fetch: KeyFetch, call: Call, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of this rank's own keys: its own rows of ``grad`` plus those of the rows other ranks fetched,
    sent back by the inverse all-to-all."""
    rank = call.pg.rank()
    own = grad[:, :, :call.layout.local_length(rank)].clone()
    sizes = fetch.sent_sizes(rank)
    back = exchange_impl(grad[:, :, own.size(2):], 2, fetch.received_sizes(rank), sizes, call.pg, kind="key_fetch")
    # One receiver's rows at a time: none repeats within one, so the sums are in a fixed order (no atomics).
    for rows, grads in zip(torch.split(fetch.sent_rows(rank, grad.device), sizes), torch.split(back, sizes, 2)):
        own.index_add_(2, rows, grads)
    return own


def _attend_options(q, k, keys: _Keys, call: Call) -> dict:
    return dict(heads=HeadSegment.all(q.size(1), k.size(1)), key_mask=keys.key_mask, seg_k=keys.segment_ids,
                scoring=call.scoring)


# ---------------------------------------------------------------------------- packed documents: balanced queries


def _pieces(chunks: list[Chunk]) -> tuple[Piece, ...]:
    """The pieces of the concatenation of ``chunks``' rows."""
    local, out = 0, []
    for chunk in chunks:
        out.append(Piece(local, chunk.start, chunk.length))
        local += chunk.length
    return tuple(out)


def _incoming(plan: Dispatch, call: Call, *tensors: torch.Tensor):
    """The chunks this rank computes for others (in source-rank order) and, for each of ``tensors`` (sequence dim
    2), their rows received from their owners."""
    world, rank = call.layout.world_size, call.pg.rank()
    sent, received = plan.sent(rank, world), plan.received(rank, world)
    send_sizes = [sum(c.length for c in chunks) for chunks in sent]
    recv_sizes = [sum(c.length for c in chunks) for chunks in received]
    moved = []
    for t in tensors:
        outgoing = [t[:, :, c.rows] for chunks in sent for c in chunks]
        payload = torch.cat(outgoing, 2) if outgoing else t[:, :, :0]
        moved.append(exchange_impl(payload, 2, send_sizes, recv_sizes, call.pg, kind="dispatch"))
    return [c for chunks in received for c in chunks], *moved


def _returned(plan: Dispatch, call: Call, *results: torch.Tensor):
    """Send every result (rows of the incoming chunks, sequence dim 2) back to the chunks' owners; for each, the
    ``(chunk, rows)`` of this rank's chunks that others computed."""
    world, rank = call.layout.world_size, call.pg.rank()
    sent, received = plan.sent(rank, world), plan.received(rank, world)
    send_sizes = [sum(c.length for c in chunks) for chunks in received]
    recv_sizes = [sum(c.length for c in chunks) for chunks in sent]
    mine = [c for chunks in sent for c in chunks]
    out = []
    for result in results:
        back = exchange_impl(result, 2, send_sizes, recv_sizes, call.pg, kind="dispatch")
        out.append(list(zip(mine, torch.split(back, [c.length for c in mine], 2))) if mine else [])
    return out


# ---------------------------------------------------------------------------- bytes and cost


def allgather_bytes(backward: bool = False) -> sympy.Expr:
    """``allgather``: all-gather of K, V (and masks), ``(P - 1)`` padded shards; the backward gathers them again
    and reduce-scatters dK, dV (``a`` bytes per element). With packed documents this is the most the keys cost:
    only the visible ones are fetched (:mod:`.visible_keys`, data-dependent bytes the plan counts from a batch's
    ``position_ids``)."""
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
    world, hardware = p.world, p.hardware
    sent = p.sent({"P": world})
    comm = sum(sent) / hardware.bandwidth(world)
    latency = 4 * hardware.latency(world) * max(1, math.ceil(math.log2(max(world, 2))))
    return p.cost(compute=p.balanced, comm=comm, exposed=comm, latency=latency, sent=sent,
                  memory=p.memory)


def _working_set(shape: AttentionShape, world: int, head_chunks: int, backward: bool) -> int:
    """The gathered K/V of the whole sequence and the float32 accumulators of this rank's queries (backward: dQ,
    and dK/dV of the whole sequence in float32 until the reduce-scatter), one head group at a time."""
    s, e, c = -(-shape.seq // world), shape.dtype.itemsize, compute_dtype(shape.dtype).itemsize
    heads, kv_heads = -(-shape.heads // head_chunks), -(-shape.kv_heads // head_chunks)
    gathered = shape.batch * shape.seq * kv_heads * shape.kv_dims
    if backward:
        return gathered * (e + c) + shape.batch * s * heads * shape.head_dim * c
    return gathered * e + shape.batch * s * heads * (shape.dv + 1) * c


register(Strategy(name="allgather", check=ring.RING.check, forward=_forward, backward=_backward,
                  bytes_sent=allgather_bytes, bytes_by_rank=_bytes_by_rank, cost=_cost, working_set=_working_set,
                  preferred_layout=zigzag_layout_when_causal, rank=3, reason="gathering K/V once is cheapest here"))


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
    """:func:`~autoshard.runtime.attention.attention` with ``strategy="allgather"`` (same keywords)."""
    return attention(q, k, v, strategy="allgather", **options)
