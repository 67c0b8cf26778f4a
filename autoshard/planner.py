"""Dry-run plans: what the compiler will do, what it will move, and what it will hold -- without GPUs.

    plan = autoshard.plan(model, (input_ids,), world_size=64)      # the model and inputs may be on meta
    print(plan)                                                    # summary, then one row per layer
    plan.attention[0].strategy, plan.attention[0].costs, plan.attention[0].reason
    sum(c.bytes_per_rank for c in plan.collectives)                # what rank 0 sends, forward + backward
    plan.memory_per_rank.total, plan.memory_per_rank.formula
    Plan.from_json(plan.to_json()) == plan;  plan.to_dot()

How: dynamo captures the model's graphs (meta tensors as fake ones: nothing is computed), the compiler's passes
run for one rank of a *plan group* (a stand-in with a rank and a size; nothing communicates), every
collective the rewrite emits is recorded with every rank's bytes and a sympy formula
(:mod:`autoshard.passes.comms`), the per-rank graph runs forward on fake tensors under autograd's
saved-tensor hooks to measure what it keeps for backward, and the cost model
(:mod:`autoshard.cost`) prices every attention strategy on the given topology.

A model built on the meta device plans as it runs, called as its users call it (transformers' models with
their defaults: a ``DynamicCache`` built and returned): its meta tensors are captured as fake CPU tensors
(:func:`_meta_as_fake` says why), so its graphs are the graphs of a run. What only values say is not guessed:
a mask computed from a meta buffer (nanoGPT's ``bias``) is planned ``unknown`` -- as a dense mask, never as
causal -- and its reason names the buffer; plan the model on the CPU to read it.

Memory per rank = parameters + their gradients + saved activations (exactly what autograd keeps, by
storage) + outputs held by the caller + a transient term (twice the largest saved activation: the
backward of the op that saved it holds its input gradient and output gradient at once).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from .config import BackendConfig
from .cost import Topology, attention_costs
from .passes.capture import DENSE_MASK
from .passes.graph import keep_real_values
from .runtime.attention import formulas
from .runtime.groups import plan_group_name
from .strategy import attention_shape

__all__ = ["Plan", "AttentionDecision", "Collective", "MemoryEstimate", "PlanFallback", "plan", "plan_graph",
           "plan_graphs"]


MASK_TERMS = ("causal", "window", "chunk", "key_mask", "segment_ids", "alibi", "position_bias", "dropout")
"""The keys of an attention report that the plan's mask column names, in order."""


@dataclass
class AttentionDecision:
    """How one attention call is distributed, and why."""

    node: str
    layer: int
    strategy: str
    layout: str
    reason: str
    mask: str
    """What structures the mask (``causal``, ``window``, ``chunk C``, ``key_mask``, ``segment_ids``) and the score
    terms the distributed op adds (``alibi``, ``position_bias``, ``dropout``), ``dense`` (kept whole), ``unknown`` (computed from buffers whose values a plan on the meta device does not have; planned
    dense), or ``none``."""
    shape: dict
    """B, S, H, Hkv, D (query/key head dim), Dv (value head dim), dtype."""
    costs: list[dict]
    """Every strategy's estimated cost (:class:`~autoshard.cost.StrategyCost` fields)."""


@dataclass
class Collective:
    """One collective, in one direction."""

    kind: str
    group: str
    node: str
    phase: str
    bytes_per_rank: int
    """Bytes the plan's rank sends."""
    bytes_by_rank: list[int]
    formula: Any
    """Bytes per rank as a sympy expression of S, P, B, H, Hkv, D (None where only the count is exact)."""
    reason: str = ""


@dataclass
class MemoryEstimate:
    """Peak bytes on the plan's rank during forward + backward."""

    parameters: int
    gradients: int
    saved_activations: int
    outputs: int
    transient: int
    total: int
    formula: Any
    """``total`` as a sympy expression in S and P (activations scale with ceiling(S/P))."""


