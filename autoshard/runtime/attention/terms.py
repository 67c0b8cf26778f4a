"""What a call adds to its scores and probabilities beyond the mask: :class:`ScoreTerms`.

Three terms, each a function of (query head, global query position, global key position), so every block of
every strategy computes its part from its global offsets:

* ALiBi slopes ``[H]``: the score gets ``slope[h] * (k_pos - q_pos)`` (Bloom, MPT);
* a relative-position bias ``[H, 2R + 1]``: the score gets ``bias[h, k_pos - q_pos + R]`` (T5's learned buckets,
  tabulated over the distances of the sequence by the compiler); it is learned, so the backward adds its
  gradient -- the sums of the scores' gradients along each distance -- into ``position_bias_grad``;
* dropout on the probabilities (:mod:`.dropout`).

Strategies pass one :class:`ScoreTerms` down to the blocks; a rank that holds a range of the query heads
(Ulysses) takes :meth:`ScoreTerms.heads` of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dropout import AttentionDropout

__all__ = ["ScoreTerms", "NO_TERMS"]


@dataclass(frozen=True)
class ScoreTerms:
    """The terms of one call, for tensors holding a given range of query heads."""

    alibi_slopes: torch.Tensor | None = None
    """ALiBi: ``[H]`` float32 slopes (None: none)."""
    position_bias: torch.Tensor | None = None
    """``[H, 2R + 1]``: ``position_bias[h, k_pos - q_pos + R]`` is added to every score (None: none)."""
    position_bias_grad: torch.Tensor | None = None
    """The backward's accumulator of ``position_bias``'s gradient (same shape, compute dtype); None in the forward
    and when the bias needs no gradient."""
    dropout: AttentionDropout | None = None
    """Dropout on the probabilities (None: none)."""

    @property
    def positional(self) -> bool:
        """Whether the terms depend on positions (so blocks must be computed at their global offsets)."""
        return self.alibi_slopes is not None or self.position_bias is not None or self.dropout is not None

    def heads(self, start: int, stop: int) -> "ScoreTerms":
        """The terms of the query heads ``[start, stop)`` of the tensors these terms are for."""
        def rows(t):
            return None if t is None else t[start:stop]

        return ScoreTerms(rows(self.alibi_slopes), rows(self.position_bias), rows(self.position_bias_grad),
                          None if self.dropout is None else self.dropout.heads_from(start))

    def local_kwargs(self) -> dict:
        """The keyword arguments of :func:`~.local.local_attention` (and its backward) these terms are."""
        return {"alibi_slopes": self.alibi_slopes, "position_bias": self.position_bias, "dropout": self.dropout}


NO_TERMS = ScoreTerms()
"""A call without terms."""
