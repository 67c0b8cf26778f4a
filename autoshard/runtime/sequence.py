"""Moving a tensor between *whole* (every rank holds all of it) and *sharded along the sequence*.

    x_local = shard_sequence(x, dim=1, layout="zigzag")      # no communication
    pos     = sequence_positions(x.size(1), layout="zigzag") # global index of each local position
    x_full  = unshard_sequence(x_local, dim=1, layout="zigzag", length=x.size(1))

Autograd follows the *logical* tensor (the DTensor convention), unlike the raw collectives: the
sharded tensor and the whole tensor are the same value, so

* ``shard_sequence``'s backward gathers the gradient shards into the whole gradient;
* ``unshard_sequence``'s backward keeps this rank's part of the (identical on every rank) gradient.

That is what makes "every rank computes the same loss from gathered outputs" give exactly the
one-process gradients. Uneven shards are allowed (see :mod:`autoshard.runtime.layouts`).
"""

from __future__ import annotations

import torch

from .collectives import _per_position, _pg, _with, all_gather_impl, gather_facts, reduce_scatter_impl
from .groups import GroupLike, resolve_group
from .layouts import SequenceLayout
from .op_info import declare

__all__ = ["shard_sequence", "unshard_sequence", "sequence_positions", "resolve_layout"]

# ``seq_unshard_for_local_use`` is the gather the compiler emits when the whole value is consumed by
# computation on this rank's positions (keys gathered for this rank's queries): its gradient is then
# this rank's share, and the backward reduce-scatters the shares instead of slicing.


def resolve_layout(layout: str | SequenceLayout, length: int, world_size: int) -> SequenceLayout:
    """A :class:`SequenceLayout` from a layout name or a layout (checked against length and world size)."""
    if isinstance(layout, SequenceLayout):
        if layout.length != length or layout.world_size != world_size:
            raise ValueError(f"autoshard: {layout} does not describe {length} positions on {world_size} ranks")
        return layout
    return SequenceLayout.of(layout, length, world_size)


def _local_pieces(x: torch.Tensor, dim: int, layout: SequenceLayout, rank: int) -> torch.Tensor:
    parts = [x.narrow(dim, s, e - s) for s, e in layout.local_intervals(rank)]
    if not parts:
        return x.new_empty(_with(x.shape, dim, 0))
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone(memory_format=torch.contiguous_format)


def _global_order(gathered: torch.Tensor, dim: int, layout: SequenceLayout) -> torch.Tensor:
    """Reorder a rank-ordered concatenation of local shards into global position order."""
    if layout.kind == "contiguous":
        return gathered
    pieces = []
    offset = 0
    for rank in range(layout.world_size):
        for s, e in layout.local_intervals(rank):
            pieces.append((s, offset, e - s))
            offset += e - s
    pieces.sort()
    return torch.cat([gathered.narrow(dim, off, n) for _, off, n in pieces], dim)


@torch.library.custom_op("autoshard::seq_shard", mutates_args=())
def _seq_shard(x: torch.Tensor, dim: int, layout: list[int], group: str) -> torch.Tensor:
    return _local_pieces(x, dim, SequenceLayout.decode(layout), _pg(group).rank())


def _local_fake(x, dim, layout, group):
    return x.new_empty(_with(x.shape, dim, SequenceLayout.decode(layout).local_length(_pg(group).rank())))


def _whole_fake(x, dim, layout, group):
    return x.new_empty(_with(x.shape, dim, SequenceLayout.decode(layout).length))


_seq_shard.register_fake(_local_fake)


@torch.library.custom_op("autoshard::seq_unshard", mutates_args=())
def _seq_unshard(x: torch.Tensor, dim: int, layout: list[int], group: str) -> torch.Tensor:
    lay = SequenceLayout.decode(layout)
    gathered = all_gather_impl(x, dim, lay.local_lengths, _pg(group))
    return _global_order(gathered, dim, lay)


_seq_unshard.register_fake(_whole_fake)


def _rank_order(x: torch.Tensor, dim: int, layout: SequenceLayout) -> torch.Tensor:
    """Reorder a whole tensor (global position order) into the concatenation of every rank's positions."""
    if layout.kind == "contiguous":
        return x
    return torch.cat([x.narrow(dim, s, e - s) for r in range(layout.world_size)
                      for s, e in layout.local_intervals(r)], dim)


@torch.library.custom_op("autoshard::seq_reduce_scatter", mutates_args=())
def _seq_reduce_scatter(x: torch.Tensor, dim: int, layout: list[int], group: str) -> torch.Tensor:
    lay = SequenceLayout.decode(layout)
    return reduce_scatter_impl(_rank_order(x, dim, lay), dim, lay.local_lengths, _pg(group))


