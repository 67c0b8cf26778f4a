"""Rewrite: emit the per-rank graph, one rule at a time, inserting placement transitions.

The :class:`Rewriter` walks the original graph in order and builds a new one. For every node the
op's rule (``rules/``) asks for its inputs in the placements it needs (``rw.input(x, want)``), emits
the local computation and declares the output placement (``rw.done``). Transitions between
placements are inserted on demand and cached per (value, placement):

==========  ===========  ==================================================================
have        want         emitted
==========  ===========  ==================================================================
R           S            ``seq_shard``: local slice, no communication
S           R            ``seq_unshard``: all-gather (a *fallback* unless the rule expects it)
S(A)        S(B)         ``seq_realign``: point-to-point exchange of the positions that moved
P           R            ``reduce_partial``: all-reduce
R           R (local)    ``grad_sync``: identity whose backward sums the gradient over ranks
==========  ===========  ==================================================================

Every transition that moves data and every fallback is recorded in the :class:`~.report.CompileReport`,
with the node it serves and the bytes this rank sends. Collectives are not booked as they are emitted:
every emitted node is marked with the node whose rewrite emitted it, a transition's collective with the
value it moves, and once the graph is built the comm book is derived from it (:mod:`.comms`).
"""

from __future__ import annotations

from typing import Any

import operator

import torch
import torch.fx as fx

from ..config import BackendConfig
from ..placements import REPLICATE, Partial, Placement, Replicate, Shard
from ..runtime.accounting import all_gather_bytes, all_reduce_bytes
from ..runtime.groups import SequenceGroups
from ..runtime.layouts import SequenceLayout
from ..runtime.redistribute import grad_scale, grad_sync, grad_sync_bucket, realign_bytes, reduce_partial
from ..runtime.symbolic import is_symbolic
from .comms import EMITTED_BY, LAYOUT, REASON, SERVES, CommBook, derive_comms
from .graph import is_module_state, mutates, storage_of, user_line
from .infer import Families, Family
from .ops import UNBOUND, hint_of, is_tensor_node, numel, op_of, shape_of, value_of
from .regions import REGION
from .report import CompileReport, Fallback, Transition
from .rules import RULES

__all__ = ["Rewriter", "GRAD_BUCKET_BYTES", "is_parameter"]

GRAD_BUCKET_BYTES = 25 * 2**20
"""Largest gradient bucket (as DDP's default)."""


