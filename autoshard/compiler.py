"""The torch.compile backend: ``torch.compile(model, backend=autoshard.backend(mesh))``.

Dynamo hands the backend one graph per captured region. The backend classifies it once
(:func:`~autoshard.passes.pipeline.graph_kind`: a dry run, a decode step, dynamic sizes, a static-cache prefill,
dense masks or plain) and compiles it as its kind says (:data:`_COMPILE_KIND`); every graph it compiles for a
sequence goes through one sequence of steps (:meth:`AutoshardBackend._compile`): check that every rank compiled the
same graph, choose the memory policy's config, run the passes of :data:`autoshard.passes.pipeline.PASSES` in order
(canonical ops, capture, decompose, link, families, strategy, rewrite; ``AUTOSHARD_DUMP=<dir>`` writes what each
produced), record what they did (:class:`~autoshard.records.GraphRecord`, :func:`explain`), and lower the per-rank
graph with the inner compiler (by default inductor on CUDA, eager elsewhere).

Every rank compiles its own graph (uneven shards make ranks' shapes differ) and, before the first
run, checks through the rendezvous store that all ranks compiled the same graph for the same shapes:
a rank that reaches a different graph fails with an error, never a hang. Each rank deletes its store
key of one check once the next check shows that every rank has read it, so a long run leaves at most
one check's keys per group in the store.

A dynamic-shape graph (dynamo's symbolic sizes, after a second sequence length) is compiled once per length class
(:meth:`AutoshardBackend.compile_class`, ``length_classes=True``): the passes run on symbolic lengths, the rank graph
computes its sizes at run time, and a later call whose sizes every rank's guards admit runs it without compiling.
The inner compiler (eager, aot_eager, inductor) traces the rank graph with the class's symbolic sizes, so its code
serves the class too. With a memory budget (by default on CUDA) the memory policy decides at the call's sizes and the class
ends there (what fits fits every shorter length). Inputs that arrive split (``inputs="sharded"``) join a class too:
the graph is generalized at the global length (the sum of the ranks' local lengths, exchanged on every call), its
split inputs placed in the layout of that symbolic length, and each call passes the global length where dynamo
passes the rank's own. Where a class is not supported (another inner compiler, values handed between graphs, a
size dynamo does not pass as an input) it is compiled once per distinct set of sizes; the ``SIZES_CACHED`` sets of
sizes used most recently keep their compiled graph.
Every compilation is counted with its cause (:class:`~autoshard.records.Cause`: a new graph, a dynamo recompile and
the guard that failed, a new sequence length, batch size or dtype of a dynamic graph, sizes dropped from the cache, a
new mask structure); :func:`explain` prints the counts, so a user who sees a compile per step learns why.
How every call of a dynamic graph is served, and how the ranks agree on it: :mod:`autoshard.dynamic_sizes`.
"""

from __future__ import annotations

import copy
import datetime
import functools
import hashlib
import itertools
import logging
import warnings
from collections import Counter, deque
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher

from .boundary import (carrying, deferred_inputs_of, inline_inputs, lazy_head, shard_inputs,
                       split_inputs_of, unwrap_inputs)
from .config import BackendConfig, resolve_config, trace_checkpointed_layers
from .dynamic_sizes import NO_SHARDED_INPUT, PerSizes, on_every_rank, placing_per_call, short_shard
from .passes.decode import cache_written_in_place, decode_runner
from .passes.dense_masks import dense_mask_runner
from .passes.static_cache import static_prefill_runner
from .passes.ops import value_of
from .passes.pipeline import DynamoGraph, GraphKind, compile_graph, graph_kind, source_name
from .passes.report import CompileReport
from .passes.specialize import GenericGraph, generalize, specialize
from .placements import Shard
from .recognized import recognize_loaded, warn_if_traced_through
from .records import CAUSES, Cause, GraphRecord, describe_record, dynamo_cause, warn_at_the_recompile_limit
from .planner import plan_graph, plan_graphs
from .policy import device_budget, host_budget, memory_policy_for
from .runtime.input_check import checking_inputs, replicated_inputs
from .runtime.warn import warn
from .runtime.attention.dispatch import last_dispatch
from .runtime.attention.visible_keys import last_fetch
from .passes.placement import documents_of, reads_any_layout
from .runtime.placement import Documents, last_placement, marked, placing_documents
from .runtime.layouts import SequenceLayout
from .runtime.offload import eager_checkpoints
from .runtime.split_tensor import SplitTensor
from .runtime.groups import (GroupLike, check_sequence_mesh, default_store, sequence_group,
                             sequence_groups)

