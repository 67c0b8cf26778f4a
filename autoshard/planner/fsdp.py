"""The step around the compiled graphs: FSDP2's shards and gathers and the optimizer's states, as arithmetic.

Planning options that the graphs do not show are arithmetic on top of the simulated graphs
(:mod:`autoshard.planner.memory`): ``dp_shard`` (FSDP2 shards parameters, gradients and optimizer states over that
many ranks, all-gathers one unit's parameters -- and prefetches the next -- and reduce-scatters its gradients;
its units are the outermost numbered blocks, :data:`_UNIT`) and ``optimizer`` (its states, resident all step);
see :func:`autoshard.plan`.

:func:`memory_estimate` adds the graphs of a step up: they run one after the other (graph breaks), so graph
``g``'s forward runs on top of what the graphs before it keep, its backward on top of that and the gradients of
the graphs after it; the step's peak is the largest of these, by kind
(:class:`~autoshard.planner.result.MemoryEstimate`), with the FSDP2 and optimizer terms. :func:`planned_step_time`
prices the step with the same terms: FSDP2's gathers and the optimizer's reads and writes.
"""

from __future__ import annotations

import re

import sympy
import torch

from ..hardware import HardwareProfile
from ..runtime.attention import formulas
from ..step_time import StepTime, step_time
from .memory import GraphMemory
from .result import MemoryEstimate, Plan

__all__ = ["OPTIMIZERS", "check_planning_options", "memory_estimate", "planned_step_time"]


OPTIMIZERS = (None, "adam", "adamw")
"""The optimizers whose states the memory estimate counts (:func:`autoshard.plan`'s ``optimizer``)."""


def check_planning_options(dp_shard: int, optimizer: str | None) -> None:
    """Refuse a ``dp_shard`` that is no positive int and an optimizer not in :data:`OPTIMIZERS`."""
    if not isinstance(dp_shard, int) or dp_shard < 1:
        raise ValueError(f"autoshard.plan: dp_shard must be a positive int, got {dp_shard!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"autoshard.plan: optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")


def _shard_bytes(p: torch.Tensor, shards: int) -> int:
    """Bytes of one FSDP2 shard of ``p`` (dim 0 cut into ``shards`` chunks, padded to equal size)."""
    if p.dim() == 0:
        return p.element_size()
    return -(-p.size(0) // shards) * (p.numel() // max(1, p.size(0))) * p.element_size()


_UNIT = re.compile(r"^(.*?_modules_\d+_)")
"""The FSDP2 unit a parameter's placeholder belongs to: its outermost numbered module (a block of the model's
layer list), or the root."""


def memory_estimate(memories: list[GraphMemory], *, dp_shard: int, optimizer: str | None,
                    prefetch: bool = False) -> MemoryEstimate:
    """The step's peak from its graphs' (see the module docstring), with the FSDP2 and optimizer terms;
    ``prefetch``: from the graphs' peaks with prefetch (:attr:`GraphMemory.with_prefetch`), where they offload."""
    parameters = _parameters(memories)
    full = sum(p.numel() * p.element_size() for _, p in parameters.values())
    candidates = []
    for g, m in enumerate(memories):
        before = sum(h.held for h in memories[:g])
        later = set().union(*(h.gradients for h in memories[g + 1:])) - m.gradients
        later_grads = sum(parameters[i][1].numel() * parameters[i][1].element_size() for i in later)
        forward, backward = m.with_prefetch if prefetch and m.with_prefetch else (m.forward, m.backward)
        for phase, p, grads in (("forward", forward, 0), ("backward", backward, later_grads)):
            candidates.append((before + grads + p.extra, g, phase, p, before, grads))
    _, g, phase, p, before, later_grads = max(candidates, key=lambda c: c[0])
    gradients = p.gradients + later_grads
    sharded = sum(_shard_bytes(x, dp_shard) for _, x in parameters.values())
    gathered = unsharded_grads = 0
    if dp_shard > 1:
        largest = sorted(_units(parameters).values(), reverse=True)
        gathered = sum(largest[:2])
        unsharded_grads = min(gradients, largest[0])
        gradients = gradients * sharded // max(1, full)
    states = 0
    if optimizer is not None:
        for _, x in parameters.values():
            states += _shard_bytes(x, dp_shard) // x.element_size() * _state_bytes(x)
    cached = sum(h.held_cache for h in memories[:g])  # the graphs before it keep their returned caches too
    activations = p.saved + before + p.kv_cache + p.outputs + p.transient
    fixed = sharded + gradients + states + gathered + unsharded_grads
    local = next((m.local for m in memories if m.local > 0), 1)
    formula = fixed + sympy.Rational(activations, local) * sympy.ceiling(formulas.S / formulas.P)
    return MemoryEstimate(parameters=sharded, gradients=gradients, optimizer_states=states,
                          gathered_parameters=gathered, unsharded_gradients=unsharded_grads,
                          saved_activations=p.saved + before - cached, kv_cache=p.kv_cache + cached,
                          outputs=p.outputs, transient=p.transient,
                          total=fixed + activations, formula=formula, peak_at=f"g{g} {phase}: {p.op}",
                          host_offloaded=sum(m.host for m in memories),
                          host_regions=[b for m in memories for b in m.host_regions],
                          stopped=any(m.stopped for m in memories),
                          host_prefetched=any(m.prefetched and m.host for m in memories))


def planned_step_time(result: Plan, memories: list[GraphMemory], topology: HardwareProfile, *, dp_shard: int,
                      optimizer: str | None) -> StepTime:
    """The step's time on ``topology`` (:func:`autoshard.step_time.step_time`) from the timers of its graph calls
    and the plan's counts."""
    parameters = _parameters(memories)
    optimizer_bytes = 0
    if optimizer is not None:  # reads and writes the states and the parameters (or their master copies), reads the
        for _, x in parameters.values():  # gradients
            optimizer_bytes += _shard_bytes(x, dp_shard) // x.element_size() * (2 * _state_bytes(x) + 3 * x.element_size())
    symbols = result.symbols
    return step_time([m.timer for m in memories], topology=topology, world=result.world_size,
                     tokens=symbols.get("B", 1) * symbols.get("S", 0), collectives=result.collectives,
                     attention_nodes={a.node for a in result.attention},
                     fsdp=list(_units(parameters).values()) if dp_shard > 1 else None, dp_shard=dp_shard,
                     host_bytes=result.memory_per_rank.host_offloaded,
                     host_prefetched=result.memory_per_rank.host_prefetched, optimizer_bytes=optimizer_bytes)


def _parameters(memories: list[GraphMemory]) -> dict[int, tuple[str, torch.Tensor]]:
    """Every parameter the graphs take, once."""
    parameters: dict[int, tuple[str, torch.Tensor]] = {}
    for m in memories:
        parameters.update(m.parameters)
    return parameters


def _units(parameters: dict[int, tuple[str, torch.Tensor]]) -> dict[str, int]:
    """FSDP2 unit (:data:`_UNIT`) -> bytes of its parameters."""
    units: dict[str, int] = {}
    for name, x in parameters.values():
        match = _UNIT.match(name)
        unit = match.group(1) if match else ""
        units[unit] = units.get(unit, 0) + x.numel() * x.element_size()
    return units


def _state_bytes(x: torch.Tensor) -> int:
    """The optimizer's state bytes per element of ``x``: two float32 moments, and a float32 master copy of a 16-bit
    parameter."""
    return 8 + (4 if x.element_size() < 4 and x.is_floating_point() else 0)
