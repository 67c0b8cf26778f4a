"""Counting attention work per rank (FLOPs counted, not timed).

    with attention_flops() as fl:
        out = attention(q, k, v, causal=True); out.sum().backward()
    fl.forward, fl.backward

Every call of :func:`~autoshard.runtime.attention.local_attention` (and its backward) records the FLOPs
of the (query, key) pairs its mask lets through, whichever kernel runs, per visible pair and head:
``2 * D + 2 * Dv`` in the forward (``Q K^T`` over the query/key head dim ``D``, ``P V`` over the value head
dim ``Dv``), ``6 * D + 4 * Dv`` in the backward (``Q K^T`` again, ``dQ``, ``dK``; ``dV``, ``dP``); with
``Dv = D``, ``4 * D`` and ``10 * D``. Position masks (causal, window, chunks) and packed documents
(``segment_ids``: the kernels compute only the rectangles of each document, see :mod:`.documents`) reduce the
count; a key-padding mask (``key_mask``) does not, since no kernel skips work for it. Blocks a strategy skips
are never computed and so never counted: the figure measures how evenly a strategy spreads the work.

Counters nest; the stack is process-wide (autograd may run backward on another thread).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ..accounting import _lock, counting

__all__ = ["AttentionFlops", "attention_flops", "counting_flops", "record_flops"]

_FLOPS_PER_PAIR = {"forward": (2, 2), "backward": (6, 4)}
"""Direction -> FLOPs per visible (query, key) pair and head, per unit of the query/key head dim and per unit of
the value head dim."""


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


def counting_flops() -> bool:
    """Whether a counter is active (so callers compute a count only when someone reads it)."""
    return bool(_active)


def record_flops(direction: str, pairs: int, heads: int, head_dim: int, value_dim: int) -> None:
    """Record one computed block: ``pairs`` visible pairs for each of ``heads`` (batch x heads) rows, query/key
    head dim ``head_dim``, value head dim ``value_dim``."""
    if not _active:
        return
    per_qk, per_v = _FLOPS_PER_PAIR[direction]
    flops = pairs * heads * (per_qk * head_dim + per_v * value_dim)
    with _lock:  # the lock counting() adds and removes counters under
        for counter in _active:
            setattr(counter, direction, getattr(counter, direction) + flops)
            counter.calls += 1
