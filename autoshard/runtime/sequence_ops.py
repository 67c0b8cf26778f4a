"""Runtime ops for values that reach the split sequence through their *data*: positions chosen by a
comparison (``argmax`` of an end-of-text token), rows read at those positions, and constant buffers
whose values the compiler read as a mask.

``seq_arg_extreme``
    ``max`` / ``min`` with indices (and so ``argmax`` / ``argmin``) along a split dim. Each rank takes
    its shard's extreme and the *global* position of it; one all-gather of those few values (packed as
    bytes: value and int64 index per output element) lets every rank pick the same winner -- the
    extreme, NaN first as torch's ``max`` propagates it, ties to the smallest position, as one device
    does. A rank without a position of the dim offers the reduction's identity at position ``length``,
    which never wins. Backward: the rank holding the winner puts the (replicated) value gradient there;
    no communication.
``seq_local_index``
    Where global positions sit on one rank: the local index, or -1 where another rank holds the
    position (negative positions count from the end, as indexing does). The rules read rows at
    data-dependent positions with it: each rank reads the rows it holds and zeros elsewhere, a partial
    sum whose all-reduce moves only the rows read.
``local_arange``, ``select_owned``
    The same for positions the compiler knows: an ``arange`` built at this rank's positions only, and the
    row at one global position on the rank that holds it, zeros elsewhere (``hidden[:, 0]``).
``check_band`` / ``check_runs``
    A guard on a constant buffer that the compiler read as a structured mask (nanoGPT's
    ``tril(ones(N, N))``): each call checks, in O(1), that the buffer is the same tensor at the same
    version as when it was last verified; when it was replaced or changed in place, its values are
    verified again (:func:`constant_band`) and a buffer that no longer holds the band fails loudly
    instead of running a wrong mask. ``check_runs`` guards positions compared inside segments that an earlier
    graph made (the compiler read ``P[k] <= P[q]`` inside a segment as ``k <= q``): on every call, in O(S),
    segment ids never decrease and positions grow by one inside a segment, or it raises.

Every op is a ``torch.library`` custom op with a fake implementation, so the inner compilers trace it
(``local_arange`` and ``select_owned`` are plain functions, traced through).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .collectives import _pg, all_gather_impl
from .layouts import SequenceLayout
from .op_info import declare
from .reductions import extreme_identity

__all__ = ["Band", "constant_band", "local_index", "local_arange", "select_owned"]


# ---------------------------------------------------------------------------- positions on this rank


def local_index(index: torch.Tensor, layout: SequenceLayout, rank: int) -> torch.Tensor:
    """The local index on ``rank`` of every global position in ``index`` (-1 where another rank holds it)."""
    glob = torch.where(index < 0, index + layout.length, index)
    out = torch.full_like(glob, -1)
    local = 0
    for start, stop in layout.local_intervals(rank):
        out = torch.where((glob >= start) & (glob < stop), glob - start + local, out)
        local += stop - start
    return out


def local_arange(start, step, layout_code: list[int], rank: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``start + step * p`` for the global positions ``p`` of ``rank`` under the layout (a split ``arange``)."""
    positions = SequenceLayout.decode(layout_code).positions(rank, device=device)
    return (positions * step + start).to(dtype)


def select_owned(x: torch.Tensor, dim: int, position: int, layout_code: list[int], rank: int) -> torch.Tensor:
    """``x.select(dim, position)`` on the rank that holds global ``position``, zeros elsewhere (a partial sum)."""
    layout = SequenceLayout.decode(layout_code)
    local = 0
    for s, e in layout.local_intervals(rank):
        if s <= position < e:
            return x.select(dim, local + position - s)
        local += e - s
    # zeros that stay connected to ``x`` (every rank must run the same backward, and its collectives): the sum of
    # an empty slice, so no inf or NaN of ``x`` reaches them, in ``x``'s dtype (bool and integers too)
    return x.narrow(dim, 0, 0).sum(dim, dtype=x.dtype)


@torch.library.custom_op("autoshard::seq_local_index", mutates_args=())
def _seq_local_index(index: torch.Tensor, layout: list[int], rank: int) -> torch.Tensor:
    return local_index(index, SequenceLayout.decode(layout), rank)


@_seq_local_index.register_fake
def _(index, layout, rank):
    return torch.empty_like(index)


declare(torch.ops.autoshard.seq_local_index.default)


# ---------------------------------------------------------------------------- max / min with indices


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@torch.library.custom_op("autoshard::seq_arg_extreme", mutates_args=())
def _seq_arg_extreme(x: torch.Tensor, dim: int, keepdim: bool, largest: bool, layout: list[int],
                     group: str) -> tuple[torch.Tensor, torch.Tensor]:
    pg = _pg(group)
    lay = SequenceLayout.decode(layout)
    if x.size(dim):
        value, index = x.max(dim, keepdim=True) if largest else x.min(dim, keepdim=True)
        index = lay.positions(pg.rank(), device=x.device)[index]
    else:
        shape = [1 if d == dim else n for d, n in enumerate(x.shape)]
        value = x.new_full(shape, extreme_identity(x.dtype, largest))
        index = torch.full(shape, lay.length, dtype=torch.long, device=x.device)
    packed = torch.cat([_as_bytes(value), _as_bytes(index)])
    table = all_gather_impl(packed[None], 0, [1] * pg.size(), pg)  # [P, bytes]: every rank's candidates
    split = value.numel() * value.element_size()
    values = table[:, :split].contiguous().view(x.dtype).view(-1, *value.shape)
    indices = table[:, split:].contiguous().view(torch.long).view(-1, *index.shape)
    best = values.amax(0) if largest else values.amin(0)  # NaN wins, as torch's max / min propagate it
    hit = values == best
    if x.dtype.is_floating_point:
        hit |= values.isnan() & best.isnan()
    index = torch.where(hit, indices, lay.length).amin(0)
    return (best, index) if keepdim else (best.squeeze(dim), index.squeeze(dim))


