"""Handing carriers across graph boundaries: one codec for the compiler and the planner.

A model compiled as several graphs (graph breaks, per-block compilation, FSDP2's per-layer graphs) hands values
from one graph to the next as carriers (:mod:`autoshard.runtime.carrier`): split along the sequence
(:class:`~autoshard.runtime.split_tensor.SplitTensor`), left uncomputed
(:class:`~autoshard.runtime.deferred.DeferredTensor`), or, out of the last graph, logits computed on first read
(:class:`~autoshard.runtime.lazy_linear.LazyLinear`). A graph that takes carriers is compiled and run on what they
hold; what it hands on leaves wrapped again. Both halves are here:

* when a graph is compiled (by the backend, from the carriers dynamo passes as example inputs; by the planner, from
  what it recorded of the earlier graphs' outputs): :func:`inline_inputs` puts every deferred input's recipe in
  the graph, the input replaced by what the recipe reads, and :func:`shard_inputs` names the placement of every
  split input and takes its shard as the example;
* when it runs (:func:`carrying`): :func:`unwrap_inputs` hands the compiled graph what the carriers hold (a
  deferred input's recipe inputs, a split input's shard, differentiably) and :func:`wrap_outputs` wraps what it
  returns (split outputs as ``SplitTensor``, deferred ones as ``DeferredTensor`` of the inputs their recipes read,
  lazy heads as ``LazyLinear``: :func:`lazy_head`).

Positions: a split input's position is among the inputs with every deferred input already replaced by what its
recipe reads; the graph's outputs by their position in its output tuple.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from .passes.deferred import DeferredOutput, inline_deferred
from .passes.lazy import LazyOutput
from .passes.ops import value_of
from .placements import Shard
from .runtime.deferred import DeferredTensor, Recipe, defer
from .runtime.kv_cache import CacheLayout
from .runtime.lazy_linear import lazy_linear
from .runtime.layouts import current_swaps, placing
from .runtime.redistribute import grad_scale, grad_sync, seq_realign
from .runtime.split_tensor import SplitTensor, local_of, wrap

__all__ = ["DeferredInput", "deferred_inputs_of", "traced_deferred_inputs", "split_inputs_of", "inline_inputs",
           "shard_inputs", "unwrap_inputs", "wrap_outputs", "carrying", "lazy_head"]


@dataclass(frozen=True)
class DeferredInput:
    """A graph input an earlier graph left uncomputed, as the graph taking it is compiled."""

    recipe: Recipe
    """How the value is computed."""
    reads: list
    """Example values of what the recipe reads, in its placeholder order."""
    beside: list
    """What stands for each of them in the list kept beside the example inputs (:func:`inline_inputs`)."""


def deferred_inputs_of(inputs: Sequence) -> dict[int, DeferredInput]:
    """The deferred inputs among example inputs (``DeferredTensor``): position -> what the compile needs of it."""
    return {i: DeferredInput(x.recipe, list(x.recipe_inputs), list(x.recipe_inputs))
            for i, x in enumerate(inputs) if isinstance(x, DeferredTensor)}


def traced_deferred_inputs(gm: fx.GraphModule, inputs: list) -> tuple[fx.GraphModule, list]:
    """A graph of symbolic sizes dynamo traced with deferred inputs (``DeferredTensor`` in ``inputs``), with their
    recipes inlined as dynamo traced them (the recipe's inputs of the symbolic sizes dynamo gave the carrier's inner
    tensors), and ``inputs`` flattened to match (:func:`unwrap_inputs` flattens each call's alike): a graph whose
    sizes the length classes can generalize. Unchanged without deferred inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    deferred = {i: DeferredInput(x.recipe, list(value_of(placeholders[i]).recipe_inputs), list(x.recipe_inputs))
                for i, x in enumerate(inputs) if isinstance(x, DeferredTensor)}
    gm, _, flat = inline_inputs(gm, inputs, deferred, inputs)
    return gm, flat


def split_inputs_of(inputs: Sequence, group_name: str) -> dict[int, tuple[Shard, torch.Tensor]]:
    """The inputs among example inputs that arrive split over ``group_name`` (``SplitTensor``): position -> (their
    placement, their shard as the example, needing a gradient as the carrier does: the inner compiler traces it)."""
    return {i: (Shard(x.seq_dim, x.seq_layout), x.local.detach().requires_grad_(x.requires_grad))
            for i, x in enumerate(inputs) if isinstance(x, SplitTensor) and x.group_name == group_name}


def _flatten(values: Sequence, replaced: dict[int, Sequence]) -> list:
    """``values`` with the one at each position of ``replaced`` replaced by the values it lists."""
    out = []
    for i, value in enumerate(values):
        out.extend(replaced[i] if i in replaced else (value,))
    return out


def inline_inputs(gm: fx.GraphModule, inputs: list, deferred: dict[int, DeferredInput],
                  beside: list | None = None) -> tuple[fx.GraphModule, list, list | None]:
    """The graph with the recipe of every input at a position of ``deferred`` inlined
    (:func:`~autoshard.passes.deferred.inline_deferred`), its example ``inputs`` with each such input replaced by
    what its recipe reads, and the list ``beside`` them (global inputs, the inputs' sources) with each replaced by
    its :attr:`DeferredInput.beside`. Unchanged without deferred inputs."""
    if not deferred:
        return gm, inputs, beside
    gm = inline_deferred(gm, {i: d.recipe for i, d in deferred.items()}, {i: d.reads for i, d in deferred.items()})
    return (gm, _flatten(inputs, {i: d.reads for i, d in deferred.items()}),
            _flatten(beside, {i: d.beside for i, d in deferred.items()}) if beside is not None else None)


def shard_inputs(gm: fx.GraphModule, inputs: list,
                 split: dict[int, tuple[Shard, torch.Tensor]]) -> tuple[dict[str, Shard], list]:
    """For the inputs that arrive split (``split``: position -> (placement, example shard)): placeholder name ->
    placement, and the example inputs with those shards in their place."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return ({placeholders[i].name: shard for i, (shard, _) in split.items()},
            [split[i][1] if i in split else x for i, x in enumerate(inputs)])


def unwrap_inputs(args: Sequence, *, flatten: bool, split: Collection[int]) -> tuple[Sequence, list]:
    """At run time: (``args`` with every ``DeferredTensor`` replaced by what its recipe reads when ``flatten``,
    the same with the ``SplitTensor`` at each position of ``split`` replaced by its shard: what the compiled
    graph is called with). The shard's gradient goes back as a ``SplitTensor``."""
    flat = _flatten(args, {i: a.recipe_inputs for i, a in enumerate(args) if isinstance(a, DeferredTensor)}) \
        if flatten else args
    return flat, [local_of(a) if i in split else a for i, a in enumerate(flat)]


def wrap_outputs(out: Sequence, args: Sequence, *, split: dict[int, Shard], deferred: dict[int, DeferredOutput],
                 lazy: dict[int, Callable], group_name: str, caches: Collection[int] = ()) -> Sequence:
    """At run time: the compiled graph's outputs ``out`` as they leave it, from the inputs ``args`` it was called
    with (flattened: :func:`unwrap_inputs`): at each position of ``lazy`` made by its function of the output and
    ``args`` (:func:`lazy_head`), of ``split`` a ``SplitTensor`` over ``group_name`` (at a position of ``caches``,
    the keys or values of a KV cache, without gradient: one carrying a :class:`~autoshard.runtime.kv_cache.
    CacheLayout`), of ``deferred`` (None from the graph) a ``DeferredTensor`` of the inputs its recipe reads."""
    def leaving(i: int, o):
        if i in lazy:
            o = lazy[i](o, args)
        if i in split:
            if i in caches and not o.requires_grad:
                return _split_cache(o, split[i], group_name)
            return wrap(o, split[i].dim, split[i].layout, group_name, current_swaps())
        if i in deferred:
            return defer(deferred[i].recipe, deferred[i].reads(args), deferred[i].shape)
        return o

    return type(out)(leaving(i, o) for i, o in enumerate(out))


def _split_cache(local: torch.Tensor, shard: Shard, group_name: str) -> SplitTensor:
    """A prefill's KV cache keys or values leaving split: the carrier of a cache that grows (its rule is the prompt's
    layout; dynamo's guard on it holds for every prompt, so the first decode step compiles once for all), its shard
    dynamic along the sequence as the decode steps' shards are (:mod:`autoshard.passes.decode`)."""
    torch._dynamo.maybe_mark_dynamic(local, shard.dim)
    shape = list(local.shape)
    shape[shard.dim] = shard.layout.length
    return SplitTensor(local, shard.dim, CacheLayout(shard.layout), group_name, shape)


def carrying(fn: Callable, *, flatten: bool, split_inputs: Collection[int], split_outputs: dict[int, Shard],
             deferred_outputs: dict[int, DeferredOutput], lazy_outputs: dict[int, Callable],
             group_name: str, cache_outputs: Collection[int] = (), any_placement: bool = False) -> Callable:
    """``fn`` (a compiled per-rank graph) called on what its carrier inputs hold (:func:`unwrap_inputs`), its
    outputs wrapped as they leave (:func:`wrap_outputs`). Split inputs an earlier graph computed under a placement
    (:attr:`~autoshard.runtime.split_tensor.SplitTensor.placed`) run the graph under it where it reads any layout
    (``any_placement``: :mod:`~autoshard.runtime.placement`), else arrive realigned to the layout it was compiled
    for."""
    def run(*args):
        flat, local = unwrap_inputs(args, flatten=flatten, split=split_inputs)
        local, swaps = _placed_inputs(flat, local, split_inputs, any_placement, group_name)
        with placing(swaps) if swaps else contextlib.nullcontext():
            return wrap_outputs(fn(*local), flat, split=split_outputs, deferred=deferred_outputs, lazy=lazy_outputs,
                                group_name=group_name, caches=cache_outputs)
    return run


def _placed_inputs(flat: Sequence, local: list, split: Collection[int], any_placement: bool,
                   group_name: str) -> tuple[list, dict]:
    """The shards a graph runs on and the placement it runs under: that of its split inputs where one placement
    computed them (:attr:`~autoshard.runtime.split_tensor.SplitTensor.placed`) and the graph reads any layout
    (``any_placement``), every other split input realigned to it; else none, every placed input realigned to the
    layout it was compiled for."""
    placements = [flat[i].placed for i in split if flat[i].placed]
    swaps = placements[0] if placements and any_placement and all(p is placements[0] for p in placements) else {}
    out = list(local)
    for i in split:
        carrier = flat[i]
        rows, wanted = carrier.rows_layout, swaps.get(carrier.seq_layout, carrier.seq_layout)
        if rows != wanted:
            out[i] = seq_realign(local[i], carrier.seq_dim, rows, wanted, group_name)
    return out, swaps


def lazy_head(h: torch.Tensor, args: Sequence, *, spec: LazyOutput, group_name: str, summed: bool, world: int,
              host: bool) -> torch.Tensor:
    """The lazy logits of the head ``spec`` (:class:`~autoshard.passes.lazy.LazyOutput`) from the graph's output
    ``h`` and its inputs ``args`` (``h`` held in host memory when ``host``: with ``offload``). On split tokens, the
    head's parameters take this rank's share of their gradient the way the graph's own uses do: ``summed`` over the
    group (``grad_sync``), or multiplied by its size."""
    weight, bias = args[spec.weight], args[spec.bias] if spec.bias is not None else None
    if spec.split:
        weight, bias = (p if p is None else grad_sync(p, group_name) if summed else grad_scale(p, world)
                        for p in (weight, bias))
    return lazy_linear(h, weight, bias, dtype=spec.dtype, host=host)
