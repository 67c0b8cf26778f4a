"""Dry-run plans of a decode step: what serving a long context costs per rank, without GPUs.

    plan = autoshard.plan_decode(model, kwargs=dict(input_ids=prompt), world_size=8)   # on meta: nothing computed
    print(plan)                   # KV cache per rank, bytes per step, memory per rank, the attention calls
    plan.kv_cache_bytes_by_rank, plan.bytes_per_step, plan.memory_per_rank

How: the model runs the prompt once on fake tensors (meta tensors as fake CPU ones, as
:mod:`autoshard.planner.capture` captures them; nothing is computed or allocated) and returns its KV cache; every
cache tensor is made the ``SplitTensor`` a sequence-parallel prefill leaves it as (the prompt laid out over the
ranks, :class:`CacheLayout`); dynamo captures the next token's step with that cache, the decode pass rewrites it for
the plan's rank exactly as a run does (:func:`~autoshard.passes.decode.decode_graph`), and the rewritten step runs
on fake tensors under the planner's live-bytes follower (:class:`~autoshard.planner.memory.LiveBytes`). So the
bytes are counted, not estimated: each rank's cache share is its layout's, the merge of every decode attention is
the all-gather the rewritten graph calls (``B x H x Sq x (Dv + 1)`` fp32 values to each other rank), and the
step's working set is what its ops make. Memory per rank is the parameters (every rank holds them all: sequence
parallelism does not shard weights), the rank's cache share, and the step's peak above them. The prefill itself is
a forward of the sequence-parallel training graph: :func:`autoshard.plan` plans it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_leaves

from ..config import dynamo_settings
from ..passes.decode import decode_graph, decode_runner
from ..policy import format_bytes
from ..runtime.groups import SequenceGroups
from ..runtime.kv_cache import CacheLayout
from ..runtime.layouts import SequenceLayout
from ..runtime.split_tensor import SplitTensor
from .capture import meta_as_fake
from .memory import LiveBytes

__all__ = ["DecodePlan", "plan_decode"]


@dataclass(kw_only=True)
class DecodePlan:
    """One decode step after a prompt of ``context`` tokens, on ``world_size`` ranks, seen from ``rank``."""

    world_size: int
    rank: int
    context: int
    """Tokens before the step (the prompt); a sliding-window layer's cache holds its window of them."""
    layout: str
    """How the prefill laid the prompt out (the cache's prompt positions per rank)."""
    attention_calls: int
    """Decode attentions in the step (one per layer): each over the rank's share of its cache."""
    kv_cache_bytes_by_rank: list[int]
    """Every rank's share of the KV cache, in bytes, when the step starts."""
    kv_cache_bytes_whole: int
    """The whole cache (what one process holds)."""
    bytes_per_step: int
    """Bytes the plan's rank sends in one decode step: the merges' all-gathers (independent of ``context``)."""
    parameters: int
    """Bytes of the parameters (every rank holds them all)."""
    step_peak: int
    """The step's peak above its inputs (the new token's activations, logits, the merge's buffers; at this first
    step after the prefill also the room the shards get to grow in place, :func:`~autoshard.runtime.kv_cache.room`)."""
    memory_per_rank: int
    """``parameters`` + the rank's cache share + ``step_peak``."""
    fallback: str = ""
    """Why the step is not a sharded decode step (empty when it is): then the cache is not split."""
    calls: list[dict] = field(default_factory=list)
    """Per decode attention: its node, query shape and bytes sent."""

    def __str__(self) -> str:
        mine = self.kv_cache_bytes_by_rank[self.rank]
        lines = [f"autoshard decode plan: {self.world_size} ranks, a {self.context:,}-token context, seen from rank "
                 f"{self.rank}"]
        if self.fallback:
            lines.append(f"  not a sharded decode step: {self.fallback}")
        lines += [
            f"  KV cache per rank {format_bytes(mine)} (whole: {format_bytes(self.kv_cache_bytes_whole)}; ranks "
            f"{format_bytes(min(self.kv_cache_bytes_by_rank))} to {format_bytes(max(self.kv_cache_bytes_by_rank))}), "
            f"the prompt laid out {self.layout}, later tokens round robin",
            f"  sends per rank per decode step {format_bytes(self.bytes_per_step)} ({self.attention_calls} decode "
            f"attention(s), one all-gather of (out, lse) each; the same at every context length)",
            f"  memory per rank {format_bytes(self.memory_per_rank)} (parameters {format_bytes(self.parameters)}, "
            f"KV cache {format_bytes(mine)}, the step's working set {format_bytes(self.step_peak)})",
        ]
        return "\n".join(lines)


