"""Rule tables: how each canonical op links sequence dims and how it runs on shards.

One file per op family, each registering its ops in :mod:`~autoshard.passes.rules.registry` on import (like
DTensor's ``_ops/``); importing the package imports every file:

=================  ============================================================================
file               ops
=================  ============================================================================
``pointwise``      elementwise ops (ATen ``pointwise`` tag), casts, identity, dropout
``views``          view/reshape/flatten/squeeze/unsqueeze, permute/transpose, expand, repeat,
                   repeat_interleave, getitem / narrow / select
``joins``          split / chunk / unbind, cat, stack, pad
``matmul``         linear, matmul/bmm/mm, addmm
``norms``          layer_norm, rms_norm, softmax/log_softmax (and over the sequence)
``reductions``     sum/mean/amax/... over any dims, cumsum
``selection``      topk, sort, argsort, cummax along a dim (and max/min with indices)
``embedding``      embedding, gather, index_select, scatter
``factories``      arange and friends: positions of the local tokens
``loss``           cross_entropy / nll_loss, elementwise losses: exact global reductions
``attention``      the captured attention: distributed attention
``conv``           convolutions: 1-d ones along the sequence split with halos (strided too)
``recurrence``     the gated delta rule and Mamba2's scan: state passing between ranks
=================  ============================================================================

A rule is two functions: ``link(ctx, node, op)`` declares edges between sequence elements (see
:mod:`autoshard.passes.infer`), ``rewrite(rw, node, op)`` emits the local computation into the new graph
through a :class:`~autoshard.passes.rewrite.Rewriter` (a rule for split outputs only is wrapped in
:func:`~autoshard.passes.rules.pointwise.when_output_split`, which runs the node whole when its output is not
split). The rewriter asks a rule only about nodes the sequence touches: a node whose value and inputs are in no
family and whose inputs are all whole is re-emitted as it is, replicated (``always=True``: the rule emits even
those itself). Ops without a rule fall back: their inputs are
gathered whole and the fallback is recorded in the plan with the reason.

:func:`link_graph` (the ``link`` pass) runs every node's link rule into a :class:`~autoshard.passes.infer.LinkContext`;
the rule files import :mod:`autoshard.passes.infer` for it, never the other way round.
"""

from __future__ import annotations

import torch.fx as fx

from ..infer import LinkContext, token_local_nodes
from ..ops import is_tensor_node, op_of, shape_of, size_key
from . import (attention, conv, embedding, factories, joins, loss, markers, matmul,  # noqa: F401 -- each registers
               norms, recurrence, reductions, selection, views)
from .pointwise import link_broadcast
from .registry import RULES

__all__ = ["RULES", "attention_lengths", "link_graph"]


def link_graph(gm: fx.GraphModule) -> LinkContext:
    """Run every node's link rule (seeds come from the attention rule and from markers). Ops without a rule
    inside token-local regions link like elementwise ops."""
    ctx = LinkContext()
    ctx.token_local = token_local_nodes(gm)
    ctx.attention_lengths = attention_lengths(gm)
    ctx.joined_lengths = _joined_lengths(gm, ctx.attention_lengths)
    for node in gm.graph.nodes:
        op = op_of(node)
        rule = RULES.get(op.name) if op is not None else None
        if rule is not None:
            rule.link(ctx, node, op)
        inputs = [n for n in node.all_input_nodes if is_tensor_node(n)]
        if node in ctx.token_local and is_tensor_node(node) and getattr(op, "name", None) not in ("view", "expand"):
            # per-position code: equal-sized dims are the same positions, even along a sort or a gather
            link_broadcast(ctx, node, inputs, set_factors=rule is None)
        elif node in ctx.token_local and not is_tensor_node(node) and len(inputs) > 1:
            link_broadcast(ctx, inputs[0], inputs[1:], set_factors=False)  # x[i] = y: y is placed like x
        if op is not None and op.name == "tuple_get" and op["input"] in ctx.token_local:
            producer = op["input"]  # an output of a token-local op with several outputs
            link_broadcast(ctx, node, [n for n in producer.all_input_nodes if is_tensor_node(n)],
                           set_factors=RULES.get(getattr(op_of(producer), "name", None)) is None)
    return ctx


def attention_lengths(gm: fx.GraphModule) -> set:
    """The query lengths of the graph's attention calls (``size_key`` of each)."""
    return {size_key(shape_of(op["q"])[2]) for op in map(op_of, gm.graph.nodes)
            if op is not None and op.name == "attention"}


def _joined_lengths(gm: fx.GraphModule, attention_lengths: set) -> set:
    """The lengths of the parts a joint sequence is concatenated from: SD3's ``cat([image, text])`` of an
    attention's length along the tokens, whose image tokens come from a patchify of their own."""
    lengths = set()
    for op in map(op_of, gm.graph.nodes):
        if op is not None and op.name == "cat" and all(is_tensor_node(t) for t in op["tensors"]):
            dim = op["dim"] % len(shape_of(op["tensors"][0]))
            if size_key(sum(shape_of(t)[dim] for t in op["tensors"])) in attention_lengths:
                lengths.update(size_key(shape_of(t)[dim]) for t in op["tensors"])
    return lengths
