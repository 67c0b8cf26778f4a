"""The compile pipeline: the passes one graph goes through, in one ordered list, each with a name.

=================  ==================================================================================
``inline``         checkpointed and wrapped subgraphs are copied into the graph (:mod:`.regions`)
``canonical``      record every node's canonical op (:mod:`.normalize`, :mod:`.ops`)
``functionalize``  in-place writes into fresh tensors become out-of-place ops (:mod:`.functionalize`)
``capture``        attention calls become ``captured_attention`` with a structured mask (:mod:`.capture`)
``defer``          masks and other cheap large outputs are handed on uncomputed (:mod:`.deferred`)
``decompose``      composites (``diff``) become ops that have rules (:mod:`.normalize`)
``chunking``       the LM head and its cross-entropy become one chunked op (:mod:`.chunking`)
``lazy``           a returned LM head's logits are computed when first read; a returned KV cache is found
                   (:mod:`.lazy`)
``recompute``      with ``recompute="layers"``, every layer becomes a checkpointed region (:mod:`.recompute`)
``link``           every node's rule links its dims to its inputs' dims; annotations seed (:mod:`.rules`)
``families``       linked dims joined into sequence families (:mod:`.infer`)
``strategy``       an attention algorithm per attention, a layout per family (:mod:`autoshard.strategy`)
``rewrite``        the local graph of this rank (:mod:`.rewrite`)
``tile``           token-local regions (``tile_tokens``) and MLP blocks (``chunk_mlp``) run in checkpointed tiles
                   of this rank's tokens (:mod:`.tile`)
``outline``        checkpointed regions are cut out of the local graph again, still checkpointed (:mod:`.regions`)
=================  ==================================================================================

Each pass reads and writes one :class:`PipelineState` and returns what it counted (attentions captured,
masks left dense, patterns missed, families, fallbacks...). :func:`run_pipeline` times every pass and
keeps its counts in ``state.stats`` (the compile report carries them). With ``dump_dir`` set (the
backend takes it from the environment variable ``AUTOSHARD_DUMP``), every pass writes what it produced
-- the graph's code after a graph pass, the families, the decisions -- to a numbered file, so a
surprising result can be traced to the pass that made it.

:func:`compile_graph` runs the pipeline on one dynamo graph for one rank of its
:class:`~autoshard.runtime.groups.SequenceGroups`; the backend (:mod:`autoshard.compiler`) and the dry run
(:mod:`autoshard.planner`) both call it; the backend imports the planner (dry runs, the memory policy), never
the other way round.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx

from ..config import BackendConfig
from ..runtime.groups import SequenceGroups
from ..runtime.warn import warn
from ..strategy import choose
from .capture import capture_attention
from .tile import tile
from .chunking import chunk_losses
from .deferred import DeferredOutput, defer_outputs
from .functionalize import functionalize
from .infer import Families, LinkContext, find_families
from .lazy import LazyOutput, kv_cache_outputs, lazy_outputs
from .normalize import canonicalize, decompose
from .ops import op_of, value_of
from .regions import Region, fill_regions, inline_regions, outline_regions
from .recompute import recompute_layers
from .report import CompileReport
from .rewrite import Rewriter, is_parameter
from .rules import link_graph

__all__ = ["PipelineState", "PassStats", "PASSES", "run_pipeline", "CompiledGraph", "compile_graph"]

_DUMPS = itertools.count()
"""Numbers this process's dumped compiles (``AUTOSHARD_DUMP``), one folder each."""


@dataclass
class PassStats:
    """What one pass took and counted."""

    seconds: float
    """Wall time of the pass."""
    counts: dict[str, int]
    """What the pass counted (its own keys: ``attention``, ``dense_masks``, ``families``, ...)."""


