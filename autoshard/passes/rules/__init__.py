"""Rule tables: how each canonical op links sequence dims and how it runs on shards.

One file per op family, each registering its ops here on import (like DTensor's ``_ops/``):

=================  ============================================================================
file               ops
=================  ============================================================================
``pointwise``      elementwise ops (ATen ``pointwise`` tag), casts, identity, dropout
``views``          view/reshape/flatten/squeeze/unsqueeze, permute/transpose, expand,
                   getitem / narrow / select, split, unbind, cat, stack, pad, repeat_interleave
``matmul``         linear, matmul/bmm/mm, addmm
``norms``          layer_norm, rms_norm, softmax/log_softmax (and over the sequence)
``reductions``     sum/mean/amax/... over any dims, cumsum
``selection``      topk, sort, argsort, cummax along a dim (and max/min with indices)
``embedding``      embedding, gather, index_select, scatter
``factories``      arange and friends: positions of the local tokens
``loss``           cross_entropy / nll_loss, elementwise losses: exact global reductions
``attention``      the captured attention: distributed attention
``conv``           convolutions: 1-d ones along the sequence split with halos (strided too)
=================  ============================================================================

A rule is two functions: ``link(ctx, node, op)`` declares edges between sequence elements (see
:mod:`autoshard.passes.infer`), ``rewrite(rw, node, op)`` emits the local computation into the new graph
through a :class:`~autoshard.passes.rewrite.Rewriter`. The rewriter asks a rule only about nodes the sequence
touches: a node whose value and inputs are in no family and whose inputs are all whole is re-emitted as it is,
replicated (``always=True``: the rule emits even those itself). Ops without a rule fall back: their inputs are
gathered whole and the fallback is recorded in the plan with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Rule", "RULES", "register"]


@dataclass(frozen=True)
class Rule:
    """The link and rewrite functions of one canonical op."""

    name: str
    link: Callable
    rewrite: Callable
    always: bool = False
    """Rewrite every node, also those the sequence does not touch (the rule emits them otherwise than as they are)."""


RULES: dict[str, Rule] = {}


def register(*names: str, link: Callable, rewrite: Callable, always: bool = False) -> None:
    """Register the rule of the canonical ops ``names``."""
    for name in names:
        if name in RULES:
            raise ValueError(f"rule for {name!r} registered twice")
        RULES[name] = Rule(name, link, rewrite, always)


def load_all() -> None:
    """Import every rule file (each registers itself)."""
    from . import (attention, conv, embedding, factories, loss, markers, matmul, norms, pointwise,  # noqa: F401
                   reductions, selection, views)
