"""Shape and layout ops: views (``view_as_complex`` / ``view_as_real`` among them), permutes, expands,
repeat_interleave, repeat, indexing, splits, concatenation, padding.

Shape ops are declarative: ``SHAPE_OPS`` holds one line per op, its *dim map* (:mod:`.dim_maps`: which input
dims or factors each output dim is made of), and one link and one rewrite interpret every map. Views follow
*factors*: the input's dims are cut into factors, the output's dims are matched against consecutive factors
(merging or splitting them), and matched factors are the same positions. A factor cut in two by a view starts
new, unlinked factors: the sequence cannot be followed through it, and a split value there is gathered.
``repeat_interleave`` by an int appends an inner factor to the repeated dim, so a merged ``[B*S]`` repeated per
token (MoE routing) stays split; ``repeat`` puts an outer factor before it, so a ``[N]`` repeated whole per
expert (Llama-4's ``hidden.repeat(E, 1)``: ``[E*N]``) stays split along its inner ``N``.

Indexing along the sequence is exact on shards: a step-1 slice keeps each rank's positions inside the
range (a derived layout: the shifted labels of a causal LM), selecting one position gives a partial
value held by its owner (``hidden[:, 0]``: the CLS token), and so does indexing it with a tensor of
positions (``hidden[arange(B), eos_index]``: CLIP's pooling): each rank reads the rows it holds
(``autoshard::seq_local_index``) and zeros elsewhere, and the all-reduce that makes the partial value
whole moves only the rows read. Constant int lists are advanced indices too: on
another dim they keep the split (Falcon's ``fused_qkv[..., [-2], :]``), on the split dim they gather.
Concatenation, splitting, stacking and padding are in :mod:`.joins`. A view that merges several dims into the length of an attention's queries, none of them such a
length itself (a DiT's patchify, ``conv3d(...).flatten(2)``), starts a sequence: the patch grid before it is
whole, the tokens after it split.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
import torch.fx as fx

from ...placements import REPLICATE, Partial, Shard
from ...runtime.sequence_ops import select_owned  # the module defines autoshard::seq_local_index too
from ..ops import Op, is_tensor_node, permutation, shape_of, size_key, value_of
from .registry import register
from .dim_maps import (Broadcast, DimMap, Factors, InputDim, NewDim, Repeat, output_factors, pieces, reshape_map,
                       source_of)
from .pointwise import OUTPUT_WHOLE, run_whole, whole_args

__all__ = ["SHAPE_OPS", "ShapeOp", "link_shape_op", "parse_index", "IndexItem", "IndexSlice", "IndexSelect", "IndexNew",
           "IndexTensor", "IndexList", "local_range"]

SPLIT_STARTS = "the split starts at this value"
"""Why a view, repeat or index whose output starts a split takes its input whole: an expected gather."""

# ============================================================================= shape ops: dim maps
#
# Each shape op is one line of SHAPE_OPS: the dim map of a node (:mod:`.dim_maps`), how it runs on this rank's
# input, and what it does when its output is not split. One link and one rewrite interpret every map.


@dataclass(frozen=True)
class ShapeOp:
    """A shape op: its dim map and how it runs."""

    dim_map: Callable[[fx.Node, Op, Callable], DimMap | None]
    """``(node, op, factorization)``: the node's dim map (``factorization(node)`` gives a value's factors); None
    where none follows the elements (``repeat_interleave`` by per-element counts)."""
    emit: Callable[[Any, fx.Node, Op, fx.Node, Shard], fx.Node]
    """``(rw, node, op, x, out)``: the op on ``x``, this rank's input, giving its part of the output ``out``."""
    whole: Callable[[Any, fx.Node, Op], None]
    """``(rw, node, op)``: rewrite the node whose output is not split."""


SEQUENCE_STARTS = "autoshard_sequence_starts"
"""Node meta: the output dims of a view where a sequence starts (:func:`_starting_sequences`)."""


def _reshaped(node, op, factorization) -> DimMap:
    return _with_starts(node, reshape_map(factorization(op["input"]), shape_of(node)))


def _with_starts(node, dim_map: DimMap) -> DimMap:
    """``dim_map`` with the dims where the link found a sequence starting (``SEQUENCE_STARTS``) made new."""
    starts = node.meta.get(SEQUENCE_STARTS, ())
    return tuple(NewDim(shape_of(node)[d]) if d in starts else spec for d, spec in enumerate(dim_map))


