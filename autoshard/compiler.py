"""The torch.compile backend: ``torch.compile(model, backend=autoshard.backend(mesh))``.

Dynamo hands the backend one graph per captured region; the backend runs the passes of
:data:`autoshard.passes.pipeline.PASSES` in order (canonical ops, capture, decompose, link, families,
strategy, rewrite; ``AUTOSHARD_DUMP=<dir>`` writes what each produced) and lowers the per-rank graph
with the inner compiler (by default inductor on CUDA, eager elsewhere).

Every rank compiles its own graph (uneven shards make ranks' shapes differ) and, before the first
run, checks through the rendezvous store that all ranks compiled the same graph for the same shapes:
a rank that reaches a different graph fails with an error, never a hang. Each rank deletes its store
key of one check once the next check shows that every rank has read it, so a long run leaves at most
one check's keys per group in the store.

A dynamic-shape graph (dynamo's symbolic sizes, after a second sequence length) is compiled once per
distinct set of sizes; the ``SIZES_CACHED`` sets of sizes used most recently keep their compiled graph.
Every rank makes the same cache decision on every call: with split inputs (``inputs="sharded"``) the
ranks' local lengths differ, so on every call they all-gather their local lengths and a digest of their
other sizes (a few bytes, counted as ``"metadata"``) and key the cache on all ranks' lengths; a rank
whose shard is not the one the layout gives it, or whose other sizes differ, makes every rank raise.
"""

from __future__ import annotations

import copy
import datetime
import functools
import hashlib
import itertools
import logging
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from .config import BackendConfig, resolve_config, trace_checkpointed_layers
from .passes.decode import cache_written_in_place, decode_graph, decode_runner
from .passes.dense_masks import dense_mask_inputs, dense_mask_runner
from .passes.static_cache import static_prefill, static_prefill_runner
from .passes.deferred import inline_deferred
from .passes.ops import value_of
from .passes.pipeline import compile_graph, source_name
from .passes.report import CompileReport
from .passes.specialize import is_dynamic, size_key, specialize, symbol_of, symbolic_dims
from .placements import Shard
from .planner import memory_policy_for, plan_graph
from .policy import device_budget, host_budget
from .runtime.collectives import gather_facts
from .runtime.input_check import checking_inputs, replicated_inputs
from .runtime.warn import warn
from .runtime.attention.dispatch import last_dispatch
from .runtime.layouts import SequenceLayout
from .runtime.deferred import DeferredTensor, defer
from .runtime.lazy_linear import lazy_linear
from .runtime.redistribute import grad_scale, grad_sync
from .runtime.split_tensor import SplitTensor, local_of, wrap
from .runtime.groups import (GroupLike, check_sequence_mesh, default_store, sequence_group,
                             sequence_groups)

__all__ = ["backend", "compile", "AutoshardBackend", "autoshard_backend", "GraphRecord", "explain"]

logger = logging.getLogger("autoshard")
"""The package's logger: ``backend(dry_run=True)`` logs its plan here (INFO, rank 0)."""

FINGERPRINT_TIMEOUT = datetime.timedelta(seconds=120)
_COMPILES = itertools.count()
"""Numbers this process's compiles; ranks compile in the same order, so the n-th compile of every rank
must be the same graph."""
SIZES_CACHED = 8
"""How many sets of sizes of one dynamic-shape graph keep their compiled graph (least recently used first out)."""
RECORDS_KEPT = 64
"""How many compiled graphs' records a backend keeps for reports and warnings (oldest first out)."""
_LAST_CHECK: dict[str, int] = {}
"""Group name -> number of this rank's last graph check in that group (whose store key it still holds)."""


@dataclass
class GraphRecord:
    """What the backend keeps of a graph it compiled: what reports read, nothing that holds the graphs."""

    report: CompileReport
    """Placements, transitions, fallbacks, attention decisions."""
    gathered_output_shapes: set
    """Global shapes of the outputs the graph gathers whole."""
    splits_sequence: bool
    """Whether anything in the graph is split along a sequence."""


