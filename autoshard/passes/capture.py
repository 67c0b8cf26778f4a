"""Capture: every attention in the graph becomes one ``captured_attention`` call with a structured mask.

Three spellings are recognized:

* ``F.scaled_dot_product_attention`` (any ``attn_mask`` / ``is_causal`` / ``enable_gqa``);
* hand-written attention: ``matmul(q, k^T)``, an optional constant scale, an optional soft-cap
  (``tanh(s / c) * c``, Gemma2's attention logit cap; ``s * (1 / c)`` and either operand order too), an
  optional mask (added, ``masked_fill(-inf)`` or ``where(keep, scores, -inf)``), ``softmax`` over the
  keys, optional casts and dropout, ``matmul(probs, v)``;
* user-marked attention functions (``autoshard.attention_function``), which reach the graph as the
  ``autoshard::marked_attention`` op.

K/V repeated for grouped-query attention (``k[:, :, None].expand(...).reshape(...)``, HF's
``repeat_kv``) are replaced by the un-repeated tensors: distributed attention moves ``Hkv`` heads, not
``H``. The mask goes through :mod:`autoshard.passes.masks`; when it cannot be structured the attention
keeps it dense (``dense_mask``) and the rewrite computes it on gathered keys.

``captured_attention`` itself is the one-device meaning of the captured call, used when the attention
is not distributed. Its ``softcap`` (0: none) caps the scaled scores, ``softcap * tanh(s / softcap)``,
before the mask; the distributed op applies it block by block.

A captured attention whose mask stays dense carries why in ``node.meta[DENSE_MASK]`` (a :class:`DenseMask`),
for plans to say. A mask computed from module buffers whose values are unknown -- fake or meta tensors, a
dry-run plan of a model built on the meta device -- is *unknown*, not "not structurable": nanoGPT's
``bias[:, :, :T, :T] == 0`` is causal exactly when the buffer holds ``tril(ones)``, which only its values say.
It is planned as what it is here, a dense mask (never assumed causal), and the reason names the buffers.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from ..runtime.attention.empty_rows import soft_capped_attention, uniform_attention
from .graph import eliminate_dead_code, is_module_state, new_node, real_value, unused_impure, user_line, where
from ..runtime.attention.masks import MaskSpec
from .masks import MASKING_FILL, MaskData, Unstructurable, empty_rows_of, structure_mask, structure_mask_mod
from .ops import canonical, is_tensor_node, permutation, register_canonical, shape_of, size_key, value_of
from .report import Fallback

__all__ = ["captured_attention", "capture_attention", "dense_mask_of", "DenseMask", "DENSE_MASK"]

_FLEX_ATTENTION = torch.ops.higher_order.flex_attention
_VMAP_LEVEL = "_vmap_"
"""In the name of torch.vmap's level bookkeeping (``_vmap_increment_nesting`` / ``_vmap_decrement_nesting``), which
dynamo emits around a traced ``vmap`` (FlexAttention builds its default block mask with one): a pair must stay or go
together, so capture never removes one of them as dead code."""

DENSE_MASK = "autoshard_dense_mask"
"""``node.meta`` key of a captured attention whose mask stays dense: its :class:`DenseMask`."""


@dataclass(frozen=True)
class DenseMask:
    """Why an attention's mask stays dense (see the module docstring)."""

    reason: str
    unknown_buffers: tuple[str, ...] = ()
    """The module buffers the mask is computed from whose values are unknown (then the mask is unknown)."""


def dense_mask_of(q_len: int, k_len: int, causal: bool, window, key_mask, segment_ids, device,
                  chunk: int = 0) -> torch.Tensor | None:
    """The boolean [B|1, 1, Sq, Sk] mask a structured mask stands for (True = attend)."""
    qi = torch.arange(q_len, device=device)[:, None]
    ki = torch.arange(k_len, device=device)[None, :]
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        mask &= ki <= qi
    if window is not None:
        left, right = window
        if left >= 0:
            mask &= ki >= qi - left
        if right >= 0:
            mask &= ki <= qi + right
    if chunk:
        mask &= qi // chunk == ki // chunk
    mask = mask[None, None]
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :].bool()
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return mask


