"""Hybrid (2-D) attention: Ulysses all-to-all inside groups, ring attention across them (USP-style).

The group is a 2-D ``DeviceMesh``. Its axis named ``"ulysses"`` (else axis 1) is the all-to-all axis of
``P_u`` ranks; its axis named ``"ring"`` (else axis 0) the ring axis of ``P_r`` ranks. The sequence is laid
out over ``P = P_r * P_u`` *sequence ranks*; the rank at mesh coordinate ``(ring=i, ulysses=j)`` holds
sequence rank ``i * P_u + j``. That is the flattened mesh rank when the mesh is ordered
``(ring, ulysses)`` -- e.g. ``init_device_mesh("cpu", (P_r, P_u), mesh_dim_names=("ring", "ulysses"))``
over the default group -- so ``shard_sequence(x, dim, layout=...)`` on the default group makes the right
shards. For any other mesh, :func:`hybrid_sequence_rank` names the rank and
``SequenceLayout.of(kind, length, mesh.size()).positions(that rank)`` the positions to keep.

Each Ulysses group moves to head-split over the union of its members' shards (:mod:`.ulysses`), then
the ranks that hold the same heads (the ring axis) run the ring of :mod:`.ring` over those unions. With
the zigzag layout every union holds balanced early and late chunks, so causal work stays balanced.
Bytes (:func:`hybrid_bytes`): the Ulysses formulas on ``P_u`` ranks plus the ring formulas on ``P_r`` ranks
for ``H / P_u`` heads. Cost: the all-to-alls inside a node exposed, the ring across nodes overlapped; the cost
model places the Ulysses axis inside a node (the largest node-sized axis that splits the heads) and reports
the hybrid impossible without a 2-D mesh or for a group inside one node.
"""

from __future__ import annotations

import dataclasses
import math

import sympy
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..groups import hybrid_mesh_axes
from ..layouts import SequenceLayout
from . import ring, ulysses
from .api import attention
from .base import AttentionShape, Pricing, Strategy, StrategyCost, register, zigzag_layout_when_causal
from .call import AttentionInputError, Call
from .formulas import P, P_r, P_u, S, Hkv, Sizes
from .ulysses import check_heads, ulysses_backward, ulysses_forward

__all__ = ["hybrid_attention", "hybrid_axes", "hybrid_sequence_rank", "hybrid_layout", "hybrid_bytes"]


_NEEDS_MESH = ("autoshard.attention: strategy 'hybrid' needs group= a 2-D DeviceMesh, e.g. init_device_mesh(device, "
               "(P_ring, P_ulysses), mesh_dim_names=('ring', 'ulysses'))")


def hybrid_axes(mesh: DeviceMesh) -> tuple[int, int]:
    """``(ring_axis, ulysses_axis)`` of a 2-D mesh, as the compiler reads it too
    (:func:`~autoshard.runtime.groups.hybrid_mesh_axes`): the axes named ``"ring"`` / ``"ulysses"``, else 0 / 1."""
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
        raise AttentionInputError(_NEEDS_MESH)
    try:
        return hybrid_mesh_axes(mesh)
    except ValueError as e:
        raise AttentionInputError(str(e).replace("autoshard:", "autoshard.attention:", 1)) from None


def hybrid_sequence_rank(mesh: DeviceMesh) -> int:
    """The sequence rank this process holds in a hybrid call over ``mesh``: ``ring_coord * P_u + ulysses_coord``."""
    ring, ulysses = hybrid_axes(mesh)
    coordinate = mesh.get_coordinate()
    return coordinate[ring] * mesh.size(ulysses) + coordinate[ulysses]


def hybrid_layout(mesh: DeviceMesh, length: int, layout: str | SequenceLayout = "contiguous") -> SequenceLayout:
    """The layout a hybrid call over ``mesh`` expects: ``layout`` over ``mesh.size()`` sequence ranks."""
    hybrid_axes(mesh)
    if isinstance(layout, SequenceLayout):
        if layout.world_size != mesh.size() or layout.length != length:
            raise AttentionInputError(f"autoshard.attention: {layout!r} does not place {length} positions on the "
                                      f"{mesh.size()} ranks of the mesh")
        return layout
    return SequenceLayout.of(layout, length, mesh.size())


def _check(q, k, v, call: Call) -> int:
    if not call.ring_group:
        raise AttentionInputError(_NEEDS_MESH)
    upg, rpg = call.pg, call.ring_pg
    world = upg.size() * rpg.size()
    if call.layout.world_size != world:
        raise AttentionInputError(
            f"autoshard.attention: the layout places the sequence on {call.layout.world_size} ranks but the hybrid "
            f"mesh has {rpg.size()} x {upg.size()} = {world}; build the layout for {world} ranks (hybrid_layout)")
    check_heads(q.size(1), upg.size(), "the Ulysses axis of strategy 'hybrid'")
    return rpg.rank() * upg.size() + upg.rank()