def _starting_sequences(dim_map: DimMap, in_factors, attention_lengths, joined_lengths) -> tuple[int, ...]:
    """The output dims where a view starts a sequence: it merges several dims into the length of an attention's
    queries or of a part they are concatenated from (``joined_lengths``), none of them an attention's length
    itself -- a DiT's patchify (``conv3d(...).flatten(2)``: frames x height x width patches become the tokens;
    SD3's image tokens before they join the text). The tokens are then a sequence of their own, split from here on;
    the patch grid before is whole on every rank. A merge that keeps an attention's sequence as one of its
    factors (``[B, S] -> [B*S]``) is followed factor by factor instead."""
    starts = []
    for d, spec in enumerate(dim_map):
        sizes = [size for size, _ in pieces(spec, in_factors) if size != 1]
        if (isinstance(spec, Factors) and len(sizes) > 1
                and size_key(math.prod(sizes)) in attention_lengths | joined_lengths
                and not attention_lengths.intersection(map(size_key, sizes))):
            starts.append(d)
    return tuple(starts)


def _complex_view_map(node, op, factorization) -> DimMap:
    """``view_as_complex`` / ``view_as_real``: the dims both sides have are the same positions."""
    shared = min(len(shape_of(op["input"])), len(shape_of(node)))
    return tuple(InputDim(d) for d in range(shared)) + tuple(NewDim(s) for s in shape_of(node)[shared:])


def _permuted(node, op, factorization) -> DimMap:
    return tuple(InputDim(p) for p in permutation(node))


def _expanded(node, op, factorization) -> DimMap:
    out_shape, in_shape = shape_of(node), shape_of(op["input"])
    lead = len(out_shape) - len(in_shape)
    kept = (InputDim(d) if size == out_shape[lead + d] else Broadcast(out_shape[lead + d]) for d, size in enumerate(in_shape))
    return tuple(Broadcast(s) for s in out_shape[:lead]) + tuple(kept)


def _repeated(node, op, factorization) -> DimMap | None:
    """Repeating each element ``k`` times appends an inner factor ``k`` to the dim: its own factors (the sequence
    among them: MoE's ``hidden[B*S, D].repeat_interleave(top_k, 0)``) are followed through; a size-1 dim repeated
    is new positions."""
    d = _repeated_dim(op)
    if d is None:
        return None
    in_shape = shape_of(op["input"])
    repeated = Repeat(d, op["repeats"]) if in_shape[d] != 1 else NewDim(shape_of(node)[d])
    return tuple(repeated if dim == d else InputDim(dim) for dim in range(len(in_shape)))


def _tiled(node, op, factorization) -> DimMap:
    """``x.repeat(*sizes)``: leading new dims and size-1 dims repeated are copies of one element; a dim repeated
    ``k > 1`` times is ``k`` copies of it, an outer factor before its own (the sequence among them)."""
    sizes, in_shape = op["sizes"], shape_of(op["input"])
    lead = len(sizes) - len(in_shape)
    kept = (InputDim(d) if times == 1 else Broadcast(size * times) if size == 1 else Repeat(d, times, whole=True)
            for d, (size, times) in enumerate(zip(in_shape, sizes[lead:])))
    return tuple(Broadcast(s) for s in sizes[:lead]) + tuple(kept)


def _repeated_dim(op: Op) -> int | None:
    """The dim whose elements ``repeat_interleave`` repeats an int number of times; None for counts per
    element (a tensor) or no dim (the input flattened first)."""
    repeats, dim = op["repeats"], op["dim"]
    if isinstance(repeats, int) and not isinstance(repeats, bool) and dim is not None:
        return dim % len(shape_of(op["input"]))
    return None


def _to_local_shape(method: str) -> Callable:
    """Emit ``x.<method>(local shape of the output)`` (``reshape``, ``expand``)."""
    def emit(rw, node, op, x, out):
        return rw.method(method, x, tuple(rw.local_shape(node, out)))

    return emit


def _reemitted(rw, node, op, x, out):
    """The node's own call on ``x`` (its other arguments are dims, not sizes)."""
    return rw.reemit(node, (x,) + tuple(rw.value(a) for a in node.args[1:]), rw.value(node.kwargs))


