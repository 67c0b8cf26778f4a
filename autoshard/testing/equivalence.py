"""Compare a model compiled with autoshard against the same model on one process, on this rank.

    result = compare_with_one_process(lambda: LlamaLM(cfg), lambda: (ids, labels), strategy="ring")
    assert result.max_error() < 1e-4, result.summary()

Every rank builds the model from the same seed, runs it uncompiled (the one-process reference) and
compiled with ``autoshard.backend(**options)`` on the same full inputs, calls backward on the same
scalar (the sum of every output's dot product with fixed random weights, so every output carries
gradient) and compares outputs and every parameter gradient, values and dtypes. An error is the
largest absolute difference divided by the largest magnitude of the reference tensor -- floored at
1e-3 of the largest magnitude among all outputs (or all gradients), so that a gradient that is zero in
exact arithmetic (a key bias under softmax) is not judged by its rounding noise alone.

``dtype=`` sets the parameters' dtype. ``autocast=dtype`` runs both forwards under ``torch.autocast`` of
the model's device type with that dtype (the backwards outside it, as a training step runs them) and
records the output dtypes of every op of both forwards by op name (``op_dtypes``,
``reference_op_dtypes``), to check what ran in which precision.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..compiler import backend as make_backend

__all__ = ["compare_with_one_process", "Comparison"]


@dataclass
class Comparison:
    """Per-tensor relative errors of one rank's compiled run against the reference."""

    outputs: dict[str, float] = field(default_factory=dict)
    grads: dict[str, float] = field(default_factory=dict)
    attention: list[dict] = field(default_factory=list)
    """Distributed attention decisions of the compiled graphs."""
    fallbacks: list[str] = field(default_factory=list)
    """Ops that were computed on gathered inputs."""
    transitions: list[str] = field(default_factory=list)
    compiled_reports: list = field(default_factory=list)
    """The :class:`~autoshard.passes.report.CompileReport` of every graph compiled on this rank."""
    op_dtypes: dict[str, set[tuple[str, ...]]] = field(default_factory=dict)
    """With ``autocast``: op name (``aten.mm``, ``autoshard.attention``) -> the output dtypes it ran with in the
    compiled forward on this rank (``("bfloat16",)``; one entry per distinct tuple)."""
    reference_op_dtypes: dict[str, set[tuple[str, ...]]] = field(default_factory=dict)
    """The same for the one-process forward."""
    dtypes: dict[str, str] = field(default_factory=dict)
    """Outputs and gradients whose dtype differs from the reference's: name -> ``"got, reference"``. Any makes
    :meth:`max_error` infinite."""

    def max_error(self) -> float:
        return max([0.0, *self.outputs.values(), *self.grads.values(), *(float("inf") for _ in self.dtypes)])

    def summary(self) -> str:
        worst = sorted({**{f"out {k}": v for k, v in self.outputs.items()},
                        **{f"grad {k}": v for k, v in self.grads.items()}}.items(), key=lambda kv: -kv[1])[:5]
        dtypes = f"; dtypes unlike the reference's: {self.dtypes}" if self.dtypes else ""
        return f"max relative error {self.max_error():.2e}; worst: {worst}; fallbacks: {self.fallbacks}{dtypes}"


def _flatten(out: Any, prefix: str = "out") -> dict[str, torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return {prefix: out}
    if isinstance(out, (list, tuple)):
        return {k: v for i, o in enumerate(out) for k, v in _flatten(o, f"{prefix}[{i}]").items()}
    if isinstance(out, dict) or hasattr(out, "items"):
        return {k: v for key, o in out.items() for k, v in _flatten(o, f"{prefix}.{key}").items()}
    return {}


def _objective(outputs: dict[str, torch.Tensor], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for name, t in sorted(outputs.items()):
        if t.is_floating_point() and t.requires_grad:
            w = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
            total = total + (t * w).sum()
    return total


def _errors(pairs: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]) -> dict[str, float]:
    """Relative errors of (got, reference) pairs with the floor described in the module docstring; a missing
    gradient counts as zeros."""
    def mag(t):
        return t.detach().double().abs().max().item() if t is not None and t.numel() else 0.0

    floor = 1e-3 * max([mag(b) for _, b in pairs.values()] + [1e-30])
    out = {}
    for name, (a, b) in pairs.items():
        if a is None and b is None:
            out[name] = 0.0
            continue
        a, b = (torch.zeros_like(b) if a is None else a), (torch.zeros_like(a) if b is None else b)
        if a.shape != b.shape:
            out[name] = float("inf")
            continue
        diff = (a.detach().double() - b.detach().double()).abs().max().item() if b.numel() else 0.0
        out[name] = diff / max(mag(b), floor)
    return out


class _OpDtypes(TorchDispatchMode):
    """Records the output dtypes of every op dispatched under it, by op name. Compilation runs without it (it
    ignores compile internals, so dynamo compiles instead of falling back to eager); the compiled graph's
    ops are recorded as they run. Ops a custom op runs inside are not seen."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, set[tuple[str, ...]]] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if tensors:
            self.seen.setdefault(str(func.overloadpacket), set()).add(
                tuple(str(t.dtype).removeprefix("torch.") for t in tensors))
        return out


def compare_with_one_process(make_model: Callable[[], torch.nn.Module], make_inputs: Callable[[], tuple],
                             *, seed: int = 0, dtype: torch.dtype = torch.float32, autocast: torch.dtype | None = None,
                             group=None, kwargs: dict | None = None, **options) -> Comparison:
    """Run on every rank of ``group``: compiled vs one-process outputs and parameter gradients."""
    torch.manual_seed(seed)
    model = make_model().to(dtype)
    reference = copy.deepcopy(model)
    inputs = make_inputs()
    inputs = tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
    kwargs = kwargs or {}
    device = next(model.parameters(), torch.empty(0)).device.type
    result = Comparison()

    @contextlib.contextmanager
    def forward(record: dict):
        if autocast is None:
            yield
            return
        with torch.autocast(device, dtype=autocast), _OpDtypes() as ops:
            yield
        record.update(ops.seen)

    with forward(result.reference_op_dtypes):
        ref_out = _flatten(reference(*inputs, **kwargs))
    _objective(ref_out, seed + 1).backward()

    be = make_backend(group, **options)
    compiled = torch.compile(model, backend=be)
    with forward(result.op_dtypes):
        out = _flatten(compiled(*inputs, **kwargs))
    _objective(out, seed + 1).backward()

    outputs = {name: (out.get(name), ref) for name, ref in ref_out.items()}
    ref_params = dict(reference.named_parameters())
    grads = {name: (p.grad, ref_params[name].grad) for name, p in model.named_parameters()
             if p.grad is not None or ref_params[name].grad is not None}
    result.outputs, result.grads = _errors(outputs), _errors(grads)
    result.dtypes = {f"{kind} {name}": f"{a.dtype}, {b.dtype}" for kind, pairs in (("out", outputs), ("grad", grads))
                     for name, (a, b) in pairs.items() if a is not None and b is not None and a.dtype != b.dtype}
    for graph in be.compiled:
        result.compiled_reports.append(graph.report)
        result.attention += graph.report.attention
        result.fallbacks += [f"{f.node}: {f.reason}" for f in graph.report.fallbacks]
        result.transitions += [f"{t.kind} {t.node} {t.have}->{t.want}" for t in graph.report.transitions]
    return result
