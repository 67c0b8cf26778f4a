"""Planning: the graphs of a model, planned one call after the other as the run calls them, into one :class:`Plan`.

:func:`plan` captures the model (:mod:`autoshard.planner.capture`: meta tensors as fake ones, nothing is
computed) and :func:`plan_graphs` plans its graph calls in order, each in named steps:

1. the replicated inputs the call checks (:mod:`autoshard.runtime.input_check`: bytes of metadata);
2. a graph called again with inputs of the same kinds is planned once and counted at every call (its
   collectives, its memory); otherwise (:func:`_plan_call`)
3. the graph the run compiles: the values earlier graphs leave uncomputed inlined, those they leave split taken
   split (:mod:`autoshard.planner.capture`), the config the memory policy chooses for it with ``memory_budget``
   (:func:`autoshard.policy.memory_policy_for`, which plans the graph once per option it weighs);
4. the compiler's passes for one rank of a *plan group* (a stand-in with a rank and a size; nothing
   communicates): every collective the rewrite emits is recorded with every rank's bytes and a sympy formula
   (:mod:`autoshard.passes.comms`), with the placements and what the passes did (:func:`_record`);
5. every attention call priced with every strategy on the given topology (:mod:`autoshard.cost`,
   :func:`_decisions`);
6. the per-rank graph run forward and backward on fake tensors to follow what it holds and time its ops
   (:mod:`autoshard.planner.memory`).

Then the graphs' peaks add up into the step's, with the FSDP2 and optimizer terms, and the step is priced on the
hardware profile, by layer (:mod:`autoshard.planner.fsdp`, :mod:`autoshard.step_time`). With packed documents in
concrete ``position_ids``, :func:`plan` counts each rank's attention work as the strategy dispatches it
(:func:`_documents`) and scales the step's attention time to it; with the all-gather strategy, it counts what the
attention sends for that batch (:func:`_documents_traffic`: the keys each rank fetches,
:mod:`autoshard.runtime.attention.visible_keys`, and the queries the dispatch moves) and prices its change.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from ..config import BackendConfig, resolve_config
from ..cost import attention_costs
from ..hardware import HardwareProfile
from ..hardware import hardware as resolve_hardware
from ..passes.capture import DENSE_MASK
from ..passes.pipeline import compile_graph
from ..policy import memory_policy_for
from ..runtime.attention.base import STRATEGIES, AttentionShape, attention_seconds, bytes_sent_by_rank
from ..runtime.attention.formulas import Sizes
from ..runtime.attention.dispatch import balance
from ..runtime.attention.masks import MaskSpec
from ..runtime.attention.visible_keys import key_fetch
from ..runtime import placement as document_placement
from ..runtime.placement import Documents, Placement, segments_of
from ..runtime.groups import SequenceGroups
from ..runtime.input_check import check_bytes, replicated_inputs
from ..runtime.layouts import SequenceLayout, split_sizes
from ..strategy import LONGEST, attention_shape, deciding, length_class
from .capture import capture, carried, inline_deferred_inputs
from .fsdp import check_planning_options, memory_estimate, planned_step_time
from .memory import GraphMemory, graph_memory
from .result import MASK_TERMS, AttentionDecision, Collective, Plan, PlanFallback

__all__ = ["plan", "plan_graph", "plan_graphs"]


def plan(model: torch.nn.Module, args: tuple | torch.Tensor = (), kwargs: dict | None = None, *, world_size: int,
         config: BackendConfig | None = None, rank: int = 0, dp_shard: int = 1, optimizer: str | None = None,
         per_layer_graphs: bool = False, hardware: str | HardwareProfile | None = None, threads: int | None = None,
         **overrides) -> Plan:
    """What ``torch.compile(model, backend=autoshard.backend(...))`` would do on ``world_size`` ranks.

    No process group is needed and nothing full-size is allocated when the model and the inputs are on
    the meta device. ``args``: the positional arguments (a lone tensor is one argument); ``config`` and
    ``overrides`` as in :func:`autoshard.backend`: a :class:`~autoshard.config.BackendConfig` (None: the
    defaults) and its fields set on top of it (``strategy="ring"``, ``topology=HardwareProfile(...)``).

    Planning options (the step around the compiled model, which the graphs do not show; they change only the
    memory estimate):

    * ``dp_shard``: the ranks FSDP2 shards the parameters, their gradients and the optimizer's states over --
      ``fully_shard`` over the flattened (dp, sp) mesh is ``dp * sp``; 1: no FSDP (every rank holds them all).
      Its units are the model's outermost numbered blocks (each element of its layer list, as
      ``fully_shard(layer)`` for every layer and then the root wraps them) and the root (the rest). On top of
      the shards the rank holds the two largest units unsharded (the one running and the one prefetched; the
      root stays unsharded from forward to backward) and the gradients of the unit being reduce-scattered.
    * ``optimizer``: ``"adamw"`` (or ``"adam"``): two float32 moments per parameter, and a float32 master copy
      of 16-bit parameters (the mixed-precision recipe: 16-bit parameters, float32 optimizer); None: no states
      counted (a forward + backward only).
    * ``hardware``: the profile the step is priced on and the strategies chosen with (:func:`autoshard.hardware.hardware`:
      ``"a100"``, ``"h100"``, ``"h200"``, ``"b200"``, a calibrated profile file, or a
      :class:`~autoshard.hardware.HardwareProfile`): ``plan.step_seconds``, ``plan.step_time`` (by layer). The same as
      ``topology=`` (give one of them); neither: the default (H100-class) profile.
    * ``threads``: CPU threads per rank of the run priced: a CPU profile's rates scale to them
      (:meth:`~autoshard.hardware.HardwareProfile.with_threads`; None: what torchrun gives a rank); a GPU's do not
      change.
    * ``per_layer_graphs``: plan the graphs FSDP2's hooks cut the model into when every layer is wrapped (one
      graph per layer, the mask made before them handed on uncomputed, :mod:`autoshard.runtime.deferred`), as the
      run makes them, instead of one graph of the whole model: the same attention, and the bytes the per-layer
      graphs send (each computes its own segment ids, positions and masks from the small inputs)."""
    check_planning_options(dp_shard, optimizer)
    if hardware is not None:
        if overrides.get("topology") is not None:
            raise ValueError("autoshard.plan: give hardware= or topology=, not both (they are the same profile)")
        overrides["topology"] = resolve_hardware(hardware)
    config = resolve_config(config, overrides, "autoshard.plan")
    if config.topology is not None:
        config = dataclasses.replace(config, topology=config.topology.with_threads(threads, world=world_size))
    args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
    graphs = capture(model, args, dict(kwargs or {}), per_layer_graphs=per_layer_graphs)
    result = plan_graphs(graphs, world_size=world_size, config=config, rank=rank, dp_shard=dp_shard,
                         optimizer=optimizer)
    result.documents = _documents(result, (kwargs or {}).get("position_ids"))
    if result.documents and result.step_time is not None:
        ratio = _documents_ratio(result, config.topology or HardwareProfile())
        result.step_time = result.step_time.attention_scaled(ratio)
    if "key_rows" in result.documents:
        _documents_traffic(result, (kwargs or {}).get("position_ids"), config.topology or HardwareProfile())
    return result


def plan_graph(gm: fx.GraphModule, example_inputs: list, *, world_size: int, config: BackendConfig) -> Plan:
    """The plan of one dynamo graph."""
    return plan_graphs([(gm, example_inputs)], world_size=world_size, config=config)


def plan_graphs(graphs: list[tuple], *, world_size: int, config: BackendConfig, rank: int = 0, dp_shard: int = 1,
                optimizer: str | None = None, memory_cap: int | None = None) -> Plan:
    """The plan of already-captured dynamo graphs (what ``backend(..., dry_run=True)`` prints): (graph, example
    inputs) or, from :func:`~autoshard.planner.capture.capture`, one entry per call (graph, its inputs, the earlier
    call output each input is). With ``outputs="split"`` a graph takes the values an earlier graph leaves split
    still split, as the run does. A graph called again is planned once and counted at every call (its collectives,
    its memory). ``dp_shard`` and ``optimizer``: as in :func:`plan`. ``memory_cap``: each graph's simulation stops
    once its live bytes above its inputs pass it (the memory policy's options after the first: one that does not fit
    need not run to its end; :attr:`~.result.MemoryEstimate.stopped`)."""
    check_planning_options(dp_shard, optimizer)

    topology = config.topology or HardwareProfile()
    result = Plan(world_size=world_size, rank=rank, topology=asdict(topology), symbols={"P": world_size})
    calls = _Calls()
    for call, (gm, example_inputs, *sources) in enumerate(graphs):
        sources = list(sources[0]) if sources else [None] * len(example_inputs)
        if config.inputs == "replicated" and config.check_inputs:
            _check_inputs(result, calls, call, example_inputs, sources)
        kinds = calls.kinds(sources)
        planned = calls.planned.get((id(gm), kinds))
        if planned is None:
            planned = _plan_call(result, calls, call, gm, example_inputs, sources, config=config, topology=topology,
                                 dp_shard=dp_shard, optimizer=optimizer, memory_cap=memory_cap)
            calls.planned[(id(gm), kinds)] = planned
        else:  # the same graph run again with inputs of the same kinds: counted again
            calls.leave(call, planned.compiled.carried_outputs, planned.deferred)
            _count(result, planned.compiled.report, f"g{planned.index}.", rank)
            result.attention += [dataclasses.replace(d) for d in planned.decisions]
        calls.memories.append(planned.memory)
    _finish(result, calls, topology, dp_shard=dp_shard, optimizer=optimizer)
    return result


class _Planned(NamedTuple):
    """A graph planned for inputs of given kinds, as later calls of it count it again."""

    index: int
    """The graph's number in the plan (``g<index>``)."""
    compiled: Any
    """What the compile pipeline made of it (:class:`~autoshard.passes.pipeline.CompiledGraph`)."""
    decisions: list[AttentionDecision]
    memory: GraphMemory
    deferred: dict[int, tuple]
    """Output position -> (DeferredOutput, the graph's inputs, their sources): the values it leaves uncomputed."""


