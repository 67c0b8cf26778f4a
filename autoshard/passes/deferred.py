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

In a graph compiled for a length class (symbolic lengths, :mod:`.specialize`) a recipe's sizes are expressions of
the lengths: they become nodes computing them from what the recipe reads -- its inputs' shapes, and an *anchor*
(an empty ``(0, *lengths)`` tensor, :attr:`DeferredOutput.anchor`) for a length no input holds (``arange(S)``) --
so its code is the same at every length, and the graphs taking it see one recipe (dynamo guards it) of inputs
whose sizes vary: they compile once per class too.

An output is deferred when (every condition is a reason the recomputation could differ, or cost more):

* it needs no gradient, and neither does anything it is computed from (a recipe has no autograd history);
* every op computing it is deterministic (:func:`~autoshard.passes.graph.has_side_effects`: no in-place write,
  no random draw) and none is one that autocast runs in a lower precision (matmuls, linear, convolutions,
  attention: the layer graph may run under another autocast state than the graph that built the value);
* it reads only whole inputs of the graph (not a value split along the sequence), no module attribute;
* it is at least :data:`DEFER_RATIO` times the elements of everything it reads (a mask, cos and sin; not
  FlexAttention's block mask, whose graph computes it once from a vmap of ``mask_mod`` -- fused away by
  inductor -- and which the layer graphs do not read: they read ``mask_mod``).

A deferred value never reaches a higher-order op while dynamo traces (FlexAttention's op does not dispatch a
tensor subclass next to fake tensors): values that do -- the block mask -- are not deferred by the conditions
above, and ``mask_mod``'s own inputs (positions, segment ids) are as small as what they are made from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import is_fake

from ..runtime.deferred import Recipe
from ..runtime.symbolic import evaluate, hint_of, is_symbolic
from .graph import eliminate_dead_code, fake_mode_of, has_side_effects, new_node, reachable, unused_impure
from .ops import canonical, is_tensor_node, numel, shape_of, value_of
from .specialize import hinted, materialize_sizes, symints_in

__all__ = ["DeferredOutput", "defer_outputs", "inline_deferred", "DEFER_RATIO"]

DEFER_RATIO = 8
"""An output is deferred only when it has at least this many times the elements of the inputs its recipe reads
(a mask: ``S`` times; RoPE's cos: the head dim)."""

_LOWER_PRECISION = {"linear", "matmul", "addmm", "einsum", "conv", "attention", "outer", "linear_cross_entropy"}
"""Canonical ops that autocast runs in a lower precision: a recipe with one could compute differently where it is
inlined."""
_LOWER_PRECISION_NAMES = ("mm", "matmul", "linear", "conv", "einsum", "attention")
"""The same, in the names of ops outside the canonical vocabulary (``aten.bmm``)."""
@dataclass(frozen=True)
class DeferredOutput:
    """An output the graph leaves uncomputed."""

    recipe: Recipe
    """How it is computed."""
    inputs: tuple[int, ...]
    """The graph inputs (placeholder positions) the recipe reads, in the recipe's placeholder order."""
    shape: tuple
    """The value's shape: ints, or ``SymInt`` expressions of the lengths in a graph compiled for a length class
    (:meth:`evaluated` at a call's lengths)."""
    anchor: tuple | None = None
    """Where the recipe also reads an *anchor*, its last input: an empty ``(0, *anchor)`` tensor whose sizes are
    the lengths no input's shape holds (RoPE's ``arange(S)`` reads no tensor: a recipe of a length class reads
    ``S`` from its anchor's dim 1, so its code serves every length). ``()`` for a recipe that reads nothing; None
    without an anchor."""

    def reads(self, args) -> list[torch.Tensor]:
        """What the recipe reads in a call of the graph with ``args``: those inputs, then the anchor."""
        anchor = [] if self.anchor is None else [torch.empty((0, *self.anchor), device=self.recipe.device)]
        return [args[j] for j in self.inputs] + anchor

    def evaluated(self, values: dict) -> DeferredOutput:
        """This output at a call's lengths (``values``: symbol -> int)."""
        return replace(self, shape=tuple(evaluate(s, values) for s in self.shape),
                       anchor=None if self.anchor is None else tuple(evaluate(s, values) for s in self.anchor))


def _name(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))


def _deterministic(node: fx.Node) -> bool:
    """Whether ``node`` computes the same value wherever and whenever it runs: no side effect, no random draw, and
    no precision autocast would change (see the module docstring)."""
    if node.op not in ("call_function", "call_method") or has_side_effects(node):
        return False
    if "functorch" in str(getattr(node.target, "__module__", "")):  # a vmap's batch dims: they need its levels
        return False
    op = canonical(node)
    if op is not None:
        return op.name not in _LOWER_PRECISION
    return not any(name in _name(node) for name in _LOWER_PRECISION_NAMES)


