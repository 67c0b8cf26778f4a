"""Tile token-local work over this rank's tokens, each tile under activation checkpointing: one mechanism, a
table of what it tiles.

At long context the largest values of a step are not a layer's saved activations (``recompute="layers"`` keeps
its input only) but what one layer makes while it runs, forward and again in backward: Llama's RMSNorm upcasts
``[tokens, hidden]`` to float32 and its backward makes half a dozen float32 values of that size, the MLP
``[tokens, intermediate]`` ones, the projections and residual adds one each. Row ``i`` of all of them depends on
row ``i`` of the layer's input only: they are *token-local*, and computing them a tile of rows at a time is the
same math (the float sums of the weights' gradients are taken tile by tile, the one difference). ALST's
``SequenceTiledCompute`` does this by hand; this pass finds the work in the graph, in any model's spelling.

What it tiles (:data:`FINDERS`; the chunked LM head + loss, :mod:`.chunking`, is the same idea inside one op):

==================  ===============  ==========================================================================
finder              lever            what it finds
==================  ===============  ==========================================================================
``regions``         ``tile_tokens``  every token-local region: norms, projections, residual adds, the MLP
``mlp``             ``chunk_mlp``    MLP blocks alone (the cheaper lever: only their values), those left
==================  ===============  ==========================================================================

**Regions.** A node is *row-local* when, with ``lead`` its shape but the last dim:

* its op is pointwise (not in place, not random), a cast or copy (``to``, ``float``, ``contiguous``), ``linear``
  (any weight and bias), a reduction or ``softmax`` over dim ``-1`` (reductions with ``keepdim=True``), or a
  ``layer_norm`` / ``rms_norm`` over the last dim;
* every tensor it reads is a *row value* (shape ``lead + [n]``) or a broadcast value of at most one dim (a norm's
  weight, a scalar) -- a ``linear``'s weight and bias are read whole;
* it reads at least one row value.

Row-local nodes with the same ``lead``, the same placement and the same checkpointed region (``regions.REGION``:
a tile never straddles a layer's checkpoint) join into regions, in graph order: a node joins the region of one of
the row values it reads unless something outside that region, between it and the node, depends on the region
(the region must run as one call: no cycle through the outside). A region is tiled when it holds a ``linear``, a
reduction or a norm -- the ops whose values are worth tiling -- and a value that dies inside it (an LM head and
the cast of its logits, both handed out, would only be computed twice).

**MLP blocks**, found from the per-rank graph (every node spelled any way :mod:`.ops` binds)::

    a = linear(x, W1[, b1])              # one up projection (GELU MLP) or more (SwiGLU's gate and up), all of x
    c = linear(x, W2[, b2])              # (optional)
    m = pointwise ops of a [, c] and constants   # gelu(a), silu(a) * c, the tanh spelling of GELU
    y = linear(m, W3[, b3])              # the down projection: the block's output

Every value between ``x`` and ``y`` has no use outside the block and no input from outside it but the weights and
biases. (Not matched: GPT-2's ``Conv1D``, an ``addmm`` over a flattened view; a dropout inside the block.)

**The rewrite** (:func:`checkpoint_tiles`), the same for both::

    pieces_j = torch.split(x_j.flatten(0, -2), sizes)    # every row input x_j, in ``tiles`` near-equal pieces
    outs_k = tag_activation_checkpoint(body, pieces_0[k], ..., w_0, ..., use_reentrant=False)   # tile k
    y_i = torch.cat([outs_0[i], ...]).unflatten(0, lead)  # every value the tiled work hands out

where ``body`` is the work cut out as a submodule over ``[tile, n]`` rows (reductions over ``-1`` and linear
algebra on the last dim do not see the flattening). In forward a tile's values die with its call (the checkpoint
keeps its input only); backward reruns ``body`` a tile at a time: the values exist whole only as outputs, at the
price of one more forward of the tiled ops. ``torch.split``'s backward is one ``cat`` of the tiles' gradients.

Design choices:

* **A pass on the per-rank graph, after ``rewrite``.** There the work is this rank's, sizes are this rank's, and
  nothing inside it communicates (the weights' gradient sums sit in the gradient bucket, outside), so a tile
  reruns no collective. Inference and the rules never see the tiles.
* **Dynamo's own checkpoint.** The tiles are the ``tag_activation_checkpoint`` calls dynamo emits for
  ``torch.utils.checkpoint``, so every inner compiler meets what it already handles; the ops stay the model's own.
* **Before ``outline``; nested inside checkpointed layers.** Work inside a checkpointed region (the model's
  ``torch.utils.checkpoint``, ``recompute="layers"``) is tiled like any other and its new nodes carry the region,
  so ``outline`` cuts them out with the layer: the tiles' checkpoints nest inside the layer's (the tiled ops run
  three times in all, and one tile at a time in the layer's recomputation too). Work that straddles a region's
  edge is left as it is.
* **The same number of tiles on every rank.** The count is derived from the largest rank's rows (the placement
  gives every rank's shape), ``chunks_for(largest rows, tokens)``, and each rank splits its own rows into that
  many near-equal tiles (some empty), so hooks that gather parameters (FSDP) run the same number of times
  everywhere.

Counts: ``tiled_regions`` regions rewritten, ``tiles`` their checkpointed calls, ``untiled_regions`` regions worth
tiling but left (rows unknown, or no point of the graph where the call can sit: an outside user of one output
comes before an input of another); ``chunked_mlps`` MLP blocks rewritten, ``mlp_chunks`` their calls,
``unchunked_mlps`` blocks found but left (all of them when ``chunk_mlp`` is None; else those whose inner values
have other uses, that straddle a region's edge, or whose rows are unknown).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from ..placements import Shard
from ..runtime.chunked_loss import chunks_for
from ..runtime.layouts import split_sizes
from .ops import canonical, numel, shape_of
from .regions import REGION
from .rewrite import Rewriter

__all__ = ["tile", "FINDERS", "rows_of", "checkpoint_tiles"]

_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
_WORTH_TILING = {"linear", "reduce", "softmax", "layer_norm", "rms_norm"}
"""Ops whose presence makes a region worth tiling (the rest are cheap pointwise ops and casts)."""


def rows_of(rewriter: Rewriter, original: fx.Node | None) -> tuple[tuple[int, ...], list[int]] | None:
    """(this rank's leading dims of ``original``'s local value, every rank's rows), read off the placement
    inference gave ``original``, a node of the original graph (None: unknown)."""
    if original is None or len(shape_of(original)) < 2:
        return None
    shape, placement = shape_of(original), rewriter.placement(original)
    if not isinstance(placement, Shard):  # replicated (or partial): whole leading dims on every rank
        return tuple(shape[:-1]), [numel(shape[:-1])] * rewriter.world
    if placement.dim == len(shape) - 1:
        return None
    shapes = [placement.local_shape(shape, r) for r in range(rewriter.world)]
    return tuple(shapes[rewriter.rank][:-1]), [numel(s[:-1]) for s in shapes]


def checkpoint_tiles(gm: fx.GraphModule, members: list[fx.Node], row_inputs: list[fx.Node], outputs: list[fx.Node],
                     lead: tuple[int, ...], tiles: int, name: str, before: fx.Node) -> list[fx.Node]:
    """Replace ``members`` (in graph order) by ``tiles`` checkpointed calls of them cut out as ``gm``'s submodule
    ``name``, inserted before ``before``: every ``row_inputs`` value is split over its rows (all leading dims),
    every other value the members read is passed whole, and each of ``outputs`` is the tiles' rows concatenated
    (the new nodes returned, in the order of ``outputs``)."""
    graph, inside = gm.graph, set(members)
    whole: dict[fx.Node, None] = {}
    for node in members:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in row_inputs:
                whole.setdefault(arg)
    body_graph = fx.Graph()
    env = {x: body_graph.placeholder(f"tile_{i}") for i, x in enumerate(row_inputs)}
    env.update({arg: body_graph.placeholder(arg.name) for arg in whole})
    for node in members:
        env[node] = body_graph.node_copy(node, env.__getitem__)
    body_graph.output(tuple(env[y] for y in outputs))
    while hasattr(gm, name):
        name += "_"
    setattr(gm, name, fx.GraphModule(gm, body_graph))
    sizes = split_sizes(numel(lead), tiles)
    with graph.inserting_before(before):
        body = graph.get_attr(name)
        pieces = [graph.call_function(torch.split, (graph.call_method("flatten", (x, 0, -2)), sizes, 0))
                  for x in row_inputs]
        calls = [graph.call_function(_CHECKPOINT, (body, *(graph.call_function(operator.getitem, (p, k))
                                                           for p in pieces), *whole), {"use_reentrant": False})
                 for k in range(tiles)]
        results = []
        for i, y in enumerate(outputs):
            rows = [graph.call_function(operator.getitem, (call, i)) for call in calls]
            results.append(graph.call_method("unflatten", (graph.call_function(torch.cat, (rows, 0)), 0, lead)))
            results[-1].meta.update({k: v for k, v in y.meta.items() if k in ("stack_trace", "nn_module_stack")})
    region = members[0].meta.get(REGION)
    if region is not None:  # inside a checkpointed region: ``outline`` takes the tiles into its body
        node = body
        while node is not before:
            node.meta[REGION] = region
            node = node.next
    for y, new in zip(outputs, results):
        y.replace_all_uses_with(new)
    for node in reversed(members):
        graph.erase_node(node)
    return results


# ----------------------------------------------------------------------------- finding the regions


def _dim_is_last(dim) -> bool:
    return dim == -1 or (isinstance(dim, (list, tuple)) and list(dim) == [-1])


_IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv}


def _random(fn: str) -> bool:
    """Whether the ATen op ``fn`` draws random numbers (a tile would draw other numbers than the whole)."""
    packet = getattr(torch.ops.aten, fn.rstrip("_"), None)
    return packet is not None and any(torch.Tag.nondeterministic_seeded in getattr(packet, ov).tags
                                      for ov in packet.overloads())


def _read_whole(node: fx.Node) -> set:
    """The inputs a row-local node reads whole whatever their shape: a ``linear``'s weight and bias."""
    op = canonical(node)
    return {op["weight"], op["bias"]} if op.name == "linear" else set()


def _is_row(arg_shape: tuple | None, lead: tuple) -> bool:
    """Whether a value of ``arg_shape`` is a row value over ``lead`` (``lead + [n]``)."""
    return arg_shape is not None and len(arg_shape) >= 2 and arg_shape[:-1] == lead


def _row_local(node: fx.Node, shape: dict[fx.Node, tuple]) -> bool:
    """Whether ``node`` is row-local (see the module docstring); ``shape``: the global shape of the nodes known."""
    out = shape.get(node)
    op = canonical(node)
    if out is None or len(out) < 2 or op is None or (node.op == "call_method" and node.target.endswith("_")):
        return False
    name = op.name
    if name == "pointwise" and (str(getattr(node.target, "__name__", node.target)).endswith("_")
                                or node.target in _IN_PLACE_OPERATORS or _random(op["fn"])):
        return False
    if name == "reduce" and not (_dim_is_last(op["dim"]) and op["keepdim"]):
        return False
    if name == "softmax" and not _dim_is_last(op["dim"]):
        return False
    if name in ("layer_norm", "rms_norm") and len(op["normalized_shape"]) != 1:
        return False
    if name not in ("pointwise", "to", "identity", "linear", *_WORTH_TILING):
        return False
    lead, rows, whole = out[:-1], 0, _read_whole(node)
    for arg in node.all_input_nodes:
        if arg in whole:
            continue
        arg_shape = shape.get(arg)
        if _is_row(arg_shape, lead):
            rows += 1
        elif arg_shape is None or len(arg_shape) > 1:
            return False
    return rows > 0


@dataclass
class _TokenLocalRegion:
    """Row-local nodes tiled as one call (see the module docstring)."""

    key: tuple
    """(lead, placement, checkpointed region): what every member shares."""
    nodes: list[fx.Node] = field(default_factory=list)


def _token_local_regions(gm: fx.GraphModule, shape: dict[fx.Node, tuple],
                         placement: dict[fx.Node, object]) -> list[_TokenLocalRegion]:
    """The regions of row-local nodes (see the module docstring), in graph order."""
    regions: list[_TokenLocalRegion] = []
    region_of: dict[fx.Node, int] = {}
    upstream: dict[fx.Node, int] = {}  # node -> bitmask of the regions it depends on (members: their own too)
    for node in gm.graph.nodes:
        inputs = node.all_input_nodes
        depends = 0
        for arg in inputs:
            depends |= upstream.get(arg, 0)
        if not _row_local(node, shape):
            upstream[node] = depends
            continue
        key = (shape[node][:-1], placement.get(node), node.meta.get(REGION))
        chosen = None
        for arg in inputs:
            index = region_of.get(arg)
            if index is None or regions[index].key != key:
                continue
            bit = 1 << index
            if not any(upstream.get(other, 0) & bit for other in inputs if region_of.get(other) != index):
                chosen = index
                break
        if chosen is None:
            chosen = len(regions)
            regions.append(_TokenLocalRegion(key))
        regions[chosen].nodes.append(node)
        region_of[node] = chosen
        upstream[node] = depends | (1 << chosen)
    return regions


def _hoist_inputs(members: list[fx.Node], before: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Make every value ``members`` read from outside come before ``before`` (where their tiled call goes),
    moving up those that come later but read only values before it (a parameter through its gradient bucket,
    emitted at its first use: the ``k_proj`` weight after the ``q_proj`` output's view); False when one cannot."""
    inside = set(members)
    late = sorted({arg for n in members for arg in n.all_input_nodes if arg not in inside and order[arg] > order[before]},
                  key=order.__getitem__)
    if any(order[arg] >= order[before] for node in late for arg in node.all_input_nodes):
        return False
    for node in late:
        before.prepend(node)
    return True


def _tile_regions(gm: fx.GraphModule, tokens_per_tile: int | None, rewriter: Rewriter) -> dict[str, int]:
    """Tile every token-local region of the per-rank graph ``gm`` that ``rewriter`` made (none when
    ``tokens_per_tile`` is None; see the module docstring for the counts)."""
    if tokens_per_tile is None:
        return {"tiled_regions": 0, "untiled_regions": 0, "tiles": 0}
    original_of = rewriter.originals()
    shape = rewriter.global_shapes(original_of)
    placement = {node: rewriter.placement(original) for node, original in original_of.items()}
    tiled = untiled = emitted = 0
    for region in _token_local_regions(gm, shape, placement):
        members, inside = region.nodes, set(region.nodes)
        outputs = [n for n in members if any(user not in inside for user in n.users)]
        if len(outputs) == len(members) or not any(canonical(n).name in _WORTH_TILING for n in members):
            continue  # nothing would die inside a tile, or nothing worth it
        row_inputs = list(dict.fromkeys(arg for n in members for arg in n.all_input_nodes
                                        if arg not in inside and arg not in _read_whole(n)
                                        and _is_row(shape.get(arg), region.key[0])))
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        users = [user for y in outputs for user in y.users if user not in inside]
        before = min(users, key=order.__getitem__) if users else None
        rows = rows_of(rewriter, original_of.get(outputs[0])) if outputs else None
        if rows is None or before is None or not _hoist_inputs(members, before, order):
            untiled += 1
            continue
        lead, every_rank = rows
        tiles = chunks_for(max(every_rank), tokens_per_tile)
        results = checkpoint_tiles(gm, members, row_inputs, outputs, lead, tiles, f"tile_body_{tiled}", before)
        shape.update({new: shape[y] for y, new in zip(outputs, results)})
        placement.update({new: placement.get(y) for y, new in zip(outputs, results)})
        tiled += 1
        emitted += tiles
    return {"tiled_regions": tiled, "untiled_regions": untiled, "tiles": emitted}


# ----------------------------------------------------------------------------- MLP blocks


def _match(down: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(``x``, the block's nodes before ``down`` in graph order) when ``down`` ends the ops of an MLP block (see
    the module docstring; whether its values are used elsewhere is not checked here), else None."""
    op = canonical(down)
    if op is None or op.name != "linear" or not isinstance(op["input"], fx.Node):
        return None
    inner: set[fx.Node] = set()
    ups: list[fx.Node] = []
    frontier = [op["input"]]
    while frontier:
        node = frontier.pop()
        if node in inner:
            continue
        node_op = canonical(node)
        if node_op is None or node_op.name not in ("linear", "pointwise"):
            return None
        inner.add(node)
        if node_op.name == "linear":
            ups.append(node)
        else:
            frontier += node.all_input_nodes
    if not ups or canonical(op["input"]).name != "pointwise":  # linear -> linear: no activation between
        return None
    x = canonical(ups[0])["input"]
    weights = [w for o in (op, *map(canonical, ups)) for w in (o["weight"], o["bias"])]
    if not isinstance(x, fx.Node) or any(canonical(up)["input"] is not x for up in ups) or \
            any(isinstance(w, fx.Node) and w in inner for w in weights):
        return None
    order = {n: i for i, n in enumerate(down.graph.nodes)}
    return x, sorted(inner, key=order.__getitem__)


def _tile_mlps(gm: fx.GraphModule, tokens_per_chunk: int | None, rewriter: Rewriter) -> dict[str, int]:
    """Chunk every MLP block of the per-rank graph ``gm`` that ``rewriter`` made (none when ``tokens_per_chunk``
    is None; see the module docstring for the counts)."""
    chunked = unchunked = emitted = 0
    original_of = rewriter.originals()
    for down in list(gm.graph.nodes):  # a block's nodes come before its down projection: none is met erased
        found = _match(down)
        if found is None:
            continue
        x, block = found
        rows = rows_of(rewriter, original_of.get(down)) if tokens_per_chunk is not None else None
        members = {*block, down}
        closed = all(user in members for node in block for user in node.users)
        if rows is None or not closed or len({n.meta.get(REGION) for n in members}) != 1:
            unchunked += 1
            continue
        lead, every_rank = rows
        chunks = chunks_for(max(every_rank), tokens_per_chunk)
        checkpoint_tiles(gm, [*block, down], [x], [down], lead, chunks, f"mlp_chunk_body_{chunked}", down.next)
        chunked += 1
        emitted += chunks
    return {"chunked_mlps": chunked, "unchunked_mlps": unchunked, "mlp_chunks": emitted}


# ----------------------------------------------------------------------------- the pass


FINDERS: tuple[tuple[str, Callable[[fx.GraphModule, int | None, Rewriter], dict[str, int]]], ...] = (
    ("tile_tokens", _tile_regions),
    ("chunk_mlp", _tile_mlps),
)
"""(the config field of its tokens per tile, the finder that tiles what it finds), in the order they run:
the MLP blocks a region took are no longer in the graph when the MLP finder looks."""


def tile(gm: fx.GraphModule, config, rewriter: Rewriter) -> dict[str, int]:
    """Tile what every finder of :data:`FINDERS` finds in the per-rank graph ``gm`` that ``rewriter`` made, each
    with its lever's tokens per tile from ``config`` (:class:`~autoshard.config.BackendConfig`); the counts of
    all (see the module docstring)."""
    counts: dict[str, int] = {}
    for lever, finder in FINDERS:
        counts.update(finder(gm, getattr(config, lever), rewriter))
    if any(getattr(config, lever) for lever, _ in FINDERS):
        gm.graph.lint()
        gm.recompile()
    return counts