@dataclass
class _Calls:
    """What the graph calls planned so far leave to the later ones."""

    carried_outputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    """(call, output position) -> the Shard it leaves split in."""
    deferred_outputs: dict[tuple[int, int], tuple] = field(default_factory=dict)
    """(call, output position) -> (DeferredOutput, the producer's inputs and their sources)."""
    planned: dict[tuple, _Planned] = field(default_factory=dict)
    """(id of the graph, what its inputs are) -> the graph planned for them."""
    memories: list[GraphMemory] = field(default_factory=list)
    """One per call: what its graph holds."""

    def kinds(self, sources: list) -> tuple:
        """What a call's inputs are: per input, the split it arrives in, the recipe of the value it arrives
        uncomputed as, or None (a plain tensor)."""
        return tuple(str(self.carried_outputs[s]) if s in self.carried_outputs else
                     self.deferred_outputs[s][0].recipe.key if s in self.deferred_outputs else None for s in sources)

    def leave(self, call: int, carried: dict, deferred: dict) -> None:
        """Record what ``call`` leaves split (output position -> Shard) and uncomputed (``_Planned.deferred``)."""
        self.carried_outputs.update({(call, position): shard for position, shard in carried.items()})
        self.deferred_outputs.update({(call, position): value for position, value in deferred.items()})


