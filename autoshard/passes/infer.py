"""Infer which dimension of which value carries the sequence, and with what offset.

The pass works on *elements*: one factor of one dim of one tensor value, written ``(node, dim,
factor)``. A dim is usually one factor; a view that merges dims (``[B, S, V] -> [B*S, V]``) gives the
merged dim several factors so that the sequence can be followed through the merge and back.

Every op's link rule (``rules/*.py``) declares *edges* between elements of its inputs and outputs:
``(a, b, delta)`` says "position ``i`` of ``a`` is position ``i + delta`` of ``b``". Pointwise ops, views,
norms and linear layers give ``delta = 0``; slices, pads and concatenations give offsets (a shifted
label is the next token's label).

Elements are then joined over the edges, *largest tensors first* (an edge weighs the smaller of its
two tensors), keeping offsets: position ``i`` of an element is position ``i + offset`` of its group's
root. An edge is *refused* when it would give an element a second offset (the same tensor used as
token ids and as shifted labels), or put two dims of one value into one group (attention scores
``[.., S, S]``); the op behind a refused edge re-aligns or gathers that input when the graph is
rewritten -- and because big tensors were joined first, what moves is the small one (the labels, not
the logits). Groups that contain a seed -- the sequence dims of attention calls, of annotated inputs
(``autoshard.mark_sequence``) and of ``seq_dims`` -- are the *families*; the first seed is a family's
root (the first attention's query dim, whose layout the strategy chooses). Elements in no family
are not split.

Some positions are not an offset of others: a strided convolution's output position ``j`` reads input
positions ``s*j - p ...``. Its rule declares a *conditional seed* instead of an edge (``seed_along``): the
input's length is a sequence of its own whenever the output's is one (and the other way round), so the
input becomes the root of a new family with its own layout, and the rule moves the halos between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .dispatch import dispatch_regions
from .ops import as_size, is_tensor_node, op_of, shape_of, value_of

__all__ = ["Elem", "Family", "Families", "LinkContext", "find_families", "token_local_nodes"]

Elem = tuple[fx.Node, int, int]
"""(node, dim, factor)"""


@dataclass
class Family:
    """One sequence: the elements that carry it and their offsets to the root."""

    index: int
    root: Elem
    """The element whose positions are the family's positions (offset 0)."""
    length: int
    """The root's length: the sequence length the layout splits."""
    offsets: dict[Elem, int] = field(default_factory=dict)
    """Element -> offset: position ``i`` of the element is root position ``i + offset``."""
    attention_nodes: list[fx.Node] = field(default_factory=list)
    """Attention calls whose sequence this is."""
    root_offset: int = 0
    """The root's offset inside its joined group (an implementation detail of :func:`find_families`)."""


@dataclass
class Families:
    """Result of :func:`find_families`."""

    families: list[Family]
    member: dict[Elem, tuple[Family, int]]
    """Element -> (family, offset)."""
    factors: dict[fx.Node, list[list[int]]]
    """Node -> factorization of each dim (global sizes)."""
    refused: list[tuple[Elem, Elem, int, str]]
    """Edges not followed, with the reason."""
    token_local: set[fx.Node] = field(default_factory=set)
    """Nodes inside ``autoshard.token_local`` regions."""

    def square_values(self) -> set[str]:
        """Names of the values that carry a sequence on two dims (an S x S score or mask matrix): a refused
        edge that would have put a second dim of the value into a family. Two dims of a value that no family
        holds (the batch twice, in a ``[B, B]`` contrastive matrix) are not a sequence."""
        return {why.removeprefix("second dim of ") for a, b, _, why in self.refused
                if why.startswith("second dim of ") and (a in self.member or b in self.member)}

    def dims_of(self, node: fx.Node) -> list[tuple[int, int, Family, int]]:
        """The (dim, factor, family, offset) of every element of ``node`` that is in a family."""
        out = []
        for d, fs in enumerate(self.factors.get(node, [])):
            for f in range(len(fs)):
                hit = self.member.get((node, d, f))
                if hit is not None:
                    out.append((d, f, hit[0], hit[1]))
        return out