def _tile_local(rw, node, op, x, out):
    """``x.repeat(*sizes)`` on this rank's part; copies along the split dim (a size-1 or leading dim repeated) are
    as many as this rank holds."""
    sizes = list(op["sizes"])
    if isinstance(_tiled(node, op, None)[out.dim], Broadcast):
        sizes[out.dim] = rw.local_shape(node, out)[out.dim]
    return rw.method("repeat", x, tuple(sizes))


def _repeat_local(rw, node, op, x, out):
    return rw.call(torch.repeat_interleave, x, op["repeats"], _repeated_dim(op))


def _whole_keeping_partial(rw, node, op) -> None:
    """A partial input stays partial (the op moves elements, it adds none); anything else runs whole."""
    have = rw.placement(op["input"])
    if isinstance(have, Partial):
        rw.done(node, rw.reemit(node), have)
    else:
        run_whole(rw, node, OUTPUT_WHOLE, expected=True)


def _whole(rw, node, op) -> None:
    """The op runs whole, a partial input reduced first."""
    run_whole(rw, node, OUTPUT_WHOLE, expected=True)


def _whole_repeat(rw, node, op) -> None:
    """A split input repeated per-element or flattened (no dim map), or into an output left whole: a fallback."""
    if isinstance(rw.placement(op["input"]), Shard):
        rw.fallback(node, "repeating a split value by per-element counts or flattened")
    else:
        run_whole(rw, node, OUTPUT_WHOLE, expected=True)


SHAPE_OPS: dict[str, ShapeOp] = {
    "view": ShapeOp(_reshaped, _to_local_shape("reshape"), _whole_keeping_partial),  # also flatten, squeeze, ...
    "complex_view": ShapeOp(_complex_view_map, _reemitted, _whole_keeping_partial),
    "permute": ShapeOp(_permuted, _reemitted, _whole_keeping_partial),  # also transpose, movedim, t
    "expand": ShapeOp(_expanded, _to_local_shape("expand"), _whole),
    "repeat_interleave": ShapeOp(_repeated, _repeat_local, _whole_repeat),
    "repeat": ShapeOp(_tiled, _tile_local, _whole),
}


def link_shape_op(ctx, node, op):
    """Whole input dims are linked dim to dim (:meth:`~autoshard.passes.infer.LinkContext.link_dims`, which lets a
    dim take a merge it meets), then merged, cut and repeated dims factor by factor."""
    src = op["input"]
    in_factors = ctx.factorization(src)
    if op.name == "view":  # decided here, from the plain map, so that linking the graph again decides the same
        plain = reshape_map(in_factors, shape_of(node))
        node.meta[SEQUENCE_STARTS] = _starting_sequences(plain, in_factors, ctx.attention_lengths, ctx.joined_lengths)
        dim_map = _with_starts(node, plain)
    else:
        dim_map = SHAPE_OPS[op.name].dim_map(node, op, ctx.factorization)
    if dim_map is None:
        return
    ctx.set_factorization(node, output_factors(dim_map, in_factors))
    for d, spec in enumerate(dim_map):
        if isinstance(spec, InputDim):
            ctx.link_dims(node, d, src, spec.dim)
    for d, spec in enumerate(dim_map):
        if not isinstance(spec, InputDim):
            for f, (size, source) in enumerate(pieces(spec, in_factors)):
                if source is not None and size != 1:
                    ctx.link((src, *source), (node, d, f))


def rewrite_shape_op(rw, node, op):
    """The input split where the output's sequence factor comes from; where it comes from no input factor, the
    split starts here (the op runs whole, this rank keeps its part); a broadcast one takes the input whole."""
    shape_op = SHAPE_OPS[op.name]
    src = op["input"]
    out = rw.out_shard(node)
    dim_map = shape_op.dim_map(node, op, lambda n: _factors(rw, n)) if out is not None else None
    if dim_map is None:
        shape_op.whole(rw, node, op)
        return
    if isinstance(dim_map[out.dim], Broadcast):
        x = rw.input(src, REPLICATE, partial_grad=True)
    else:
        in_factors = _factors(rw, src)
        source = source_of(dim_map, in_factors, out.dim, out.factor)
        if source is None:
            whole = rw.reemit(node, *whole_args(rw, node, SPLIT_STARTS, expected=True))
            rw.done(node, rw.shard_value(node, whole, out), out)
            return
        d_in, f_in = source
        merged = len(in_factors[d_in]) > 1
        x = rw.input(src, Shard(d_in, out.layout, tuple(in_factors[d_in]) if merged else (), f_in if merged else 0))
    rw.done(node, shape_op.emit(rw, node, op, x, out), out)


