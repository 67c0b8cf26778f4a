"""The memory policy: ``memory_budget`` picks the cheapest recomputation, tiling and offload whose plan fits it.

Sequence parallelism divides activations by the number of ranks; when that is not enough, the compiler has
five more levers of its own, each bought with compute or transfers:

======================  ==========================================  ==========================================
lever                   what it removes                             what it costs
======================  ==========================================  ==========================================
``chunk_mlp``           the MLPs' ``[tokens, intermediate]`` values  one more forward of every MLP (backward)
                        (saved and transient), a chunk at a time
``tile_tokens``         every token-local value (norms' float32      one more forward of the token-local ops:
                        upcasts, projections, residuals, the MLP)   norms, projections, MLP (not attention)
                        but a region's outputs, a tile at a time
``head_chunks``         attention's gathered / head-split copies,    more, smaller collectives (Ulysses: some
                        accumulators and gradients but one head      key/value heads go to more ranks); the
                        group's; with the eager inner compiler the   output projection a sum of partial products
                        projections run in the same groups: the
                        queries, outputs and their gradients too
``recompute="layers"``  every value a layer saves but its input      one more forward of every layer, its
                                                                    collectives included
``offload``             the recomputed layers' inputs (host memory   a copy to the host and back per layer, on
                        holds them until backward), all but one:     a stream of its own (eager inner compiler
                        backward brings the next layer's back while  only)
                        it runs one (prefetch)
``offload_prefetch      that one: each layer's input comes back      the copy back is no longer hidden: compute
=False``                when backward uses it                       waits for it
``offload_spared``      host memory: the last region's inputs stay   one more forward of each rebuilt region (no
                        on the device, every other region before it  autograd); the last region's inputs cost the
                        is rebuilt from the one before it            device nothing at its peak
======================  ==========================================  ==========================================

(The chunked LM head + loss, ``chunk_loss``, is on by default: it costs one head matmul and removes the
largest values of a step.) The ladder, cheapest first: as configured, chunked MLPs, tiles, tiles with attention
in :data:`HEAD_CHUNKS` head groups (``head_chunks``: its gathered or head-split copies one group at a time); the
same four with recomputed layers; the same four with prefetching offload too; then with offload that brings
each layer's input back only when backward uses it -- never changing a lever the user set. The policy takes the
first option whose planned per-rank peak (:func:`autoshard.plan`'s ``memory_per_rank.total``, or
``total_prefetched`` for offload with prefetch; computed for rank 0 so that every rank decides the same) fits
the budget and whose host bytes fit ``host_budget``.

Each estimate is a whole plan (half a minute for Llama-8B at millions of tokens; offload with and without prefetch
share one, whose simulation counts what prefetching holds aside), so the policy does not plan every rung.
Device memory only falls as levers are added (tiles remove what MLP chunks remove and more; offload moves bytes to
the host), so an option whose peak exceeds the budget rules out every option it *dominates* (one with no lever
stronger) -- when it exceeds it by more than :data:`DOMINANCE_MARGIN`: in a model too small for a lever to pay,
the lever can add a little (a tile's concatenated outputs). The policy plans the strongest option first -- nothing
fits when its peak clearly does not -- then the options just below it (one lever a step weaker); then, while
options before the first one known to fit are neither planned nor ruled out, it plans the one of them that
dominates the most others (its failure rules out the most). An option without offload is also ruled out when the
same levers with offload keep more in host memory than the budget clearly allows: without offload those bytes
(every layer's input) are on the device at the end of forward. The first option of the ladder that fits is chosen.

The host budget is met region by region: an offload option whose plan keeps more in host memory than
``host_budget`` (and whose device peak fits) is planned again sparing the host the fewest regions that bring it
within (``offload_spared``, from the plan's bytes per region), and weighed with that plan. What it
planned, ruled out and chose is kept (:class:`MemoryPolicy`) and shown in the plan.

When nothing fits, an explicit budget is an error naming the smallest feasible budget (the smallest
estimate planned: the options it rules out are at most :data:`DOMINANCE_MARGIN` below it), the options planned
and what that option still holds (the planner's breakdown of its peak: a returned KV cache, which no lever removes,
is named there with its fix, ``use_cache=False``). Every rank computes the same plans, so every rank raises. The
budget the backend assumes on CUDA when none is given (the device's memory) only warns: the estimate counts
parameters as the graph sees them, whole, which over-counts FSDP-sharded models.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from .config import BackendConfig
from .passes.pipeline import compile_graph
from .runtime.groups import SequenceGroups
from .runtime.warn import warn

__all__ = ["MemoryOption", "MemoryPolicy", "MemoryBudgetError", "CHUNK_TOKENS", "MAX_CHUNKS", "DOMINANCE_MARGIN",
           "HEAD_CHUNKS", "chunk_tokens", "spared_regions", "choose_memory_policy", "memory_policy_for",
           "device_budget", "host_budget",
           "format_bytes"]

def format_bytes(nbytes: float) -> str:
    """``nbytes`` for people: ``"1.50 GiB"``, ``"12.00 KiB"``, ``"512 B"`` (the plan's and the policy's sizes)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{int(nbytes)} B"


