"""The plan and how it reads: what the compiler will do on ``world_size`` ranks, as data, text, JSON and Graphviz.

A :class:`Plan` is what :func:`autoshard.plan` returns (:mod:`autoshard.planner.orchestrate` builds it): one
:class:`AttentionDecision` per attention call (its strategy, layout, mask and every strategy's cost), one
:class:`Collective` per collective and direction (every rank's bytes and a sympy formula), the fallbacks, the
placements and the data flow between them, the counts of what the passes did (losses, MLP chunks, tiles), the
memory policy's choice, packed documents' work, the predicted step time (:mod:`autoshard.step_time`) and the peak
memory per rank (:class:`MemoryEstimate`). ``str(plan)`` is a summary and one row per layer; :meth:`Plan.to_json`
and :meth:`Plan.from_json` round-trip it (formulas as sympy strings); :meth:`Plan.to_dot` draws the values
coloured by placement.

The memory breakdown (:class:`MemoryEstimate`) is the peak moment's live bytes by kind
(:mod:`autoshard.planner.memory` simulates the step); a returned KV cache's keys and values that autograd does not
save (checkpointed layers: the attention's are recomputed) are a kind of their own, named with its fix
(``use_cache=False``; :mod:`autoshard.passes.lazy` says why they are not made lazy). The FSDP2 and optimizer terms
are arithmetic on top (:mod:`autoshard.planner.fsdp`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import sympy

from ..policy import format_bytes
from ..step_time import LayerTime, StepTime

__all__ = ["MASK_TERMS", "AttentionDecision", "Collective", "MemoryEstimate", "PlanFallback", "Plan"]


MASK_TERMS = ("causal", "window", "chunk", "key_mask", "segment_ids", "alibi", "position_bias", "sinks", "dropout")
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
    terms the distributed op adds (``alibi``, ``position_bias``, ``sinks``, ``dropout``), ``dense`` (kept whole), ``unknown`` (computed from buffers whose values a plan on the meta device does not have; planned
    dense), or ``none``."""
    shape: dict
    """B, S, H, Hkv, D (query/key head dim), Dv (value head dim), dtype."""
    costs: list[dict]
    """Every strategy's estimated cost (:class:`~autoshard.runtime.attention.base.StrategyCost` fields)."""
    positions: dict = field(default_factory=dict)
    """The position mask: ``causal``, ``window`` (``[left, right]`` or None) and ``chunk`` (0: none)."""
    lengths: dict = field(default_factory=dict)
    """Its length class: the sequence lengths ``low`` to ``high`` (None: no end) over which the cost model keeps its
    strategy (one compilation of a graph of symbolic lengths serves them), and the strategy just ``below`` and
    ``above`` (``""``: none); empty where the cost model did not choose it."""


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
    region: str = ""
    """The checkpointed region (``g<i>.region<j>``, a key of :attr:`Plan.recomputed`) whose recomputation in backward
    sends it again; empty for the rest."""


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
    host_regions: list[int] = field(default_factory=list)
    """Of ``host_offloaded``: what each offloaded region's inputs take, in forward's order (the graphs' in turn):
    what the memory policy spares the host region by region (``offload_spared``)."""
    stopped: bool = False
    """Whether the simulation stopped early, past the cap the memory policy gave it: ``total`` is then a lower
    bound (of an option that does not fit)."""
    host_prefetched: bool = False
    """Whether backward prefetches the offloaded inputs a region early (``offload_prefetch``: the copies run beside
    compute; the prefetched region is in ``total``), or brings each back when backward first uses it."""
    total_prefetched: int = 0
    """With offload: ``total`` were the copies back prefetched, from the same simulation (what prefetching holds
    counted in; ``total`` itself when the plan prefetches), so the memory policy weighs both from one plan; 0
    without offload."""


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
    head_groups: dict[str, int] = field(default_factory=dict)
    """Attentions run with their projections a head group at a time (``head_chunks``, :mod:`autoshard.passes.heads`):
    ``grouped``, ``groups`` (their calls' groups, summed) and ``ungrouped`` (their heads in groups inside the op
    only)."""
    memory_policy: list[str] = field(default_factory=list)
    """With ``memory_budget``: per graph, what the memory policy weighed and chose (:mod:`autoshard.policy`)."""
    documents: dict = field(default_factory=dict)
    """Packed documents, when the inputs planned hold them (``position_ids`` restarting at 0, concrete values) and an
    attention reads segment ids: ``work`` (visible pairs per rank of one attention call as it will run),
    ``laid_out`` (the same as the layout places the queries), ``imbalance`` (max / mean of ``work``) and
    ``documents`` (how many, over the batch); with the all-gather strategy, ``key_rows`` (the key rows every rank
    fetches, :mod:`autoshard.runtime.attention.visible_keys`), ``gathered_rows`` (what an all-gather brings each) and
    ``keys_fetched`` (whether they are fetched), ``keys_s`` and ``dispatch_s`` (the exposed seconds per step the keys
    fetched and the queries dispatched add to all-gathering every key, negative when they save: the step time counts
    them, the collectives their bytes), ``placed`` (whether the run places the documents by their lengths,
    :mod:`autoshard.runtime.placement`: every number above is then of the placed layout; None where it does not
    consider it) and ``tokens`` (tokens per
    rank)."""
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
                         + ("prefetched: each layer's input comes back while the layer after it runs backward"
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
        if self.head_groups.get("grouped"):
            g = self.head_groups
            lines.append(f"  head groups: {g['grouped']} attention(s) run with their q/k/v and output projections "
                         f"{g['groups'] // g['grouped']} head groups at a time (head_chunks): queries, outputs and "
                         f"their gradients never whole"
                         + (f"; {g['ungrouped']} with groups inside the op only" if g.get("ungrouped") else ""))
        if self.documents:
            d = self.documents
            lines.append(f"  packed documents ({d['documents']}, from position_ids): attention work per rank (visible "
                         f"pairs of one call) {', '.join(f'{w:,}' for w in d['work'])}: max/mean "
                         f"{d['imbalance']:.2f} ({d['laid_out_imbalance']:.2f} as laid out)")
            if d.get("placed") is not None:
                lines.append("  documents placed by length (short ones whole on a rank, long ones zigzag over a group; "
                             "the compiled layout's tokens per rank)" if d["placed"] else
                             "  documents kept in the compiled layout (placing them by length would send more)")
            if "key_rows" in d:
                lines.append(f"  keys of the documents: every rank fetches the rows its queries see, "
                             f"{', '.join(f'{n:,}' for n in d['key_rows'])} of the {d['gathered_rows']:,} an all-gather "
                             f"brings ({max(d['key_rows']) / d['gathered_rows']:.2f} at the busiest rank): "
                             + (f"fetched, {d['keys_s'] * 1e3:+,.1f} ms of exposed communication per step against "
                                f"all-gathering every key" if d["keys_fetched"] else "all-gathered, as many would move")
                             + f"; the dispatched queries {d['dispatch_s'] * 1e3:+,.1f} ms")
        if self.input_checks:
            lines.append(f"  replicated inputs checked on every call of {len(self.input_checks)} graph(s): "
                         f"{sum(self.input_checks.values()):,} B sent per rank per step (metadata; "
                         f"check_inputs=False skips it)")
        if self.step_time is not None:
            lines.append(f"  step time {self.step_time.describe()}")
        if self.attention:
            lines.append(f"  why: {self.attention[0].reason}")
        if any(a.lengths for a in self.attention):
            lines.append(f"  {self.describe_length_class()}")
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

    def length_class(self) -> dict:
        """The lengths over which every attention keeps its strategy: ``low``, ``high`` (as in
        :attr:`AttentionDecision.lengths`) and the strategies ``below`` and ``above`` them, where the first class
        boundary on either side is; empty where no attention's strategy came from the cost model."""
        classes = [a.lengths for a in self.attention if a.lengths]
        if not classes:
            return {}
        low = max(c["low"] for c in classes)
        high = min((c["high"] for c in classes if c["high"] is not None), default=None)
        return {"low": low, "high": high, "below": next(c["below"] for c in classes if c["low"] == low),
                "above": next(c["above"] for c in classes if c["high"] == high)}

    def describe_length_class(self) -> str:
        """:meth:`length_class` as the plan's line."""
        c = self.length_class()
        lengths = f"{c['low']:,} tokens and longer" if c["high"] is None else f"{c['low']:,} to {c['high']:,} tokens"
        text = f"length class: one compilation (a graph of symbolic lengths) serves S = {lengths} with these strategies"
        if c["low"] > 1:
            text += f"; shorter compiles another class ({c['below'] or 'no strategy fits'})"
        if c["high"] is not None:
            text += f"; longer compiles another class ({c['above'] or 'no strategy fits'})"
        return text

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

