"""Shape and layout ops: views (``view_as_complex`` / ``view_as_real`` among them), permutes, expands,
repeat_interleave, indexing, splits, concatenation, padding.

Views follow *factors*: the input's dims are cut into factors, the output's dims are matched against
consecutive factors (merging or splitting them), and matched factors are the same positions. A
factor cut in two by a view starts new, unlinked factors: the sequence cannot be followed through
it, and a split value there is gathered. ``repeat_interleave`` by an int appends an inner factor to
the repeated dim, so a merged ``[B*S]`` repeated per token (MoE routing) stays split.

Indexing along the sequence is exact on shards: a step-1 slice keeps each rank's positions inside the
range (a derived layout: the shifted labels of a causal LM), selecting one position gives a partial
value held by its owner (``hidden[:, 0]``: the CLS token), and so does indexing it with a tensor of
positions (``hidden[arange(B), eos_index]``: CLIP's pooling): each rank reads the rows it holds
(``autoshard::seq_local_index``) and zeros elsewhere, and the all-reduce that makes the partial value
whole moves only the rows read. Constant int lists are advanced indices too: on
another dim they keep the split (Falcon's ``fused_qkv[..., [-2], :]``), on the split dim they gather.
Concatenation and padding along the sequence place the new positions on the ranks that hold their
neighbours (the CLS token goes to the rank holding position 0), so no data moves.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...placements import REPLICATE, Partial, Shard
from ...runtime import sequence_ops as _sequence_ops  # noqa: F401 -- defines autoshard::seq_local_index
from ..ops import Op, is_tensor_node, shape_of, value_of
from . import register
from .pointwise import OUTPUT_WHOLE, TUPLE_LINKS, link_nothing, rewrite_same, run_whole, whole_args

__all__ = ["permutation", "select_owned"]

SPLIT_STARTS = "the split starts at this value"
"""Why a view, repeat or index whose output starts a split takes its input whole: an expected gather."""

# ============================================================================= views (reshape family)


def view_factors(in_factors: list[list[int]], out_shape) -> tuple[list[list[int]], list[tuple[tuple, tuple]]]:
    """Output factorization and factor links ``((in_dim, in_factor), (out_dim, out_factor))`` of a reshape."""
    atoms = [(size, (d, f)) for d, fs in enumerate(in_factors) for f, size in enumerate(fs) if size != 1]
    out_factors: list[list[int]] = []
    links = []
    i, carry = 0, None
    for od, s in enumerate(out_shape):
        if s == 1:
            out_factors.append([1])
            continue
        group, prod = [], 1
        while prod < s:
            if carry is not None:
                atom, carry = carry, None
            elif i < len(atoms):
                atom, i = atoms[i], i + 1
            else:
                return [[int(x)] for x in out_shape], []
            size, src = atom
            if s % (prod * size) == 0:
                group.append(atom)
                prod *= size
            else:
                need = s // prod
                if need <= 1 or size % need:
                    return [[int(x)] for x in out_shape], []
                group.append((need, None))
                carry = (size // need, None)
                prod *= need
        if prod != s:
            return [[int(x)] for x in out_shape], []
        out_factors.append([sz for sz, _ in group])
        links += [(src, (od, f)) for f, (_, src) in enumerate(group) if src is not None]
    return out_factors, links


def link_view(ctx, node, op):
    src = op["input"]
    factors, links = view_factors(ctx.factorization(src), shape_of(node))
    ctx.set_factorization(node, factors)
    for (d_in, f_in), (d_out, f_out) in links:
        ctx.link((src, d_in, f_in), (node, d_out, f_out))


def rewrite_view(rw, node, op):
    src = op["input"]
    out = rw.out_shard(node)
    have = rw.placement(src)
    if out is None:
        if isinstance(have, Partial):
            rw.done(node, rw.reemit(node), have)
        else:
            run_whole(rw, node, OUTPUT_WHOLE, expected=True)
        return
    want = _view_source_shard(rw, node, src, out)
    if want is None:  # the split starts here: reshape the whole value, then keep this rank's part
        whole = rw.reemit(node, *whole_args(rw, node, SPLIT_STARTS, expected=True))
        rw.done(node, rw.shard_value(node, whole, out), out)
        return
    x = rw.input(src, want)
    rw.done(node, rw.method("reshape", x, tuple(rw.local_shape(node, out))), out)


def _view_source_shard(rw, node, src, out: Shard) -> Shard | None:
    """The placement ``src`` must have for the view to produce ``out``: the input factor the output's
    sequence factor comes from, split the same way."""
    in_factors = rw.families.factors.get(src) or [[s] for s in shape_of(src)]
    _, links = view_factors(in_factors, shape_of(node))
    for (d_in, f_in), (d_out, f_out) in links:
        if d_out == out.dim and f_out == out.factor:
            factors = in_factors[d_in]
            return Shard(d_in, out.layout, tuple(factors) if len(factors) > 1 else (), f_in if len(factors) > 1 else 0)
    return None


register("view", link=link_view, rewrite=rewrite_view)


# ============================================================================= complex views


def link_complex_view(ctx, node, op):
    """``view_as_complex`` / ``view_as_real``: the dims both sides have are the same positions."""
    src = op["input"]
    shared = min(len(shape_of(src)), len(shape_of(node)))
    in_factors = ctx.factorization(src)
    ctx.set_factorization(node, [list(in_factors[d]) for d in range(shared)] +
                          [[s] for s in shape_of(node)[shared:]])
    for d in range(shared):
        ctx.link_dims(node, d, src, d)


register("complex_view", link=link_complex_view, rewrite=rewrite_same)


# ============================================================================= permutes


def permutation(node: fx.Node) -> list[int]:
    """Output dim i is input dim perm[i]: found by running the op on a meta tensor of distinct sizes."""
    src = node.args[0]
    ndim = len(shape_of(src))
    probe = torch.empty(tuple(range(2, 2 + ndim)), device="meta")
    args = (probe,) + tuple(node.args[1:])
    out = getattr(probe, node.target)(*args[1:], **node.kwargs) if node.op == "call_method" else node.target(*args, **node.kwargs)
    return [s - 2 for s in out.shape]


def link_permute(ctx, node, op):
    src = op["input"]
    perm = permutation(node)
    in_factors = ctx.factorization(src)
    ctx.set_factorization(node, [list(in_factors[p]) for p in perm])
    for d, p in enumerate(perm):
        ctx.link_dims(node, d, src, p)


def rewrite_permute(rw, node, op):
    src = op["input"]
    out = rw.out_shard(node)
    if out is None:
        have = rw.placement(src)
        x = rw.env[src] if isinstance(have, Partial) else rw.input(src, REPLICATE)
        rw.done(node, rw.reemit(node, (x,) + tuple(node.args[1:]), dict(node.kwargs)), have if isinstance(have, Partial) else REPLICATE)
        return
    perm = permutation(node)
    x = rw.input(src, out.moved(perm[out.dim]))
    rw.done(node, rw.reemit(node, (x,) + tuple(node.args[1:]), dict(node.kwargs)), out)


register("permute", link=link_permute, rewrite=rewrite_permute)


# ============================================================================= expand


def link_expand(ctx, node, op):
    src = op["input"]
    out_shape, in_shape = shape_of(node), shape_of(src)
    lead = len(out_shape) - len(in_shape)
    in_factors = ctx.factorization(src)
    ctx.set_factorization(node, [[s] for s in out_shape[:lead]] + [
        list(in_factors[d]) if in_shape[d] == out_shape[lead + d] else [out_shape[lead + d]] for d in range(len(in_shape))])
    for d in range(len(in_shape)):
        if in_shape[d] == out_shape[lead + d]:
            ctx.link_dims(node, lead + d, src, d)


def rewrite_expand(rw, node, op):
    src = op["input"]
    out = rw.out_shard(node)
    if out is None:
        run_whole(rw, node, OUTPUT_WHOLE, expected=True)
        return
    out_shape, in_shape = shape_of(node), shape_of(src)
    d_in = out.dim - (len(out_shape) - len(in_shape))
    broadcast = d_in < 0 or in_shape[d_in] != out_shape[out.dim]
    x = rw.input(src, REPLICATE, partial_grad=True) if broadcast else rw.input(src, out.moved(d_in))
    rw.done(node, rw.method("expand", x, tuple(rw.local_shape(node, out))), out)


register("expand", link=link_expand, rewrite=rewrite_expand)


# ============================================================================= repeat_interleave


def _repeated_dim(op: Op) -> int | None:
    """The dim whose elements ``repeat_interleave`` repeats an int number of times; None for counts per
    element (a tensor) or no dim (the input flattened first)."""
    repeats, dim = op["repeats"], op["dim"]
    if isinstance(repeats, int) and not isinstance(repeats, bool) and dim is not None:
        return dim % len(shape_of(op["input"]))
    return None


def link_repeat_interleave(ctx, node, op):
    """Repeating each element ``k`` times appends an inner factor ``k`` to the dim: its own factors (the
    sequence among them: MoE's ``hidden[B*S, D].repeat_interleave(top_k, 0)``) are followed through."""
    d = _repeated_dim(op)
    if d is None:
        return
    src = op["input"]
    factors = [list(f) for f in ctx.factorization(src)]
    repeated = factors[d] if shape_of(src)[d] != 1 else []  # a size-1 dim: the repeats are all there is
    factors[d] = repeated + [op["repeats"]] if op["repeats"] != 1 else factors[d]
    ctx.set_factorization(node, factors)
    for dim in range(len(factors)):
        if dim != d:
            ctx.link_dims(node, dim, src, dim)
    for f, size in enumerate(repeated):
        if size != 1:
            ctx.link((src, d, f), (node, d, f))


def rewrite_repeat_interleave(rw, node, op):
    src = op["input"]
    out = rw.out_shard(node)
    d = _repeated_dim(op)
    if (out is None or d is None) and isinstance(rw.placement(src), Shard):
        rw.fallback(node, "repeating a split value by per-element counts or flattened")
        return
    if out is None or d is None:
        run_whole(rw, node, OUTPUT_WHOLE, expected=True)
        return
    want = _repeat_source_shard(rw, src, out, d)
    if want is None:  # the repeat itself is the sequence: repeat the whole value, then keep this rank's part
        whole = rw.reemit(node, *whole_args(rw, node, SPLIT_STARTS, expected=True))
        rw.done(node, rw.shard_value(node, whole, out), out)
        return
    rw.done(node, rw.call(torch.repeat_interleave, rw.input(src, want), op["repeats"], d), out)


def _repeat_source_shard(rw, src, out: Shard, d: int) -> Shard | None:
    """The placement ``src`` must have for the repeat to produce ``out``: the same split, less the repeat
    factor when the repeated dim holds the sequence; None when the sequence is the repeat factor."""
    if out.dim != d:
        return out
    factors = (rw.families.factors.get(src) or [[s] for s in shape_of(src)])[d]
    if out.factor >= len(factors) or shape_of(src)[d] == 1:
        return None
    return Shard(d, out.layout, tuple(factors) if len(factors) > 1 else (), out.factor if len(factors) > 1 else 0)


register("repeat_interleave", link=link_repeat_interleave, rewrite=rewrite_repeat_interleave)


# ============================================================================= indexing


def parse_index(shape, index) -> list[tuple]:
    """Items of a ``x[index]``: ("slice", in_dim, start, stop, step), ("select", in_dim, i), ("new",),
    ("tensor", in_dim, node), ("list", in_dim, indices) with start/stop clamped to the dim and the
    indices of a constant list made nonnegative. Tensors and lists are the advanced items."""
    if not isinstance(index, tuple):
        index = (index,)
    consuming = sum(1 for it in index if it is not None and it is not Ellipsis)
    items, d = [], 0
    for it in index:
        if it is Ellipsis:
            for _ in range(len(shape) - consuming):
                items.append(("slice", d, 0, shape[d], 1))
                d += 1
        elif it is None:
            items.append(("new",))
        elif isinstance(it, slice):
            start, stop, step = it.indices(shape[d])
            items.append(("slice", d, start, max(stop, start), step))
            d += 1
        elif isinstance(it, int):
            items.append(("select", d, it % shape[d]))
            d += 1
        elif isinstance(it, fx.Node) and is_tensor_node(it) and value_of(it).dtype != torch.bool:
            items.append(("tensor", d, it))
            d += 1
        elif _int_list(it):
            items.append(("list", d, tuple(i % shape[d] for i in it)))
            d += 1
        else:
            raise _Unsupported(f"index item {it!r}")
    while d < len(shape):
        items.append(("slice", d, 0, shape[d], 1))
        d += 1
    return items


class _Unsupported(Exception):
    pass


def _int_list(item) -> bool:
    """A constant flat list of ints (``qkv[..., [-2], :]``); not bools, which would be a mask."""
    return (isinstance(item, list) and bool(item)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in item))