def captured_attention(q, k, v, key_mask=None, segment_ids=None, dense_mask=None, *, causal=False, window=None,
                       chunk=0, scale=None, softcap=0.0, dropout_p=0.0, empty_rows="zero", alibi_slopes=None,
                       position_bias=None, sinks=None):
    """Attention with a structured mask, on whole tensors (what one device computes). ``empty_rows``: what
    a row with no visible key gets (see :attr:`~autoshard.passes.masks.MaskData.empty_rows`). ``chunk``: chunked
    local attention (query i sees key j only if i // chunk == j // chunk; 0: none). ``softcap``: see the
    module docstring. ``alibi_slopes``: ALiBi, ``[H]`` slopes; every visible score gets ``slope[h] * (k - q)``
    after the cap. ``position_bias``: ``[H, 2R + 1]``, every visible score gets ``position_bias[h, k - q + R]``.
    ``sinks``: ``[H]`` attention sinks (gpt-oss), one more logit per row in the softmax, whose key has value 0."""
    structured = causal or window is not None or chunk or key_mask is not None or segment_ids is not None
    mask = (dense_mask_of(q.size(-2), k.size(-2), causal, window, key_mask, segment_ids, q.device, chunk)
            if structured else None)
    if dense_mask is not None:
        mask = dense_mask if mask is None else (mask & dense_mask if dense_mask.dtype == torch.bool
                                                else dense_mask.masked_fill(~mask, float("-inf")))
    if sinks is not None:
        return _with_sinks(q, k, v, mask, sinks, scale=scale, softcap=softcap, dropout_p=dropout_p)
    if alibi_slopes is not None or position_bias is not None:
        return _with_bias(q, k, v, mask, alibi_slopes, position_bias, scale=scale, softcap=softcap,
                          dropout_p=dropout_p, empty_rows=empty_rows)
    if softcap:
        return soft_capped_attention(q, k, v, mask, scale=1.0 / math.sqrt(q.size(-1)) if scale is None else scale,
                                     softcap=softcap, dropout_p=dropout_p, empty_rows=empty_rows)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=k.size(-3) != q.size(-3))
    if empty_rows != "zero" and mask is not None and mask.dtype == torch.bool:  # what the additive fill gives
        empty = ~mask.any(-1, keepdim=True)
        scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
        every_key = (uniform_attention(q, k, v, scale, k.size(-2)) if empty_rows == "uniform" else
                     F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=k.size(-3) != q.size(-3)))
        out = torch.where(empty, every_key.to(out.dtype), out)
    return out


def _with_sinks(q, k, v, mask, sinks, *, scale, softcap, dropout_p):
    """:func:`captured_attention` with attention sinks, written out as gpt-oss computes it: the sink logit joins
    every row's scores, the softmax runs over both, the sink's column is dropped (a row that sees no key gives
    0)."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    group = q.size(-3) // k.size(-3)
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], -1), dim=-1)[..., :-1]
    return F.dropout(probs, dropout_p).to(v.dtype) @ v


def _with_bias(q, k, v, mask, alibi_slopes, position_bias, *, scale, softcap, dropout_p, empty_rows):
    """:func:`captured_attention` with ALiBi or a relative-position bias: the bias in an additive mask. A hidden
    score gets finfo.min, not -inf (a row that sees no key then stays finite), and such a row gets what
    ``empty_rows`` says: 0, or the uniform attention finfo.min gives."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    distance = (torch.arange(k.size(-2), device=q.device) - torch.arange(q.size(-2), device=q.device)[:, None])
    additive = torch.zeros((), dtype=q.dtype, device=q.device)
    if alibi_slopes is not None:
        additive = additive + (alibi_slopes.view(-1, 1, 1) * distance.to(alibi_slopes.dtype)).to(q.dtype)
    if position_bias is not None:
        additive = additive + position_bias[:, distance + (position_bias.size(1) - 1) // 2].to(q.dtype)
    empty = None
    if mask is not None and mask.dtype == torch.bool:
        additive = torch.where(mask, additive, torch.finfo(q.dtype).min)
        empty = ~mask.any(-1, keepdim=True)
    elif mask is not None:
        additive = additive + mask
    if softcap:
        out = soft_capped_attention(q, k, v, additive, scale=scale, softcap=softcap, dropout_p=dropout_p)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, dropout_p=dropout_p, scale=scale,
                                             enable_gqa=k.size(-3) != q.size(-3))
    return torch.where(empty, 0.0, out) if empty is not None and empty_rows == "zero" else out


