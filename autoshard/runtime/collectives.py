"""Autograd-aware collectives over a process group, traceable by torch.compile.

Each collective is a ``torch.library`` custom op (``torch.ops.autoshard.*``) with a fake
implementation (so FakeTensor, dynamo and AOTAutograd can trace it) and a registered backward. The
group travels as its registered name, as in torch's functional collectives.

The module is one block per collective, in the order of the table below: its forward implementation (a
plain function that communicates, which the sequence layouts and the attention strategies call too), the
custom op and its fake, its autograd formula, and the public function. ``all_gather`` and
``reduce_scatter`` share one autograd context: each is the other's backward.

Gradient convention. These are the *raw* collectives: linear maps on the P per-rank tensors, whose
backward is the exact adjoint when the objective is the **sum of the per-rank objectives**:

=================  ==========================================================================
forward            backward
=================  ==========================================================================
``all_gather``     ``reduce_scatter`` (sum) of the output gradient
``reduce_scatter`` ``all_gather`` of the output gradient
``all_reduce``     ``all_reduce`` (sum) of the output gradient (``max``: split evenly among the
                   ranks that hold the maximum, as ``torch.amax`` splits it among tied elements)
``all_to_all``     the reverse ``all_to_all``
=================  ==========================================================================

Sequence layouts (``shard_sequence`` / ``unshard_sequence`` in :mod:`autoshard.runtime.sequence`)
follow the *logical-tensor* convention instead (as DTensor does); they reuse the forward functions here.

Uneven sizes are first-class: ``all_gather`` and ``reduce_scatter`` take every rank's size along the
dim, ``all_to_all`` takes how the split dim is cut and every rank's size along the concatenated dim.
Every call records its bytes in the :mod:`~autoshard.runtime.accounting` counter.

Bad arguments fail on every rank, never on one while the others wait in the collective: a check that
depends on what only one rank holds (its shard's length) first exchanges those facts
(:func:`gather_facts`, a few bytes counted as ``"metadata"``) and then decides from what every rank now
knows identically, so every rank raises the same error.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .accounting import all_gather_bytes, all_reduce_bytes, record, reduce_scatter_bytes
from .groups import GroupLike, global_rank, group_name, metadata_device, resolve_group
from .layouts import split_sizes as balanced_split
from .op_info import declare

__all__ = [
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "RingCommunicator",
    "all_gather_impl",
    "reduce_scatter_impl",
    "all_reduce_impl",
    "define_all_reduce",
    "all_to_all_impl",
    "exchange_impl",
    "gather_facts",
    "gather_table",
]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# ---------------------------------------------------------------------------- shared helpers


def _pg(name: str) -> dist.ProcessGroup:
    return resolve_group(name)


def _narrow_pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` zero-padded (at the end) along ``dim`` to ``size``."""
    if x.size(dim) == size:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = size - x.size(dim)
    return torch.cat([x, x.new_zeros(pad_shape)], dim)