def _check_inputs(result: Plan, calls: _Calls, call: int, example_inputs: list, sources: list) -> None:
    """Count the bytes ``call`` sends checking that every rank passed the same replicated inputs (those no earlier
    graph hands on split or uncomputed)."""
    checked = [i for i in replicated_inputs(example_inputs)
               if sources[i] not in calls.carried_outputs and sources[i] not in calls.deferred_outputs]
    if checked:
        result.input_checks[f"g{call}"] = check_bytes(len(checked), result.world_size)


def _plan_call(result: Plan, calls: _Calls, call: int, gm: fx.GraphModule, example_inputs: list, sources: list, *,
               config: BackendConfig, topology: HardwareProfile, dp_shard: int, optimizer: str | None,
               memory_cap: int | None = None) -> _Planned:
    """Plan a graph call not planned before (a new graph, or inputs of other kinds): steps 3 to 6 of the module
    docstring, recorded in ``result``."""
    world_size, rank = result.world_size, result.rank
    index = len(calls.planned)
    if any(key[0] == id(gm) for key in calls.planned):
        gm = copy.deepcopy(gm)  # compiled once already (in place): this run's inputs differ
    gm, example_inputs, sources = inline_deferred_inputs(gm, example_inputs, sources, calls.deferred_outputs)
    graph_config = config
    if config.memory_budget is not None:
        graph_config, policy = memory_policy_for(gm, example_inputs, plan_graphs=plan_graphs, world_size=world_size,
                                                 config=config, budget=config.memory_budget,
                                                 host_budget=config.host_budget, dp_shard=dp_shard,
                                                 optimizer=optimizer)
        result.memory_policy.append(f"g{index} {policy.describe()}")
    whole_inputs = example_inputs
    names, example_inputs = carried(gm, sources, calls.carried_outputs, example_inputs, rank)
    simulated = _simulation_key(gm, example_inputs, world_size, rank, graph_config)
    compiled = compile_graph(gm, config=graph_config, groups=SequenceGroups.planned(rank, world_size),
                             topology=topology, planning=True,
                             sharded_inputs=names or None, carried_inputs=set(names) or None)
    deferred = {position: (out, whole_inputs, sources) for position, out in compiled.deferred_outputs.items()}
    calls.leave(call, compiled.carried_outputs, deferred)
    _record(result, gm, compiled.report, f"g{index}.")
    decisions = _decisions(compiled, index, world_size, graph_config, topology)
    result.attention += decisions
    if decisions and "S" not in result.symbols:
        result.symbols.update({k: v for k, v in decisions[0].shape.items() if k != "dtype"})
    root = compiled.families.families[0].length if compiled.families.families else 1
    memory = _SIMULATED.get(simulated)
    if memory is None:
        memory = graph_memory(compiled, example_inputs, world_size, root, topology, offload=graph_config.offload,
                              prefetch=False, cap=memory_cap)
        if not memory.stopped:
            _SIMULATED[simulated] = memory
        while len(_SIMULATED) > _SIMULATIONS_KEPT:
            _SIMULATED.pop(next(iter(_SIMULATED)))
    if graph_config.offload and graph_config.offload_prefetch:
        memory = dataclasses.replace(memory, forward=memory.with_prefetch[0], backward=memory.with_prefetch[1],
                                     prefetched=True)
    return _Planned(index, compiled, decisions, memory, deferred)


