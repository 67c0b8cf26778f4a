"""Attention run over groups of heads, one group at a time (``head_chunks``): UPipe's head-chunked Ulysses, for
every strategy.

At long context a distributed attention's largest values are its own: Ulysses holds the whole sequence of its
share of the heads (q, K, V, the float32 output and, in backward, dout, dQ, dK, dV: ``[B, H/P, S, D]`` each), the
all-gather the whole K/V, every strategy float32 accumulators of ``[B, H, S/P, D]``. Attention is independent
across key/value heads, so the op may run it a group of heads at a time: each group's copies and accumulators die
before the next group starts, and the working set (:attr:`~.base.Strategy.working_set`) is a group's.

* **Groups follow the key/value heads.** :func:`head_groups` cuts the ``Hkv`` key/value heads into ``n``
  contiguous near-equal groups; a group's query heads are the GQA groups that read them (``H / Hkv`` each), so
  every group is an ordinary GQA attention of fewer heads and any strategy runs it unchanged.
* **As many groups as the heads allow.** A strategy that splits heads over ranks (Ulysses, the hybrid's Ulysses
  axis: :attr:`~.base.Strategy.splits_heads`) needs a query head per rank in every group; the count falls to the
  largest that keeps every group that wide. Attention dropout hashes its mask from global head indices the groups
  do not carry, so a call with dropout runs whole.
* **The result is written in place of a concatenation.** Each group's output, LSE and gradients go into slices of
  tensors allocated once (a concatenation would hold every group twice); the score terms (ALiBi slopes, a
  position bias and its gradient accumulator) are sliced to the group's heads.

The strategies' collectives run once per group: more calls of a group's size (Ulysses sends a key/value head to
every rank whose query heads read it, so with fewer query heads per group than ``P * H / Hkv`` some key/value
heads travel to more ranks). The byte formulas and the planner's step time count a call whole.
"""

from __future__ import annotations

import dataclasses

import torch

from ..layouts import split_sizes
from .base import Strategy
from .call import Call

__all__ = ["head_groups", "chunked_forward", "chunked_backward"]


def head_groups(heads: int, kv_heads: int, chunks: int, min_heads: int = 1) -> list[tuple[int, int, int, int]]:
    """``(q_lo, q_hi, kv_lo, kv_hi)`` of at most ``chunks`` groups of heads, cut along the key/value heads, each
    group's query heads at least ``min_heads`` (one group when the heads allow no more)."""
    group = heads // kv_heads
    count = max(1, min(chunks, kv_heads))
    while count > 1 and min(split_sizes(kv_heads, count)) * group < min_heads:
        count -= 1
    out, lo = [], 0
    for size in split_sizes(kv_heads, count):
        out.append((lo * group, (lo + size) * group, lo, lo + size))
        lo += size
    return out


def _groups(strategy: Strategy, q: torch.Tensor, k: torch.Tensor, call: Call) -> list[tuple[int, int, int, int]]:
    if call.head_chunks <= 1 or call.dropout_p:
        return [(0, q.size(1), 0, k.size(1))]
    return head_groups(q.size(1), k.size(1), call.head_chunks, call.pg.size() if strategy.splits_heads else 1)


def _group_call(call: Call, q_lo: int, q_hi: int) -> Call:
    """``call`` for the query heads ``[q_lo, q_hi)``: its per-head score terms sliced (views: a position bias's
    gradient accumulates into the whole accumulator)."""
    def rows(t):
        return None if t is None else t[q_lo:q_hi]

    return dataclasses.replace(call, alibi_slopes=rows(call.alibi_slopes), position_bias=rows(call.position_bias),
                               position_bias_grad=rows(call.position_bias_grad))


def chunked_forward(strategy: Strategy, q, k, v, key_mask, segment_ids, call: Call):
    """``strategy.forward`` a head group at a time (:func:`head_groups`); one group: the strategy's own call."""
    groups = _groups(strategy, q, k, call)
    if len(groups) == 1:
        return strategy.forward(q, k, v, key_mask, segment_ids, call)
    out = lse = None
    for q_lo, q_hi, kv_lo, kv_hi in groups:
        o, l = strategy.forward(q[:, q_lo:q_hi], k[:, kv_lo:kv_hi], v[:, kv_lo:kv_hi], key_mask, segment_ids,
                                _group_call(call, q_lo, q_hi))
        if out is None:
            out = o.new_empty((*q.shape[:-1], o.size(-1)))
            lse = l.new_empty(q.shape[:-1])
        out[:, q_lo:q_hi] = o
        lse[:, q_lo:q_hi] = l
    return out, lse


def chunked_backward(strategy: Strategy, dout, q, k, v, out, lse, key_mask, segment_ids, call: Call):
    """``strategy.backward`` a head group at a time, with the groups of :func:`chunked_forward`."""
    groups = _groups(strategy, q, k, call)
    if len(groups) == 1:
        return strategy.backward(dout, q, k, v, out, lse, key_mask, segment_ids, call)
    dq = dk = dv = None
    for q_lo, q_hi, kv_lo, kv_hi in groups:
        gq, gk, gv = strategy.backward(dout[:, q_lo:q_hi], q[:, q_lo:q_hi], k[:, kv_lo:kv_hi], v[:, kv_lo:kv_hi],
                                       out[:, q_lo:q_hi], lse[:, q_lo:q_hi], key_mask, segment_ids,
                                       _group_call(call, q_lo, q_hi))
        if dq is None:
            dq, dk, dv = gq.new_empty(q.shape), gk.new_empty(k.shape), gv.new_empty(v.shape)
        dq[:, q_lo:q_hi], dk[:, kv_lo:kv_hi], dv[:, kv_lo:kv_hi] = gq, gk, gv
    return dq, dk, dv