__all__ = ["backend", "compile", "AutoshardBackend", "autoshard_backend", "GraphRecord", "Cause", "CAUSES", "explain"]

logger = logging.getLogger("autoshard")
"""The package's logger: ``backend(dry_run=True)`` logs its plan here (INFO, rank 0)."""

FINGERPRINT_TIMEOUT = datetime.timedelta(seconds=120)
_COMPILES = itertools.count()
"""Numbers this process's compiles; ranks compile in the same order, so the n-th compile of every rank
must be the same graph."""
RECORDS_KEPT = 64
"""How many compiled graphs' records a backend keeps for reports and warnings (oldest first out)."""
_LAST_CHECK: dict[str, int] = {}
"""Group name -> number of this rank's last graph check in that group (whose store key it still holds)."""


class AutoshardBackend:
    """A torch.compile backend that splits the model's sequence over the ranks of ``group``."""

    def __init__(self, group: GroupLike = None, config: BackendConfig | None = None):
        self.group = group
        self.config = config or BackendConfig()
        self.compiled: deque[GraphRecord] = deque(maxlen=RECORDS_KEPT)
        """What reports need of the graphs compiled on this rank, newest last (the last ``RECORDS_KEPT``)."""
        self.compilations: Counter[str] = Counter()
        """Cause kind (:data:`CAUSES`) -> graphs this backend compiled on this rank for it (all of them)."""
        self._cause = Cause("new graph")
        """Why the next graph this backend compiles is compiled (then ``new variant`` until set again)."""
        self._guard_failures_seen: dict = {}
        self._documents: list[Documents] = []
        """The packed documents of the graphs compiled that read any layout: what a graph that takes
        ``position_ids`` prices their placement with, where there is one (:mod:`autoshard.runtime.placement`)."""
        self._warned_whole_cache = False
        trace_checkpointed_layers()
        recognize_loaded()

    @property
    def sharded_layout(self) -> str:
        """The layout inputs split by ``autoshard.shard_inputs`` arrive in."""
        return "contiguous" if self.config.layout == "auto" else self.config.layout

    def _sequence_group(self) -> dist.ProcessGroup:
        """The group this backend splits sequences over (a 2-D mesh's flattened group)."""
        return sequence_group(self.group)

    def __call__(self, gm: fx.GraphModule, example_inputs: list, *, mode: str | None = None,
                 options: dict | None = None) -> Callable:
        """Compile ``gm`` for this rank: classify it once (:func:`~autoshard.passes.pipeline.graph_kind`), then
        compile it as its kind says (:data:`_COMPILE_KIND`). ``mode`` (what ``torch.compile(mode=...)`` and
        transformers' ``CompileConfig`` pass on) names inductor's modes: the per-rank graphs run as they are, so it
        is ignored; ``options`` are inductor's too, and refused rather than ignored."""
        if options:
            raise ValueError(f"autoshard: torch.compile options {sorted(options)} are inductor's; autoshard takes its "
                             "settings as autoshard.backend(**settings) (see autoshard.BackendConfig)")
        pg = self._sequence_group()
        warn_if_traced_through(gm)
        self._cause = dynamo_cause(self._guard_failures_seen)
        warn_at_the_recompile_limit(gm, self._cause)
        graph = DynamoGraph(gm=gm, example_inputs=example_inputs, dry_run=self.config.dry_run, rank=pg.rank(),
                            group_name=pg.group_name)
        kind = graph_kind(graph)
        if kind.name != "dry_run":
            self._warn_if_cache_kept_whole(gm, example_inputs)
        if kind.name not in ("dry_run", "decode", "dynamic") and self.config.inputs == "sharded":
            raise ValueError(short_shard(example_inputs) or NO_SHARDED_INPUT)  # split inputs' dim is dynamic
        return _COMPILE_KIND[kind.name](self, kind, graph)

    def compile(self, gm: fx.GraphModule, example_inputs: list, sharded_inputs: dict[str, Any] | None = None,
                global_inputs: list | None = None) -> Callable:
        """Compile one static copy of a dynamic graph for this rank as its kind says (a prefill into a fixed-size
        KV cache, masks that arrive dense, or plain). ``sharded_inputs``: placeholder name -> the Shard placement
        its (local) input arrives in; ``global_inputs``: the inputs' global shapes, when they differ from
        ``example_inputs``'."""
        graph = DynamoGraph(gm=gm, example_inputs=example_inputs, sharded_inputs=sharded_inputs,
                            global_inputs=global_inputs)
        kind = graph_kind(graph, specialized=True)
        return _COMPILE_KIND[kind.name](self, kind, graph)

    def _plan_only(self, kind: GraphKind, graph: DynamoGraph) -> Callable:
        """A dry run: rank 0 logs the plan (:func:`autoshard.planner.plan_graph`), the graph runs as it is."""
        pg = self._sequence_group()
        if pg.rank() == 0:
            logger.info("%s", plan_graph(copy.deepcopy(graph.gm), graph.example_inputs, world_size=pg.size(),
                                         config=self.config))
        return graph.gm.forward

    def _decode_step(self, kind: GraphKind, graph: DynamoGraph) -> Callable:
        """A decode step over a cache split along the sequence (:mod:`autoshard.passes.decode`): any cache length."""
        self._record(GraphRecord(kind.found.report, set(), True), graph.example_inputs)
        return decode_runner(kind.found, graph.rank, graph.group_name)

    def _per_sizes(self, kind: GraphKind, graph: DynamoGraph) -> Callable:
        """Symbolic sizes: each set of sizes compiled on first use (:meth:`compile_for_sizes`)."""
        return PerSizes(self, graph.gm, graph.example_inputs)

    def _static_prefill(self, kind: GraphKind, graph: DynamoGraph) -> Callable:
        """A prefill into a fixed-size KV cache, compiled as :mod:`autoshard.passes.static_cache` rewrites it (its
        structured variant now, its dense one on first need): its cache leaves split."""
        pg, prefill = self._sequence_group(), kind.found
        example_inputs, global_inputs = graph.example_inputs, graph.global_inputs
        extra = [value_of(n) for n in prefill.structured.graph.nodes if n.op == "placeholder"][len(example_inputs):]
        structured = self._compile(prefill.structured, [*example_inputs, *extra], graph.sharded_inputs,
                                   [*global_inputs, *extra] if global_inputs is not None else None)
        return static_prefill_runner(
            prefill, structured,
            lambda: self._compile(prefill.gm, example_inputs, graph.sharded_inputs, global_inputs),
            pg.rank(), pg.group_name)

    def _dense_masks(self, kind: GraphKind, graph: DynamoGraph) -> Callable:
        """Masks built by code this backend does not compile: compiled per structure their values hold, read at
        run time (:mod:`autoshard.passes.dense_masks`)."""
        return dense_mask_runner(graph.gm, kind.found, lambda gm, args: self._compile(gm, args, graph.sharded_inputs,
                                                                                       graph.global_inputs),
                                 self._sequence_group())

    def _plain(self, kind: GraphKind, graph: DynamoGraph) -> Callable:
        """Any other graph: the pipeline on the graph itself."""
        return self._compile(graph.gm, graph.example_inputs, graph.sharded_inputs, graph.global_inputs)

    def _compile(self, gm: fx.GraphModule, example_inputs: list, sharded_inputs: dict[str, Any] | None,
                 global_inputs: list | None, generic: GenericGraph | None = None) -> Callable:
        """Compile one graph for this rank in a sequence of steps: take the values earlier graphs hand over,
        check that every rank compiled the same graph, choose the memory policy's config, run the pipeline
        (:func:`~autoshard.passes.pipeline.compile_graph`), record, lower with the inner compiler, and hand values
        on to the next graph. ``generic``: ``gm`` is that graph of symbolic lengths (:func:`compile_class`): the
        rank graph computes its sizes at run time, and what leaves it split is placed for each call's lengths."""
        pg = self._sequence_group()
        check = self.config.inputs == "replicated" and self.config.check_inputs
        checked = replicated_inputs(example_inputs) if check else []
        names = [source_name(n) or n.name for n in gm.graph.nodes if n.op == "placeholder"]
        deferred = deferred_inputs_of(example_inputs)  # values an earlier graph left uncomputed: computed here
        gm, example_inputs, global_inputs = inline_inputs(gm, example_inputs, deferred, global_inputs)
        if generic is None:
            carried = split_inputs_of(example_inputs, pg.group_name)
            placements, local = shard_inputs(gm, example_inputs, carried)
            carried_names = set(placements)
            if carried:  # values an earlier graph returned split: they arrive split, the graph gets their shards
                sharded_inputs = {**(sharded_inputs or {}), **placements}
                global_inputs = global_inputs or example_inputs
                example_inputs = local
        else:  # a class's carriers arrive in the layout of its symbolic lengths (compile_class placed them)
            carried = generic.carried_inputs
            placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            carried_names = {placeholders[i] for i in carried}
        index = next(_COMPILES)
        _check_same_graph(pg, index, gm, global_inputs or example_inputs,
                          same_values=self.config.inputs == "replicated")
        policy_inputs = example_inputs if generic is not None else global_inputs or example_inputs
        config, policy = self._memory_policy(gm, policy_inputs, pg.size(), generic)
        if generic is None:
            compiled = compile_graph(gm, config=config, groups=sequence_groups(self.group),
                                     sharded_inputs=sharded_inputs, carried_inputs=carried_names or None)
        else:
            with enable_python_dispatcher():
                compiled = compile_graph(gm, config=config, groups=sequence_groups(self.group),
                                         sharded_inputs=sharded_inputs, carried_inputs=carried_names or None)
        compiled.report.memory_policy = policy
        self._record(GraphRecord(compiled.report, compiled.gathered_output_shapes, bool(compiled.families.families)),
                     example_inputs)
        traced = example_inputs if generic is None else generic.rank_args or generic.fake_args
        run = _lower(compiled.graph_module, traced, self.config.inner_for(_device_type(example_inputs)))
        any_placement = reads_any_layout(compiled.graph_module)
        flat_names = [source_name(n) or n.name for n in gm.graph.nodes if n.op == "placeholder"]  # deferred inlined
        placed = self._placing(compiled, flat_names, bool(deferred), not carried, any_placement, pg.size())
        if placed is not None or (carried and any_placement):
            run = marked(run)
        if deferred or carried or compiled.carried_outputs or compiled.deferred_outputs or compiled.lazy_outputs:
            lazy = {i: functools.partial(lazy_head, spec=spec, group_name=pg.group_name,
                                         summed=self.config.grad_sync, world=pg.size(), host=config.offload)
                    for i, spec in compiled.lazy_outputs.items()}
            wrapper = functools.partial(carrying, flatten=bool(deferred), split_inputs=set(carried),
                                        deferred_outputs=compiled.deferred_outputs, lazy_outputs=lazy,
                                        group_name=pg.group_name, cache_outputs=set(compiled.cache_outputs or ()),
                                        any_placement=any_placement)
            if generic is not None and (compiled.carried_outputs or compiled.deferred_outputs):
                run = placing_per_call(run, wrapper, compiled.carried_outputs, compiled.deferred_outputs, generic)
            else:
                run = wrapper(run, split_outputs=compiled.carried_outputs)
        if placed is not None:
            run = placing_documents(run, *placed)
        if checked:
            run = checking_inputs(run, checked, [names[i] for i in checked], pg.group_name, index)
        return run

    def _placing(self, compiled, names: list[str], flatten: bool, eligible: bool, any_placement: bool,
                 world_size: int) -> tuple[Callable, Callable] | None:
        """Where a graph's calls place packed documents by their lengths (:mod:`autoshard.runtime.placement`): the
        documents as known at the call, and its ``position_ids`` from the call's arguments (``names``: of its inputs
        with every deferred one replaced by what its recipe reads, ``flatten``: there are such); or None. The graph
        reads any layout (``any_placement``) and takes ``position_ids`` replicated and nothing split from another
        graph (``eligible``); what it hands on carries the placement. The documents are those of its own attentions,
        or of a later graph's (placed from the call after that one compiled)."""
        documents = documents_of(compiled, world_size) if any_placement else None
        if documents is not None and documents not in self._documents:
            self._documents.append(documents)
        position = next((i for i, name in enumerate(names) if "position_ids" in name), None)
        if not eligible or not any_placement or position is None or self.config.inputs != "replicated":
            return None
        return ((lambda: self._documents[0] if len(self._documents) == 1 else None),
                lambda args: unwrap_inputs(args, flatten=flatten, split=())[0][position])

    def _memory_policy(self, gm: fx.GraphModule, example_inputs: list, world: int,
                       generic: GenericGraph | None = None) -> tuple[BackendConfig, Any]:
        """The config the memory policy chooses for this graph (:mod:`autoshard.policy`) and what it weighed;
        the backend's own config and None without a budget (``memory_budget`` unset on CPU). Decided from rank
        0's plan, so every rank decides the same. For a length class (``generic``), decided at this call's sizes
        and the class bounded by them: what fits there fits every shorter length."""
        budget, strict = self.config.memory_budget, True
        if budget is None:
            budget, strict = device_budget(example_inputs), False
        if budget is None:
            return self.config, None
        host = self.config.host_budget if self.config.host_budget is not None else host_budget()
        if generic is not None:  # at the call's sizes: a split input's global ones
            gm = specialize(generic.source, *generic.at_hints(example_inputs))
            if generic.split_inputs:
                example_inputs = [value_of(p) for p in gm.graph.nodes if p.op == "placeholder"]
            generic.bound_above()
        return memory_policy_for(gm, example_inputs, plan_graphs=plan_graphs, world_size=world, config=self.config,
                                 budget=budget, host_budget=host, strict=strict)

    def _warn_if_cache_kept_whole(self, gm: fx.GraphModule, example_inputs: list) -> None:
        """A step (no gradients, no split input) over a fixed-size cache written in place that arrives whole
        (allocated before the compiled prefill): correct, but the cache is whole on every rank (warned once per
        backend)."""
        if torch.is_grad_enabled() or any(isinstance(x, SplitTensor) for x in example_inputs):
            return
        cache = cache_written_in_place(gm)
        if cache is not None and not self._warned_whole_cache:
            self._warned_whole_cache = True
            warn(
                f"autoshard: the KV cache {cache} is a fixed-size buffer (as transformers' StaticCache) that was "
                "allocated whole before this graph ran: every rank holds the whole cache and decodes with it (the "
                "tokens are right). autoshard splits a fixed-size cache the compiled prefill allocates (a StaticCache "
                "initialized lazily, by the prefill of a model compiled with this backend); one allocated eagerly "
                "(early_initialization, prefill_chunk_size, a prefill run uncompiled as generate() does with "
                "CompileConfig) stays whole. Caches that grow by appending (DynamicCache, the default) are split.")

    def _record(self, record: GraphRecord, example_inputs: list) -> None:
        """Keep ``record`` of a graph compiled for ``example_inputs`` (:attr:`compiled`), warning about what it
        runs undistributed: its attentions on gathered keys or whole (:func:`_warn_undistributed`), and, in a graph
        with no sequence of its own, the work on a value an earlier graph gathered whole (a graph break between the
        logits and the loss): correct, but the work after the break is not split."""
        gathered = {shape for c in self.compiled for shape in c.gathered_output_shapes}
        inputs = {tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)}
        if not record.splits_sequence and gathered & inputs:
            warn(
                "autoshard: a graph break passes values the previous graph gathered whole (e.g. logits before a "
                "loss computed in a separate graph); the code after the break runs unsplit on every rank. With "
                "outputs='split' (the default) the next graph takes them still split.")
        _warn_undistributed(record.report)
        record.cause, self._cause = self._cause, Cause("new variant")
        self.compilations[record.cause.kind] += 1
        self.compiled.append(record)

    def compile_class(self, gm: fx.GraphModule, args: list, names: list[str], dims: list | None = None,
                      totals: dict | None = None) -> tuple[GenericGraph, Callable] | str:
        """Compile a dynamic graph once for the length class of ``args`` (:func:`~.passes.specialize.generalize`):
        the compiled graph serves every call the returned :class:`GenericGraph` admits. Where a graph of symbolic
        lengths is not supported, why not (on every rank alike; the caller then compiles for the sizes of
        ``args``), empty with ``length_classes=False``. ``names``: the inputs' names in the user's code. With
        ``inputs="sharded"``, ``dims``: the (input, dim, symbol) of the split dims, ``totals``: each symbol's global
        length; the graph is generalized at the global lengths, its split inputs arrive as the layout of a symbolic
        length splits it, and a call passes the global lengths where dynamo passes each rank's own
        (:meth:`PerSizes.__call__`)."""
        config, pg = self.config, self._sequence_group()
        if not config.length_classes:
            return ""
        inner = config.inner_for(_device_type(args))
        if inner not in ("eager", "aot_eager", "inductor"):
            return f"inner={inner!r} (length classes run with eager, aot_eager and inductor)"
        why, placements = None, {}
        try:
            generic = generalize(gm, args, totals)
            kind = graph_kind(DynamoGraph(gm=generic.gm, example_inputs=args), specialized=True)
            why = None if kind.name == "plain" else f"a graph of kind {kind.name}"
            arriving = [(i, d, self.sharded_layout) for i, d, _ in dims or ()]
            for i in generic.carried_inputs:  # handed over split by another graph: in its layout's kind
                carrier = args[i]
                if carrier.group_name != pg.group_name or not isinstance(carrier.layout_rule, SequenceLayout) \
                        or not isinstance(carrier.seq_layout.rule, tuple):
                    raise NotImplementedError(f"input {i} arrives split in a layout of its own ({carrier!r})")
                arriving.append((i, carrier.seq_dim, carrier.seq_layout.kind))
            if arriving:
                placements = self._arriving_split(generic, arriving)
        except Exception as e:  # noqa: BLE001 -- any failure falls back to a graph for these sizes
            logger.debug("autoshard: no length class", exc_info=True)
            why = f"{type(e).__name__}: {e}"
        if not on_every_rank(why is None, pg):
            return why or "not supported on another rank"
        try:
            with warnings.catch_warnings():  # fx warns of every SymInt a pass writes; materialize_sizes lifts them
                warnings.filterwarnings("ignore", message="Raw SymInt value")
                run = self._compile(generic.gm, args, placements or None, generic.fake_args if placements else None,
                                    generic)
            self.compiled[-1].length_class = generic.describe(names)
        except Exception as e:  # noqa: BLE001
            logger.debug("autoshard: no length class", exc_info=True)
            run, why = None, f"{type(e).__name__}: {e}"
        if not on_every_rank(run is not None, pg):
            return why or "not supported on another rank"
        return generic, run

    def _arriving_split(self, generic: GenericGraph, arriving: list[tuple[int, int, str]]) -> dict[str, Shard]:
        """The placements of a generic graph's inputs that arrive split (``arriving``: their (input, dim, layout
        kind): ``inputs="sharded"``, or a carrier from another graph): that layout of their symbolic global length.
        Sets the graph's :attr:`~GenericGraph.rank_args`: this rank's shards, of the sizes the layout computes."""
        pg = self._sequence_group()
        placeholders = [n for n in generic.gm.graph.nodes if n.op == "placeholder"]
        placements, rank_args = {}, list(generic.fake_args)
        for i, d, kind in arriving:
            whole = generic.fake_args[i]
            shard = Shard(d, SequenceLayout.of(kind, whole.shape[d], pg.size()))
            placements[placeholders[i].name] = shard
            with generic.mode:
                rank_args[i] = torch.empty(shard.local_shape(whole.shape, pg.rank()), dtype=whole.dtype,
                                           device=whole.device).requires_grad_(whole.requires_grad)
        generic.rank_args = rank_args
        return placements

    def compile_for_sizes(self, gm: fx.GraphModule, args: list, dims: list | None = None,
                          totals: dict | None = None) -> Callable:
        """Compile a dynamic graph for the sizes of ``args``. With ``inputs="sharded"``, ``dims`` are the
        (input, dim, symbol) of the split sequence dims and ``totals`` each symbol's global length (``args`` pass it
        where it is an int input: :meth:`~autoshard.dynamic_sizes.PerSizes.__call__`): the global graph is compiled
        with those inputs arriving split."""
        if not totals:
            return self.compile(specialize(gm, args), args)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        shapes: dict[int, list] = {}
        sharded: dict[str, Any] = {}
        for i, d, sym in dims:
            shapes.setdefault(i, list(args[i].shape))[d] = totals[sym]
            sharded[placeholders[i].name] = self._arriving_shard(d, totals[sym])
        static = specialize(gm, args, {i: tuple(s) for i, s in shapes.items()})
        global_inputs = [value_of(p) for p in static.graph.nodes if p.op == "placeholder"]
        return self.compile(static, args, sharded, global_inputs)

    def _arriving_shard(self, dim: int, length) -> Shard:
        """How an input split by ``autoshard.shard_inputs`` along ``dim`` arrives: the sharded layout of its global
        ``length`` (an int, or a class's symbolic length)."""
        return Shard(dim, SequenceLayout.of(self.sharded_layout, length, self._sequence_group().size()))


