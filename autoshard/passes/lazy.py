"""Logits nobody reads cost nothing: a returned LM head's output becomes a lazy value (the ``lazy`` pass).

transformers' ``*ForCausalLM`` called with ``labels=`` returns the logits beside the loss. Once the loss is
chunked (:mod:`.chunking`), the head's ``linear`` is there only for that output: the graph would compute the
``[S / P, V]`` logits (the step's largest value at long context, one more product of the head) whether or not
the caller reads them. This pass hands them back as :class:`~autoshard.runtime.lazy_linear.LazyLinear` instead:
the graph keeps ``h`` (``[S / P, H]``) and computes ``linear(h, W, b)`` when, and if, the caller reads the
logits -- with the same values and gradients (see that module). Other designs were weighed: dropping the
output (the caller's ``out.logits`` would change), an option the user sets (the point is that nobody has to),
computing the logits inside the chunked loss and keeping them (their memory is the problem).

The graph itself returns ``h`` in the logits' place (:class:`LazyOutput` says where the head's weight and bias
are among its inputs); the backend makes the lazy value from them outside the compiled graph, so any inner
compiler (eager, aot_eager, inductor) compiles an ordinary graph. A ``linear`` node is made lazy when (each
condition keeps the rewrite invisible or worth it):

* its only user is the graph's output (a value the graph itself reads is computed anyway);
* its output has at least :data:`LAZY_RATIO` times the elements of its input ``h`` (a vocabulary head, not a
  small projection that is cheaper to compute than to explain);
* its weight and bias are inputs of the graph (parameters are, as dynamo traces modules today).

The plan (:mod:`autoshard.planner`) counts the lazy logits as unread: its step backpropagates the loss, not
them, and holds ``h`` for them.

A returned KV cache is found here too (:func:`kv_cache_outputs`) but not made lazy. transformers' models default
to ``use_cache=True``, so a training call that does not pass ``use_cache=False`` returns every layer's keys and
values (a ``DynamicCache``): ``Hkv * D`` per token and layer, each. Where autograd saves them for the attention's
backward anyway they cost nothing more; under checkpointed layers it does not, and the cache is held beside what
the step needs (80 GiB per rank for Llama-3-8B at 5M tokens on 8 ranks). Handing them back lazily would mean
keeping what recomputes them -- the layer's input, ``H`` per token, where the cache is ``2 * Hkv * D`` (half of
that for grouped-query attention: Llama-3-8B's 4096 against 2048), and kept past the checkpoint, which frees it
after the layer's backward (or keeps it in host memory, with offload) -- so the lazy form would hold more than
the cache. The plan names the cache's bytes and the fix (``use_cache=False``) instead, and a compiled training
call that returns one warns once (:mod:`.pipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .ops import numel, op_of, shape_of, value_of

__all__ = ["LazyOutput", "lazy_outputs", "kv_cache_outputs", "LAZY_RATIO"]

LAZY_RATIO = 8
"""A returned ``linear`` becomes lazy only when its output has at least this many times its input's elements
(a vocabulary head: ``V / H``, 31 for Llama-3)."""


@dataclass(frozen=True)
class LazyOutput:
    """An output the graph returns as the input of its head: the backend makes ``lazy_linear(h, W, b)`` of it."""

    weight: int
    """The graph input (placeholder position) that is the head's weight."""
    bias: int | None
    """The graph input that is the head's bias, or None."""
    dtype: torch.dtype
    """The dtype the head computes in (under autocast, the autocast dtype)."""
    split: bool = False
    """Whether the graph returns ``h`` split along the sequence (set by the rewrite): then the head's parameters get
    this rank's share of their gradient, summed over the ranks as the graph's own parameter uses are."""


def lazy_outputs(gm: fx.GraphModule) -> dict[int, LazyOutput]:
    """Make every returned vocabulary head of ``gm`` lazy: the graph returns its input ``h`` instead. Returns
    output position -> :class:`LazyOutput`."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if not isinstance(output.args[0], (tuple, list)):
        return {}
    inputs = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    values, lazy, heads = list(output.args[0]), {}, []
    for position, node in enumerate(values):
        op = op_of(node) if isinstance(node, fx.Node) else None
        if op is None or op.name != "linear" or set(node.users) != {output}:
            continue
        h, weight, bias = op["input"], op["weight"], op["bias"]
        if not isinstance(h, fx.Node) or numel(shape_of(node)) < LAZY_RATIO * numel(shape_of(h)) or \
                weight not in inputs or (bias is not None and bias not in inputs):
            continue
        lazy[position] = LazyOutput(inputs[weight], inputs[bias] if bias is not None else None, value_of(node).dtype)
        values[position] = h
        heads.append(node)
    if lazy:
        output.args = (type(output.args[0])(values),)
        for node in heads:
            if not node.users:  # returned twice: still erased once
                gm.graph.erase_node(node)
    return lazy


def kv_cache_outputs(gm: fx.GraphModule) -> list[int]:
    """The output positions of ``gm`` that return an attention's keys or values: a returned KV cache
    (transformers' ``use_cache=True``: the ``DynamicCache`` hands back the very tensors the attention reads)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if not isinstance(output.args[0], (tuple, list)):
        return []
    attentions = [op for op in map(op_of, gm.graph.nodes) if op is not None and op.name == "attention"]
    read = {op[key] for op in attentions for key in ("k", "v")}
    return [position for position, node in enumerate(output.args[0]) if isinstance(node, fx.Node) and node in read]
