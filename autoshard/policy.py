"""The memory policy: ``memory_budget`` picks the cheapest recomputation and chunking whose plan fits it.

Sequence parallelism divides activations by the number of ranks; when that is not enough, the compiler has
three more levers of its own, each bought with compute or transfers:

======================  ==========================================  ==========================================
lever                   what it removes                             what it costs
======================  ==========================================  ==========================================
``chunk_mlp``           the MLPs' ``[tokens, intermediate]`` values  one more forward of every MLP (backward)
                        (saved and transient), a chunk at a time
``recompute="layers"``  every value a layer saves but its input      one more forward of every layer, its
                                                                    collectives included
``offload``             the recomputed layers' inputs (host memory   a copy to the host and back per layer
                        holds them until backward)                  (eager inner compiler only)
======================  ==========================================  ==========================================

(The chunked LM head + loss, ``chunk_loss``, is on by default: it costs one head matmul and removes the
largest values of a step.) The policy tries, in that order of cost, the options as configured, then with
chunked MLPs, then with recomputed layers, then with both, then with both and offload -- never changing a
lever the user set -- and takes the first whose planned per-rank peak (:func:`autoshard.plan`'s
``memory_per_rank.total``, computed for rank 0 so that every rank decides the same) fits the budget. What it
weighed and why it chose is kept (:class:`MemoryPolicy`) and shown in the plan.

When nothing fits, an explicit budget is an error naming the smallest feasible budget (the smallest
estimate) and the options planned. Every rank computes the same plans, so every rank raises. The budget the
backend assumes on CUDA when none is given (the device's memory) only warns: the estimate counts
parameters as the graph sees them, whole, which over-counts FSDP-sharded models.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .config import BackendConfig

__all__ = ["MemoryOption", "MemoryPolicy", "MemoryBudgetError", "CHUNK_MLP_TOKENS", "MAX_MLP_CHUNKS",
           "mlp_chunk_tokens", "choose_memory_policy",
           "device_budget", "format_bytes"]

def format_bytes(nbytes: float) -> str:
    """``nbytes`` for people: ``"1.50 GiB"``, ``"12.00 KiB"``, ``"512 B"`` (the plan's and the policy's sizes)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{int(nbytes)} B"


CHUNK_MLP_TOKENS = 1024
"""Tokens per MLP chunk the policy sets at least: a chunk's ``[1024, intermediate]`` values are small next to the
layer's other values, and its matmuls still run at full speed."""
MAX_MLP_CHUNKS = 16
"""Chunks per MLP block the policy sets at most: past 16 a block's chunks hold less than a sixteenth of its
``[tokens, intermediate]`` values -- little left to save -- and each chunk is one more call (and one more
checkpoint for a plan to simulate)."""


def mlp_chunk_tokens(local_tokens: int | None) -> int:
    """Tokens per MLP chunk for a rank holding ``local_tokens`` (unknown: :data:`CHUNK_MLP_TOKENS`)."""
    if not local_tokens:
        return CHUNK_MLP_TOKENS
    return max(CHUNK_MLP_TOKENS, -(-local_tokens // MAX_MLP_CHUNKS))


class MemoryBudgetError(ValueError):
    """No option of the memory policy fits the budget."""


@dataclass(frozen=True, kw_only=True)
class MemoryOption:
    """One set of levers the policy weighed, with its planned peak."""

    chunk_mlp: int | None
    """Tokens per MLP chunk, or None."""
    recompute: str
    """``"none"`` or ``"layers"``."""
    offload: bool
    """Whether the checkpointed layers' inputs wait in host memory."""
    estimate: int
    """Planned per-rank peak bytes with these levers."""

    def describe(self) -> str:
        levers = ([f"chunk_mlp={self.chunk_mlp}"] if self.chunk_mlp else []) + \
                 ([f"recompute={self.recompute!r}"] if self.recompute != "none" else []) + \
                 (["offload"] if self.offload else [])
        return ", ".join(levers) or "no recomputation or MLP chunking"


@dataclass(frozen=True, kw_only=True)
class MemoryPolicy:
    """What the policy weighed and chose for one graph."""

    budget: int
    """The per-rank budget in bytes."""
    options: tuple[MemoryOption, ...]
    """The options planned, in the order tried (cheapest first)."""
    chosen: MemoryOption | None
    """The first that fits, or None."""

    def describe(self) -> str:
        weighed = "; ".join(f"{o.describe()}: {format_bytes(o.estimate)}" for o in self.options)
        if self.chosen is None:
            return f"memory policy: nothing fits {format_bytes(self.budget)} per rank ({weighed})"
        return (f"memory policy: {self.chosen.describe()} -- the cheapest option within "
                f"{format_bytes(self.budget)} per rank ({weighed})")


def _options(config: BackendConfig, mlp_chunk: int = CHUNK_MLP_TOKENS) -> list[dict]:
    """The levers to try, cheapest first, leaving those the user set as they are: offload only with the
    layers recomputed, and only with the eager inner compiler."""
    mlp = [config.chunk_mlp] if config.chunk_mlp is not None else [None, mlp_chunk]
    layers = [config.recompute] if config.recompute != "none" else ["none", "layers"]
    offload = [True] if config.offload else [False] + ([True] if config.inner in ("eager", "auto") else [])
    out = []
    for host in offload:
        for recompute in layers:
            for chunk_mlp in mlp:
                levers = {"chunk_mlp": chunk_mlp, "recompute": recompute, "offload": host}
                if levers not in out and not (host and recompute == "none"):
                    out.append(levers)
    return out


def choose_memory_policy(config: BackendConfig, estimate: Callable[[BackendConfig], int], *, budget: int,
                         strict: bool = True, mlp_chunk: int = CHUNK_MLP_TOKENS) -> tuple[BackendConfig, MemoryPolicy]:
    """The config of the cheapest option whose ``estimate`` (planned per-rank peak bytes) is within ``budget``,
    and what was weighed; ``mlp_chunk``: the tokens per MLP chunk of the options that chunk them
    (:func:`mlp_chunk_tokens`). Nothing fits: :class:`MemoryBudgetError` when ``strict``, else a warning and
    the option with the smallest estimate."""
    options = []
    for levers in _options(config, mlp_chunk):
        candidate = dataclasses.replace(config, **levers)
        options.append(MemoryOption(**levers, estimate=int(estimate(candidate))))
        if options[-1].estimate <= budget:
            policy = MemoryPolicy(budget=budget, options=tuple(options), chosen=options[-1])
            return candidate, policy
    policy = MemoryPolicy(budget=budget, options=tuple(options), chosen=None)
    smallest = min(options, key=lambda o: o.estimate)
    message = (f"autoshard: no memory policy fits memory_budget={budget:,} bytes ({format_bytes(budget)}) per "
               f"rank: the smallest feasible budget is {smallest.estimate:,} bytes ({format_bytes(smallest.estimate)}), with "
               f"{smallest.describe()}. Options planned: "
               + "; ".join(f"{o.describe()}: {format_bytes(o.estimate)}" for o in options)
               + ". Raise the budget, use more ranks, or shard parameters and optimizer states (FSDP2).")
    if strict:
        raise MemoryBudgetError(message)
    warnings.warn(message, stacklevel=3)
    return dataclasses.replace(config, chunk_mlp=smallest.chunk_mlp, recompute=smallest.recompute,
                               offload=smallest.offload), policy


def device_budget(example_inputs: list) -> int | None:
    """The memory of the CUDA device the graph's inputs are on, or None (CPU: no budget)."""
    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor) and x.device.type == "cuda"), None)
    if device is None:
        return None
    return torch.cuda.get_device_properties(device).total_memory
