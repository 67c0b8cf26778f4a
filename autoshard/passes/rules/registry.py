"""The rule table: every rule file registers its canonical ops here on import.

A leaf of the ``rules`` package: the rule files import :func:`register` from here, and the package imports
the rule files, so the table never imports the code that fills it.
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
