"""What the backend keeps of each graph it compiles: why it compiled it (:class:`Cause`), what reports read of it
(:class:`GraphRecord`), and how :func:`autoshard.explain` prints it (:func:`describe_record`).

A user who sees a compilation per step needs its cause: dynamo's failed guard, a new sequence length, batch size or
dtype of a dynamic graph, sizes dropped from the backend's cache, or another variant of a graph already counted. The
backend counts every compilation by cause and warns once per frame when dynamo hands it the last graph dynamo's
recompile limit allows there (past it the frame runs uncompiled, whole on every rank).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx as fx

from .passes.graph import user_line
from .passes.report import CompileReport
from .passes.rules.recurrence import STATE_PASSING
from .runtime.warn import warn

__all__ = ["CAUSES", "Cause", "GraphRecord", "describe_record", "dynamo_cause", "warn_at_the_recompile_limit"]


CAUSES = ("new graph", "recompiled by dynamo", "new sequence length", "new batch size", "new dtype",
          "sizes dropped from the cache", "new variant")
"""Why the backend compiles a graph (:class:`Cause`), in the order :func:`explain` counts them."""


@dataclass(frozen=True)
class Cause:
    """Why a graph was compiled."""

    kind: str
    """One of :data:`CAUSES`: ``new graph`` (dynamo handed over a graph, first of its code or after a graph
    break), ``recompiled by dynamo`` (a guard of an earlier graph failed), ``new sequence length`` / ``new batch
    size`` / ``new dtype`` (a dynamic graph called with sizes not compiled before), ``sizes dropped from the
    cache`` (compiled before, evicted since: more than ``SIZES_CACHED`` sets of sizes in use), ``new variant``
    (another variant of a graph already counted: a mask structure, a cache prefill's dense variant)."""
    detail: str = ""
    """What changed, e.g. dynamo's failed guard or ``input 2 dim 1: 61 -> 64``."""

    def describe(self) -> str:
        return self.kind + (f" ({self.detail})" if self.detail else "")


def dynamo_cause(seen: dict) -> Cause:
    """The cause of dynamo handing over a graph: the newest guard failure dynamo reported since the last call, else a
    new graph. dynamo keeps the failures per code object; ``seen`` counts each one's read before (a frame that fails
    again appends to its own list, wherever that list is among the others)."""
    fresh = None
    for code, failures in list(torch._dynamo.utils.guard_failures.items()):
        if len(failures) > seen.get(code, 0):
            fresh, seen[code] = failures[-1], len(failures)
    if fresh is not None:
        return Cause("recompiled by dynamo", " ".join(str(fresh).split())[:200])
    return Cause("new graph")


_WARNED_FRAMES: set[int] = set()
"""The frames (dynamo's frame ids) warned about as at dynamo's recompile limit."""


def warn_at_the_recompile_limit(gm: fx.GraphModule, cause: Cause) -> None:
    """Warn (once per frame) when dynamo hands over the last graph its recompile limit allows for a frame: at the next
    guard failure there it runs the frame uncompiled, so nothing in it is distributed any more -- correct, whole on
    every rank, which a user would otherwise learn only from later warnings about values used outside compiled
    code."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    limit = torch._dynamo.config.recompile_limit
    if compile_id is None or compile_id.frame_compile_id is None or compile_id.frame_compile_id + 1 < limit:
        return
    if compile_id.frame_id in _WARNED_FRAMES:
        return
    _WARNED_FRAMES.add(compile_id.frame_id)
    where = next((user_line(n) for n in gm.graph.nodes if n.meta.get("stack_trace")), "unknown")
    warn(f"autoshard: dynamo has compiled the code at {where} {compile_id.frame_compile_id + 1} times "
         f"(torch._dynamo.config.recompile_limit = {limit}); at its next guard failure there dynamo runs that code "
         f"uncompiled, and nothing in it is split along the sequence any more (correct, but whole on every rank). "
         f"This time: {cause.describe()}. TORCH_LOGS=recompiles names every failing guard; autoshard.explain() lists "
         f"why each graph compiled. Where the guards are new sequence lengths of values handed from one graph to the "
         f"next (FSDP2's per-layer graphs), raising torch._dynamo.config.recompile_limit keeps them compiled")


@dataclass
class GraphRecord:
    """What the backend keeps of a graph it compiled: what reports read, nothing that holds the graphs."""

    report: CompileReport
    """Placements, transitions, fallbacks, attention decisions."""
    gathered_output_shapes: set
    """Global shapes of the outputs the graph gathers whole."""
    splits_sequence: bool
    """Whether anything in the graph is split along a sequence."""
    cause: Cause = Cause("new graph")
    """Why it was compiled."""
    length_class: str = ""
    """The lengths a graph compiled for a length class serves (:meth:`GenericGraph.describe`), else empty."""


def describe_record(index: int, record: GraphRecord) -> list[str]:
    """A compiled graph's record, as :func:`explain` prints it."""
    report = record.report
    strategies = Counter(a["strategy"] for a in report.attention)
    counts = {name: stats.counts for name, stats in report.passes.items()}
    deferred = counts.get("defer", {}).get("deferred", 0)
    recurrences = sum(c.reason == STATE_PASSING and c.phase == "forward" for c in report.comms)
    lines = [f"graph {index}: {len(report.attention)} attention call(s)"
             + (f" ({', '.join(f'{n} {k}' for k, n in strategies.items())})" if strategies else "")
             + (f", {recurrences} recurrence(s) passing their state" if recurrences else "")
             + f", {len(report.comms)} collective(s), {len(report.fallbacks)} fallback(s)"
             + (f", {deferred} output(s) handed on uncomputed" if deferred else "")
             + f"; compiled for: {record.cause.describe()}"
             + (f"; serves {record.length_class}" if record.length_class else "")]
    if report.square_values:
        lines.append(f"  sequence x sequence values: {', '.join(report.square_values)}")
    lines += [f"  fallback {f.node} ({f.op}): {f.reason}" for f in report.fallbacks]
    lines += [f"  attention {a['node']}: {a['strategy']}" + (f" -- {a['reason']}" if a.get("reason") else "")
              for a in report.attention if a["strategy"] in ("gathered-kv", "whole")]
    levers = {"chunked LM head + loss": counts.get("chunking", {}).get("chunked_losses", 0),
              "chunked MLP blocks": counts.get("tile", {}).get("chunked_mlps", 0),
              "tiled token-local regions": counts.get("tile", {}).get("tiled_regions", 0),
              "attentions with their projections in head groups": counts.get("heads", {}).get("grouped_attentions", 0),
              "recomputed regions": len(report.recomputed),
              "offloaded regions": counts.get("outline", {}).get("offloaded", 0),
              "of them rebuilt in backward": counts.get("outline", {}).get("rebuilt", 0)}
    if any(levers.values()):
        lines.append("  memory: " + ", ".join(f"{n} {k}" for k, n in levers.items() if n))
    if report.memory_policy is not None:
        lines.append("  " + report.memory_policy.describe())
    return lines