@register_canonical("attention", functions=[captured_attention])
def _bind_captured(q, k, v, key_mask=None, segment_ids=None, dense_mask=None, *, causal=False, window=None, chunk=0,
                   scale=None, softcap=0.0, dropout_p=0.0, empty_rows="zero", alibi_slopes=None, position_bias=None,
                   sinks=None):
    return {"q": q, "k": k, "v": v, "key_mask": key_mask, "segment_ids": segment_ids, "dense_mask": dense_mask,
            "causal": causal, "window": window, "chunk": chunk, "scale": scale, "softcap": softcap,
            "dropout_p": dropout_p, "empty_rows": empty_rows, "alibi_slopes": alibi_slopes,
            "position_bias": position_bias, "sinks": sinks, "captured": True}


# ----------------------------------------------------------------------------- pattern helpers


def _op(node):
    return canonical(node) if isinstance(node, fx.Node) else None


def _skip(node, names=("to", "identity")):
    """Follow ``node`` back through casts / copies."""
    while True:
        op = _op(node)
        if op is None or op.name not in names:
            return node
        node = op["input"]


def _unrepeat(k: fx.Node) -> fx.Node:
    """The un-repeated K/V behind HF's ``repeat_kv`` (unsqueeze -> expand -> reshape), else ``k`` itself."""
    op = _op(k)
    if op is None or op.name != "view":
        return k
    expanded = op["input"]
    e_op = _op(expanded)
    if e_op is None or e_op.name != "expand":
        return k
    unsq = e_op["input"]
    u_op = _op(unsq)
    if u_op is None or u_op.name not in ("view", "getitem"):
        return k
    base = _skip(u_op["input"], ("identity",))
    if base is None or not is_tensor_node(base):
        return k
    b_shape, u_shape, e_shape, k_shape = shape_of(base), shape_of(unsq), shape_of(expanded), shape_of(k)
    ok = (len(b_shape) == 4 and u_shape == b_shape[:2] + (1,) + b_shape[2:] and len(e_shape) == 5
          and e_shape[:2] == b_shape[:2] and e_shape[3:] == b_shape[2:]
          and k_shape == (b_shape[0], b_shape[1] * e_shape[2]) + b_shape[2:])
    return base if ok else k


def _transposed_last(node: fx.Node) -> fx.Node | None:
    """``x`` when ``node`` is ``x`` with its last two dims swapped."""
    op = _op(node)
    if op is None or op.name != "permute":
        return None
    perm = permutation(node)
    n = len(perm)
    return op["input"] if perm == list(range(n - 2)) + [n - 1, n - 2] else None


def _constant_scale(node: fx.Node):
    """(scores before scaling, scale) for ``scores * c`` / ``scores / c``; (node, 1.0) otherwise."""
    op = _op(node)
    if op is not None and op.name == "pointwise" and op["fn"] in ("mul", "div") and len(node.args) == 2:
        a, b = node.args
        if isinstance(b, (int, float)) and is_tensor_node(a):
            return a, (float(b) if op["fn"] == "mul" else 1.0 / float(b))
        if isinstance(a, (int, float)) and is_tensor_node(b) and op["fn"] == "mul":
            return b, float(a)
    return node, 1.0


def _soft_capped(node: fx.Node):
    """(scores before the cap, cap, factor) for ``tanh(x * a) * c`` with constants ``a`` and ``c > 0`` (any
    form :func:`_constant_scale` reads, so Gemma2's ``tanh(x / c) * c`` too): that is ``c * tanh(s / c)`` of
    ``s = x * (a * c)``, so ``a * c`` multiplies into the attention's scale. (node, 0.0, 1.0) otherwise."""
    capped, cap = _constant_scale(node)
    tanh = _skip(capped)
    t_op = _op(tanh)
    if cap <= 0.0 or t_op is None or t_op.name != "pointwise" or t_op["fn"] != "tanh":
        return node, 0.0, 1.0
    argument = tanh.args[0] if tanh.args else tanh.kwargs.get("input")  # torch.tanh(input=...) too
    if not is_tensor_node(argument):
        return node, 0.0, 1.0
    scores, inner = _constant_scale(_skip(argument))
    return scores, cap, inner * cap


