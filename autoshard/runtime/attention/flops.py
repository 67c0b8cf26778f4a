"""Counting attention work per rank (FLOPs counted, not timed).

    with attention_flops() as fl:
        out = attention(q, k, v, causal=True); out.sum().backward()
    fl.forward, fl.backward

Every call of :func:`~autoshard.runtime.attention.local_attention` (and its backward) records the FLOPs
of the (query, key) pairs its mask lets through, whichever kernel runs: ``4 * D`` per visible pair and
head in the forward (``Q K^T`` and ``P V``), ``10 * D`` in the backward (``Q K^T`` again, ``dV``, ``dP``,
``dQ``, ``dK``). Only position masks (causal, window, chunks) are counted; data masks (``key_mask``,
``segment_ids``) do not reduce the count, since no kernel skips work for them. Blocks a strategy skips
are never computed and so never counted: the figure measures how evenly a strategy spreads the work.

Counters nest; the stack is process-wide (autograd may run backward on another thread).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ..accounting import _lock, counting

__all__ = ["AttentionFlops", "attention_flops", "record_flops"]

FORWARD_FLOPS_PER_PAIR = 4
"""FLOPs per visible (query, key) pair, per head and per unit of head dim, in the forward."""
BACKWARD_FLOPS_PER_PAIR = 10
"""The same in the backward."""


@dataclass
class AttentionFlops:
    """Attention FLOPs this rank computed while the counter was active."""

    forward: int = 0
    """FLOPs of forward blocks."""
    backward: int = 0
    """FLOPs of backward blocks."""
    calls: int = 0
    """How many blocks (local attention calls, forward and backward) were computed."""

    @property
    def total(self) -> int:
        """Forward plus backward."""
        return self.forward + self.backward


_active: list[AttentionFlops] = []


def attention_flops() -> contextlib.AbstractContextManager[AttentionFlops]:
    """Count the attention FLOPs this rank computes inside the block."""
    return counting(AttentionFlops(), _active)


def record_flops(direction: str, pairs: int, heads: int, head_dim: int) -> None:
    """Record one computed block: ``pairs`` visible pairs for each of ``heads`` (batch x heads) rows."""
    if not _active:
        return
    per_pair = FORWARD_FLOPS_PER_PAIR if direction == "forward" else BACKWARD_FLOPS_PER_PAIR
    flops = per_pair * pairs * heads * head_dim
    with _lock:  # the lock counting() adds and removes counters under
        for counter in _active:
            setattr(counter, direction, getattr(counter, direction) + flops)
            counter.calls += 1