def _recipe_nodes(output: fx.Node, excluded: set[str]) -> list[fx.Node] | None:
    """The nodes computing ``output`` back to the graph's inputs, in graph order; None when it is not deferrable
    (see the module docstring)."""
    nodes = []
    for node in reachable(output, lambda n: n.all_input_nodes):
        value = value_of(node)
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return None
        if node.op == "placeholder":
            if node.name in excluded or not is_tensor_node(node):
                return None
        elif not _deterministic(node):
            return None
        nodes.append(node)
    position = {n: i for i, n in enumerate(output.graph.nodes)}
    return sorted(nodes, key=position.__getitem__)


def _worth_deferring(nodes: list[fx.Node], output: fx.Node) -> bool:
    """Whether the value is large next to what it is made from (:data:`DEFER_RATIO`)."""
    read = sum(numel(shape_of(n)) for n in nodes if n.op == "placeholder")
    return numel(shape_of(output)) >= DEFER_RATIO * max(read, 1)


def _recipe_of(nodes: list[fx.Node], output: fx.Node, placeholders: list[fx.Node]) -> DeferredOutput:
    """The recipe computing ``output`` from ``nodes`` (:func:`_recipe_nodes`). In a graph of symbolic lengths its
    sizes are computed from what it reads (:func:`~.specialize.materialize_sizes`): the shapes of its inputs, and
    an anchor for the lengths none of them holds (:attr:`DeferredOutput.anchor`)."""
    inputs = [n for n in nodes if n.op == "placeholder"]
    value = value_of(output)
    lengths = _lengths_read(nodes, value, inputs)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta["val"] = value_of(node)
    anchor = None
    if lengths or not inputs:  # the carrier needs an inner tensor, and the lengths a shape that holds them
        anchor = tuple(lengths)
        graph.placeholder("anchor").meta["val"] = value.new_empty((0, *anchor))
    for node in nodes:
        if node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[output])
    module = fx.GraphModule(torch.nn.Module(), graph)
    materialize_sizes(module)
    for node in graph.nodes:  # the recipe keeps no example value (the graph inlining it computes its own)
        trace = node.meta.get("stack_trace")
        node.meta = {"stack_trace": trace} if trace else {}
    recipe = Recipe(module, tuple(hint_of(s) for s in value.shape), value.dtype, value.device)
    return DeferredOutput(recipe, tuple(placeholders.index(n) for n in inputs), shape_of(output), anchor)


def _lengths_read(nodes: list[fx.Node], value: torch.Tensor, inputs: list[fx.Node]) -> list[torch.SymInt]:
    """The symbolic lengths a recipe's nodes and value use that no input's shape holds as a dim of its own (a
    length class's RoPE: ``arange(S)``), each once, in the order first used."""
    held = {s.node.expr for n in inputs for s in value_of(n).shape if is_symbolic(s) and s.node.expr.is_Symbol}
    found: dict = {}
    for size in symints_in([(n.args, n.kwargs) for n in nodes] + [tuple(value.shape)]):
        for symbol in sorted(size.node.expr.free_symbols - held, key=str) if is_symbolic(size) else ():
            found.setdefault(symbol, hinted(size.node.shape_env, symbol))
    return list(found.values())


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
        if nodes is not None and _worth_deferring(nodes, node):
            deferred[position] = _recipe_of(nodes, node, placeholders)
    if deferred:
        output.args = (type(results)(None if i in deferred else n for i, n in enumerate(results)),)
        eliminate_dead_code(gm.graph, keep)
        gm.recompile()
    return deferred


def inline_deferred(gm: fx.GraphModule, deferred: dict[int, Recipe], inputs: dict[int, list]) -> fx.GraphModule:
    """A copy of ``gm`` (dynamo keeps reading its own graph's placeholders) with the recipe of every deferred input
    put back: placeholder ``i`` (by position) becomes the recipe's inputs, whose example values ``inputs[i]``
    gives (real or fake tensors), and the recipe's nodes, with example values computed under the graph's fake
    mode (see the module docstring); a size the recipe computes from its inputs' shapes is a constant where they
    are static."""
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
                env[node].meta["example_value"] = _in_mode(mode, next(examples))
            elif node.op == "output":
                old.replace_all_uses_with(env[node.args[0]])
            else:
                with graph.inserting_before(body_at):
                    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                    made = new_node(graph, node.target, args, kwargs, op=node.op)
                if type(made.meta["example_value"]) is int:  # a length class's recipe reads a size: in a graph of
                    graph.erase_node(made)  # static sizes it is the constant, as dynamo writes sizes there
                    env[node] = made.meta["example_value"]
                    continue
                env[node] = made
                if node.meta.get("stack_trace"):
                    made.meta["stack_trace"] = node.meta["stack_trace"]
        graph.erase_node(old)
    gm.recompile()
    return gm


def _in_mode(mode, x: torch.Tensor) -> torch.Tensor:
    """``x`` as an example value of a graph whose fake mode is ``mode`` (a real tensor, or a fake one of another
    graph's mode: a plan's producer graph)."""
    if mode is None or (is_fake(x) and x.fake_mode is mode):
        return x
    if is_fake(x):
        with mode:
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    return mode.from_tensor(x)