_SIMULATED: dict[tuple, GraphMemory] = {}
"""The latest simulations of a per-rank graph (:func:`~.memory.graph_memory`, without prefetch: its peaks with
prefetch are in it), by :func:`_simulation_key`: the memory policy plans the graph once per option it weighs, and
the plan of the option it chooses is then the same simulation (half a minute for Llama-8B at millions of tokens)."""
_SIMULATIONS_KEPT = 8


def _simulation_key(gm: fx.GraphModule, example_inputs: list, world_size: int, rank: int,
                    config: BackendConfig) -> tuple:
    """What a simulation of ``gm`` compiled with ``config`` depends on (its code and inputs, the ranks, the config
    but the budgets and prefetch, which the simulation's peaks cover)."""
    inputs = tuple((tuple(x.shape), x.dtype, x.device.type, x.requires_grad) if isinstance(x, torch.Tensor) else x
                   for x in example_inputs)
    levers = dataclasses.replace(config, memory_budget=None, host_budget=None, offload_prefetch=False)
    return hash(gm.code), repr(inputs), world_size, rank, repr(levers)


def _record(result: Plan, gm: fx.GraphModule, report, prefix: str) -> None:
    """Add a newly planned graph's placements, data flow, collectives and fallbacks (:func:`_count`) and what its
    passes did (losses chunked or lazy, tiles, MLP chunks) to ``result``."""
    result.placements.update({prefix + k: v for k, v in report.placements.items()})
    result.edges += [[prefix + i.name, prefix + n.name] for n in gm.graph.nodes for i in n.all_input_nodes
                     if n.name in report.placements and i.name in report.placements]
    _count(result, report, prefix, result.rank)
    chunking = report.passes.get("chunking")
    for key, count in (chunking.counts.items() if chunking is not None else ()):
        name = key.removesuffix("_losses")
        result.losses[name] = result.losses.get(name, 0) + count
    lazy = report.passes.get("lazy")
    result.losses["lazy_logits"] = result.losses.get("lazy_logits", 0) + (lazy.counts["lazy"] if lazy else 0)
    tiled = report.passes["tile"].counts if "tile" in report.passes else {}
    for key, count in (("regions", "tiled_regions"), ("tiles", "tiles")):
        result.tiles[key] = result.tiles.get(key, 0) + tiled.get(count, 0)
    for key in ("chunked", "unchunked"):
        result.mlps[key] = result.mlps.get(key, 0) + tiled.get(f"{key}_mlps", 0)
    heads = report.passes["heads"].counts if "heads" in report.passes else {}
    for key, count in (("grouped", "grouped_attentions"), ("groups", "head_groups"),
                       ("ungrouped", "ungrouped_attentions")):
        result.head_groups[key] = result.head_groups.get(key, 0) + heads.get(count, 0)


