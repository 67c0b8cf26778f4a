"""The compile pipeline: what kind of graph dynamo handed over, and the passes it goes through.

A graph is first classified, once (:func:`graph_kind`): it is of the first kind in :data:`KINDS` whose front pass
applies, and that pass's result (:attr:`GraphKind.found`) is what the backend (:mod:`autoshard.compiler`) compiles:

==================  =================================================================================================
``dry_run``         ``dry_run=True``: the plan is logged, the graph runs as it is
``decode``          a decode step over a KV cache split along the sequence, rewritten for it whole
                    (:mod:`.decode`; it has no sequence of its own, so the passes below do not apply)
``dynamic``         symbolic sizes: compiled per length class, or each set of sizes specialized (:mod:`.specialize`),
                    and classified from
                    ``static_prefill`` on (the dynamic graph was no dry run and no decode step)
``static_prefill``  a prefill into a fresh fixed-size KV cache, rewritten to attend over the prompt
                    (:mod:`.static_cache`): its variants go through the passes below
``dense_masks``     attention masks that arrive dense: one variant per structure their values hold
                    (:mod:`.dense_masks`), each through the passes below
``plain``           the graph itself goes through the passes below
==================  =================================================================================================

The passes (:data:`PASSES`), in one ordered list, each with a name:

=================  ==================================================================================
``inline``         checkpointed and wrapped subgraphs are copied into the graph (:mod:`.regions`)
``canonical``      record every node's canonical op (:mod:`.normalize`, :mod:`.ops`)
``functionalize``  in-place writes into fresh tensors become out-of-place ops (:mod:`.functionalize`)
``capture``        attention calls become ``captured_attention`` with a structured mask (:mod:`.capture`)
``defer``          masks and other cheap large outputs are handed on uncomputed (:mod:`.deferred`)
``decompose``      composites (``diff``) become ops that have rules (:mod:`.normalize`)
``grid``           a block's tokens convolved as an image stay one sequence dim (:mod:`.grid`)
``chunking``       the LM head and its cross-entropy become one chunked op (:mod:`.chunking`)
``lazy``           a returned LM head's logits are computed when first read; a returned KV cache is found
                   (:mod:`.lazy`)
``recompute``      with ``recompute="layers"``, every layer becomes a checkpointed region (:mod:`.recompute`)
``link``           every node's rule links its dims to its inputs' dims; annotations seed (:mod:`.rules`)
``families``       linked dims joined into sequence families (:mod:`.infer`)
``strategy``       an attention algorithm per attention, a layout per family (:mod:`autoshard.strategy`)
``rewrite``        the local graph of this rank (:mod:`.rewrite`)
``heads``          with ``head_chunks``, each attention runs with its q/k/v and output projections a head group at a
                   time (:mod:`.heads`)
``tile``           token-local regions (``tile_tokens``) and MLP blocks (``chunk_mlp``) run in checkpointed tiles
                   of this rank's tokens (:mod:`.tile`)
``materialize``    symbolic sizes the passes wrote (a graph compiled for a length class) become nodes that compute
                   them from the inputs at run time (:mod:`.specialize`)
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
import logging
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
from ..runtime.split_tensor import SplitTensor
from ..runtime.warn import warn
from ..strategy import choose
from .capture import capture_attention
from .tile import tile
from .heads import group_heads
from .chunking import chunk_losses
from .decode import decode_graph
from .deferred import DeferredOutput, defer_outputs
from .dense_masks import dense_mask_inputs
from .functionalize import functionalize
from .grid import flatten_grids
from .infer import Families, LinkContext, find_families
from .lazy import LazyOutput, kv_cache_outputs, lazy_outputs
from .normalize import canonicalize, decompose
from .ops import hint_of, op_of, value_of
from .regions import Region, fill_regions, inline_regions, outline_regions
from .recompute import recompute_layers
from .report import CompileReport
from .rewrite import Rewriter, is_parameter
from .rules import link_graph
from .specialize import is_dynamic, materialize_sizes
from .static_cache import static_prefill

__all__ = ["GraphKind", "DynamoGraph", "KINDS", "graph_kind", "PipelineState", "PassStats", "PASSES", "run_pipeline",
           "CompiledGraph", "compile_graph"]

logger = logging.getLogger("autoshard")
"""The package's logger (:mod:`autoshard.compiler`'s): why a graph with a split cache input is not a decode step
(DEBUG)."""

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


def _grid(state: PipelineState) -> dict[str, int]:
    return flatten_grids(state.gm)


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


def _heads(state: PipelineState) -> dict[str, int]:
    return group_heads(state.gm, state.config, state.rewriter)


def _tile(state: PipelineState) -> dict[str, int]:
    return tile(state.gm, state.config, state.rewriter)


def _lazy(state: PipelineState) -> dict[str, int]:
    state.lazy_outputs = lazy_outputs(state.gm) if state.config.lazy_logits else {}
    state.cache_outputs = kv_cache_outputs(state.gm)
    return {"lazy": len(state.lazy_outputs), "kv_cache": len(state.cache_outputs)}


def _materialize(state: PipelineState) -> dict[str, int]:
    return {"sizes": materialize_sizes(state.gm)}


def _outline(state: PipelineState) -> dict[str, int]:
    return outline_regions(state.gm, state.regions, offload=state.config.offload,
                           prefetch=state.config.offload_prefetch, spared=state.config.offload_spared)


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
    ("grid", _grid, _graph_code),
    ("chunking", _chunking, _graph_code),
    ("lazy", _lazy, _graph_code),
    ("recompute", _recompute, _graph_code),
    ("link", _link, lambda state: f"{len(state.links.factors)} nodes with linked dims\n"),
    ("families", _families, _families_text),
    ("strategy", _strategy, _decisions_text),
    ("rewrite", _rewrite, _graph_code),
    ("heads", _heads, _graph_code),
    ("tile", _tile, _graph_code),
    ("materialize", _materialize, _graph_code),
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
    gathered = {tuple(map(hint_of, value_of(n).shape)) for n in rewriter.gathered_outputs}  # at the call's lengths
    return CompiledGraph(state.gm, rewriter.report, families, state.strategies, gathered, state.reasons,
                         rewriter.carried_outputs, state.deferred_outputs, state.lazy_outputs, state.cache_outputs)


@dataclass(frozen=True, kw_only=True)
class DynamoGraph:
    """A graph dynamo handed the backend (or a static copy of one for one call's sizes), with what its kind depends
    on and how its inputs arrive."""

    gm: fx.GraphModule
    example_inputs: list
    dry_run: bool = False
    """The backend's ``dry_run``."""
    rank: int = 0
    """This rank in the sequence group (a decode step is rewritten for it)."""
    group_name: str | None = None
    """The sequence group's name: inputs split over it may be a decode step's cache."""
    sharded_inputs: dict[str, Any] | None = None
    """Placeholder name -> the Shard placement its local input arrives in (``inputs="sharded"``)."""
    global_inputs: list | None = None
    """The inputs' global shapes, when they differ from ``example_inputs``' (split inputs)."""


@dataclass(frozen=True)
class GraphKind:
    """What a graph is (:data:`KINDS`), and what the kind's front pass made of it."""

    name: str
    """``dry_run``, ``decode``, ``dynamic``, ``static_prefill``, ``dense_masks`` or ``plain``."""
    found: Any = None
    """The decode step (:class:`~.decode.DecodeGraph`), the prefill (:class:`~.static_cache.StaticPrefill`), the
    positions of the dense masks; True for the other kinds."""


def _dry_run(graph: DynamoGraph) -> bool | None:
    return graph.dry_run or None


def _decode_step(graph: DynamoGraph):
    if not any(isinstance(x, SplitTensor) for x in graph.example_inputs):
        return None
    decode, why_not = decode_graph(graph.gm, graph.example_inputs, group_name=graph.group_name)
    if decode is None:
        logger.debug("autoshard: not a decode step: %s", why_not)
    return decode


def _dynamic_sizes(graph: DynamoGraph) -> bool | None:
    return is_dynamic(graph.gm) or None


def _static_prefill(graph: DynamoGraph):
    return None if torch.is_grad_enabled() else static_prefill(graph.gm)  # a training step keeps its buffers


def _dense_masks(graph: DynamoGraph) -> tuple[int, ...] | None:
    return dense_mask_inputs(graph.gm, graph.example_inputs) or None


KINDS: tuple[tuple[str, Callable[[DynamoGraph], Any]], ...] = (
    ("dry_run", _dry_run),
    ("decode", _decode_step),
    ("dynamic", _dynamic_sizes),
    ("static_prefill", _static_prefill),
    ("dense_masks", _dense_masks),
)
"""(kind, its front pass: what it makes of the graph, None where it does not apply), in the order they are tried
(see the module docstring); a graph none applies to is ``plain``."""

_SPECIALIZED = [name for name, _ in KINDS].index("static_prefill")
"""Where a specialization of a dynamic graph starts in :data:`KINDS`."""


def graph_kind(graph: DynamoGraph, *, specialized: bool = False) -> GraphKind:
    """The first kind of :data:`KINDS` whose front pass applies to ``graph``; ``specialized``: a static copy of a
    dynamic graph for one call's sizes (:func:`~.specialize.specialize`), tried from ``static_prefill`` on."""
    for name, front in KINDS[_SPECIALIZED if specialized else 0:]:
        found = front(graph)
        if found is not None:
            return GraphKind(name, found)
    return GraphKind("plain", True)


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