def plan_decode(model: torch.nn.Module, args: tuple = (), kwargs: dict | None = None, *, world_size: int,
                rank: int = 0, layout: str = "zigzag") -> DecodePlan:
    """The plan of the decode step that follows ``model(*args, **kwargs)`` (the prompt; the model is called with
    ``use_cache=True``, as ``generate()`` does) on ``world_size`` ranks, the prompt laid out as ``layout`` by the
    prefill. The model and the inputs may be on the meta device."""
    kwargs = dict(kwargs or {})
    group = SequenceGroups.planned(rank, world_size).sequence
    with meta_as_fake(model, args, kwargs) as (running, args, kwargs):
        with running, torch.no_grad():
            prompt = model(*args, **kwargs, use_cache=True)
            cache = getattr(prompt, "past_key_values", None)
            if cache is None or not hasattr(cache, "layers"):
                raise ValueError("autoshard.plan_decode: the model returned no KV cache with layers (a transformers "
                                 "Cache) when called with use_cache=True")
            ids = kwargs.get("input_ids", args[0] if args else None)
            context = int(ids.shape[-1]) if ids is not None else max(int(layer.keys.shape[-2]) for layer in cache.layers)
            whole, by_rank = 0, [0] * world_size
            for layer in cache.layers:  # a sliding-window layer holds its window, not the whole prompt
                for name in ("keys", "values"):
                    x = getattr(layer, name)
                    held = SequenceLayout.of(layout, int(x.shape[-2]), world_size)
                    whole += x.numel() * x.element_size()
                    per_position = x.numel() * x.element_size() // max(1, x.shape[-2])
                    by_rank = [b + per_position * held.local_length(r) for r, b in enumerate(by_rank)]
                    setattr(layer, name, _split(x, held, rank, group))
            step = dict(input_ids=torch.zeros(ids.shape[0], 1, dtype=torch.long), cache=cache, use_cache=True)
        captured = {}

        def grab(gm, example_inputs):
            decode, why_not = decode_graph(gm, example_inputs, group_name=group)
            captured.update(decode=decode, why_not=why_not, inputs=list(example_inputs))
            if decode is None:
                return gm.forward
            run = decode_runner(decode, rank, group)

            def measured(*inputs):  # fake inputs run fake; the runner's index tensors (from ints) stay real
                live = LiveBytes()
                with live:
                    for x in tree_leaves(inputs):
                        if isinstance(x, torch.Tensor):
                            live.track(x.local if isinstance(x, SplitTensor) else x)
                    base = live.total
                    out = run(*inputs)
                captured["peak"] = max((p[0] for p in live.peaks.values()), default=base) - base
                return out
            return measured

        with torch._dynamo.config.patch(recompile_limit=1 << 30, accumulated_recompile_limit=1 << 30), \
                dynamo_settings(), torch.no_grad():
            torch.compile(model, backend=grab, dynamic=False)(**step)
        parameters = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    decode = captured.get("decode")
    calls = []
    if decode is not None:
        for node in decode.gm.graph.nodes:
            if node.target is torch.ops.autoshard.decode_attention.default:
                q, v = node.args[0].meta["example_value"], node.args[2].meta.get("example_value")
                batch, heads, queries = q.shape[:3]
                dv = (v.shape[-1] if v is not None else q.shape[-1])
                sent = (world_size - 1) * batch * heads * queries * (dv + 1) * 4
                calls.append({"node": node.name, "query": list(q.shape), "bytes_sent": sent})
    return DecodePlan(world_size=world_size, rank=rank, context=context, layout=layout,
                      attention_calls=len(calls), kv_cache_bytes_by_rank=by_rank, kv_cache_bytes_whole=whole,
                      bytes_per_step=sum(c["bytes_sent"] for c in calls), parameters=parameters,
                      step_peak=captured.get("peak", 0), memory_per_rank=parameters + by_rank[rank]
                      + captured.get("peak", 0), fallback="" if decode is not None else captured.get(
                          "why_not", "dynamo captured no graph"), calls=calls)


def _split(x: torch.Tensor, layout: SequenceLayout, rank: int, group: str) -> SplitTensor:
    """The ``SplitTensor`` a sequence-parallel prefill leaves the cache tensor ``x`` (fake) as, on ``rank``."""
    local = list(x.shape)
    local[-2] = layout.local_length(rank)
    return SplitTensor(x.new_empty(local), x.dim() - 2, CacheLayout(layout), group, list(x.shape))
