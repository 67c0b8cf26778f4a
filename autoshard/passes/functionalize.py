"""Functionalize: in-place writes into fresh tensors become out-of-place ops the rules already split.

Model code assembles tensors by writing into a fresh buffer (MLA's keys, DeepSeek-style)::

    k = k_nope.new_empty(b, h, s, d_nope + d_rope)
    k[..., :d_nope] = k_nope                    # operator.setitem
    k[..., d_nope:].copy_(k_pe)                 # getitem(k, index).copy_(k_pe)

or scatters into one in place (``x.scatter_(dim, index, src)``, ``x.index_put_(...)``). An in-place op
on a value split along the sequence cannot run as written on a shard (its index and its source are in
global terms). So this pass, which runs before attention capture, rewrites each such write into the
value it produces and points every *later* use of the written tensor at that value:

* ``b[index] = v`` and ``b[index].copy_(v)`` with a basic index (slices, ints, ``...``, ``None``): ``b`` with
  the indexed box replaced, built from slices of ``b`` and ``v`` (broadcast to the box and cast to ``b``'s
  dtype) by ``cat`` along each restricted dim. A slice with a step ``k`` (Wan's rotary embedding writes
  ``out[..., 0::2] = ...`` and ``out[..., 1::2] = ...`` into ``empty_like``) views the groups of ``k`` it
  touches as ``[n, k]`` (``unflatten``), replaces one column there and flattens back; a strided box whose
  last group runs past the dim is kept in place. ``cat``, slices and views have rules, so a box that does
  not cut the sequence dim is computed on every rank's own positions, and one that does is exact through
  the slice and concatenation rules;
* ``b.copy_(v)``: ``v`` broadcast to ``b``'s shape and cast;
* the same through ``b.data`` (CogVideoX builds its positions with ``joint.data[:, text:].copy_(pos)``): a
  write into ``b`` of ``v.detach()``, as autograd does not see it;
* ``b.scatter_(...)``, ``b.scatter_add_``, ``b.index_put_``, ``b.index_add_``, ``b.index_copy_``,
  ``b.index_fill_``, ``b.masked_scatter_``: their out-of-place twins.

Elementwise in-place ops (``x.mul_(2)``, ``x.masked_fill_(m, v)``) stay: the pointwise rules run them in
place on the shard, which is exact.

The rewrite is the same value only when nothing else can observe the write, so a write is kept in place
(and a split target then gets the rewriter's clear error) unless: ``b`` is made in this graph by an op
whose value owns its storage (not a graph input, a parameter or a buffer, not a view of another tensor:
their writes are seen outside; a value this pass built is its own), and no other tensor sharing ``b``'s
storage, made before the write, is used after it (one made after it is made from the written value).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph import new_node, storage_of
from .ops import OP_KEY, canonical, is_tensor_node, shape_of, value_of

__all__ = ["functionalize", "OUT_OF_PLACE"]

OUT_OF_PLACE = {"scatter_": "scatter", "scatter_add_": "scatter_add", "scatter_reduce_": "scatter_reduce",
                "index_put_": "index_put", "index_add_": "index_add", "index_copy_": "index_copy",
                "index_fill_": "index_fill", "masked_scatter_": "masked_scatter"}
"""In-place tensor methods (not elementwise) and their out-of-place twins."""


def _box(base: fx.Node, index) -> list[tuple[int, int, int, int, int]] | None:
    """The dims a basic ``index`` restricts in ``base``, as ``(dim, start, stop, step, column)`` (static bounds):
    a strided slice as the groups of ``step`` from ``start`` to ``stop`` whose ``column`` it takes; None when the
    index is not basic (a tensor, a negative step, an unknown bound) or no such groups fit in the dim."""
    shape = shape_of(base)
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(item is Ellipsis for item in items) > 1:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        explicit = sum(item is not None for item in items if item is not Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(shape) - explicit)
    box, dim = [], 0
    for item in items:
        if item is None:
            continue
        if dim >= len(shape):
            return None
        size = shape[dim]
        if isinstance(item, bool) or not isinstance(item, (int, slice)):
            return None
        if isinstance(item, int):
            start = item + size if item < 0 else item
            if not 0 <= start < size:
                return None
            box.append((dim, start, start + 1, 1, 0))
        else:
            if not all(b is None or (isinstance(b, int) and not isinstance(b, bool)) for b in
                       (item.start, item.stop, item.step)) or (item.step or 1) < 1:
                return None
            if isinstance(size, torch.SymInt):  # a length of a class: a whole slice restricts nothing; the bounds of
                if (item.start or 0, item.stop, item.step or 1) != (0, None, 1):  # a part would pin the length
                    return None
                dim += 1
                continue
            start, stop, step = item.indices(size)
            count = len(range(start, stop, step))
            if step == 1 or count <= 1:
                if (start, start + count) != (0, size):
                    box.append((dim, start, start + count, 1, 0))
            else:
                column = max(0, start + count * step - size)  # groups of `step` from start - column fit the dim
                if column >= step or column > start:
                    return None
                box.append((dim, start - column, start - column + count * step, step, column))
        dim += 1
    return box


def _box_value(graph: fx.Graph, base: fx.Node, box, value, view_shape) -> fx.Node:
    """``value`` as the box's content: broadcast to the indexed view's shape, shaped like the box in ``base``'s
    dims (ints keep their dim, ``None`` adds none) and cast to ``base``'s dtype."""
    dtype = value_of(base).dtype
    box_shape = list(shape_of(base))
    for dim, start, stop, step, _ in box:
        box_shape[dim] = (stop - start) // step
    if not isinstance(value, fx.Node):
        return new_node(graph, torch.full, (tuple(box_shape), value),
                        {"dtype": dtype, "device": value_of(base).device})
    out = value
    if tuple(shape_of(out)) != tuple(view_shape):
        out = new_node(graph, "expand", (out, *view_shape), op="call_method")
    if tuple(view_shape) != tuple(box_shape):
        out = new_node(graph, "reshape", (out, *box_shape), op="call_method")
    if value_of(out).dtype != dtype:
        out = new_node(graph, "to", (out, dtype), op="call_method")
    return out