_COMPILE_KIND: dict[str, Callable[[AutoshardBackend, GraphKind, DynamoGraph], Callable]] = {
    "dry_run": AutoshardBackend._plan_only,
    "decode": AutoshardBackend._decode_step,
    "dynamic": AutoshardBackend._per_sizes,
    "static_prefill": AutoshardBackend._static_prefill,
    "dense_masks": AutoshardBackend._dense_masks,
    "plain": AutoshardBackend._plain,
}
"""Kind of graph (:data:`~autoshard.passes.pipeline.KINDS`) -> how the backend compiles one of that kind."""


_WARNED_ATTENTION: set[tuple[str, str]] = set()
"""(user line, reason) of the attentions warned about as not distributed (once each per process)."""


def _warn_undistributed(report: CompileReport) -> None:
    """Warn once per place and reason about an attention that runs on gathered keys or whole (the plan and
    :func:`explain` say it too)."""
    for a in report.attention:
        key = (a.get("line", "unknown"), a.get("reason", ""))
        if a["strategy"] in ("gathered-kv", "whole") and key not in _WARNED_ATTENTION:
            _WARNED_ATTENTION.add(key)
            warn(f"autoshard: the attention at {key[0]} is not distributed ({a['strategy']}): {key[1]}")


def _device_type(example_inputs: list) -> str:
    """The device type of a graph: its first tensor input's (``"cpu"`` for a graph without one)."""
    return next((x.device.type for x in example_inputs if isinstance(x, torch.Tensor)), "cpu")


