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
(:mod:`autoshard.passes.comms`), the per-rank graph runs forward and backward on fake tensors to follow what it
holds, and the cost model
(:mod:`autoshard.cost`) prices every attention strategy on the given topology. The same fake run prices every op
on that hardware profile: the step's time, by layer (:mod:`autoshard.step_time`, ``plan(..., hardware="h100")``).

A model built on the meta device plans as it runs, called as its users call it (transformers' models with
their defaults: a ``DynamicCache`` built and returned): its meta tensors are captured as fake CPU tensors
(:func:`_meta_as_fake` says why), so its graphs are the graphs of a run. What only values say is not guessed:
a mask computed from a meta buffer (nanoGPT's ``bias``) is planned ``unknown`` -- as a dense mask, never as
causal -- and its reason names the buffer; plan the model on the CPU to read it.

Memory per rank is the peak of a simulated step, not a sum of worst cases. Each per-rank graph runs forward and
backward on fake tensors under a dispatch mode that follows every storage from the op that makes it to the moment
the last reference dies (:class:`_LiveBytes`: what a caching-free allocator holds -- the CPU's resident set, a
GPU's allocated bytes). What autograd saves, the gradients as they accumulate, the gradients of the activations,
what the caller holds (the outputs) and the temporaries of every op are all in it, at the moments they exist:

* activation checkpointing (``tag_activation_checkpoint``, non-reentrant): forward keeps the regions' inputs (the
  checkpoint holds them) and nothing inside; backward reruns one region at a time, so the peak is the kept inputs
  + the largest region's recomputed activations + its backward's gradients -- the simulation reruns the regions
  as the run does;
* ops whose fake implementation allocates only their outputs add their working set while they run
  (:data:`_WORKING_SETS`: the chunked LM head + loss holds a chunk's ``[tokens / chunks, V]`` values,
  :func:`~autoshard.runtime.chunked_loss.working_set_bytes`; a distributed attention its strategy's gathered or
  head-split copies and float32 accumulators, :attr:`~autoshard.runtime.attention.base.Strategy.working_set`);
* graphs run one after the other (graph breaks): graph ``g``'s forward runs on top of what the graphs before it
  keep, its backward on top of that and the gradients of the graphs after it;
* backward starts from what a training step differentiates: a graph that returns a loss (a differentiable
  scalar) is differentiated from its losses alone -- the logits, a KV cache and hidden states returned beside it
  are held, not differentiated (``loss.backward()``); a graph without one (a layer of several graphs) from every
  differentiable output, with the caller's gradient of each.

The breakdown (:class:`MemoryEstimate`) is the peak moment's live bytes by kind; a returned KV cache's keys and
values that autograd does not save (checkpointed layers: the attention's are recomputed) are a kind of their own,
named with its fix (``use_cache=False``; :mod:`autoshard.passes.lazy` says why they are not made lazy). Planning
options that the graphs do not show are arithmetic on top: ``dp_shard`` (FSDP2 shards parameters, gradients and
optimizer states over that many ranks, all-gathers one unit's parameters -- and prefetches the next -- and
reduce-scatters its gradients) and ``optimizer`` (its states, resident all step); see :func:`plan`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import re
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .config import BackendConfig, dynamo_settings, resolve_config
from .runtime.input_check import check_bytes, replicated_inputs
from .cost import AttentionShape, Topology, attention_costs, attention_seconds
from .hardware import hardware as resolve_hardware
from .passes.capture import DENSE_MASK
from .passes.deferred import inline_deferred
from .passes.graph import keep_real_values
from .passes.pipeline import compile_graph
from .policy import choose_memory_policy, chunk_tokens, format_bytes
from .runtime.attention import formulas
from .runtime.chunked_loss import working_set_bytes
from .runtime.offload import PlannedOffload, planned_offload
from .runtime.groups import SequenceGroups
from .strategy import attention_shape
from .runtime.attention.base import STRATEGIES
from .runtime.attention.dispatch import balance
from .runtime.attention.masks import MaskSpec
from .runtime.layouts import SequenceLayout, split_sizes
from .step_time import LayerTime, OpTimer, StepTime, attention_op_shape, run_timed, step_time

__all__ = ["Plan", "AttentionDecision", "Collective", "MemoryEstimate", "PlanFallback", "plan", "plan_graph",
           "plan_graphs"]


MASK_TERMS = ("causal", "window", "chunk", "key_mask", "segment_ids", "alibi", "position_bias", "dropout")
"""The keys of an attention report that the plan's mask column names, in order."""

OPTIMIZERS = (None, "adam", "adamw")
"""The optimizers whose states the memory estimate counts (:func:`plan`'s ``optimizer``)."""


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
    positions: dict = field(default_factory=dict)
    """The position mask: ``causal``, ``window`` (``[left, right]`` or None) and ``chunk`` (0: none)."""


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


@dataclass(kw_only=True)
class MemoryEstimate:
    """Peak bytes on the plan's rank during one training step (forward + backward; the optimizer's states are
    resident all along), by what they are at the peak moment: ``total`` is the sum of the byte fields."""

    parameters: int
    """The parameters the rank holds: all of them, or its ``1 / dp_shard`` shards under FSDP2."""
    gradients: int
    """Parameter gradients alive at the peak (backward makes them as it goes; a peak early in backward holds few),
    sharded like the parameters under FSDP2."""
    optimizer_states: int = 0
    """The optimizer's states of the rank's parameters (``optimizer="adamw"``: two float32 moments per parameter,
    and a float32 master copy of 16-bit parameters), sharded like them."""
    gathered_parameters: int = 0
    """FSDP2 (``dp_shard > 1``): the unsharded parameters of the two largest units, all-gathered at once (the one
    running and the one prefetched)."""
    unsharded_gradients: int = 0
    """FSDP2 (``dp_shard > 1``): the gradients of the unit being reduce-scattered, unsharded -- the gradients made
    by the peak, at most the largest unit's."""
    saved_activations: int
    """What forward saved for backward and is still held at the peak (checkpointed regions: their inputs; the
    graphs before a graph break: all they keep)."""
    kv_cache: int = 0
    """The keys and values of a returned KV cache (a call with transformers' default ``use_cache=True``) that the
    caller holds and autograd does not save: what ``use_cache=False`` removes."""
    outputs: int
    """Graph outputs the caller holds that autograd does not save (returned logits, a loss), but a KV cache."""
    transient: int
    """Everything else alive at the peak: gradients of activations, the activations a checkpointed region
    recomputes, the working set of the op that runs (a chunk of the chunked loss)."""
    total: int
    """The sum of the fields above: the rank's peak."""
    formula: Any
    """``total`` as a sympy expression in S and P: the activation terms scale with ceiling(S/P), the rest is
    fixed."""
    peak_at: str = ""
    """Where the peak is: the graph, the phase and the op that runs then (``g0 backward: aten.mm.default``)."""
    def describe(self) -> str:
        """``at its peak (<where>): <total> (<the terms>)``, and the fix of a returned KV cache."""
        terms = [("parameters", self.parameters), ("gradients", self.gradients),
                 ("optimizer states", self.optimizer_states), ("FSDP gathered parameters", self.gathered_parameters),
                 ("FSDP unsharded gradients", self.unsharded_gradients),
                 ("saved activations", self.saved_activations), ("returned KV cache", self.kv_cache),
                 ("outputs", self.outputs), ("transient", self.transient)]
        shown = [(name, value) for name, value in terms
                 if value or name in ("parameters", "gradients", "saved activations", "outputs", "transient")]
        cache = ("; the returned KV cache is every layer's keys and values (transformers' default use_cache=True), "
                 "held by the caller and not saved for backward: call the model with use_cache=False where the step "
                 "does not read it" if self.kv_cache else "")
        return (f"at its peak ({self.peak_at}): {format_bytes(self.total)} ("
                + ", ".join(f"{name} {format_bytes(value)}" for name, value in shown) + ")" + cache)

    host_offloaded: int = 0
    """Bytes of checkpointed layers' inputs kept in host memory from forward to backward, and of the hidden state
    lazy logits hold (``offload``): not in
    ``total`` (the simulation drops them when they are copied out and allocates them again when backward copies
    them back)."""
    host_prefetched: bool = False
    """Whether backward brings the offloaded inputs back a region ahead (``offload_prefetch``: the copies overlap
    compute; the region brought back early is in ``total``), or each when backward first uses it."""
    total_prefetched: int = 0
    """With offload: ``total`` were the copies back double-buffered, from the same simulation (what prefetching
    holds early counted in; ``total`` itself when the plan double-buffers), so the memory policy weighs both
    from one plan; 0 without offload."""


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
    """LM heads and their cross-entropies: ``chunked`` (made one chunked op, ``chunk_loss``), ``logits_kept`` (of
    those, heads kept for their logits' other use, such as being returned), ``lazy_logits`` (returned heads whose
    logits are computed when first read, ``lazy_logits``; counted unread) and ``unchunked`` (left as they are:
    the pattern does not fit)."""
    mlps: dict[str, int] = field(default_factory=dict)
    """Token-local MLP blocks: ``chunked`` (``chunk_mlp``: a chunk of the tokens at a time, each checkpointed) and
    ``unchunked``."""
    tiles: dict[str, int] = field(default_factory=dict)
    """Token-local regions (``tile_tokens``): ``regions`` tiled, ``tiles`` the checkpointed calls they make."""
    memory_policy: list[str] = field(default_factory=list)
    """With ``memory_budget``: per graph, what the memory policy weighed and chose (:mod:`autoshard.policy`)."""
    documents: dict = field(default_factory=dict)
    """Packed documents, when the inputs planned hold them (``position_ids`` restarting at 0, concrete values) and an
    attention reads segment ids: ``work`` (visible pairs per rank of one attention call as it will run),
    ``laid_out`` (the same as the layout places the queries), ``imbalance`` (max / mean of ``work``) and
    ``documents`` (how many, over the batch)."""
    step_time: StepTime | None = None
    """The step's predicted time on the plan's hardware (:mod:`autoshard.step_time`), by layer."""
    input_checks: dict[str, int] = field(default_factory=dict)
    """With ``inputs="replicated"`` and ``check_inputs`` (the defaults): graph call (``g<i>``, numbered by call) ->
    bytes the plan's rank sends checking that every rank passed the same inputs (:mod:`autoshard.runtime.
    input_check`: the accountant's ``"metadata"``, not in ``collectives``)."""

    # ------------------------------------------------------------------ reading
    @property
    def step_seconds(self) -> float | None:
        """The predicted seconds of one step (forward + backward, and the optimizer's when planned with one)."""
        return None if self.step_time is None else self.step_time.seconds

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
            f"  sends per rank per step: forward {format_bytes(self.bytes_sent('forward'))}, backward "
            f"{format_bytes(self.bytes_sent('backward'))}",
        ]
        if mem is not None:
            lines.append(f"  memory per rank {mem.describe()}")
            if 2 * mem.outputs > mem.total:
                lines.append("  note: most of it is outputs gathered whole on every rank (the logits?); "
                             "outputs='split' (the default) keeps them split")
        if self.recomputed:
            lines.append(f"  activation checkpointing: {len(self.recomputed)} region(s) recomputed whole in backward, "
                         f"their collectives included ({format_bytes(sum(self.recomputed.values()))} sent again "
                         f"per rank)")
        if mem is not None and mem.host_offloaded:
            lines.append(f"  offload: {format_bytes(mem.host_offloaded)} of checkpointed layer inputs"
                         + (" and lazy logits' hidden state" if self.losses.get("lazy_logits") else "")
                         + " wait in host memory until backward (not in the total above); "
                         + ("double-buffered: each layer's input comes back while the layer after it runs backward"
                            if mem.host_prefetched else "each comes back when backward uses it, compute waiting"))
        lines += [f"  {line}" for line in self.memory_policy]
        if self.losses.get("chunked"):
            kept = self.losses.get("logits_kept", 0) - self.losses.get("lazy_logits", 0)
            lines.append(f"  LM head + cross-entropy: {self.losses['chunked']} chunked over the rank's tokens "
                         f"(chunk_loss): the float32 [tokens, vocab] logits, softmax and gradient are never whole"
                         + (f"; {kept} head(s) also returning their logits: those stay, in the head's dtype "
                            f"(in outputs above)" if kept else ""))
        if self.losses.get("lazy_logits"):
            lines.append(f"  returned logits: {self.losses['lazy_logits']} LM head output(s) computed when first read "
                         f"(lazy_logits), counted unread: the rank holds their [tokens, hidden] input, not "
                         f"[tokens, vocab]")
        if self.losses.get("unchunked"):
            lines.append(f"  cross-entropy: {self.losses['unchunked']} not chunked (chunk_loss off, or it is no LM "
                         f"head): the logits are held whole on the rank's tokens (in saved activations and outputs "
                         f"above)")
        if self.mlps.get("chunked"):
            lines.append(f"  MLP blocks: {self.mlps['chunked']} chunked over the rank's tokens (chunk_mlp), each chunk "
                         f"recomputed in backward")
        if self.tiles.get("regions"):
            lines.append(f"  token-local regions: {self.tiles['regions']} tiled over the rank's tokens (tile_tokens: "
                         f"{self.tiles['tiles']} tiles), each tile recomputed in backward: norms, projections, "
                         f"residuals and MLPs never whole but their outputs")
        if self.documents:
            d = self.documents
            lines.append(f"  packed documents ({d['documents']}, from position_ids): attention work per rank (visible "
                         f"pairs of one call) {', '.join(f'{w:,}' for w in d['work'])}: max/mean "
                         f"{d['imbalance']:.2f} ({d['laid_out_imbalance']:.2f} as laid out)")
        if self.input_checks:
            lines.append(f"  replicated inputs checked on every call of {len(self.input_checks)} graph(s): "
                         f"{sum(self.input_checks.values()):,} B sent per rank per step (metadata; "
                         f"check_inputs=False skips it)")
        if self.step_time is not None:
            lines.append(f"  step time {self.step_time.describe()}")
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
        if self.step_time is not None and self.step_time.layers:
            lines.append("")
            lines.append(f"  {'step time by layer (ms)':<40} {'compute':>10} {'attention':>10} {'comm':>10} {'exposed':>10}")
            for row in self.step_time.layers:
                lines.append(f"  {row.layer[-40:]:<40} {row.compute_s * 1e3:>10.2f} {row.attention_s * 1e3:>10.2f} "
                             f"{row.comm_s * 1e3:>10.2f} {row.exposed_s * 1e3:>10.2f}")
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
        if data["step_time"] is not None:
            t = data["step_time"]
            data["step_time"] = StepTime(**{**t, "layers": [LayerTime(**row) for row in t["layers"]]})
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


def _capture(model, args: tuple, kwargs: dict, *, per_layer_graphs: bool = False) -> list[tuple]:
    """Dynamo's graphs of ``model(*args, **kwargs)``, one entry per *call* of a graph -- (graph, the call's inputs,
    per input the (call, output position) that produced it, or None): a value one call returns and a later one
    takes (a graph break) is the same tensor object; a graph dynamo runs again (FSDP2's one graph for every layer
    of a kind) is one entry per run, the same graph module. Meta tensors are captured as fake CPU tensors
    (:func:`_meta_as_fake`): nothing is computed. ``per_layer_graphs``: a graph break before and after every
    block of the model's layer lists, where FSDP2's hooks cut it (``fully_shard`` on every layer)."""
    calls = []
    produced: dict[int, tuple[int, int]] = {}
    alive: list = []  # the outputs seen, so that their ids stay theirs during the capture

    with _meta_as_fake(model, args, kwargs) as (running, args, kwargs), _cut_layers(model, per_layer_graphs):
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


def _carried(sources: list, carried_outputs: dict, example_inputs: list, rank: int) -> tuple[dict, list]:
    """What a graph takes split from earlier graphs (``outputs="split"``): (placeholder index -> Shard, the example
    inputs with those at this rank's local shape)."""
    shards = {i: carried_outputs[src] for i, src in enumerate(sources) if src is not None and src in carried_outputs}
    local = [x.new_empty(shards[i].local_shape(tuple(x.shape), rank)) if i in shards else x
             for i, x in enumerate(example_inputs)]
    return shards, local


def _inline_deferred(gm: fx.GraphModule, example_inputs: list, sources: list, deferred: dict) -> tuple:
    """What the run does with the values earlier graphs leave uncomputed (``deferred``: (graph, output position) ->
    (DeferredOutput, that graph's inputs, their sources)): the graph with their recipes inlined, its inputs and
    their sources with each such input replaced by the inputs its recipe reads
    (:func:`~autoshard.passes.deferred.inline_deferred`)."""
    taken = {i: deferred[src] for i, src in enumerate(sources) if src in deferred}
    if not taken:
        return gm, example_inputs, sources
    read = {i: ([inputs[j] for j in out.inputs] or [torch.empty(0)], [origins[j] for j in out.inputs] or [None])
            for i, (out, inputs, origins) in taken.items()}
    gm = inline_deferred(gm, {i: out.recipe for i, (out, _, _) in taken.items()}, {i: v for i, (v, _) in read.items()})
    flat_inputs, flat_sources = [], []
    for i, (x, src) in enumerate(zip(example_inputs, sources)):
        flat_inputs += read[i][0] if i in read else [x]
        flat_sources += read[i][1] if i in read else [src]
    return gm, flat_inputs, flat_sources


def _chunked_loss_working_set(args: tuple) -> int:
    """The chunked LM head + loss: a chunk's ``[tokens / chunks, V]`` values alive at once
    (:func:`~autoshard.runtime.chunked_loss.working_set_bytes`), forward or backward."""
    if len(args) == 11:  # forward: h, weight, bias, target, class_weight, ignore_index, smoothing, reduction, chunks,
        h, weight, chunks, out_dtype = args[0], args[1], args[8], args[9]  # out_dtype, grads
    else:  # backward: grad (out_dtype), h, weight, bias, target, class_weight, lse, ignore_index, smoothing, reduction,
        h, weight, chunks, out_dtype = args[1], args[2], args[10], args[0].dtype  # chunks
    rows = h.numel() // max(1, h.size(-1))
    return working_set_bytes(rows, weight.size(0), chunks, h.dtype, out_dtype)


def _attention_working_set(backward: bool) -> Callable[[tuple], int]:
    """A distributed attention: its strategy's working set (:attr:`~autoshard.runtime.attention.base.Strategy.
    working_set`: the gathered or head-split copies, the float32 accumulators), its head groups one at a time."""
    def working_set(args: tuple) -> int:
        shape, config = attention_op_shape(args, backward)
        world = SequenceLayout.decode(config.layout).world_size
        return STRATEGIES[config.strategy].working_set(shape, world, config.head_chunks, backward)

    return working_set


_WORKING_SETS: dict[Any, Callable[[tuple], int]] = {
    torch.ops.autoshard.linear_cross_entropy.default: _chunked_loss_working_set,
    torch.ops.autoshard.linear_cross_entropy_backward.default: _chunked_loss_working_set,
    torch.ops.autoshard.attention.default: _attention_working_set(False),
    torch.ops.autoshard.attention_backward.default: _attention_working_set(True),
}
"""Ops whose fake implementation allocates only their outputs -> the bytes the real op holds on top of its inputs
and outputs while it runs (from its arguments)."""


@dataclass(kw_only=True)
class _Peak:
    """One graph's peak in one phase, above the graph's inputs, by kind (as in :class:`MemoryEstimate`)."""

    saved: int = 0
    """Storages autograd saved in forward (outside checkpointed regions; the regions' inputs)."""
    kv_cache: int = 0
    """The keys and values of a returned KV cache, not saved."""
    outputs: int = 0
    """The graph's other outputs, not saved."""
    gradients: int = 0
    """The parameters' gradients."""
    transient: int = 0
    """The rest, and the working set of the op that runs."""
    op: str = ""
    """The op that ran at the peak."""

    @property
    def extra(self) -> int:
        """All of it."""
        return self.saved + self.kv_cache + self.outputs + self.gradients + self.transient


@dataclass(kw_only=True)
class _GraphMemory:
    """What one per-rank graph holds when it runs forward and backward alone (:func:`_memory`)."""

    parameters: dict[int, tuple[str, torch.Tensor]]
    """id of the parameter (the same object in every graph that takes it) -> (its placeholder's name, the
    parameter)."""
    gradients: set[int]
    """The ids of the parameters it makes gradients for."""
    held: int
    """Bytes its forward leaves alive above its inputs (saved for backward, outputs)."""
    held_cache: int
    """Of ``held``: a returned KV cache's keys and values, not saved."""
    forward: _Peak
    backward: _Peak
    local: int
    """This rank's tokens (the per-position scale of the activation terms)."""
    host: int = 0
    """Bytes of checkpointed regions' inputs offloaded to host memory (``offload``)."""
    prefetched: bool = False
    """Whether backward brings them back a region ahead (``offload_prefetch``): ``forward`` and ``backward`` then
    hold the region brought back early."""
    ahead: tuple[_Peak, _Peak] | None = None
    """With offload: the forward and backward peaks double-buffered (``forward`` and ``backward`` when
    ``prefetched``)."""
    timer: OpTimer | None = None
    """The time of its ops."""


class _LiveBytes(TorchDispatchMode):
    """Follows every storage the ops make from their call to the death of its last reference (a weak reference's
    callback), and the peak of their sum: after each op (its inputs and outputs both alive) plus the op's working
    set (:data:`_WORKING_SETS`). At each new peak the live storages are kept, to be sorted by kind afterwards. With
    ``offload``, a second peak adds what double-buffering would hold early (``offload.ahead``, counted as working
    set)."""

    def __init__(self, offload: PlannedOffload | None = None):
        super().__init__()
        self.offload = offload
        self.live: dict[int, tuple[int, int]] = {}  # storage address -> (serial, bytes)
        self.refs: dict[int, weakref.ref] = {}
        self.serial = 0
        self.total = 0
        self.phase = "forward"
        self.peaks: dict[str, tuple[int, dict[int, int], int, str]] = {}  # phase -> (bytes, serials, extra, op)
        self.peaks_ahead: dict[str, tuple[int, dict[int, int], int, str]] = {}  # the same, prefetch's bytes added

    def track(self, t: torch.Tensor) -> int:
        """Follow ``t``'s storage (once); returns its serial (addresses are reused, serials are not)."""
        st = t.untyped_storage()
        key = st._cdata
        if key not in self.live:
            self.serial += 1
            self.live[key] = (self.serial, st.nbytes())
            self.total += st.nbytes()

            def gone(_, key=key, serial=self.serial):
                if self.live.get(key, (None,))[0] == serial:
                    self.total -= self.live.pop(key)[1]
                    self.refs.pop(key, None)
            self.refs[key] = weakref.ref(st, gone)
        return self.live[key][0]

    def serial_of(self, t: torch.Tensor) -> int | None:
        """The serial of ``t``'s storage; None when it is not followed (a constant)."""
        entry = self.live.get(t.untyped_storage()._cdata)
        return None if entry is None else entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        extra = _WORKING_SETS[func](args) if func in _WORKING_SETS else 0
        snapshot = None
        both = ((self.peaks, extra),) + (((self.peaks_ahead, extra + self.offload.ahead),) if self.offload else ())
        for peaks, held in both:
            if self.total + held > peaks.get(self.phase, (-1,))[0]:
                snapshot = snapshot or dict(self.live.values())
                peaks[self.phase] = (self.total + held, snapshot, held, str(func))
        return out


def _fake_leaf(mode: FakeTensorMode, x: torch.Tensor) -> torch.Tensor:
    """``x`` in ``mode`` as a leaf: an input that an earlier graph computed (past a graph break) arrives with a
    gradient history that ends here -- backward stops at it, as it stops at the graph's boundary."""
    fake = mode.from_tensor(x)
    return fake.detach().requires_grad_() if fake.grad_fn is not None else fake


def _memory(compiled, example_inputs: list, world: int, root_length: int, topology: Topology,
            offload: bool = False, prefetch: bool = False) -> _GraphMemory:
    """Run the per-rank graph forward and backward on fake tensors (from its losses, or the caller's gradient of every
    differentiable output: ones; see the module docstring) and follow its live bytes (see the module docstring) and the time of its ops on ``topology``
    (:class:`~autoshard.step_time.OpTimer`)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [_fake_leaf(mode, x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    placeholders = [n.name for n in compiled.graph_module.graph.nodes if n.op == "placeholder"]
    parameters = {id(orig): (name, x) for name, x, orig in zip(placeholders, inputs, example_inputs)
                  if isinstance(orig, torch.nn.Parameter)}
    timer = OpTimer(topology, world)
    packed: set[int] = set()

    def pack(t):
        serial = live.serial_of(t)
        if serial is not None:
            packed.add(serial)
        return t

    with planned_offload() as host, mode, _LiveBytes(host if offload else None) as live, timer:
        for x in inputs:
            if isinstance(x, torch.Tensor):
                live.track(x)
        inputs_serials, base = {serial for serial, _ in live.live.values()}, live.total
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            results = run_timed(compiled.graph_module, inputs, timer)
            outputs = [t for t in tree_leaves(results) if isinstance(t, torch.Tensor)]
        # lazy logits (the head's input in their place): nobody reads them, so no gradient comes through them;
        # with offload the head's input waits in host memory (the device's copy dies with the output)
        unread = {id(results[i]) for i in compiled.lazy_outputs or ()}
        if offload and compiled.lazy_outputs:
            results = list(results)
            for i in compiled.lazy_outputs:
                host.host += results[i].numel() * results[i].element_size()
                results[i] = None
            outputs = [t for t in tree_leaves(results) if isinstance(t, torch.Tensor)]
        output_serials = {live.serial_of(t) for t in outputs}
        cache = {live.serial_of(results[i]): results[i].untyped_storage().nbytes()  # a returned KV cache's storages
                 for i in compiled.cache_outputs or ()}
        held = live.total - base
        live.phase = timer.phase = "backward"
        differentiable = [t for t in outputs if t.requires_grad and id(t) not in unread]
        losses = [t for t in differentiable if t.dim() == 0]
        differentiable = losses or differentiable
        if differentiable:
            torch.autograd.backward(differentiable, [torch.ones_like(t) for t in differentiable])
        grads = {live.serial_of(p.grad) for _, p in parameters.values() if p.grad is not None}

    def peak(peaks: dict, phase: str) -> _Peak:
        if phase not in peaks:
            return _Peak()
        _, serials, extra, op = peaks[phase]
        kinds = {"saved": 0, "kv_cache": 0, "outputs": 0, "gradients": 0, "transient": extra}
        for serial, nbytes in serials.items():
            if serial in inputs_serials:
                continue
            kind = ("gradients" if serial in grads else "saved" if serial in packed else "kv_cache" if serial in cache
                    else "outputs" if serial in output_serials else "transient")
            kinds[kind] += nbytes
        return _Peak(**kinds, op=op)

    peaks = live.peaks_ahead if offload and prefetch else live.peaks
    return _GraphMemory(parameters=parameters, gradients={i for i, (_, p) in parameters.items() if p.grad is not None},
                        held=held, held_cache=sum(n for serial, n in cache.items() if serial not in packed),
                        forward=peak(peaks, "forward"), backward=peak(peaks, "backward"),
                        local=-(-root_length // world), host=host.host, prefetched=offload and prefetch,
                        ahead=(peak(live.peaks_ahead, "forward"), peak(live.peaks_ahead, "backward"))
                        if offload else None,
                        timer=timer)


def _shard_bytes(p: torch.Tensor, shards: int) -> int:
    """Bytes of one FSDP2 shard of ``p`` (dim 0 cut into ``shards`` chunks, padded to equal size)."""
    if p.dim() == 0:
        return p.element_size()
    return -(-p.size(0) // shards) * (p.numel() // max(1, p.size(0))) * p.element_size()


_UNIT = re.compile(r"^(.*?_modules_\d+_)")
"""The FSDP2 unit a parameter's placeholder belongs to: its outermost numbered module (a block of the model's
layer list), or the root."""


def _estimate(memories: list[_GraphMemory], *, dp_shard: int, optimizer: str | None,
              ahead: bool = False) -> MemoryEstimate:
    """The step's peak from its graphs' (see the module docstring), with the FSDP2 and optimizer terms; ``ahead``:
    from the graphs' double-buffered peaks (:attr:`_GraphMemory.ahead`), where they offload."""
    parameters = _parameters(memories)
    full = sum(p.numel() * p.element_size() for _, p in parameters.values())
    candidates = []
    for g, m in enumerate(memories):
        before = sum(h.held for h in memories[:g])
        later = set().union(*(h.gradients for h in memories[g + 1:])) - m.gradients
        later_grads = sum(parameters[i][1].numel() * parameters[i][1].element_size() for i in later)
        forward, backward = m.ahead if ahead and m.ahead else (m.forward, m.backward)
        for phase, p, grads in (("forward", forward, 0), ("backward", backward, later_grads)):
            candidates.append((before + grads + p.extra, g, phase, p, before, grads))
    _, g, phase, p, before, later_grads = max(candidates, key=lambda c: c[0])
    gradients = p.gradients + later_grads
    sharded = sum(_shard_bytes(x, dp_shard) for _, x in parameters.values())
    gathered = unsharded_grads = 0
    if dp_shard > 1:
        largest = sorted(_units(parameters).values(), reverse=True)
        gathered = sum(largest[:2])
        unsharded_grads = min(gradients, largest[0])
        gradients = gradients * sharded // max(1, full)
    states = 0
    if optimizer is not None:
        for _, x in parameters.values():
            states += _shard_bytes(x, dp_shard) // x.element_size() * _state_bytes(x)
    cached = sum(h.held_cache for h in memories[:g])  # the graphs before it keep their returned caches too
    activations = p.saved + before + p.kv_cache + p.outputs + p.transient
    fixed = sharded + gradients + states + gathered + unsharded_grads
    local = next((m.local for m in memories if m.local > 0), 1)
    formula = fixed + sympy.Rational(activations, local) * sympy.ceiling(formulas.S / formulas.P)
    return MemoryEstimate(parameters=sharded, gradients=gradients, optimizer_states=states,
                          gathered_parameters=gathered, unsharded_gradients=unsharded_grads,
                          saved_activations=p.saved + before - cached, kv_cache=p.kv_cache + cached,
                          outputs=p.outputs, transient=p.transient,
                          total=fixed + activations, formula=formula, peak_at=f"g{g} {phase}: {p.op}",
                          host_offloaded=sum(m.host for m in memories),
                          host_prefetched=any(m.prefetched and m.host for m in memories))


