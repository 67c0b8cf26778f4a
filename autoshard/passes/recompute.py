"""Recomputation the compiler adds: every transformer layer becomes a checkpointed region (``recompute="layers"``).

At long context the values autograd saves for backward are most of a rank's memory: a Llama-8B layer keeps
about 25 ``[tokens, hidden]`` values of its own (norms, projections, the SwiGLU's three ``[tokens,
intermediate]`` values), so 32 layers at 16k tokens per rank hold ~100 GiB. Checkpointing a layer keeps only
its inputs and reruns it in backward, one layer at a time -- what torchtitan and ALST do by wrapping each
block by hand. Here it is one option, and the layers are found from the graph.

A *layer* is the nodes whose module stack (dynamo's ``node.meta["nn_module_stack"]``) passes through one entry
of a module list: the outermost module whose path ends in an index (``model.layers.3``, ``h.0``,
``blocks[2]``). Its nodes are tagged as a new region (:mod:`.regions`' ``meta[REGION]``), exactly as if the
model had checkpointed the layer itself: the rewriter tags what it emits for them, ``fill_regions`` takes in
what capture and decompose inserted between them, and ``outline`` cuts each one out into a
``tag_activation_checkpoint`` call after the rewrite, collectives included (the compile report books them a
second time, phase backward). The pass runs after every pass that changes the graph before inference.

A graph that *is* one layer -- a block compiled by itself: FSDP2's hooks cut a model into one graph per layer,
and ``layer.compile()`` does so by hand -- has no module list inside it (its module paths start at the traced
module, ``L['self'].self_attn``...). Such a graph, when it holds an attention, is one layer: its whole body
becomes the region (its inputs are what the checkpoint keeps, as a layer's would be).

A layer is left as it is (and counted) when:

* the model already checkpoints some of it (``already``): its own checkpoint stays;
* it draws random numbers (``random``: dropout with p > 0 in training, ``rand``...): the checkpoint runs with
  ``preserve_rng_state=False`` (it is traced), so a recomputed draw would differ from the forward's and the
  gradient would be wrong;
* its nodes are not one contiguous run of the graph (``interleaved``): a region is cut out whole.
"""

from __future__ import annotations

import re

import torch.fx as fx

from .capture import captured_attention
from .ops import op_of
from .regions import REGION, Region

__all__ = ["recompute_layers", "layer_of"]

_INDEXED = re.compile(r"(\.\d+|\w\[\d+\])$")
"""A module path that ends in a module-list index."""

_RANDOM_FACTORIES = ("rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli",
                     "multinomial", "normal")


def layer_of(node: fx.Node) -> str | None:
    """The path of the layer ``node`` belongs to (the outermost indexed module of its module stack), or None."""
    stack = node.meta.get("nn_module_stack")
    for path, _ in (stack or {}).values():
        if _INDEXED.search(path):
            return path
    return None


def _is_one_layer(order: list[fx.Node]) -> bool:
    """Whether the graph of ``order``, which holds no module list, is a layer's own forward (see the module
    docstring): it holds an attention."""
    return any(n.target is captured_attention for n in order)


def _draws_random(node: fx.Node) -> bool:
    op = op_of(node)
    if op is not None and op.name == "dropout":
        return bool(op["training"]) and op["p"] != 0
    name = getattr(node.target, "__name__", str(node.target))
    return name.removesuffix("_") in _RANDOM_FACTORIES


def recompute_layers(gm: fx.GraphModule, regions: list[Region], mode: str) -> dict[str, int]:
    """Tag every layer of ``gm`` as a new checkpointed region appended to ``regions`` (``mode="layers"``);
    counts the layers recomputed and those left (see the module docstring)."""
    counts = {"recomputed_layers": 0, "already": 0, "random": 0, "interleaved": 0}
    if mode == "none":
        return counts
    layers: dict[str, list[fx.Node]] = {}
    order: list[fx.Node] = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    for node in order:
        path = layer_of(node)
        if path is not None:
            layers.setdefault(path, []).append(node)
    if not layers and _is_one_layer(order):
        layers["L['self']"] = order
    position = {n: i for i, n in enumerate(order)}
    for path, nodes in layers.items():
        first, last = position[nodes[0]], position[nodes[-1]]
        span = order[first:last + 1]
        if any(REGION in n.meta for n in span):
            counts["already"] += 1
        elif any(_draws_random(n) for n in span):
            counts["random"] += 1
        elif any(layer_of(n) not in (None, path) for n in span):
            counts["interleaved"] += 1
        else:
            region = Region(len(regions), {}, {})
            regions.append(region)
            for n in span:
                n.meta[REGION] = region.index
            counts["recomputed_layers"] += 1
    return counts
