"""Structured attention masks: which (query, key) pairs are visible, by *global* position.

A :class:`MaskSpec` holds the position-based part of a mask (``causal``, ``window`` and ``chunk``); the
data-based parts (``key_mask``, ``segment_ids``) are tensors that travel with the keys and are applied tile
by tile. It is the one form of a position mask from the mask pass (:mod:`autoshard.passes.masks` finds one:
:meth:`MaskSpec.of_band`) to the kernels and the cost model. No window is ``(-1, -1)``, never ``None``: a side of
``-1`` is unbounded whether the other side is or not (flash-attn's convention, the ints a custom op's schema takes),
so code reads :attr:`~MaskSpec.lower` / :attr:`~MaskSpec.upper` and never branches on a missing window;
:meth:`MaskSpec.of` and :attr:`~MaskSpec.window_arg` convert at the API edges that take ``window=None``.
No mask here ever becomes an ``S x S`` tensor: a block of queries ``[q_start, q_start + q_len)`` against a
block of keys ``[k_start, k_start + k_len)`` is *classified* from its offsets alone:

``HIDDEN``
    no pair is visible: the block is skipped (no compute, no mask tensor);
``FULL``
    every pair is visible: computed without building any mask tensor;
``PARTIAL``
    some pairs are visible: a ``q_len x k_len`` boolean mask is built for this block (tiles keep it small).

Visibility rule (flash-attn's convention): key ``j`` is visible to query ``i`` iff
``causal`` implies ``j <= i`` and ``window=(left, right)`` implies ``i - left <= j <= i + right``,
where ``-1`` means unbounded on that side, and ``chunk=C`` implies ``i // C == j // C``. Mistral's
``sliding_window=W`` is ``window=(W - 1, 0)`` with ``causal=True``; Llama-4's chunked local attention is
``chunk=C`` with ``causal=True``.

A chunk mask is block-diagonal: a block whose query positions and key positions share no chunk (the
chunk ranges ``[q_start // C, q_last // C]`` and ``[k_start // C, k_last // C]`` are disjoint) is
``HIDDEN``, so every strategy skips it the way it skips the blocks a causal mask or a window hides; a block
is ``FULL`` only when all its queries and keys lie in one chunk.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["MaskSpec", "Visibility"]


class Visibility(enum.Enum):
    """How much of a (query block, key block) rectangle a :class:`MaskSpec` lets through."""

    HIDDEN = "hidden"
    PARTIAL = "partial"
    FULL = "full"


@dataclass(frozen=True)
class MaskSpec:
    """The position-based part of an attention mask."""

    causal: bool = False
    """Key ``j`` is visible to query ``i`` only if ``j <= i``."""
    window: tuple[int, int] = (-1, -1)
    """``(left, right)``: key ``j`` is visible to query ``i`` only if ``i - left <= j <= i + right``;
    ``-1`` leaves that side unbounded."""
    chunk: int = 0
    """Chunked local attention: key ``j`` is visible to query ``i`` only if ``i // chunk == j // chunk``
    (0: no chunks)."""

    def __post_init__(self):
        window = tuple(self.window)
        if len(window) != 2 or not all(isinstance(w, int) and not isinstance(w, bool) for w in window):
            raise ValueError(f"autoshard.attention: window must be a pair of ints (left, right), got {self.window!r}")
        if any(w < -1 for w in window):
            raise ValueError(
                f"autoshard.attention: window sides must be >= 0, or -1 for unbounded, got {self.window!r}")
        object.__setattr__(self, "window", window)
        if not isinstance(self.chunk, int) or isinstance(self.chunk, bool) or self.chunk < 0:
            raise ValueError(f"autoshard.attention: chunk must be an int >= 0 (0: no chunks), got {self.chunk!r}")

    @staticmethod
    def of(causal: bool = False, window: tuple[int, int] | None = None, chunk: int = 0) -> "MaskSpec":
        """The spec of ``causal``, ``window`` (``None`` for no window) and ``chunk`` (0 for none)."""
        return MaskSpec(bool(causal), (-1, -1) if window is None else tuple(window), int(chunk))

    @staticmethod
    def of_band(lower: int | None = None, upper: int | None = None, chunk: int = 0) -> "MaskSpec":
        """The spec of the keys ``i - lower <= j <= i + upper`` (``None``: unbounded on that side) and ``chunk``,
        the inverse of :attr:`lower` and :attr:`upper`: ``upper == 0`` is ``causal`` (with ``window=(lower, 0)``
        when ``lower`` is bounded). The band must hold the diagonal (both sides >= 0)."""
        if (lower is not None and lower < 0) or (upper is not None and upper < 0):
            raise ValueError(f"autoshard.attention: a band of keys [i - {lower}, i + {upper}] without the diagonal")
        if upper == 0:
            return MaskSpec(True, (-1, -1) if lower is None else (lower, 0), chunk)
        return MaskSpec(False, (-1 if lower is None else lower, -1 if upper is None else upper), chunk)

    # ------------------------------------------------------------------ the band of visible keys
    @property
    def lower(self) -> int | None:
        """Visible keys satisfy ``j >= i - lower`` (``None``: no lower bound)."""
        return None if self.window[0] == -1 else self.window[0]

    @property
    def upper(self) -> int | None:
        """Visible keys satisfy ``j <= i + upper`` (``None``: no upper bound)."""
        if self.causal:
            return 0 if self.window[1] == -1 else min(0, self.window[1])
        return None if self.window[1] == -1 else self.window[1]

    @property
    def is_positional(self) -> bool:
        """Whether visibility depends on positions at all (False: no causal mask, no window, no chunks)."""
        return self.lower is not None or self.upper is not None or self.chunk > 0

    @property
    def is_plain_causal(self) -> bool:
        """Exactly ``j <= i`` (causal, no window or chunk cutting further)."""
        return self.causal and self.lower is None and not self.chunk

    @property
    def window_arg(self) -> tuple[int, int] | None:
        """The window in the form ``local_attention`` takes (``None`` when unbounded on both sides)."""
        return None if self.window == (-1, -1) else self.window

    # ------------------------------------------------------------------ blocks
    def classify(self, q_start: int, q_len: int, k_start: int, k_len: int) -> Visibility:
        """Whether the block of queries ``[q_start, q_start + q_len)`` against keys ``[k_start, k_start + k_len)``
        is hidden, fully visible or partly visible (from the offsets alone)."""
        if q_len <= 0 or k_len <= 0:
            return Visibility.HIDDEN
        q_last, k_last = q_start + q_len - 1, k_start + k_len - 1
        lo, hi = self.lower, self.upper
        # The visible band [i - lo, i + hi] moves right as i grows.
        if (hi is not None and k_start > q_last + hi) or (lo is not None and k_last < q_start - lo):
            return Visibility.HIDDEN
        c = self.chunk
        if c and (k_start // c > q_last // c or k_last // c < q_start // c):  # no chunk in common
            return Visibility.HIDDEN
        if ((hi is None or k_last <= q_start + hi) and (lo is None or k_start >= q_last - lo)
                and (not c or q_start // c == q_last // c == k_start // c == k_last // c)):
            return Visibility.FULL
        return Visibility.PARTIAL

    def visible(self, q_start: int, q_len: int, k_start: int, k_len: int,
                device: torch.device | str | None = None) -> torch.Tensor:
        """The ``[q_len, k_len]`` boolean mask of one block (True = visible). Only for blocks (tiles) that
        are partly visible; nothing calls it for a whole sequence."""
        i = torch.arange(q_start, q_start + q_len, device=device).unsqueeze(1)
        j = torch.arange(k_start, k_start + k_len, device=device).unsqueeze(0)
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
        if self.upper is not None:
            mask &= j <= i + self.upper
        if self.lower is not None:
            mask &= j >= i - self.lower
        if self.chunk:
            mask &= i // self.chunk == j // self.chunk
        return mask

    def visible_pairs(self, q_start: int, q_len: int, k_start: int, k_len: int) -> int:
        """How many (query, key) pairs of the block are visible (an exact count, without a mask tensor)."""
        visibility = self.classify(q_start, q_len, k_start, k_len)
        if visibility is Visibility.HIDDEN:
            return 0
        if visibility is Visibility.FULL:
            return q_len * k_len
        i = torch.arange(q_start, q_start + q_len)
        first = torch.full_like(i, k_start) if self.lower is None else (i - self.lower).clamp(min=k_start)
        last = torch.full_like(i, k_start + k_len - 1) if self.upper is None else (i + self.upper).clamp(
            max=k_start + k_len - 1)
        if self.chunk:  # the row's chunk [i // C * C, i // C * C + C - 1]
            chunk_start = i // self.chunk * self.chunk
            first, last = torch.maximum(first, chunk_start), torch.minimum(last, chunk_start + self.chunk - 1)
        return int((last - first + 1).clamp(min=0).sum())