def _factors(rw, node: fx.Node) -> list[list[int]]:
    """The factorization inference gave ``node`` (one factor per dim when it gave none)."""
    return rw.families.factors.get(node) or [[s] for s in shape_of(node)]


for _name in SHAPE_OPS:
    register(_name, link=link_shape_op, rewrite=rewrite_shape_op)


# ============================================================================= indexing


@dataclass(frozen=True, eq=False)
class IndexSlice:
    """``start:stop:step`` over input dim ``dim`` (clamped to it; ``stop`` None: to its end)."""

    dim: int
    start: int
    stop: int | None
    step: int


@dataclass(frozen=True, eq=False)
class IndexSelect:
    """One position ``at`` (nonnegative) of input dim ``dim``: the dim goes away."""

    dim: int
    at: int


@dataclass(frozen=True, eq=False)
class IndexNew:
    """``None``: a new dim of size 1; it reads no input dim."""

    dim = None


@dataclass(frozen=True, eq=False)
class IndexTensor:
    """A tensor of positions (a graph value) over input dim ``dim``: an advanced item."""

    dim: int
    node: fx.Node


@dataclass(frozen=True, eq=False)
class IndexList:
    """A constant list of positions (nonnegative) over input dim ``dim``: an advanced item."""

    dim: int
    indices: tuple[int, ...]


IndexItem = Union[IndexSlice, IndexSelect, IndexNew, IndexTensor, IndexList]
_ADVANCED = (IndexTensor, IndexList)


def _slice_indices(it: slice, size) -> tuple:
    """``it.indices(size)``, also for a symbolic ``size`` or bound and a forward step: each clamp a comparison, which
    on a ``SymInt`` records its guard (the slice ``[1:]`` of a length is ``1`` for every length of at least 1; the
    slice ``[:T]`` of a table of 1024 rotary frequencies is ``T`` for every ``T`` up to 1024)."""
    step = 1 if it.step is None else it.step
    symbolic = any(isinstance(v, torch.SymInt) for v in (size, it.start, it.stop))
    if not symbolic or not isinstance(step, int) or step <= 0:
        return it.indices(int(size))  # a symbolic size specializes (its guard pins the length)

    def clamp(i, default):
        if i is None:
            return default
        if i < 0:
            i = i + size
            return i if i >= 0 else 0
        return i if i <= size else size

    return clamp(it.start, 0), clamp(it.stop, size), step


def parse_index(shape, index) -> list[IndexItem]:
    """The items of ``x[index]``, one per input dim in order (plus one per ``None``), slices clamped to their dim
    and the positions of selects and constant lists made nonnegative."""
    if not isinstance(index, tuple):
        index = (index,)
    consuming = sum(1 for it in index if it is not None and it is not Ellipsis)
    items, d = [], 0
    for it in index:
        if it is Ellipsis:
            for _ in range(len(shape) - consuming):
                items.append(IndexSlice(d, 0, shape[d], 1))
                d += 1
        elif it is None:
            items.append(IndexNew())
        elif isinstance(it, slice):
            start, stop, step = _slice_indices(it, shape[d])
            items.append(IndexSlice(d, start, max(stop, start), step))
            d += 1
        elif isinstance(it, int):
            items.append(IndexSelect(d, it % shape[d]))
            d += 1
        elif isinstance(it, fx.Node) and is_tensor_node(it) and value_of(it).dtype != torch.bool:
            items.append(IndexTensor(d, it))
            d += 1
        elif _int_list(it):
            items.append(IndexList(d, tuple(i % shape[d] for i in it)))
            d += 1
        else:
            raise _Unsupported(f"index item {it!r}")
    while d < len(shape):
        items.append(IndexSlice(d, 0, shape[d], 1))
        d += 1
    return items


class _Unsupported(Exception):
    pass


def _int_list(item) -> bool:
    """A constant flat list of ints (``qkv[..., [-2], :]``); not bools, which would be a mask."""
    return (isinstance(item, list) and bool(item)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in item))


def _advanced_shape(item: IndexTensor | IndexList) -> tuple[int, ...]:
    """The index shape of an advanced item: the tensor's, or ``(len(list),)``."""
    return shape_of(item.node) if isinstance(item, IndexTensor) else (len(item.indices),)