_ADVANCED = ("tensor", "list")


def _advanced_shape(item: tuple) -> tuple[int, ...]:
    """The index shape of an advanced item: the tensor's, or ``(len(list),)``."""
    return shape_of(item[2]) if item[0] == "tensor" else (len(item[2]),)


def _index_items(node: fx.Node, op: Op) -> list[tuple]:
    src = op["input"]
    shape = shape_of(src)
    if op.name == "narrow":
        dim = op["dim"] % len(shape)
        return parse_index(shape, (slice(None),) * dim + (slice(op["start"], op["start"] + op["length"]),))
    if op.name == "select":
        dim = op["dim"] % len(shape)
        return parse_index(shape, (slice(None),) * dim + (op["index"],))
    return parse_index(shape, op["index"])


def _output_dims(items: list[tuple], out_ndim: int) -> tuple[dict[int, int], list[int]]:
    """Output dim of each basic item (by item position) and the output dims of the advanced block."""
    advanced = [k for k, it in enumerate(items) if it[0] in _ADVANCED]
    adv_ndim = max((len(_advanced_shape(items[k])) for k in advanced), default=0)
    adjacent = not advanced or advanced == list(range(advanced[0], advanced[-1] + 1))
    out_of, od = {}, 0
    adv_start = 0 if (advanced and not adjacent) else None
    if adv_start == 0:
        od = adv_ndim
    for k, it in enumerate(items):
        if it[0] in _ADVANCED:
            if adv_start is None:
                adv_start = od
                od += adv_ndim
            continue
        if it[0] == "select":
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
        if it[0] == "slice" and k in out_of and it[4] == 1:
            d_in, od = it[1], out_of[k]
            if it[2] == 0 and it[3] == shape_of(src)[d_in]:
                factors[od] = list(ctx.factorization(src)[d_in])
    ctx.set_factorization(node, factors)
    for k, it in enumerate(items):
        if it[0] == "slice" and k in out_of and it[4] == 1:
            ctx.link_dims(node, out_of[k], src, it[1], it[2])
        elif it[0] == "tensor":
            idx = it[2]
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
    tensor_items = [it for it in items if it[0] == "tensor"]  # the advanced items that are graph values
    have = rw.out_shard(src) or rw.placement(src)

    if isinstance(have, Shard):
        k, item = next((k, it) for k, it in enumerate(items) if it[0] != "new" and it[1] == have.dim)
        x = rw.input(src, have)
        if item[0] == "slice" and item[4] == 1 and not tensor_items and (not have.factors or
                                                                         (item[2], item[3]) == (0, shape_of(src)[have.dim])):
            if have.factors:
                placement = have.moved(out_of[k])
                local_items = items
            else:
                lo, hi = _local_range(have, rw.rank, item[2], item[3])
                placement = Shard(out_of[k], have.layout.derive(item[2], item[3] - item[2]))
                local_items = [("slice", it[1], lo, hi, 1) if it is item else it for it in items]
            new = rw.call(operator.getitem, x, _build_index(rw, local_items, None, node, adv_dims))
            if out is not None and out != placement:  # the kept positions sit elsewhere: move them (not the source)
                new = rw.realign_value(node, new, placement, out)
                placement = out
            rw.done(node, new, placement)
            return
        if item[0] == "select" and not any(it[0] in _ADVANCED for it in items) and not have.factors:
            kept = [("slice", it[1], 0, None, 1) if it is item else it for it in items]
            local = rw.call(operator.getitem, x, _build_index(rw, kept, None, node, adv_dims))
            owned = rw.call(select_owned, local, _dim_after(items, item), item[2], have.layout.encode(), rw.rank)
            rw.done(node, owned, Partial())
            return
        if item[0] == "tensor" and out is None and not have.factors:
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
    local = rw.call(torch.ops.autoshard.seq_local_index.default, rw.input(item[2], REPLICATE),
                    have.layout.encode(), rw.rank)
    row = rw.local_shape(src, have)
    if row[have.dim] == 0:  # no rows here: read a zero row
        row[have.dim] = 1
        x = rw.call(torch.cat, [x, rw.method("new_zeros", x, tuple(row))], have.dim)
    index = list(_build_index(rw, items, None, node, adv_dims))
    index[items.index(item)] = rw.call(torch.clamp, local, min=0)
    picked = rw.call(operator.getitem, x, tuple(index))
    # where the rows landed: the advanced block of the output (the index broadcast with the other tensors)
    block = (1,) * (len(adv_dims) - len(shape_of(item[2]))) + shape_of(item[2])
    view = [1] * len(shape_of(node))
    for j, od in enumerate(adv_dims):
        view[od] = block[j]
    owned = rw.call(torch.reshape, rw.call(operator.ge, local, 0), tuple(view))
    val = value_of(node)
    return rw.call(torch.where, owned, picked, rw.call(torch.zeros, (), dtype=val.dtype, device=val.device))


