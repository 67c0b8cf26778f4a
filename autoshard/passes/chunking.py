"""Chunk the LM head and its loss: ``linear -> cross_entropy`` becomes ``autoshard::linear_cross_entropy``.

The pattern, found from the graph (like Inductor's pattern rewrites, each one counted)::

    logits = linear(h, W[, b])                   # W: [V, H]
    logits = logits.float() / .to(float32)       # optional upcasts (never to a narrower dtype)
    logits = logits[:, :-1] / .view(-1, V) / .contiguous()   # optional: slices of the tokens, flattening
    loss = F.cross_entropy(logits [N, V], target [N], weight=, ignore_index=, label_smoothing=, reduction=)

becomes ``linear_cross_entropy(h' [N, H], W, target, b, ...)`` where ``h'`` is ``h`` under the same slices and
flattening (a slice of the tokens commutes with the head; views keep the last dim). Every link of the
chain must have no other use, the chain's ops may not touch the last (class) dim, and the loss must take
class indices (not probabilities); anything else is left as it is.

The logits themselves may have other uses: transformers' ``*ForCausalLM`` return them next to the loss.
Then the head stays for those uses and only the loss is chunked: the logits are held in the head's dtype
(bfloat16 ``[tokens, V]``, split along the sequence like every output) because the caller gets them, but
their float32 upcast, the log-softmax autograd would save and their float32 gradient -- three times their
size -- never exist. The price is one more head matmul in forward (the op computes its chunks' logits
itself; it never reads the returned ones, so they can be freed as soon as the caller drops them). Counted
as ``logits_kept``. Under ``torch.autocast``
``h`` and ``W`` are cast to the dtype the head ran in, and the loss keeps the dtype ``cross_entropy``
returned (see :mod:`autoshard.runtime.chunked_loss` for what runs): each chunk's logits go from the head's
dtype to the loss's compute dtype (float32; float64 for float64), exactly what an upcast ``.float()`` does.
A cast to a narrower dtype (``.float()`` of float64 logits, ``.half()``) is not chunked: the loss would come
out more precise than one device's, not equal to it.

The pass runs before inference, so the loss rule (:mod:`.rules.loss`) sees the new op: the tokens of
``h'`` are linked to the targets', each rank runs it on its own tokens, and a mean stays exact (local
sums and denominators all-reduced). The number of chunks is set there per world size
(``BackendConfig.chunk_loss``); here, for the whole graph.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..runtime.chunked_loss import chunks_for, linear_cross_entropy
from .graph import new_node
from .ops import OP_KEY, canonical, op_of, register_canonical, shape_of, value_of

__all__ = ["chunk_losses"]


@register_canonical("linear_cross_entropy", functions=[linear_cross_entropy])
def _bind_linear_cross_entropy(h, weight, target, bias=None, *, class_weight=None, ignore_index=-100,
                               label_smoothing=0.0, reduction="mean", chunks=1, out_dtype=None):
    return {"input": h, "weight": weight, "target": target, "bias": bias, "class_weight": class_weight,
            "ignore_index": ignore_index, "label_smoothing": label_smoothing, "reduction": reduction,
            "chunks": chunks, "out_dtype": out_dtype}


_KEEP_METHODS = ("contiguous", "clone")
"""Identity methods a chain may hold (``detach`` and friends stop gradients: not a link)."""


def _token_index(index, ndim: int) -> tuple | None:
    """``index`` as a tuple of ``ndim`` entries when it holds only slices (and one Ellipsis) and leaves the
    last dim whole; else None."""
    index = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, slice) or i is Ellipsis for i in index) or sum(i is Ellipsis for i in index) > 1:
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (ndim - len(index) + 1) + index[at + 1:]
    index = index + (slice(None),) * (ndim - len(index))
    if len(index) != ndim or index[-1] != slice(None):
        return None
    return index


def _link(node: fx.Node, classes: int) -> str | None:
    """What kind of chain link ``node`` is (``"cast"``, ``"view"``, ``"keep"``, ``"slice"``), or None."""
    op = op_of(node)
    if op is None or not isinstance(value_of(node), torch.Tensor) or len(node.users) != 1:
        return None
    src = op.get("input")
    if not isinstance(src, fx.Node) or not isinstance(value_of(src), torch.Tensor):
        return None
    before, after = value_of(src), value_of(node)
    if before.dim() < 1 or after.dim() < 1 or after.shape[-1] != classes:
        return None
    if op.name == "to":
        if not after.is_floating_point() or after.element_size() < before.element_size() or after.shape != before.shape:
            return None
        return "cast"
    if op.name == "view" and before.numel() == after.numel():
        return "view"
    if op.name == "identity" and node.op == "call_method" and node.target in _KEEP_METHODS:
        return "keep"
    if op.name == "getitem" and _token_index(op["index"], before.dim()) is not None:
        return "slice"
    return None


def _match(ce: fx.Node):
    """(linear node, chain from the linear to the loss's input) of a chunkable loss, or None."""
    op = op_of(ce)
    if op is None or op.name != "cross_entropy" or ce.target is not F.cross_entropy:
        return None
    logits, target = op["input"], op["target"]
    if not isinstance(logits, fx.Node) or not isinstance(target, fx.Node):
        return None
    lv, tv = value_of(logits), value_of(target)
    if not isinstance(lv, torch.Tensor) or not isinstance(tv, torch.Tensor) or tv.is_floating_point():
        return None
    if lv.dim() != 2 or tv.dim() != 1 or op["reduction"] not in ("none", "sum", "mean"):
        return None
    if op["weight"] is not None and not isinstance(op["weight"], fx.Node):
        return None
    classes = lv.shape[1]
    chain, node = [], logits
    while True:
        head = op_of(node)
        if head is not None and head.name == "linear":
            break
        if _link(node, classes) is None:
            return None
        chain.append(node)
        node = op_of(node)["input"]
    weight = head["weight"]
    if not isinstance(weight, fx.Node) or shape_of(weight)[0] != classes or \
            len(shape_of(weight)) != 2 or not isinstance(head["input"], fx.Node):
        return None
    if head["bias"] is not None and not isinstance(head["bias"], fx.Node):
        return None
    if not value_of(node).is_floating_point():
        return None
    return node, chain[::-1]


def _rewrite(graph: fx.Graph, ce: fx.Node, linear: fx.Node, chain: list[fx.Node], tokens_per_chunk: int) -> None:
    op, head = op_of(ce), op_of(linear)
    hidden = shape_of(head["weight"])[1]
    mm_dtype = value_of(linear).dtype
    with graph.inserting_before(ce):
        h = head["input"]
        for link in chain:  # the chain's slices and views, on h
            kind = _link(link, shape_of(link)[-1])
            if kind == "slice":
                h = new_node(graph, operator.getitem, (h, _token_index(op_of(link)["index"], len(shape_of(link)))))
            elif kind == "view":
                h = new_node(graph, "reshape", (h, tuple(shape_of(link)[:-1]) + (hidden,)), op="call_method")
        if len(shape_of(h)) != 2:
            h = new_node(graph, "reshape", (h, (-1, hidden)), op="call_method")

        def cast(x):
            if x is None or value_of(x).dtype == mm_dtype:
                return x
            return new_node(graph, "to", (x, mm_dtype), op="call_method")

        rows = shape_of(op["target"])[0]
        loss = new_node(graph, linear_cross_entropy, (cast(h), cast(head["weight"]), op["target"], cast(head["bias"])),
                        {"class_weight": op["weight"], "ignore_index": op["ignore_index"],
                         "label_smoothing": float(op["label_smoothing"]), "reduction": op["reduction"],
                         "chunks": chunks_for(rows, tokens_per_chunk), "out_dtype": value_of(ce).dtype})
    loss.meta.update({k: v for k, v in ce.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
    ce.replace_all_uses_with(loss)
    for dead in [ce, *chain[::-1]]:
        graph.erase_node(dead)
    if not linear.users:  # else the logits are also returned (or used otherwise): the head stays for them
        graph.erase_node(linear)
    for user in loss.users:  # they named the loss node; new nodes are bound on demand
        user.meta[OP_KEY] = canonical(user)


def chunk_losses(gm: fx.GraphModule, tokens_per_chunk: int | None) -> dict[str, int]:
    """Rewrite every chunkable ``linear -> cross_entropy`` of ``gm`` (none when ``tokens_per_chunk`` is None);
    counts: ``chunked_losses`` rewritten, ``unchunked_losses`` cross-entropies left as they were, ``logits_kept``
    chunked losses whose head stays for the logits' other uses."""
    losses = [n for n in gm.graph.nodes if (o := op_of(n)) is not None and o.name == "cross_entropy"]
    if tokens_per_chunk is None:
        return {"chunked_losses": 0, "unchunked_losses": len(losses)}
    chunked = kept = 0
    for ce in losses:
        found = _match(ce)
        if found is None:
            continue
        kept += len(found[0].users) > 1  # the logits have uses besides the loss
        _rewrite(gm.graph, ce, *found, tokens_per_chunk)
        chunked += 1
    return {"chunked_losses": chunked, "unchunked_losses": len(losses) - chunked, "logits_kept": kept}
