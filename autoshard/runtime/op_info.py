"""The op registry: what the planner, the step-time model and the byte book know about each op the compiler emits.

Every ``autoshard::`` custom op declares itself beside its ``torch.library.custom_op`` definition, with the
formulas it has::

    declare(torch.ops.autoshard.attention.default, working_set=_working_set)

and the modules that price, simulate or book ops look them up here (:func:`lookup`) instead of keeping tables of
their own -- the way ``torch.utils.flop_counter.register_flop_formula`` keeps one FLOP formula per op and DTensor's
``_ops/`` files register each op's sharding strategy with one propagator. An entry (:class:`OpInfo`) holds, each
optional:

* ``flops``: the :class:`Work` of one call -- matrix FLOPs in a dtype and the bytes it streams beyond its inputs and
  outputs -- which the step-time model prices (:mod:`autoshard.step_time`); an op without it costs the bytes of its
  inputs and outputs;
* ``seconds``: the price of one call on a hardware profile, for an op a cost model prices whole (a distributed
  attention: its rank's share of the work, its imbalance, the exposed part of its communication);
* ``working_set``: the bytes the real op holds on top of its inputs and outputs while it runs, which its fake
  implementation (allocating only its outputs) does not show; the planner's memory simulation adds them
  (:func:`working_set`);
* ``traffic``: what one emitted call sends, booked on the byte book (:mod:`autoshard.passes.comms`).

Formulas read a call's arguments by name (:func:`arguments`: the op's schema names them, a Python function's
signature names its parameters; defaults filled in), never by position.

Who declares what, where: an op's module declares the op and the formulas the runtime can state. A formula that
needs what sits above the runtime registers itself on the declared op from there (:func:`register`): the traffic
declarations read the compiler's graphs (the original value a call serves, the rewriter's marks), so they stay
beside the rules that emit the calls (:func:`autoshard.passes.comms.declares`); the attention's price needs the
cost model, so the step-time model registers it. The Python functions the rewrite emits as calls (gradient syncs,
the reduction helpers) are not ops: their traffic gives them their entry.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

__all__ = ["Arguments", "Work", "OpInfo", "OPS", "declare", "register", "lookup", "arguments", "working_set"]

Arguments = dict[str, Any]
"""A call's arguments by parameter name."""


@dataclass(frozen=True)
class Work:
    """What one call computes, as the step-time model prices it (:meth:`seconds`)."""

    flops: int
    """Matrix-multiply FLOPs."""
    dtype: torch.dtype
    """The dtype they are computed in."""
    bytes: int = 0
    """Bytes streamed through memory beyond the call's inputs and outputs (passes over intermediate values)."""

    def seconds(self, profile) -> float:
        """The FLOPs over ``profile``'s rate in the dtype plus the bytes over its memory bandwidth
        (:class:`autoshard.hardware.HardwareProfile`)."""
        return self.flops / profile.matmul_rate(self.dtype) + self.bytes / profile.memory_bandwidth


@dataclass
class OpInfo:
    """One op's (or emitted function's) entry: see the module docstring."""

    target: Any
    """The op's overload (``torch.ops.autoshard.<name>.default``), or a Python function emitted as a call."""
    flops: Callable[[Arguments], Work] | None = None
    """Arguments -> the :class:`Work` of the call."""
    seconds: Callable[[Arguments, Any, int], tuple[float, float, float]] | None = None
    """``(arguments, profile, world)`` -> (compute, communication, exposed communication) seconds of the call on
    the hardware profile (:class:`autoshard.hardware.HardwareProfile`) for a rank of ``world``."""
    working_set: Callable[[Arguments], int] | None = None
    """Arguments -> bytes held on top of the call's inputs and outputs while it runs."""
    traffic: Callable[[Any, Any], None] | None = None
    """``(book, call)``: books what the emitted call sends (:class:`autoshard.passes.comms.CommBook`,
    :class:`autoshard.passes.comms.Call`)."""
    _reader: Callable[[tuple, dict], Arguments] | None = field(default=None, repr=False)

    def arguments(self, args: tuple, kwargs: dict | None = None) -> Arguments:
        """``args`` and ``kwargs`` of a call by parameter name (see :func:`arguments`)."""
        if self._reader is None:
            self._reader = _reader(self.target)
        return self._reader(args, kwargs or {})


_FORMULAS = tuple(f.name for f in fields(OpInfo) if f.name not in ("target", "_reader"))

OPS: dict[Any, OpInfo] = {}
"""Target -> its entry: every ``autoshard::`` op, and the Python functions emitted as calls that send something."""


def declare(op: torch._ops.OpOverload, **formulas: Callable) -> OpInfo:
    """Declare ``op`` beside its definition, with its ``formulas`` (the :class:`OpInfo` fields)."""
    if op in OPS:
        raise RuntimeError(f"{op} is declared twice")
    OPS[op] = OpInfo(op)
    for name, formula in formulas.items():
        register(name, op)(formula)
    return OPS[op]


def register(formula: str, *targets) -> Callable:
    """Decorator: the decorated function is the ``formula`` (an :class:`OpInfo` field) of ``targets``; an op must
    be declared first, a Python function gets its entry here."""
    if formula not in _FORMULAS:
        raise ValueError(f"{formula!r} is not one of the formulas {_FORMULAS}")

    def add(fn: Callable) -> Callable:
        for target in targets:
            if target not in OPS:
                if isinstance(target, torch._ops.OpOverload):
                    raise KeyError(f"{target} is not declared: declare it beside its definition")
                OPS[target] = OpInfo(target)
            if getattr(OPS[target], formula) is not None:
                raise RuntimeError(f"two {formula} formulas for {target}")
            setattr(OPS[target], formula, fn)
        return fn
    return add


def lookup(target) -> OpInfo | None:
    """``target``'s entry, or None."""
    return OPS.get(target)


def arguments(target, args: tuple, kwargs: dict | None = None) -> Arguments:
    """A call of ``target`` (an op overload or a Python function, declared or not) by parameter name: the op's
    schema names, else the function's signature; defaults filled in."""
    info = OPS.get(target)
    return info.arguments(args, kwargs) if info is not None else _reader(target)(args, kwargs or {})


def working_set(func, args: tuple, kwargs: dict | None = None) -> int:
    """The bytes a call of ``func`` holds on top of its inputs and outputs while it runs (0: none declared)."""
    info = OPS.get(func)
    if info is None or info.working_set is None:
        return 0
    return info.working_set(info.arguments(args, kwargs))


def _reader(target) -> Callable[[tuple, dict], Arguments]:
    """What names the arguments of calls to ``target``."""
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema.arguments
        names = tuple(a.name for a in schema)
        defaults = {a.name: a.default_value for a in schema if a.has_default_value()}

        def read_op(args: tuple, kwargs: dict) -> Arguments:
            return {**defaults, **dict(zip(names, args)), **kwargs}
        return read_op
    signature = inspect.signature(target)

    def read_function(args: tuple, kwargs: dict) -> Arguments:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)
    return read_function