def _masked(graph: fx.Graph, node: fx.Node, before: fx.Node):
    """(scores, mask node or None, fill or None): the masks an attention applies to its scores, as SDPA takes
    one (bool = attend, or an additive float mask), and the value masked scores are set to. Several (a bias
    added, then a causal ``masked_fill``: ALiBi) become one additive mask, the bias where every mask keeps."""
    scores, mask, fill = _masked_once(graph, node, before)
    while mask is not None:
        inner, inner_mask, inner_fill = _masked_once(graph, _skip(scores), before)
        if inner_mask is None or not _is_scores(inner):
            break
        with graph.inserting_before(before):
            mask = _combined(graph, inner_mask, mask, fill)
        scores, fill = inner, min(f for f in (fill, inner_fill, float("-inf")) if f is not None)
    return scores, mask, fill


def _is_scores(node: fx.Node) -> bool:
    """Whether ``node`` is ``q @ k^T``, maybe scaled and soft-capped (what a mask applies to)."""
    scores = _constant_scale(_skip(_soft_capped(_skip(node))[0]))[0]
    m_op = _op(scores)
    return m_op is not None and m_op.name == "matmul"


def _combined(graph: fx.Graph, inner, outer, fill):
    """One mask of two, as SDPA takes it: bool ones and'ed; with an additive one, the additive sum where the bool
    ones keep, ``fill`` (-inf when none) elsewhere."""
    bools = [m for m in (inner, outer) if value_of(m).dtype == torch.bool]
    floats = [m for m in (inner, outer) if value_of(m).dtype != torch.bool]
    keep = functools.reduce(lambda a, b: new_node(graph, operator.and_, (a, b)), bools) if bools else None
    additive = functools.reduce(lambda a, b: new_node(graph, operator.add, (a, b)), floats) if floats else None
    if additive is None:
        return keep
    if keep is None:
        return additive
    hidden = new_node(graph, operator.invert, (keep,))
    return new_node(graph, "masked_fill", (additive, hidden, fill if fill is not None else float("-inf")),
                    op="call_method")


def _masked_once(graph: fx.Graph, node: fx.Node, before: fx.Node):
    """:func:`_masked` of one mask."""
    op = _op(node)
    if op is None or op.name != "pointwise":
        return node, None, None
    fn = op["fn"]
    if fn == "add" and len(node.args) == 2 and all(is_tensor_node(a) for a in node.args):
        a, b = node.args
        return ((a, b) if shape_of(a) == shape_of(node) else (b, a)) + (None,)
    if (fn == "sub" and len(node.args) == 2 and not node.kwargs and all(is_tensor_node(a) for a in node.args)
            and shape_of(node.args[0]) == shape_of(node)):  # scores - bias: the mask is -bias
        with graph.inserting_before(before):
            negated = new_node(graph, operator.neg, (node.args[1],))
        return node.args[0], negated, None
    if fn == "masked_fill" and _is_masking_fill(node.args[2]):
        with graph.inserting_before(before):
            keep = new_node(graph, operator.invert, (node.args[1],))
        return node.args[0], keep, float(node.args[2])
    if fn == "where" and _is_masking_fill(node.args[2]) and is_tensor_node(node.args[1]):
        return node.args[1], node.args[0], float(node.args[2])
    return node, None, None


def _is_masking_fill(value) -> bool:
    """Whether a score set to ``value`` is masked out (:data:`~.masks.MASKING_FILL`)."""
    return isinstance(value, (int, float)) and value <= MASKING_FILL