@dataclass
class PlanFallback:
    node: str
    op: str
    reason: str


@dataclass
class Plan:
    """What autoshard will do on ``world_size`` ranks (seen from ``rank``)."""

    world_size: int
    rank: int
    topology: dict
    symbols: dict[str, int]
    """The sizes the formulas' symbols stand for."""
    attention: list[AttentionDecision] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    memory_per_rank: MemoryEstimate | None = None
    fallbacks: list[PlanFallback] = field(default_factory=list)
    placements: dict[str, str] = field(default_factory=dict)
    """Graph value (``g<i>.<name>``) -> placement (``S(1)``, ``R``, ``P(sum)``)."""
    graphs: int = 0
    edges: list[list[str]] = field(default_factory=list)
    """Data flow between the values of ``placements`` (for :meth:`to_dot`)."""
    recomputed: dict[str, int] = field(default_factory=dict)
    """Checkpointed region (``g<i>.region<j>``) -> bytes the plan's rank sends again when backward recomputes
    it (the whole region reruns, its collectives too; they are among ``collectives``, phase backward)."""
    losses: dict[str, int] = field(default_factory=dict)
    """LM heads and their cross-entropies: ``chunked`` (made one chunked op, ``chunk_loss``) and ``unchunked`` (left
    as they are: their logits have another use, such as being returned, or the pattern does not fit)."""

    # ------------------------------------------------------------------ reading
    def bytes_sent(self, phase: str | None = None, rank: int | None = None) -> int:
        """Total bytes ``rank`` (default: the plan's) sends, in ``phase`` or both."""
        r = self.rank if rank is None else rank
        return sum(c.bytes_by_rank[r] for c in self.collectives if phase is None or c.phase == phase)

    def __str__(self) -> str:
        mem = self.memory_per_rank
        split = sum(1 for p in self.placements.values() if p.startswith("S"))
        strategies = sorted({a.strategy for a in self.attention})
        lines = [
            f"autoshard plan: {self.world_size} ranks, {self.graphs} graph(s), seen from rank {self.rank}",
            "  sizes: " + ", ".join(f"{k}={v:,}" for k, v in self.symbols.items()),
            f"  {split} of {len(self.placements)} values split along the sequence; {len(self.attention)} attention "
            f"call(s) via {', '.join(strategies) or 'none'}; {len(self.fallbacks)} fallback(s)",
            f"  sends per rank per step: forward {_size(self.bytes_sent('forward'))}, backward "
            f"{_size(self.bytes_sent('backward'))}",
        ]
        if mem is not None:
            lines.append(f"  memory per rank: {_size(mem.total)} (parameters {_size(mem.parameters)}, gradients "
                         f"{_size(mem.gradients)}, saved activations {_size(mem.saved_activations)}, outputs "
                         f"{_size(mem.outputs)}, transient {_size(mem.transient)})")
            if mem.outputs > mem.saved_activations:
                lines.append("  note: most of it is outputs gathered whole on every rank (the logits?); "
                             "outputs='split' (the default) keeps them split")
        if self.recomputed:
            lines.append(f"  activation checkpointing: {len(self.recomputed)} region(s) recomputed whole in backward, "
                         f"their collectives included ({_size(sum(self.recomputed.values()))} sent again per rank)")
        if self.losses.get("chunked"):
            lines.append(f"  LM head + cross-entropy: {self.losses['chunked']} chunked over the rank's tokens "
                         f"(chunk_loss): the [tokens, vocab] logits are never whole")
        if self.losses.get("unchunked"):
            lines.append(f"  cross-entropy: {self.losses['unchunked']} not chunked (its input has another use, such as "
                         f"logits the model returns, or it is no LM head): the logits are held whole on the rank's "
                         f"tokens (in saved activations and outputs above)")
        if self.attention:
            lines.append(f"  why: {self.attention[0].reason}")
        for f in self.fallbacks:
            lines.append(f"  fallback: {f.node} ({f.op}): {f.reason}")
        lines.append("")
        lines.append(f"  {'layer':>5}  {'attention':<26} {'strategy':<10} {'layout':<11} {'mask':<22} "
                     f"{'fwd MiB':>9} {'bwd MiB':>9}")
        per_node = {}
        for c in self.collectives:
            per_node.setdefault((c.node, c.phase), 0)
            per_node[(c.node, c.phase)] += c.bytes_by_rank[self.rank]
        for a in self.attention:
            lines.append(f"  {a.layer:>5}  {a.node:<26} {a.strategy:<10} {a.layout:<11} {a.mask:<22} "
                         f"{per_node.get((a.node, 'forward'), 0) / 2**20:>9.2f} "
                         f"{per_node.get((a.node, 'backward'), 0) / 2**20:>9.2f}")
        others = [c for c in self.collectives if c.node not in {a.node for a in self.attention}]
        if others:
            lines.append("")
            lines.append(f"  {'other collectives':<40} {'kind':<15} {'phase':<9} {'bytes/rank':>14}")
            for c in others:
                lines.append(f"  {c.node[:40]:<40} {c.kind:<15} {c.phase:<9} {c.bytes_by_rank[self.rank]:>14,}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ serialization
    def to_json(self) -> str:
        """Deterministic JSON (sorted keys; formulas as sympy strings)."""
        data = asdict(self)
        for c in data["collectives"]:
            c["formula"] = None if c["formula"] is None else sympy.srepr(c["formula"])
        if data["memory_per_rank"] is not None:
            data["memory_per_rank"]["formula"] = sympy.srepr(data["memory_per_rank"]["formula"])
        return json.dumps(data, sort_keys=True, indent=1)

    @staticmethod
    def from_json(text: str) -> "Plan":
        data = json.loads(text)
        data["attention"] = [AttentionDecision(**a) for a in data["attention"]]
        data["collectives"] = [Collective(**{**c, "formula": None if c["formula"] is None else sympy.sympify(c["formula"])})
                               for c in data["collectives"]]
        if data["memory_per_rank"] is not None:
            m = data["memory_per_rank"]
            data["memory_per_rank"] = MemoryEstimate(**{**m, "formula": sympy.sympify(m["formula"])})
        data["fallbacks"] = [PlanFallback(**f) for f in data["fallbacks"]]
        return Plan(**data)

    def to_dot(self) -> str:
        """Graphviz of the values coloured by placement (split blue, whole grey, partial orange) and the
        attention calls (red)."""
        colours = {"S": "lightblue", "R": "lightgrey", "P": "orange"}
        attention = {a.node for a in self.attention}
        lines = ["digraph autoshard_plan {", "  rankdir=TB; node [shape=box, style=filled, fontsize=9];"]
        for name, placement in self.placements.items():
            colour = "tomato" if name.split(".", 1)[-1] in attention else colours.get(placement[0], "white")
            lines.append(f'  "{name}" [label="{name}\\n{placement}", fillcolor={colour}];')
        for a, b in self.edges:
            lines.append(f'  "{a}" -> "{b}";')
        lines.append("}")
        return "\n".join(lines)


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{int(nbytes)} B"


# ============================================================================= building


@contextlib.contextmanager
def _meta_as_fake(model: torch.nn.Module, args: tuple, kwargs: dict):
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


def _capture(model, args: tuple, kwargs: dict) -> list[tuple[fx.GraphModule, list, list]]:
    """Dynamo's graphs of ``model(*args, **kwargs)``, each with its example inputs and, per input, the (graph,
    output position) that produced it, or None: a value one graph returns and the next takes (a graph break)
    is the same tensor object. Meta tensors are captured as fake CPU tensors (:func:`_meta_as_fake`): nothing
    is computed."""
    graphs = []
    produced: dict[int, tuple[int, int]] = {}
    alive: list = []  # the outputs seen, so that their ids stay theirs during the capture

    with _meta_as_fake(model, args, kwargs) as (running, args, kwargs):
        def grab(gm, example_inputs):
            keep_real_values(gm, example_inputs)  # dynamo drops them when this returns; masks may read buffers
            index = len(graphs)
            graphs.append((gm, list(example_inputs), [produced.get(id(x)) for x in example_inputs]))

            def run(*inputs):
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
        with torch._dynamo.config.patch(recompile_limit=1 << 30, accumulated_recompile_limit=1 << 30):
            torch.compile(model, backend=grab, dynamic=False)(*args, **kwargs)
    if not graphs:
        raise RuntimeError("autoshard.plan: dynamo captured no graph of the model (it ran eagerly); nothing to plan")
    return graphs


def _carried(sources: list, carried_outputs: dict, example_inputs: list, rank: int) -> tuple[dict, list]:
    """What a graph takes split from earlier graphs (``outputs="split"``): (placeholder index -> Shard, the example
    inputs with those at this rank's local shape)."""
    shards = {i: carried_outputs[src] for i, src in enumerate(sources) if src is not None and src in carried_outputs}
    local = [x.new_empty(shards[i].local_shape(tuple(x.shape), rank)) if i in shards else x
             for i, x in enumerate(example_inputs)]
    return shards, local


def _memory(compiled, example_inputs: list, world: int, root_length: int) -> tuple[MemoryEstimate, Any]:
    """Run the per-rank graph forward on fake tensors and count what autograd saves (see the module
    docstring); returns the estimate and the formula of its sequence-dependent part."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    params = [x for x, orig in zip(inputs, example_inputs) if isinstance(orig, torch.nn.Parameter)]
    param_storages = {p.untyped_storage()._cdata for p in params}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in param_storages:
            saved[storage._cdata] = storage.nbytes()
        return t

    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = compiled.graph_module(*inputs)
    out_bytes = sum(t.untyped_storage().nbytes() for t in torch.utils._pytree.tree_leaves(outputs)
                    if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in saved)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    activations = sum(saved.values())
    transient = 2 * max(saved.values(), default=0)
    local = -(-root_length // world)
    per_position = sympy.Rational(activations + out_bytes + transient, max(local, 1))
    estimate = MemoryEstimate(param_bytes, grad_bytes, activations, out_bytes, transient,
                              param_bytes + grad_bytes + activations + out_bytes + transient, None)
    return estimate, per_position * sympy.ceiling(formulas.S / formulas.P)


def _decisions(compiled, index: int, world: int, config: BackendConfig, topology: Topology) -> list[AttentionDecision]:
    out = []
    by_node = {a["node"]: a for a in compiled.report.attention}
    layer = 0
    for fam in compiled.families.families:
        for node in fam.attention_nodes:
            shape = attention_shape(node, fam.length)
            costs = attention_costs(shape, world, topology, hybrid_possible=True, memory_budget=config.memory_budget)
            decided = by_node.get(node.name, {})
            strategy = decided.get("strategy", compiled.strategies.get(node, "?"))
            dense = node.meta.get(DENSE_MASK)
            # the rewrite's reason where it did not distribute the attention as the strategy pass chose
            reason = decided.get("reason") or compiled.reasons.get(node, "")
            if dense is not None:  # an unknown mask is not one that is "not causal / window / ...": its own reason
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
                       for c in costs]))
            layer += 1
    return out


def plan_graphs(graphs: list[tuple], *, world_size: int, config: BackendConfig, rank: int = 0) -> Plan:
    """The plan of already-captured dynamo graphs (what ``backend(..., dry_run=True)`` prints): (graph, example
    inputs) or, from :func:`_capture`, (graph, example inputs, the earlier output each input is). With
    ``outputs="split"`` a graph takes the values an earlier graph leaves split still split, as the run does."""
    from .compiler import compile_graph

    topology = config.topology or Topology()
    result = Plan(world_size=world_size, rank=rank, topology=asdict(topology), symbols={})
    symbols: dict[str, int] = {"P": world_size}
    memories = []
    carried_outputs: dict[tuple[int, int], Any] = {}  # (graph, output position) -> Shard it leaves split in
    for index, (gm, example_inputs, *sources) in enumerate(graphs):
        shards, example_inputs = _carried(sources[0] if sources else [None] * len(example_inputs),
                                             carried_outputs, example_inputs, rank)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        names = {placeholders[i].name: shard for i, shard in shards.items()}
        compiled = compile_graph(gm, config=config, rank=rank, world=world_size,
                                 group=plan_group_name(rank, world_size), topology=topology, planning=True,
                                 sharded_inputs=names or None, carried_inputs=set(names) or None)
        carried_outputs.update({(index, position): shard for position, shard in compiled.carried_outputs.items()})
        report = compiled.report
        prefix = f"g{index}."
        result.placements.update({prefix + k: v for k, v in report.placements.items()})
        result.edges += [[prefix + i.name, prefix + n.name] for n in gm.graph.nodes for i in n.all_input_nodes
                         if n.name in report.placements and i.name in report.placements]
        for c in report.comms:
            result.collectives.append(Collective(c.kind, "sequence", prefix + c.node, c.phase, c.bytes_by_rank[rank],
                                                 list(c.bytes_by_rank), c.formula, c.reason))
        result.fallbacks += [PlanFallback(prefix + f.node, f.op, f.reason) for f in report.fallbacks]
        result.recomputed.update({f"{prefix}region{i}": sent for i, sent in report.recomputed.items()})
        chunking = report.passes.get("chunking")
        for key, count in (chunking.counts.items() if chunking is not None else ()):
            name = key.removesuffix("_losses")
            result.losses[name] = result.losses.get(name, 0) + count
        decisions = _decisions(compiled, index, world_size, config, topology)
        result.attention += decisions
        if decisions and "S" not in symbols:
            symbols.update({k: v for k, v in decisions[0].shape.items() if k != "dtype"})
        root = compiled.families.families[0].length if compiled.families.families else 1
        memories.append(_memory(compiled, example_inputs, world_size, root))
    result.graphs = len(graphs)
    result.symbols = symbols
    if memories:  # graphs run one after the other: parameters once, activations add up
        first = memories[0][0]
        activations = sum(m.saved_activations for m, _ in memories)
        outputs = sum(m.outputs for m, _ in memories)
        transient = max(m.transient for m, _ in memories)
        total = first.parameters + first.gradients + activations + outputs + transient
        formula = first.parameters + first.gradients + sum(f for _, f in memories)
        result.memory_per_rank = MemoryEstimate(first.parameters, first.gradients, activations, outputs, transient,
                                                total, formula)
    return result


def plan_graph(gm: fx.GraphModule, example_inputs: list, *, world_size: int, config: BackendConfig) -> Plan:
    """The plan of one dynamo graph."""
    return plan_graphs([(gm, example_inputs)], world_size=world_size, config=config)


def plan(model: torch.nn.Module, args: tuple | torch.Tensor = (), kwargs: dict | None = None, *, world_size: int,
         config: BackendConfig | None = None, rank: int = 0, **overrides) -> Plan:
    """What ``torch.compile(model, backend=autoshard.backend(...))`` would do on ``world_size`` ranks.

    No process group is needed and nothing full-size is allocated when the model and the inputs are on
    the meta device. ``args``: the positional arguments (a lone tensor is one argument); ``config`` and
    ``overrides`` as in :func:`autoshard.backend`: a :class:`~autoshard.config.BackendConfig` (None: the
    defaults) and its fields set on top of it (``strategy="ring"``, ``topology=Topology(...)``)."""
    from .compiler import resolve_config

    config = resolve_config(config, overrides, "autoshard.plan")
    args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
    graphs = _capture(model, args, dict(kwargs or {}))
    return plan_graphs(graphs, world_size=world_size, config=config, rank=rank)