def _finish(result: Plan, calls: _Calls, topology: HardwareProfile, *, dp_shard: int, optimizer: str | None) -> None:
    """Number the attention calls by layer, and add the step's memory (from every call's graph) and time."""
    for layer, decision in enumerate(result.attention):
        decision.layer = layer
    result.graphs = len(calls.planned)
    memories = calls.memories
    if memories:
        result.memory_per_rank = memory_estimate(memories, dp_shard=dp_shard, optimizer=optimizer)
        if any(m.with_prefetch for m in memories):
            result.memory_per_rank.total_prefetched = memory_estimate(memories, dp_shard=dp_shard, optimizer=optimizer,
                                                                      prefetch=True).total
        result.step_time = planned_step_time(result, memories, topology, dp_shard=dp_shard, optimizer=optimizer)


def _count(result: Plan, report, prefix: str, rank: int) -> None:
    """Add what one run of a graph sends, and its fallbacks, to ``result``."""
    for c in report.comms:
        result.collectives.append(Collective(c.kind, "sequence", prefix + c.node, c.phase, c.bytes_by_rank[rank],
                                             list(c.bytes_by_rank), c.formula, c.reason,
                                             "" if c.region is None else f"{prefix}region{c.region}"))
    result.fallbacks += [PlanFallback(prefix + f.node, f.op, f.reason) for f in report.fallbacks]
    for i, sent in report.recomputed.items():
        key = f"{prefix}region{i}"
        result.recomputed[key] = result.recomputed.get(key, 0) + sent