class AutoshardBackend:
    """A torch.compile backend that splits the model's sequence over the ranks of ``group``."""

    def __init__(self, group: GroupLike = None, config: BackendConfig | None = None):
        self.group = group
        self.config = config or BackendConfig()
        self.compiled: deque[GraphRecord] = deque(maxlen=RECORDS_KEPT)
        """What reports need of the graphs compiled on this rank, newest last (the last ``RECORDS_KEPT``)."""
        self._warned_whole_cache = False
        trace_checkpointed_layers()

    @property
    def sharded_layout(self) -> str:
        """The layout inputs split by ``autoshard.shard_inputs`` arrive in."""
        return "contiguous" if self.config.layout == "auto" else self.config.layout

    def _sequence_group(self) -> dist.ProcessGroup:
        """The group this backend splits sequences over (a 2-D mesh's flattened group)."""
        return sequence_group(self.group)

    def __call__(self, gm: fx.GraphModule, example_inputs: list, *, mode: str | None = None,
                 options: dict | None = None) -> Callable:
        """Compile ``gm`` for this rank. ``mode`` (what ``torch.compile(mode=...)`` and transformers'
        ``CompileConfig`` pass on) names inductor's modes: the per-rank graphs run as they are, so it is ignored;
        ``options`` are inductor's too, and refused rather than ignored."""
        if options:
            raise ValueError(f"autoshard: torch.compile options {sorted(options)} are inductor's; autoshard takes its "
                             "settings as autoshard.backend(**settings) (see autoshard.BackendConfig)")
        pg = self._sequence_group()
        world, rank = pg.size(), pg.rank()
        if self.config.dry_run:
            if rank == 0:
                logger.info("%s", plan_graph(copy.deepcopy(gm), example_inputs, world_size=world, config=self.config))
            return gm.forward
        if any(isinstance(x, SplitTensor) for x in example_inputs):
            decode, why_not = decode_graph(gm, example_inputs, rank=rank, group_name=pg.group_name)
            if decode is not None:  # a decode step over a cache split along the sequence: any cache length
                self.compiled.append(GraphRecord(decode.report, set(), True))
                return decode_runner(decode, rank, pg.group_name)
            logger.debug("autoshard: not a decode step: %s", why_not)
        elif not torch.is_grad_enabled():
            self._warn_if_cache_kept_whole(gm)
        if is_dynamic(gm):
            return _PerSizes(self, gm, example_inputs)
        if self.config.inputs == "sharded":
            raise ValueError(_NO_SHARDED_INPUT)
        return self.compile(gm, example_inputs)

    def compile(self, gm: fx.GraphModule, example_inputs: list, sharded_inputs: dict[str, Any] | None = None,
                global_inputs: list | None = None) -> Callable:
        """Compile one static graph for this rank and lower it. ``sharded_inputs``: placeholder name -> the
        Shard placement its (local) input arrives in; ``global_inputs``: the inputs' global shapes, when
        they differ from ``example_inputs``'. A prefill into a fixed-size KV cache is compiled as
        :mod:`autoshard.passes.static_cache` rewrites it, and its cache leaves split. A graph whose attention mask
        arrives dense is compiled per structure its values hold (:mod:`autoshard.passes.dense_masks`)."""
        static = None if torch.is_grad_enabled() else static_prefill(gm)
        if static is None:
            masks = dense_mask_inputs(gm, example_inputs)
            if masks:  # built by code this backend does not compile: read at run time (autoshard.passes.dense_masks)
                return dense_mask_runner(gm, masks, lambda graph, args: self._compile(graph, args, sharded_inputs,
                                                                                      global_inputs),
                                         self._sequence_group())
            return self._compile(gm, example_inputs, sharded_inputs, global_inputs)
        pg = self._sequence_group()
        extra = [value_of(n) for n in static.structured.graph.nodes if n.op == "placeholder"][len(example_inputs):]
        structured = self._compile(static.structured, [*example_inputs, *extra], sharded_inputs,
                                   [*global_inputs, *extra] if global_inputs is not None else None)
        return static_prefill_runner(
            static, structured, lambda: self._compile(static.gm, example_inputs, sharded_inputs, global_inputs),
            pg.rank(), pg.group_name)

    def _compile(self, gm: fx.GraphModule, example_inputs: list, sharded_inputs: dict[str, Any] | None,
                 global_inputs: list | None) -> Callable:
        pg = self._sequence_group()
        check = self.config.inputs == "replicated" and self.config.check_inputs
        checked = replicated_inputs(example_inputs) if check else []
        names = [source_name(n) or n.name for n in gm.graph.nodes if n.op == "placeholder"]
        deferred = {i: x for i, x in enumerate(example_inputs) if isinstance(x, DeferredTensor)}
        if deferred:  # values an earlier graph left uncomputed: their recipes are computed here, from their inputs
            gm = inline_deferred(gm, {i: x.recipe for i, x in deferred.items()},
                                 {i: list(x.recipe_inputs) for i, x in deferred.items()})
            example_inputs = _flatten_deferred(example_inputs)
            global_inputs = _flatten_deferred(global_inputs, deferred) if global_inputs is not None else None
        carried = {i: x for i, x in enumerate(example_inputs) if isinstance(x, SplitTensor) and x.group_name == pg.group_name}
        if carried:  # values an earlier graph returned split: they arrive split, the graph gets their shards
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            sharded_inputs = {**(sharded_inputs or {}),
                              **{placeholders[i].name: Shard(x.seq_dim, x.seq_layout) for i, x in carried.items()}}
            global_inputs = global_inputs or example_inputs
            example_inputs = [x.local.detach().requires_grad_(x.requires_grad) if i in carried else x
                              for i, x in enumerate(example_inputs)]  # the inner compiler traces the shard's grad
        index = next(_COMPILES)
        _check_same_graph(pg, index, gm, global_inputs or example_inputs,
                          same_values=self.config.inputs == "replicated")
        config, policy = self._memory_policy(gm, global_inputs or example_inputs, pg.size())
        compiled = compile_graph(gm, config=config, groups=sequence_groups(self.group), sharded_inputs=sharded_inputs,
                                 carried_inputs={placeholders[i].name for i in carried} if carried else None)
        compiled.report.memory_policy = policy
        record = GraphRecord(compiled.report, compiled.gathered_output_shapes, bool(compiled.families.families))
        self._warn_if_whole_from_earlier_graph(record, example_inputs)
        _warn_undistributed(compiled.report)
        self.compiled.append(record)
        run = _lower(compiled.graph_module, example_inputs, self.config.inner_for(_device_type(example_inputs)))
        if deferred or carried or compiled.carried_outputs or compiled.deferred_outputs or compiled.lazy_outputs:
            lazy = {i: functools.partial(_lazy_head, spec=spec, group_name=pg.group_name,
                                         summed=self.config.grad_sync, world=pg.size(), host=config.offload)
                    for i, spec in compiled.lazy_outputs.items()}
            run = _carrying(run, bool(deferred), set(carried), compiled.carried_outputs, compiled.deferred_outputs,
                            lazy, pg.group_name)
        if checked:
            run = checking_inputs(run, checked, [names[i] for i in checked], pg.group_name, index)
        return run

    def _memory_policy(self, gm: fx.GraphModule, example_inputs: list, world: int) -> tuple[BackendConfig, Any]:
        """The config the memory policy chooses for this graph (:mod:`autoshard.policy`) and what it weighed;
        the backend's own config and None without a budget (``memory_budget`` unset on CPU). Decided from rank
        0's plan, so every rank decides the same."""
        budget, strict = self.config.memory_budget, True
        if budget is None:
            budget, strict = device_budget(example_inputs), False
        if budget is None:
            return self.config, None
        host = self.config.host_budget if self.config.host_budget is not None else host_budget()
        return memory_policy_for(gm, example_inputs, world_size=world, config=self.config, budget=budget,
                                 host_budget=host, strict=strict)

    def _warn_if_cache_kept_whole(self, gm: fx.GraphModule) -> None:
        """A step over a fixed-size cache written in place that arrives whole (allocated before the compiled
        prefill): correct, but the cache is whole on every rank (warned once per backend)."""
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

    def _warn_if_whole_from_earlier_graph(self, compiled: GraphRecord, example_inputs: list) -> None:
        """A graph with no sequence of its own that takes, as input, a value an earlier graph gathered whole
        (a graph break between the logits and the loss): correct, but the work after the break is not split."""
        gathered = {shape for c in self.compiled for shape in c.gathered_output_shapes}
        inputs = {tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)}
        if not compiled.splits_sequence and gathered & inputs:
            warn(
                "autoshard: a graph break passes values the previous graph gathered whole (e.g. logits before a "
                "loss computed in a separate graph); the code after the break runs unsplit on every rank. With "
                "outputs='split' (the default) the next graph takes them still split.")

    def compile_for_sizes(self, gm: fx.GraphModule, args: list, dims: list | None = None,
                          lengths: tuple | None = None) -> Callable:
        """Compile a dynamic graph for the sizes of ``args``. With ``inputs="sharded"``, ``dims`` are the
        (input, dim, symbol) of the split sequence dims and ``lengths[r][k]`` rank ``r``'s local length of
        the ``k``-th (see :func:`_split_lengths`): their global lengths are the sums over ranks, and the
        global graph is compiled with those inputs arriving split."""
        if lengths is None:
            return self.compile(specialize(gm, args), args)
        pg = self._sequence_group()
        totals = [sum(column) for column in zip(*lengths)]
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        global_of = {sym: n for (_, _, sym), n in zip(dims, totals)}
        shapes: dict[int, list] = {}
        sharded: dict[str, Any] = {}
        for (i, d, sym), n in zip(dims, totals):
            shape = shapes.setdefault(i, list(args[i].shape))
            shape[d] = n
            sharded[placeholders[i].name] = Shard(d, SequenceLayout.of(self.sharded_layout, n, pg.size()))
        global_args = [global_of.get(symbol_of(p), a) if not isinstance(a, torch.Tensor) else a
                       for p, a in zip(placeholders, args)]
        static = specialize(gm, global_args, {i: tuple(s) for i, s in shapes.items()})
        global_inputs = [value_of(p) for p in static.graph.nodes if p.op == "placeholder"]
        return self.compile(static, args, sharded, global_inputs)


