"""Regions: higher-order-op subgraphs (activation checkpointing, ``wrap``) are rewritten like the top graph.

Dynamo hands a checkpointed layer (``torch.utils.checkpoint``, transformers' gradient checkpointing) to
the backend as one ``tag_activation_checkpoint(body, *operands, **checkpoint_kwargs)`` node whose body is
a submodule; ``wrap(body, *operands)`` is the same without the checkpoint. Left as they are, nothing
inside them could be split: the passes would see one opaque call.

``inline``, the first pass, copies every body into the top graph in place of its call, so capture, the
rules and the families see the layer's attention, masks and positions exactly as in a graph without
checkpointing. Every node copied from a checkpointed body carries its region's index in
``node.meta[REGION]`` (a body checkpointed inside another one belongs to the outer region: the outer
recomputation already recomputes it); ``wrap`` bodies are inlined for good.

``outline``, the last pass, cuts each region out of the rewritten, per-rank graph again and calls it
through ``tag_activation_checkpoint`` with the original keyword arguments and body metadata (a
selective-checkpoint ``context_fn`` survives), so the inner compiler meets the checkpoint dynamo made:
eager runs ``torch.utils.checkpoint`` on the rewritten body, AOTAutograd tags its nodes for
recomputation. The rewriter tags every node it emits while rewriting a region's node with that region,
so the region's local attention, its collectives and the transitions its nodes asked for are recomputed
with it. Recomputation policy: the whole region is recomputed in backward, collectives included, with
early stop off (the HOP's own choice), so every rank reruns the same collectives in the same order; the
comm book, derived from the emitted nodes and their region tags (:mod:`.comms`), counts each recomputed
collective a second time (phase ``backward``) and the report lists the regions. With ``offload`` the call
is :func:`autoshard.runtime.offload.offloaded_checkpoint`: the same checkpoint, its inputs kept in host
memory until backward.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..runtime.offload import offloaded_checkpoint

__all__ = ["REGION", "REGIONS", "Region", "inline_regions", "fill_regions", "outline_regions"]

REGION = "autoshard_region"
"""``node.meta`` key: the index of the checkpointed region a node belongs to."""
REGIONS = "autoshard_regions"
"""``GraphModule.meta`` key: the graph's checkpointed regions (:class:`Region`), in index order."""

_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
_WRAP = torch.ops.higher_order.wrap


@dataclass(frozen=True)
class Region:
    """One checkpointed subgraph of the original graph."""

    index: int
    kwargs: dict
    """The checkpoint's keyword arguments (``use_reentrant``, ``context_fn``, ...)."""
    meta: dict
    """The body module's metadata (dynamo keeps a selective-checkpoint ``context_fn`` there)."""


def _fresh_attr(gm: fx.GraphModule, value, hint: str) -> str:
    name, i = hint, 0
    while hasattr(gm, name):
        i += 1
        name = f"{hint}_{i}"
    setattr(gm, name, value)
    return name


def _inline_one(gm: fx.GraphModule, node: fx.Node, region: int | None) -> None:
    """Copy ``node``'s body into ``gm`` before it and route its ``getitem`` users to the copied outputs."""
    owner, body_attr = node.args[0], node.args[0].target
    body: fx.GraphModule = getattr(gm, body_attr)
    graph = gm.graph
    env: dict[fx.Node, object] = {}
    operands = iter(node.args[1:])
    outputs = None
    with graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(operands)
            elif inner.op == "output":
                outputs = fx.node.map_arg(inner.args[0], lambda n: env[n])
            elif inner.op == "get_attr":  # a nested body or a constant: it moves up with its graph
                new = graph.get_attr(_fresh_attr(gm, getattr(body, inner.target), inner.target))
                new.meta.update(inner.meta)
                env[inner] = new
            else:
                new = graph.node_copy(inner, lambda n: env[n])
                if region is not None or REGION in node.meta:
                    new.meta[REGION] = node.meta.get(REGION, region)
                env[inner] = new
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise NotImplementedError(f"autoshard: {user.format_node()} uses a higher-order op's result whole")
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)
    if not owner.users:
        graph.erase_node(owner)
        delattr(gm, body_attr)


def inline_regions(gm: fx.GraphModule) -> list[Region]:
    """Inline every ``tag_activation_checkpoint`` and ``wrap`` body (nested ones too); return the
    checkpointed regions in graph order (see the module docstring). They are also kept in
    ``gm.meta[REGIONS]``, so inlining an inlined graph again (specialization inlines first, to recompute the
    bodies' example values at the concrete sizes) returns the same regions."""
    regions: list[Region] = gm.meta.setdefault(REGIONS, [])
    while True:
        hops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (_CHECKPOINT, _WRAP)]
        if not hops:
            break
        for node in hops:
            region = None
            if node.target is _CHECKPOINT and REGION not in node.meta:
                body = getattr(gm, node.args[0].target)
                region = len(regions)
                regions.append(Region(region, dict(node.kwargs), dict(body.meta)))
            _inline_one(gm, node, region)
    return regions


