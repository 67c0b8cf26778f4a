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

import torch.fx as fx

from ..runtime.chunked_loss import chunks_for
from .ops import canonical
from .regions import REGION
from .rewrite import Rewriter
from .tile import checkpoint_tiles, rows_of

__all__ = ["chunk_mlps"]


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
    if chunked:
        gm.graph.lint()
        gm.recompile()
    return {"chunked_mlps": chunked, "unchunked_mlps": unchunked, "mlp_chunks": emitted}
