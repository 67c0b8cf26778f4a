"""Capturing a model's graphs for a plan, and handing values from one graph to the next as the run does.

:func:`capture` runs the model under ``torch.compile`` with a backend that only records: one entry per *call* of
a graph (a graph dynamo runs again -- FSDP2's one graph for every layer of a kind -- is one entry per run), with
the earlier call's output each input is (a graph break hands the same tensor object on).
``per_layer_graphs`` cuts the model where FSDP2's hooks cut it (:func:`_cut_layers`).

A model built on the meta device plans as it runs, called as its users call it (transformers' models with their
defaults: a ``DynamicCache`` built and returned): its meta tensors are captured as fake CPU tensors
(:func:`meta_as_fake` says why), so its graphs are the graphs of a run. What only values say is not guessed: a
mask computed from a meta buffer (nanoGPT's ``bias``) is planned ``unknown`` -- as a dense mask, never as causal
-- and its reason names the buffer; plan the model on the CPU to read it.

Between graphs the plan does what the run does: a value an earlier graph leaves split (``outputs="split"``) is
taken split, at the rank's local shape (:func:`carried`); a value an earlier graph leaves uncomputed (a deferred
mask, :mod:`autoshard.runtime.deferred`) has its recipe inlined into the graph that takes it
(:func:`inline_deferred_inputs`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from ..config import dynamo_settings
from ..recognized import recognize_loaded
from ..boundary import DeferredInput, inline_inputs, shard_inputs
from ..passes.graph import keep_real_values

__all__ = ["meta_as_fake", "capture", "carried", "inline_deferred_inputs"]


@contextlib.contextmanager
def meta_as_fake(model: torch.nn.Module, args: tuple, kwargs: dict):
    """Stand-ins for the meta tensors of a capture. Yields (the context the graphs run in, args, kwargs): inside,
    the model's meta parameters, buffers and tensor attributes are fake tensors on the CPU (parameters still
    parameters, a tensor two modules share still one tensor), so are the meta inputs, and the graphs run under
    their fake mode; the originals are back in place on exit. Without meta tensors nothing changes (the
    context does nothing: a model on the CPU computes, as it did).

    Why not capture on meta: a constant the model makes from data on its inputs' device
    (``torch.tensor([], device=x.device)``, transformers' ``DynamicCache`` before its first ``cat``; Falcon's
    ``fused_qkv[..., [-2], :]``) is a *real* meta tensor even under dynamo's fake mode (``torch.tensor`` does
    not lift meta data), and the next op that meets it with a fake tensor fails. On a fake CPU the constant is
    fake, as it is when the model runs on a device; the graphs are the run's, and nothing is computed or
    allocated. Values stay unknown, as on meta (a mask made from a fake buffer stays dense, and says why)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}

    def fake(t):
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return t
        if id(t) not in fakes:
            stand_in = mode.fake_tensor_converter.from_meta_and_device(mode, t, torch.device("cpu"))
            fakes[id(t)] = (torch.nn.Parameter(stand_in, requires_grad=t.requires_grad)
                            if isinstance(t, torch.nn.Parameter) else stand_in)
        return fakes[id(t)]

    swapped = []
    for module in model.modules():
        for state in (module._parameters, module._buffers, vars(module)):  # the last: plain tensor attributes
            for name, value in state.items():
                if fake(value) is not value:
                    swapped.append((state, name, value))
                    state[name] = fake(value)
    args, kwargs = tree_map(fake, args), tree_map(fake, kwargs)
    try:
        yield mode if fakes else contextlib.nullcontext(), args, kwargs
    finally:
        for state, name, value in swapped:
            state[name] = value