def fill_regions(gm: fx.GraphModule) -> None:
    """Tag the nodes later passes inserted inside a region (capture's attention, decompose's slices): a run of
    untagged nodes between two nodes of one region belongs to it. Inlining left every region contiguous and
    passes insert their nodes where the nodes they replace stood."""
    run: list[fx.Node] = []
    before = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        region = node.meta.get(REGION)
        if region is None:
            run.append(node)
            continue
        if run and before == region:
            for n in run:
                n.meta[REGION] = region
        run, before = [], region


def _outline_one(gm: fx.GraphModule, region: Region, members: list[fx.Node], checkpoint, extra: dict) -> fx.Node:
    """Replace ``members`` (a region's nodes in the rewritten graph, in order) by one call of ``checkpoint`` (its
    keyword arguments the region's, and ``extra``)."""
    graph = gm.graph
    inside = set(members)
    inputs: dict[fx.Node, None] = {}
    for n in members:
        for x in n.all_input_nodes:
            if x not in inside:
                inputs.setdefault(x)
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    body_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for x in inputs:
        env[x] = body_graph.placeholder(x.name)
        env[x].meta.update(x.meta)
    for n in members:
        env[n] = body_graph.node_copy(n, lambda x: env[x])
    body_graph.output(tuple(env[n] for n in outputs))
    body = fx.GraphModule(gm, body_graph)
    body.meta.update(region.meta)
    name = _fresh_attr(gm, body, f"checkpoint_body_{region.index}")
    with graph.inserting_after(members[-1]):
        attr = graph.get_attr(name)
    with graph.inserting_after(attr):
        call = graph.call_function(checkpoint, (attr, *inputs), dict(region.kwargs) | extra)
    last = call
    for k, n in enumerate(outputs):
        with graph.inserting_after(last):
            last = graph.call_function(operator.getitem, (call, k))
        n.replace_all_uses_with(last, delete_user_cb=lambda user: user not in inside)
    for n in reversed(members):
        graph.erase_node(n)
    return call


def outline_regions(gm: fx.GraphModule, regions: list[Region], offload: bool = False, prefetch: bool = True,
                    spared: int = 0) -> dict[str, int]:
    """Cut every region back out of the rewritten graph ``gm`` (nodes tagged ``meta[REGION]``) into a
    ``tag_activation_checkpoint`` call -- :func:`autoshard.runtime.offload.offloaded_checkpoint` with
    ``offload``: the region's inputs wait for backward in host memory (``prefetch``: backward prefetches the next
    region's while it runs one); returns how many regions were outlined, offloaded and rebuilt. ``spared`` (with
    ``offload``): regions whose inputs the host does not keep, from the last one back
    (``BackendConfig.offload_spared``): the last keeps its inputs on the device, then every other one is rebuilt
    from the one before it."""
    members: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        index = n.meta.get(REGION)
        if index is None:
            continue
        if n.target is operator.getitem and not isinstance(n.args[0], fx.Node):
            continue
        if n.target is operator.getitem and isinstance(n.args[1], int) and n.args[0].meta.get(REGION) != index:
            del n.meta[REGION]  # an element of an outer tuple (a gradient bucket): taken outside the region
            continue
        members.setdefault(index, []).append(n)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for index, nodes in members.items():  # all checked before the graph changes
        inside, last = set(nodes), order[nodes[-1]]
        for n in nodes:
            for user in n.users:
                if user not in inside and order[user] < last:
                    raise RuntimeError(f"autoshard: checkpointed region {index} is not contiguous in the rewritten "
                                       f"graph ({user.format_node()} uses {n.name} between its nodes)")
    counts = {"outlined": len(members), "offloaded": 0, "rebuilt": 0}
    for position, index in enumerate(members):
        from_end = len(members) - 1 - position
        if not offload or (spared and from_end == 0):
            checkpoint, extra = _CHECKPOINT, {}
        else:
            rebuilt = from_end % 2 == 1 and from_end < 2 * spared - 1 and position > 0
            checkpoint, extra = offloaded_checkpoint, {"prefetch": prefetch} | ({"rebuild": True} if rebuilt else {})
            counts["offloaded"] += 1
            counts["rebuilt"] += rebuilt
        _outline_one(gm, regions[index], members[index], checkpoint, extra)
    gm.graph.lint()
    gm.recompile()
    return counts
