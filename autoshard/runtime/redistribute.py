"""Placement transitions the compiler emits, with logical-tensor (DTensor-convention) gradients.

``reduce_partial``
    Partial -> Replicate: all-reduce. Backward: identity (the replicated gradient is every rank's
    gradient of its partial term).
``grad_sync`` / ``grad_sync_bucket``
    Replicate used by sharded computation: identity forward; backward all-reduces (sums) the
    gradient, which each rank computed from its own tokens only. Returns views, so parameters are
    not copied. A bucket syncs several parameters' gradients in one all-reduce once the last of
    them is ready, so backward has a few synchronization points instead of one per parameter.
``grad_scale``
    identity forward, gradient scaled by a constant (``grad_sync=False``: a replicated parameter's
    gradient becomes each rank's 1/P share).
``seq_realign``
    Shard(layout A) -> Shard(layout B) of the same sequence: each rank fetches the positions B gives it
    from their owners under A (point-to-point). Covers halo exchanges (B a shifted A) and any
    re-layout. Positions B holds several times are fetched several times; backward sends gradients
    back to the owners under A and adds them. Defined by :func:`define_run_moves`, as the convolutions' windows
    (:mod:`.conv_halo`) are: runs moved point to point, and their adjoint.
``seq_cumsum``
    cumulative sum along a sharded dim: local cumsum plus the sum of all earlier positions held by
    other ranks (an all-gather of per-interval totals). ``reverse=True`` sums from the end; each is the
    other's backward.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .collectives import _p2p, _pg, _with, all_gather_impl, define_all_reduce
from .layouts import SequenceLayout
from .op_info import declare

__all__ = ["reduce_partial", "grad_sync", "grad_sync_bucket", "grad_scale", "seq_realign", "seq_cumsum", "realign_plan",
           "realign_bytes", "runs_bytes", "cumsum_totals_bytes", "define_run_moves"]


# ---------------------------------------------------------------------------- reduce_partial


_reduce_partial = define_all_reduce("reduce_partial")
_reduce_partial.register_autograd(lambda ctx, g: (g, None, None))


def reduce_partial(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    """Partial(op) -> Replicate over the group named ``group``; gradient passes through unchanged."""
    return torch.ops.autoshard.reduce_partial(x, op, group)


# ---------------------------------------------------------------------------- grad_sync / grad_scale


class _GradSync(torch.autograd.Function):
    """Identity on several tensors; backward sums all their gradients over the group in one all-reduce."""

    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        present = [g for g in grads if g is not None]
        if not present:
            return (None,) + grads
        flat = torch.cat([g.reshape(-1) for g in present]) if len(present) > 1 else present[0].reshape(-1)
        summed = torch.ops.autoshard.reduce_partial(flat.contiguous(), "sum", ctx.group)
        pieces = iter(torch.split(summed, [g.numel() for g in present]))
        return (None,) + tuple(next(pieces).view_as(g) if g is not None else None for g in grads)


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def grad_sync(x: torch.Tensor, group: str) -> torch.Tensor:
    """Identity whose backward sums the gradient over the group (a replicated value used by sharded work)."""
    return _GradSync.apply(group, x)[0]


def grad_sync_bucket(group: str, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``grad_sync`` of several tensors with one all-reduce, when the last of their gradients is ready
    (the bucket of parameters of a layer, as DDP does)."""
    return _GradSync.apply(group, *xs)


def grad_scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity whose backward multiplies the gradient by ``factor``."""
    return _GradScale.apply(x, factor)


# ---------------------------------------------------------------------------- realign


@functools.lru_cache(maxsize=1024)
def realign_plan(src: SequenceLayout, dst: SequenceLayout, rank: int):
    """For ``rank``: what to send and receive to turn a ``src``-sharded tensor into a ``dst``-sharded one.

    Returns ``(keep, sends, recvs)``: ``keep`` lists (dst_local_start, src_local_start, n) runs copied
    locally; ``sends[peer]`` lists (src_local_start, n) runs this rank sends ``peer``; ``recvs[peer]``
    lists (dst_local_start, n) runs received from ``peer``, in the order the peer sends them.
    """
    def runs(layout: SequenceLayout, r: int, lo: int, hi: int):
        """Local runs of rank r's positions inside [lo, hi): (local_start, global_start, n)."""
        out, local = [], 0
        for s, e in layout.local_intervals(r):
            a, b = max(s, lo), min(e, hi)
            if b > a:
                out.append((local + a - s, a, b - a))
            local += e - s
        return out

    def pieces(dst_rank: int):
        """(dst_local, src_rank, src_local, n) for every run dst_rank needs, in dst order."""
        result, dst_local = [], 0
        for s, e in dst.local_intervals(dst_rank):
            pos = s
            while pos < e:
                owner = src.owner(min(max(pos, 0), src.length - 1))
                owner_runs = runs(src, owner, pos, e)
                if not owner_runs or owner_runs[0][1] != pos:
                    raise ValueError(f"realign: position {pos} is not held by its owner {owner}")
                src_local, _, n = owner_runs[0]
                result.append((dst_local + pos - s, owner, src_local, n))
                pos += n
            dst_local += e - s
        return result

    world = src.world_size
    keep, recvs = [], {p: [] for p in range(world)}
    for dst_local, owner, src_local, n in pieces(rank):
        if owner == rank:
            keep.append((dst_local, src_local, n))
        else:
            recvs[owner].append((dst_local, n))
    sends = {p: [] for p in range(world)}
    for peer in range(world):
        if peer == rank:
            continue
        for _, owner, src_local, n in pieces(peer):
            if owner == rank:
                sends[peer].append((src_local, n))
    return tuple(keep), sends, recvs