def capture(model, args: tuple, kwargs: dict, *, per_layer_graphs: bool = False) -> list[tuple]:
    """Dynamo's graphs of ``model(*args, **kwargs)``, one entry per *call* of a graph -- (graph, the call's inputs,
    per input the (call, output position) that produced it, or None): a value one call returns and a later one
    takes (a graph break) is the same tensor object; a graph dynamo runs again (FSDP2's one graph for every layer
    of a kind) is one entry per run, the same graph module. Meta tensors are captured as fake CPU tensors
    (:func:`meta_as_fake`): nothing is computed. ``per_layer_graphs``: a graph break before and after every
    block of the model's layer lists, where FSDP2's hooks cut it (``fully_shard`` on every layer)."""
    calls = []
    produced: dict[int, tuple[int, int]] = {}
    alive: list = []  # the outputs seen, so that their ids stay theirs during the capture

    with meta_as_fake(model, args, kwargs) as (running, args, kwargs), _cut_layers(model, per_layer_graphs):
        def grab(gm, example_inputs):
            keep_real_values(gm, example_inputs)  # dynamo drops them when this returns; masks may read buffers

            def run(*inputs):
                index = len(calls)
                calls.append((gm, list(inputs), [produced.get(id(x)) for x in inputs]))
                with running:  # on fake inputs, the tensors the graph makes are fake too
                    out = gm.forward(*inputs)
                for position, value in enumerate(out):
                    if isinstance(value, torch.Tensor):
                        produced[id(value)] = (index, position)
                        alive.append(value)
                return out
            return run

        # every plan compiles the model anew (its own capturing backend): dynamo's per-frame recompile limit would
        # otherwise make the ninth plan of one model run it eagerly, capturing nothing
        recognize_loaded()  # the functions dynamo records as one op, as a backend made now would (see recognized.py)
        with torch._dynamo.config.patch(recompile_limit=1 << 30, accumulated_recompile_limit=1 << 30), dynamo_settings():
            torch.compile(model, backend=grab, dynamic=False)(*args, **kwargs)
    if not calls:
        raise RuntimeError("autoshard.plan: dynamo captured no graph of the model (it ran eagerly); nothing to plan")
    return calls


@contextlib.contextmanager
def _cut_layers(model: torch.nn.Module, cut: bool):
    """With ``cut``, a graph break before and after every element of the model's outermost layer lists while the
    block runs (what FSDP2's hooks do to a model whose every layer is ``fully_shard``-ed)."""
    handles = []
    if cut:
        nested = {id(m) for outer in model.modules() if isinstance(outer, torch.nn.ModuleList)
                  for m in outer.modules() if m is not outer}
        for layers in (m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and id(m) not in nested):
            for layer in layers:
                handles.append(layer.register_forward_pre_hook(lambda *_: torch._dynamo.graph_break()))
                handles.append(layer.register_forward_hook(lambda *_: torch._dynamo.graph_break()))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def carried(gm: fx.GraphModule, sources: list, carried_outputs: dict, example_inputs: list,
            rank: int) -> tuple[dict, list]:
    """What a graph takes split from earlier graphs (``outputs="split"``): (placeholder name -> Shard, the example
    inputs with those at this rank's local shape), through the run's codec (:func:`~autoshard.boundary.shard_inputs`)."""
    shards = {i: carried_outputs[src] for i, src in enumerate(sources) if src is not None and src in carried_outputs}
    return shard_inputs(gm, example_inputs, {i: (shard, example_inputs[i].new_empty(
        shard.local_shape(tuple(example_inputs[i].shape), rank))) for i, shard in shards.items()})


def inline_deferred_inputs(gm: fx.GraphModule, example_inputs: list, sources: list, deferred: dict) -> tuple:
    """What the run does with the values earlier graphs leave uncomputed (``deferred``: (graph, output position) ->
    (DeferredOutput, that graph's inputs, their sources)): the graph with their recipes inlined, its inputs and
    their sources with each such input replaced by the inputs its recipe reads
    (:func:`~autoshard.boundary.inline_inputs`, as the run does)."""
    taken = {i: deferred[src] for i, src in enumerate(sources) if src in deferred}
    return inline_inputs(gm, example_inputs, {
        i: DeferredInput(out.recipe, out.reads(inputs),
                         [origins[j] for j in out.inputs] + [None] * (out.anchor is not None))
        for i, (out, inputs, origins) in taken.items()}, sources)
