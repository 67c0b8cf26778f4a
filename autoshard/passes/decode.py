"""Decode steps: a graph that appends new tokens to a KV cache split along the sequence and attends over it.

After a prefill, transformers' ``DynamicCache`` holds the keys and values the compiled prefill returned split
(``SplitTensor``). The next ``generate()`` step's graph takes them as inputs and, per layer, does
``keys = cat([cache_keys, new_keys], dim=-2)``, ``sdpa(q, keys, values, ...)`` and returns ``keys`` / ``values``
(the cache's new state). That graph has no sequence of its own to split (one new token), so the training
pipeline (:mod:`.pipeline`) does not apply; this pass recognizes it and rewrites it for the sharded cache
(:mod:`autoshard.runtime.kv_cache`), in a form that holds for every cache length:

* each ``cat`` of a cache input becomes ``autoshard::cache_append`` of the rank's shard (the new positions the
  cache's round-robin rule gives this rank, or none);
* each attention over such keys and values becomes ``autoshard::decode_attention`` (local attention with LSE,
  one all-gather of ``(out, lse)``, the LSE merge); a mask the model built over the global key positions is
  read at this rank's key positions (``index_select`` of its columns);
* everything else (projections, norms, RoPE at the replicated ``position_ids``, the MLP, the logits of the new
  token) runs replicated, as one process runs it;
* the cache outputs leave as ``SplitTensor`` carrying the cache's :class:`~autoshard.runtime.kv_cache.CacheLayout`.

The rewritten graph takes, after the original inputs, each cache input's global length and the global
positions of its shard after the append (:class:`DecodeGraph` says which); :func:`decode_runner` supplies them
and wraps the outputs. A graph whose cache inputs are used any other way (a slice, a norm over the cache, an
append along another dim, a causal mask over several new queries) is not a decode step: :func:`decode_graph`
returns None with the reason, and the caller compiles it as any other graph.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from ..runtime.kv_cache import CacheLayout  # importing it defines autoshard::cache_append, ::decode_attention
from ..runtime.split_tensor import SplitTensor
from .ops import canonical, op_of, value_of
from .report import CompileReport

__all__ = ["DecodeGraph", "decode_graph", "decode_runner"]


@dataclass
class DecodeGraph:
    """A decode step rewritten for this rank."""

    gm: fx.GraphModule
    """The rewritten graph: the original inputs (cache inputs as this rank's shards), then one global length per
    cache input, then one positions tensor per cache input (None for a cache no mask reads)."""
    caches: dict[int, tuple[int, CacheLayout, int]] = field(default_factory=dict)
    """Input position of each cache input -> (its sequence dim, its layout rule, new positions per step)."""
    masked: set[int] = field(default_factory=set)
    """The cache inputs whose keys a mask reads: the graph takes their shards' positions."""
    cache_outputs: dict[int, int] = field(default_factory=dict)
    """Output position -> the input position of the cache it extends (it leaves as a SplitTensor)."""
    report: CompileReport = field(default_factory=CompileReport)
    """The attention calls rewritten (strategy ``"decode"``)."""


def _rule(x: SplitTensor) -> CacheLayout:
    rule = x.layout_rule
    return rule if isinstance(rule, CacheLayout) else CacheLayout(rule)


def _not_decode(reason: str) -> tuple[None, str]:
    return None, reason


def decode_graph(gm: fx.GraphModule, example_inputs: list, *, rank: int, group_name: str
                 ) -> tuple[DecodeGraph | None, str]:
    """``gm`` rewritten as this rank's decode step, or (None, why it is not one). ``example_inputs``: the
    graph's inputs, the cache among them as ``SplitTensor`` of ``group_name``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    carried = {i: x for i, x in enumerate(example_inputs)
               if isinstance(x, SplitTensor) and x.group_name == group_name}
    if not carried:
        return _not_decode("no input is a cache split along the sequence")
    if torch.is_grad_enabled():  # the decode ops have no backward; a training graph is the pipeline's
        return _not_decode("gradients are enabled")
    appends: dict[fx.Node, tuple[int, fx.Node]] = {}  # cat node -> (cache input position, new values node)
    caches: dict[int, tuple[int, CacheLayout, int]] = {}
    for i, x in carried.items():
        node, dim = placeholders[i], x.seq_dim
        for user in node.users:
            if _unused_metadata(user):
                continue
            op = op_of(user)
            if op is None or op.name != "cat" or len(op["tensors"]) != 2 or op["tensors"][0] is not node:
                return _not_decode(f"cache input {node.name} is used by {user.name}, not appended to")
            if op["dim"] % x.dim() != dim:
                return _not_decode(f"{user.name} appends to cache input {node.name} along dim {op['dim']}, "
                                   f"not its sequence dim {dim}")
            new = op["tensors"][1]
            count = value_of(new).shape[dim]
            if not isinstance(count, int):
                return _not_decode(f"{user.name} appends a symbolic number of positions")
            if isinstance(value_of(new), SplitTensor) or new in (placeholders[j] for j in carried):
                return _not_decode(f"{user.name} appends a split value")
            appends[user] = (i, new)
            caches[i] = (dim, _rule(x), count)
    attentions, chains = {}, set()
    for node in gm.graph.nodes:
        op = op_of(node)
        if op is None or op.name != "attention":
            continue
        k, v = _kv_source(op["k"], appends, chains), _kv_source(op["v"], appends, chains)
        if k is None and v is None:
            continue
        if k is None or v is None:
            return _not_decode(f"attention {node.name} mixes cache and other keys or values")
        if op["dropout_p"] or (op["is_causal"] and value_of(op["q"]).shape[-2] != 1):
            return _not_decode(f"attention {node.name} has dropout or a causal mask over several queries")
        attentions[node] = (op, k, v)
    for cat in appends:
        for user in cat.users:
            if user.op != "output" and user not in chains and user not in attentions:
                return _not_decode(f"the appended cache {cat.name} is used by {user.name}, not as attention keys "
                                   "or values")
    return _rewrite(gm, placeholders, caches, appends, attentions, rank, group_name), ""


_REPEAT_OPS = {"view", "expand", "getitem"}
"""What transformers' ``repeat_kv`` does between the cache and the attention (``x[:, :, None].expand(..)
.reshape(..)``): the decode attention takes the keys unrepeated and groups the query heads instead."""


def _kv_source(node, appends: dict, chains: set):
    """The appended cache whose keys or values attention input ``node`` is (itself, or its GQA repetition:
    ``[B, Hkv, L, D]`` -> ``[B, Hkv * G, L, D]`` with query head ``h`` on KV head ``h // G``), else None. The
    repetition's nodes are added to ``chains``."""
    walked, start = [], node
    while node not in appends:
        op = op_of(node)
        if op is None or op.name not in _REPEAT_OPS or not isinstance(op["input"], fx.Node):
            return None
        if op.name == "getitem" and not all(i is None or i == slice(None) for i in (
                op["index"] if isinstance(op["index"], tuple) else (op["index"],))):
            return None
        walked.append(node)
        node = op["input"]
    if walked:
        source, result = value_of(node).shape, value_of(start).shape
        if (len(source) != 4 or len(result) != 4 or result[0] != source[0] or result[1] % source[1]
                or list(result[2:]) != list(source[2:])):
            return None
        if any(len(n.users) != 1 for n in walked[1:]):
            return None
        chains.update(walked)
    return node


_METADATA = {"numel", "size", "dim", "sym_size", "sym_numel"}


def _unused_metadata(node: fx.Node) -> bool:
    """A shape query on a cache input whose result nothing reads (dynamo keeps those it turned into guards)."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    return name in _METADATA and not node.users


def _rewrite(gm, placeholders, caches, appends, attentions, rank, group_name) -> DecodeGraph:
    gm = copy.deepcopy(gm)  # dynamo reads the graph it handed over after the backend returns
    by_name = {n.name: n for n in gm.graph.nodes}
    placeholders = [by_name[n.name] for n in placeholders]
    appends = {by_name[cat.name]: (i, by_name[new.name]) for cat, (i, new) in appends.items()}
    attentions = {by_name[n.name]: (canonical(by_name[n.name]), by_name[k.name], by_name[v.name])  # not the copied ops
                  for n, (_, k, v) in attentions.items()}
    graph = gm.graph
    last = placeholders[-1]
    lengths, positions = {}, {}
    for names, kind in ((lengths, "cache_length"), (positions, "cache_positions")):
        for i in sorted(caches):
            with graph.inserting_after(last):
                names[i] = last = graph.placeholder(f"{kind}_{i}")
    local = {}
    for cat, (i, new) in appends.items():
        dim, rule, _ = caches[i]
        with graph.inserting_before(cat):
            local[cat] = graph.call_function(torch.ops.autoshard.cache_append.default, (
                placeholders[i], new, dim, lengths[i], rule.prompt.length, rule.slot(rank), rule.world_size))
    report, masked = CompileReport(), set()
    for node, (op, k, v) in attentions.items():
        i = appends[k][0]
        q = value_of(op["q"])
        scale = op["scale"] if op["scale"] is not None else q.shape[-1] ** -0.5
        with graph.inserting_before(node):
            mask = op["attn_mask"]
            if mask is not None:  # the model's mask over the global keys, read at this rank's keys
                mask = graph.call_function(torch.index_select, (mask, -1, positions[i]))
                masked.add(i)
            out = graph.call_function(torch.ops.autoshard.decode_attention.default, (
                op["q"], local[k], local[v], mask, float(scale), group_name))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        report.attention.append({"node": node.name, "strategy": "decode",
                                 "reason": "one query over a cache split along the sequence: local attention with "
                                           "LSE, one all-gather of (out, lse) per call"})
    output = next(n for n in graph.nodes if n.op == "output")
    results = output.args[0]
    flat = list(results) if isinstance(results, (tuple, list)) else [results]
    cache_outputs = {pos: appends[value][0] for pos, value in enumerate(flat) if value in appends}
    for cat, replacement in local.items():
        cat.replace_all_uses_with(replacement)
        graph.erase_node(cat)
    graph.eliminate_dead_code()
    gm.recompile()
    return DecodeGraph(gm, caches=caches, masked=masked, cache_outputs=cache_outputs, report=report)


def decode_runner(decode: DecodeGraph, rank: int, group_name: str) -> Callable:
    """Call the rewritten graph with the cache inputs' shards, their lengths and their shards' positions after
    the append; hand the extended caches back as ``SplitTensor``."""
    fn = decode.gm.forward

    def run(*args):
        lengths, positions, memo = [], [], {}
        for i in sorted(decode.caches):
            dim, rule, new = decode.caches[i]
            length = int(args[i].shape[dim])
            lengths.append(length)
            if i not in decode.masked:
                positions.append(None)
                continue
            key = (rule, length + new)  # every layer's cache shares one rule: computed once per step
            if key not in memo:
                memo[key] = rule.positions(rank, length + new, device=args[i].device)
            positions.append(memo[key])
        inputs = [args[i].local if i in decode.caches else a for i, a in enumerate(args)]
        out = fn(*inputs, *lengths, *positions)
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        for pos, i in decode.cache_outputs.items():
            dim, rule, new = decode.caches[i]
            torch._dynamo.maybe_mark_dynamic(flat[pos], dim)  # a shard grows every P steps: no recompile then
            flat[pos] = SplitTensor(flat[pos], dim, rule, group_name, _grown(args[i].shape, dim, new))
        return type(out)(flat) if isinstance(out, (tuple, list)) else flat[0]

    return run


def _grown(shape, dim: int, new: int) -> list[int]:
    out = list(shape)
    out[dim] += new
    return out