def _sink_softmax(node: fx.Node):
    """(softmax, scores, sinks) when ``node`` is gpt-oss's attention sinks: ``softmax(cat([scores, sink], -1) -
    rowmax)[..., :-1]``, ``sink`` the ``[H]`` sink logits expanded to one column per row (the rowmax, which the
    softmax does not see, is optional); None otherwise."""
    if node.target is not operator.getitem or not is_tensor_node(node.args[0]):
        return None
    probs, index = _skip(node.args[0]), node.args[1]
    last = index[-1] if isinstance(index, tuple) else index
    if (not isinstance(last, slice) or last.start not in (None, 0) or last.stop != -1 or last.step not in (None, 1)
            or not all(i is Ellipsis or i == slice(None) for i in (index[:-1] if isinstance(index, tuple) else ()))
            or (Ellipsis not in index if isinstance(index, tuple) else False) and len(index) != len(shape_of(probs))):
        return None
    s_op = _op(probs)
    if s_op is None or s_op.name != "softmax" or s_op["dim"] % len(shape_of(probs)) != len(shape_of(probs)) - 1:
        return None
    combined = _skip(s_op["input"])
    if combined.target is operator.sub and _is_rowmax(combined.args[1], combined.args[0]):
        combined = combined.args[0]
    if combined.target is not torch.cat or len(combined.args[0]) != 2:
        return None
    dim = combined.args[1] if len(combined.args) > 1 else combined.kwargs.get("dim", 0)
    if dim % len(shape_of(combined)) != len(shape_of(combined)) - 1:
        return None
    scores, column = combined.args[0]
    sinks = column
    while True:  # back through the expand and the views (reshape, unsqueeze, x[None, :, None, None]) that made it
        op = _op(sinks)
        if op is not None and op.name in ("expand", "view", "identity", "to"):
            sinks = op["input"]
        elif sinks.target is operator.getitem and all(i is None or i == slice(None) for i in (
                sinks.args[1] if isinstance(sinks.args[1], tuple) else (sinks.args[1],))):
            sinks = sinks.args[0]
        else:
            break
    if not is_tensor_node(sinks) or shape_of(sinks) != (shape_of(scores)[-3],) or shape_of(column)[-1] != 1:
        return None
    return probs, scores, sinks


def _is_rowmax(node, of: fx.Node) -> bool:
    """Whether ``node`` is ``of.max(dim=-1, keepdim=True)`` (its values) or ``of.amax(-1, keepdim=True)``."""
    if not isinstance(node, fx.Node):
        return False
    if node.target is operator.getitem and node.args[1] == 0:
        node = node.args[0]
    if node.target not in ("max", "amax", torch.max, torch.amax) or node.args[0] is not of:
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
    return isinstance(dim, int) and dim % len(shape_of(of)) == len(shape_of(of)) - 1 and bool(keep)


def _handwritten(graph: fx.Graph, node: fx.Node):
    """(q, k, v, mask, scale, softcap, dropout_p, fill, sinks) when ``node`` is ``matmul(softmax(scores), v)`` (or
    gpt-oss's softmax with attention sinks, :func:`_sink_softmax`); a string saying what did not match when ``node``
    is ``matmul(softmax(x), v)`` but ``x`` is not scaled (and maybe soft-capped) ``q @ k^T`` plus a mask (an
    attention that cannot be captured); None otherwise."""
    op = _op(node)
    if op is None or op.name != "matmul":
        return None
    probs, v = op["a"], op["b"]
    probs = _skip(probs)
    dropout_p = 0.0
    d_op = _op(probs)
    if d_op is not None and d_op.name == "dropout":
        dropout_p = float(d_op["p"]) if d_op["training"] else 0.0
        probs = _skip(d_op["input"])
    with_sinks = _sink_softmax(probs)
    probs, scores, sinks = with_sinks if with_sinks is not None else (probs, None, None)
    s_op = _op(probs)
    if s_op is None or s_op.name != "softmax" or "log" in str(probs.target):
        return None
    if s_op["dim"] % len(shape_of(probs)) != len(shape_of(probs)) - 1:
        return None
    scores, mask, fill = _masked(graph, _skip(scores if sinks is not None else s_op["input"]), node)
    scores, softcap, cap_factor = _soft_capped(_skip(scores))
    scores, scale = _constant_scale(_skip(scores))
    scale *= cap_factor
    m_op = _op(scores)
    if m_op is None or m_op.name != "matmul":
        what = m_op.get("fn", m_op.name) if m_op is not None else str(scores.target)
        return (f"{node.name} looks like attention (matmul of a softmax over keys) but its scores go through "
                f"{what} ({scores.name}), which distributed attention does not support")
    q, kt = m_op["a"], m_op["b"]
    k = _transposed_last(kt)
    if k is None or not all(is_tensor_node(t) and len(shape_of(t)) == 4 for t in (q, k, v)):
        return None
    return q, k, v, mask, scale, softcap, dropout_p, fill, sinks