def runs_bytes(plan_of, world: int, row_bytes: int, phase: str) -> list[int]:
    """Bytes every rank sends under a point-to-point plan (``plan_of(rank)``: (kept, sends, receives), each run a
    number of ``row_bytes`` positions): its sends forward, its receives (the gradients going back) backward."""
    out = []
    for rank in range(world):
        _, sends, recvs = plan_of(rank)
        runs = sends if phase == "forward" else recvs
        out.append(sum(n for peer_runs in runs.values() for _, n in peer_runs) * row_bytes)
    return out


def realign_bytes(src: SequenceLayout, dst: SequenceLayout, row_bytes: int, phase: str) -> list[int]:
    """Bytes every rank sends to move ``row_bytes``-a-position values from ``src`` to ``dst`` (``"forward"``) or their
    gradients back (``"backward"``)."""
    return runs_bytes(functools.partial(realign_plan, src, dst), src.world_size, row_bytes, phase)


def _move_runs(x: torch.Tensor, dim: int, out: torch.Tensor, keep, outgoing: dict, incoming: dict, pg,
               combine: str, kind: str) -> torch.Tensor:
    """Runs of ``x`` along ``dim`` into ``out`` (``combine``: ``"copy_"`` or ``"add_"``): ``keep`` holds the
    local ``(to, from, length)`` runs, ``outgoing`` peer -> the ``(from, length)`` runs sent to it,
    ``incoming`` peer -> the ``(to, length)`` runs received from it, in order. The bytes are counted as
    ``kind``."""
    for to, frm, n in keep:
        getattr(out.narrow(dim, to, n), combine)(x.narrow(dim, frm, n))
    send_list = [(torch.cat([x.narrow(dim, s, n) for s, n in runs], dim), peer) for peer, runs in outgoing.items() if runs]
    recv_bufs = {peer: x.new_empty(_with(x.shape, dim, sum(n for _, n in runs))) for peer, runs in incoming.items() if runs}
    for w in _p2p(send_list, [(buf, peer) for peer, buf in recv_bufs.items()], pg, kind):
        w.wait()
    for peer, buf in recv_bufs.items():
        off = 0
        for to, n in incoming[peer]:
            getattr(out.narrow(dim, to, n), combine)(buf.narrow(dim, off, n))
            off += n
    return out


def define_run_moves(name: str, arg_names: tuple[str, str], plan: Callable, lengths: Callable, kind: str, *,
                     zero_fill: bool = False) -> None:
    """Define ``autoshard::<name>(x, dim, a, b, group)`` (``a`` and ``b`` named ``arg_names``): the runs of ``x``
    along ``dim`` moved between the ranks of ``group`` as ``plan(a, b, rank)`` says (``(keep, sends, receives)``,
    :func:`realign_plan`'s form) into a tensor of ``lengths(a, b, rank)[1]`` positions along ``dim`` (zeros where
    no run lands with ``zero_fill``), the bytes counted as ``kind``; and its backward
    ``autoshard::<name>_backward(g, dim, a, b, group)``, the adjoint: gradients return to their source owners and
    are added there into ``lengths(a, b, rank)[0]`` positions (what this rank received forward, it now sends back;
    what it sent, it receives back)."""
    first, second = arg_names
    signature = f"(Tensor {{}}, SymInt dim, SymInt[] {first}, SymInt[] {second}, str group) -> Tensor"

    def forward(x, dim, a, b, group):
        pg = _pg(group)
        keep, sends, recvs = plan(a, b, pg.rank())
        out = (x.new_zeros if zero_fill else x.new_empty)(_with(x.shape, dim, lengths(a, b, pg.rank())[1]))
        return _move_runs(x, dim, out, keep, sends, recvs, pg, "copy_", kind)

    def backward(g, dim, a, b, group):
        pg = _pg(group)
        keep, sends, recvs = plan(a, b, pg.rank())
        out = g.new_zeros(_with(g.shape, dim, lengths(a, b, pg.rank())[0]))
        return _move_runs(g, dim, out, [(frm, to, n) for to, frm, n in keep], recvs, sends, pg, "add_", kind)

    forward_op = torch.library.custom_op(f"autoshard::{name}", forward, mutates_args=(),
                                         schema=signature.format("x"))
    backward_op = torch.library.custom_op(f"autoshard::{name}_backward", backward, mutates_args=(),
                                          schema=signature.format("g"))
    for op, side in ((forward_op, 1), (backward_op, 0)):
        op.register_fake(lambda t, dim, a, b, group, side=side:
                         t.new_empty(_with(t.shape, dim, lengths(a, b, _pg(group).rank())[side])))
    backward_packet = getattr(torch.ops.autoshard, f"{name}_backward")
    declare(getattr(torch.ops.autoshard, name).default)
    declare(backward_packet.default)
    forward_op.register_autograd(lambda ctx, g: (backward_packet(g, *ctx.args), None, None, None, None),
                                 setup_context=_keep_arguments)