def _local_range(shard: Shard, rank: int, start: int, stop: int) -> tuple[int, int]:
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
        if it[0] != "select":
            d += 1
    raise ValueError


def _build_index(rw, items, out, node, adv_dims):
    """The index tuple of ``items`` with tensor indices taken in the placement the output needs."""
    result = []
    for it in items:
        if it[0] == "new":
            result.append(None)
        elif it[0] == "slice":
            result.append(slice(it[2], it[3], it[4]))
        elif it[0] == "select":
            result.append(it[2])
        elif it[0] == "list":
            result.append(list(it[2]))
        else:
            idx = it[2]
            want = REPLICATE
            if out is not None and out.dim in adv_dims:
                idx_shape = shape_of(idx)
                d_idx = adv_dims.index(out.dim) - (len(adv_dims) - len(idx_shape))
                if d_idx >= 0 and idx_shape[d_idx] == shape_of(node)[out.dim]:
                    want = out.moved(d_idx)
            result.append(rw.input(idx, want))
    return tuple(result)


def select_owned(x: torch.Tensor, dim: int, position: int, layout_code: list[int], rank: int) -> torch.Tensor:
    """``x.select(dim, position)`` on the rank that holds global ``position``, zeros elsewhere (a partial sum)."""
    from ...runtime.layouts import SequenceLayout

    layout = SequenceLayout.decode(layout_code)
    local = 0
    for s, e in layout.local_intervals(rank):
        if s <= position < e:
            return x.select(dim, local + position - s)
        local += e - s
    # zeros that stay connected to ``x`` (every rank must run the same backward, and its collectives): the sum of
    # an empty slice, so no inf or NaN of ``x`` reaches them, in ``x``'s dtype (bool and integers too)
    return x.narrow(dim, 0, 0).sum(dim, dtype=x.dtype)


