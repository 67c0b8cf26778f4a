"""What every strategy receives: the configuration of one call (:class:`Call`), how its blocks score their pairs
(:class:`Scoring`), and the error for inputs it cannot serve (:class:`AttentionInputError`).

The custom op ``autoshard::attention`` (:mod:`.api`) turns its arguments into one :class:`Call` and hands it, with
the tensors, to the strategy the registry (:mod:`.base`) names: the strategy's check, forward and backward read
everything but the tensors from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..groups import resolve_group
from ..layouts import SequenceLayout
from .dropout import AttentionDropout
from .masks import MaskSpec
from .terms import ScoreTerms

__all__ = ["Call", "Scoring", "AttentionInputError"]


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
    head_chunks: int = 1
    """Head groups run one at a time (:mod:`.head_chunks`)."""

    @property
    def terms(self) -> ScoreTerms:
        """The call's score terms, for tensors holding every query head."""
        return ScoreTerms(self.alibi_slopes, self.position_bias, self.position_bias_grad,
                          AttentionDropout(self.dropout_p, self.dropout_seed) if self.dropout_p else None)

    @property
    def scoring(self) -> Scoring:
        """How the call's blocks score their pairs, for tensors holding every query head."""
        return Scoring(self.spec, self.scale, self.softcap, self.terms, self.kernels)

    @property
    def pg(self) -> dist.ProcessGroup:
        return resolve_group(self.group)

    @property
    def ring_pg(self) -> dist.ProcessGroup:
        return resolve_group(self.ring_group)


@dataclass(frozen=True)
class Scoring:
    """How every block of a call scores its (query, key) pairs, for tensors holding a given range of query heads:
    what the strategies pass down to the blocks (:func:`.blocks.attend`) besides the tensors and their positions."""

    spec: MaskSpec
    """Causal / window / chunk mask."""
    scale: float
    """Softmax scale."""
    softcap: float
    """Scores soft-cap (0: none)."""
    terms: ScoreTerms
    """The score terms of these query heads."""
    kernels: str
    """``"auto"``, ``"torch"`` or ``"triton"``."""

    def heads(self, start: int, stop: int) -> Scoring:
        """The scoring of the query heads ``[start, stop)`` of the tensors this one is for."""
        return dataclasses.replace(self, terms=self.terms.heads(start, stop))

    def local_kwargs(self) -> dict:
        """The keyword arguments of :func:`~.local.local_attention` (and its backward) this scoring is."""
        return dict(causal=self.spec.causal, window=self.spec.window_arg, chunk=self.spec.chunk, scale=self.scale,
                    softcap=self.softcap, kernels=self.kernels, **self.terms.local_kwargs())