def _lower(gm: fx.GraphModule, example_inputs: list, inner) -> Callable:
    """The rank graph ``gm`` compiled by the inner compiler ``inner``; ``"eager"``: run as it is, its checkpointed
    regions through torch's plain checkpoint (:func:`~autoshard.runtime.offload.eager_checkpoints`)."""
    if inner == "eager":
        eager_checkpoints(gm)
        return gm.forward
    if callable(inner):
        return inner(gm, example_inputs)
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(inner)(gm, example_inputs)


def _fingerprint(gm: fx.GraphModule, example_inputs: list) -> str:
    """What every rank must agree on: the graph and its inputs' shapes."""
    h = hashlib.sha256(gm.code.encode())
    for x in example_inputs:
        h.update(repr((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x).encode())
    return h.hexdigest()[:16]


def _values_digest(example_inputs: list) -> str:
    """A digest of the inputs' values: whole for data, a sample for parameters (cheap on large models)."""
    h = hashlib.sha256()
    for x in example_inputs:
        if (isinstance(x, torch.Tensor) and not isinstance(x, (torch._subclasses.FakeTensor, SplitTensor))
                and x.device.type != "meta"):  # a SplitTensor holds a different shard on every rank
            data = x.detach().reshape(-1)[:256] if isinstance(x, torch.nn.Parameter) else x.detach().reshape(-1)
            # a fresh copy: numpy() would mark the input's own storage unresizable (FSDP2 frees its unsharded
            # parameters by resizing their storage to 0), and a clone keeps the stride 0 of an expanded scalar
            # (a pipeline's t.expand(batch)), which cannot be viewed as bytes
            copy = torch.empty(data.shape, dtype=data.dtype).copy_(data)
            h.update(copy.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _check_same_graph(pg: dist.ProcessGroup, index: int, gm: fx.GraphModule, example_inputs: list,
                      same_values: bool = True) -> None:
    """Every rank of ``pg`` compiled the same graph for the same input shapes as its ``index``-th graph, and
    (``same_values``, whole inputs) passed the same input values and parameters."""
    store = default_store()
    world, rank = pg.size(), pg.rank()
    prefix = f"autoshard/{pg.group_name}/{index}"
    mine = _fingerprint(gm, example_inputs) + "/" + (_values_digest(example_inputs) if same_values else "-")
    store.set(f"{prefix}/{rank}", mine)
    keys = [f"{prefix}/{r}" for r in range(world)]
    try:
        store.wait(keys, FINGERPRINT_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 -- the store raises its own timeout type
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RuntimeError(
            f"autoshard: rank {rank} compiled graph #{index} but rank(s) {missing} did not reach it within "
            f"{FINGERPRINT_TIMEOUT.seconds} s: every rank must call the compiled model with the same input "
            f"shapes and take the same code path") from exc
    prints = [store.get(key).decode().split("/") for key in keys]
    previous = _LAST_CHECK.get(pg.group_name)
    if previous is not None:  # every rank set its key of this check after reading all keys of the previous one
        store.delete_key(f"autoshard/{pg.group_name}/{previous}/{rank}")
    _LAST_CHECK[pg.group_name] = index

    def groups(part):
        out = {}
        for r, p in enumerate(prints):
            out.setdefault(p[part], []).append(r)
        return sorted(out.values())

    if len({p[0] for p in prints}) > 1:
        raise RuntimeError(
            "autoshard: ranks reached different graphs or input shapes for compiled graph "
            f"#{index} (ranks grouped by what they compiled: {groups(0)}); every rank must "
            "pass inputs of the same shapes and take the same code path" + ("" if same_values else (
                "; inputs='sharded' serves a model dynamo compiles as one graph (a graph after a graph break or "
                "FSDP2's per-layer cut takes this rank's shards unmarked: not supported yet; pass whole inputs)")))
    if len({p[1] for p in prints}) > 1:
        raise RuntimeError(
            f"autoshard: ranks passed different input values or parameters to compiled graph #{index} (ranks "
            f"grouped by values: {groups(1)}); with inputs='replicated' every rank passes the same full batch and "
            "holds the same parameters (seed the inputs, broadcast the initial weights), or split the batch with "
            "autoshard.shard_inputs and inputs='sharded'")


def compile(model: torch.nn.Module | Callable, group: GroupLike = None, config: BackendConfig | None = None, *,
            dynamic: bool | None = None, fullgraph: bool = False, **overrides):
    """``torch.compile(model, backend=autoshard.backend(group, config, **overrides), dynamic=..., fullgraph=...)``,
    with the backend kept as the compiled model's ``autoshard_backend`` (what :func:`explain` reads)."""
    compiled_by = backend(group, config, **overrides)
    compiled = torch.compile(model, backend=compiled_by, dynamic=dynamic, fullgraph=fullgraph)
    compiled.autoshard_backend = compiled_by
    return compiled


def backend(group: GroupLike = None, config: BackendConfig | None = None, **overrides) -> AutoshardBackend:
    """The backend for ``torch.compile``: ``group`` is a ProcessGroup, a DeviceMesh (2-D for the hybrid
    strategy) or None for the default group; ``config`` a :class:`~autoshard.config.BackendConfig` (None: the
    defaults) and ``overrides`` its fields set on top of it: ``backend(mesh, config, strategy="ring")``."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, BackendConfig):
        raise TypeError("autoshard.backend: the first argument is the group; pass the BackendConfig as config=...")
    config = resolve_config(config, overrides)
    if isinstance(group, DeviceMesh):
        check_sequence_mesh(group)
    if config.strategy == "hybrid":
        if not (isinstance(group, DeviceMesh) and group.ndim == 2):
            raise ValueError("autoshard.backend: strategy='hybrid' needs a 2-D DeviceMesh (ring axis, ulysses axis)")
    return AutoshardBackend(group, config)


def explain(compiled_by: AutoshardBackend | Any = None) -> str:
    """What a backend did to the graphs it compiled on this rank (the last ``RECORDS_KEPT``), oldest first:
    attention strategies, fallbacks, the memory levers and the memory policy's choice; after a run with packed
    documents, the attention work per rank of the latest call and its imbalance, and the key rows every rank fetched. ``compiled_by``: the
    backend ``autoshard.backend(...)`` returned, or a model :func:`compile` returned; None: the one
    ``torch.compile(model, backend="autoshard")`` uses. Each report in full is ``backend.compiled[i].report``."""
    source = getattr(compiled_by, "autoshard_backend", compiled_by) if compiled_by is not None else autoshard_backend
    if source is not None and not isinstance(source, AutoshardBackend):
        raise TypeError(f"autoshard.explain takes the backend autoshard.backend(...) returned (b = autoshard.backend(); "
                        f"torch.compile(fn, backend=b); autoshard.explain(b)) or a model autoshard.compile returned, "
                        f"not {type(compiled_by).__name__}")
    if source is None or not source.compiled:
        return "autoshard: nothing compiled on this rank yet"
    counts = ", ".join(f"{source.compilations[kind]} {kind}" for kind in CAUSES if source.compilations[kind])
    lines = [f"compilations on this rank: {sum(source.compilations.values())} ({counts})"]
    lines += [line for i, record in enumerate(source.compiled) for line in describe_record(i, record)]
    documents, fetched, placed = last_dispatch(), last_fetch(), last_placement()
    if placed is not None:
        lines.append(f"packed documents, latest placement: {placed.summary()}")
    if documents is not None:
        lines.append(f"packed documents, latest attention: {documents.summary()}")
    if fetched is not None:
        lines.append(f"packed documents, latest all-gather attention: {fetched.summary()}")
    return "\n".join(lines)


autoshard_backend = AutoshardBackend()
"""``torch.compile(model, backend="autoshard")`` (the ``torch_dynamo_backends`` entry point): the default group and
default options. Made when autoshard is imported, so its dynamo setting (:func:`~autoshard.config.
trace_checkpointed_layers`) is in effect before dynamo traces a model compiled by name."""