CHUNK_TOKENS = 1024
"""Tokens per MLP chunk or tile the policy sets at least: a chunk's ``[1024, intermediate]`` values are small next
to the layer's other values, and its matmuls still run at full speed."""
MAX_CHUNKS = 16
"""MLP chunks or tiles per region the policy sets at most: past 16 a region's tiles hold less than a sixteenth of
its values -- little left to save -- and each is one more call (and one more checkpoint for a plan to
simulate)."""


def chunk_tokens(local_tokens: int | None) -> int:
    """Tokens per MLP chunk and per tile for a rank holding ``local_tokens`` (unknown: :data:`CHUNK_TOKENS`)."""
    if not local_tokens:
        return CHUNK_TOKENS
    return max(CHUNK_TOKENS, -(-local_tokens // MAX_CHUNKS))


class MemoryBudgetError(ValueError):
    """No option of the memory policy fits the budget."""


_LEVERS = ("chunk_mlp", "tile_tokens", "head_chunks", "recompute", "offload", "offload_prefetch")
HEAD_CHUNKS = 8
"""Head groups the policy runs attention in when it takes that lever (fewer where the heads allow fewer: a
Ulysses group needs a query head per rank in each; the strategy choice then prefers, among near-ties, the one
that holds the least: :func:`autoshard.cost.choose_strategy`)."""
DOMINANCE_MARGIN = 0.05
"""How far above the budget an option's peak must be to rule out the options it dominates: a lever may add a
little where it removes less (a tile's concatenated outputs in a model too small for tiles to pay), so an option
a few percent above the budget says nothing of the weaker ones."""


@dataclass(frozen=True, kw_only=True)
class MemoryOption:
    """One set of levers the policy weighed, with its planned peak."""

    chunk_mlp: int | None
    """Tokens per MLP chunk, or None."""
    tile_tokens: int | None
    """Tokens per tile of the token-local regions, or None."""
    head_chunks: int
    """Head groups every attention runs one at a time (1: all heads at once)."""
    recompute: str
    """``"none"`` or ``"layers"``."""
    offload: bool
    """Whether the checkpointed layers' inputs wait in host memory."""
    offload_prefetch: bool
    """With ``offload``: whether backward prefetches them a layer early."""
    estimate: int | None
    """Planned per-rank peak bytes with these levers; None: not planned (ruled out by an option that dominates
    it and does not fit)."""
    host: int = 0
    """Planned per-rank host bytes (the offloaded layer inputs)."""
    offload_spared: int = 0
    """With offload: regions whose inputs the host does not keep (set when the host budget is short)."""
    stopped: bool = False
    """Whether its plan stopped once it clearly exceeded the budget (``estimate`` is then a lower bound)."""

    def describe(self) -> str:
        levers = ([f"chunk_mlp={self.chunk_mlp}"] if self.chunk_mlp else []) + \
                 ([f"tile_tokens={self.tile_tokens}"] if self.tile_tokens else []) + \
                 ([f"head_chunks={self.head_chunks}"] if self.head_chunks > 1 else []) + \
                 ([f"recompute={self.recompute!r}"] if self.recompute != "none" else []) + \
                 ([f"offload{'' if self.offload_prefetch else ' (no prefetch)'}"
                   + (f" sparing {self.offload_spared} region(s) the host" if self.offload_spared else "")]
                  if self.offload else [])
        return ", ".join(levers) or "no recomputation, chunks or tiles"

    def weighed(self) -> str:
        """``<levers>: <estimate>[ + <host> in host memory]``, or ``<levers>: ruled out``."""
        if self.estimate is None:
            return f"{self.describe()}: ruled out"
        host = f" + {format_bytes(self.host)} in host memory" if self.offload and not self.stopped else ""
        return f"{self.describe()}: {'over ' if self.stopped else ''}{format_bytes(self.estimate)}{host}"


@dataclass(frozen=True, kw_only=True)
class MemoryPolicy:
    """What the policy weighed and chose for one graph."""

    budget: int
    """The per-rank budget in bytes."""
    options: tuple[MemoryOption, ...]
    """Every option of the ladder, in its order (cheapest first), planned or ruled out."""
    chosen: MemoryOption | None
    """The first that fits, or None."""
    host_budget: int | None = None
    """The per-rank host budget in bytes (None: no limit)."""

    def describe(self) -> str:
        weighed = "; ".join(o.weighed() for o in self.options)
        host = f" and {format_bytes(self.host_budget)} of host memory" if self.host_budget is not None else ""
        if self.chosen is None:
            return f"memory policy: nothing fits {format_bytes(self.budget)}{host} per rank ({weighed})"
        return (f"memory policy: {self.chosen.describe()} -- the cheapest option within "
                f"{format_bytes(self.budget)}{host} per rank ({weighed})")


def _options(config: BackendConfig, tokens: int = CHUNK_TOKENS) -> list[dict]:
    """The levers to try, cheapest first, leaving those the user set as they are: offload only with the
    layers recomputed, and only with the eager inner compiler; without prefetch after with it."""
    if config.chunk_mlp is not None or config.tile_tokens is not None:
        tokenwise = [(config.chunk_mlp, config.tile_tokens, config.head_chunks)]
    else:
        tokenwise = [(None, None, config.head_chunks), (tokens, None, config.head_chunks),
                     (None, tokens, config.head_chunks)]
    if config.head_chunks == 1:  # head groups on top of the strongest of these
        tokenwise.append((*tokenwise[-1][:2], HEAD_CHUNKS))
    layers = [config.recompute] if config.recompute != "none" else ["none", "layers"]
    prefetch_choices = [True, False] if config.offload_prefetch else [False]
    offload = [(True, prefetch) for prefetch in prefetch_choices]
    if not config.offload:
        offload = [(False, config.offload_prefetch)] + (offload if config.inner in ("eager", "auto") else [])
    out = []
    for host, prefetch in offload:
        for recompute in layers:
            for chunk_mlp, tile_tokens, head_chunks in tokenwise:
                levers = {"chunk_mlp": chunk_mlp, "tile_tokens": tile_tokens, "head_chunks": head_chunks,
                          "recompute": recompute, "offload": host, "offload_prefetch": prefetch}
                if levers not in out and not (host and recompute == "none"):
                    out.append(levers)
    return out


def _strength(levers: dict) -> tuple[int, int, int, int]:
    """How much each lever removes, comparable lever by lever: (tokenwise: none 0, MLP chunks 1, tiles 2; head
    groups; layers recomputed; offload: none 0, with prefetch 1, without prefetch 2)."""
    tokenwise = 2 if levers["tile_tokens"] else 1 if levers["chunk_mlp"] else 0
    offload = 0 if not levers["offload"] else 1 if levers["offload_prefetch"] else 2
    return tokenwise, levers["head_chunks"], int(levers["recompute"] != "none"), offload


def _dominates(a: dict, b: dict) -> bool:
    """Whether ``a`` has every lever of ``b`` at least as strong (so ``a`` plans no more memory than ``b``)."""
    return all(x >= y for x, y in zip(_strength(a), _strength(b)))


def choose_memory_policy(config: BackendConfig, estimate: Callable[[BackendConfig], tuple[int, int]], *, budget: int,
                         host_budget: int | None = None, strict: bool = True, tokens: int = CHUNK_TOKENS,
                         held: Callable[[BackendConfig], str] | None = None) -> tuple[BackendConfig, MemoryPolicy]:
    """The config of the cheapest option whose ``estimate`` (planned per-rank peak bytes, host bytes) is within
    ``budget`` and ``host_budget`` (None: no limit), and what was weighed; ``tokens``: the tokens per MLP chunk
    and per tile of the options that chunk or tile (:func:`chunk_tokens`). Planned in the order the module
    docstring gives. Nothing fits: :class:`MemoryBudgetError` when ``strict``, else a warning and the option
    with the smallest estimate; either ends with ``held`` of that option's config, when given (what it still
    holds: what a further lever, or the caller, must remove)."""
    ladder = _options(config, tokens)
    planned: dict[int, tuple[int, int]] = {}
    extra: dict[int, dict] = {}  # levers an estimate set beside the ladder's (offload_spared)

    def plan(i: int) -> tuple[int, int]:
        if i not in planned:
            peak, host, *more = estimate(dataclasses.replace(config, **ladder[i]))
            planned[i], extra[i] = (int(peak), int(host)), (more[0] if more else {})
        return planned[i]

    def within_host(i: int) -> bool:
        return host_budget is None or plan(i)[1] <= host_budget

    def fits(i: int) -> bool:
        return plan(i)[0] <= budget and within_host(i)

    def floor(j: int) -> int | None:
        """A lower bound of option ``j``'s peak: its own, planned; for an option without offload, the host bytes
        of the same levers with offload (every layer's input, all on the device at the end of forward without
        it)."""
        if j in planned:
            return planned[j][0]
        hosts = [planned[k][1] for k in planned if ladder[k]["offload"] and not ladder[j]["offload"] and
                 all(ladder[k][lever] == ladder[j][lever] for lever in ("chunk_mlp", "tile_tokens", "head_chunks",
                                                                         "recompute"))]
        return max(hosts, default=None)

    def ruled_out(i: int) -> bool:  # by an option that dominates it and whose peak clearly exceeds the budget
        return any(_dominates(ladder[j], ladder[i]) and (floor(j) or 0) > budget * (1 + DOMINANCE_MARGIN)
                   for j in range(len(ladder)))

    strongest = max(range(len(ladder)), key=lambda i: (_strength(ladder[i]), -i))
    chosen = None
    if plan(strongest)[0] <= budget * (1 + DOMINANCE_MARGIN):
        below = [i for i in range(len(ladder)) if i != strongest and _dominates(ladder[strongest], ladder[i])]
        for i in below:  # just below the strongest (nothing between): what their failures rule out
            if not any(j != i and _dominates(ladder[j], ladder[i]) for j in below) and not ruled_out(i):
                plan(i)
        while True:  # the first option that fits, in the ladder's order, planning as few as the failures allow
            first = next((i for i in range(len(ladder)) if i in planned and fits(i)), len(ladder))
            candidates = [i for i in range(first) if i not in planned and not ruled_out(i)]
            if not candidates:
                chosen = first if first < len(ladder) else None
                break
            # the candidate that dominates the most others: its failure rules out the most
            plan(max(candidates, key=lambda i: (sum(_dominates(ladder[i], ladder[j]) for j in candidates), i)))
    options = tuple(MemoryOption(**levers, estimate=planned[i][0] if i in planned else None,
                                 host=planned[i][1] if i in planned else 0, **extra.get(i, {}))
                    for i, levers in enumerate(ladder))
    policy = MemoryPolicy(budget=budget, options=options, chosen=None if chosen is None else options[chosen],
                          host_budget=host_budget)
    if chosen is not None:
        return dataclasses.replace(config, **ladder[chosen], **{k: v for k, v in extra[chosen].items()
                                                                  if k != "stopped"}), policy
    feasible = [options[i] for i in planned if within_host(i)] or [options[i] for i in planned]
    smallest = min(feasible, key=lambda o: o.estimate)
    smallest_config = dataclasses.replace(config, **{k: getattr(smallest, k) for k in (*_LEVERS, "offload_spared")})
    host = f" and {format_bytes(host_budget)} of host memory" if host_budget is not None else ""
    message = (f"autoshard: no memory policy fits memory_budget={budget:,} bytes ({format_bytes(budget)}){host} per "
               f"rank: the smallest feasible budget is {smallest.estimate:,} bytes ({format_bytes(smallest.estimate)}), "
               f"with {smallest.describe()}"
               + (f" ({format_bytes(smallest.host)} in host memory)" if smallest.offload else "")
               + ". Options planned: " + "; ".join(o.weighed() for o in options if o.estimate is not None)
               + ". Raise the budget, use more ranks, or shard parameters and optimizer states (FSDP2)."
               + (f" {held(smallest_config)}" if held is not None else ""))
    if strict:
        raise MemoryBudgetError(message)
    warn(message)
    return smallest_config, policy


def memory_policy_for(gm: fx.GraphModule, example_inputs: list, *, plan_graphs: Callable[..., Any], world_size: int,
                      config: BackendConfig, budget: int, host_budget: int | None = None, strict: bool = True,
                      dp_shard: int = 1, optimizer: str | None = None) -> tuple[BackendConfig, MemoryPolicy]:
    """The memory policy's choice for one graph (:func:`choose_memory_policy`): each option's estimate is this
    graph's plan from rank 0 (``plan_graphs``, :func:`autoshard.planner.plan_graphs`, of a copy of ``gm``; the
    options as they are, no policy inside): its peak and its host bytes; the MLP chunks and tiles are sized from the
    rank's tokens (the sequence family the compile pipeline finds; :func:`chunk_tokens`). Returns (the chosen
    config, :class:`MemoryPolicy`). When nothing fits, the error (or warning) ends with the smallest option's
    breakdown (:meth:`autoshard.planner.MemoryEstimate.describe`: a returned KV cache named with its fix).
    The planner is passed in, not imported: it plans a graph with a budget through this function."""
    plans: dict[tuple, Any] = {}  # the levers -> the plan: the options differ in these only

    clearly = int(budget * (1 + DOMINANCE_MARGIN))
    # past this many live bytes above the inputs an option's activations alone clearly exceed the budget (the
    # simulation holds the gradients whole, at most the parameters' bytes): its plan may stop there
    cap = clearly + sum(x.untyped_storage().nbytes() for x in example_inputs if isinstance(x, torch.nn.Parameter))

    def planned(option: BackendConfig, capped: bool = True):  # one plan for offload with and without prefetch
        key = (option.chunk_mlp, option.tile_tokens, option.head_chunks, option.recompute, option.offload,
               option.offload_spared)
        if key not in plans:  # the first option planned (the strongest) runs to its end: it names what is left
            plans[key] = plan_graphs([(copy.deepcopy(gm), list(example_inputs))], world_size=world_size,
                                     config=dataclasses.replace(option, memory_budget=None, offload_prefetch=False),
                                     dp_shard=dp_shard, optimizer=optimizer,
                                     memory_cap=cap if plans and capped else None)
        return plans[key]

    compiled = compile_graph(copy.deepcopy(gm), config=dataclasses.replace(config, memory_budget=None),
                             groups=SequenceGroups.planned(0, world_size), planning=True)
    families = compiled.families.families  # the rank's tokens, which size the chunks and tiles: no plan needed
    local = -(-families[0].length // world_size) if families else None

    def estimate(option: BackendConfig) -> tuple:
        memory = planned(option).memory_per_rank
        spared = {}
        if option.offload and not option.offload_spared and host_budget is not None and \
                memory.host_offloaded > host_budget and memory.total <= budget * (1 + DOMINANCE_MARGIN):
            # spare the host what it lacks, region by region (pointless where the device is clearly short)
            count = spared_regions(memory.host_regions, memory.host_offloaded - host_budget)
            if count:
                spared = {"offload_spared": count}
                memory = planned(dataclasses.replace(option, **spared), capped=False).memory_per_rank
        prefetch = option.offload and option.offload_prefetch
        peak = memory.total_prefetched if prefetch else memory.total
        if memory.stopped:
            return max(peak, clearly + 1), memory.host_offloaded, {**spared, "stopped": True}
        return peak, memory.host_offloaded, spared

    def held(option: BackendConfig) -> str:  # what the smallest option still holds: what a further lever must remove
        return f"The smallest option's memory per rank {planned(option).memory_per_rank.describe()}"

    return choose_memory_policy(config, estimate, budget=budget, host_budget=host_budget, strict=strict,
                                tokens=chunk_tokens(local), held=held)


def spared_regions(regions: list[int], excess: int) -> int | None:
    """The fewest regions ``offload_spared`` must spare the host to free ``excess`` bytes of it, given the bytes
    each offloaded region keeps there (``regions``, forward's order; the order :func:`~autoshard.passes.regions.
    outline_regions` spares them in: the last, then every other one before it, never the first); None: not
    enough."""
    order = [len(regions) - 1] + list(range(len(regions) - 2, 0, -2))
    freed = 0
    for count, index in enumerate(order, 1):
        freed += regions[index]
        if freed >= excess:
            return count
    return None


def host_budget() -> int | None:
    """This rank's share of the host's physical memory: all of it divided among the node's ranks
    (``LOCAL_WORLD_SIZE``, 1 when unset); None (no limit) where the system does not say."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return None
    return total // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def device_budget(example_inputs: list) -> int | None:
    """The memory of the CUDA device the graph's inputs are on, or None (CPU: no budget)."""
    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor) and x.device.type == "cuda"), None)
    if device is None:
        return None
    return torch.cuda.get_device_properties(device).total_memory