register("getitem", "narrow", "select", link=link_index, rewrite=rewrite_index)


# ============================================================================= split / chunk / unbind


def _split_pieces(node: fx.Node, op: Op) -> tuple[int, list[int] | None]:
    """(dim, piece sizes) of a split-like node, from its outputs; the sizes are None for ``unbind``, whose
    pieces drop the dim."""
    src_shape = shape_of(op["input"])
    if node.target in ("unbind", torch.unbind):
        dim = op["dim"] if op["dim"] is not None else (op["args"][0] if op["args"] else 0)
        return dim % len(src_shape), None
    outs = value_of(node)
    dims = [d for d in range(len(src_shape)) if any(o.shape[d] != src_shape[d] for o in outs)]
    dim = dims[0] if dims else (op["dim"] if op["dim"] is not None else (op["args"][1] if len(op["args"]) > 1 else 0))
    return dim % len(src_shape), [int(o.shape[dim]) for o in outs]


def link_split_piece(ctx, producer, producer_op, index, node):
    src = producer_op["input"]
    dim, sizes = _split_pieces(producer, producer_op)
    factors = [list(f) for f in ctx.factorization(src)]
    if sizes is None:  # unbind: piece dim d is source dim d, or d + 1 past the unbound dim
        del factors[dim]
        ctx.set_factorization(node, factors)
        for d in range(len(factors)):
            ctx.link_dims(node, d, src, d + (d >= dim))
        return
    factors[dim] = [sizes[index]]
    ctx.set_factorization(node, factors)
    for d in range(len(factors)):
        ctx.link_dims(node, d, src, d, sum(sizes[:index]) if d == dim else 0)