def _replace_box(graph: fx.Graph, base: fx.Node, box, content: fx.Node) -> fx.Node:
    """``base`` with the box ``box`` replaced by ``content``: per restricted dim, the slices before and after the
    box around the inner replacement, concatenated. A strided dim's part is viewed as ``[groups, step]`` and its
    column replaced (the box's later dims one further out), then flattened back."""
    if not box:
        return content
    (dim, start, stop, step, column), rest = box[0], box[1:]
    size = shape_of(base)[dim]

    def part(lo, hi):
        return new_node(graph, operator.getitem, (base, (slice(None),) * dim + (slice(lo, hi),)))

    if step > 1:
        groups = new_node(graph, "unflatten", (part(start, stop), dim, ((stop - start) // step, step)),
                          op="call_method")
        as_column = new_node(graph, "unsqueeze", (content, dim + 1), op="call_method")
        inner_box = [(dim + 1, column, column + 1, 1, 0)] + [(d + 1, *bounds) for d, *bounds in rest]
        inner = new_node(graph, "flatten", (_replace_box(graph, groups, inner_box, as_column), dim, dim + 1),
                         op="call_method")
    else:
        inner = _replace_box(graph, part(start, stop), rest, content) if rest else content
    pieces = ([part(0, start)] if start > 0 else []) + [inner] + ([part(stop, size)] if stop < size else [])
    return new_node(graph, torch.cat, (pieces, dim)) if len(pieces) > 1 else inner


def _write(node: fx.Node):
    """``(base, index_view, build)`` when ``node`` writes into ``base`` in a form this pass rewrites; ``build(graph)``
    emits the written value. ``index_view`` is the getitem a ``copy_`` writes through (None otherwise)."""
    if node.op == "call_function" and node.target is operator.setitem and is_tensor_node(node.args[0]):
        base, index, value = node.args
        view = None
    elif node.op == "call_method" and node.target == "copy_" and len(node.args) == 2 and not node.kwargs:
        target, value = node.args
        if not is_tensor_node(target):
            return None
        if target.op == "call_function" and target.target is operator.getitem and is_tensor_node(target.args[0]):
            base, index = target.args
            view = target
        else:
            base, index, view = target, (), None
    elif node.op == "call_method" and node.target in OUT_OF_PLACE and is_tensor_node(node.args[0]):
        base = node.args[0]

        def build(graph):
            return new_node(graph, OUT_OF_PLACE[node.target], node.args, node.kwargs, op="call_method")

        return base, None, build
    else:
        return None
    box = _box(base, index)
    if box is None:
        return None
    view_shape = shape_of(view) if view is not None else tuple(
        value_of(base)[index].shape) if index != () else shape_of(base)
    through_data = _is_data(base)
    if through_data:  # x.data[index] = v: a write into x that autograd does not see
        base = base.args[0]

    def build(graph):
        written = value
        if through_data and isinstance(value, fx.Node):
            written = new_node(graph, "detach", (value,), op="call_method")
        content = _box_value(graph, base, box, written, view_shape)
        if not box and content is written:  # the whole tensor: a copy, not the source itself
            content = new_node(graph, "clone", (content,), op="call_method")
        return _replace_box(graph, base, box, content)

    return base, view, build


def _is_data(node: fx.Node) -> bool:
    """Whether ``node`` is ``x.data`` (dynamo records it as ``torch._C._autograd._get_data_attr(x)``)."""
    return node.op == "call_function" and node.target is torch._C._autograd._get_data_attr


def _fresh(base: fx.Node, write: fx.Node, view: fx.Node | None, order: dict[fx.Node, int], built: set) -> bool:
    """Whether nothing but ``base``'s own later uses can observe ``write`` (see the module docstring); ``built``:
    the values this pass made, which own their storage even where their last op is a view."""
    if base.op not in ("call_function", "call_method") or (value_of(base)._is_view() and base not in built):
        return False
    storage = storage_of(base)
    if storage is None:
        return False
    for node in order:
        if node is base or node is view or order[node] >= order[write] or not is_tensor_node(node):
            continue  # views made after the write are made of the written value (their uses are rewired)
        other = storage_of(node)
        if other is None or other != storage:  # StorageWeakRef compares with storages only
            continue
        if node.op in ("placeholder", "get_attr") or any(order[u] > order[write] for u in node.users):
            return False
    return True


def functionalize(gm: fx.GraphModule) -> dict[str, int]:
    """Rewrite the in-place writes the module docstring lists; returns how many were rewritten and how many
    stay in place."""
    graph = gm.graph
    counts = {"functionalized": 0, "kept_in_place": 0}
    built = set()
    for write in list(graph.nodes):
        found = _write(write)
        if found is None:
            continue
        base, view, build = found
        order = {n: i for i, n in enumerate(graph.nodes)}
        if not _fresh(base, write, view, order, built):
            counts["kept_in_place"] += 1
            continue
        with graph.inserting_before(write):
            new = build(graph)
        built.add(new)
        later = [u for u in base.users if order.get(u, -1) > order[write]]
        for user in later:
            user.replace_input_with(base, new)
            user.meta[OP_KEY] = canonical(user)
        result_users = list(write.users)
        if result_users:  # copy_ returns the view, the out-of-place twins the tensor
            if view is not None:
                with graph.inserting_after(new):
                    written_view = new_node(graph, operator.getitem, (new, view.args[1]))
                write.replace_all_uses_with(written_view)
            else:
                write.replace_all_uses_with(new)
        for user in result_users:
            user.meta[OP_KEY] = canonical(user)
        _copy_meta(write, new)
        written_through = [write.args[0]] + ([view.args[0]] if view is not None else [])
        graph.erase_node(write)
        if view is not None and not view.users:
            graph.erase_node(view)
        for alias in written_through:  # x.data, once nothing else reads it
            if alias in graph.nodes and _is_data(alias) and not alias.users:
                graph.erase_node(alias)
        counts["functionalized"] += 1
    return counts


def _copy_meta(write: fx.Node, new: fx.Node) -> None:
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in write.meta:
            new.meta.setdefault(key, write.meta[key])