def _unknown_buffers(mask) -> tuple[str, ...]:
    """The module buffers ``mask`` is computed from whose values are unknown (fake or meta tensors, or values no
    longer kept), by dynamo's source name while it is known, else by their node's name."""
    names, seen, todo = [], set(), [mask]
    while todo:
        node = todo.pop()
        if not isinstance(node, fx.Node) or node in seen:
            continue
        seen.add(node)
        todo.extend(node.all_input_nodes)
        if node.op == "get_attr":
            value = functools.reduce(getattr, node.target.split("."), node.graph.owning_module)
        elif is_module_state(node):
            value = real_value(node)
        else:
            continue
        if value is not None and not isinstance(value, torch.Tensor):
            continue
        known = value is not None and not isinstance(value, FakeTensor) and not value.is_meta
        if not known and not getattr(value_of(node), "requires_grad", False):  # a parameter is no mask
            source = getattr(node.meta.get("grapharg"), "source", None)
            name = source.name if source is not None else node.target if node.op == "get_attr" else node.name
            names.append(name() if callable(name) else name)
    return tuple(sorted(names))


def _dense(reason: str, mask) -> DenseMask:
    """Why ``mask`` stays dense, ``reason`` being why it could not be structured."""
    unknown = _unknown_buffers(mask)
    if isinstance(mask, fx.Node) and mask.op == "placeholder" and not is_module_state(mask):
        reason = ("its mask is an input of this graph made by code autoshard did not compile (per-block compilation "
                  "with the mask built outside the blocks): only a dense value arrives, and its values are not a "
                  "causal mask of documents, padding and a window (a [B, 1, S, S] mask is checked on every call, "
                  "autoshard.passes.dense_masks). Compile the code that builds the mask with the same backend (the "
                  "model whole, or the function that builds it): a mask an autoshard graph makes reaches the next "
                  "graph as the recipe it is made by")
    if unknown:
        reason = (f"its mask is computed from module state {', '.join(unknown)}, whose values are unknown here (a "
                  f"model on the meta device): planned as a dense mask; plan the model with its buffers' values "
                  f"(built on the CPU) to see the mask they hold")
    return DenseMask(reason, unknown)


def _capture_flex(gm: fx.GraphModule, node: fx.Node) -> fx.Node | str:
    """``flex_attention(q, k, v, score_mod, block_mask, scale, ...)`` (dynamo's higher-order op) as a
    ``captured_attention`` that replaces its output, its ``mask_mod`` and ``score_mod`` read as structure
    (:func:`~.masks.structure_mask_mod`); the reason when it cannot be (it stays as it is, computed whole)."""
    q, k, v, score_mod, block_mask, scale = node.args[:6]
    score_buffers, mask_buffers = node.args[7], node.args[8]
    where = f"flex_attention {node.name} (at {user_line(node)})"
    uses = {user.args[1]: user for user in node.users if user.target is operator.getitem}
    if len(uses) != len(node.users) or any(i != 0 and user.users for i, user in uses.items()):
        return f"{where}: its log-sum-exp is used, which the distributed attention does not return"
    if not all(is_tensor_node(t) and len(shape_of(t)) == 4 for t in (q, k, v)):
        return f"{where}: queries, keys or values are not [B, H, S, D]"
    mask_mod = getattr(gm, block_mask[-1].target) if isinstance(block_mask[-1], fx.Node) else None
    try:
        spec, data, softcap = structure_mask_mod(gm.graph, node, mask_mod, mask_buffers,
                                                 getattr(gm, score_mod.target), score_buffers, shape_of(q)[-2],
                                                 shape_of(k)[-2], shape_of(q)[0], shape_of(q)[-3])
    except Unstructurable as exc:
        return f"{where}: its mask_mod / score_mod cannot be read as structure ({exc})"
    kwargs = {"causal": spec.causal, "window": spec.window_arg, "chunk": spec.chunk, "scale": float(scale),
              "softcap": softcap, "empty_rows": "zero"}
    kwargs.update({key: value for key in ("alibi_slopes", "position_bias") if (value := getattr(data, key)) is not None})
    out = uses.get(0)
    with gm.graph.inserting_before(node):
        new = new_node(gm.graph, captured_attention, (q, k, v, data.key_mask, data.segment_ids, None), kwargs,
                       example_value=value_of(out) if out is not None else None)
    new.meta["stack_trace"] = node.meta.get("stack_trace")
    for user in uses.values():
        user.replace_all_uses_with(new)
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    return new