class Rewriter:
    """Builds the local graph of one rank (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, families: Families, layouts: dict[int, SequenceLayout], *,
                 groups: SequenceGroups, config: BackendConfig, strategies: dict[fx.Node, str],
                 sharded_inputs: dict[str, Shard] | None = None):
        self.gm = gm
        self.groups = groups
        """This rank and the groups the emitted collectives run over."""
        self.rank, self.world = groups.rank, groups.world
        """Shorthands of ``groups`` (the rules and the chunked MLP read them for shapes and layouts)."""
        self.sharded_inputs = sharded_inputs or {}
        self.families = families
        self.layouts = layouts
        self.config = config
        self.strategies = strategies
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.placements: dict[fx.Node, Any] = {}
        self.replicated_uses: dict[fx.Node, fx.Node] = {}
        """New node -> the original node it is a replicated use of (a parameter through its gradient bucket):
        the same value as the original's, which ``env`` maps to the node before the wrapper."""
        self.report = CompileReport()
        self._cache: dict[tuple, fx.Node] = {}
        self._bucket: list | None = None  # [bucket node, bytes, dtype] of the open gradient bucket
        self._root_of: dict[SequenceLayout, int] = {}  # layout -> the length of the family root it derives from
        self.gathered_outputs: list[fx.Node] = []
        """Outputs that were split and are gathered whole for the caller."""
        self.carried_outputs: dict[int, Shard] = {}
        """Position in the output tuple -> placement of the split outputs left local (``outputs="split"``)."""
        self.split_outputs: set[int] = set()
        """Positions of the outputs returned as this rank's shard (``"sharded"``, or carried: ``"split"``)."""
        self._last_placeholder: fx.Node | None = None
        self._aliases: dict | None = None  # storage -> the original nodes viewing it (built at the first write)
        self._order: dict[fx.Node, int] = {}

    # ------------------------------------------------------------------ facts about original nodes
    @staticmethod
    def shape(node: fx.Node) -> tuple[int, ...]:
        return shape_of(node)

    def family_layout(self, family: Family) -> SequenceLayout:
        return self.layouts[family.index]

    def out_shard(self, node: fx.Node) -> Shard | None:
        """The Shard placement inference gave ``node``'s value, or None."""
        dims = self.families.dims_of(node)
        if not dims:
            return None
        dim, factor, family, offset = dims[0]
        factors = self.families.factors[node][dim]
        layout = self.family_layout(family).derive(offset, factors[factor])
        self._root_of[layout.at_hint()] = hint_of(family.length)  # what the comm book reads: the call's lengths
        return Shard(dim, layout, tuple(factors) if len(factors) > 1 else (), factor if len(factors) > 1 else 0)

    def root_length(self, layout: SequenceLayout) -> int:
        """The length of the family root a split value's layout derives from (for byte formulas), at the lengths of
        the call being compiled."""
        known = self._root_of.get(layout)
        if known is not None:
            return known
        return hint_of(self.families.families[0].length) if self.families.families else layout.length

    def originals(self) -> dict[fx.Node, fx.Node]:
        """Each node of the rank graph made for a node of the original graph -> that node (the parameters' gradient
        wrappers included): what the passes after the rewrite read shapes and placements from."""
        out = {new: original for original, new in self.env.items() if isinstance(new, fx.Node)}
        out.update(self.replicated_uses)
        return out

    def global_shapes(self, originals: dict[fx.Node, fx.Node]) -> dict[fx.Node, tuple]:
        """Each rank-graph node of ``originals`` (:meth:`originals`) that holds a tensor -> its global shape."""
        return {node: tuple(shape_of(original)) for node, original in originals.items() if is_tensor_node(original)}

    def placement(self, node: Any) -> Placement:
        if not isinstance(node, fx.Node):
            return REPLICATE
        return self.placements.get(node, REPLICATE)

    def local_shape(self, node: fx.Node, placement: Placement | None = None) -> list[int]:
        """Local shape of ``node``'s value on this rank under ``placement`` (default: its own)."""
        placement = self.placement(node) if placement is None else placement
        shape = self.shape(node)
        return placement.local_shape(shape, self.rank) if isinstance(placement, Shard) else list(shape)

    def requires_grad(self, node: Any) -> bool:
        return is_tensor_node(node) and bool(value_of(node).requires_grad)

    # ------------------------------------------------------------------ emitting
    def call(self, target, *args, **kwargs) -> fx.Node:
        return self.graph.call_function(target, tuple(args), dict(kwargs))

    def method(self, name: str, *args, **kwargs) -> fx.Node:
        return self.graph.call_method(name, tuple(args), dict(kwargs))

    def in_dtype_of(self, node: fx.Node, x: fx.Node, new: Any) -> Any:
        """``new`` (the new-graph value of ``node``'s input ``x``) cast to the dtype ``node`` computed in, its
        output's, where ``x``'s differs. Under ``torch.autocast`` an op of the lower-precision list (SDPA,
        linear, addmm) casts its inputs; when a rule emits it as other ops (a custom op, a partial product
        plus a bias) they get their inputs as autocast gave them. Gradients flow back through the cast."""
        dtype = value_of(node).dtype
        return new if value_of(x).dtype == dtype else self.method("to", new, dtype)

    def value(self, arg: Any) -> Any:
        """The new-graph counterpart of ``arg`` (nodes mapped, containers mapped element-wise), no transition."""
        return fx.node.map_arg(arg, lambda n: self.env[n])

    def reemit(self, node: fx.Node, args: tuple | None = None, kwargs: dict | None = None) -> fx.Node:
        """``node``'s call again, with ``args``/``kwargs`` (already new-graph values) or its own mapped ones."""
        args = self.value(node.args) if args is None else args
        kwargs = self.value(node.kwargs) if kwargs is None else kwargs
        new = self.graph.create_node(node.op, node.target, tuple(args), dict(kwargs), name=node.name)
        new.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
        return new

    def done(self, node: fx.Node, new: Any, placement: Any) -> None:
        """Record ``node``'s new value and placement."""
        self.env[node] = new
        self.placements[node] = placement
        if is_tensor_node(node):
            self.report.placements[node.name] = str(placement)

    # ------------------------------------------------------------------ transitions
    def input(self, node: Any, want: Placement, *, partial_grad: bool = False, expected: bool = True,
              reason: str = "") -> Any:
        """``node``'s new value in placement ``want``.

        ``partial_grad``: the value is replicated and consumed by sharded work, so its gradient is this
        rank's share (wrapped in ``grad_sync``). ``expected=False`` marks a gather as a fallback.
        """
        if not is_tensor_node(node):
            return self.value(node)
        have = self.placement(node)
        new = self.env[node]
        if have == want:
            if isinstance(want, Replicate):
                return self._replicated_use(node, new, partial_grad)
            return new
        if isinstance(have, Shard) and have.stores_like(want):  # only the merge's factors differ: nothing moves
            return new
        key = (node, want, partial_grad)
        if key in self._cache:
            return self._cache[key]
        if isinstance(have, Partial):
            out = self._reduce(node, new, have)
            if isinstance(want, Shard):
                out = self.shard_value(node, out, want)
            elif partial_grad:
                out = self._replicated_use(node, out, True)
        elif isinstance(have, Replicate):
            out = self.shard_value(node, self._replicated_use(node, new, False), want)
        elif isinstance(want, Replicate):
            out = self._unshard(node, new, have, expected, reason, local_use=partial_grad)
        else:
            out = self.realign_value(node, new, have, want, expected, reason)
        self._cache[key] = out
        return out

    def changed_in_place(self, node: fx.Node) -> None:
        """``node``'s value was just changed in place: transitions of it made before (a gather, a slice) hold
        the old value, so later uses make new ones."""
        for key in [key for key in self._cache if key[0] is node]:
            del self._cache[key]

    def _replicated_use(self, node: fx.Node, new: fx.Node, partial_grad: bool) -> fx.Node:
        """``new`` for a replicated use. Its gradient must come out whole on every rank wherever it flows on
        through replicated work: a share (``partial_grad``) is summed there -- a parameter's in its gradient
        bucket, anything else (an activation, also one an earlier graph passed in) alone. Without
        ``grad_sync`` a parameter's share is not summed but multiplied by P: the ranks' gradients then
        *average* to the one-process gradient, which is what DDP and FSDP (both average) make of them."""
        if not (partial_grad and self.requires_grad(node)) or self.world == 1:
            return new
        parameter = is_parameter(node)
        key = (node, "grad_sync" if self.config.grad_sync or not parameter else "grad_scale")
        if key not in self._cache:
            if not parameter:
                self._cache[key] = _serving(self.call(grad_sync, new, self.groups.sequence), node)
            elif self.config.grad_sync:
                self._cache[key] = self._bucketed(node, new)
            else:
                self._cache[key] = self.call(grad_scale, new, float(self.world))
            self.replicated_uses[self._cache[key]] = node
        return self._cache[key]

    def _bucketed(self, node: fx.Node, new: fx.Node) -> fx.Node:
        """``new`` (a parameter) through the open gradient bucket; a bucket holds parameters in order of
        first use, up to ``GRAD_BUCKET_BYTES``, so its one all-reduce runs when the layer's backward is done."""
        nbytes = value_of(node).numel() * value_of(node).element_size()
        bucket = self._bucket
        if bucket is None or bucket[1] + nbytes > GRAD_BUCKET_BYTES or bucket[2] != value_of(node).dtype:
            with self.graph.inserting_after(self._last_placeholder):
                bucket_node = self.call(grad_sync_bucket, self.groups.sequence)
            self._last_placeholder = bucket_node
            bucket = self._bucket = [bucket_node, 0, value_of(node).dtype]
        bucket_node = bucket[0]
        index = len(bucket_node.args) - 1
        bucket_node.args = bucket_node.args + (new,)
        bucket[1] += nbytes
        self.report.grad_buckets.setdefault(bucket_node.name, []).append(node.name)
        return self.call(operator.getitem, bucket_node, index)

    def _split_factors(self, node: fx.Node, new: fx.Node, shard: Shard, local: bool) -> tuple[fx.Node, int]:
        """View a merged dim as its factors; returns (view, dim of the sequence factor)."""
        if not shard.factors:
            return new, shard.dim
        shape = list(self.shape(node))
        factors = list(shard.factors)
        if local:
            factors[shard.factor] = shard.layout.local_length(self.rank)
        view = self.call(torch.reshape, new, tuple(shape[:shard.dim] + factors + shape[shard.dim + 1:]))
        return view, shard.dim + shard.factor

    def _merge_factors(self, node: fx.Node, new: fx.Node, shard: Shard, local: bool) -> fx.Node:
        if not shard.factors:
            return new
        shape = self.local_shape(node, shard) if local else list(self.shape(node))
        return self.call(torch.reshape, new, tuple(shape))

    def shard_value(self, node: fx.Node, new: fx.Node, want: Shard) -> fx.Node:
        """This rank's part of ``new``, a new-graph node holding ``node``'s whole value."""
        x, dim = self._split_factors(node, new, want, local=False)
        x = _serving(self.call(torch.ops.autoshard.seq_shard.default, x, dim, want.layout.encode(),
                               self.groups.sequence), node, layout=want.layout)
        return self._merge_factors(node, x, want, local=True)

    def _unshard(self, node: fx.Node, new: fx.Node, have: Shard, expected: bool, reason: str,
                 local_use: bool = False) -> fx.Node:
        """Gather; ``local_use``: the whole value feeds this rank's share of the work, so the backward
        reduce-scatters the gradient shares (instead of keeping this rank's part of one gradient)."""
        x, dim = self._split_factors(node, new, have, local=True)
        op = torch.ops.autoshard.seq_unshard_for_local_use if local_use else torch.ops.autoshard.seq_unshard
        x = _serving(self.call(op.default, x, dim, have.layout.encode(), self.groups.sequence), node, reason,
                     have.layout)
        nbytes = all_gather_bytes(have.layout.max_local_length * self._row_bytes(node, have), self.world)
        self.report.transitions.append(Transition("all_gather", node.name, str(have), "R", nbytes, reason))
        if not expected:
            self.report.fallbacks.append(Fallback(node.name, "gather", reason or "needed whole"))
        return self._merge_factors(node, x, have, local=False)

    def realign_value(self, node: fx.Node, new: fx.Node, have: Shard, want: Shard, expected: bool = True,
                      reason: str = "") -> fx.Node:
        """Move ``new`` (``node``'s value, split as ``have``) to ``want``: a gather and a slice when the split
        moves to another dim, point-to-point otherwise."""
        if (want.dim, want.factors, want.factor) == (have.dim, have.factors, have.factor):
            return self._realign(node, new, have, want)
        return self.shard_value(node, self._unshard(node, new, have, expected, reason or "re-sharded on another dim"),
                                want)

    def _realign(self, node: fx.Node, new: fx.Node, have: Shard, want: Shard) -> fx.Node:
        x, dim = self._split_factors(node, new, have, local=True)
        x = _serving(self.call(torch.ops.autoshard.seq_realign.default, x, dim, have.layout.encode(),
                               want.layout.encode(), self.groups.sequence), node)
        sent = realign_bytes(have.layout.at_hint(), want.layout.at_hint(), hint_of(self._row_bytes(node, have)),
                             "forward")[self.rank]  # the report's count, at the call's lengths
        self.report.transitions.append(Transition("realign", node.name, str(have), str(want), sent, "positions moved"))
        return self._merge_factors(node, x, want, local=True)

    def _row_bytes(self, node: fx.Node, shard: Shard) -> int:
        """Bytes of one sequence position of ``node`` (from its global shape: a rank's shard may be empty)."""
        return numel(self.shape(node)) // shard.layout.length * _itemsize(node)

    def _reduce(self, node: fx.Node, new: fx.Node, have: Partial) -> fx.Node:
        out = _serving(self.call(reduce_partial, new, have.op, self.groups.sequence), node)
        nbytes = all_reduce_bytes(numel(self.shape(node)), _itemsize(node), self.world)
        self.report.transitions.append(Transition("all_reduce", node.name, str(have), "R", nbytes))
        return out

    # ------------------------------------------------------------------ generic behaviours
    def fallback(self, node: fx.Node, reason: str) -> None:
        """Run ``node`` on whole inputs; its output is replicated. Inside a token-local region the op runs
        on this rank's positions instead (the user said the code is per position)."""
        if node in self.families.token_local and any(self.out_shard(n) for n in node.all_input_nodes
                                                     if is_tensor_node(n)):
            self._token_local(node)
            return
        target = node.args[0] if node.args else None
        if mutates(node) and is_tensor_node(target) and not isinstance(self.placement(target), Replicate):
            raise RuntimeError(
                f"autoshard: {node.format_node()} changes {target.name} in place, and {target.name} is split along "
                f"the sequence ({self.placement(target)}); {reason}. Write it out of place, or wrap the code in "
                f"autoshard.token_local if it works position by position.")
        sharded = [n for n in node.all_input_nodes if not isinstance(self.placement(n), Replicate)]
        args = fx.node.map_arg(node.args, lambda n: self.input(n, REPLICATE, expected=False, reason=reason))
        kwargs = fx.node.map_arg(node.kwargs, lambda n: self.input(n, REPLICATE, expected=False, reason=reason))
        new = self.reemit(node, args, kwargs)
        if sharded:
            self.report.fallbacks.append(Fallback(node.name, str(node.target), reason))
        self.done(node, new, _replicated(node))

    def _token_local(self, node: fx.Node) -> None:
        """An op without a usable rule inside a token-local region: it runs on this rank's positions, every
        input as it is placed (split inputs stay split, whole ones stay whole and get their gradient summed)."""
        def local(n):
            want = self.out_shard(n) or self.placement(n)
            return self.input(n, want, partial_grad=isinstance(want, Replicate))

        args, kwargs = fx.node.map_arg(node.args, local), fx.node.map_arg(node.kwargs, local)
        new = self.reemit(node, args, kwargs)
        if is_tensor_node(node):
            self.done(node, new, self.out_shard(node) or REPLICATE)
        elif isinstance(value_of(node), (tuple, list)):  # topk, sort, ...: every output keeps the split
            inputs = [n for n in node.all_input_nodes if is_tensor_node(n)]
            split = next(s for s in (self.out_shard(n) for n in inputs) if s is not None)
            length = shape_of(next(n for n in inputs if self.out_shard(n) == split))[split.dim]
            for i, v in enumerate(value_of(node)):
                if not (isinstance(v, torch.Tensor) and v.dim() > split.dim and v.shape[split.dim] == length):
                    raise RuntimeError(f"autoshard: token-local {node.format_node()} output {i} does not keep the "
                                       f"sequence dim {split.dim}; only per-position functions may be token_local")
            self.done(node, new, tuple(split for _ in value_of(node)))
        else:  # a mutation (x[i] = y): done in place, as placed
            self.done(node, new, REPLICATE)

    def run(self) -> fx.GraphModule:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                new = self.graph.placeholder(node.name, type_expr=node.type)
                new.meta.update(node.meta)
                self._last_placeholder = new
                self.done(node, new, self.sharded_inputs.get(node.name, REPLICATE))
            elif node.op == "get_attr":
                self.done(node, self.graph.get_attr(node.target), REPLICATE)
            elif node.op == "output":
                self._outputs(node)
            else:
                tail = next(iter(reversed(self.graph.nodes)), None)
                self._rewrite(node)
                self._mark_emitted(node, tail)
        book = CommBook(self.world, self.root_length, self.groups.heads_axis_size)
        for region, sent in derive_comms(self.graph, book, self.rank).items():
            self.report.recomputed[region] += sent
        self.report.comms = book.comms
        live = {n.name for n in self.placements}
        self.report.square_values = sorted(self.families.square_values() & live)
        return fx.GraphModule(self.gm, self.graph)

    def _rewrite(self, node: fx.Node) -> None:
        """``node`` through its op's rule; one the sequence does not touch is re-emitted as it is, replicated (unless
        its rule rewrites every node). An error names the pass, the op, the node and the user's line."""
        op = None
        try:
            op = op_of(node)
            if mutates(node):
                self._check_write_reaches_its_aliases(node)
            rule = RULES.get(op.name) if op is not None else None
            if rule is None and UNBOUND in node.meta:
                self.fallback(node, f"unbound {node.meta[UNBOUND]}")
            elif rule is None:
                self.fallback(node, f"no rule for {node.target if node.op == 'call_function' else '.' + str(node.target)}")
            elif rule.always or self.touches_sequence(node):
                rule.rewrite(self, node, op)
            else:
                self.done(node, self.reemit(node), _replicated(node))
        except Exception as e:
            raise RuntimeError(f"autoshard pass 'rewrite' failed on {op.name if op is not None else node.target} node "
                               f"{node.format_node()}\n  user code: {user_line(node)}\n  {type(e).__name__}: {e}") from e

    def _check_write_reaches_its_aliases(self, node: fx.Node) -> None:
        """A write into a whole copy of a value (one a rule gathered: a view or ``.data`` without a rule) does not
        reach the split value it was taken from: if that value, or another view of its storage, is read after
        the write, a clear error instead of a write that is lost."""
        target = node.args[0] if node.args else None
        if not is_tensor_node(target) or not isinstance(self.placement(target), Replicate):
            return
        if self._aliases is None:
            self._aliases = {}
            for n in self.gm.graph.nodes:
                storage = storage_of(n)
                if storage is not None:
                    self._aliases.setdefault(storage, []).append(n)
            self._order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        for alias in self._aliases.get(storage_of(target), ()):
            split = alias in self.placements and not isinstance(self.placement(alias), Replicate)
            if split and any(self._order[u] > self._order[node] for u in alias.users):
                raise RuntimeError(
                    f"autoshard: {node.format_node()} writes into {target.name}, a whole copy of {alias.name}, which "
                    f"is split along the sequence ({self.placement(alias)}) and read after the write: the write would "
                    f"not reach it. Write the value out of place (x = torch.cat(...) or torch.where(...)), or wrap "
                    f"the code in autoshard.token_local if it works position by position.")

    def touches_sequence(self, node: fx.Node) -> bool:
        """Whether ``node``'s value or an input is in a sequence family, or an input is not whole (split, partial)."""
        return bool(self.families.dims_of(node)) or any(
            self.families.dims_of(n) or not _whole(self.placement(n)) for n in node.all_input_nodes)

    def _mark_emitted(self, node: fx.Node, tail: fx.Node | None) -> None:
        """Mark the nodes emitted after ``tail`` as ``node``'s (the comm book derives from them, :mod:`.comms`) and,
        when ``node`` is in a checkpointed region, with that region (:mod:`.regions` cuts it out again)."""
        region = node.meta.get(REGION)
        if region is not None:
            self.report.recomputed.setdefault(region, 0)
        new = tail.next if tail is not None else next(iter(self.graph.nodes), None)
        while new is not None and new.op != "root":
            new.meta[EMITTED_BY] = node
            if region is not None:
                new.meta[REGION] = region
            new = new.next

    def _few_positions(self, node: fx.Node, have, keys_and_values: set) -> bool:
        """Whether ``have`` splits a piece of the sequence of a constant length no longer than one rank's share (the
        last token's logits, a convolution's last positions): at most two ranks hold any of it, so it leaves whole.
        An attention's keys or values cut to their last positions (a sliding-window cache) stay split: the decode
        steps read them where they are."""
        if not (isinstance(have, Shard) and have.layout.kind == "derived") or is_symbolic(have.layout.length):
            return False
        root = self.root_length(have.layout)
        few = have.layout.length <= self.world or (not is_symbolic(root) and have.layout.length * self.world <= root)
        return few and not _cut_from(node, keys_and_values)

    def _outputs(self, node: fx.Node) -> None:
        """The graph's outputs: split ones gathered (``outputs="gathered"``), left as local shards
        (``"sharded"``), or, with ``"split"``, left local and listed in ``carried_outputs`` for the backend
        to hand back as :class:`~autoshard.runtime.split_tensor.SplitTensor` (a value whose split merges
        the sequence with another dim is gathered, and so are a few positions sliced out of the sequence
        (:meth:`_few_positions`): the last token's logits ``generate()`` asks for with ``logits_to_keep=1``, the last
        positions a linear-attention layer's convolution keeps in its cache and updates in place)."""
        attentions = [op for op in map(op_of, self.gm.graph.nodes) if op is not None and op.name == "attention"]
        keys_and_values = {op[key] for op in attentions for key in ("k", "v")}

        def out(n, index=None):
            have = self.placement(n)
            few = self._few_positions(n, have, keys_and_values)
            if isinstance(have, Shard) and (self.config.outputs == "sharded" or (
                    self.config.outputs == "split" and index is not None and not have.factors and not few)):
                if self.config.outputs == "split":
                    self.carried_outputs[index] = have
                if index is not None:
                    self.split_outputs.add(index)
                return self.env[n]
            if isinstance(have, Shard):
                self.gathered_outputs.append(n)
            return self.input(n, REPLICATE, reason="output")
        results = node.args[0]
        if isinstance(results, (tuple, list)):
            self.graph.output(type(results)(out(n, i) if isinstance(n, fx.Node) else n for i, n in enumerate(results)))
        else:
            self.graph.output(fx.node.map_arg(results, out))


