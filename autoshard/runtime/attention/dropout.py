"""Dropout on attention probabilities, with a mask that is a function of global positions.

One process drops attention probabilities with a mask drawn from torch's generator over the whole
``[B, H, S, S]`` matrix; no rank of a distributed attention ever holds that matrix, and torch's generators
are not counter-based (a rank cannot draw just its blocks). So the distributed op draws one seed per call
and decides every (batch, head, query, key) element by a counter-based hash of the seed and the element's
**global** indices::

    x = fmix32(seed + (b * 2**16 + h) * 0x9E3779B9)    # h: the global query head
    x = fmix32(x ^ (q_pos * 0x85EBCA77))
    x = fmix32(x ^ (k_pos * 0xC2B2AE3D))
    keep = (x >> 8) >= round(p * 2**24)              # all arithmetic modulo 2**32

(``fmix32`` is MurmurHash3's finalizer). What this guarantees:

* the mask of an element depends only on the seed and its global indices: the same for every strategy,
  layout, world size, block split and kernel (the torch path and the Triton kernels compute the same
  hash), and the forward and the backward of a call use the same mask;
* each element is kept with probability ``1 - p`` (to ``2**-24``), elements independently as far as the
  hash mixes (tested: the kept fraction and the correlation of neighbours);
* the kept probabilities are scaled by ``1 / (1 - p)``, as ``F.dropout`` does; the row normalization (the
  LSE) is of the probabilities before dropout, so blocks merge as without it.

It is *not* the one-process mask: that one comes from torch's generator. The seed is drawn from the default
generator of the device (``autoshard::attention_seed``, one 31-bit draw), so ranks whose generators agree --
the premise of :mod:`autoshard.runtime.random` -- draw the same seed, and recomputation under activation
checkpointing, which restores the generator, draws it again. The generator then advances by one draw where
one process drew ``B * H * S * S`` numbers: random ops after the attention differ from one process (they still
agree across ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..op_info import declare

__all__ = ["AttentionDropout", "dropout_keep", "draw_seed", "keep_threshold"]

_MASK = 0xFFFFFFFF
_HEAD, _QUERY, _KEY = 0x9E3779B9, 0x85EBCA77, 0xC2B2AE3D
_SEED_BOUND = 2**31 - 1


def keep_threshold(p: float) -> int:
    """An element is kept when its 24-bit hash is at least this."""
    return round(p * 2**24)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK
    return x ^ (x >> 16)


def dropout_keep(seed: torch.Tensor, p: float, batch_head: torch.Tensor, q_pos: torch.Tensor,
                 k_pos: torch.Tensor) -> torch.Tensor:
    """The keep mask (bool) of the elements at the broadcast of ``batch_head`` (``b * 2**16 + h``, ``h`` the global
    query head), ``q_pos`` and ``k_pos`` (global positions), int64, for the 0-d int64 ``seed`` (see the module
    docstring)."""
    x = _fmix32((seed + batch_head * _HEAD) & _MASK)
    x = _fmix32(x ^ ((q_pos * _QUERY) & _MASK))
    x = _fmix32(x ^ ((k_pos * _KEY) & _MASK))
    return (x >> 8) >= keep_threshold(p)


@dataclass(frozen=True)
class AttentionDropout:
    """The dropout of one attention call, for the tensors it is applied to."""

    p: float
    """Probability of dropping an element (0 < p < 1)."""
    seed: torch.Tensor
    """The call's seed, a 0-d int64 tensor (:func:`draw_seed`)."""
    head_offset: int = 0
    """The global index of the first query head of those tensors (a Ulysses rank holds a range of heads)."""

    @property
    def scale(self) -> float:
        """What kept probabilities are multiplied by."""
        return 1.0 / (1.0 - self.p)

    def heads_from(self, start: int) -> "AttentionDropout":
        """The dropout of the query heads from local head ``start`` on."""
        return replace(self, head_offset=self.head_offset + start)

    def keep(self, batch: int, heads: int, q_start: int, q_len: int, k_start: int, k_len: int) -> torch.Tensor:
        """The ``[batch, heads, q_len, k_len]`` keep mask of a tile at global positions ``q_start``, ``k_start``."""
        device = self.seed.device
        b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
        h = torch.arange(self.head_offset, self.head_offset + heads, device=device).view(1, heads, 1, 1)
        q = torch.arange(q_start, q_start + q_len, device=device).view(1, 1, q_len, 1)
        k = torch.arange(k_start, k_start + k_len, device=device).view(1, 1, 1, k_len)
        return dropout_keep(self.seed, self.p, b * 2**16 + h, q, k)


@torch.library.custom_op("autoshard::attention_seed", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def draw_seed(site: str, device: torch.device) -> torch.Tensor:
    """One seed for an attention's dropout, drawn from the default generator of ``device`` (a 0-d int64 tensor).
    ``site`` (the graph node it serves) keeps two draws apart under common-subexpression elimination."""
    return torch.randint(0, _SEED_BOUND, (), dtype=torch.int64, device=device)


@draw_seed.register_fake
def _(site, device):
    return torch.empty((), dtype=torch.int64, device=device)


declare(torch.ops.autoshard.attention_seed.default)