def _pinned_rows(graph: fx.Graph, out: fx.Node, data: MaskData, values: fx.Node) -> fx.Node:
    """``out`` with the rows where ``data.query_mask`` is False set to key ``data.pinned_key``'s value: the rows
    that see that key alone (softmax over one score is exactly 1, so SDPA's output there is the value itself, and
    its gradient goes to that value alone)."""
    rank = len(shape_of(out))
    index = (slice(None),) + (None,) * (rank - 3) + (slice(None), None)
    rows = new_node(graph, operator.getitem, (data.query_mask, index))
    value = new_node(graph, torch.narrow, (values, -2, data.pinned_key, 1))
    return new_node(graph, torch.where, (rows, out, value))


def capture_attention(gm: fx.GraphModule, missed: list[Fallback] | None = None) -> list[tuple[fx.Node, str | None]]:
    """Replace every attention of ``gm`` by ``captured_attention``; returns (node, reason the mask stayed dense).
    Attention-like patterns that could not be captured are appended to ``missed`` as fallbacks: they run whole."""
    graph = gm.graph
    keep = unused_impure(graph) | {n for n in graph.nodes if _VMAP_LEVEL in str(n.target)}
    captured = []
    mask_cache: dict[tuple, tuple[MaskSpec, MaskData] | DenseMask] = {}
    for node in list(graph.nodes):
        op = _op(node)
        if node.op == "call_function" and node.target is _FLEX_ATTENTION:
            found = _capture_flex(gm, node)
            if isinstance(found, str):
                if missed is not None:
                    missed.append(Fallback(node.name, "flex_attention", f"{found} ({where(node)})"))
            else:
                captured.append((found, None))
            continue
        if op is not None and op.name == "attention" and node.target is not captured_attention:
            q, k, v = op["q"], op["k"], op["v"]
            mask, causal, scale, dropout_p = op["attn_mask"], bool(op["is_causal"]), op["scale"], float(op["dropout_p"])
            fill, softcap, sinks = None, 0.0, None
        elif op is not None and op.name == "matmul":
            found = _handwritten(graph, node)
            if isinstance(found, str) and missed is not None:
                missed.append(Fallback(node.name, "matmul", f"{found} ({where(node)})"))
            if not isinstance(found, tuple):
                continue
            q, k, v, mask, scale, softcap, dropout_p, fill, sinks = found
            causal = False
        else:
            continue
        values = v  # with as many heads as the queries: what a row that sees one key alone returns
        k, v = _unrepeat(k), _unrepeat(v)
        q_len, k_len, batch = shape_of(q)[-2], shape_of(k)[-2], shape_of(q)[0]
        key = (mask, causal, size_key(q_len), size_key(k_len))
        if key not in mask_cache:
            try:
                mask_cache[key] = structure_mask(graph, node, mask, causal, q_len, k_len, batch, shape_of(q)[-3])
            except Unstructurable as exc:
                mask_cache[key] = _dense(str(exc), mask)
        structured = mask_cache[key]
        dense = why_dense = None
        if isinstance(structured, DenseMask):
            why_dense, dense, structured = structured, mask, (MaskSpec(causal=causal), MaskData())
        spec, data = structured
        kwargs = {"causal": spec.causal, "window": spec.window_arg, "chunk": spec.chunk,
                  "scale": float(scale) if scale is not None else 1.0 / math.sqrt(shape_of(q)[-1]),
                  "softcap": softcap, "dropout_p": dropout_p,
                  # with sinks a row that sees no key gives 0 whatever its scores are filled with: the sink takes it
                  "empty_rows": "zero" if sinks is not None else empty_rows_of(fill) if fill is not None
                  else data.empty_rows}
        if sinks is not None:
            kwargs["sinks"] = sinks
        if data.alibi_slopes is not None:
            kwargs["alibi_slopes"] = data.alibi_slopes
        if data.position_bias is not None:
            kwargs["position_bias"] = data.position_bias
        with graph.inserting_before(node):
            new = new_node(graph, captured_attention, (q, k, v, data.key_mask, data.segment_ids, dense), kwargs,
                           example_value=value_of(node))
        if node.meta.get("stack_trace"):
            new.meta["stack_trace"] = node.meta["stack_trace"]
        if why_dense is not None:
            new.meta[DENSE_MASK] = why_dense
        result = new
        if data.query_mask is not None:
            with graph.inserting_before(node):
                result = _pinned_rows(graph, new, data, values)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        captured.append((new, why_dense.reason if why_dense is not None else None))
    eliminate_dead_code(graph, keep)
    return captured