@dataclass(kw_only=True)
class PipelineState:
    """The graph and what the passes learn about it, filled in pass order."""

    gm: fx.GraphModule
    """The graph; graph passes change it in place, ``rewrite`` replaces it by this rank's graph."""
    config: BackendConfig
    """The backend's options."""
    groups: SequenceGroups
    """This rank and the groups it communicates over; ``strategy`` gives a plan that chose the hybrid without a
    mesh the plan groups of the mesh it names."""
    sharded_inputs: dict[str, Any] | None = None
    """Placeholder name -> the Shard placement its input arrives in (``inputs="sharded"``)."""
    seeds: list[tuple[fx.Node, int]] = field(default_factory=list)
    """(placeholder, sequence dim) of inputs the user named in ``seq_dims``, and of SplitTensor inputs."""
    carried_layouts: dict[str, str] = field(default_factory=dict)
    """Placeholder name -> layout kind of the inputs that arrive as SplitTensor (their family keeps it)."""
    topology: Any = None
    """Cluster description for the cost model; None = the default."""
    planning: bool = False
    """A dry run: the hybrid may be chosen without a 2-D mesh (the plan names the mesh to build)."""
    dump_dir: str | None = None
    """Where every pass writes what it produced, or None."""

    regions: list[Region] = field(default_factory=list)
    """inline: the checkpointed regions of the original graph."""
    missed: list = field(default_factory=list)
    """capture: attention-like patterns that were not captured (:class:`~.report.Fallback`: they run whole)."""
    deferred_outputs: dict[int, DeferredOutput] = field(default_factory=dict)
    """defer: output position -> how the value the graph no longer computes is computed where it is used."""
    lazy_outputs: dict[int, LazyOutput] = field(default_factory=dict)
    """lazy: output position -> the head the backend makes lazy logits of (the graph returns its input)."""
    cache_outputs: list[int] = field(default_factory=list)
    """lazy: the output positions that return an attention's keys or values (a returned KV cache)."""
    links: LinkContext | None = None
    """link: the dims every rule linked."""
    families: Families | None = None
    """families: the sequence families."""
    layouts: dict = field(default_factory=dict)
    """strategy: family index -> root layout."""
    strategies: dict = field(default_factory=dict)
    """strategy: attention node -> algorithm."""
    reasons: dict = field(default_factory=dict)
    """strategy: attention node -> why."""
    rewriter: Rewriter | None = None
    """rewrite: the rewriter (its report, its gathered outputs)."""
    stats: dict[str, PassStats] = field(default_factory=dict)
    """Pass name -> what it took and counted, in pass order."""


def _inline(state: PipelineState) -> dict[str, int]:
    before = len(state.gm.graph.nodes)
    state.regions = inline_regions(state.gm)
    return {"checkpointed": len(state.regions), "nodes_added": len(state.gm.graph.nodes) - before}


def _canonical(state: PipelineState) -> dict[str, int]:
    canonicalize(state.gm)
    return {"nodes": len(state.gm.graph.nodes)}


def _functionalize(state: PipelineState) -> dict[str, int]:
    return functionalize(state.gm)


def _capture(state: PipelineState) -> dict[str, int]:
    captured = capture_attention(state.gm, state.missed)
    canonicalize(state.gm)  # rewired nodes: their canonical ops must name the new inputs
    layers = sum(getattr(op_of(n), "name", None) in ("linear", "matmul", "addmm") for n in state.gm.graph.nodes)
    return {"attention": len(captured), "dense_masks": sum(reason is not None for _, reason in captured),
            "missed": len(state.missed), "layers": layers}


def _defer(state: PipelineState) -> dict[str, int]:
    state.deferred_outputs = defer_outputs(state.gm, excluded=set(state.sharded_inputs or {}))
    return {"deferred": len(state.deferred_outputs)}


def _decompose(state: PipelineState) -> dict[str, int]:
    before = len(state.gm.graph.nodes)
    decompose(state.gm)
    return {"nodes_added": len(state.gm.graph.nodes) - before}


def _chunking(state: PipelineState) -> dict[str, int]:
    return chunk_losses(state.gm, state.config.chunk_loss)


def _recompute(state: PipelineState) -> dict[str, int]:
    return recompute_layers(state.gm, state.regions, state.config.recompute)


def _link(state: PipelineState) -> dict[str, int]:
    state.links = link_graph(state.gm)
    for node, dim in state.seeds:
        state.links.seed((node, dim, 0))
    return {"seeds": len(state.seeds)}


def _families(state: PipelineState) -> dict[str, int]:
    state.families = find_families(state.links)
    return {"families": len(state.families.families), "refused_links": len(state.families.refused)}


def _strategy(state: PipelineState) -> dict[str, int]:
    carried = {}
    for node in state.gm.graph.nodes:
        if node.name in state.carried_layouts:
            for _, _, family, _ in state.families.dims_of(node):
                carried[family.index] = state.carried_layouts[node.name]
    groups = state.groups
    state.layouts, state.strategies, state.reasons, heads_axis_size = choose(
        state.families, config=state.config, world=groups.world, heads_axis_size=groups.heads_axis_size,
        topology=state.topology, planning=state.planning, carried_layouts=carried)
    if state.planning and heads_axis_size and not groups.ring:
        state.groups = groups.planned_hybrid(heads_axis_size)
    return dict(Counter(state.strategies.values()))