class _PerSizes:
    """A dynamic-shape graph, compiled once per distinct set of sizes it is called with; the
    ``SIZES_CACHED`` sets used most recently keep their compiled graph (see the module docstring)."""

    def __init__(self, backend: AutoshardBackend, gm: fx.GraphModule, example_inputs: list):
        self.backend, self.gm = backend, gm
        self.cache: OrderedDict[tuple, Callable] = OrderedDict()
        self.split_dims = _split_dims(gm, example_inputs) if backend.config.inputs == "sharded" else []
        if backend.config.inputs == "sharded" and not self.split_dims:
            raise ValueError(_NO_SHARDED_INPUT)
        self.pg = backend._sequence_group()
        symbols = {sym for _, _, sym in self.split_dims}
        self.length_args = {i for i, p in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
                            if symbol_of(p) in symbols}
        """Inputs that are a split length themselves (dynamo passes symbolic sizes as ints)."""

    def __call__(self, *args):
        lengths = self._split_lengths(args) if self.split_dims else None
        key = (size_key(args), lengths)
        fn = self.cache.get(key)
        if fn is None:
            if lengths is not None:
                self._check_layout(lengths)
            fn = self.cache[key] = self.backend.compile_for_sizes(self.gm, list(args), self.split_dims, lengths)
            if len(self.cache) > SIZES_CACHED:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(key)
        return fn(*args)

    def _split_lengths(self, args) -> tuple[tuple[int, ...], ...]:
        """Every rank's local lengths of the split dims (``[rank][dim]``), all-gathered with a digest of each
        rank's other sizes; raises on every rank alike when the ranks' other sizes differ."""
        others = [[list(a.shape), a.dtype] if isinstance(a, torch.Tensor) else None if i in self.length_args else a
                  for i, a in enumerate(args)]
        for i, d, _ in self.split_dims:
            others[i][0][d] = None
        digest = int.from_bytes(hashlib.sha256(repr(others).encode()).digest()[:7], "big")
        rows = gather_facts([args[i].size(d) for i, d, _ in self.split_dims] + [digest], self.pg)
        if len({row[-1] for row in rows}) > 1:
            raise RuntimeError("autoshard: with inputs='sharded' every rank must pass inputs of the same shapes apart "
                               "from the split sequence dim; the ranks' other sizes differ")
        return tuple(tuple(row[:-1]) for row in rows)

    def _check_layout(self, lengths: tuple[tuple[int, ...], ...]) -> None:
        """Raise (on every rank alike: ``lengths`` is all-gathered) unless every split input arrives as the
        layout splits it. Checked once per set of lengths, when it is compiled."""
        kind = self.backend.sharded_layout
        for k, (i, d, _) in enumerate(self.split_dims):
            column = tuple(row[k] for row in lengths)
            expected = SequenceLayout.of(kind, sum(column), self.pg.size()).local_lengths
            if column != expected:
                raise RuntimeError(
                    f"autoshard: input {i} arrives split along dim {d} into local lengths {list(column)} over the "
                    f"ranks, but the {kind} layout of {sum(column)} positions gives {list(expected)}; split inputs "
                    f"with autoshard.shard_inputs(..., layout={kind!r})")


