"""Decode steps: a graph that adds new tokens to a KV cache split along the sequence and attends over it.

After a prefill, transformers' ``DynamicCache`` holds the keys and values the compiled prefill returned split
(``SplitTensor``). The next ``generate()`` step's graph takes them as inputs and, per layer, does
``keys = cat([cache_keys, new_keys], dim=-2)``, ``sdpa(q, keys, values, ...)`` and returns ``keys`` / ``values``
(the cache's new state). That graph has no sequence of its own to split (one new token), so the training
pipeline (:mod:`.pipeline`) does not apply; this pass recognizes it and rewrites it for the sharded cache
(:mod:`autoshard.runtime.kv_cache`), in a form that holds for every cache length:

* each ``cat`` of a cache input becomes ``autoshard::cache_append``: the new positions the cache's round-robin
  rule gives this rank (or none) written after its shard, in place (the shard lives in a storage with room,
  :func:`~autoshard.runtime.kv_cache.room`: a step copies no cache);
* each attention over such keys and values becomes ``autoshard::decode_attention`` (local attention with LSE,
  one all-gather of ``(out, lse)``, the LSE merge); a mask the model built over the global key positions is
  read at this rank's key positions (``index_select`` of its columns);
* everything else (projections, norms, RoPE at the replicated ``position_ids``, the MLP, the logits of the new
  token) runs replicated, as one process runs it;
* a fixed-size cache (transformers' ``StaticCache``: ``buffer.index_copy_(dim, cache_position, new)`` and
  attention over the whole buffer under the model's mask), which the prefill left split
  (:mod:`.static_cache`), becomes ``autoshard::cache_write`` into the rank's shard (the positions it holds)
  and the decode attention over the shard, the mask read at the shard's positions;
* a sliding-window layer's cache (transformers' ``DynamicSlidingWindowLayer`` keeps ``appended[:, :, -k:]``)
  becomes an ``index_select`` of the rank's entries in the window: each rank drops its own positions that left it;
  the cache's first position then travels with its carrier (``SplitTensor.cache_start``, not guarded: one graph
  serves every step of a full window);
* the cache outputs leave as ``SplitTensor`` carrying the cache's :class:`~autoshard.runtime.kv_cache.CacheLayout`.

The rewritten graph is the same on every rank and for every prompt: it takes, after the original inputs, the
index of the first new position the rank keeps of each appended cache, the indices of its shard's entries in the
appended cache, for a window the entries that stay and for a fixed-size cache the slot of
every position (:class:`DecodeGraph` says which); :func:`decode_runner` supplies them and wraps the outputs. A
graph whose cache inputs are used any other way (a slice, a norm over the cache, an append along another dim, a
causal mask over several new queries) is not a decode step: :func:`decode_graph` returns None with the reason,
and the caller compiles it as any other graph (:func:`cache_written_in_place` names a fixed-size cache that
arrives whole, for the caller's warning).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from ..runtime.kv_cache import CacheLayout, appended, first_owned, room  # defines the autoshard::cache_* ops
from ..runtime.split_tensor import SplitTensor
from .graph import eliminate_dead_code
from .ops import canonical, is_tensor_node, op_of, value_of
from .report import CompileReport

__all__ = ["DecodeGraph", "decode_graph", "decode_runner", "cache_written_in_place"]


@dataclass
class DecodeGraph:
    """A decode step rewritten for this rank."""

    gm: fx.GraphModule
    """The rewritten graph: the original inputs (cache inputs as this rank's shards), then per appended cache input
    the index of the first new position this rank keeps (it keeps every ``P``-th from there), then one tensor per cache
    input of its local entries' indices in the appended cache (None for a cache no mask reads), then one tensor
    per windowed cache input of the local entries its window keeps, then one per fixed-size cache input of the
    local slot of every position, then one per appended cache input of its shard's view with room for the new
    positions."""
    caches: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Input position of each cache input -> (its sequence dim, new positions per step). Its layout rule is read
    from the carrier at each call, so one graph serves every prompt length."""
    masked: set[int] = field(default_factory=set)
    """The cache inputs whose keys a mask reads: the graph takes their shards' positions."""
    grown: set[int] = field(default_factory=set)
    """The cache inputs appended to: the graph takes, for each, the view of the shard with room for the new
    positions it keeps (:func:`~autoshard.runtime.kv_cache.room`), and writes them there."""
    statics: set[int] = field(default_factory=set)
    """The fixed-size cache inputs (written in place at positions, transformers' ``StaticCache``): the graph
    takes, for each, the local slot of every position (-1: another rank's)."""
    windows: dict[int, int] = field(default_factory=dict)
    """Cache input position -> how many last positions the cache keeps (a sliding-window layer's cache): the
    graph takes the local indices of the entries that stay."""
    cache_outputs: dict[int, tuple[int, bool]] = field(default_factory=dict)
    """Output position -> (the input position of the cache it extends, whether it is that cache's window); it
    leaves as a SplitTensor."""
    report: CompileReport = field(default_factory=CompileReport)
    """The attention calls rewritten (strategy ``"decode"``)."""


def _rule(x: SplitTensor) -> CacheLayout:
    rule = x.layout_rule
    return rule if isinstance(rule, CacheLayout) else CacheLayout(rule)


def _not_decode(reason: str) -> tuple[None, str]:
    return None, reason


def decode_graph(gm: fx.GraphModule, example_inputs: list, *, group_name: str) -> tuple[DecodeGraph | None, str]:
    """``gm`` rewritten as a decode step, or (None, why it is not one). ``example_inputs``: the graph's inputs, the
    cache among them as ``SplitTensor`` of ``group_name``. The graph is every rank's: what differs by rank and by
    prompt (the positions a rank holds) :func:`decode_runner` computes at each call."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    carried = {i: x for i, x in enumerate(example_inputs)
               if isinstance(x, SplitTensor) and x.group_name == group_name}
    if not carried:
        return _not_decode("no input is a cache split along the sequence")
    if torch.is_grad_enabled():  # the decode ops have no backward; a training graph is the pipeline's
        return _not_decode("gradients are enabled")
    appends: dict[fx.Node, tuple[int, fx.Node]] = {}  # cat node -> (cache input position, new values node)
    writes: dict[fx.Node, int] = {}  # index_copy_ node -> cache input position
    statics: dict[fx.Node, int] = {}  # a fixed-size cache input (written in place) -> its position
    caches: dict[int, tuple[int, int]] = {}
    split = {placeholders[j] for j in carried}
    for i, x in carried.items():
        node, dim = placeholders[i], x.seq_dim
        reads = []
        for user in node.users:
            if _unused_metadata(user):
                continue
            if user.op == "call_method" and user.target == "index_copy_" and user.args[0] is node:
                if len(user.args) != 4 or user.users or user.args[1] % x.dim() != dim:
                    return _not_decode(f"{user.name} writes cache input {node.name} other than along its sequence")
                if any(a in split or isinstance(value_of(a), SplitTensor) for a in user.args[2:]):
                    return _not_decode(f"{user.name} writes a split value")
                writes[user] = i
                continue
            op = op_of(user)
            if op is None or op.name != "cat" or len(op["tensors"]) != 2 or op["tensors"][0] is not node:
                reads.append(user)
                continue
            if op["dim"] % x.dim() != dim:
                return _not_decode(f"{user.name} appends to cache input {node.name} along dim {op['dim']}, "
                                   f"not its sequence dim {dim}")
            new = op["tensors"][1]
            count = value_of(new).shape[dim]
            if not isinstance(count, int):
                return _not_decode(f"{user.name} appends a symbolic number of positions")
            if isinstance(value_of(new), SplitTensor) or new in split:
                return _not_decode(f"{user.name} appends a split value")
            appends[user] = (i, new)
            caches[i] = (dim, count)
        if i in writes.values():
            if i in caches:
                return _not_decode(f"cache input {node.name} is both appended to and written in place")
            statics[node] = i
            caches[i] = (dim, 0)
        elif reads:
            return _not_decode(f"cache input {node.name} is used by {reads[0].name}, not appended to or written")
    sources = {**{cat: i for cat, (i, _) in appends.items()}, **statics}
    attentions, chains = {}, set()
    for node in gm.graph.nodes:
        op = op_of(node)
        if op is None or op.name != "attention":
            continue
        k, v = repetition_source(op["k"], sources, chains), repetition_source(op["v"], sources, chains)
        if k is None and v is None:
            continue
        if k is None or v is None:
            return _not_decode(f"attention {node.name} mixes cache and other keys or values")
        if op["dropout_p"] or (op["is_causal"] and value_of(op["q"]).shape[-2] != 1):
            return _not_decode(f"attention {node.name} has dropout or a causal mask over several queries")
        attentions[node] = (op, k, v)
    for cache in statics:
        for user in cache.users:
            if not (user in writes or user in chains or user in attentions or _sizes_for(user, chains)
                    or _unused_metadata(user)):
                return _not_decode(f"the fixed-size cache {cache.name} is read by {user.name}, not as attention "
                                   "keys or values")
    windows: dict[fx.Node, int] = {}  # a slice keeping the last positions of an appended cache -> how many
    for cat in appends:
        for user in cat.users:
            if user.op == "output" or user in chains or user in attentions or _sizes_for(user, chains):
                continue
            keep = _window(user, caches[appends[cat][0]][0])
            if keep is None:
                return _not_decode(f"the appended cache {cat.name} is used by {user.name}, not as attention keys "
                                   "or values or a window of its last positions")
            if any(u.op != "output" for u in user.users):
                return _not_decode(f"the window {user.name} of the appended cache {cat.name} is used by another "
                                   "operation than the graph's output")
            windows[user] = keep
    world = _rule(next(iter(carried.values()))).world_size
    return _rewrite(gm, placeholders, caches, appends, writes, attentions, windows, world, group_name), ""


_IN_PLACE_WRITES = {"index_copy_", "index_put_", "copy_", "setitem", "index_fill_", "scatter_"}
"""Methods that write a cache buffer in place (transformers' ``StaticLayer`` writes with ``index_copy_``, and on
devices without it with ``keys[:, :, cache_position] = ...``)."""


def cache_written_in_place(gm: fx.GraphModule) -> str | None:
    """The name of a graph input that attention reads as keys or values and the graph writes in place (a cache
    of a fixed size, as transformers' ``StaticCache``: not sharded, it stays whole on every rank), else None."""
    inputs = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for node in gm.graph.nodes:
        op = op_of(node)
        if op is None or op.name != "attention":
            continue
        for kv in (repetition_source(op["k"], inputs, set()), repetition_source(op["v"], inputs, set())):
            written = [_method(u) for u in (kv.users if kv is not None else ())
                       if _method(u) in _IN_PLACE_WRITES and u.args and u.args[0] is kv]
            if written:
                source = getattr(kv.meta.get("grapharg"), "source", None)
                name = source.name if isinstance(getattr(source, "name", None), str) else (
                    source.name() if source is not None else kv.name)
                return f"{name} (written in place by {written[0]})"
    return None


def _method(node: fx.Node) -> str | None:
    """The name of the method or function ``node`` calls."""
    return node.target if node.op == "call_method" else getattr(node.target, "__name__", None)


def _window(node: fx.Node, dim: int) -> int | None:
    """How many last positions along ``dim`` the slice ``node`` keeps (``x[:, :, -k:, :]``: what a sliding-window
    cache stores), else None."""
    op = op_of(node)
    if op is None or op.name != "getitem":
        return None
    index = op["index"] if isinstance(op["index"], tuple) else (op["index"],)
    if len(index) <= dim or not all(isinstance(i, slice) for i in index):
        return None
    whole = slice(None)
    window = index[dim]
    if any(i != whole for d, i in enumerate(index) if d != dim) or window.stop is not None or window.step is not None:
        return None
    return -window.start if isinstance(window.start, int) and window.start < 0 else None


_REPEAT_OPS = {"view", "expand", "getitem"}
"""What transformers' ``repeat_kv`` does between the cache and the attention (``x[:, :, None].expand(..)
.reshape(..)``): the decode attention takes the keys unrepeated and groups the query heads instead."""


def repetition_source(node, sources, chains: set):
    """The cache among ``sources`` whose keys or values attention input ``node`` is (itself, or its GQA repetition:
    ``[B, Hkv, L, D]`` -> ``[B, Hkv * G, L, D]`` with query head ``h`` on KV head ``h // G``), else None. The
    repetition's nodes are added to ``chains``. (Ops read with ``canonical``, not ``op_of``: a specialized copy of a
    graph keeps the cached ops of the graph it copies.)"""
    walked, start = [], node
    while node not in sources:
        op = canonical(node) if isinstance(node, fx.Node) else None
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


def _sizes_for(node: fx.Node, chains: set) -> bool:
    """Whether ``node`` is a shape query (or an element of one) read only by the GQA repetitions in ``chains``
    (``repeat_kv`` expands to the cache's length): they go with the repetition, the decode attention takes the
    keys unrepeated."""
    name = _method(node)
    if name not in _METADATA and name != "getitem":
        return False
    if name == "getitem" and is_tensor_node(node):
        return False
    return bool(node.users) and all(user in chains or _sizes_for(user, chains) for user in node.users)


def _unused_metadata(node: fx.Node) -> bool:
    """A shape query on a cache input whose result nothing reads (dynamo keeps those it turned into guards)."""
    return _method(node) in _METADATA and not node.users


def _rewrite(gm, placeholders, caches, appends, writes, attentions, windows, world, group_name) -> DecodeGraph:
    gm = copy.deepcopy(gm)  # dynamo reads the graph it handed over after the backend returns
    by_name = {n.name: n for n in gm.graph.nodes}
    placeholders = [by_name[n.name] for n in placeholders]
    appends = {by_name[cat.name]: (i, by_name[new.name]) for cat, (i, new) in appends.items()}
    writes = {by_name[w.name]: i for w, i in writes.items()}
    statics = set(writes.values())
    attentions = {by_name[n.name]: (canonical(by_name[n.name]), by_name[k.name], by_name[v.name])  # not the copied ops
                  for n, (_, k, v) in attentions.items()}
    windows = {by_name[n.name]: keep for n, keep in windows.items()}
    windowed = {appends[node.args[0]][0]: keep for node, keep in windows.items()}
    graph = gm.graph
    last = placeholders[-1]
    firsts, positions, kept, slots, extended = {}, {}, {}, {}, {}
    grown = {i for i, _ in appends.values()}
    for names, kind, inputs in ((firsts, "cache_first", grown), (positions, "cache_indices", caches),
                                (kept, "cache_kept", windowed), (slots, "cache_slots", statics),
                                (extended, "cache_extended", grown)):
        for i in sorted(inputs):
            with graph.inserting_after(last):
                names[i] = last = graph.placeholder(f"{kind}_{i}")
    local = {placeholders[i]: placeholders[i] for i in statics}  # a fixed-size cache: its shard, written in place
    for write, i in writes.items():
        with graph.inserting_before(write):
            graph.call_function(torch.ops.autoshard.cache_write.default, (
                placeholders[i], write.args[2], write.args[3], caches[i][0], slots[i]))
        graph.erase_node(write)
    index_of = {**{cat: i for cat, (i, _) in appends.items()}, **{placeholders[i]: i for i in statics}}
    for cat, (i, new) in appends.items():  # written after the shard, in its storage (the runner made room)
        with graph.inserting_before(cat):
            graph.call_function(torch.ops.autoshard.cache_append.default, (
                extended[i], new, caches[i][0], firsts[i], world))
        local[cat] = extended[i]
    report, masked = CompileReport(), set()
    for node, (op, k, v) in attentions.items():
        i = index_of[k]
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
    cache_outputs = {pos: (appends[value][0], False) for pos, value in enumerate(flat) if value in appends}
    cache_outputs.update({pos: (appends[value.args[0]][0], True) for pos, value in enumerate(flat) if value in windows})
    for window in windows:  # the window's entries this rank holds: the runner knows which from the positions
        i = appends[window.args[0]][0]
        with graph.inserting_before(window):
            kept_local = graph.call_function(torch.index_select, (local[window.args[0]], caches[i][0], kept[i]))
        window.replace_all_uses_with(kept_local)
        graph.erase_node(window)
    for cat, replacement in local.items():
        if cat is not replacement:
            cat.replace_all_uses_with(replacement)
            graph.erase_node(cat)
    eliminate_dead_code(graph)  # the repetitions and their shape reads; not the in-place writes
    gm.recompile()
    return DecodeGraph(gm, caches=caches, masked=masked, grown=grown, statics=statics, windows=windowed,
                       cache_outputs=cache_outputs, report=report)


def decode_runner(decode: DecodeGraph, rank: int, group_name: str) -> Callable:
    """Call the rewritten graph with the cache inputs' shards, the new positions this rank keeps, the local indices a
    mask and a window read, all from each carrier's own layout rule (a new prompt length is a new rule, not a new
    graph); hand the extended caches back as ``SplitTensor`` (a window's with its new first position)."""
    fn = decode.gm.forward

    def run(*args):
        firsts, indices, kept, slots, grown, starts, rules, memo = [], [], [], [], [], {}, {}, {}
        for i in sorted(decode.caches):
            dim, new = decode.caches[i]
            rule = rules[i] = _rule(args[i])
            start = args[i].cache_start
            end = start + int(args[i].shape[dim])
            if i in decode.grown:  # the shard with room for its new positions: appending copies no cache
                firsts.append(first_owned(rule, rank, end))
                held, extended = room(args[i].local, dim, appended(rule, rank, end, new))
                args[i].local = held  # the carrier the caller holds: the same values, a storage that grows
                grown.append(extended)
            if i in decode.statics:  # written where the rank holds a position: the same slots every step
                if (rule, end, "slots") not in memo:
                    memo[rule, end, "slots"] = rule.slots(rank, end, device=args[i].device)
                slots.append(memo[rule, end, "slots"])
            if i not in decode.masked and i not in decode.windows:
                indices.append(None)
                continue
            key = (rule, end + new, start)  # every layer's cache shares one rule: computed once per step
            if key not in memo:
                memo[key] = rule.positions(rank, end + new, device=args[i].device, start=start)
            held = memo[key]  # the positions of the appended shard's entries, in local order
            indices.append(held - start if i in decode.masked else None)
            if i in decode.windows:
                starts[i] = max(start, end + new - decode.windows[i])
                if (key, starts[i]) not in memo:
                    memo[key, starts[i]] = torch.nonzero(held >= starts[i]).flatten()
                kept.append(memo[key, starts[i]])
        inputs = [args[i].local if i in decode.caches else a for i, a in enumerate(args)]
        out = fn(*inputs, *firsts, *indices, *kept, *slots, *grown)
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        for pos, (i, window) in decode.cache_outputs.items():
            dim, new = decode.caches[i]
            start = starts[i] if window else args[i].cache_start
            shape = list(args[i].shape)
            shape[dim] = args[i].cache_start + shape[dim] + new - start
            torch._dynamo.maybe_mark_dynamic(flat[pos], dim)  # a shard grows every P steps: no recompile then
            flat[pos] = SplitTensor(flat[pos], dim, rules[i], group_name, shape, start)
        return type(out)(flat) if isinstance(out, (tuple, list)) else flat[0]

    return run
