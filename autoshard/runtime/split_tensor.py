"""``SplitTensor``: a value split along the sequence that leaves one compiled graph and enters the next.

The carrier. A graph break, per-block compilation, FSDP's module hooks cut a model into several graphs;
what one graph returns split along the sequence must reach the next graph still split, with its layout
and its global length known. The options were a side table keyed by tensor identity (the value then
shows its local shape to the code between the graphs, and dynamo would trace the next graph at the local
length: wrong positions, wrong masks), DTensor (it cannot express zigzag, nor our uneven shards: torch's
chunk gives the remainder to the last ranks, ours to the first), or a tensor subclass. It is a subclass.

A ``SplitTensor`` has the *global* shape, dtype and device of the value and holds this rank's shard
(``local``), the sequence ``dim``, the :class:`~autoshard.runtime.layouts.SequenceLayout` and the group's
name. So:

* dynamo traces the next graph with the global shape, exactly as without the split (it flattens the
  subclass through ``__tensor_flatten__``, and guards on its layout; on the layout's kind alone where a length
  class returned the carrier, :attr:`SplitTensor.any_length`: the next graph then serves any length too);
* the backend sees a split input (the example value is a ``SplitTensor``): the placeholder is seeded as a
  sequence, its placement is the carrier's, and the compiled graph is called with ``local`` -- no gather,
  no re-slicing. Inner compilers (eager, aot_eager, inductor) only ever see plain local tensors;
* anywhere else -- user code between graphs, a graph compiled by another backend -- every op but a view of the
  whole value (autograd's alias of a tensor an ``autograd.Function`` returns unchanged: FSDP2's hooks) gathers the
  whole value first (``__torch_dispatch__``) and returns plain tensors: the one-process value, at the
  cost of an all-gather per use (``full_tensor()`` once keeps a whole copy). Every rank of the group must
  make that use (it is an all-gather): a rank that does so alone -- ``if rank == 0: print(logits)`` --
  waits for the others in the rendezvous store and raises a clear error after ``GATHER_TIMEOUT``, instead
  of hanging in the collective. In-place ops on a ``SplitTensor`` raise: they would change a temporary
  gathered copy;
* autograd: :func:`wrap` and :func:`local_of` are each other's adjoint. The gradient of a carrier that
  went into another graph arrives as a ``SplitTensor`` (its ``local`` is the gradient shard); one that
  user code consumed arrives whole, and this rank keeps its part.
"""

from __future__ import annotations

import datetime

import torch

from .carrier import Carrier, is_fake_or_meta
from .groups import default_store, resolve_group
from .kv_cache import CacheLayout, cache_write
from .layouts import SequenceLayout

__all__ = ["SplitTensor", "wrap", "local_of"]

GATHER_TIMEOUT = datetime.timedelta(seconds=300)
"""How long a rank that gathers a SplitTensor waits for the other ranks of its group to gather it too."""
_GATHERS: dict[str, int] = {}
"""Group name -> how many SplitTensor gathers this rank has made in it."""


_GATHER_WARNING = (
    "autoshard: a value split along the sequence (an autoshard.SplitTensor: an output such as the logits, or a "
    "value passed between compiled graphs) is used outside compiled code, so it is all-gathered whole for that "
    "use, and again for every later use. In user code, x.full_tensor() once keeps a whole copy, and "
    "outputs='gathered' returns plain whole tensors; in model code that dynamo did not compile (a graph break: "
    "TORCH_LOGS=graph_breaks says where), that code runs undistributed")


