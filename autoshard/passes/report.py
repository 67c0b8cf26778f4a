"""What the rewrite reports: the :class:`CompileReport` of one rank's graph and its records.

The :class:`~autoshard.passes.rewrite.Rewriter` fills a :class:`CompileReport` as it builds the per-rank graph: a
:class:`Transition` for every placement change that communicates, a :class:`Fallback` for every op the rules could
not run on shards. The records sit below the rewriter and the rules, so a rule records a fallback without importing
the rewriter (which imports every rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CompileReport", "Transition", "Fallback"]


@dataclass
class Transition:
    """A placement change that communicates."""

    kind: str
    """``all_gather``, ``all_reduce``, ``realign``."""
    node: str
    """The value moved."""
    have: str
    want: str
    bytes_sent: int
    """Bytes this rank sends (the accountant's convention)."""
    reason: str = ""


@dataclass
class Fallback:
    """An op the rules could not run on shards: its inputs were gathered."""

    node: str
    op: str
    reason: str


@dataclass
class CompileReport:
    """What the rewrite did on this rank."""

    placements: dict[str, str] = field(default_factory=dict)
    transitions: list[Transition] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    attention: list[dict] = field(default_factory=list)
    """One entry per distributed attention: node, strategy, layout, mask, the dtype it computes in."""
    grad_buckets: dict[str, list[str]] = field(default_factory=dict)
    """Gradient buckets: bucket node -> the parameters whose gradients it sums in one all-reduce."""
    comms: list = field(default_factory=list)
    """Every collective this rank performs, forward and backward, with every rank's bytes
    (:class:`~autoshard.passes.comms.Comm`)."""
    square_values: list[str] = field(default_factory=list)
    """Values that carry the sequence on two dims (an S x S mask or score matrix would be one): they are
    computed whole along one of them."""
    recomputed: dict[int, int] = field(default_factory=dict)
    """Checkpointed region (:mod:`.regions`) -> bytes this rank sends again when backward recomputes it: the
    whole region reruns, its forward collectives too."""
    passes: dict = field(default_factory=dict)
    """Pass name -> its :class:`~autoshard.passes.pipeline.PassStats` (seconds, counts), in pass order."""
    memory_policy: Any = None
    """What the memory policy weighed and chose for this graph (:class:`~autoshard.policy.MemoryPolicy`), or None
    without a budget."""