_NO_SHARDED_INPUT = (
    "autoshard: inputs='sharded' expects the inputs that carry the sequence to come from autoshard.shard_inputs(...), "
    "which marks their sequence dim dynamic; this graph has no such input. Pass whole inputs with "
    "inputs='replicated' (the default).")


def _split_dims(gm: fx.GraphModule, example_inputs: list) -> list[tuple[int, int, Any]]:
    """(input, dim, symbol) of the symbolic dims ``autoshard.shard_inputs`` marked: the split sequence. Other
    symbolic dims (a batch size dynamo made dynamic after a change) are sizes like any other."""
    return [(i, d, sym) for i, d, sym in symbolic_dims(gm)
            if d in getattr(example_inputs[i], "_dynamo_dynamic_indices", ())]


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


def _carrying(fn: Callable, flatten: bool, carried_inputs: set[int], carried_outputs: dict, deferred_outputs: dict,
              lazy_outputs: dict, group_name: str) -> Callable:
    """``fn`` (a compiled per-rank graph) called with the inner tensors of its DeferredTensor inputs in their
    place (``flatten``) and the shards of the SplitTensor inputs at ``carried_inputs`` (positions among those
    flattened inputs); its outputs at ``lazy_outputs`` made by their function (:func:`_lazy_head`) of the output
    and the flattened inputs, those at ``carried_outputs`` handed back as SplitTensor, at ``deferred_outputs``
    (None from the graph) as DeferredTensor of the inputs their recipes read."""
    def run(*args):
        args = _flatten_deferred(args) if flatten else args
        out = fn(*(local_of(a) if i in carried_inputs else a for i, a in enumerate(args)))
        out = type(out)(lazy_outputs[i](o, args) if i in lazy_outputs else o for i, o in enumerate(out))
        return type(out)(wrap(o, carried_outputs[i].dim, carried_outputs[i].layout, group_name) if i in carried_outputs
                         else defer(deferred_outputs[i].recipe, [args[j] for j in deferred_outputs[i].inputs])
                         if i in deferred_outputs else o for i, o in enumerate(out))
    return run


