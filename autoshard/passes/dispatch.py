"""Expert dispatch: rows sorted by a key, computed in groups of equal keys, and put back in their order.

Mixture-of-experts layers (transformers' ``grouped_mm`` experts, its default under ``torch.compile``: Mixtral,
Qwen3-MoE, gpt-oss, ...) route each token's top-k slots to experts by sorting the slots by expert id, computing each
expert's contiguous group of rows (a grouped product whose offsets are the cumulative counts of the sorted ids), and
putting the rows back with the inverse permutation (``inv[perm] = arange(n)``, then ``y[inv]``). Each slot's
result depends on its own row and its own key alone: the sort, the groups and the inverse only move rows. So the
region from the sort to the gather by the inverse is token-local (:func:`~.infer.token_local_nodes`): on a split
sequence every rank sorts, groups and restores its own slots and gets exactly its rows of the one-process result,
with no gather and each expert computing only the rank's tokens.

A region is taken only when it is exactly that (:func:`dispatch_regions`): a ``sort`` of a 1-D key whose
permutation is inverted as above and gathered by, nothing in between used outside it (a sorted value that leaves
the region would be each rank's order, not the whole sequence's), and in between only the ops :func:`_moves_rows`
accepts -- rows
gathered by the permutation (or by it divided by top-k: a token's slots), by the sorted keys (an expert's bias),
elementwise ops that combine the sorted rows with nothing row-aligned in another order, views and splits of the
last dim, the grouped products, and the counts of the sorted keys and their cumulative sum. Anything else -- a
cumulative sum over the rows (a capacity limit that drops tokens), a reduction across rows -- leaves the graph as
it is: the dispatch then gathers the sequence (correct, not split) and the plan says so.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph import reachable
from .ops import is_tensor_node, op_of, shape_of

__all__ = ["dispatch_regions", "GROUPED_PRODUCTS"]

GROUPED_PRODUCTS = {"grouped_mm_fallback", "_grouped_mm", "grouped_mm"}
"""Names of the grouped matrix products (rows in contiguous groups, group ``g``'s rows times weight ``g``, the
groups' ends given as ``offs``): transformers' CPU fallback op and torch's ``_grouped_mm``."""

_COUNTS = {torch.histc, torch.bincount}


def dispatch_regions(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of every expert dispatch of ``gm`` (see the module docstring)."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if _is_sort(node):
            out |= _region(node)
    return out


def _is_sort(node: fx.Node) -> bool:
    if not (node.target is torch.sort or (node.op == "call_method" and node.target == "sort")):
        return False
    keys = node.args[0]
    return is_tensor_node(keys) and len(shape_of(keys)) == 1


def _region(sort: fx.Node) -> set[fx.Node]:
    """The dispatch that starts at ``sort``, or nothing."""
    parts = {user.args[1]: user for user in sort.users if user.target is operator.getitem}
    keys, perm = parts.get(0), parts.get(1)
    if perm is None or len(parts) != len(sort.users):
        return set()
    inverse = _inverse(perm)
    if inverse is None:
        return set()
    inv, write, positions = inverse
    ends = [u for u in inv.users if u.target is operator.getitem and u.args[1] is inv]
    if not ends:
        return set()
    after = set(reachable(sort, lambda n: n.users))
    before = set(reachable(ends[0], lambda n: n.all_input_nodes)).union(*(
        reachable(e, lambda n: n.all_input_nodes) for e in ends[1:]))
    core = after & before
    writes = {n for n in after  # in-place writes into its rows (an expert's bias added) reach no end, but belong
              if not n.users and n.op != "output" and n.args and n.args[0] in core}
    for w in writes:
        before |= set(reachable(w, lambda n: n.all_input_nodes))
    region = (after & before) | {sort, perm, inv, write, positions, *ends} | ({keys} if keys is not None else set())
    closed = all(user in region for node in region.difference(ends) for user in node.users)  # no sorted value leaks
    allowed = all(_moves_rows(n, region, perm, keys, inv) for n in region if n not in (sort, perm, keys, write,
                                                                                       positions, inv))
    return region if closed and allowed else set()


def _inverse(perm: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """``(inv, the write, the positions)`` of ``inv = empty_like(perm); inv[perm] = arange(len(perm))``, or None."""
    for inv in perm.users:
        if inv.target is not torch.empty_like or inv.args[0] is not perm:
            continue
        for write in inv.users:
            if (write.target is operator.setitem and write.args[0] is inv and write.args[1] is perm
                    and isinstance(write.args[2], fx.Node) and write.args[2].target is torch.arange
                    and shape_of(write.args[2]) == shape_of(perm)):
                return inv, write, write.args[2]
    return None


def _moves_rows(node: fx.Node, region: set[fx.Node], perm: fx.Node, keys: fx.Node | None, inv: fx.Node) -> bool:
    """Whether ``node`` (inside a dispatch) only moves, groups or transforms rows one by one."""
    op = op_of(node)
    name = op.name if op is not None else None
    inside = [a for a in node.all_input_nodes if a in region]
    if node.target is operator.getitem and isinstance(node.args[1], fx.Node):  # rows gathered by an index
        index = node.args[1]
        return (index in (perm, keys, inv) or (index.target is operator.floordiv and index.args[0] is perm
                                               and isinstance(index.args[1], int)))
    if node.target is operator.floordiv:
        return node.args[0] is perm and isinstance(node.args[1], int)
    if node.target in _COUNTS:  # the counts of the sorted keys: the groups' sizes
        return node.args[0] is keys or (op_of(node.args[0]) is not None and op_of(node.args[0]).name == "to"
                                        and node.args[0].args[0] is keys)
    if name == "cumsum":  # the groups' ends
        return node.args[0].target in _COUNTS
    if _grouped_product(node):
        return True
    if name in ("to", "identity"):
        return True
    if name == "reduce":  # over later dims (each row's own values)
        dims = op["dim"] if isinstance(op["dim"], (tuple, list)) else (op["dim"],)
        ndim = len(shape_of(op["input"]))
        return op["dim"] is not None and all(isinstance(d, int) and d % ndim != 0 for d in dims)
    if name == "pointwise":  # with nothing row-aligned from outside: parameters, scalars, broadcast rows
        rows = shape_of(node)[0] if shape_of(node) else None
        return all(a in region or not is_tensor_node(a) or len(shape_of(a)) < len(shape_of(node))
                   or shape_of(a)[0] == 1 or shape_of(a)[0] != rows for a in node.all_input_nodes)
    if node.target is operator.getitem:  # a part of a split, or the rows whole and later dims indexed
        return node.args[0] in region and (isinstance(node.args[1], int) or _rows_whole(node.args[1],
                                                                                       len(shape_of(node.args[0]))))
    if name == "split":  # of a later dim (a gate and an up projection)
        return len(inside) == 1 and op["dim"] is not None and op["dim"] % len(shape_of(inside[0])) != 0
    if name == "view":  # the rows stay the rows
        return len(inside) == 1 and bool(shape_of(node)) and shape_of(node)[0] == shape_of(inside[0])[0]
    return False


def _rows_whole(index, ndim: int) -> bool:
    """Whether ``x[index]`` keeps dim 0 whole and in place (``x[..., ::2]``, ``x[:, :h]``): it indexes later dims."""
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, fx.Node) or i is None for i in items):
        return False
    if items and items[0] is Ellipsis:
        return len(items) - 1 < ndim
    return bool(items) and items[0] == slice(None)


def _grouped_product(node: fx.Node) -> bool:
    """Whether ``node`` is one of :data:`GROUPED_PRODUCTS` (a torch function or a library op, any overload)."""
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = target._qualified_op_name if isinstance(target, torch._ops.OpOverloadPacket) else target._opname
        name = name.split("::")[-1]
    else:
        name = getattr(target, "__name__", "")
    return node.op == "call_function" and name in GROUPED_PRODUCTS