def _with(shape: Sequence[int], dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for v in xs:
        out *= int(v)
    return out


def _sizes_or_even(sizes: Sequence[int], local: int, world: int) -> list[int]:
    return list(sizes) if len(sizes) else [local] * world


def _dim(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim() if x.dim() else 0


def _per_position(x: torch.Tensor, dim: int) -> int:
    """Elements of ``x`` per position along ``dim``."""
    return _prod(_with(x.shape, dim, 1))


def _p2p(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], pg: dist.ProcessGroup,
         kind: str) -> list[dist.Work]:
    """Post sends/receives (peer given as group rank) as one batch; returns the works to wait on."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), global_rank(pg, peer), pg) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, global_rank(pg, peer), pg) for t, peer in recvs]
    record(kind, sum(t.numel() * t.element_size() for t, _ in sends),
           sum(t.numel() * t.element_size() for t, _ in recvs))
    return dist.batch_isend_irecv(ops) if ops else []


def gather_table(table: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's rows of the small integer ``table`` (as many on every rank), stacked in rank order, on every
    rank; counted as ``"metadata"``."""
    out = table.new_empty((pg.size() * table.size(0),) + tuple(table.shape[1:]))
    _all_gather_single(out, table.contiguous(), group=pg)
    nbytes = all_gather_bytes(table.numel() * table.element_size(), pg.size())
    record("metadata", nbytes, nbytes)
    return out


def gather_facts(facts: Sequence[int], pg: dist.ProcessGroup) -> list[list[int]]:
    """Every rank's ``facts`` (as many integers on every rank), in rank order, on every rank."""
    mine = torch.tensor([list(facts)], dtype=torch.long, device=metadata_device(pg))
    return gather_table(mine, pg).tolist()


# ---------------------------------------------------------------------------- all_gather


def all_gather_impl(x: torch.Tensor, dim: int, sizes: Sequence[int], pg: dist.ProcessGroup, *,
                    kind: str = "all_gather") -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; rank ``i`` contributes ``sizes[i]`` rows there. ``kind``: what
    the byte counter files the call under."""
    world = pg.size()
    longest = max(sizes)
    moved = _narrow_pad(x, dim, longest).movedim(dim, 0).contiguous()
    out = moved.new_empty((world * longest,) + tuple(moved.shape[1:]))
    _all_gather_single(out, moved, group=pg)
    nbytes = all_gather_bytes(moved.numel() * moved.element_size(), world)
    record(kind, nbytes, nbytes)
    if len(set(sizes)) > 1:
        out = torch.cat([out[i * longest: i * longest + sizes[i]] for i in range(world)], 0)
    return out.movedim(0, dim).contiguous()


@torch.library.custom_op("autoshard::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, dim: int, sizes: list[int], group: str) -> torch.Tensor:
    pg = _pg(group)
    return all_gather_impl(x, dim, _sizes_or_even(sizes, x.size(dim), pg.size()), pg)


@_all_gather_op.register_fake
def _(x, dim, sizes, group):
    world = _pg(group).size()
    return x.new_empty(_with(x.shape, dim, sum(_sizes_or_even(sizes, x.size(dim), world))))


def _gather_setup(ctx, inputs, output):
    ctx.dim, ctx.sizes, ctx.group = inputs[1], inputs[2], inputs[3]
    ctx.local = inputs[0].size(inputs[1])


def _all_gather_backward(ctx, grad):
    pg = _pg(ctx.group)
    sizes = _sizes_or_even(ctx.sizes, ctx.local, pg.size())
    return torch.ops.autoshard.reduce_scatter(grad, ctx.dim, sizes, ctx.group), None, None, None


_all_gather_op.register_autograd(_all_gather_backward, setup_context=_gather_setup)
declare(torch.ops.autoshard.all_gather.default)


def all_gather(x: torch.Tensor, dim: int, *, group: GroupLike = None, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order). ``sizes``: every rank's size along ``dim``
    when they differ. Backward: reduce-scatter (sum) of the gradient."""
    return torch.ops.autoshard.all_gather(x, _dim(x, dim), list(sizes or []), group_name(group))


# ---------------------------------------------------------------------------- reduce_scatter


def reduce_scatter_impl(x: torch.Tensor, dim: int, sizes: Sequence[int], pg: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's chunk along ``dim`` (chunk ``i`` has ``sizes[i]`` rows)."""
    world, rank = pg.size(), pg.rank()
    longest = max(sizes)
    moved = x.movedim(dim, 0)
    if len(set(sizes)) > 1:
        starts = [sum(sizes[:i]) for i in range(world)]
        moved = torch.cat([_narrow_pad(moved[starts[i]: starts[i] + sizes[i]], 0, longest) for i in range(world)])
    moved = moved.contiguous()
    out = moved.new_empty((longest,) + tuple(moved.shape[1:]))
    _reduce_scatter_single(out, moved, group=pg)
    nbytes = reduce_scatter_bytes(out.numel() * out.element_size(), world)
    record("reduce_scatter", nbytes, nbytes)
    return out[: sizes[rank]].movedim(0, dim).contiguous()


@torch.library.custom_op("autoshard::reduce_scatter", mutates_args=())
def _reduce_scatter_op(x: torch.Tensor, dim: int, sizes: list[int], group: str) -> torch.Tensor:
    pg = _pg(group)
    return reduce_scatter_impl(x, dim, list(sizes) or balanced_split(x.size(dim), pg.size()), pg)


@_reduce_scatter_op.register_fake
def _(x, dim, sizes, group):
    pg = _pg(group)
    chunks = list(sizes) or balanced_split(x.size(dim), pg.size())
    return x.new_empty(_with(x.shape, dim, chunks[pg.rank()]))


def _reduce_scatter_backward(ctx, grad):
    pg = _pg(ctx.group)
    sizes = list(ctx.sizes) or balanced_split(ctx.local, pg.size())
    return torch.ops.autoshard.all_gather(grad, ctx.dim, sizes, ctx.group), None, None, None


_reduce_scatter_op.register_autograd(_reduce_scatter_backward, setup_context=_gather_setup)
declare(torch.ops.autoshard.reduce_scatter.default)


def reduce_scatter(x: torch.Tensor, dim: int, *, group: GroupLike = None, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Sum ``x`` over ranks and return this rank's chunk along ``dim``. ``sizes``: the chunk sizes (default:
    balanced, larger first). Backward: all-gather of the gradient."""
    return torch.ops.autoshard.reduce_scatter(x, _dim(x, dim), list(sizes or []), group_name(group))


# ---------------------------------------------------------------------------- all_reduce


def all_reduce_impl(x: torch.Tensor, op: str, pg: dist.ProcessGroup) -> torch.Tensor:
    """Elementwise ``op`` (sum / max / min) of ``x`` over ranks; ``x`` is not modified."""
    world = pg.size()
    out = x.contiguous().clone()
    dist.all_reduce(out, op=_REDUCE_OPS[op], group=pg)
    nbytes = all_reduce_bytes(out.numel(), out.element_size(), world)
    record("all_reduce", nbytes, nbytes)
    return out


def define_all_reduce(name: str):
    """Define ``autoshard::<name>(x, op, group)``, :func:`all_reduce_impl` over the group named ``group``, and its
    fake, and declare it; the caller registers its gradient (:func:`all_reduce`'s; :func:`~.redistribute.reduce_partial`'s)."""
    def forward(x, op, group):
        return all_reduce_impl(x, op, _pg(group))

    custom = torch.library.custom_op(f"autoshard::{name}", forward, mutates_args=(),
                                     schema="(Tensor x, str op, str group) -> Tensor")
    custom.register_fake(lambda x, op, group: torch.empty_like(x))
    declare(getattr(torch.ops.autoshard, name).default)
    return custom


_all_reduce_op = define_all_reduce("all_reduce")


def _all_reduce_setup(ctx, inputs, output):
    ctx.op, ctx.group = inputs[1], inputs[2]
    if ctx.op != "sum":
        ctx.save_for_backward(inputs[0], output)


def _all_reduce_backward(ctx, grad):
    if ctx.op == "sum":
        return torch.ops.autoshard.all_reduce(grad, "sum", ctx.group), None, None
    # max / min: the summed gradient split evenly among the ranks that hold the extremum (torch.amax's rule
    # for ties); the gradient and the tie count travel in one all-reduce
    x, out = ctx.saved_tensors
    hit = (x == out).to(grad.dtype)
    total, ties = torch.ops.autoshard.all_reduce(torch.stack([grad, hit]), "sum", ctx.group).unbind(0)
    return total * hit / ties, None, None


_all_reduce_op.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)


def all_reduce(x: torch.Tensor, op: str = "sum", *, group: GroupLike = None) -> torch.Tensor:
    """Elementwise ``op`` (``"sum"`` or ``"max"``) over ranks, out of place. Backward: the summed gradient
    (for ``max``, split evenly among the ranks whose value is the maximum -- ``torch.amax``'s rule for
    ties -- and zero elsewhere; the tie counts ride along in the backward all-reduce)."""
    if op not in ("sum", "max"):
        raise ValueError(f"all_reduce: op must be 'sum' or 'max', not {op!r}")
    return torch.ops.autoshard.all_reduce(x, op, group_name(group))


# ---------------------------------------------------------------------------- all_to_all


def all_to_all_impl(
    x: torch.Tensor,
    split_dim: int,
    cat_dim: int,
    split_sizes_: Sequence[int],
    cat_sizes: Sequence[int],
    pg: dist.ProcessGroup,
) -> torch.Tensor:
    """Cut ``x`` along ``split_dim`` into ``split_sizes_`` (piece ``j`` goes to rank ``j``) and concatenate
    the pieces received from every rank along ``cat_dim`` (rank ``i``'s piece has ``cat_sizes[i]`` rows)."""
    world, rank = pg.size(), pg.rank()
    if split_dim == cat_dim:
        raise ValueError("all_to_all: split_dim and cat_dim must differ")
    moved = x.movedim(split_dim, 0).contiguous()
    cat_after = cat_dim if cat_dim < split_dim else cat_dim - 1  # cat_dim's index among the rest dims
    rest = list(moved.shape[1:])
    row = moved[0].numel() if moved.size(0) else _prod(rest)
    in_splits = [s * row for s in split_sizes_]
    out_shapes = []
    for i in range(world):
        shape = [split_sizes_[rank]] + rest
        shape[1 + cat_after] = cat_sizes[i]
        out_shapes.append(shape)
    out_splits = [_prod(s) for s in out_shapes]
    flat_out = moved.new_empty(sum(out_splits))
    dist.all_to_all_single(flat_out, moved.reshape(-1), out_splits, in_splits, group=pg)
    item = moved.element_size()
    record("all_to_all", (sum(in_splits) - in_splits[rank]) * item, (sum(out_splits) - out_splits[rank]) * item)
    pieces = torch.split(flat_out, out_splits)
    out = torch.cat([p.view(s) for p, s in zip(pieces, out_shapes)], 1 + cat_after)
    return out.movedim(0, split_dim).contiguous()


def exchange_impl(x: torch.Tensor, dim: int, send_sizes: Sequence[int], recv_sizes: Sequence[int],
                  pg: dist.ProcessGroup, kind: str = "all_to_all") -> torch.Tensor:
    """Cut ``x`` along ``dim`` into ``send_sizes`` (piece ``j`` goes to rank ``j``) and return the pieces received
    from every rank concatenated along the same ``dim`` in rank order (``recv_sizes[i]`` rows from rank ``i``). A
    rank's piece for itself is its own (``send_sizes[rank] == recv_sizes[rank]``, not sent)."""
    rank = pg.rank()
    moved = x.movedim(dim, 0).contiguous()
    row = _per_position(moved, 0)
    in_splits, out_splits = [n * row for n in send_sizes], [n * row for n in recv_sizes]
    flat_out = moved.new_empty(sum(out_splits))
    dist.all_to_all_single(flat_out, moved.reshape(-1), out_splits, in_splits, group=pg)
    item = moved.element_size()
    record(kind, (sum(in_splits) - in_splits[rank]) * item, (sum(out_splits) - out_splits[rank]) * item)
    return flat_out.view(sum(recv_sizes), *moved.shape[1:]).movedim(0, dim)


@torch.library.custom_op("autoshard::all_to_all", mutates_args=())
def _all_to_all_op(x: torch.Tensor, split_dim: int, cat_dim: int, split_sizes: list[int], cat_sizes: list[int],
                   group: str) -> torch.Tensor:
    return all_to_all_impl(x, split_dim, cat_dim, split_sizes, cat_sizes, _pg(group))


@_all_to_all_op.register_fake
def _(x, split_dim, cat_dim, split_sizes, cat_sizes, group):
    rank = _pg(group).rank()
    shape = _with(x.shape, split_dim, split_sizes[rank])
    shape[cat_dim] = sum(cat_sizes)
    return x.new_empty(shape)


def _all_to_all_setup(ctx, inputs, output):
    ctx.args = inputs[1:]


def _all_to_all_backward(ctx, grad):
    split_dim, cat_dim, split_sizes_, cat_sizes, group = ctx.args
    return torch.ops.autoshard.all_to_all(grad, cat_dim, split_dim, cat_sizes, split_sizes_, group), None, None, None, None, None


_all_to_all_op.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)
declare(torch.ops.autoshard.all_to_all.default)


def all_to_all(
    x: torch.Tensor,
    *,
    split_dim: int,
    cat_dim: int,
    group: GroupLike = None,
    split_sizes: Sequence[int] | None = None,
    cat_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Move the split of a tensor from ``cat_dim`` to ``split_dim``: cut ``x`` along ``split_dim`` (piece ``j``
    to rank ``j``; ``split_sizes`` default balanced) and concatenate what arrives along ``cat_dim``
    (``cat_sizes``: every rank's size along ``cat_dim``, default all equal). Backward: the reverse move."""
    pg = resolve_group(group)
    world = pg.size()
    split_dim, cat_dim = _dim(x, split_dim), _dim(x, cat_dim)
    cuts = list(split_sizes) if split_sizes is not None else balanced_split(x.size(split_dim), world)
    cats = list(cat_sizes) if cat_sizes is not None else [x.size(cat_dim)] * world
    if len(cuts) != world or sum(cuts) != x.size(split_dim):
        raise ValueError(f"all_to_all: split_sizes {cuts} must have {world} entries summing to {x.size(split_dim)}")
    if len(cats) != world or cats[pg.rank()] != x.size(cat_dim):
        raise ValueError(f"all_to_all: cat_sizes {cats} must have {world} entries, this rank's equal to "
                         f"{x.size(cat_dim)}")
    return torch.ops.autoshard.all_to_all(x, split_dim, cat_dim, cuts, cats, pg.group_name)


# ---------------------------------------------------------------------------- ring neighbours


class RingCommunicator:
    """Asynchronous exchange with ring neighbours, for overlapping communication with computation.

    ``start(tensors, shapes)`` posts the sends of ``tensors`` to the next rank (``r + 1``) and receives
    into fresh buffers of the given shapes from the previous rank, returning at once; ``wait()`` blocks
    until the exchange is done and returns the received tensors. Used by the ring attention algorithms;
    not differentiable (they define their own backward).
    """

    def __init__(self, group: GroupLike = None, direction: int = 1):
        self.pg = resolve_group(group)
        self.rank, self.world = self.pg.rank(), self.pg.size()
        self.send_to = (self.rank + direction) % self.world
        self.recv_from = (self.rank - direction) % self.world
        self._works: list[dist.Work] = []
        self._received: list[torch.Tensor] = []

    def start(self, tensors: Sequence[torch.Tensor], recv_like: Sequence[tuple[Sequence[int], torch.Tensor]] | None = None):
        """Post the exchange. ``recv_like``: (shape, prototype) per tensor to receive; default: same as sent."""
        if self._works:
            raise RuntimeError("RingCommunicator: wait() for the previous exchange first")
        recv_like = recv_like or [(t.shape, t) for t in tensors]
        self._received = [proto.new_empty(tuple(shape)) for shape, proto in recv_like]
        self._works = _p2p([(t, self.send_to) for t in tensors], [(t, self.recv_from) for t in self._received],
                           self.pg, "send_recv")
        return self

    def wait(self) -> list[torch.Tensor]:
        """Block until the posted exchange completes; return the received tensors."""
        for w in self._works:
            w.wait()
        self._works = []
        out, self._received = self._received, []
        return out