def _all_ranks_gather(group_name: str) -> None:
    """Meet the group's other ranks in the rendezvous store before a gather outside compiled code, and raise
    a clear error instead of hanging when they do not come (code that uses a SplitTensor on some ranks only,
    such as ``if rank == 0: print(logits)``)."""
    pg = resolve_group(group_name)
    store = default_store()
    count = _GATHERS[group_name] = _GATHERS.get(group_name, 0) + 1
    key = f"autoshard/split_gather/{group_name}/{count}"
    if store.add(key, 1) == pg.size():
        store.set(key + "/all", "1")
    try:
        store.wait([key + "/all"], GATHER_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 -- the store raises its own timeout type
        raise RuntimeError(
            f"autoshard: rank {pg.rank()} uses an output split along the sequence (an autoshard.SplitTensor) outside "
            f"compiled code, which all-gathers it, but not every rank of its group did so within "
            f"{GATHER_TIMEOUT.seconds} s. Use it on every rank (e.g. whole = x.full_tensor() on every rank, then "
            f"print on one), or compile with outputs='gathered'") from exc
    if count > 2:  # every rank is past the gather before the last: its keys are read
        store.delete_key(f"autoshard/split_gather/{group_name}/{count - 2}")
        store.delete_key(f"autoshard/split_gather/{group_name}/{count - 2}/all")


def _whole_view(x: SplitTensor, size) -> SplitTensor:
    """A view of the whole shape (what autograd makes of a tensor an ``autograd.Function`` returns unchanged, as
    FSDP2's pre-forward hook does to every layer input): a ``SplitTensor`` of a view of the shard, without a
    gather. Any other view gathers."""
    return x.aliased() if list(size) == list(x.shape) else NotImplemented


def _cache_write(cache: SplitTensor, dim: int, index, source) -> SplitTensor:
    """``cache.index_copy_(dim, index, source)`` on a fixed-size KV cache split along ``dim`` (a ``CacheLayout``
    carrier; ``index`` and ``source`` whole): each rank writes the positions it holds. Anything else gathers (and
    is refused: an in-place change)."""
    if not (isinstance(cache, SplitTensor) and isinstance(cache.layout_rule, CacheLayout)
            and dim % cache.dim() == cache.seq_dim and not isinstance(index, SplitTensor)
            and not isinstance(source, SplitTensor)):
        return NotImplemented
    cache_write(cache.local, index, source, cache.seq_dim, layout=cache.layout_rule,
                capacity=cache.shape[cache.seq_dim], rank=resolve_group(cache.group_name).rank())
    return cache


def _placing(rule: SequenceLayout | CacheLayout | tuple[str, int]):
    """What a compiled graph depends on of a carrier's rule (:meth:`SplitTensor.__metadata_guard__`): of a cache's, its
    world size (a decode graph reads the rule at each call); of a layout, all of it (its shards' lengths follow from
    it, and dynamo guards them on every rank alike only so: it does not guard a carrier's global size); of a
    carrier of any length, the layout's kind and world size."""
    return ("cache", rule.world_size) if isinstance(rule, CacheLayout) else rule


class SplitTensor(Carrier):
    """A value split along a sequence dim over a group's ranks (see the module docstring)."""

    local: torch.Tensor
    """This rank's shard."""
    seq_dim: int
    """The dim split along the sequence."""
    layout_rule: SequenceLayout | CacheLayout
    """Which positions every rank holds: a layout, or the rule of a KV cache that grows (``seq_layout`` gives the
    layout either way)."""
    group_name: str
    """The sequence group's name."""
    cache_start: int = 0
    """Of a cache that keeps a window: the position (under ``layout_rule``) of its first entry, the positions before
    it dropped. It changes every step, so it is not part of what dynamo guards (the flatten context): it travels
    with the carrier object, read by the decode step that takes it (:mod:`autoshard.passes.decode`)."""
    placed: dict = {}
    """The swaps of the placement its shard was computed under (:mod:`~autoshard.runtime.placement`: packed documents
    placed by their lengths): ``layout_rule`` stays the compiled layout (what dynamo guards and the next graph
    compiles for), the rows are those of ``placed[layout_rule]``; the next graph runs under the same swaps. Empty:
    the rows are the layout's. Not guarded: a new placement is no new graph."""
    any_length: bool = False
    """Whether the graph that takes it compiles for any length of its layout's kind (a length class returned it and
    marked its dim dynamic): dynamo then guards the layout's kind and world size (the flatten context), not its
    length, and the graph it traces computes the layout from the symbolic length."""

    own_ops = {torch.ops.aten.view.default: _whole_view, torch.ops.aten._unsafe_view.default: _whole_view,
               torch.ops.aten.index_copy_.default: _cache_write}
    in_place_error = ("autoshard: {op} changes a SplitTensor in place (a value compiled code returned split along the "
                      "sequence); take a whole copy first (x = x.full_tensor()), or compile with outputs='gathered'")
    keyword_carriers_written = True

    @staticmethod
    def __new__(cls, local: torch.Tensor, dim: int, layout: SequenceLayout | CacheLayout, group_name: str,
                shape=None, cache_start: int = 0, placed: dict | None = None):
        if shape is None:
            if not isinstance(layout, SequenceLayout):
                raise ValueError("autoshard: a SplitTensor of a growing cache needs its global shape")
            shape = list(local.shape)
            shape[dim] = layout.length
        out = cls._wrapper(shape, local.dtype, local.device)
        out.local, out.seq_dim, out.layout_rule, out.group_name = local, dim, layout, group_name
        if cache_start:
            out.cache_start = cache_start
        if placed:
            out.placed = placed
        return out

    @property
    def seq_layout(self) -> SequenceLayout:
        """Which positions every rank holds (of a cache, at its current length)."""
        rule = self.layout_rule
        if isinstance(rule, SequenceLayout):
            return rule
        return rule.at(self.cache_start + int(self.shape[self.seq_dim]), self.cache_start)

    @property
    def rows_layout(self) -> SequenceLayout:
        """Which positions every rank's shard holds: :attr:`seq_layout`, or its placed layout (:attr:`placed`)."""
        layout = self.seq_layout
        return self.placed.get(layout, layout)

    def __tensor_flatten__(self):
        return ["local"], (self.seq_dim, self.layout_rule.rule if self.any_length else self.layout_rule,
                           self.group_name)

    @classmethod
    def __metadata_guard__(cls, compiled, given) -> bool:
        """Whether a graph dynamo traced with a carrier of context ``compiled`` serves one of context ``given``:
        the same dim and group, and the same layout, or any cache rule of the same world size (a decode graph reads
        the rule at each call: a new prompt is no new graph)."""
        return compiled[0] == given[0] and compiled[2] == given[2] and _placing(compiled[1]) == _placing(given[1])

    @staticmethod
    def __tensor_unflatten__(inner, context, outer_size, outer_stride):
        dim, rule, group_name = context
        if isinstance(rule, tuple):  # a carrier of any length: its layout of the (symbolic) global length
            kind, world_size = rule
            out = SplitTensor(inner["local"], dim, SequenceLayout.of(kind, outer_size[dim], world_size), group_name,
                              outer_size)
            out.any_length = True
            return out
        return SplitTensor(inner["local"], dim, rule, group_name, outer_size)

    def __repr__(self) -> str:
        kind = self.layout_rule.kind if isinstance(self.layout_rule, SequenceLayout) else "cache"
        return (f"SplitTensor(shape={tuple(self.shape)}, seq_dim={self.seq_dim}, layout={kind}, "
                f"local={tuple(self.local.shape)}, requires_grad={self.requires_grad})")

    def full_tensor(self) -> torch.Tensor:
        """The whole value (all-gathered), as a plain tensor; differentiable. Asked for, so not warned about."""
        warned, SplitTensor._warned = SplitTensor._warned, True
        try:
            return self.clone()
        finally:
            SplitTensor._warned = warned

    def aliased(self) -> SplitTensor:
        out = SplitTensor(torch.ops.aten.alias.default(self.local), self.seq_dim, self.layout_rule, self.group_name,
                          self.shape, self.cache_start, self.placed)
        if self.any_length:  # FSDP2's hooks hand the next graph this view
            out.any_length = True
            out._mark_dynamic()
        return out

    def mark_any_length(self) -> None:
        """Make this carrier one the next graph may take at any length (:attr:`any_length`; a length class returns
        it): its global and local lengths dynamic on every rank, whether or not a rank's own shard length changed
        (the ranks' graphs stay alike). Not where a rank holds fewer than 2 positions (dynamo compiles a size of 0
        or 1 as a constant, so that rank's graph would differ: such a carrier keeps its length), nor a KV cache's
        (its rule serves every length already)."""
        if not isinstance(self.layout_rule, SequenceLayout) or min(self.seq_layout.local_lengths) < 2:
            return
        self.any_length = True
        self._mark_dynamic()

    def _mark_dynamic(self) -> None:
        if not is_fake_or_meta(self.local):  # a view made while dynamo traces is no graph's input
            torch._dynamo.maybe_mark_dynamic(self, self.seq_dim)
            torch._dynamo.maybe_mark_dynamic(self.local, self.seq_dim)

    def materialize(self) -> torch.Tensor:
        """The whole value, gathered over the group (no autograd: called under dispatch)."""
        if is_fake_or_meta(self.local):
            return self.local.new_empty(self.shape)
        _all_ranks_gather(self.group_name)
        self.warn_once(_GATHER_WARNING)
        return torch.ops.autoshard.seq_unshard.default(self.local, self.seq_dim, self.rows_layout.encode(),
                                                       self.group_name)


class _Wrap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, dim, layout, group_name, placed):
        ctx.dim, ctx.layout, ctx.group_name, ctx.placed = dim, layout, group_name, placed
        return SplitTensor(local.detach(), dim, layout, group_name, placed=placed)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, SplitTensor):
            return grad.local, None, None, None, None
        rows = ctx.placed.get(ctx.layout, ctx.layout)
        shard = torch.ops.autoshard.seq_shard.default(grad.contiguous(), ctx.dim, rows.encode(), ctx.group_name)
        return shard, None, None, None, None


class _Local(torch.autograd.Function):
    @staticmethod
    def forward(ctx, split):
        ctx.dim, ctx.layout, ctx.group_name, ctx.placed = split.seq_dim, split.seq_layout, split.group_name, split.placed
        return split.local.detach()  # a new tensor on the same storage, not a view: AOTAutograd would replay a view from its base

    @staticmethod
    def backward(ctx, grad):
        return SplitTensor(grad.contiguous(), ctx.dim, ctx.layout, ctx.group_name, placed=ctx.placed)


def wrap(local: torch.Tensor, dim: int, layout: SequenceLayout, group_name: str, placed: dict | None = None) -> SplitTensor:
    """The carrier of this rank's shard ``local`` (split along ``dim`` as ``layout`` over ``group_name``; its rows
    those of ``placed[layout]`` where a placement swapped it, :attr:`SplitTensor.placed`)."""
    return _Wrap.apply(local, dim, layout, group_name, placed or {})


def local_of(split: SplitTensor) -> torch.Tensor:
    """This rank's shard of ``split``; its gradient goes back as a ``SplitTensor``."""
    return _Local.apply(split)