def _forward(q, k, v, key_mask, segment_ids, call: Call):
    return ulysses_forward(q, k, v, key_mask, segment_ids, pg=call.pg, ring_pg=call.ring_pg, layout=call.layout,
                           scoring=call.scoring)


def _backward(dout, q, k, v, out, lse, key_mask, segment_ids, call: Call):
    return ulysses_backward(dout, q, k, v, out, lse, key_mask, segment_ids, pg=call.pg, ring_pg=call.ring_pg,
                            layout=call.layout, scoring=call.scoring)


def _mesh_groups(mesh: DeviceMesh) -> list[dist.ProcessGroup]:
    """The Ulysses axis' group, then the ring axis' (the order :class:`~.base.Call` takes them in)."""
    ring_axis, ulysses_axis = hybrid_axes(mesh)
    return [mesh.get_group(ulysses_axis), mesh.get_group(ring_axis)]


# ---------------------------------------------------------------------------- bytes and cost


def hybrid_bytes(backward: bool = False) -> sympy.Expr:
    """``hybrid``: Ulysses inside groups of ``P_u`` ranks (``S / P`` tokens each, ``P = P_r * P_u``), then a ring of
    ``P_r`` blocks of ``S / P_r`` tokens with the ``ceiling(Hkv / P_u)`` kv heads a rank holds."""
    total = P_r * P_u
    return (ulysses.ulysses_terms(P_u, S / total, backward)
            + ring.ring_terms(P_r, S / P_r, sympy.ceiling(Hkv / P_u), backward)).subs(P, total)


def _bytes_by_rank(lengths: list[int], n: Sizes, backward: bool, P_u: int | None = None) -> list[int]:
    if P_u is None or P_u < 1 or len(lengths) % P_u:
        raise ValueError(f"hybrid needs P_u, a Ulysses axis size dividing the {len(lengths)} ranks; got {P_u}")
    return ulysses.ulysses_ring_bytes(lengths, P_u, n, backward)


def _node_axis(p: Pricing) -> int:
    """The Ulysses axis the cost model plans: the largest power-of-two share of a node and of the ranks that splits
    the heads."""
    inner = math.gcd(p.hardware.ranks_per_node, p.world)
    while inner > 1 and p.shape.heads % inner:
        inner //= 2
    return inner


def _cost(p: Pricing) -> StrategyCost:
    world, hardware = p.world, p.hardware
    inner = _node_axis(p)
    if not p.hybrid_possible:
        return p.impossible("needs a 2-D device mesh (ring axis, ulysses axis)")
    if world <= hardware.ranks_per_node:
        return p.impossible("the group fits in one node (Ulysses alone is the inner part)")
    if inner <= 1:
        return p.impossible("no node-sized head split")
    outer = world // inner
    sent = p.sent({"P_r": outer, "P_u": inner})
    # Ulysses inside the node (fast, exposed; its shape without the masks, whose gather counts with the ring's
    # traffic), the ring across nodes (slow, overlapped)
    inner_sent = p.sent({"P": inner}, ulysses.ulysses_bytes,
                        dataclasses.replace(p.shape, seq=p.shape.seq // outer, key_mask=False, segment_ids_dtype=None))
    inner_comm = sum(inner_sent) / hardware.intra_node_bandwidth
    ring_comm = max(0, sum(sent) - sum(inner_sent)) / hardware.inter_node_bandwidth
    latency = (10 * hardware.intra_node_latency + 2 * outer * (hardware.inter_node_latency + hardware.step_overhead)
               + p.merge_time(outer))
    return p.cost(compute=p.balanced, comm=inner_comm + ring_comm,
                  exposed=inner_comm + max(0.0, ring_comm - p.balanced), latency=latency, sent=sent,
                  memory=p.memory, mesh=(outer, inner))


def _working_set(shape: AttentionShape, world: int, head_chunks: int, backward: bool) -> int:
    """Ulysses' head-split copies (a ring rank's share of the sequence times a Ulysses rank's share of the heads:
    the bytes of Ulysses over all ranks) and the ring's K/V blocks in flight between the Ulysses groups."""
    return ulysses.ulysses_working_set(shape, world, head_chunks, backward) + \
        ring.ring_working_set(dataclasses.replace(shape, heads=0), world, head_chunks, backward)


register(Strategy(name="hybrid", check=_check, forward=_forward, backward=_backward, bytes_sent=hybrid_bytes,
                  bytes_by_rank=_bytes_by_rank, cost=_cost, working_set=_working_set, splits_heads=True, preferred_layout=zigzag_layout_when_causal, rank=4,
                  reason="the group spans nodes: all-to-all inside a node, ring across nodes",
                  mesh_groups=_mesh_groups))


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: DeviceMesh,
                     **options) -> torch.Tensor:
    """:func:`~autoshard.runtime.attention.attention` with ``strategy="hybrid"`` over the 2-D mesh ``group``."""
    return attention(q, k, v, group=group, strategy="hybrid", **options)
