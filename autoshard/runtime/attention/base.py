"""What every strategy receives, and the registry the custom op dispatches through.

A strategy is a module with ``_check`` (local validation that needs the strategy's rules),
``_forward`` and ``_backward``; it registers a :class:`Strategy` at import. The one custom op
``autoshard::attention`` (see :mod:`.api`) and its backward op look the strategy up by name, so every
algorithm gets the same autograd wiring, fake implementation and argument checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..groups import resolve_group
from ..layouts import SequenceLayout
from .dropout import AttentionDropout
from .masks import MaskSpec
from .terms import ScoreTerms

__all__ = ["Call", "Strategy", "STRATEGIES", "register", "AttentionInputError"]


class AttentionInputError(ValueError):
    """Inputs that distributed attention cannot serve; the message names the constraint and the fix."""


@dataclass(frozen=True, kw_only=True)
class Call:
    """The configuration of one distributed attention call (everything but the tensors)."""

    strategy: str
    """The algorithm's registered name."""
    layout: SequenceLayout
    """Which global positions each sequence rank holds (its length is the global length)."""
    group: str
    """Process-group name: the sequence group, or for ``hybrid`` the Ulysses (all-to-all) axis."""
    ring_group: str = ""
    """For ``hybrid``: the ring axis' process-group name; empty otherwise."""
    spec: MaskSpec = MaskSpec()
    """Causal / window / chunk mask."""
    scale: float
    """Softmax scale."""
    softcap: float = 0.0
    """Scores soft-cap: ``softcap * tanh(s / softcap)`` on the scaled scores before the mask (0: none)."""
    alibi_slopes: torch.Tensor | None = None
    """ALiBi: ``[H]`` float32 slopes; every score gets ``slope[h] * (k_pos - q_pos)`` of its global positions, after
    the cap and before the mask (None: none)."""
    dropout_p: float = 0.0
    """Dropout on the attention probabilities (0: none), by a mask hashed from ``dropout_seed`` and global positions
    (see :mod:`.dropout`)."""
    dropout_seed: torch.Tensor | None = None
    """The call's dropout seed, a 0-d int64 tensor (with ``dropout_p``)."""
    position_bias: torch.Tensor | None = None
    """A relative-position bias ``[H, 2R + 1]``: every score gets ``position_bias[h, k_pos - q_pos + R]`` (None:
    none)."""
    position_bias_grad: torch.Tensor | None = None
    """In the backward: the accumulator of ``position_bias``'s gradient."""
    kernels: str = "auto"
    """``"auto"``, ``"torch"`` or ``"triton"`` (see :mod:`.backend`)."""

    @property
    def terms(self) -> ScoreTerms:
        """The call's score terms, for tensors holding every query head."""
        return ScoreTerms(self.alibi_slopes, self.position_bias, self.position_bias_grad,
                          AttentionDropout(self.dropout_p, self.dropout_seed) if self.dropout_p else None)

    @property
    def pg(self) -> dist.ProcessGroup:
        return resolve_group(self.group)

    @property
    def ring_pg(self) -> dist.ProcessGroup:
        return resolve_group(self.ring_group)


@dataclass(frozen=True)
class Strategy:
    """One distributed attention algorithm."""

    name: str
    check: Callable
    """``check(q, k, v, call)``: raise :class:`AttentionInputError` for inputs this algorithm cannot serve;
    returns this rank's sequence rank (the layout rank whose positions it holds)."""
    forward: Callable
    """``forward(q, k, v, key_mask, segment_ids, call) -> (out, lse)`` in the compute dtype."""
    backward: Callable
    """``backward(dout, q, k, v, out, lse, key_mask, segment_ids, call) -> (dq, dk, dv)``."""


STRATEGIES: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Make ``strategy`` available to ``attention(strategy=name)`` and the custom op."""
    STRATEGIES[strategy.name] = strategy
    return strategy