def _rewrite(state: PipelineState) -> dict[str, int]:
    fill_regions(state.gm)
    state.rewriter = Rewriter(state.gm, state.families, state.layouts, groups=state.groups, config=state.config,
                              strategies=state.strategies, sharded_inputs=state.sharded_inputs)
    state.gm = state.rewriter.run()
    state.lazy_outputs = {i: replace(lazy, split=i in state.rewriter.split_outputs)
                          for i, lazy in state.lazy_outputs.items()}
    report = state.rewriter.report
    return {"transitions": len(report.transitions), "fallbacks": len(report.fallbacks),
            "collectives": len(report.comms)}


def _tile(state: PipelineState) -> dict[str, int]:
    return tile(state.gm, state.config, state.rewriter)


def _lazy(state: PipelineState) -> dict[str, int]:
    state.lazy_outputs = lazy_outputs(state.gm) if state.config.lazy_logits else {}
    state.cache_outputs = kv_cache_outputs(state.gm)
    return {"lazy": len(state.lazy_outputs), "kv_cache": len(state.cache_outputs)}


def _outline(state: PipelineState) -> dict[str, int]:
    outlined = outline_regions(state.gm, state.regions, offload=state.config.offload,
                               prefetch=state.config.offload_prefetch)
    return {"outlined": outlined, "offloaded": outlined if state.config.offload else 0}


def _graph_code(state: PipelineState) -> str:
    state.gm.recompile()  # the passes edit the graph; the code is regenerated from it
    return state.gm.code


def _families_text(state: PipelineState) -> str:
    lines = [f"family {i}: length {fam.length}, attention {[n.name for n in fam.attention_nodes]}"
             for i, fam in enumerate(state.families.families)]
    lines += [f"refused {a} -- {b}: {why}" for a, b, _, why in state.families.refused]
    return "\n".join(lines) + "\n"


def _decisions_text(state: PipelineState) -> str:
    lines = [f"family {i}: {layout}" for i, layout in state.layouts.items()]
    lines += [f"{node.name}: {strategy} ({state.reasons.get(node, '')})" for node, strategy in state.strategies.items()]
    return "\n".join(lines) + "\n"


PASSES: tuple[tuple[str, Callable[[PipelineState], dict[str, int]], Callable[[PipelineState], str]], ...] = (
    ("inline", _inline, _graph_code),
    ("canonical", _canonical, _graph_code),
    ("functionalize", _functionalize, _graph_code),
    ("capture", _capture, _graph_code),
    ("defer", _defer, _graph_code),
    ("decompose", _decompose, _graph_code),
    ("chunking", _chunking, _graph_code),
    ("lazy", _lazy, _graph_code),
    ("recompute", _recompute, _graph_code),
    ("link", _link, lambda state: f"{len(state.links.factors)} nodes with linked dims\n"),
    ("families", _families, _families_text),
    ("strategy", _strategy, _decisions_text),
    ("rewrite", _rewrite, _graph_code),
    ("tile", _tile, _graph_code),
    ("outline", _outline, _graph_code),
)
"""(name, pass, what the pass produced as text for a dump), in the order they run."""


def run_pipeline(state: PipelineState) -> PipelineState:
    """Run :data:`PASSES` in order on ``state``, recording each one's time and counts (and its output,
    with ``state.dump_dir``)."""
    dump = Path(state.dump_dir) if state.dump_dir else None
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
    for index, (name, run, describe) in enumerate(PASSES):
        start = time.perf_counter()
        counts = run(state)
        state.stats[name] = PassStats(time.perf_counter() - start, counts)
        if dump is not None:
            (dump / f"{index:02d}-{name}.txt").write_text(f"# {name}: {counts}\n{describe(state)}")
    return state


@dataclass
class CompiledGraph:
    """One rank's result of compiling one dynamo graph."""

    graph_module: fx.GraphModule
    """The rewritten, per-rank graph."""
    report: CompileReport
    """Placements, transitions, fallbacks, attention decisions."""
    families: Any
    strategies: dict
    gathered_output_shapes: set = None
    """Global shapes of the outputs this graph gathers whole."""
    reasons: dict = None
    """Attention node -> why its strategy was chosen."""
    carried_outputs: dict = None
    """Position in the output tuple -> Shard placement of the outputs handed back as SplitTensor."""
    deferred_outputs: dict = None
    """Position in the output tuple -> :class:`~.deferred.DeferredOutput` of the outputs handed back as
    DeferredTensor (the graph returns None there)."""
    lazy_outputs: dict = None
    """Position in the output tuple -> :class:`~.lazy.LazyOutput` of the outputs handed back as
    :class:`~autoshard.runtime.lazy_linear.LazyLinear` (the graph returns the head's input there)."""
    cache_outputs: list = None
    """Positions in the output tuple of a returned KV cache's keys and values (:func:`~.lazy.kv_cache_outputs`)."""