def _cut_from(node: fx.Node, sources: set) -> bool:
    """Whether ``node`` is one of ``sources`` (an attention's keys or values), sliced, copied or cast (a sliding-window
    cache's tail)."""
    while node not in sources:
        op = op_of(node)
        if op is None or op.name not in ("getitem", "narrow", "identity", "to") or not isinstance(op["input"], fx.Node):
            return False
        node = op["input"]
    return True


def is_parameter(node: fx.Node) -> bool:
    """Whether ``node`` is a graph input that holds a module's parameter: dynamo's example is a Parameter while
    the backend runs; later (plans, per-length compiles) dynamo's mark of module state says it."""
    return node.op == "placeholder" and (
        isinstance(getattr(node.meta.get("grapharg"), "example", None), torch.nn.Parameter) or is_module_state(node))


def _replicated(node: fx.Node) -> Any:
    """The placement of ``node``'s value held whole: REPLICATE, or one per element of a tuple value."""
    value = value_of(node)
    return tuple(REPLICATE for _ in value) if isinstance(value, (tuple, list)) else REPLICATE


def _whole(placement: Any) -> bool:
    """Whether a placement (a tuple's: each element's) is replicated."""
    return all(isinstance(p, Replicate) for p in (placement if isinstance(placement, tuple) else (placement,)))


def _serving(new: fx.Node, node: fx.Node, reason: str = "", layout: SequenceLayout | None = None) -> fx.Node:
    """``new``, an emitted collective, marked for :mod:`.comms` as moving ``node``'s value, ``reason`` why, over
    ``layout`` (the one its layout argument encodes)."""
    new.meta[SERVES] = node
    if reason:
        new.meta[REASON] = reason
    if layout is not None:
        new.meta[LAYOUT] = layout
    return new


def _itemsize(node: fx.Node) -> int:
    return value_of(node).element_size()

