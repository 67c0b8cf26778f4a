"""The captured attention: where sequence families start, and where distributed attention runs.

Link: the query's sequence dim seeds a family (the first attention of a model is its root);
self-attention (equal lengths) ties queries and keys together; key masks and segment ids are per-key
positions. Cross-attention's keys (another length) are split only where their own sequence is seeded (an
encoder's self-attention), so a DiT's text stays whole on every rank.

Rewrite: with queries, keys and values split along one layout and a structured mask, the call becomes
``torch.ops.autoshard.attention`` with the strategy chosen for it (``rw.strategies``); soft-capped
scores (``softcap``, Gemma2), chunked local attention (``chunk``, Llama-4; its hidden blocks are
skipped, see :mod:`autoshard.runtime.attention`) and ALiBi slopes pass through to it. Dropout on the
probabilities does too, with a seed drawn in the graph (``autoshard::attention_seed``) and a mask hashed from
global positions: the same for every strategy and world size, not the one-process mask (see
:mod:`autoshard.runtime.attention.dropout`). An attention that keeps a dense mask (one the mask pass could not
structure) runs on gathered keys and values with this rank's rows of the mask, unless its scores are
soft-capped or dropped out; those run on whole tensors. Cross-attention (keys of another sequence, and no
term relating query and key positions) runs on this rank's queries and all the keys: no traffic when the keys
are whole, a gather of them when they are split along their own sequence. All are recorded in the plan.

Mixed precision: the distributed op gets queries, keys and values in the dtype the one-device attention
computed in (its output's): under ``torch.autocast`` SDPA and a hand-written attention's matmuls cast
their inputs, a custom op is not cast, so the rewrite emits the casts. The op computes in the dtype it
is given (its blocks accumulate and merge in float32), as a fused kernel does.

Rows that see no key under an additive mask get what one device gives them: the rule emits
:func:`~autoshard.runtime.attention.empty_rows.fill_empty_rows` after the op, which every rank runs alike
(those rows can sit on some ranks only) and whose all-reduces, or the one-integer question that precedes
a gather, are declared here (``TRAFFIC``).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from ...placements import REPLICATE, Shard
from ...runtime.attention import STRATEGIES
from ...runtime.attention import dropout as _dropout  # noqa: F401 -- defines autoshard::attention_seed
from ...runtime.attention.api import OpConfig
from ...runtime.attention.base import bytes_sent, bytes_sent_by_rank
from ...runtime.attention.empty_rows import fill_empty_rows, gathers_for_empty_rows
from ...strategy import attention_shape
from ..capture import DENSE_MASK
from ..comms import declares
from ..graph import user_line
from ..ops import op_of, shape_of, value_of
from .registry import register
from .pointwise import OUTPUT_WHOLE, mapped_args, run_whole, whole_args

__all__: list[str] = []  # the rules register themselves on import; nothing here is called from outside


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
                       bytes_sent_by_rank(strategy, phase, layout.local_lengths, **sizes), bytes_sent(strategy, phase))


@declares(fill_empty_rows)
def _empty_row_traffic(book, call) -> None:
    """What :func:`fill_empty_rows` always sends: the three all-reduces of ``uniform_attention`` (and their
    backward), or the one-integer all-reduce that asks whether any rank has an empty row (the gather that
    follows when one has is not planned for)."""
    if gathers_for_empty_rows(call.arguments["mode"], call.arguments["softcap"]):
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
    if shape_of(q)[2] == shape_of(k)[2]:  # another sequence's keys (a DiT's text) are split where they are seeded
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
        slopes, bias, sinks = op.get("alibi_slopes"), op.get("position_bias"), op.get("sinks")
        args.append(rw.input(slopes, REPLICATE) if slopes is not None else None)
        for term in (bias, sinks):  # learned: each rank's gradient is its queries' share
            args.append(rw.input(term, REPLICATE, partial_grad=True) if term is not None else None)
        args.append(rw.call(torch.ops.autoshard.attention_seed.default, node.name, value_of(q).device)
                    if dropout_p else None)
        # a 2-D mesh strategy's (the hybrid's) group is its Ulysses axis; the layout spans the whole (flattened) mesh
        groups = (rw.groups.heads, rw.groups.ring) if STRATEGIES[strategy].mesh_groups else (rw.groups.sequence, "")
        config = OpConfig(strategy, sq.layout.encode(), *groups, bool(op.get("causal")),
                          window[0] if window else -1, window[1] if window else -1, int(op.get("chunk") or 0),
                          float(op["scale"]), softcap, dropout_p, rw.config.kernels, rw.config.head_chunks)
        call = rw.call(torch.ops.autoshard.attention.default, *args, *config.args())
        result = rw.call(operator.getitem, call, 0)
        empty_rows = op.get("empty_rows", "zero")
        if empty_rows != "zero":
            lse = rw.call(operator.getitem, call, 1)
            result = rw.call(fill_empty_rows, result, lse, *args[:3], float(op["scale"]), softcap,
                             list(sq.layout.local_lengths), empty_rows, rw.groups.sequence)
        rw.done(node, result, out)
        rw.report.attention.append({"node": node.name, "strategy": strategy, "layout": sq.layout.kind,
                                    "length": sq.layout.length, "causal": bool(op.get("causal")),
                                    "window": window, "chunk": int(op.get("chunk") or 0),
                                    "key_mask": op.get("key_mask") is not None,
                                    "segment_ids": op.get("segment_ids") is not None, "softcap": softcap,
                                    "alibi": slopes is not None, "position_bias": bias is not None,
                                    "sinks": sinks is not None,
                                    "dropout": dropout_p,
                                    "dtype": str(value_of(node).dtype).removeprefix("torch.")})
        return
    if _is_cross_attention(rw, op, sq, sk, out, dropout_p):
        _rewrite_cross_attention(rw, node, op, out)
        return
    structured = (op.get("causal") or op.get("window") or op.get("chunk") or op.get("key_mask")
                  or op.get("segment_ids"))
    if (dense is not None and dropout_p == 0.0 and not softcap and op.get("sinks") is None and out is not None
            and out.dim == 2
            and not out.factors and not structured):
        why = node.meta.get(DENSE_MASK)
        reason = ("attention with a mask that is not causal / window / padding / segments"
                  + (f": {why.reason}" if why is not None else ""))
        nd = len(shape_of(dense))
        mask_rows = out.moved(nd - 2) if shape_of(dense)[nd - 2] == shape_of(q)[2] else REPLICATE
        new = rw.call(F.scaled_dot_product_attention, rw.input(q, out),
                      rw.input(k, REPLICATE, partial_grad=True, expected=False, reason=reason),
                      rw.input(v, REPLICATE, partial_grad=True, expected=False, reason=reason),
                      attn_mask=rw.input(dense, mask_rows), scale=float(op["scale"]),
                      enable_gqa=shape_of(k)[1] != shape_of(q)[1])
        rw.done(node, new, out)
        rw.report.attention.append({"node": node.name, "strategy": "gathered-kv", "reason": reason,
                                    "line": user_line(node)})
        return
    reason = ("attention with dropout and a mask that is not causal / window / padding / segments"
              if dense is not None and dropout_p else
              "attention with soft-capped scores and a mask that is not causal / window / padding / segments"
              if dense is not None and softcap else
              "attention with sinks and a mask that is not causal / window / padding / segments"
              if dense is not None and op.get("sinks") is not None else
              "attention whose keys are not the queries' sequence" if sq is not None and sq != sk else
              "attention outside any sequence family")
    if out is not None or sq is not None or sk is not None:
        rw.report.attention.append({"node": node.name, "strategy": "whole", "reason": reason, "line": user_line(node)})
        whole = rw.reemit(node, *whole_args(rw, node, reason))
        rw.done(node, rw.shard_value(node, whole, out) if out is not None else whole, out or REPLICATE)
        return
    run_whole(rw, node, OUTPUT_WHOLE, expected=True)


def _is_cross_attention(rw, op, sq, sk, out, dropout_p) -> bool:
    """Queries split, keys of another sequence (a DiT's text, whole; an encoder's output, split along its own), and
    no term that relates a query's position to a key's (causal, window, chunk, segments, ALiBi, a position bias)
    or draws a mask from global positions (dropout)."""
    relative = any(op.get(term) for term in ("causal", "window", "chunk", "segment_ids"))
    positional = op.get("alibi_slopes") is not None or op.get("position_bias") is not None
    other_keys = sk is None or shape_of(op["k"])[2] != shape_of(op["q"])[2]
    return (sq is not None and other_keys and out == sq and sq.dim == 2 and not sq.factors and not relative
            and not positional and not dropout_p)


def _rewrite_cross_attention(rw, node, op, out) -> None:
    """Each rank's queries attend to all the keys: the call as it is on this rank's rows (a mask's rows too). Keys
    every rank holds (a DiT's text) move nothing; keys split along their own sequence (an encoder's output) are
    gathered. The keys', values' and learned terms' gradients are this rank's share, summed over the ranks."""
    q, dense = op["q"], op.get("dense_mask")

    def placed(n):
        if n is q:
            return rw.input(q, out)
        if n is dense and len(shape_of(dense)) >= 2 and shape_of(dense)[-2] == shape_of(q)[2] > 1:
            return rw.input(dense, out.moved(len(shape_of(dense)) - 2))
        return rw.input(n, REPLICATE, partial_grad=True, expected=True, reason="cross-attention gathers its keys")

    rw.done(node, rw.reemit(node, *mapped_args(node, placed)), out)
    rw.report.attention.append({"node": node.name, "strategy": "local", "reason": "cross-attention to whole keys",
                                "line": user_line(node)})


register("attention", link=link_attention, rewrite=rewrite_attention)
