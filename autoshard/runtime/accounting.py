"""The communication accountant: every byte the library moves is recorded here.

    with autoshard.runtime.comm_counter() as cc:
        loss = model(x); loss.backward()
    cc.bytes_sent, cc.bytes_received, cc.calls["all_gather"].count

Counting convention (per rank, algorithm-independent, so the planner can predict it exactly):

* point-to-point: the bytes of the tensors sent / received;
* ``all_gather`` of an ``n``-byte shard (padded to the largest shard when shards are uneven):
  sent ``(P-1)·n``, received ``(P-1)·n``: this rank's shard reaches every peer;
* ``reduce_scatter`` of an ``N``-byte input into ``P`` chunks of at most ``c`` bytes: sent and received
  ``(P-1)·c``: every peer's chunk leaves this rank once, this rank's chunk arrives from every peer;
* ``all_reduce`` of ``N`` bytes: a reduce-scatter followed by an all-gather of ``c = ceil(N/P)``-byte
  chunks: sent and received ``2·(P-1)·c``;
* ``all_to_all``: the bytes sent to / received from other ranks (the part that stays local is free).

Counters nest; every active counter sees every call. The stack is process-wide, not thread-local,
because autograd may run backward functions on another thread.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator

__all__ = ["CommCounter", "CallStats", "comm_counter", "counting", "record", "all_gather_bytes", "reduce_scatter_bytes",
           "all_reduce_bytes"]


@dataclass
class CallStats:
    """Totals for one kind of collective."""

    count: int = 0
    """How many calls."""
    bytes_sent: int = 0
    """Bytes this rank sent in those calls."""
    bytes_received: int = 0
    """Bytes this rank received in those calls."""


_UNPLANNED = ("metadata",)
"""Collective kinds whose bytes no plan predicts."""


@dataclass
class CommCounter:
    """What this rank sent and received while the counter was active."""

    bytes_sent: int = 0
    """All bytes this rank sent."""
    bytes_received: int = 0
    """All bytes this rank received."""
    calls: dict[str, CallStats] = field(default_factory=dict)
    """Per collective kind (``"all_gather"``, ``"send_recv"``, ...): count and bytes."""

    def add(self, kind: str, sent: int, received: int) -> None:
        self.bytes_sent += sent
        self.bytes_received += received
        stats = self.calls.setdefault(kind, CallStats())
        stats.count += 1
        stats.bytes_sent += sent
        stats.bytes_received += received

    @property
    def payload_bytes_sent(self) -> int:
        """Bytes sent by the collectives a plan predicts: all, less the ``"metadata"`` the ranks exchange to check
        each other (lengths, flags). Packed documents' ``"dispatch"`` of queries and ``"key_fetch"`` of visible keys
        depend on where the documents fall: a plan counts them when it reads the batch's ``position_ids``."""
        return sum(s.bytes_sent for kind, s in self.calls.items() if kind not in _UNPLANNED)

    @property
    def dispatch_bytes_sent(self) -> int:
        """Bytes sent moving packed documents' queries to the ranks that balance the attention work (and their
        results back): data-dependent, zero when the documents fall evenly."""
        stats = self.calls.get("dispatch")
        return stats.bytes_sent if stats else 0

    @property
    def key_fetch_bytes_sent(self) -> int:
        """Bytes sent fetching packed documents' visible keys for the all-gather strategy (and their gradients
        back): data-dependent, zero when every document sits whole on the rank that computes it."""
        stats = self.calls.get("key_fetch")
        return stats.bytes_sent if stats else 0

    def summary(self) -> str:
        """One line per collective kind."""
        rows = [f"{k:>16}: {v.count:5d} calls, sent {v.bytes_sent:,} B, received {v.bytes_received:,} B"
                for k, v in sorted(self.calls.items())]
        return "\n".join(rows) if rows else "(no communication)"


_active: list[CommCounter] = []
_lock = threading.Lock()


@contextlib.contextmanager
def counting(counter, active: list) -> Iterator:
    """``counter`` in ``active`` (the counters that records reach) for the duration of the block."""
    with _lock:
        active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            active.remove(counter)


def comm_counter() -> contextlib.AbstractContextManager[CommCounter]:
    """Count the bytes every autoshard collective on this rank sends and receives inside the block."""
    return counting(CommCounter(), _active)


def record(kind: str, sent: int, received: int) -> None:
    """Record one collective call (called by the runtime, never by users)."""
    if not _active:
        return
    with _lock:
        for counter in _active:
            counter.add(kind, int(sent), int(received))


# ---------------------------------------------------------------------------- the convention, as functions
# The runtime records with these and the planner predicts with them, so the two cannot drift apart.


def all_gather_bytes(largest_shard_bytes: int, world: int) -> int:
    """Bytes a rank sends (and receives) in an all-gather of shards padded to the largest one."""
    return (world - 1) * largest_shard_bytes


def reduce_scatter_bytes(largest_chunk_bytes: int, world: int) -> int:
    """Bytes a rank sends (and receives) in a reduce-scatter of chunks padded to the largest one."""
    return (world - 1) * largest_chunk_bytes


def all_reduce_bytes(numel: int, itemsize: int, world: int) -> int:
    """Bytes a rank sends (and receives) in an all-reduce: a reduce-scatter then an all-gather of ceil(numel/P)."""
    return 2 * (world - 1) * (-(-numel // world)) * itemsize