class LinkContext:
    """What link rules see: factorizations of values and a way to declare edges."""

    def __init__(self):
        self.factors: dict[fx.Node, list[list[int]]] = {}
        self.edge_list: list[tuple[Elem, Elem, int, int]] = []
        """(a, b, delta, order): position i of a is position i + delta of b."""
        self.seeds: list[tuple[Elem, fx.Node | None]] = []
        self.weak_seeds: list[Elem] = []
        self.conditional_seeds: list[tuple[Elem, Elem]] = []
        """(element, anchor): the element roots a family of its own when the anchor is in one."""
        self.token_local: set[fx.Node] = set()
        """Nodes inside ``autoshard.token_local`` regions."""
        self.attention_lengths: set = set()
        """The query lengths of the graph's attention calls (a view that merges dims into one starts a sequence)."""
        self.joined_lengths: set = set()
        """The lengths of the parts of a joint sequence an attention's queries are concatenated from (a view that
        merges dims into one of them starts a sequence too)."""
        self._linked: set[tuple[fx.Node, int]] = set()  # (node, dim) pairs some edge already uses

    def factorization(self, node: fx.Node) -> list[list[int]]:
        """The factors of each dim of ``node`` (defaults to one factor per dim)."""
        if node not in self.factors:
            self.factors[node] = [[s] for s in shape_of(node)] if is_tensor_node(node) else []
        return self.factors[node]

    def set_factorization(self, node: fx.Node, factors: list[list[int]]) -> None:
        self.factors[node] = factors

    def link(self, a: Elem, b: Elem, delta: int = 0) -> None:
        """Position ``i`` of element ``a`` is position ``i + delta`` of element ``b``."""
        if a[0] is b[0] and a[1:] == b[1:]:
            return
        self._linked.update(((a[0], a[1]), (b[0], b[1])))
        self.edge_list.append((a, b, delta, len(self.edge_list)))

    def link_dims(self, a: fx.Node, da: int, b: fx.Node, db: int, delta: int = 0) -> None:
        """Link dim ``da`` of ``a`` with dim ``db`` of ``b``: factor by factor when both are the same merge
        (then ``delta`` must be 0), as one position each when both are plain dims (sizes may differ, as
        across a slice). A size-1 dim is never linked: it is broadcast, not a position."""
        fa, fb = self.factorization(a)[da], self.factorization(b)[db]
        for node, mine, theirs, d in ((a, fa, fb, da), (b, fb, fa, db)):
            if len(mine) == 1 and len(theirs) > 1 and mine[0] == math.prod(theirs) and (node, d) not in self._linked:
                self.factors[node][d] = list(theirs)  # a dim not linked yet takes the merge it meets
        fa, fb = self.factorization(a)[da], self.factorization(b)[db]
        if len(fa) == 1 and len(fb) == 1:
            if fa != [1] and fb != [1]:
                self.link((a, da, 0), (b, db, 0), delta)
        elif fa == fb and delta == 0:
            for k in range(len(fa)):
                if fa[k] != 1:
                    self.link((a, da, k), (b, db, k), 0)

    def seed(self, elem: Elem, attention: fx.Node | None = None) -> None:
        """``elem`` carries a sequence (the first seed of a family becomes its root)."""
        self.seeds.append((elem, attention))

    def seed_weakly(self, elem: Elem) -> None:
        """``elem`` carries a sequence, but roots its family only when no :meth:`seed` is in it: a recurrence's input,
        whose positions may sit at an offset from the attention's (after a causal convolution), which keep the
        layout the strategy asked for."""
        self.weak_seeds.append(elem)

    def seed_along(self, elem: Elem, anchor: Elem) -> None:
        """``elem`` carries a sequence of its own whenever ``anchor`` is in a family (a strided convolution's
        input and output: no offset maps one onto the other)."""
        self.conditional_seeds.append((elem, anchor))


def _numel(node: fx.Node) -> int:
    v = value_of(node)
    return as_size(v.numel()) if hasattr(v, "numel") else 0


def _order(size) -> int:
    """Where a tensor of ``size`` elements comes in the joins' order: its size; a symbolic size (a graph compiled
    for every length) at a length beyond any real one, so the order, and the links an order refuses, are the same
    for every length and record no guard."""
    if not isinstance(size, torch.SymInt):
        return size
    return int(size.node.expr.xreplace({sym: 1 << 60 for sym in size.node.expr.free_symbols}))