_seq_reduce_scatter.register_fake(_local_fake)


@torch.library.custom_op("autoshard::seq_unshard_for_local_use", mutates_args=())
def _seq_unshard_local_use(x: torch.Tensor, dim: int, layout: list[int], group: str) -> torch.Tensor:
    return _seq_unshard(x, dim, layout, group)


_seq_unshard_local_use.register_fake(_whole_fake)


def _setup(ctx, inputs, output):
    ctx.dim, ctx.layout, ctx.group = inputs[1], inputs[2], inputs[3]


_seq_shard.register_autograd(
    lambda ctx, g: (torch.ops.autoshard.seq_unshard(g, ctx.dim, ctx.layout, ctx.group), None, None, None),
    setup_context=_setup)
_seq_unshard.register_autograd(
    lambda ctx, g: (torch.ops.autoshard.seq_shard(g, ctx.dim, ctx.layout, ctx.group), None, None, None),
    setup_context=_setup)
_seq_unshard_local_use.register_autograd(
    lambda ctx, g: (torch.ops.autoshard.seq_reduce_scatter(g, ctx.dim, ctx.layout, ctx.group), None, None, None),
    setup_context=_setup)
declare(torch.ops.autoshard.seq_shard.default)
declare(torch.ops.autoshard.seq_unshard.default)
declare(torch.ops.autoshard.seq_reduce_scatter.default)
declare(torch.ops.autoshard.seq_unshard_for_local_use.default)


def shard_sequence(x: torch.Tensor, dim: int, *, group: GroupLike = None,
                   layout: str | SequenceLayout = "contiguous") -> torch.Tensor:
    """This rank's shard of ``x`` (held whole by every rank) along ``dim``; no communication.

    ``layout``: ``"contiguous"``, ``"zigzag"`` or a :class:`SequenceLayout`. Lengths the world size does
    not divide give uneven shards (sizes differ by at most one). Backward: the gradient shards are
    gathered into the whole gradient.
    """
    pg = resolve_group(group)
    dim = dim % x.dim()
    lay = resolve_layout(layout, x.size(dim), pg.size())
    return torch.ops.autoshard.seq_shard(x, dim, lay.encode(), pg.group_name)


def unshard_sequence(x: torch.Tensor, dim: int, *, group: GroupLike = None,
                     layout: str | SequenceLayout = "contiguous", length: int | None = None) -> torch.Tensor:
    """The whole tensor, in global order, on every rank, from every rank's shard along ``dim``.

    ``length``: the global length (default: the sum of the ranks' lengths along ``dim``). The ranks first
    exchange their lengths (a few bytes, counted as ``"metadata"``) and check them against the layout
    together, so shards that do not fit it fail on every rank. Backward: this rank's part of the gradient.
    """
    pg = resolve_group(group)
    dim = dim % x.dim()
    if isinstance(layout, SequenceLayout):
        length = layout.length
    facts = gather_facts([x.size(dim), _per_position(x, dim), -1 if length is None else length], pg)
    lay = _agreed_layout(facts, layout, dim)
    return torch.ops.autoshard.seq_unshard(x, dim, lay.encode(), pg.group_name)


def _agreed_layout(facts: list[list[int]], layout: str | SequenceLayout, dim: int) -> SequenceLayout:
    """The layout the ranks' (length along ``dim``, elements per position, requested length or -1) facts
    describe; raises -- the same on every rank, as every rank has the same facts -- when they do not fit."""
    held = [f[0] for f in facts]
    for what, index in (f"elements per position along dim {dim}", 1), ("length", 2):
        if len({f[index] for f in facts}) > 1:
            raise ValueError(f"unshard_sequence: the ranks differ in {what}: {[f[index] for f in facts]} by rank")
    length = facts[0][2] if facts[0][2] >= 0 else sum(held)
    lay = resolve_layout(layout, length, len(facts))
    wrong = [r for r, n in enumerate(held) if n != lay.local_length(r)]
    if wrong:
        raise ValueError(
            f"unshard_sequence: rank(s) {wrong} hold {[held[r] for r in wrong]} positions along dim {dim}, but the "
            f"{lay.kind} layout of {length} positions on {len(facts)} ranks gives them "
            f"{[lay.local_length(r) for r in wrong]}")
    return lay


def sequence_positions(length: int, *, group: GroupLike = None, layout: str | SequenceLayout = "contiguous",
                       device: torch.device | str | None = None) -> torch.Tensor:
    """The global position of each of this rank's local positions (int64), for a ``length``-long sequence."""
    pg = resolve_group(group)
    return resolve_layout(layout, length, pg.size()).positions(pg.rank(), device=device)
