"""The captured attention: where sequence families start, and where distributed attention runs.

Link: the query's sequence dim seeds a family (the first attention of a model is its root), the keys'
too; self-attention (equal lengths) ties queries and keys together; key masks and segment ids are
per-key positions.

Rewrite: with queries, keys and values split along one layout and a structured mask, the call becomes
``torch.ops.autoshard.attention`` with the strategy chosen for it (``rw.strategies``); soft-capped
scores (``softcap``, Gemma2), chunked local attention (``chunk``, Llama-4; its hidden blocks are
skipped, see :mod:`autoshard.runtime.attention`) and ALiBi slopes pass through to it. Dropout on the
probabilities does too, with a seed drawn in the graph (``autoshard::attention_seed``) and a mask hashed from
global positions: the same for every strategy and world size, not the one-process mask (see
:mod:`autoshard.runtime.attention.dropout`). An attention that keeps a dense mask (one the mask pass could not
structure) runs on gathered keys and values with this rank's rows of the mask, unless its scores are
soft-capped or dropped out; those, and one whose keys are another sequence, run on whole tensors. Both are
recorded in the plan.

Mixed precision: the distributed op gets queries, keys and values in the dtype the one-device attention
computed in (its output's): under ``torch.autocast`` SDPA and a hand-written attention's matmuls cast
their inputs, a custom op is not cast, so the rewrite emits the casts. The op computes in the dtype it
is given (its blocks accumulate and merge in float32), as a fused kernel does.

Rows that see no key under an additive mask (:func:`fill_empty_rows`) get what one device gives them.
Such rows can sit on some ranks only (left padding under a causal mask leaves the first rank's rows
empty), so every rank takes the same path whatever its own rows are: a ~finfo.min fill is always
computed from all-reduced sums; for a milder fill (or soft-capped scores) the ranks first all-reduce
whether any row anywhere is empty (one integer), and only then all gather the keys and values,
together. That decision is a branch on a value, so it runs inside the custom op
``autoshard::fill_gathered_empty_rows``, opaque to AOTAutograd and Inductor; its backward recomputes the
forward (the same collectives, in the same order on every rank) and differentiates it.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from ...placements import REPLICATE, Shard
from ...runtime.collectives import all_gather, all_reduce
from ...runtime.attention import STRATEGIES, formulas
from ...runtime.attention import dropout as _dropout  # noqa: F401 -- defines autoshard::attention_seed
from ...runtime.attention.api import OpConfig
from ...runtime.attention.local import without_autocast
from ...strategy import attention_shape
from ..comms import declares
from ..ops import op_of, shape_of, value_of
from . import register
from .pointwise import OUTPUT_WHOLE, run_whole, whole_args

__all__ = ["uniform_attention", "soft_capped_attention", "attend_to_every_key", "fill_empty_rows"]


def uniform_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, length: int,
                      total=lambda t: t) -> torch.Tensor:
    """Attention in which every score is equal -- what softmax gives rows whose scores all round to an
    additive mask's ~finfo.min fill. The value is the mean of ``v`` over all ``length`` keys; the gradient is
    softmax's at equal scores (the scores still depend on q and k for autograd), written with the
    first-order expansion ``p_j = (1 + e_j - mean(e)) / length`` of zero-valued ``e = s - s.detach()``, which
    has exactly that value and that gradient. ``total`` sums a per-rank partial over ranks (the keys are
    split), identity on one device."""
    group_size = q.size(-3) // k.size(-3)
    expand = lambda t: t.repeat_interleave(group_size, dim=-3)  # noqa: E731  kv heads -> query heads
    kv = expand(total(torch.einsum("bhsd,bhse->bhde", k, v.detach())))  # the scores' part: no gradient to v
    k_mean = expand(total(k.sum(-2, keepdim=True))) / length
    v_mean = expand(total(v.sum(-2, keepdim=True))) / length
    first = torch.einsum("bhsd,bhde->bhse", q, kv) * (scale / length)
    centre = (q * k_mean).sum(-1, keepdim=True) * scale
    return v_mean + (first - first.detach()) - (centre - centre.detach()) * v_mean


def soft_capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                          scale: float, softcap: float, dropout_p: float = 0.0,
                          empty_rows: str = "zero") -> torch.Tensor:
    """Attention whose scaled scores ``s`` become ``softcap * tanh(s / softcap)`` before the mask (Gemma2), on
    whole tensors with the scores materialized (SDPA has no soft-cap). ``mask``: bool (True = attend), an
    additive float mask, or None. A row a bool mask hides entirely gets what ``empty_rows`` says (see
    :class:`~autoshard.passes.masks.StructuredMask`): 0 (``"zero"``), uniform attention to every key with
    the gradient softmax has at equal scores (``"uniform"``, a ~finfo.min fill), or attention with the
    unmasked scores (``"scores"``, a milder fill)."""
    group_size = q.size(-3) // k.size(-3)
    k, v = (t.repeat_interleave(group_size, dim=-3) for t in (k, v))
    s = q @ k.transpose(-1, -2) * scale
    s = softcap * torch.tanh(s / softcap)
    empty = None
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask
    elif mask is not None:
        empty = ~mask.any(-1, keepdim=True)
        on_empty_rows = s - s.detach() if empty_rows == "uniform" else s if empty_rows == "scores" else 0.0
        s = torch.where(empty, on_empty_rows, s.masked_fill(~mask, float("-inf")))
    p = torch.softmax(s, -1, dtype=torch.promote_types(s.dtype, torch.float32)).to(q.dtype)
    if empty is not None and empty_rows == "zero":
        p = p.masked_fill(empty, 0.0)
    if dropout_p:
        p = F.dropout(p, dropout_p)
    return p @ v


def attend_to_every_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float,
                        sizes: list[int], group: str, uniform: bool) -> torch.Tensor:
    """Unmasked attention of this rank's queries to every key -- what softmax gives a row whose scores are all
    shifted by the same mild fill -- or, when ``uniform``, the uniform attention of a ~finfo.min fill with
    its gradient (for soft-capped scores, which :func:`uniform_attention` cannot serve). Keys and values
    are gathered in rank order (``sizes``: every rank's number of keys), which softmax does not mind;
    all_gather's backward sums every rank's share of their gradient."""
    keys, values = (all_gather(t, -2, group=group, sizes=sizes) for t in (k, v))
    if softcap:  # rows that see no key, given what the fill gives them
        no_key_visible = torch.zeros((), dtype=torch.bool, device=q.device).expand(*q.shape[:-1], keys.size(-2))
        return soft_capped_attention(q, keys, values, no_key_visible, scale=scale, softcap=softcap,
                                     empty_rows="uniform" if uniform else "scores")
    return F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=k.size(-3) != q.size(-3))


def _anywhere(flags: torch.Tensor, group: str) -> bool:
    """Whether any element of ``flags`` is set on any rank: the same answer on every rank."""
    return bool(all_reduce(flags.any().to(torch.int32).reshape(1), "max", group=group))


def _gathers_for_empty_rows(mode: str, softcap: float) -> bool:
    """Whether :func:`fill_empty_rows` asks if any row is empty and gathers the keys only then (a mild fill, or
    soft-capped scores), rather than always computing :func:`uniform_attention` from all-reduced sums."""
    return mode == "scores" or bool(softcap)


def fill_empty_rows(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float, softcap: float, sizes: list[int], mode: str, group: str) -> torch.Tensor:
    """Query rows that see no key, as an additive mask makes them (``sizes``: every rank's number of keys):
    ``"uniform"`` (a ~finfo.min fill) attends uniformly to all keys (:func:`uniform_attention`); ``"scores"``
    (a milder fill) attends to all keys with the unmasked scores (:func:`attend_to_every_key`), gathering
    them only when some rank has such a row. With soft-capped scores (``softcap``) the uniform rows'
    gradient goes through each key's cap, so they too are computed on gathered keys, only when some rank
    has such a row (through ``autoshard::fill_gathered_empty_rows``)."""
    if _gathers_for_empty_rows(mode, softcap):
        return torch.ops.autoshard.fill_gathered_empty_rows(out, lse, q, k, v, scale, softcap, sizes, mode, group)
    empty = torch.isneginf(lse).unsqueeze(-1)
    # the sums feed this rank's rows: their gradients are per-rank shares, summed by all_reduce's backward
    uniform = uniform_attention(q, k, v, scale, sum(sizes), lambda t: all_reduce(t, "sum", group=group))
    return torch.where(empty, uniform.to(out.dtype), out)


def _fill_gathered(out, lse, q, k, v, scale, softcap, sizes, mode, group) -> torch.Tensor:
    """The gathering branch of :func:`fill_empty_rows`, as plain autograd code."""
    empty = torch.isneginf(lse).unsqueeze(-1)
    if not _anywhere(empty, group):
        return out
    every_key = attend_to_every_key(q, k, v, scale, softcap, sizes, group, uniform=mode == "uniform")
    return torch.where(empty, every_key.to(out.dtype), out)


def _own_storage(result: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``result``, copied when it shares storage with an input (a custom op's outputs may not alias)."""
    ptr = result.untyped_storage().data_ptr()
    return result.clone() if any(t.untyped_storage().data_ptr() == ptr for t in inputs) else result


@torch.library.custom_op("autoshard::fill_gathered_empty_rows", mutates_args=())
def _fill_gathered_op(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float, softcap: float, sizes: list[int], mode: str, group: str) -> torch.Tensor:
    with without_autocast(q):
        result = _fill_gathered(out, lse, q, k, v, scale, softcap, sizes, mode, group).contiguous()
    return _own_storage(result, out, lse, q, k, v)


@_fill_gathered_op.register_fake
def _(out, lse, q, k, v, scale, softcap, sizes, mode, group):
    return out.new_empty(out.shape)


def _autograd_inside_op():
    """Autograd on again inside a custom op's kernel, which the dispatcher runs below autograd (the autograd
    keys excluded, grad mode off), so the recomputed forward records a graph to differentiate."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradOther, keys.AutogradNestedTensor, keys.AutogradFunctionality):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


@torch.library.custom_op("autoshard::fill_gathered_empty_rows_backward", mutates_args=())
def _fill_gathered_backward_op(grad: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor,
                               k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float, sizes: list[int],
                               mode: str, group: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for ``out``, ``q``, ``k``, ``v``: the forward recomputed with autograd and differentiated
    (every rank takes the same branch, so the collectives and their backwards match)."""
    with torch.enable_grad(), _autograd_inside_op(), without_autocast(q):
        inputs = [t.detach().requires_grad_() for t in (out, q, k, v)]
        result = _fill_gathered(inputs[0], lse, *inputs[1:], scale, softcap, sizes, mode, group)
        grads = torch.autograd.grad(result, inputs, grad, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else _own_storage(g.contiguous(), grad, out, lse, q, k, v)
                 for g, t in zip(grads, inputs))


@_fill_gathered_backward_op.register_fake
def _(grad, out, lse, q, k, v, scale, softcap, sizes, mode, group):
    return tuple(t.new_empty(t.shape) for t in (out, q, k, v))


def _fill_gathered_setup(ctx, inputs, output):
    out, lse, q, k, v, *ctx.options = inputs
    ctx.save_for_backward(out, lse, q, k, v)


def _fill_gathered_backward(ctx, grad):
    d_out, dq, dk, dv = torch.ops.autoshard.fill_gathered_empty_rows_backward(grad, *ctx.saved_tensors, *ctx.options)
    return (d_out, None, dq, dk, dv) + (None,) * len(ctx.options)


_fill_gathered_op.register_autograd(_fill_gathered_backward, setup_context=_fill_gathered_setup)


@declares(torch.ops.autoshard.attention.default)
def _attention_traffic(book, call) -> None:
    """The attention's own traffic, forward and (when its inputs need gradients) backward: the exact bytes of
    every rank (uneven shards and head splits included) and the strategy's formula."""
    strategy, layout = call.arguments["strategy"], call.layout()
    s = attention_shape(call.value, layout.length)
    sizes = dict(B=s.batch, H=s.heads, Hkv=s.kv_heads, D=s.head_dim, Dv=s.dv, dtype=s.dtype, key_mask=s.key_mask,
                 segment_ids_dtype=s.segment_ids_dtype, P_u=book.heads_axis_size)  # read by 2-D mesh strategies only
    for phase in call.phases:
        book.attention(call.value.name, strategy, phase,
                       formulas.bytes_sent_by_rank(strategy, phase, layout.local_lengths, **sizes),
                       formulas.bytes_sent(strategy, phase))


@declares(fill_empty_rows)
def _empty_row_traffic(book, call) -> None:
    """What :func:`fill_empty_rows` always sends: the three all-reduces of :func:`uniform_attention` (and their
    backward), or the one-integer all-reduce that asks whether any rank has an empty row (the gather that
    follows when one has is not planned for)."""
    if _gathers_for_empty_rows(call.arguments["mode"], call.arguments["softcap"]):
        book.all_reduce(call.value.name, 1, 4, "forward", "any row with no visible key")
        return
    op = op_of(call.value)
    k, v = value_of(op["k"]), value_of(op["v"])
    b, hkv, d, dv = k.shape[0], k.shape[1], k.shape[3], v.shape[3]
    for numel in (b * hkv * d * dv, b * hkv * d, b * hkv * dv):
        for phase in call.phases:
            book.all_reduce(call.value.name, numel, call.itemsize, phase,  # the attention's dtype
                            "rows with no visible key")


def link_attention(ctx, node, op):
    q, k, v = op["q"], op["k"], op["v"]
    ctx.set_factorization(node, [list(f) for f in ctx.factorization(q)[:3]] + [[shape_of(node)[-1]]])
    for d in range(3):
        ctx.link_dims(node, d, q, d)
    ctx.link_dims(k, 2, v, 2)
    if shape_of(q)[2] == shape_of(k)[2]:
        ctx.link_dims(q, 2, k, 2)
    for per_key in (op.get("key_mask"), op.get("segment_ids")):
        if per_key is not None:
            ctx.link_dims(per_key, 1, k, 2)
    dense = op.get("dense_mask")
    if dense is not None:
        nd = len(shape_of(dense))
        ctx.link_dims(dense, nd - 2, q, 2)
    ctx.seed((q, 2, 0), node)
    ctx.seed((k, 2, 0), node)


def rewrite_attention(rw, node, op):
    q, k, v = op["q"], op["k"], op["v"]
    sq, sk, out = rw.out_shard(q), rw.out_shard(k), rw.out_shard(node)
    dense, dropout_p = op.get("dense_mask"), float(op.get("dropout_p") or 0.0)
    softcap = float(op.get("softcap") or 0.0)
    distributable = (sq is not None and sk is not None and out is not None and sq == sk and out == sq
                     and sq.dim == 2 and not sq.factors and dense is None)
    if distributable:
        strategy = rw.strategies[node]
        window = op.get("window")
        args = [rw.in_dtype_of(node, t, rw.input(t, s)) for t, s in ((q, sq), (k, sk), (v, sk))]
        per_key = Shard(1, sk.layout)
        args += [rw.input(t, per_key) if t is not None else None for t in (op.get("key_mask"), op.get("segment_ids"))]
        slopes, bias = op.get("alibi_slopes"), op.get("position_bias")
        args.append(rw.input(slopes, REPLICATE) if slopes is not None else None)
        args.append(rw.input(bias, REPLICATE, partial_grad=True) if bias is not None else None)  # a rank's share
        args.append(rw.call(torch.ops.autoshard.attention_seed.default, node.name, value_of(q).device)
                    if dropout_p else None)
        # a 2-D mesh strategy's (the hybrid's) group is its Ulysses axis; the layout spans the whole (flattened) mesh
        groups = (rw.heads_group, rw.ring_group) if STRATEGIES[strategy].mesh_groups else (rw.group, "")
        config = OpConfig(strategy, sq.layout.encode(), *groups, bool(op.get("causal")),
                          window[0] if window else -1, window[1] if window else -1, int(op.get("chunk") or 0),
                          float(op["scale"]), softcap, dropout_p, rw.config.kernels)
        call = rw.call(torch.ops.autoshard.attention.default, *args, *config.args())
        result = rw.call(operator.getitem, call, 0)
        empty_rows = op.get("empty_rows", "zero")
        if empty_rows != "zero":
            lse = rw.call(operator.getitem, call, 1)
            result = rw.call(fill_empty_rows, result, lse, *args[:3], float(op["scale"]), softcap,
                             list(sq.layout.local_lengths), empty_rows, rw.group)
        rw.done(node, result, out)
        rw.report.attention.append({"node": node.name, "strategy": strategy, "layout": sq.layout.kind,
                                    "length": sq.layout.length, "causal": bool(op.get("causal")),
                                    "window": window, "chunk": int(op.get("chunk") or 0),
                                    "key_mask": op.get("key_mask") is not None,
                                    "segment_ids": op.get("segment_ids") is not None, "softcap": softcap,
                                    "alibi": slopes is not None, "position_bias": bias is not None,
                                    "dropout": dropout_p,
                                    "dtype": str(value_of(node).dtype).removeprefix("torch.")})
        return
    structured = (op.get("causal") or op.get("window") or op.get("chunk") or op.get("key_mask")
                  or op.get("segment_ids"))
    if (dense is not None and dropout_p == 0.0 and not softcap and out is not None and out.dim == 2
            and not out.factors and not structured):
        reason = "attention with a mask that is not causal / window / padding / segments"
        nd = len(shape_of(dense))
        mask_rows = out.moved(nd - 2) if shape_of(dense)[nd - 2] == shape_of(q)[2] else REPLICATE
        new = rw.call(F.scaled_dot_product_attention, rw.input(q, out),
                      rw.input(k, REPLICATE, partial_grad=True, expected=False, reason=reason),
                      rw.input(v, REPLICATE, partial_grad=True, expected=False, reason=reason),
                      attn_mask=rw.input(dense, mask_rows), scale=float(op["scale"]),
                      enable_gqa=shape_of(k)[1] != shape_of(q)[1])
        rw.done(node, new, out)
        rw.report.attention.append({"node": node.name, "strategy": "gathered-kv", "reason": reason})
        return
    reason = ("attention with dropout and a mask that is not causal / window / padding / segments"
              if dense is not None and dropout_p else
              "attention with soft-capped scores and a mask that is not causal / window / padding / segments"
              if dense is not None and softcap else
              "attention whose keys are not the queries' sequence" if sq is not None and sq != sk else
              "attention outside any sequence family")
    if out is not None or sq is not None or sk is not None:
        rw.report.attention.append({"node": node.name, "strategy": "whole", "reason": reason})
        whole = rw.reemit(node, *whole_args(rw, node, reason))
        rw.done(node, rw.shard_value(node, whole, out) if out is not None else whole, out or REPLICATE)
        return
    run_whole(rw, node, OUTPUT_WHOLE, expected=True)


register("attention", link=link_attention, rewrite=rewrite_attention)