def _index_items(node: fx.Node, op: Op) -> list[IndexItem]:
    src = op["input"]
    shape = shape_of(src)
    if op.name == "narrow":
        dim = op["dim"] % len(shape)
        return parse_index(shape, (slice(None),) * dim + (slice(op["start"], op["start"] + op["length"]),))
    if op.name == "select":
        dim = op["dim"] % len(shape)
        return parse_index(shape, (slice(None),) * dim + (op["index"],))
    return parse_index(shape, op["index"])


def _output_dims(items: list[IndexItem], out_ndim: int) -> tuple[dict[int, int], list[int]]:
    """Output dim of each basic item (by item position) and the output dims of the advanced block."""
    advanced = [k for k, it in enumerate(items) if isinstance(it, _ADVANCED)]
    adv_ndim = max((len(_advanced_shape(items[k])) for k in advanced), default=0)
    adjacent = not advanced or advanced == list(range(advanced[0], advanced[-1] + 1))
    out_of, od = {}, 0
    adv_start = 0 if (advanced and not adjacent) else None
    if adv_start == 0:
        od = adv_ndim
    for k, it in enumerate(items):
        if isinstance(it, _ADVANCED):
            if adv_start is None:
                adv_start = od
                od += adv_ndim
            continue
        if isinstance(it, IndexSelect):
            continue
        out_of[k] = od
        od += 1
    adv_dims = list(range(adv_start, adv_start + adv_ndim)) if advanced else []
    return out_of, adv_dims


def link_index(ctx, node, op):
    src = op["input"]
    try:
        items = _index_items(node, op)
    except _Unsupported:
        return
    out_shape = shape_of(node)
    out_of, adv_dims = _output_dims(items, len(out_shape))
    factors = [[s] for s in out_shape]
    for k, it in enumerate(items):
        if isinstance(it, IndexSlice) and k in out_of and it.step == 1:
            d_in, od = it.dim, out_of[k]
            if it.start == 0 and it.stop == shape_of(src)[d_in]:
                factors[od] = list(ctx.factorization(src)[d_in])
    ctx.set_factorization(node, factors)
    for k, it in enumerate(items):
        if isinstance(it, IndexSlice) and k in out_of and it.step == 1:
            ctx.link_dims(node, out_of[k], src, it.dim, it.start)
        elif isinstance(it, IndexTensor):
            idx = it.node
            idx_shape = shape_of(idx)
            for j, od in enumerate(adv_dims):
                d_idx = j - (len(adv_dims) - len(idx_shape))
                if d_idx >= 0 and idx_shape[d_idx] == out_shape[od]:
                    ctx.link_dims(node, od, idx, d_idx)


def rewrite_index(rw, node, op):
    src = op["input"]
    try:
        items = _index_items(node, op)
    except _Unsupported as exc:
        rw.fallback(node, f"indexing with {exc}")
        return
    out = rw.out_shard(node)
    out_of, adv_dims = _output_dims(items, len(shape_of(node)))
    tensor_items = [it for it in items if isinstance(it, IndexTensor)]  # the advanced items that are graph values
    have = rw.out_shard(src) or rw.placement(src)

    if isinstance(have, Shard):
        k, item = next((k, it) for k, it in enumerate(items) if it.dim == have.dim)
        x = rw.input(src, have)
        if isinstance(item, IndexSlice) and item.step == 1 and not tensor_items and (
                not have.factors or (item.start, item.stop) == (0, shape_of(src)[have.dim])):
            if have.factors:
                placement = have.moved(out_of[k])
                local_items = items
            else:
                lo, hi = local_range(have, rw.rank, item.start, item.stop)
                placement = Shard(out_of[k], have.layout.derive(item.start, item.stop - item.start))
                local_items = [IndexSlice(it.dim, lo, hi, 1) if it is item else it for it in items]
            new = rw.call(operator.getitem, x, _build_index(rw, local_items, None, node, adv_dims))
            if out is not None and out != placement:  # the kept positions sit elsewhere: move them (not the source)
                new = rw.realign_value(node, new, placement, out)
                placement = out
            rw.done(node, new, placement)
            return
        if isinstance(item, IndexSelect) and not any(isinstance(it, _ADVANCED) for it in items) and not have.factors:
            kept = [IndexSlice(it.dim, 0, None, 1) if it is item else it for it in items]
            local = rw.call(operator.getitem, x, _build_index(rw, kept, None, node, adv_dims))
            owned = rw.call(select_owned, local, _dim_after(items, item), item.at, have.layout.encode(), rw.rank)
            rw.done(node, owned, Partial())
            return
        if isinstance(item, IndexTensor) and out is None and not have.factors:
            rw.done(node, _read_owned_rows(rw, node, src, items, item, x, have, adv_dims), Partial())
            return
        rw.fallback(node, "indexing a split dim with a step, a tensor, a list or a merged dim")
        return

    if isinstance(have, Partial) and not tensor_items and out is None:
        rw.done(node, rw.reemit(node), have)
        return
    if out is None:
        run_whole(rw, node, OUTPUT_WHOLE, expected=True)
        return
    if out.dim in adv_dims:  # a whole source read at split positions (a mask gathered at token positions)
        x = rw.input(src, REPLICATE, partial_grad=True)
        rw.done(node, rw.call(operator.getitem, x, _build_index(rw, items, out, node, adv_dims)), out)
        return
    whole = rw.reemit(node, *whole_args(rw, node, SPLIT_STARTS, expected=True))
    rw.done(node, rw.shard_value(node, whole, out), out)