def rewrite_split(rw, node, op):
    """Pieces cut along another dim than the split one keep the split (``unbind`` drops its dim, so a later
    split dim moves down by one); cutting along the split dim gathers."""
    src = op["input"]
    dim, sizes = _split_pieces(node, op)
    have = rw.out_shard(src) or rw.placement(src)
    n = len(value_of(node))
    if isinstance(have, Shard) and have.dim != dim:
        piece = have if sizes is not None else have.moved(have.dim - (have.dim > dim))
        rw.done(node, rw.reemit(node, (rw.input(src, have),) + tuple(node.args[1:]), dict(node.kwargs)),
                tuple(piece for _ in range(n)))
    elif isinstance(have, Shard):
        rw.fallback(node, "splitting along the split sequence dim")
    else:  # partial (a whole source: the rewriter re-emits the split itself)
        rw.done(node, rw.reemit(node), tuple(have for _ in range(n)))


register("split", link=link_nothing, rewrite=rewrite_split)
TUPLE_LINKS["split"] = link_split_piece


# ============================================================================= cat / stack


def _cat_inputs(op: Op) -> list[fx.Node]:
    """Inputs that take part (legacy ``cat`` skips 1-D empty tensors)."""
    return [t for t in op["tensors"] if not (is_tensor_node(t) and shape_of(t) == (0,))]