def _lazy_head(h: torch.Tensor, args, *, spec, group_name: str, summed: bool, world: int, host: bool) -> torch.Tensor:
    """The lazy logits of the head ``spec`` (:class:`~autoshard.passes.lazy.LazyOutput`) from the graph's output
    ``h`` and its inputs ``args`` (``h`` held in host memory when ``host``: with ``offload``). On split tokens, the
    head's parameters take this rank's share of their gradient the way the graph's own uses do: ``summed`` over the
    group (``grad_sync``), or multiplied by its size."""
    weight, bias = args[spec.weight], args[spec.bias] if spec.bias is not None else None
    if spec.split:
        weight, bias = (p if p is None else grad_sync(p, group_name) if summed else grad_scale(p, world)
                        for p in (weight, bias))
    return lazy_linear(h, weight, bias, dtype=spec.dtype, host=host)


def _flatten_deferred(args, like: dict | None = None) -> list:
    """``args`` with every DeferredTensor (or, given ``like``, the argument at each of its positions) replaced by
    its inner tensors (those of ``like[i]``)."""
    like = like or {}
    out = []
    for i, a in enumerate(args):
        carrier = like.get(i, a)
        out.extend(carrier.recipe_inputs if isinstance(carrier, DeferredTensor) else (a,))
    return out