def _read_owned_rows(rw, node, src, items, item, x, have: Shard, adv_dims) -> fx.Node:
    """``x[index]`` where ``item`` indexes the split dim with a tensor of positions: the rows this rank holds,
    zeros where another rank holds the position (a partial sum; see the module docstring)."""
    local = rw.call(torch.ops.autoshard.seq_local_index.default, rw.input(item.node, REPLICATE),
                    have.layout.encode(), rw.rank)
    row = rw.local_shape(src, have)
    if row[have.dim] == 0:  # no rows here: read a zero row
        row[have.dim] = 1
        x = rw.call(torch.cat, [x, rw.method("new_zeros", x, tuple(row))], have.dim)
    index = list(_build_index(rw, items, None, node, adv_dims))
    index[items.index(item)] = rw.call(torch.clamp, local, min=0)
    picked = rw.call(operator.getitem, x, tuple(index))
    # where the rows landed: the advanced block of the output (the index broadcast with the other tensors)
    block = (1,) * (len(adv_dims) - len(shape_of(item.node))) + shape_of(item.node)
    view = [1] * len(shape_of(node))
    for j, od in enumerate(adv_dims):
        view[od] = block[j]
    owned = rw.call(torch.reshape, rw.call(operator.ge, local, 0), tuple(view))
    val = value_of(node)
    return rw.call(torch.where, owned, picked, rw.call(torch.zeros, (), dtype=val.dtype, device=val.device))


def local_range(shard: Shard, rank: int, start: int, stop: int) -> tuple[int, int]:
    """Local index range of the positions in [start, stop) this rank holds (one range: positions increase)."""
    first, last, local = None, 0, 0
    for s, e in shard.layout.local_intervals(rank):
        a, b = max(s, start), min(e, stop)
        if b > a:
            first = local + a - s if first is None else first
            last = local + b - s
        local += e - s
    return (0, 0) if first is None else (first, last)


def _dim_after(items, item) -> int:
    """The dim ``item``'s input dim has in the intermediate where only ``None`` items were applied before it."""
    d = 0
    for it in items:
        if it is item:
            return d
        if not isinstance(it, IndexSelect):
            d += 1
    raise ValueError


def _build_index(rw, items, out, node, adv_dims):
    """The index tuple of ``items`` with tensor indices taken in the placement the output needs."""
    result = []
    for it in items:
        if isinstance(it, IndexNew):
            result.append(None)
        elif isinstance(it, IndexSlice):
            result.append(slice(it.start, it.stop, it.step))
        elif isinstance(it, IndexSelect):
            result.append(it.at)
        elif isinstance(it, IndexList):
            result.append(list(it.indices))
        else:
            idx = it.node
            want = REPLICATE
            if out is not None and out.dim in adv_dims:
                idx_shape = shape_of(idx)
                d_idx = adv_dims.index(out.dim) - (len(adv_dims) - len(idx_shape))
                if d_idx >= 0 and idx_shape[d_idx] == shape_of(node)[out.dim]:
                    want = out.moved(d_idx)
            result.append(rw.input(idx, want))
    return tuple(result)


register("getitem", "narrow", "select", link=link_index, rewrite=rewrite_index)
