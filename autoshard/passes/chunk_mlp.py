"""Chunk the token-local MLP blocks over this rank's tokens, each chunk under activation checkpointing.

The block, found from the per-rank graph (every node of it spelled any way :mod:`.ops` binds)::

    a = linear(x, W1[, b1])              # one up projection (GELU MLP) or more (SwiGLU's gate and up), all of x
    c = linear(x, W2[, b2])              # (optional)
    m = pointwise ops of a [, c] and constants   # gelu(a), silu(a) * c, the tanh spelling of GELU
    y = linear(m, W3[, b3])              # the down projection: the block's output

Every value between ``x`` and ``y`` has no use outside the block and no input from outside it but the weights
and biases. (Not matched: GPT-2's ``Conv1D``, an ``addmm`` over a flattened view; a dropout inside the block.) Such a block is row-local over all leading dims of ``x``: row ``i`` of ``y`` depends on row ``i`` of
``x`` only, whatever the dims mean, so computing it a slice of rows at a time is the same math (the float sums
of the weights' gradients are taken chunk by chunk, the one difference from one matmul). It becomes::

    pieces = torch.split(x.flatten(0, -2), sizes)       # this rank's rows in ``chunks`` near-equal pieces
    y_k = tag_activation_checkpoint(body, pieces[k], W1, ..., use_reentrant=False)[0]   # for every piece k
    y = torch.cat([y_0, ...]).unflatten(0, x.shape[:-1])

where ``body`` is the block cut out as a submodule. In forward a chunk's ``[c, intermediate]`` values die with
its call (the checkpoint keeps its input only); backward reruns ``body`` on one chunk at a time and frees its
values before the next: the block's ``[tokens, intermediate]`` values never exist whole, at the price of one
more forward of the block. ``torch.split``'s backward is one ``cat`` of the chunks' gradients (slices would
each allocate a zeroed ``[tokens, hidden]`` gradient).

Design choices:

* **A pass on the per-rank graph, after ``rewrite``.** There the block is this rank's computation, sizes are
  this rank's, and nothing inside it communicates (the weights' gradient sums sit in the gradient bucket, outside
  the block), so a chunk reruns no collective. Inference and the rules never see the chunks.
* **Dynamo's own checkpoint.** The chunks are the ``tag_activation_checkpoint`` calls dynamo emits for
  ``torch.utils.checkpoint``, so every inner compiler meets what it already handles: eager runs
  ``torch.utils.checkpoint`` on the body, AOTAutograd tags the body's nodes for recomputation. The block's ops
  stay the model's own (any activation spelling), where a custom op would have to re-implement them.
* **Before ``outline``; nested inside checkpointed layers.** A block inside a checkpointed region (the model's
  ``torch.utils.checkpoint``, transformers' gradient checkpointing) is chunked like any other and its new
  nodes carry the region, so ``outline`` cuts them out with the layer: the chunks' checkpoints nest inside the
  layer's. Leaving such blocks whole would keep memory down in forward but not in backward, where the layer's
  recomputation holds the whole ``[tokens, intermediate]`` again; nested, it runs the block once more (three
  forwards in all) and holds one chunk at a time there too. A block whose nodes straddle a region's edge is
  left as it is.
* **The same number of chunks on every rank.** A rank's shards differ by a token or so under uneven splits;
  the count is derived from the largest rank's rows (the block output's placement gives every rank's shape),
  ``chunks_for(largest rows, chunk_mlp)``, and each rank splits its own rows into that many near-equal chunks
  (some empty when it has fewer rows than chunks). Every rank thus runs the same checkpoints, so hooks that
  gather parameters (FSDP) run the same number of times everywhere.

Counts: ``chunked_mlps`` blocks rewritten; ``unchunked_mlps`` blocks found but left as they are (all of them
when ``chunk_mlp`` is None; else those whose inner values have other uses, that straddle a region's edge, or
whose rows are unknown); ``mlp_chunks`` the checkpointed calls emitted (every chunked block's chunk count,
summed).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..placements import Shard
from ..runtime.chunked_loss import chunks_for
from .ops import canonical, numel, shape_of
from .regions import REGION
from .rewrite import Rewriter

__all__ = ["chunk_mlps", "split_sizes"]

_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


def split_sizes(rows: int, chunks: int) -> list[int]:
    """``rows`` cut into exactly ``chunks`` near-equal sizes (the first ones one larger; zeros when there are fewer
    rows than chunks)."""
    size, extra = divmod(rows, chunks)
    return [size + (k < extra) for k in range(chunks)]


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


def _rows(rewriter: Rewriter, original: fx.Node | None) -> tuple[tuple[int, ...], list[int]] | None:
    """(this rank's leading dims of the block's output, every rank's rows), read off the placement inference gave
    ``original``, the node of the original graph whose local value the block computes (None: unknown)."""
    if original is None or len(shape_of(original)) < 2:
        return None
    shape, placement = shape_of(original), rewriter.placement(original)
    if not isinstance(placement, Shard):  # replicated (or partial): whole leading dims on every rank
        return tuple(shape[:-1]), [numel(shape[:-1])] * rewriter.world
    if placement.dim == len(shape) - 1:
        return None
    shapes = [placement.local_shape(shape, r) for r in range(rewriter.world)]
    return tuple(shapes[rewriter.rank][:-1]), [numel(s[:-1]) for s in shapes]


def _rewrite(gm: fx.GraphModule, down: fx.Node, x: fx.Node, block: list[fx.Node], lead: tuple[int, ...],
             chunks: int, index: int) -> None:
    """Replace ``block`` and ``down`` by ``chunks`` checkpointed calls of the block cut out as ``gm``'s submodule."""
    graph, members = gm.graph, [*block, down]
    inside = set(members)
    externals: dict[fx.Node, None] = {}
    for node in members:
        for arg in node.all_input_nodes:
            if arg not in inside and arg is not x:
                externals.setdefault(arg)
    body_graph = fx.Graph()
    env = {x: body_graph.placeholder("chunk")}
    env.update({arg: body_graph.placeholder(arg.name) for arg in externals})
    for node in members:
        env[node] = body_graph.node_copy(node, env.__getitem__)
    body_graph.output((env[down],))
    name = f"mlp_chunk_body_{index}"
    while hasattr(gm, name):
        name += "_"
    setattr(gm, name, fx.GraphModule(gm, body_graph))
    with graph.inserting_before(down):
        body = graph.get_attr(name)
        pieces = graph.call_function(torch.split, (graph.call_method("flatten", (x, 0, -2)),
                                                   split_sizes(numel(lead), chunks), 0))
        outputs = []
        for k in range(chunks):
            call = graph.call_function(_CHECKPOINT, (body, graph.call_function(operator.getitem, (pieces, k)),
                                                     *externals), {"use_reentrant": False})
            outputs.append(graph.call_function(operator.getitem, (call, 0)))
        y = graph.call_method("unflatten", (graph.call_function(torch.cat, (outputs, 0)), 0, lead))
    y.meta.update({k: v for k, v in down.meta.items() if k in ("stack_trace", "nn_module_stack")})
    if REGION in down.meta:  # inside a checkpointed region: ``outline`` takes the chunks into its body
        node = body
        while node is not down:
            node.meta[REGION] = down.meta[REGION]
            node = node.next
    down.replace_all_uses_with(y)
    for node in reversed(members):
        graph.erase_node(node)


def chunk_mlps(gm: fx.GraphModule, tokens_per_chunk: int | None, rewriter: Rewriter) -> dict[str, int]:
    """Chunk every MLP block of the per-rank graph ``gm`` that ``rewriter`` made (none when ``tokens_per_chunk``
    is None; see the module docstring for the counts)."""
    chunked = unchunked = emitted = 0
    original_of = {new: original for original, new in rewriter.env.items() if isinstance(new, fx.Node)}
    for down in list(gm.graph.nodes):  # a block's nodes come before its down projection: none is met erased
        found = _match(down)
        if found is None:
            continue
        x, block = found
        rows = _rows(rewriter, original_of.get(down)) if tokens_per_chunk is not None else None
        members = {*block, down}
        closed = all(user in members for node in block for user in node.users)
        if rows is None or not closed or len({n.meta.get(REGION) for n in members}) != 1:
            unchunked += 1
            continue
        lead, every_rank = rows
        chunks = chunks_for(max(every_rank), tokens_per_chunk)
        _rewrite(gm, down, x, block, lead, chunks, chunked)
        chunked += 1
        emitted += chunks
    if chunked:
        gm.graph.lint()
        gm.recompile()
    return {"chunked_mlps": chunked, "unchunked_mlps": unchunked, "mlp_chunks": emitted}
