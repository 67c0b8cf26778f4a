"""Deferred values across graph boundaries: what a graph leaves uncomputed, and where it is computed instead.

Two halves of one mechanism (the carrier is :class:`~autoshard.runtime.deferred.DeferredTensor`; its module
docstring says why a recipe and not a classified mask):

* :func:`defer_outputs` (the ``defer`` pass) finds the outputs of a graph that are large, cheap values of small
  inputs -- an ``[B, 1, S, S]`` mask built from ``position_ids``, RoPE's ``[B, S, D]`` cos and sin -- and cuts
  them out: the graph returns None in their place and :class:`DeferredOutput` says how the backend makes the
  :class:`~autoshard.runtime.deferred.DeferredTensor` (which recipe, which of the graph's inputs it reads);
* :func:`inline_deferred` puts a deferred input's recipe back into the graph that takes it: the placeholder
  becomes the recipe's inputs (the backend passes the carrier's inner tensors in its place) and the recipe's
  nodes, so the passes after it read the mask's structure as in a whole-model compile.

An output is deferred when (every condition is a reason the recomputation could differ, or cost more):

* it needs no gradient, and neither does anything it is computed from (a recipe has no autograd history);
* every op computing it is pure and deterministic (:func:`~autoshard.passes.graph.is_pure`: no in-place write,
  no random draw, no op outside the canonical vocabulary such as ``torch.vmap``'s nesting levels) and none is
  one that autocast runs in a lower precision (matmuls, linear, convolutions, attention: the layer graph may run
  under another autocast state than the graph that built the value);
* it reads only whole inputs of the graph (not a value split along the sequence), no module attribute;
* its recipe's largest value is at least :data:`DEFER_RATIO` times the elements of everything it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake

from ..runtime.deferred import Recipe
from .graph import eliminate_dead_code, fake_mode_of, is_pure, new_node, unused_impure
from .ops import canonical, is_tensor_node, numel, shape_of, value_of

__all__ = ["DeferredOutput", "defer_outputs", "inline_deferred", "DEFER_RATIO"]

DEFER_RATIO = 8
"""An output is deferred only when its recipe's largest value has at least this many times the elements of the
inputs it reads (a mask: ``S`` times; RoPE's cos: the head dim)."""

_LOWER_PRECISION = {"linear", "matmul", "addmm", "einsum", "conv", "attention", "outer", "linear_cross_entropy"}
"""Canonical ops that autocast runs in a lower precision: a recipe with one could compute differently where it is
inlined."""


@dataclass(frozen=True)
class DeferredOutput:
    """An output the graph leaves uncomputed."""

    recipe: Recipe
    """How it is computed."""
    inputs: tuple[int, ...]
    """The graph inputs (placeholder positions) the recipe reads, in the recipe's placeholder order."""


def _recipe_nodes(output: fx.Node, excluded: set[str]) -> list[fx.Node] | None:
    """The nodes computing ``output`` back to the graph's inputs, in graph order, or None when it is not
    deferrable (see the module docstring)."""
    seen, stack = set(), [output]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        value = value_of(node)
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return None
        if node.op == "placeholder":
            if node.name in excluded or not is_tensor_node(node):
                return None
            continue
        if node.op not in ("call_function", "call_method") or not is_pure(node):
            return None
        op = canonical(node)
        if op is None or op.name in _LOWER_PRECISION:
            return None
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(output.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _recipe_of(nodes: list[fx.Node], output: fx.Node, placeholders: list[fx.Node]) -> DeferredOutput | None:
    """The recipe computing ``output`` from ``nodes`` (its inputs first), or None when it is not worth deferring."""
    inputs = [n for n in nodes if n.op == "placeholder"]
    read = sum(numel(shape_of(n)) for n in inputs)
    largest = max(numel(shape_of(n)) for n in nodes if is_tensor_node(n))
    if largest < DEFER_RATIO * max(read, 1):
        return None
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
            env[node].meta = {"stack_trace": node.meta.get("stack_trace")} if node.meta.get("stack_trace") else {}
    if not inputs:
        graph.placeholder("anchor")  # the carrier needs an inner tensor: an empty one stands in
    graph.output(env[output])
    value = value_of(output)
    recipe = Recipe(fx.GraphModule(torch.nn.Module(), graph), value.shape, value.dtype, value.device)
    return DeferredOutput(recipe, tuple(placeholders.index(n) for n in inputs))


def defer_outputs(gm: fx.GraphModule, excluded: set[str]) -> dict[int, DeferredOutput]:
    """Cut the deferrable outputs out of ``gm`` (see the module docstring): each becomes None in the output
    tuple; returns them by output position. ``excluded``: placeholders a recipe may not read (inputs that
    arrive split)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    results = output.args[0]
    if not isinstance(results, (tuple, list)):
        return {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    keep = unused_impure(gm.graph)
    deferred: dict[int, DeferredOutput] = {}
    for position, node in enumerate(results):
        if not is_tensor_node(node) or node.op == "placeholder" or len(shape_of(node)) < 2:
            continue
        nodes = _recipe_nodes(node, excluded)
        found = _recipe_of(nodes, node, placeholders) if nodes is not None else None
        if found is not None:
            deferred[position] = found
    if deferred:
        output.args = (type(results)(None if i in deferred else n for i, n in enumerate(results)),)
        eliminate_dead_code(gm.graph, keep)
        gm.recompile()
    return deferred


def inline_deferred(gm: fx.GraphModule, deferred: dict[int, Recipe], inputs: dict[int, list]) -> fx.GraphModule:
    """A copy of ``gm`` (dynamo keeps reading its own graph's placeholders) with the recipe of every deferred input
    put back: placeholder ``i`` (by position) becomes the recipe's inputs, whose example values ``inputs[i]``
    gives (real or fake tensors), and the recipe's nodes, with example values computed under the graph's fake
    mode (see the module docstring)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copied = fx.GraphModule(gm, graph)
    copied.meta.update(gm.meta)
    gm = copied
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    mode = fake_mode_of(graph)
    body_at = next(n for n in graph.nodes if n.op != "placeholder")
    for i, recipe in deferred.items():
        old = placeholders[i]
        env: dict[fx.Node, fx.Node] = {}
        examples = iter(inputs[i])
        for node in recipe.graph_module.graph.nodes:
            if node.op == "placeholder":
                with graph.inserting_before(old):
                    env[node] = graph.placeholder(f"{old.name}_{node.name}")
                example = next(examples)
                env[node].meta["example_value"] = (mode.from_tensor(example) if mode is not None
                                                   and not is_fake(example) else example)
            elif node.op == "output":
                old.replace_all_uses_with(env[node.args[0]])
            else:
                with graph.inserting_before(body_at):
                    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                    env[node] = new_node(graph, node.target, args, kwargs, op=node.op)
                if node.meta.get("stack_trace"):
                    env[node].meta["stack_trace"] = node.meta["stack_trace"]
        graph.erase_node(old)
    gm.recompile()
    return gm
