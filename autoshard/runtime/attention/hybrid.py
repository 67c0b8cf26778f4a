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
Bytes: the Ulysses formulas on ``P_u`` ranks plus the ring formulas on ``P_r`` ranks for ``H / P_u`` heads
(see :mod:`.formulas`).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..layouts import SequenceLayout
from .base import AttentionInputError, Call, Strategy, register
from .ulysses import check_heads, ulysses_backward, ulysses_forward

__all__ = ["hybrid_attention", "hybrid_axes", "hybrid_sequence_rank", "hybrid_layout"]


_NEEDS_MESH = ("autoshard.attention: strategy 'hybrid' needs group= a 2-D DeviceMesh, e.g. init_device_mesh(device, "
               "(P_ring, P_ulysses), mesh_dim_names=('ring', 'ulysses'))")


def hybrid_axes(mesh: DeviceMesh) -> tuple[int, int]:
    """``(ring_axis, ulysses_axis)`` of a 2-D mesh: the axes named ``"ring"`` / ``"ulysses"``, else 0 / 1."""
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
        raise AttentionInputError(_NEEDS_MESH)
    names = tuple(mesh.mesh_dim_names or ())
    ulysses = names.index("ulysses") if "ulysses" in names else 1
    ring = names.index("ring") if "ring" in names else 1 - ulysses
    if ring == ulysses:
        raise AttentionInputError(f"autoshard.attention: the mesh axes {names} name no distinct ring and ulysses axes")
    return ring, ulysses


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
                           spec=call.spec, scale=call.scale, softcap=call.softcap, terms=call.terms,
                           kernels=call.kernels)


def _backward(dout, q, k, v, out, lse, key_mask, segment_ids, call: Call):
    return ulysses_backward(dout, q, k, v, out, lse, key_mask, segment_ids, pg=call.pg, ring_pg=call.ring_pg,
                            layout=call.layout, spec=call.spec, scale=call.scale, softcap=call.softcap,
                            terms=call.terms, kernels=call.kernels)


register(Strategy("hybrid", _check, _forward, _backward))


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: DeviceMesh,
                     **options) -> torch.Tensor:
    """:func:`~autoshard.runtime.attention.attention` with ``strategy="hybrid"`` over the 2-D mesh ``group``."""
    from .api import attention

    return attention(q, k, v, group=group, strategy="hybrid", **options)