def link_cat(ctx, node, op):
    out_shape = shape_of(node)
    dim = op["dim"] % len(out_shape)
    inputs = _cat_inputs(op)
    factors = [[s] for s in out_shape]
    for d in range(len(out_shape)):
        if d != dim and inputs:
            factors[d] = list(ctx.factorization(inputs[0])[d])
    ctx.set_factorization(node, factors)
    offset = 0
    for t in inputs:
        for d in range(len(out_shape)):
            ctx.link_dims(node, d, t, d, -offset if d == dim else 0)
        offset += shape_of(t)[dim]


def rewrite_cat(rw, node, op):
    out = rw.out_shard(node)
    dim = op["dim"] % len(shape_of(node))
    inputs = _cat_inputs(op)
    if out is None:
        run_whole(rw, node, OUTPUT_WHOLE, expected=True)
        return
    if out.dim != dim:
        new = [rw.input(t, out) for t in inputs]
    elif out.factors:
        rw.fallback(node, "concatenating along a merged split dim")
        return
    else:
        new, offset = [], 0
        for t in inputs:
            length = shape_of(t)[dim]
            new.append(rw.input(t, Shard(dim, out.layout.derive(offset, length)), partial_grad=False))
            offset += length
    rw.done(node, rw.call(torch.cat, new, dim), out)