def _decisions(compiled, index: int, world: int, config: BackendConfig,
               topology: HardwareProfile) -> list[AttentionDecision]:
    out = []
    by_node = {a["node"]: a for a in compiled.report.attention}
    layer = 0
    for fam in compiled.families.families:
        for node in fam.attention_nodes:
            shape = attention_shape(node, fam.length)
            costs = attention_costs(shape, world, topology, hybrid_possible=True, memory_budget=config.memory_budget,
                                    head_chunks=config.head_chunks)
            decided = by_node.get(node.name, {})
            strategy = decided.get("strategy", compiled.strategies.get(node, "?"))
            dense = node.meta.get(DENSE_MASK)
            # the rewrite's reason where it did not distribute the attention as the strategy pass chose
            reason = decided.get("reason") or compiled.reasons.get(node, "")
            if dense is not None and (dense.unknown_buffers or dense.reason not in reason):
                # an unknown mask is not one that is "not causal / window / ...": its own reason
                reason = dense.reason if dense.unknown_buffers or not reason else f"{reason}: {dense.reason}"
            mask = ", ".join([k if k != "chunk" else f"chunk {decided[k]}"
                              for k in MASK_TERMS if decided.get(k)]
                             + ([] if dense is None else ["unknown" if dense.unknown_buffers else "dense"])) or "none"
            out.append(AttentionDecision(
                node=f"g{index}.{node.name}", layer=layer, strategy=strategy, layout=decided.get("layout", "-"),
                reason=reason, mask=mask,
                shape={"B": shape.batch, "S": shape.seq, "H": shape.heads, "Hkv": shape.kv_heads, "D": shape.head_dim,
                       "Dv": shape.dv, "dtype": str(shape.dtype).replace("torch.", "")},
                costs=[{k: v for k, v in asdict(c).items() if k != "mesh"} | {"mesh": list(c.mesh) if c.mesh else None}
                       for c in costs],
                positions={"causal": shape.mask.causal,
                           "window": list(shape.mask.window_arg) if shape.mask.window_arg else None,
                           "chunk": shape.mask.chunk},
                lengths=dict(_lengths(shape, strategy, decided.get("layout"), world, topology, config))))
            layer += 1
    return out


@functools.lru_cache(maxsize=64)  # the layers of a model share a few shapes; each probe prices ~80 lengths
def _lengths(shape: AttentionShape, strategy: str, layout: str | None, world: int, topology: HardwareProfile,
             config: BackendConfig) -> dict:
    """The lengths one compilation of a graph of symbolic lengths serves for this attention, as the plan shows them
    (:attr:`AttentionDecision.lengths`; the cost model's :func:`~autoshard.strategy.length_class`, cut at the
    zigzag layout's two chunks per rank and, with a memory budget, at this length, as the backend bounds a class);
    empty where the cost model did not choose its strategy (the strategy option, an attention run whole or on
    gathered keys)."""
    if config.strategy != "auto" or strategy not in STRATEGIES:
        return {}
    decide = deciding(shape, world, topology, config, hybrid_possible=True)
    try:
        if STRATEGIES[decide(shape.seq)[0].strategy].algorithm != STRATEGIES[strategy].algorithm:
            return {}
    except ValueError:  # nothing fits at this length (the memory budget): ran as the budget's policy chose
        return {}
    lengths = length_class(shape.seq, decide)
    low, below, high, above = lengths.low, lengths.below, lengths.high, lengths.above
    if layout == "zigzag" and low < 2 * world:  # shorter, the family is laid out contiguously
        low, below = 2 * world, f"{STRATEGIES[strategy].on_layout('contiguous').name} on the contiguous layout"
    if config.memory_budget is not None and high > shape.seq:  # what fits here fits shorter lengths only
        high, above = shape.seq, "the memory policy decides again"
    return {"low": low, "high": high if high < LONGEST else None, "below": below, "above": above}


