"""Windows of a split sequence: what a convolution over the sequence reads on each rank.

A convolution's output positions ``[a, b)`` read the input positions ``[s*a - p, s*(b-1) - p + d*(k-1) + 1)``
(stride ``s``, left padding ``p``, dilation ``d``, kernel ``k``). When the input is split along the sequence
by a layout, each rank needs, for every interval of output positions it owns, one such *window*: mostly its
own positions plus a halo from its neighbours, with zeros where the window passes the sequence's ends (the
convolution's zero padding). The windows of different ranks may overlap (a halo is read by two ranks), so
they are not a layout, and their sizes differ by rank (uneven shards, strides): a halo exchange with one
fixed ``left``/``right`` for all ranks cannot serve them.

``autoshard::seq_windows(x, dim, layout, windows, group)`` fetches them: every rank knows every rank's
windows (they follow from the layouts the compiler chose), so each sends its neighbours exactly the
positions they read, point to point, with no exchange of sizes first. Backward is the adjoint: the gradient
of each window position returns to the rank that owns the position and is added there (a position read
twice gets both gradients).

Windows travel through the dispatcher flattened, per rank ``[n, lo_0, hi_0, ..., lo_{n-1}, hi_{n-1}]``
(:func:`encode_windows`).
"""

from __future__ import annotations

import functools
from typing import Sequence

from .layouts import SequenceLayout
from .symbolic import as_size
from .redistribute import define_run_moves, runs_bytes

__all__ = ["window_plan", "window_bytes", "encode_windows", "decode_windows"]

Windows = tuple[tuple[tuple[int, int], ...], ...]
"""Per rank, the half-open global position ranges it reads, in the order its output is built."""


def encode_windows(windows: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
    """Flatten per-rank windows into ints (see the module docstring); a bound that depends on a symbolic length (a
    length class's graph) stays a ``SymInt``, computed per call."""
    out = []
    for ranges in windows:
        out.append(len(ranges))
        for lo, hi in ranges:
            out += [as_size(lo), as_size(hi)]
    return out


@functools.lru_cache(maxsize=256)
def decode_windows(code: tuple[int, ...], world: int) -> Windows:
    """Inverse of :func:`encode_windows`, for ``world`` ranks."""
    out, i = [], 0
    for _ in range(world):
        n = code[i]
        out.append(tuple((code[i + 1 + 2 * j], code[i + 2 + 2 * j]) for j in range(n)))
        i += 1 + 2 * n
    return tuple(out)


@functools.lru_cache(maxsize=256)
def window_plan(layout: SequenceLayout, windows: Windows, rank: int):
    """For ``rank``: ``(keep, sends, recvs)`` in :func:`~autoshard.runtime.redistribute.realign_plan`'s form,
    with window-local offsets in place of the destination layout's (positions outside the sequence are sent
    by nobody: they stay zero)."""
    def pieces(reader: int):
        """(window offset, owner, owner's local offset, n) of every run ``reader``'s windows hold."""
        result, base = [], 0
        for lo, hi in windows[reader]:
            pos, end = max(lo, 0), min(hi, layout.length)
            while pos < end:
                owner = layout.owner(pos)
                local = 0
                for s, e in layout.local_intervals(owner):
                    if s <= pos < e:
                        n = min(e, end) - pos
                        result.append((base + pos - lo, owner, local + pos - s, n))
                        pos += n
                        break
                    local += e - s
            base += hi - lo
        return result

    keep, recvs = [], {p: [] for p in range(layout.world_size)}
    for offset, owner, local, n in pieces(rank):
        if owner == rank:
            keep.append((offset, local, n))
        else:
            recvs[owner].append((offset, n))
    sends = {p: [] for p in range(layout.world_size)}
    for peer in range(layout.world_size):
        if peer != rank:
            sends[peer] = [(local, n) for _, owner, local, n in pieces(peer) if owner == rank]
    return tuple(keep), sends, recvs


def window_bytes(layout: SequenceLayout, windows: Sequence[Sequence[tuple[int, int]]], row_bytes: int,
                 phase: str) -> list[int]:
    """Bytes every rank sends to fetch ``windows`` (``"forward"``) or to return their gradients (``"backward"``)."""
    frozen = tuple(tuple(map(tuple, w)) for w in windows)
    return runs_bytes(functools.partial(window_plan, layout, frozen), layout.world_size, row_bytes, phase)


def _width(windows: Windows, rank: int) -> int:
    return sum(hi - lo for lo, hi in windows[rank])


def _windows_plan(layout: list[int], windows: list[int], rank: int):
    src = SequenceLayout.decode(layout)
    return window_plan(src, decode_windows(tuple(windows), src.world_size), rank)


def _windows_lengths(layout: list[int], windows: list[int], rank: int) -> tuple[int, int]:
    src = SequenceLayout.decode(layout)
    return src.local_length(rank), _width(decode_windows(tuple(windows), src.world_size), rank)


define_run_moves("seq_windows", ("layout", "windows"), _windows_plan, _windows_lengths, "halo_exchange",
                 zero_fill=True)

