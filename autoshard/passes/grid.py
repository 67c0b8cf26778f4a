"""Grids of tokens: a block that convolves its tokens as an image convolves the token sequence (the ``grid`` pass).

Image and video transformers view their tokens as the image inside a block -- Sana's Mix-FFN, PVT's and SegFormer's
depth-wise convolution::

    grid = tokens.unflatten(1, (H, W)).permute(0, 3, 1, 2)          # [B, C, H, W]
    out = conv_point(silu(conv_depth(conv_inverted(grid))))        # 1 x 1, 3 x 3 depth-wise, 1 x 1
    tokens = out.flatten(2).transpose(1, 2)                         # [B, H*W, C]

A view that cuts the sequence into two dims is where the split is lost: a rank's tokens are not a rectangle of the
grid, so the view rules (:mod:`.rules.views`) gather there and the block's convolutions run whole on every rank.
This pass rewrites such a *grid region* so that the sequence stays one dim: each of its values holds the grid's
``(H, W)`` dims as one dim of ``H * W`` cells in row-major order -- the tokens' own order:

* the view that makes the grid (a dim of an attention's query length cut into ``H x W``, both over 1) is the
  region's input; a view that merges the two dims back into one is an output (its users read the flat value);
* a permute that keeps the two dims together and in order permutes the flat value;
* elementwise ops (operands that are grids, or constant over the grid: a bias ``[C, 1, 1]``), ``chunk``/``split``
  along a dim before the grid, casts and copies run on the flat values as they are;
* a ``conv2d`` over the two dims that keeps their size (stride 1, padding ``dilation * (kernel - 1) / 2``)
  becomes ``autoshard::grid_conv`` (:mod:`autoshard.runtime.grid_conv`); a 1 x 1 one, a ``conv1d`` of kernel 1.

A region with any other use of a grid value (a norm over the grid, a graph output, a strided convolution), or
without a convolution, is left as it was. The rules then split a region along the sequence like token-local code:
the convolutions read the rows around a rank's tokens from its neighbours (:mod:`.rules.conv`), and the tokens are
never gathered.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

from .graph import eliminate_dead_code, fake_mode_of, new_node, unused_impure
from .normalize import canonicalize
from .ops import is_tensor_node, op_of, permutation, shape_of, size_key, value_of
from .rules import attention_lengths

__all__ = ["flatten_grids"]

def flatten_grids(gm: fx.GraphModule) -> dict[str, int]:
    """Rewrite every grid region of ``gm`` (see the module docstring); returns how many."""
    lengths = attention_lengths(gm)
    keep = unused_impure(gm.graph)
    done: set[fx.Node] = set()
    count = 0
    for node in list(gm.graph.nodes):
        start = None if node in done else _grid_start(node, lengths)
        region = start and _region(node, *start)
        if region:
            _flatten(gm.graph, node, *start, *region)
            done.update(region[0])
            count += 1
    if count:
        eliminate_dead_code(gm.graph, keep)
        canonicalize(gm)  # users of a region's outputs now read its flat values: their ops are bound again
    return {"grids": count}


def _grid_start(node: fx.Node, lengths: set) -> tuple[int, object, object] | None:
    """``(dim, H, W)`` when ``node`` views a dim of an attention's query length as ``H x W`` (at ``dim, dim + 1``),
    every other dim kept; else None."""
    op = op_of(node)
    if getattr(op, "name", None) != "view" or not is_tensor_node(op["input"]):
        return None
    before, after = shape_of(op["input"]), shape_of(node)
    if len(after) != len(before) + 1:
        return None
    for d, length in enumerate(before):
        height, width = after[d], after[d + 1]
        if (size_key(length) in lengths and size_key(height) != 1 and size_key(width) != 1
                and size_key(height * width) == size_key(length)
                and size_key(before[:d] + before[d + 1:]) == size_key(after[:d] + after[d + 2:])):
            return d, height, width
    return None


def _region(start: fx.Node, dim: int, height, width) -> tuple[dict[fx.Node, int], list[fx.Node]] | None:
    """The grid values reachable from ``start`` (node -> the dim where its grid's two dims begin) and the views
    that merge them back (the region's outputs); None when a grid value has another use or no convolution reads
    one."""
    grid, outputs, stack = {start: dim}, [], [start]
    while stack:
        for user in stack.pop().users:
            if user in grid or user in outputs:
                continue
            followed = _follow(user, grid, height, width)
            if followed is None:
                return None
            if followed == "output":
                outputs.append(user)
            else:
                grid[user] = followed
                stack.append(user)
    if not any(getattr(op_of(n), "name", None) == "conv" for n in grid):
        return None
    return grid, outputs


def _follow(node: fx.Node, grid: dict[fx.Node, int], height, width) -> int | str | None:
    """Where ``node``, a user of grid values, holds its grid (its first dim), ``"output"`` for a view merging it
    back, or None when the region cannot take it."""
    op = op_of(node)
    name = getattr(op, "name", None)
    if name == "pointwise":
        return _follow_elementwise(node, grid, height, width)
    if name not in ("identity", "to", "split", "tuple_get", "view", "permute", "conv") or op["input"] not in grid:
        return None
    dim = grid[op["input"]]
    before = shape_of(op["input"]) if name != "tuple_get" else None
    if name == "view":
        merged = before[:dim] + (height * width,) + before[dim + 2:]
        return "output" if size_key(shape_of(node)) == size_key(merged) else None
    if name == "permute":
        perm = permutation(node)
        at = perm.index(dim)
        return at if at + 1 < len(perm) and perm[at + 1] == dim + 1 else None
    if name == "conv":
        return dim if _keeps_grid(op, dim, before) else None
    if name == "split":
        split_dim = op["dim"] if op["dim"] is not None else (op["args"][1] if len(op["args"]) > 1 else 0)
        return dim if isinstance(split_dim, int) and 0 <= split_dim < dim else None
    return dim  # identity, to, an output of a split


def _keeps_grid(op, dim: int, shape) -> bool:
    """Whether a ``conv2d`` over dims ``dim, dim + 1`` (the last two) keeps their size: stride 1, padding
    ``dilation * (kernel - 1) / 2`` on both, weight and bias not grids themselves."""
    if op["weight"] is None or len(shape_of(op["weight"])) != 4 or dim != len(shape) - 2:
        return False
    kernel, dilation = shape_of(op["weight"])[-2:], _pair(op["dilation"])
    padding = op["padding"]
    if padding == "same":
        padding = tuple(d * (k - 1) // 2 for d, k in zip(dilation, kernel))
    padding = _pair(padding)
    return (_pair(op["stride"]) == (1, 1) and all(isinstance(v, int) for v in padding + dilation)
            and all(2 * p == d * (k - 1) for p, d, k in zip(padding, dilation, kernel)))


def _pair(value) -> tuple:
    """A convolution's per-dim argument (an int for both dims, or a pair) as a pair."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)


def _follow_elementwise(node: fx.Node, grid: dict[fx.Node, int], height, width) -> int | None:
    """An elementwise op's grid dim: its grid operands agree on it and have the output's rank; every other tensor
    operand is constant over the grid (size 1 on both its dims, or not reaching them)."""
    out = shape_of(node)
    dims = {grid.get(n) for n in node.all_input_nodes if is_tensor_node(n) and n in grid}
    if len(dims) != 1 or size_key(out[min(dims):min(dims) + 2]) != size_key((height, width)):
        return None
    dim = dims.pop()
    for n in node.all_input_nodes:
        if not is_tensor_node(n):
            continue
        shape = shape_of(n)
        if n in grid:
            if len(shape) != len(out):
                return None
            continue
        lead = len(out) - len(shape)
        covered = [d - lead for d in (dim, dim + 1) if d >= lead]
        if covered and (len(covered) == 1 or any(shape[c] != 1 for c in covered)):
            return None
    return dim


def _flatten(graph: fx.Graph, start: fx.Node, dim: int, height, width, grid: dict[fx.Node, int],
             outputs: list[fx.Node]) -> None:
    """Emit the flat twin of every grid value before it and point the region's outputs' users at it."""
    flat = {start: op_of(start)["input"]}
    for node in [n for n in graph.nodes if n in grid and n is not start]:
        with graph.inserting_before(node):
            flat[node] = _flat_twin(graph, node, grid, flat, height, width)
    for node in outputs:
        node.replace_all_uses_with(flat[op_of(node)["input"]])


def _flat_value(node: fx.Node, dim: int):
    """``node``'s example value with its grid's two dims as one."""
    value, mode = value_of(node), fake_mode_of(node.graph)
    with mode if mode is not None else contextlib.nullcontext():
        if isinstance(value, (tuple, list)):
            return type(value)(v.flatten(dim, dim + 1) for v in value)
        return value.flatten(dim, dim + 1)


def _flat_twin(graph: fx.Graph, node: fx.Node, grid: dict[fx.Node, int], flat: dict, height, width) -> fx.Node:
    op = op_of(node)
    dim = grid[node]
    example = _flat_value(node, dim)
    if op.name == "permute":
        src_dim = grid[op["input"]]
        perm = [p - (p > src_dim) for i, p in enumerate(permutation(node)) if i != dim + 1]
        return new_node(graph, torch.permute, (flat[op["input"]], perm), example_value=example)
    if op.name == "conv":
        weight, kernel = op["weight"], shape_of(op["weight"])[-2:]
        if tuple(kernel) == (1, 1):
            weight = new_node(graph, torch.flatten, (weight, 2))
            return new_node(graph, torch.conv1d, (flat[op["input"]], weight, op["bias"], 1, 0, 1, op["groups"]),
                            example_value=example)
        dilation = list(_pair(op["dilation"]))
        padding = [d * (k - 1) // 2 for d, k in zip(dilation, kernel)]
        return new_node(graph, torch.ops.autoshard.grid_conv.default,
                        (flat[op["input"]], weight, op["bias"], height, width, padding, dilation, op["groups"]),
                        example_value=example)

    def swap(arg):
        if arg in flat:
            return flat[arg]
        if is_tensor_node(arg) and op.name == "pointwise":  # constant over the grid: its two size-1 dims as one
            lead = len(shape_of(node)) - len(shape_of(arg))
            if dim >= lead:
                return new_node(graph, torch.flatten, (arg, dim - lead, dim - lead + 1))
        return arg
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), swap)
    if op.name == "tuple_get":
        return new_node(graph, operator.getitem, args, kwargs, example_value=example)
    return new_node(graph, node.target, args, kwargs, op=node.op, example_value=example)