def _decisions(compiled, index: int, world: int, config: BackendConfig, topology: Topology) -> list[AttentionDecision]:
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
                positions={"causal": shape.causal, "window": list(shape.window) if shape.window else None,
                           "chunk": shape.chunk}))
            layer += 1
    return out


def memory_policy_for(gm: fx.GraphModule, example_inputs: list, *, world_size: int, config: BackendConfig,
                      budget: int, host_budget: int | None = None, strict: bool = True, dp_shard: int = 1,
                      optimizer: str | None = None):
    """The memory policy's choice for one graph (:func:`autoshard.policy.choose_memory_policy`): each option's
    estimate is this graph's plan from rank 0 (a copy of ``gm``; the options as they are, no policy inside): its
    peak and its host bytes; the MLP chunks and tiles are sized from the rank's tokens (the sequence family the
    compile pipeline finds; :func:`autoshard.policy.chunk_tokens`). Returns (the chosen config, :class:`~autoshard.policy.MemoryPolicy`).
    When nothing fits, the error (or warning) ends with the smallest option's breakdown
    (:meth:`MemoryEstimate.describe`: a returned KV cache named with its fix)."""
    plans: dict[tuple, Plan] = {}  # the levers -> the plan: the options differ in these only

    def planned(option: BackendConfig) -> Plan:  # one plan for offload with and without prefetch: it has both peaks
        key = (option.chunk_mlp, option.tile_tokens, option.head_chunks, option.recompute, option.offload)
        if key not in plans:
            plans[key] = plan_graphs([(copy.deepcopy(gm), list(example_inputs))], world_size=world_size,
                                     config=dataclasses.replace(option, memory_budget=None, offload_prefetch=False),
                                     dp_shard=dp_shard, optimizer=optimizer)
        return plans[key]

    compiled = compile_graph(copy.deepcopy(gm), config=dataclasses.replace(config, memory_budget=None),
                             groups=SequenceGroups.planned(0, world_size), planning=True)
    families = compiled.families.families  # the rank's tokens, which size the chunks and tiles: no plan needed
    local = -(-families[0].length // world_size) if families else None

    def estimate(option: BackendConfig) -> tuple[int, int]:
        memory = planned(option).memory_per_rank
        ahead = option.offload and option.offload_prefetch
        return memory.total_prefetched if ahead else memory.total, memory.host_offloaded

    def held(option: BackendConfig) -> str:  # what the smallest option still holds: what a further lever must remove
        return f"The smallest option's memory per rank {planned(option).memory_per_rank.describe()}"

    return choose_memory_policy(config, estimate, budget=budget, host_budget=host_budget, strict=strict,
                                tokens=chunk_tokens(local), held=held)


def _check_planning_options(dp_shard: int, optimizer: str | None) -> None:
    if not isinstance(dp_shard, int) or dp_shard < 1:
        raise ValueError(f"autoshard.plan: dp_shard must be a positive int, got {dp_shard!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"autoshard.plan: optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")


def plan_graphs(graphs: list[tuple], *, world_size: int, config: BackendConfig, rank: int = 0, dp_shard: int = 1,
                optimizer: str | None = None) -> Plan:
    """The plan of already-captured dynamo graphs (what ``backend(..., dry_run=True)`` prints): (graph, example
    inputs) or, from :func:`_capture`, one entry per call (graph, its inputs, the earlier call output each input
    is). With ``outputs="split"`` a graph takes the values an earlier graph leaves split still split, as the run
    does. A graph called again is planned once and counted at every call (its collectives, its memory).
    ``dp_shard`` and ``optimizer``: as in :func:`plan`."""
    _check_planning_options(dp_shard, optimizer)

    topology = config.topology or Topology()
    result = Plan(world_size=world_size, rank=rank, topology=asdict(topology), symbols={})
    symbols: dict[str, int] = {"P": world_size}
    memories = []
    carried_outputs: dict[tuple[int, int], Any] = {}  # (call, output position) -> Shard it leaves split in
    deferred_outputs: dict[tuple[int, int], tuple] = {}  # (call, output position) -> (DeferredOutput, the producer's
    planned: dict[tuple, tuple] = {}  # (graph, what its inputs are) -> (index, compiled, decisions, memory, config)
    for call, (gm, example_inputs, *sources) in enumerate(graphs):  # inputs and their sources)
        sources = list(sources[0]) if sources else [None] * len(example_inputs)
        if config.inputs == "replicated" and config.check_inputs:
            checked = [i for i in replicated_inputs(example_inputs)
                       if sources[i] not in carried_outputs and sources[i] not in deferred_outputs]
            if checked:
                result.input_checks[f"g{call}"] = check_bytes(len(checked), world_size)
        kinds = tuple(str(carried_outputs[s]) if s in carried_outputs else
                      deferred_outputs[s][0].recipe.key if s in deferred_outputs else None for s in sources)
        again = planned.get((id(gm), kinds))
        if again is not None:  # the same graph run again with inputs of the same kinds: counted again
            index, compiled, decisions, memory, deferred = again
            carried_outputs.update({(call, position): shard for position, shard in compiled.carried_outputs.items()})
            deferred_outputs.update({(call, position): value for position, value in deferred.items()})
            _count(result, compiled.report, f"g{index}.", rank)
            result.attention += [dataclasses.replace(d) for d in decisions]
            memories.append(memory)
            continue
        index = len(planned)
        if any(key[0] == id(gm) for key in planned):
            gm = copy.deepcopy(gm)  # compiled once already (in place): this run's inputs differ
        gm, example_inputs, sources = _inline_deferred(gm, example_inputs, sources, deferred_outputs)
        graph_config = config
        if config.memory_budget is not None:
            graph_config, policy = memory_policy_for(gm, example_inputs, world_size=world_size, config=config,
                                                     budget=config.memory_budget, host_budget=config.host_budget,
                                                     dp_shard=dp_shard,
                                                     optimizer=optimizer)
            result.memory_policy.append(f"g{index} {policy.describe()}")
        whole_inputs = example_inputs
        shards, example_inputs = _carried(sources, carried_outputs, example_inputs, rank)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        names = {placeholders[i].name: shard for i, shard in shards.items()}
        compiled = compile_graph(gm, config=graph_config, groups=SequenceGroups.planned(rank, world_size),
                                 topology=topology, planning=True,
                                 sharded_inputs=names or None, carried_inputs=set(names) or None)
        carried_outputs.update({(call, position): shard for position, shard in compiled.carried_outputs.items()})
        deferred = {position: (out, whole_inputs, sources) for position, out in compiled.deferred_outputs.items()}
        deferred_outputs.update({(call, position): value for position, value in deferred.items()})
        report = compiled.report
        prefix = f"g{index}."
        result.placements.update({prefix + k: v for k, v in report.placements.items()})
        result.edges += [[prefix + i.name, prefix + n.name] for n in gm.graph.nodes for i in n.all_input_nodes
                         if n.name in report.placements and i.name in report.placements]
        _count(result, report, prefix, rank)
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
        decisions = _decisions(compiled, index, world_size, graph_config, topology)
        result.attention += decisions
        if decisions and "S" not in symbols:
            symbols.update({k: v for k, v in decisions[0].shape.items() if k != "dtype"})
        root = compiled.families.families[0].length if compiled.families.families else 1
        memories.append(_memory(compiled, example_inputs, world_size, root, topology, offload=graph_config.offload,
                                prefetch=graph_config.offload_prefetch))
        planned[(id(graphs[call][0]), kinds)] = (index, compiled, decisions, memories[-1], deferred)
    for layer, decision in enumerate(result.attention):
        decision.layer = layer
    result.graphs = len(planned)
    result.symbols = symbols
    if memories:
        result.memory_per_rank = _estimate(memories, dp_shard=dp_shard, optimizer=optimizer)
        if any(m.ahead for m in memories):
            result.memory_per_rank.total_prefetched = _estimate(memories, dp_shard=dp_shard, optimizer=optimizer,
                                                                ahead=True).total
        result.step_time = _step_time(result, memories, topology, dp_shard=dp_shard, optimizer=optimizer)
    return result


def _step_time(result: Plan, memories: list[_GraphMemory], topology: Topology, *, dp_shard: int,
               optimizer: str | None) -> StepTime:
    """The step's time on ``topology`` (:func:`autoshard.step_time.step_time`) from the timers of its graph calls
    and the plan's counts."""
    parameters = _parameters(memories)
    optimizer_bytes = 0
    if optimizer is not None:  # reads and writes the states and the parameters (or their master copies), reads the
        for _, x in parameters.values():  # gradients
            optimizer_bytes += _shard_bytes(x, dp_shard) // x.element_size() * (2 * _state_bytes(x) + 3 * x.element_size())
    symbols = result.symbols
    return step_time([m.timer for m in memories], topology=topology, world=result.world_size,
                     tokens=symbols.get("B", 1) * symbols.get("S", 0), collectives=result.collectives,
                     attention_nodes={a.node for a in result.attention},
                     fsdp=list(_units(parameters).values()) if dp_shard > 1 else None, dp_shard=dp_shard,
                     host_bytes=result.memory_per_rank.host_offloaded,
                     host_hidden=result.memory_per_rank.host_prefetched, optimizer_bytes=optimizer_bytes)


def _parameters(memories: list[_GraphMemory]) -> dict[int, tuple[str, torch.Tensor]]:
    """Every parameter the graphs take, once."""
    parameters: dict[int, tuple[str, torch.Tensor]] = {}
    for m in memories:
        parameters.update(m.parameters)
    return parameters


def _units(parameters: dict[int, tuple[str, torch.Tensor]]) -> dict[str, int]:
    """FSDP2 unit (:data:`_UNIT`) -> bytes of its parameters."""
    units: dict[str, int] = {}
    for name, x in parameters.values():
        match = _UNIT.match(name)
        unit = match.group(1) if match else ""
        units[unit] = units.get(unit, 0) + x.numel() * x.element_size()
    return units


def _state_bytes(x: torch.Tensor) -> int:
    """The optimizer's state bytes per element of ``x``: two float32 moments, and a float32 master copy of a 16-bit
    parameter."""
    return 8 + (4 if x.element_size() < 4 and x.is_floating_point() else 0)


def _count(result: Plan, report, prefix: str, rank: int) -> None:
    """Add what one run of a graph sends, and its fallbacks, to ``result``."""
    for c in report.comms:
        result.collectives.append(Collective(c.kind, "sequence", prefix + c.node, c.phase, c.bytes_by_rank[rank],
                                             list(c.bytes_by_rank), c.formula, c.reason))
    result.fallbacks += [PlanFallback(prefix + f.node, f.op, f.reason) for f in report.fallbacks]
    for i, sent in report.recomputed.items():
        key = f"{prefix}region{i}"
        result.recomputed[key] = result.recomputed.get(key, 0) + sent


def plan_graph(gm: fx.GraphModule, example_inputs: list, *, world_size: int, config: BackendConfig) -> Plan:
    """The plan of one dynamo graph."""
    return plan_graphs([(gm, example_inputs)], world_size=world_size, config=config)


def plan(model: torch.nn.Module, args: tuple | torch.Tensor = (), kwargs: dict | None = None, *, world_size: int,
         config: BackendConfig | None = None, rank: int = 0, dp_shard: int = 1, optimizer: str | None = None,
         per_layer_graphs: bool = False, hardware: str | Topology | None = None, threads: int | None = None,
         **overrides) -> Plan:
    """What ``torch.compile(model, backend=autoshard.backend(...))`` would do on ``world_size`` ranks.

    No process group is needed and nothing full-size is allocated when the model and the inputs are on
    the meta device. ``args``: the positional arguments (a lone tensor is one argument); ``config`` and
    ``overrides`` as in :func:`autoshard.backend`: a :class:`~autoshard.config.BackendConfig` (None: the
    defaults) and its fields set on top of it (``strategy="ring"``, ``topology=Topology(...)``).

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
      :class:`~autoshard.cost.Topology`): ``plan.step_seconds``, ``plan.step_time`` (by layer). The same as
      ``topology=`` (give one of them); neither: the default (H100-class) profile.
    * ``threads``: CPU threads per rank of the run priced: a CPU profile's rates scale to them
      (:meth:`~autoshard.cost.Topology.with_threads`; None: what torchrun gives a rank); a GPU's do not change.
    * ``per_layer_graphs``: plan the graphs FSDP2's hooks cut the model into when every layer is wrapped (one
      graph per layer, the mask made before them handed on uncomputed, :mod:`autoshard.runtime.deferred`), as the
      run makes them, instead of one graph of the whole model: the same attention, and the bytes the per-layer
      graphs send (each computes its own segment ids, positions and masks from the small inputs)."""
    _check_planning_options(dp_shard, optimizer)
    if hardware is not None:
        if overrides.get("topology") is not None:
            raise ValueError("autoshard.plan: give hardware= or topology=, not both (they are the same profile)")
        overrides["topology"] = resolve_hardware(hardware)
    config = resolve_config(config, overrides, "autoshard.plan")
    if config.topology is not None:
        config = dataclasses.replace(config, topology=config.topology.with_threads(threads, world=world_size))
    args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
    graphs = _capture(model, args, dict(kwargs or {}), per_layer_graphs=per_layer_graphs)
    result = plan_graphs(graphs, world_size=world_size, config=config, rank=rank, dp_shard=dp_shard,
                         optimizer=optimizer)
    result.documents = _documents(result, (kwargs or {}).get("position_ids"))
    if result.documents and result.step_time is not None:
        result.step_time = result.step_time.attention_scaled(_documents_ratio(result, config.topology or Topology()))
    return result


def _documents_ratio(result: Plan, topology: Topology) -> float:
    """What the packed documents make of the attention's priced compute: the busiest rank's visible pairs (as the
    strategy dispatches them, :attr:`Plan.documents`) over what the cost model charged without the documents (a
    whole causal sequence, times the strategy's typical imbalance)."""
    decided = next(a for a in result.attention if "segment_ids" in a.mask.split(", "))
    shape, world = decided.shape, result.world_size
    whole = AttentionShape(shape["B"], shape["S"], shape["H"], shape["Hkv"], shape["D"], getattr(torch, shape["dtype"]),
                           decided.positions["causal"], value_head_dim=shape["Dv"] if shape["Dv"] != shape["D"] else 0)
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
    ids = (position_ids == 0).long().cumsum(1)
    ids = ids.expand(decided.shape["B"], -1) if ids.size(0) == 1 else ids
    layout = SequenceLayout.of(decided.layout, ids.size(1), result.world_size)
    if ids.size(1) != decided.shape["S"] or layout.world_size != result.world_size:
        return {}
    spec = MaskSpec.of(decided.positions["causal"], decided.positions["window"], decided.positions["chunk"])
    dispatched = balance(layout, ids, spec)
    heads = decided.shape["H"]
    if decided.strategy == "allgather":
        work = dispatched.work
    elif decided.strategy in ("ulysses", "hybrid"):  # every rank: all positions, its share of the heads
        work = tuple(sum(dispatched.work) * h // heads for h in split_sizes(heads, result.world_size))
    else:
        work = dispatched.owner_work
    mean = sum(work) / len(work)
    return {"documents": int(ids[:, -1].sum()), "work": list(work), "laid_out": list(dispatched.owner_work),
            "imbalance": max(work) / mean if mean else 1.0,
            "laid_out_imbalance": max(dispatched.owner_work) / (sum(dispatched.owner_work) / len(work)) if mean else 1.0}
