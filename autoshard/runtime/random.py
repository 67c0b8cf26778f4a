"""Randomness on sharded values: every rank must draw *different* numbers for its tokens.

Every rank runs the same program from the same seed, so ``dropout`` on a sharded activation would give
each rank the same mask pattern for different tokens: correlated noise a single device never
produces. Here one 63-bit seed is drawn from the default generator -- the same draw on every rank, so
the ranks' generators stay in step for the replicated randomness that follows -- and the mask is drawn
from a private generator seeded with that seed and the rank.
"""

from __future__ import annotations

import torch

__all__ = ["sharded_dropout", "rank_generator"]


def rank_generator(device: torch.device, rank: int) -> torch.Generator:
    """A generator for this rank's share of a random draw (consumes one draw of the default generator)."""
    seed = int(torch.randint(0, 2**62, (), device="cpu"))
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + rank) % (2**63 - 1))
    return gen


def sharded_dropout(x: torch.Tensor, p: float, training: bool, rank: int) -> torch.Tensor:
    """``F.dropout(x, p, training)`` with a mask drawn for this rank's tokens only."""
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=rank_generator(x.device, rank))
    return x * keep / (1.0 - p)