def _keep_arguments(ctx, inputs, output):
    ctx.args = inputs[1:]


def _realign_lengths(src: list[int], dst: list[int], rank: int) -> tuple[int, int]:
    return SequenceLayout.decode(src).local_length(rank), SequenceLayout.decode(dst).local_length(rank)


define_run_moves("seq_realign", ("src", "dst"),
                 lambda src, dst, rank: realign_plan(SequenceLayout.decode(src), SequenceLayout.decode(dst), rank),
                 _realign_lengths, "realign")


def seq_realign(x: torch.Tensor, dim: int, src: SequenceLayout, dst: SequenceLayout, group: str) -> torch.Tensor:
    """Re-shard ``x`` (sharded along ``dim`` by ``src``) so that it is sharded by ``dst``."""
    if src == dst:
        return x
    return torch.ops.autoshard.seq_realign(x, dim, src.encode(), dst.encode(), group)


# ---------------------------------------------------------------------------- cumsum


def _cumsum_impl(x: torch.Tensor, dim: int, layout: SequenceLayout, reverse: bool, pg) -> torch.Tensor:
    rank, world = pg.rank(), pg.size()
    ivs = layout.local_intervals(rank)
    lengths = [e - s for s, e in ivs]
    pieces = list(torch.split(x, lengths, dim)) if len(ivs) > 1 else ([x] if ivs else [])
    flip = (lambda t: t.flip(dim)) if reverse else (lambda t: t)  # noqa: E731
    local = [flip(flip(p).cumsum(dim)) for p in pieces]
    # per-interval totals of every rank, padded to the largest interval count
    width = _interval_width(layout)
    zero = torch.zeros_like(x.sum(dim))
    totals = torch.stack([p.sum(dim) for p in pieces] + [zero] * (width - len(pieces)))
    gathered = all_gather_impl(totals, 0, [width] * world, pg).unflatten(0, (world, width))
    starts = [(s, r, i) for r in range(world) for i, (s, _) in enumerate(layout.local_intervals(r))]
    out = []
    for (s, _), piece in zip(ivs, local):
        before = [gathered[r, i] for s2, r, i in starts if (s2 > s if reverse else s2 < s)]
        offset = torch.stack(before).sum(0) if before else torch.zeros_like(gathered[0, 0])
        out.append(piece + offset.unsqueeze(dim))
    if not out:
        return x.clone()
    return torch.cat(out, dim) if len(out) > 1 else out[0]


def _interval_width(layout: SequenceLayout) -> int:
    """The most intervals of ``layout`` a rank holds (every rank's totals are padded to as many)."""
    return max(len(layout.local_intervals(r)) for r in range(layout.world_size))


def cumsum_totals_bytes(layout: SequenceLayout, row_bytes: int) -> int:
    """Bytes of the per-interval totals one rank contributes to :func:`seq_cumsum`'s all-gather."""
    return _interval_width(layout) * row_bytes


@torch.library.custom_op("autoshard::seq_cumsum", mutates_args=())
def _seq_cumsum(x: torch.Tensor, dim: int, layout: list[int], reverse: bool, group: str) -> torch.Tensor:
    return _cumsum_impl(x, dim, SequenceLayout.decode(layout), reverse, _pg(group))


@_seq_cumsum.register_fake
def _(x, dim, layout, reverse, group):
    return torch.empty_like(x)


def _cumsum_setup(ctx, inputs, output):
    ctx.dim, ctx.layout, ctx.reverse, ctx.group = inputs[1:]


_seq_cumsum.register_autograd(
    lambda ctx, g: (torch.ops.autoshard.seq_cumsum(g, ctx.dim, ctx.layout, not ctx.reverse, ctx.group),
                    None, None, None, None),
    setup_context=_cumsum_setup)


declare(torch.ops.autoshard.seq_cumsum.default)


def seq_cumsum(x: torch.Tensor, dim: int, layout: SequenceLayout, group: str, reverse: bool = False) -> torch.Tensor:
    """Cumulative sum of a tensor sharded along ``dim`` by ``layout``, over the whole sequence."""
    return torch.ops.autoshard.seq_cumsum(x, dim, layout.encode(), reverse, group)

