"""Sequence layouts: which global positions of a sequence each rank holds.

A layout maps a sequence of ``length`` tokens onto ``world_size`` ranks. Every rank holds a sorted
tuple of disjoint half-open intervals of global positions, and its local tensor holds those positions
in increasing order. Two layouts are built in:

``contiguous``
    rank r holds one run of consecutive positions; runs are in rank order.
``zigzag``
    the sequence is cut into 2P chunks; rank r holds chunks r and 2P-1-r, so under a causal mask
    every rank has the same amount of attention work (the early chunk is cheap, the late one costly).

Lengths that the world size does not divide are served with **uneven shards, never padding**: the
length is split into parts whose sizes differ by at most one, the larger parts first (the rule of
``torch.tensor_split``). No rank ever holds a pad token, so no operation needs to mask one out, and
``unshard`` returns exactly the original length.

The compiler also needs *derived* layouts: the layout a tensor must have so that its position ``i``
sits on the rank that holds position ``i + offset`` of a root layout (for example the labels of a
shifted loss, or the patch tokens after a CLS token was prepended). Positions outside the root's range
belong to the rank that holds the nearest root position. ``SequenceLayout.derive`` builds them.

Layouts are immutable and hashable; ``encode()`` flattens one into a list of ints so custom ops can
carry it through the dispatcher, and ``SequenceLayout.decode`` restores it (cached).

**Placed layouts.** A compiled graph's layouts are constants of its ops. A data placement
(:mod:`autoshard.runtime.placement`: packed documents placed by their lengths) swaps, for one call, a static layout
for another of the same local lengths: :func:`placing` names the swaps, and while it holds ``decode`` returns the
swapped layout, so every op reads its tokens where the placement put them without a new compilation (the shapes
are those it was compiled for).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .symbolic import evaluate, hint_of, is_symbolic as _symbolic

__all__ = ["SequenceLayout", "LAYOUTS", "split_sizes", "placing", "current_swaps", "set_swaps"]

LAYOUTS = ("contiguous", "zigzag")

Interval = tuple[int, int]


def split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` balanced pieces of ``total``: they differ by at most one, larger first. Written
    without a branch on the remainder, so a symbolic ``total`` (a graph compiled for every length) gives
    expressions and no guard per residue."""
    if parts <= 0:
        raise ValueError(f"cannot split into {parts} parts")
    return [(total + parts - 1 - i) // parts for i in range(parts)]


def _key(value):
    return value.node.expr if isinstance(value, torch.SymInt) else value


def _size(value):
    """A position as a layout holds it: an ``int``, or a ``SymInt`` of a symbolic length."""
    return value if _symbolic(value) else int(value)


@dataclass(frozen=True)
class SequenceLayout:
    """Which global positions of a ``length``-token sequence every one of ``world_size`` ranks holds."""

    kind: str = field(compare=False)
    """``"contiguous"``, ``"zigzag"``, or ``"derived"`` (built by :meth:`derive` or :meth:`from_intervals`).
    Not part of equality: two layouts that place every position on the same rank are equal."""
    length: int
    """Global number of positions."""
    world_size: int
    """Number of ranks."""
    intervals: tuple[tuple[Interval, ...], ...]
    """``intervals[r]``: the sorted, disjoint, non-adjacent, half-open position ranges rank ``r`` holds."""

    def __post_init__(self):  # a SymInt of constant value is its int: it hashes and compares as the int layout
        object.__setattr__(self, "length", _size(self.length))
        object.__setattr__(self, "intervals", tuple(tuple((_size(s), _size(e)) for s, e in ivs)
                                                    for ivs in self.intervals))

    def __hash__(self) -> int:  # a symbolic length hashes by its expression (a SymInt itself is unhashable)
        return hash((_key(self.length), self.world_size, tuple(tuple((_key(s), _key(e)) for s, e in ivs)
                                                                for ivs in self.intervals)))

    # ------------------------------------------------------------------ construction
    @staticmethod
    def of(kind: str, length: int, world_size: int) -> "SequenceLayout":
        """The built-in layout ``kind`` (``"contiguous"`` or ``"zigzag"``)."""
        if kind == "contiguous":
            return SequenceLayout.contiguous(length, world_size)
        if kind == "zigzag":
            return SequenceLayout.zigzag(length, world_size)
        raise ValueError(f"autoshard: unknown layout {kind!r}; expected one of {LAYOUTS}")

    @staticmethod
    def contiguous(length: int, world_size: int) -> "SequenceLayout":
        """Rank r holds one run; run sizes differ by at most one. A sequence shorter than the world leaves the
        last ranks none (a one-token decode step, a prompt of 3 tokens on 4 ranks)."""
        return (_contiguous if _symbolic(length) else _contiguous_cached)(length, world_size)

    @staticmethod
    def zigzag(length: int, world_size: int) -> "SequenceLayout":
        """2P chunks; rank r holds chunks r and 2P-1-r."""
        return (_zigzag if _symbolic(length) else _zigzag_cached)(length, world_size)

    @staticmethod
    def from_intervals(length: int, intervals: Sequence[Sequence[Interval]]) -> "SequenceLayout":
        """A layout from explicit per-rank intervals (merged, empty ones dropped, checked for coverage)."""
        per_rank = tuple(_normalize(iv) for iv in intervals)
        covered = sorted(i for rank in per_rank for i in rank)
        pos = 0
        for start, end in covered:
            if start != pos:
                raise ValueError(f"intervals {intervals} do not tile [0, {length})")
            pos = end
        if pos != length:
            raise ValueError(f"intervals {intervals} do not tile [0, {length})")
        return SequenceLayout("derived", length, len(per_rank), per_rank)

    def derive(self, offset: int, length: int) -> "SequenceLayout":
        """The layout of a ``length``-position tensor whose position ``i`` is this layout's ``i + offset``.

        Positions that fall outside ``[0, self.length)`` go to the rank holding the nearest position.
        ``derive(0, self.length)`` is this layout itself.
        """
        offset, length = _size(offset), _size(length)
        if offset == 0 and length == self.length:
            return self
        symbolic = _symbolic(offset) or _symbolic(length) or _symbolic(self.length)
        return (_derive if symbolic else _derive_cached)(self, offset, length)

    def evaluated(self, values: dict) -> "SequenceLayout":
        """This layout for one call of a graph compiled for every length: its symbolic positions evaluated at
        ``values`` (symbol -> int, :func:`~autoshard.runtime.symbolic.evaluate`)."""
        code = self.encode()
        if not any(isinstance(c, torch.SymInt) for c in code):
            return self
        return _decode_cached(tuple(evaluate(c, values) for c in code))

    def at_hint(self) -> "SequenceLayout":
        """This layout at the lengths of the call being compiled (a symbolic one's hints): what reports count."""
        code = self.encode()
        if not any(isinstance(c, torch.SymInt) for c in code):
            return self
        return _decode_cached(tuple(hint_of(c) for c in code))

    @functools.cached_property
    def rule(self) -> tuple[str, int] | "SequenceLayout":
        """What places the positions at every length: ``(kind, world_size)`` where this is the built-in ``kind``'s
        layout of its length (a graph compiled for a class of lengths takes it at any of them), else the layout
        itself."""
        if self.kind in LAYOUTS and not _symbolic(self.length) and self == SequenceLayout.of(self.kind, self.length,
                                                                                              self.world_size):
            return self.kind, self.world_size
        return self

    # ------------------------------------------------------------------ queries
    def local_intervals(self, rank: int) -> tuple[Interval, ...]:
        """The global position ranges rank ``rank`` holds, in local order."""
        return self.intervals[rank]

    def local_length(self, rank: int) -> int:
        """How many positions rank ``rank`` holds."""
        return sum(e - s for s, e in self.intervals[rank])

    @functools.cached_property
    def local_lengths(self) -> tuple[int, ...]:
        """``local_length(r)`` for every rank."""
        return tuple(self.local_length(r) for r in range(self.world_size))

    @property
    def max_local_length(self) -> int:
        """The largest shard (what a padded all-gather moves per rank)."""
        return max(self.local_lengths)

    @property
    def is_even(self) -> bool:
        """True when every rank holds the same number of positions."""
        return len(set(self.local_lengths)) == 1

    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The global position of every local position of ``rank`` (int64, in local order)."""
        parts = [torch.arange(s, e, device=device) for s, e in self.intervals[rank]]
        if not parts:
            return torch.empty(0, dtype=torch.long, device=device)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def owner(self, position: int) -> int:
        """The rank that holds global ``position``."""
        idx = bisect.bisect_right(self._starts, position) - 1
        if idx < 0 or position >= self.spans[idx][1]:
            raise IndexError(f"position {position} outside [0, {self.length})")
        return self.spans[idx][2]

    @functools.cached_property
    def spans(self) -> list[tuple[int, int, int]]:
        """``(start, end, rank)`` of every rank's intervals, in global order."""
        return sorted((s, e, r) for r, ivs in enumerate(self.intervals) for s, e in ivs)

    @functools.cached_property
    def _starts(self) -> list[int]:
        return [s for s, _, _ in self.spans]

    # ------------------------------------------------------------------ custom-op transport
    def encode(self) -> list[int]:
        """Flatten into ints: ``[length, world_size, n_0, s, e, ..., n_1, s, e, ...]``."""
        out = [self.length, self.world_size]
        for ivs in self.intervals:
            out.append(len(ivs))
            for s, e in ivs:
                out += [s, e]
        return out

    @staticmethod
    def decode(code: Sequence[int]) -> "SequenceLayout":
        """Inverse of :meth:`encode`."""
        code = tuple(_size(c) for c in code)
        layout = (_decode if any(map(_symbolic, code)) else _decode_cached)(code)
        return _placed.get(layout, layout) if _placed else layout

    def __repr__(self) -> str:
        return f"SequenceLayout({self.kind}, length={self.length}, world_size={self.world_size})"


# ---------------------------------------------------------------------- placed layouts

_placed = {}
"""The swaps of the current call's placement (:func:`placing`): compiled layout -> the one it reads."""


@contextlib.contextmanager
def placing(swaps):
    """While it holds, ``SequenceLayout.decode`` of a layout returns ``swaps.get(layout, layout)`` (every swap of the
    same local lengths); the previous swaps are restored after."""
    global _placed
    before, _placed = _placed, swaps
    try:
        yield
    finally:
        _placed = before


def current_swaps():
    """The swaps of the placement in effect (:func:`placing`; empty outside one)."""
    return _placed


def set_swaps(swaps) -> None:
    """Put ``swaps`` in effect until set again: for a placed call's backward, which autograd runs after the call's
    ``with placing(...)`` ended (:mod:`~autoshard.runtime.placement` sets them back to none when it ends)."""
    global _placed
    _placed = swaps


# ---------------------------------------------------------------------- helpers


def _contiguous(length: int, world_size: int) -> SequenceLayout:
    _check_servable("contiguous", length, world_size, 1)
    bounds = _prefix(split_sizes(length, world_size))
    return SequenceLayout(
        "contiguous", length, world_size,
        tuple(_normalize(((bounds[r], bounds[r + 1]),)) for r in range(world_size)),
    )


def _zigzag(length: int, world_size: int) -> SequenceLayout:
    _check_servable("zigzag", length, world_size, 2 * world_size)
    bounds = _prefix(split_sizes(length, 2 * world_size))
    chunk = lambda c: (bounds[c], bounds[c + 1])  # noqa: E731
    return SequenceLayout(
        "zigzag", length, world_size,
        tuple(_normalize((chunk(r), chunk(2 * world_size - 1 - r))) for r in range(world_size)),
    )


_contiguous_cached = functools.lru_cache(maxsize=None)(_contiguous)
_zigzag_cached = functools.lru_cache(maxsize=None)(_zigzag)
"""Layouts of integer lengths are built once; a symbolic length's (unhashable) is built each time."""


def _check_servable(kind: str, length: int, world_size: int, parts: int) -> None:
    if world_size < 1:
        raise ValueError(f"autoshard: world size must be >= 1, got {world_size}")
    if length < parts:
        raise ValueError(
            f"autoshard: the {kind} layout cuts the sequence into {parts} parts for {world_size} ranks, "
            f"but the sequence has only {length} positions; use a longer sequence, fewer ranks"
            + (", or the contiguous layout" if kind == "zigzag" else "")
        )


def _prefix(sizes: Sequence[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def _normalize(ivs: Sequence[Interval]) -> tuple[Interval, ...]:
    merged: list[list[int]] = []
    for s, e in sorted((_size(s), _size(e)) for s, e in ivs if e > s):
        if merged and merged[-1][1] == s:
            merged[-1][1] = e
        else:
            merged.append([s, e])
    return tuple((s, e) for s, e in merged)


def _derive(root: SequenceLayout, offset: int, length: int) -> SequenceLayout:
    per_rank: list[list[Interval]] = [[] for _ in range(root.world_size)]
    # Positions i with i + offset < 0 go to the owner of root position 0; beyond the end, to the owner
    # of the last one; inside, each root interval maps back by -offset.
    for s, e, r in root.spans:
        s2, e2 = max(s - offset, 0), min(e - offset, length)
        if s == 0:
            s2 = 0
        if e == root.length:
            e2 = length
        if e2 > s2:
            per_rank[r].append((s2, e2))
    return SequenceLayout.from_intervals(length, per_rank)


_derive_cached = functools.lru_cache(maxsize=4096)(_derive)


def _decode(code: tuple[int, ...]) -> SequenceLayout:
    length, world_size = code[0], code[1]
    i = 2
    per_rank = []
    for _ in range(world_size):
        n = code[i]
        i += 1
        per_rank.append(tuple((code[i + 2 * k], code[i + 2 * k + 1]) for k in range(n)))
        i += 2 * n
    for kind in LAYOUTS:
        try:
            candidate = SequenceLayout.of(kind, length, world_size)
        except ValueError:
            continue
        if candidate.intervals == tuple(per_rank):
            return candidate
    return SequenceLayout("derived", length, world_size, tuple(per_rank))


_decode_cached = functools.lru_cache(maxsize=4096)(_decode)