def _documents_ratio(result: Plan, topology: HardwareProfile) -> float:
    """What the packed documents make of the attention's priced compute: the busiest rank's visible pairs (as the
    strategy dispatches them, :attr:`Plan.documents`) over what the cost model charged without the documents (a
    whole causal sequence, times the strategy's typical imbalance)."""
    decided = next(a for a in result.attention if "segment_ids" in a.mask.split(", "))
    shape, world = decided.shape, result.world_size
    whole = AttentionShape(batch=shape["B"], seq=shape["S"], heads=shape["H"], kv_heads=shape["Hkv"],
                           head_dim=shape["D"], dtype=getattr(torch, shape["dtype"]), mask=MaskSpec(causal=decided.positions["causal"]),
                           value_head_dim=shape["Dv"] if shape["Dv"] != shape["D"] else 0)
    mean = attention_seconds(whole, topology) / world
    charged = next(c["compute_s"] for c in decided.costs if c["strategy"] == decided.strategy)
    work = result.documents["work"]
    pairs = whole.flops() / (2.0 * shape["H"] * whole.kv_dims) / world  # the mean visible pairs of the whole sequence
    busiest = max(max(work), sum(work) / len(work) * topology.slowdown(world))
    return mean * busiest / pairs / charged


def _documents(result: Plan, position_ids) -> dict:
    """The attention work per rank of packed documents (:attr:`Plan.documents`), from concrete ``position_ids`` whose
    restarts at 0 begin the documents (transformers' packing), for the first attention that reads segment ids."""
    decided = next((a for a in result.attention if "segment_ids" in a.mask.split(", ")), None)
    if (decided is None or not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
            or position_ids.is_meta or isinstance(position_ids, FakeTensor) or decided.layout == "-"):
        return {}
    ids = _segment_ids(position_ids, decided.shape["B"])
    if ids.size(1) != decided.shape["S"]:
        return {}
    (layout, placed), spec = _placed(result, decided, ids), _spec(decided)
    dispatched = balance(layout, ids, spec)
    heads = decided.shape["H"]
    if decided.strategy == "allgather":
        work = dispatched.work
    elif decided.strategy in ("ulysses", "hybrid"):  # every rank: all positions, its share of the heads
        work = tuple(sum(dispatched.work) * h // heads for h in split_sizes(heads, result.world_size))
    else:
        work = dispatched.owner_work
    mean = sum(work) / len(work)
    out = {"documents": int(ids[:, -1].sum()), "work": list(work), "laid_out": list(dispatched.owner_work),
           "imbalance": max(work) / mean if mean else 1.0,
           "laid_out_imbalance": max(dispatched.owner_work) / (sum(dispatched.owner_work) / len(work)) if mean else 1.0}
    if decided.strategy == "allgather":
        fetch = key_fetch(layout, ids, spec, dispatched)
        out.update(key_rows=list(fetch.rows), gathered_rows=(layout.world_size - 1) * layout.max_local_length,
                   keys_fetched=fetch.worth_it, placed=placed, tokens=list(layout.local_lengths))
    return out


def _placed(result: Plan, decided: AttentionDecision, ids: torch.Tensor) -> tuple[SequenceLayout, bool | None]:
    """The layout the run gives the documents ``ids`` of the attention ``decided``, and whether it placed them by
    their lengths (:mod:`~autoshard.runtime.placement`; None: not considered). Considered where every attention that
    reads them all-gathers over one layout and the batch is one row; placed where that sends less."""
    root = SequenceLayout.of(decided.layout, ids.size(1), result.world_size)
    readers = {(a.strategy, a.layout) for a in result.attention if "segment_ids" in a.mask.split(", ")}
    if not document_placement.PLACE or readers != {("allgather", decided.layout)} or ids.size(0) != 1:
        return root, None
    shape = decided.shape
    placement = Placement.of(Documents(decided.layout, result.world_size, _spec(decided),
                                       key_row=shape["Hkv"] * (shape["D"] + shape["Dv"]),
                                       query_row=shape["H"] * shape["D"], result_row=shape["H"] * (shape["Dv"] + 1)),
                             ids)
    return (root, False) if placement is None else (placement.layout, True)


def _segment_ids(position_ids: torch.Tensor, batch: int) -> torch.Tensor:
    """The documents' segment ids ``[batch, S]`` of ``position_ids`` (:func:`~autoshard.runtime.placement.
    segments_of`: transformers' rule)."""
    ids = segments_of(position_ids)
    return ids.expand(batch, -1) if ids.size(0) == 1 else ids


def _spec(decided: AttentionDecision) -> MaskSpec:
    return MaskSpec.of(decided.positions["causal"], decided.positions["window"], decided.positions["chunk"])


def _documents_traffic(result: Plan, position_ids: torch.Tensor, topology: HardwareProfile) -> None:
    """The traffic of the all-gather attentions that read the documents, as they send it for this batch, exactly,
    every rank's: the masks all-gathered; the keys fetched by visibility
    (:meth:`~autoshard.runtime.attention.visible_keys.KeyFetch.bytes_by_rank`: K and V rows, backward again and their
    gradients back) or all-gathered when too many would move; the dispatched queries and their results
    (:meth:`~autoshard.runtime.attention.dispatch.Dispatch.bytes_by_rank`). The step time takes the change of the
    busiest rank's bytes over the link as exposed communication (the dispatch runs before the compute it feeds)."""
    decided = {a.node: a for a in result.attention if "segment_ids" in a.mask.split(", ") and a.strategy == "allgather"}
    change = {"keys": 0.0, "dispatch": 0.0}
    forward = 0.0
    placed: dict[tuple, tuple] = {}  # (layout, batch, spec) -> (dispatch, fetch): every layer reads the same documents
    for n, c in enumerate(result.collectives):
        a = decided.get(c.node)
        if a is None or c.kind != "allgather":
            continue
        shape = a.shape
        ids = _segment_ids(position_ids, shape["B"])
        (layout, _), spec = _placed(result, a, ids), _spec(a)
        key = (layout, shape["B"], spec)
        if key not in placed:
            dispatched = balance(layout, ids, spec)
            placed[key] = dispatched, key_fetch(layout, ids, spec, dispatched)
        dispatched, fetch = placed[key]
        recomputed = bool(c.region)  # a checkpointed forward run again in the backward
        backward = c.phase == "backward" and not recomputed
        sizes = dict(B=shape["B"], H=shape["H"], Hkv=shape["Hkv"], D=shape["D"], Dv=shape["Dv"],
                     dtype=getattr(torch, shape["dtype"]))
        size = Sizes.of(**sizes)
        by_rank = list(c.bytes_by_rank)
        if fetch.worth_it:  # the K/V all-gather (and reduce-scatter) replaced by the fetch
            keys = bytes_sent_by_rank("allgather", "backward" if backward else "forward", layout.local_lengths,
                                      **sizes)  # K, V and no mask
            row = size.B * size.Hkv * (size.D + size.Dv)
            fetched = fetch.bytes_by_rank(row * size.e, row * size.a, backward)
            by_rank = [t - k + f for t, k, f in zip(by_rank, keys, fetched)]
        change["keys"] += (max(by_rank) - max(c.bytes_by_rank)) / topology.bandwidth(result.world_size)
        heads = size.B * size.H
        query_row = heads * ((size.D + 2 * size.Dv) * size.e + size.a) if backward else heads * size.D * size.e
        moved = dispatched.bytes_by_rank(query_row, heads * (size.Dv + 1) * size.a, backward, heads * size.D * size.e)
        with_moves = [t + d for t, d in zip(by_rank, moved)]
        change["dispatch"] += (max(with_moves) - max(by_rank)) / topology.bandwidth(result.world_size)
        forward += 0.0 if c.phase == "backward" else (max(with_moves) - max(c.bytes_by_rank)) / topology.bandwidth(
            result.world_size)
        by_rank = with_moves
        if recomputed:
            result.recomputed[c.region] += by_rank[result.rank] - c.bytes_by_rank[result.rank]
        result.collectives[n] = dataclasses.replace(
            c, bytes_by_rank=by_rank, bytes_per_rank=by_rank[result.rank], formula=None,
            reason=c.reason if recomputed else "packed documents' keys and dispatched queries, for this batch")
    if result.step_time is not None:
        result.step_time = result.step_time.attention_comm_added(sum(change.values()), forward)
    result.documents.update(keys_s=change["keys"], dispatch_s=change["dispatch"])