register("cat", link=link_cat, rewrite=rewrite_cat)


def link_stack(ctx, node, op):
    out_shape = shape_of(node)
    dim = op["dim"] % len(out_shape)
    inputs = op["tensors"]
    factors = [[s] for s in out_shape]
    for d in range(len(out_shape)):
        if d != dim:
            factors[d] = list(ctx.factorization(inputs[0])[d - (d > dim)])
    ctx.set_factorization(node, factors)
    for t in inputs:
        for d in range(len(out_shape)):
            if d != dim:
                ctx.link_dims(node, d, t, d - (d > dim))


def rewrite_stack(rw, node, op):
    out = rw.out_shard(node)
    dim = op["dim"] % len(shape_of(node))
    if out is None:
        run_whole(rw, node, OUTPUT_WHOLE, expected=True)
        return
    new = [rw.input(t, out.moved(out.dim - (out.dim > dim))) for t in op["tensors"]]
    rw.done(node, rw.call(torch.stack, new, dim), out)


register("stack", link=link_stack, rewrite=rewrite_stack)


# ============================================================================= pad


def _pad_pairs(op: Op, ndim: int) -> dict[int, tuple[int, int]]:
    pad = op["pad"]
    return {ndim - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)}


def link_pad(ctx, node, op):
    src = op["input"]
    ndim = len(shape_of(node))
    pairs = _pad_pairs(op, ndim)
    factors = [list(f) for f in ctx.factorization(src)]
    for d, (left, right) in pairs.items():
        if left or right:
            factors[d] = [shape_of(node)[d]]
    ctx.set_factorization(node, factors)
    if op["mode"] != "constant":
        return
    for d in range(ndim):
        left = pairs.get(d, (0, 0))[0]
        ctx.link_dims(node, d, src, d, -left)


def rewrite_pad(rw, node, op):
    src = op["input"]
    out = rw.out_shard(node)
    ndim = len(shape_of(node))
    pairs = _pad_pairs(op, ndim)
    if out is None:
        run_whole(rw, node, OUTPUT_WHOLE, expected=True)
        return
    left, right = pairs.get(out.dim, (0, 0))
    if not (left or right):
        x = rw.input(src, out)
        rw.done(node, rw.reemit(node, (x,) + tuple(node.args[1:]), dict(node.kwargs)), out)
        return
    if op["mode"] != "constant" or out.factors or left < 0 or right < 0:
        rw.fallback(node, f"{op['mode']} padding of the split dim")
        return
    length = shape_of(src)[out.dim]
    x = rw.input(src, Shard(out.dim, out.layout.derive(left, length)))
    local_left = _count_local(out, rw.rank, 0, left)
    local_right = _count_local(out, rw.rank, left + length, left + length + right)
    pad = list(op["pad"])
    i = ndim - 1 - out.dim
    pad[2 * i], pad[2 * i + 1] = local_left, local_right
    rw.done(node, rw.call(F.pad, x, pad, op["mode"], op["value"]), out)


def _count_local(shard: Shard, rank: int, start: int, stop: int) -> int:
    lo, hi = _local_range(shard, rank, start, stop)
    return hi - lo


register("pad", link=link_pad, rewrite=rewrite_pad)
