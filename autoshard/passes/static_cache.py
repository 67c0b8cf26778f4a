"""Prefill into a fixed-size KV cache (transformers' ``StaticCache``), so that the cache leaves split.

A ``StaticCache`` layer allocates its buffers on first use -- inside the compiled prefill -- as
``torch.zeros([B, Hkv, max_cache_len, D])``, writes the prompt's keys and values with
``buffer.index_copy_(2, arange(S) + cumulative_length, keys)``, attends the prompt's queries over the whole buffer
with a mask over its ``max_cache_len`` columns (or, where transformers drops a mask that hides nothing but the
future, as for one prompt, causally over the buffer's first ``S`` positions), and keeps the buffer. Run as written,
every rank would hold the whole buffer. In a fresh cache (``cumulative_length`` 0) whose mask hides the columns past
the prompt (a causal mask always does), the attention over the buffer is the attention over the prompt's own keys
and values with the mask's first ``S`` columns (causal without one): this pass rewrites it so (the training
pipeline then distributes it as any self-attention) and returns the prompt's keys and values in the buffer's
place. :func:`static_prefill_runner` checks at run time what the rewrite assumes (the cache is fresh, the mask
hides the rest), and makes each rank's buffer of the cache's layout (:class:`~autoshard.runtime.kv_cache.CacheLayout`:
the prompt as the prefill split it, later positions round robin) from its shard: a ``SplitTensor`` of the buffer's
global shape, the decode steps write into in place (:mod:`autoshard.passes.decode`).

A prefill into a cache that already holds positions (chunked prefill's later chunks) is refused with the reason:
its writes would land on positions other ranks hold.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from ..runtime.kv_cache import CacheLayout
from ..runtime.split_tensor import SplitTensor
from .graph import eliminate_dead_code, new_node
from .decode import repetition_source
from .ops import canonical, value_of

__all__ = ["StaticPrefill", "static_prefill", "static_prefill_runner"]


@dataclass
class StaticPrefill:
    """A prefill into fresh fixed-size caches, rewritten to attend over the prompt's keys and values."""

    gm: fx.GraphModule
    """The rewritten graph: each buffer output replaced by the keys or values written into it."""
    buffers: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Output position -> (the buffer's sequence dim, its capacity)."""
    starts: set[int] = field(default_factory=set)
    """Inputs the write positions start at (``cumulative_length``): 0 in a fresh cache."""
    masks: dict[int, int] = field(default_factory=dict)
    """Mask input -> the prompt's length: the columns from there on must be hidden."""
    structured: fx.GraphModule | None = None
    """The graph once more, the masks rebuilt from their structure (causal, and which keys every row may see:
    one ``[B, S]`` input per mask, after the others) so the attention distributes as any; the run takes it
    when the masks are that (transformers' static-cache masks are), else ``gm`` with the masks dense."""


def static_prefill(gm: fx.GraphModule) -> StaticPrefill | None:
    """``gm`` rewritten as above, or None when it makes no fixed-size cache this way."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    buffers = {}  # zeros node -> (dim, capacity, write node)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.zeros:
            continue
        writes = [u for u in node.users if u.op == "call_method" and u.target == "index_copy_"]
        if len(writes) != 1 or writes[0].users or len(writes[0].args) != 4:
            continue
        write = writes[0]
        dim, positions, new = write.args[1], write.args[2], write.args[3]
        shape = value_of(node).shape
        if not isinstance(dim, int) or len(shape) != 4:
            continue
        dim %= len(shape)
        if _start_input(positions, placeholders) is None or value_of(new).shape[dim] > shape[dim]:
            continue
        buffers[node] = (dim, int(shape[dim]), write)
    if not buffers:
        return None
    attentions, chains = {}, set()
    for node in gm.graph.nodes:
        op = canonical(node)  # not op_of: a specialized copy keeps the cached ops of the graph it copies
        if op is None or op.name != "attention":
            continue
        k, v = _buffer_read(op["k"], buffers, chains), _buffer_read(op["v"], buffers, chains)
        if k is None and v is None:
            continue
        mask = op["attn_mask"]
        causal = op["is_causal"] and mask is None  # upper-left aligned: row i sees the positions up to i
        if k is None or v is None or not (causal or (not op["is_causal"] and mask in placeholders)):
            return None  # the rewrite needs a causal attention, or a mask it can check at run time
        attentions[node] = (k, v, mask)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node, (_, _, write) in buffers.items():
        if any(u not in (write, output) and u not in chains and u not in attentions for u in node.users):
            return None  # read some other way: it stays whole
    return _rewrite(gm, buffers, attentions, placeholders)


def _buffer_read(node, buffers, chains: set):
    """The buffer among ``buffers`` that attention input ``node`` reads whole (itself or its GQA repetition:
    :func:`~autoshard.passes.decode.repetition_source`), or its first ``n`` positions for ``n`` at least the prompt's
    length (``buffer[:, :, :n]``: what transformers' SDPA attention reads of an empty cache when it attends causally
    without a mask, as at batch size 1); else None. In a fresh cache either holds the prompt's keys first and zeros
    after, which a causal attention or a mask that hides them never reads. The nodes walked are added to
    ``chains``."""
    walked: set = set()
    source = repetition_source(node, buffers, walked)
    if source is None:
        op = canonical(node) if isinstance(node, fx.Node) else None
        if op is None or op.name != "getitem" or not isinstance(op["input"], fx.Node):
            return None
        source = repetition_source(op["input"], buffers, walked)
        if source is None or not _keeps_prompt(op["index"], buffers[source][0], buffers[source][2]):
            return None
        walked.add(node)
    chains.update(walked)
    return source


def _keeps_prompt(index, dim: int, write: fx.Node) -> bool:
    """Whether ``index`` keeps the first positions along ``dim`` and all of the other dims (``[:, :, :n]``), at least
    the ``write``'s prompt."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) <= dim or not all(isinstance(i, slice) for i in index):
        return False
    if any(i != slice(None) for d, i in enumerate(index) if d != dim):
        return False
    kept = index[dim]
    stop = value_of(kept.stop) if isinstance(kept.stop, fx.Node) else kept.stop  # a symbolic length: a size node
    return (kept.start in (None, 0) and kept.step in (None, 1) and isinstance(stop, (int, torch.SymInt))
            and bool(stop >= value_of(write.args[3]).shape[dim]))


def _start_input(positions, placeholders) -> int | None:
    """The input the write positions ``arange(S) + start`` start at (``start`` a one-element input, or its
    ``.to(device)``), else None."""
    if not isinstance(positions, fx.Node) or positions.op != "call_function" or positions.target is not operator.add:
        return None
    ramp, start = positions.args
    if not (isinstance(ramp, fx.Node) and ramp.target is torch.arange and isinstance(start, fx.Node)):
        return None
    if start.op == "call_method" and start.target == "to":
        start = start.args[0]
    if start not in placeholders or value_of(start).numel() != 1:
        return None
    return placeholders[start]


def _rewrite(gm, buffers, attentions, placeholders) -> StaticPrefill:
    dense, structured = _rewritten(gm, buffers, attentions, placeholders, structured=False), \
        _rewritten(gm, buffers, attentions, placeholders, structured=True)
    dense.structured = structured.gm
    return dense


def _rewritten(gm, buffers, attentions, placeholders, *, structured: bool) -> StaticPrefill:
    gm = copy.deepcopy(gm)  # dynamo reads the graph it handed over after the backend returns
    by_name = {n.name: n for n in gm.graph.nodes}
    buffers = {by_name[z.name]: (dim, cap, by_name[w.name]) for z, (dim, cap, w) in buffers.items()}
    placeholders = {by_name[n.name]: i for n, i in placeholders.items()}
    graph = gm.graph
    result, rebuilt, last = StaticPrefill(gm), {}, list(placeholders)[-1]
    for node, (k, v, mask) in attentions.items():
        node = by_name[node.name]
        op = canonical(node)  # not op_of: the copy's cached ops name the original graph's nodes
        (dim, _, write_k), (_, _, write_v) = buffers[by_name[k.name]], buffers[by_name[v.name]]
        keys, values = write_k.args[3], write_v.args[3]
        mask = by_name[mask.name] if mask is not None else None  # None: causal (upper-left), over the prompt too
        length = int(value_of(keys).shape[dim])
        heads, kv_heads = value_of(op["q"]).shape[1], value_of(keys).shape[1]
        if structured and mask is not None and mask not in rebuilt:
            with graph.inserting_after(last):
                last = visible = graph.placeholder(f"{mask.name}_keys")
            visible.meta["example_value"] = _empty(value_of(mask), (value_of(mask).shape[0], length), torch.bool)
            with graph.inserting_before(node):
                rebuilt[mask] = _causal_and_keys(graph, visible, length, value_of(mask).device)
        with graph.inserting_before(node):  # the prompt's keys unrepeated: GQA by the attention itself
            columns = (None if mask is None else rebuilt[mask] if structured else
                       new_node(graph, operator.getitem, (mask, (Ellipsis, slice(None, length)))))
            attention = new_node(graph, torch._C._nn.scaled_dot_product_attention, (op["q"], keys, values),
                                 {"attn_mask": columns, "dropout_p": op["dropout_p"], "is_causal": mask is None,
                                  "scale": op["scale"], "enable_gqa": heads != kv_heads},
                                 example_value=value_of(node))
        attention.meta.update({k: v for k, v in node.meta.items() if k not in ("example_value", "val")})
        node.replace_all_uses_with(attention)
        graph.erase_node(node)
        if mask is not None:
            result.masks[placeholders[mask]] = length
    output = next(n for n in graph.nodes if n.op == "output")
    flat = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    for node, (dim, capacity, write) in buffers.items():
        result.starts.add(_start_input(write.args[2], placeholders))
        result.buffers.update({pos: (dim, capacity) for pos, value in enumerate(flat) if value is node})
        output.replace_input_with(node, write.args[3])
        graph.erase_node(write)
    eliminate_dead_code(graph)  # the buffers, their reads for the repetition; not the in-place writes elsewhere
    gm.recompile()
    return result


def _empty(like: torch.Tensor, shape, dtype) -> torch.Tensor:
    """A value of ``shape`` in the fake mode of ``like`` (a graph input's example value)."""
    mode = getattr(like, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        return torch.empty(shape, dtype=dtype, device=like.device)


def _causal_and_keys(graph: fx.Graph, visible: fx.Node, length: int, device) -> fx.Node:
    """``(k <= q) & visible[b, k]`` as ``[B, 1, S, S]`` graph nodes (what the mask pass reads as causal with a key
    mask)."""
    positions = new_node(graph, torch.arange, (length,), {"device": device})
    rows = new_node(graph, operator.getitem, (positions, (slice(None), None)))
    cols = new_node(graph, operator.getitem, (positions, (None, slice(None))))
    causal = new_node(graph, operator.le, (cols, rows))
    keys = new_node(graph, operator.getitem, (visible, (slice(None), None, None, slice(None))))
    return new_node(graph, operator.and_, (causal, keys))


def _keys_seen(mask: torch.Tensor, length: int) -> torch.Tensor | None:
    """The ``[B, S]`` keys a causal mask over a fresh cache lets its rows see, when ``mask`` (``[B, 1, S, C]``,
    bool or additive) is exactly that (and hides the columns past the prompt), else None."""
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    if visible.dim() != 4 or visible.size(1) != 1 or bool(visible[..., length:].any()):
        return None
    keys = visible[:, 0, -1, :length]  # the last row sees every key the causal mask lets any row see
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    return keys if torch.equal(visible[:, 0, :, :length], causal & keys[:, None, :]) else None


def static_prefill_runner(prefill: StaticPrefill, structured: Callable | None, dense: Callable[[], Callable],
                          rank: int, group_name: str) -> Callable:
    """Run the compiled rewritten prefill: ``structured`` (the compiled :attr:`StaticPrefill.structured`) when
    every mask is causal over the prompt's keys, else ``dense()`` (the compiled :attr:`StaticPrefill.gm`, made
    on first need) after checking that the masks hide what the rewrite drops; refuse a cache that is not fresh.
    Each buffer is handed back as this rank's shard of the cache's layout (zeros past the prompt), a
    ``SplitTensor``. The inputs are the same on every rank, so every rank takes the same branch."""
    compiled = {}

    def run(*args):
        for i in prefill.starts:
            if int(args[i]) != 0:
                raise ValueError(
                    "autoshard: a prefill into a fixed-size KV cache (transformers' StaticCache) that already holds "
                    f"{int(args[i])} positions (chunked prefill, or a cache passed in again) is not supported: its "
                    "writes would land on other ranks' positions. Prefill the whole prompt at once, or use the "
                    "default DynamicCache")
        keys = [_keys_seen(args[i], length) for i, length in prefill.masks.items()]
        if structured is not None and all(k is not None for k in keys):
            out = structured(*args, *keys)
        else:
            for i, length in prefill.masks.items():
                rest = args[i][..., length:]
                if bool((rest if rest.dtype == torch.bool else rest > torch.finfo(rest.dtype).min).any()):
                    raise ValueError(
                        "autoshard: the prefill's mask lets the prompt attend to positions of the fixed-size KV cache "
                        "past the prompt (not written yet); autoshard shards such a cache only under a mask that "
                        "hides them (a causal one)")
            if "dense" not in compiled:
                compiled["dense"] = dense()
            out = compiled["dense"](*args)
        flat = list(out) if isinstance(out, (tuple, list)) else [out]
        for pos, (dim, capacity) in prefill.buffers.items():
            flat[pos] = _buffer(flat[pos], dim, capacity, rank, group_name)
        return type(out)(flat) if isinstance(out, (tuple, list)) else flat[0]

    return run


def _buffer(prompt: torch.Tensor, dim: int, capacity: int, rank: int, group_name: str) -> torch.Tensor:
    """The cache buffer holding ``prompt`` (this rank's shard of it, or it whole) at its first positions."""
    shape = list(prompt.shape)
    shape[dim] = capacity
    if not isinstance(prompt, SplitTensor):  # returned whole (outputs="gathered"): the buffer is whole too
        buffer = prompt.new_zeros(shape)
        buffer.narrow(dim, 0, prompt.shape[dim]).copy_(prompt)
        return buffer
    layout = CacheLayout(prompt.seq_layout)
    local = list(prompt.local.shape)
    local[dim] = layout.local_length(rank, capacity)
    buffer = prompt.local.new_zeros(local)
    buffer.narrow(dim, 0, prompt.local.shape[dim]).copy_(prompt.local)
    return SplitTensor(buffer, dim, layout, group_name, shape)