def compile_graph(gm: fx.GraphModule, *, config: BackendConfig, groups: SequenceGroups,
                  sharded_inputs: dict[str, Any] | None = None, carried_inputs: set[str] | None = None, topology=None,
                  planning: bool = False) -> CompiledGraph:
    """Run the passes (:data:`~autoshard.passes.pipeline.PASSES`) on ``gm`` (modified in place up to the
    rewrite) for ``groups.rank`` of ``groups.world``; ``AUTOSHARD_DUMP=<dir>`` writes every pass's output under
    ``dir``.
    ``sharded_inputs``: placeholder name -> the Shard its local input arrives in; ``carried_inputs``: those of
    them that arrive as SplitTensor from another graph (they seed their sequence, and their family keeps
    their layout)."""
    dump = os.environ.get("AUTOSHARD_DUMP")
    seeds = _annotated_inputs(gm, config) + [(n, sharded_inputs[n.name].dim) for n in gm.graph.nodes
                                             if n.op == "placeholder" and n.name in (carried_inputs or {})]
    state = run_pipeline(PipelineState(
        gm=gm, config=config, groups=groups, sharded_inputs=sharded_inputs, seeds=seeds,
        carried_layouts={name: sharded_inputs[name].layout.kind for name in carried_inputs or {}},
        topology=topology, planning=planning,
        dump_dir=os.path.join(dump, f"graph{next(_DUMPS)}-rank{groups.rank}") if dump else None))
    families, rewriter = state.families, state.rewriter
    if not families.families and groups.world > 1 and (state.missed or state.stats["capture"].counts["layers"]):
        detail = "; ".join(f.reason for f in state.missed) if state.missed else (
            "no scaled_dot_product_attention or softmax(QK^T)V in it, and no input marked with "
            "autoshard.mark_sequence or seq_dims")
        warn(f"autoshard: nothing in this graph is split along a sequence, so it runs whole on every rank: {detail}")
    returned = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    if (not planning and torch.is_grad_enabled() and rewriter.report.recomputed
            and any(value_of(returned[i]).requires_grad for i in state.cache_outputs)):
        warn("autoshard: this training call returns a KV cache (every layer's keys and values: transformers' default "
             "use_cache=True); its layers are checkpointed, so autograd does not keep the keys and values and the "
             "caller holds the cache beside what backward needs. Call the model with use_cache=False where the step "
             "does not read it")
    rewriter.report.passes = state.stats
    rewriter.report.fallbacks[:0] = state.missed
    gathered = {tuple(value_of(n).shape) for n in rewriter.gathered_outputs}
    return CompiledGraph(state.gm, rewriter.report, families, state.strategies, gathered, state.reasons,
                         rewriter.carried_outputs, state.deferred_outputs, state.lazy_outputs, state.cache_outputs)


def source_name(node: fx.Node) -> str | None:
    """Dynamo's source of a graph input, as the caller wrote it (``L['kwargs']['input_ids']``), or None."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return None
    return source.name if isinstance(source.name, str) else source.name()  # a method before torch 2.10


def input_name(node: fx.Node) -> str | None:
    """The user-facing name of a graph input: ``input_ids`` for ``L['kwargs']['input_ids']`` or ``L['input_ids']``."""
    text = source_name(node)
    if text is None:
        return None
    if text.endswith("']"):
        return text[text.rfind("['") + 2:-2]
    return text


def _annotated_inputs(gm: fx.GraphModule, config: BackendConfig) -> list[tuple[fx.Node, int]]:
    """(placeholder, dim) for every input named in ``config.seq_dims`` (by name, or by position among the
    tensor inputs that are not parameters)."""
    if not config.seq_dims:
        return []
    user = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)
            and not is_parameter(n)]
    out = []
    names = [input_name(n) for n in user]
    for key, dim in config.seq_dims.items():
        matches = [n for n in user if input_name(n) == key] if isinstance(key, str) else user[key:key + 1]
        if not matches:
            raise ValueError(f"autoshard: seq_dims names input {key!r}, but the compiled graph's tensor inputs "
                             f"are {names}")
        for n in matches:
            ndim = n.meta["example_value"].dim()
            if not -ndim <= dim < ndim:
                raise ValueError(f"autoshard: seq_dims gives input {key!r} sequence dim {dim}, but it has "
                                 f"shape {tuple(n.meta['example_value'].shape)}")
            out.append((n, dim % ndim))
    return out