def _device_type(example_inputs: list) -> str:
    """The device type of a graph: its first tensor input's (``"cpu"`` for a graph without one)."""
    return next((x.device.type for x in example_inputs if isinstance(x, torch.Tensor)), "cpu")


def _lower(gm: fx.GraphModule, example_inputs: list, inner) -> Callable:
    if inner == "eager":
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
            # a copy: numpy() would mark the input's own storage unresizable, and FSDP2 frees its unsharded
            # parameters by resizing their storage to 0
            h.update(data.cpu().clone().view(torch.uint8).numpy().tobytes())
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
            "pass inputs of the same shapes and take the same code path")
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


def _describe(index: int, report: CompileReport) -> list[str]:
    """A compiled graph's report, as :func:`explain` prints it."""
    strategies = Counter(a["strategy"] for a in report.attention)
    counts = {name: stats.counts for name, stats in report.passes.items()}
    deferred = counts.get("defer", {}).get("deferred", 0)
    lines = [f"graph {index}: {len(report.attention)} attention call(s)"
             + (f" ({', '.join(f'{n} {k}' for k, n in strategies.items())})" if strategies else "")
             + f", {len(report.comms)} collective(s), {len(report.fallbacks)} fallback(s)"
             + (f", {deferred} output(s) handed on uncomputed" if deferred else "")]
    if report.square_values:
        lines.append(f"  sequence x sequence values: {', '.join(report.square_values)}")
    lines += [f"  fallback {f.node} ({f.op}): {f.reason}" for f in report.fallbacks]
    lines += [f"  attention {a['node']}: {a['strategy']}" + (f" -- {a['reason']}" if a.get("reason") else "")
              for a in report.attention if a["strategy"] in ("gathered-kv", "whole")]
    levers = {"chunked LM head + loss": counts.get("chunking", {}).get("chunked_losses", 0),
              "chunked MLP blocks": counts.get("tile", {}).get("chunked_mlps", 0),
              "tiled token-local regions": counts.get("tile", {}).get("tiled_regions", 0),
              "recomputed regions": len(report.recomputed),
              "offloaded regions": counts.get("outline", {}).get("offloaded", 0)}
    if any(levers.values()):
        lines.append("  memory: " + ", ".join(f"{n} {k}" for k, n in levers.items() if n))
    if report.memory_policy is not None:
        lines.append("  " + report.memory_policy.describe())
    return lines


def explain(compiled_by: AutoshardBackend | Any = None) -> str:
    """What a backend did to the graphs it compiled on this rank (the last ``RECORDS_KEPT``), oldest first:
    attention strategies, fallbacks, the memory levers and the memory policy's choice; after a run with packed
    documents, the attention work per rank of the latest call and its imbalance. ``compiled_by``: the
    backend ``autoshard.backend(...)`` returned, or a model :func:`compile` returned; None: the one
    ``torch.compile(model, backend="autoshard")`` uses. Each report in full is ``backend.compiled[i].report``."""
    source = getattr(compiled_by, "autoshard_backend", compiled_by) if compiled_by is not None else autoshard_backend
    if source is not None and not isinstance(source, AutoshardBackend):
        raise TypeError(f"autoshard.explain takes the backend autoshard.backend(...) returned (b = autoshard.backend(); "
                        f"torch.compile(fn, backend=b); autoshard.explain(b)) or a model autoshard.compile returned, "
                        f"not {type(compiled_by).__name__}")
    if source is None or not source.compiled:
        return "autoshard: nothing compiled on this rank yet"
    lines = [line for i, record in enumerate(source.compiled) for line in _describe(i, record.report)]
    documents = last_dispatch()
    if documents is not None:
        lines.append(f"packed documents, latest attention: {documents.summary()}")
    return "\n".join(lines)


autoshard_backend = AutoshardBackend()
"""``torch.compile(model, backend="autoshard")`` (the ``torch_dynamo_backends`` entry point): the default group and
default options. Made when autoshard is imported, so its dynamo setting (:func:`~autoshard.config.
trace_checkpointed_layers`) is in effect before dynamo traces a model compiled by name."""