def find_families(ctx: LinkContext) -> Families:
    """Join elements over the declared edges, largest tensors first, and keep the joined groups that
    contain a seed (see the module docstring)."""
    parent: dict[Elem, Elem] = {}
    offset: dict[Elem, int] = {}  # position i of e is position i + offset[e] of parent[e]
    members: dict[Elem, dict[fx.Node, tuple[int, int]]] = {}  # root -> the (dim, factor) each node has in it

    def find(e: Elem) -> tuple[Elem, int]:
        if e not in parent:
            parent[e], offset[e], members[e] = e, 0, {e[0]: e[1:]}
            return e, 0
        path, total = [], 0
        while parent[e] != e:
            path.append(e)
            total += offset[e]
            e = parent[e]
        acc = total
        for p in path:  # compress: point straight at the root
            step = offset[p]
            parent[p], offset[p] = e, acc
            acc -= step
        return e, total

    refused: list[tuple[Elem, Elem, int, str]] = []
    edges = sorted(ctx.edge_list, key=lambda edge: (-min(_order(_numel(edge[0][0])), _order(_numel(edge[1][0]))),
                                                    edge[3]))
    for a, b, delta, _ in edges:
        ra, oa = find(a)  # position i of a is position i + oa of ra
        rb, ob = find(b)
        if ra == rb:
            if oa != delta + ob:
                refused.append((a, b, delta, "offset"))
            continue
        small, large = (ra, rb) if len(members[ra]) < len(members[rb]) else (rb, ra)
        clash = next((node for node, dims in members[small].items()
                      if members[large].get(node, dims) != dims), None)
        if clash is not None:
            refused.append((a, b, delta, f"second dim of {clash.name}"))
            continue
        # attach rb under ra: position i of rb is position i - ob + delta + oa of ra
        parent[rb], offset[rb] = ra, oa - delta - ob
        if small is rb:
            members[ra].update(members.pop(rb))
        else:
            members[rb].update(members.pop(ra))
            members[ra] = members.pop(rb)

    families: list[Family] = []
    by_root: dict[Elem, Family] = {}
    for seed, attention in ctx.seeds + [(elem, None) for elem in ctx.weak_seeds]:
        root, seed_off = find(seed)
        fam = by_root.get(root)
        if fam is None:
            size = ctx.factorization(seed[0])[seed[1]][seed[2]]
            fam = by_root[root] = Family(len(families), seed, size)
            fam.root_offset = seed_off
            families.append(fam)
        if attention is not None and attention not in fam.attention_nodes:
            fam.attention_nodes.append(attention)
    added = True
    while added:  # a chain of strided convolutions reaches the families one link at a time
        added = False
        for elem, anchor in ctx.conditional_seeds:
            root, seed_off = find(elem)
            if root not in by_root and find(anchor)[0] in by_root:
                fam = by_root[root] = Family(len(families), elem, ctx.factorization(elem[0])[elem[1]][elem[2]])
                fam.root_offset = seed_off
                families.append(fam)
                added = True
    member: dict[Elem, tuple[Family, int]] = {}
    for e in list(parent):
        root, off = find(e)
        fam = by_root.get(root)
        if fam is not None:
            member[e] = (fam, off - fam.root_offset)
            fam.offsets[e] = off - fam.root_offset
    return Families(families, member, ctx.factors, refused, ctx.token_local)


def token_local_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes inside ``autoshard.token_local`` regions -- reachable from an enter marker and reaching an exit one --
    and inside expert dispatches (:func:`~.dispatch.dispatch_regions`)."""
    def marked(name):
        return [n for n in gm.graph.nodes if (op_of(n) is not None and op_of(n).name == name)]

    def reachable(starts, step):
        seen, stack = set(), list(starts)
        while stack:
            for nxt in step(stack.pop()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    after = reachable(marked("token_local_enter"), lambda n: n.users)
    region = after & reachable(marked("token_local_exit"), lambda n: n.all_input_nodes)
    made_here = lambda n: n.op == "call_function" and not n.all_input_nodes  # noqa: E731  (factories)
    # mutations (x[i] = y) have no users, so they reach no exit marker: they belong to the region they write
    region |= {n for n in after if not n.users and all(i in region or made_here(i) for i in n.all_input_nodes)}
    # factories used only inside the region (an arange of the tokens) belong to it
    region |= {n for n in gm.graph.nodes if made_here(n) and n.users and set(n.users) <= region}
    return region | dispatch_regions(gm)
