"""Zigzag ring attention: the ring of :mod:`.ring` over the zigzag layout, so causal work is balanced.

The sequence is cut into ``2P`` chunks and rank ``r`` holds chunks ``r`` and ``2P - 1 - r``: one early
(cheap under a causal mask) and one late (costly). The ring's per-piece classification then does the
rest: against a block from an earlier rank both local chunks see its first chunk fully and nothing of
its last; against a later rank's block only the local late chunk sees its first chunk; the own block is
two causal diagonals and one full rectangle. Every rank computes the same number of visible pairs
(exactly, when ``2P`` divides the length), counted by :mod:`.flops`.

Bytes sent are the ring's, and so is the cost, with the work balanced. The strategy requires inputs
sharded with ``layout="zigzag"``: in the registry it is the ring algorithm over the zigzag layout (see
:mod:`.base` for why it stays a strategy of its own).
"""

from __future__ import annotations

import dataclasses

import torch

from ..layouts import SequenceLayout
from . import ring
from .api import attention
from .base import Pricing, StrategyCost, register, zigzag_layout
from .call import AttentionInputError, Call

__all__ = ["zigzag_attention"]


def _check(q, k, v, call: Call) -> int:
    rank = ring.RING.check(q, k, v, call)
    layout = call.layout
    if layout.length < 2 * layout.world_size or layout != SequenceLayout.zigzag(layout.length, layout.world_size):
        raise AttentionInputError(
            f"autoshard.attention: strategy 'zigzag' needs the zigzag layout (2P chunks, rank r holding chunks "
            f"r and 2P-1-r), got {layout!r}; shard the inputs with shard_sequence(..., layout='zigzag') and "
            f"pass layout='zigzag', or use strategy='ring', which serves any layout")
    return rank


def _cost(p: Pricing) -> StrategyCost:
    if p.shape.seq < 2 * p.world:
        return p.impossible(f"the zigzag layout needs 2P = {2 * p.world} positions, the sequence has {p.shape.seq}")
    return p.ring(p.busiest(p.documents))


register(dataclasses.replace(  # the ring's forward, backward and bytes over the zigzag layout
    ring.RING, name="zigzag", check=_check, cost=_cost, preferred_layout=zigzag_layout, rank=1, layout="zigzag",
    reason="a ring hides its traffic behind computation, and the zigzag layout balances the causal mask"))


def zigzag_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
    """:func:`~autoshard.runtime.attention.attention` with ``strategy="zigzag"`` and ``layout="zigzag"``."""
    options.setdefault("layout", "zigzag")
    return attention(q, k, v, strategy="zigzag", **options)