@_seq_arg_extreme.register_fake
def _(x, dim, keepdim, largest, layout, group):
    shape = [n for d, n in enumerate(x.shape) if d != dim or keepdim]
    if keepdim:
        shape[dim] = 1
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.long)


def _arg_extreme_setup(ctx, inputs, output):
    x, ctx.dim, ctx.keepdim, _, ctx.layout, ctx.group = inputs
    ctx.shape = x.shape
    ctx.save_for_backward(output[1])


def _arg_extreme_backward(ctx, grad, _grad_index):
    """The value's gradient goes to the winning position, on the rank that holds it."""
    (index,) = ctx.saved_tensors
    out = grad.new_zeros(ctx.shape)
    if not out.numel():
        return out, None, None, None, None, None
    if not ctx.keepdim:
        index, grad = index.unsqueeze(ctx.dim), grad.unsqueeze(ctx.dim)
    local = local_index(index, SequenceLayout.decode(ctx.layout), _pg(ctx.group).rank())
    out.scatter_(ctx.dim, local.clamp(min=0), torch.where(local >= 0, grad, 0))
    return out, None, None, None, None, None


_seq_arg_extreme.register_autograd(_arg_extreme_backward, setup_context=_arg_extreme_setup)
declare(torch.ops.autoshard.seq_arg_extreme.default)


# ---------------------------------------------------------------------------- constant band buffers


@dataclass(frozen=True)
class Band:
    """A tensor whose every ``[..., i, j]`` is ``inside`` where ``lo <= j - i <= hi`` and ``outside``
    elsewhere (the same matrix for every leading index). ``lo`` / ``hi`` equal to ``-(rows - 1)`` /
    ``columns - 1`` bound nothing."""

    inside: float
    outside: float
    lo: int
    hi: int


def constant_band(x: torch.Tensor) -> Band | None:
    """The :class:`Band` ``x`` holds, or None. Read once, at compile time or after a change: a few passes of
    one byte per element over the matrix, no sort and no index matrix."""
    if x.dim() < 2 or not x.numel():
        return None
    x = x.detach()
    first = x.reshape(-1, *x.shape[-2:])[0]
    if not bool((x == first).all()):
        return None
    a = first[0, 0]
    b = first.reshape(-1)[(first != a).reshape(-1).byte().argmax()]  # another value, or ``a`` again
    if not bool(((first == a) | (first == b)).all()):
        return None
    rows, columns = first.shape
    index = torch.arange(rows, device=x.device)
    for inside, outside in ((a, b), (b, a)):
        hit = first == inside
        held = hit.any(1)
        lo = int((hit.byte().argmax(1) - index)[held].min())  # the first hit of every row that has one
        hi = int((columns - 1 - hit.flip(1).byte().argmax(1) - index)[held].max())  # and the last
        if torch.equal(hit, torch.ones_like(hit).tril(hi).triu(lo)):
            return Band(float(inside), float(outside), lo, hi)
    return None


_VERIFIED = WeakIdKeyDictionary()
"""Buffer -> (version, data pointer) when it was last verified to hold its band."""


@torch.library.custom_op("autoshard::check_band", mutates_args=())
def _check_band(x: torch.Tensor, inside: float, outside: float, lo: int, hi: int, name: str) -> None:
    state = (x._version, x.data_ptr())
    if _VERIFIED.get(x) == state:
        return
    if constant_band(x) != Band(inside, outside, lo, hi):
        raise RuntimeError(
            f"autoshard: the buffer {name} no longer holds the mask the compiler read from it when compiling "
            f"(value {inside} for key - query in [{lo}, {hi}], {outside} elsewhere); a buffer read as a mask must "
            f"stay constant: call torch._dynamo.reset() to compile again with its new values")
    _VERIFIED[x] = state


@_check_band.register_fake
def _(x, inside, outside, lo, hi, name):
    return None


declare(torch.ops.autoshard.check_band.default)


torch.fx.node.has_side_effect(torch.ops.autoshard.check_band.default)


@torch.library.custom_op("autoshard::check_runs", mutates_args=())
def _check_runs(segments: torch.Tensor, positions: torch.Tensor, names: str) -> None:
    segments, positions = torch.broadcast_tensors(segments, positions)
    same = segments[..., 1:] == segments[..., :-1]
    if not (bool((segments[..., 1:] >= segments[..., :-1]).all())
            and bool(((positions[..., 1:] - positions[..., :-1]) == 1)[same].all())):
        raise RuntimeError(
            f"autoshard: the attention mask compares positions inside segments ({names}), which the compiler read as "
            f"a causal mask inside each segment: that holds only when segment ids never decrease along the sequence "
            f"and positions grow by one inside a segment, and these do not")


@_check_runs.register_fake
def _(segments, positions, names):
    return None


declare(torch.ops.autoshard.check_runs.default)


torch.fx.node.has_side_effect(torch.ops.autoshard.check_runs.default)
