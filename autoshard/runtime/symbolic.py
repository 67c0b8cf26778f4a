"""Sizes that depend on a symbolic sequence length.

A graph compiled for every length (:mod:`autoshard.passes.specialize`) carries its sizes as ``torch.SymInt``: an
expression of the length symbols, with the call's value as its hint, in a ``ShapeEnv`` of the compile. The passes
and the layouts work on such sizes as on ints: arithmetic stays an expression (the rank graph computes it at run
time), and a comparison that decides something records a *guard* in the ``ShapeEnv`` -- the set of lengths the
compiled graph serves (its length class) is the set where every guard holds. Code that only needs a number for a
heuristic or a report reads the hint (:func:`hint_of`) and records nothing; code that keys a dict on sizes uses
:func:`size_key` (a ``SymInt`` is unhashable).
"""

from __future__ import annotations

import torch

__all__ = ["is_symbolic", "as_size", "hint_of", "size_key", "evaluate"]


def is_symbolic(size) -> bool:
    """True for a size that depends on a symbolic length."""
    return isinstance(size, torch.SymInt) and size.node.maybe_as_int() is None


def as_size(size):
    """A size as the passes hold it: an ``int``, or a ``SymInt`` that depends on a symbolic length."""
    if isinstance(size, torch.SymInt):
        value = size.node.maybe_as_int()
        return size if value is None else value
    return int(size)


def hint_of(size) -> int:
    """The value of a size in the call being compiled (a ``SymInt``'s hint): for heuristics and reports that must
    not record a guard."""
    return size.node.hint if isinstance(size, torch.SymInt) else size


def size_key(value):
    """``value`` (a size, a shape, a tuple of them and other constants) as a dict key: a ``SymInt`` by its
    expression (hashing one fails; comparing one records a guard)."""
    if isinstance(value, torch.SymInt):
        return ("SymInt", value.node.expr)
    if isinstance(value, (tuple, list)):
        return tuple(size_key(v) for v in value)
    return value


def evaluate(size, values: dict) -> int:
    """A size's value for a call: a symbolic one evaluated at ``values`` (symbol -> int)."""
    if not is_symbolic(size):
        return int(size)
    return int(size.node.expr.xreplace(values))
