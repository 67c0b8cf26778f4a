"""A KV cache split along the sequence for decoding: where new tokens go, and attention of new queries over it.

Prefill is training's forward: the prompt's keys and values leave the compiled graph split as its layout cut
them (``SplitTensor``), and the model's cache object (transformers' ``DynamicCache``) stores those carriers.
Every decode step then concatenates the step's new keys and values to them along the sequence and attends the
step's queries over the whole cache. Here each rank keeps its share and nothing else:

* **where new tokens go** (:class:`CacheLayout`): the positions past the prompt go round robin, one token at a
  time (vLLM's decode context parallel and Helix do the same), starting with the ranks whose prompt share is
  smaller. The prompt's shares differ by at most one, so every rank's share stays within one token of the
  others' at every step, and the rule needs no state: a rank knows which new positions are its own from the
  global length alone. Blocks of tokens per rank would keep runs contiguous, which nothing here needs
  (decode attention masks by the keys' positions, never by offsets), at the price of shares that differ by a block;
* **appending** (``autoshard::cache_append``): a rank appends the new positions it owns and drops the others,
  so its cache grows by about ``1 / P`` token per step, in place: its shard lives in a storage with room to grow
  (:func:`room`), so a step copies no cache (transformers' ``DynamicCache`` concatenates, which copies the whole
  cache every step, and a compiled step would hold the old and the new cache at once). A sliding-window cache
  keeps the positions ``[start, length)`` and each rank drops its own positions before ``start``
  (:meth:`CacheLayout.positions` with ``start``). The prompt's window is as the prefill's layout placed it (the
  last ranks of a contiguous layout hold more of it); the new positions go to the smaller shares first, so the
  shares even out as it slides;
* **writing** (``autoshard::cache_write``): a fixed-size cache (transformers' ``StaticCache``) holds the layout of
  its capacity from the start (the rank's prompt positions first, then the later positions it will own); a write at
  global positions lands in the slots of the rank holding them (:meth:`CacheLayout.slots`);
* **attention** (``autoshard::decode_attention``): the replicated queries attend over the rank's keys, with
  the log-sum-exp; one all-gather of ``(out, lse)``, ``B x H x Sq x (Dv + 1)`` fp32 values per rank whatever the
  context length (counted as ``"decode_merge"``), and the LSE merge (Tree Attention's reduction) gives every rank the one-process output.
  A dense mask (padding, windows built by the model over the global key positions) is read at the rank's key
  positions only.

:class:`CacheLayout` is what a cache ``SplitTensor`` carries between steps instead of a fixed
:class:`~autoshard.runtime.layouts.SequenceLayout`: it does not change as the cache grows, so dynamo's guard on
the carrier holds from one decode step to the next and one compiled graph serves them all.

The ops are inference ops: they have fake implementations (so dynamo and AOTAutograd trace them) and no
backward; a decode graph that needs gradients is not rewritten (see :mod:`autoshard.passes.decode`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .collectives import _pg, all_gather_impl
from .layouts import SequenceLayout
from .op_info import declare

__all__ = ["CacheLayout", "appended", "cache_append", "cache_write", "decode_attention", "first_owned", "room"]


@dataclass(frozen=True)
class CacheLayout:
    """The positions every rank holds of a cache that grows past a prompt laid out as ``prompt``."""

    prompt: SequenceLayout
    """How the prefill split the prompt's positions ``[0, prompt.length)``."""

    @property
    def world_size(self) -> int:
        return self.prompt.world_size

    @property
    def order(self) -> tuple[int, ...]:
        """The ranks in the order they take the positions past the prompt: smaller prompt shares first."""
        return _order(self.prompt)

    def slot(self, rank: int) -> int:
        """``rank``'s place in :attr:`order`: it holds the positions ``p`` past the prompt with
        ``(p - prompt.length) % P == slot``."""
        return self.order.index(rank)

    def owner(self, position: int) -> int:
        """The rank that holds ``position``."""
        if position < self.prompt.length:
            return self.prompt.owner(position)
        return self.order[(position - self.prompt.length) % self.world_size]

    def at(self, length: int, start: int = 0) -> SequenceLayout:
        """The layout of the cache once it holds the positions ``[start, length)`` (``start > 0``: a window that
        dropped the positions before it), relabeled from 0."""
        layout = _layout_at(self, int(length))
        return layout.derive(start, length - start) if start else layout

    def local_length(self, rank: int, length: int, start: int = 0) -> int:
        """How many of the positions ``[start, length)`` ``rank`` holds (``length >= prompt.length``)."""
        if start:
            return int((self.positions(rank, length) >= start).sum())
        return self.prompt.local_length(rank) + appended(self, rank, self.prompt.length, length - self.prompt.length)

    def positions(self, rank: int, length: int, device=None, start: int = 0) -> torch.Tensor:
        """The positions of ``[start, length)`` (``length >= prompt.length``) ``rank`` holds, in its local order
        (int64): the prompt's as the prefill split it, then the appended ones in order."""
        first = self.prompt.length + self.slot(rank)
        appended = torch.arange(first, max(first, length), self.world_size, device=device)
        held = torch.cat([self.prompt.positions(rank, device), appended])
        return held[held >= start] if start else held

    def slots(self, rank: int, capacity: int, device=None) -> torch.Tensor:
        """For a fixed-size cache of ``capacity`` positions: ``[capacity]`` int64, the local index of each
        position ``rank`` holds, -1 for the others (where a write at a global position lands)."""
        held = self.positions(rank, capacity, device=device)
        table = torch.full((capacity,), -1, dtype=torch.long, device=device)
        table[held] = torch.arange(len(held), device=device)
        return table


@functools.lru_cache(maxsize=64)
def _order(prompt: SequenceLayout) -> tuple[int, ...]:
    return tuple(sorted(range(prompt.world_size), key=lambda r: (prompt.local_length(r), r)))


@functools.lru_cache(maxsize=64)
def _layout_at(cache: CacheLayout, length: int) -> SequenceLayout:
    world, prompt = cache.world_size, cache.prompt
    if length <= prompt.length:
        return prompt if length == prompt.length else prompt.derive(0, length)
    intervals = [list(prompt.intervals[r]) for r in range(world)]
    for p in range(prompt.length, length):
        intervals[cache.owner(p)].append((p, p + 1))
    return SequenceLayout.from_intervals(length, intervals)


# ---------------------------------------------------------------------------- cache_append


def first_owned(cache: CacheLayout, rank: int, past_length: int) -> int:
    """Of the positions added after a cache of ``past_length`` positions: the index of the first one ``rank`` holds
    (it holds every ``P``-th from there)."""
    if past_length < cache.prompt.length:
        raise ValueError(f"autoshard: a cache of {past_length} positions is shorter than its prompt "
                         f"({cache.prompt.length})")
    return (cache.slot(rank) - (past_length - cache.prompt.length)) % cache.world_size


GROWTH = 16
"""A cache shard that runs out of room grows by a sixteenth of its length (at least the positions asked for, at
least ``MIN_ROOM``): a copy every ``16 P`` tokens of a long context rather than every step, for 6% more memory."""
MIN_ROOM = 64
"""Positions of room at least, so a short cache does not grow at every step."""


def room(local: torch.Tensor, dim: int, new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(held, extended)``: ``local`` (a cache shard ``[.., L, ..]`` along ``dim``) in a storage with room for
    ``new`` more positions after it, and the view of it with those ``L + new`` positions. The storage is
    sequence-major (``[capacity, ..]``, ``local`` a view of its first ``L`` rows moved to ``dim``), so appending
    writes the new rows in place and the view's strides do not depend on ``L`` or the capacity (dynamo's guards on
    the shard hold as it grows). ``held`` is ``local`` itself when its storage has the room and nothing was
    appended to it past ``L`` (another view of the storage that grew first keeps its rows); otherwise a copy in a
    new storage with room to grow."""
    length = local.size(dim)
    base = local._base
    if (base is not None and getattr(base, "_autoshard_used", None) == length and base.size(0) >= length + new
            and local.data_ptr() == base.data_ptr() and local.stride() == base.movedim(0, dim).stride()):
        held = local
    else:
        capacity = length + new + max(new, MIN_ROOM, length // GROWTH)
        base = local.new_empty((capacity, *(size for d, size in enumerate(local.shape) if d != dim)))
        base.narrow(0, 0, length).copy_(local.movedim(dim, 0))
        held = base.narrow(0, 0, length).movedim(0, dim)
    base._autoshard_used = length + new
    return held, base.narrow(0, 0, length + new).movedim(0, dim)


@torch.library.custom_op("autoshard::cache_append", mutates_args=("extended",))
def _cache_append_op(extended: torch.Tensor, new: torch.Tensor, dim: int, first: int, world: int) -> None:
    keep = range(first, new.size(dim), world)
    if len(keep):
        mine = new.index_select(dim, torch.tensor(list(keep), dtype=torch.long, device=new.device))
        extended.narrow(dim, extended.size(dim) - len(keep), len(keep)).copy_(mine)


@_cache_append_op.register_fake
def _(extended, new, dim, first, world):
    return None


declare(torch.ops.autoshard.cache_append.default)


def appended(cache: CacheLayout, rank: int, past_length: int, new: int) -> int:
    """How many of ``new`` positions added to a cache of ``past_length`` positions ``rank`` keeps."""
    return len(range(first_owned(cache, rank, past_length), new, cache.world_size))


def cache_append(past: torch.Tensor, new: torch.Tensor, dim: int, *, past_length: int, cache: CacheLayout,
                 rank: int) -> torch.Tensor:
    """This rank's shard of ``cat([past, new], dim)``: ``past`` is its shard of a cache of ``past_length``
    positions laid out as ``cache``; of ``new`` (replicated) it keeps the positions ``cache`` gives it, written
    after ``past`` in its storage (:func:`room`: no copy of ``past`` while the storage has room)."""
    _, extended = room(past, dim, appended(cache, rank, past_length, new.size(dim)))
    torch.ops.autoshard.cache_append.default(extended, new, dim, first_owned(cache, rank, past_length),
                                             cache.world_size)
    return extended


@torch.library.custom_op("autoshard::cache_write", mutates_args=("cache",))
def _cache_write_op(cache: torch.Tensor, positions: torch.Tensor, new: torch.Tensor, dim: int,
                    slots: torch.Tensor) -> None:
    local = slots[positions]  # -1: another rank holds that position
    mine = torch.nonzero(local >= 0).flatten()
    if mine.numel():
        cache.index_copy_(dim, local[mine], new.index_select(dim, mine).to(cache.dtype))


@_cache_write_op.register_fake
def _(cache, positions, new, dim, slots):
    return None


declare(torch.ops.autoshard.cache_write.default)


def cache_write(cache: torch.Tensor, positions: torch.Tensor, new: torch.Tensor, dim: int, *, layout: CacheLayout,
                capacity: int, rank: int) -> None:
    """This rank's part of ``whole.index_copy_(dim, positions, new)`` on a fixed-size cache of ``capacity``
    positions laid out as ``layout`` (``cache``: the rank's shard, written in place; ``new`` replicated): the
    entries at the positions it holds."""
    torch.ops.autoshard.cache_write.default(cache, positions, new, dim, layout.slots(rank, capacity, cache.device))


# ---------------------------------------------------------------------------- decode_attention


def _local_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out fp32 [B, H, Sq, Dv], lse fp32 [B, H, Sq]) of q over this rank's keys: the query heads of one KV head
    are stacked as rows (GQA without repeating the keys); a rank without keys gives out 0 and lse -inf."""
    batch, heads, sq, _ = q.shape
    kv_heads, dv = k.shape[1], v.shape[-1]
    group = heads // kv_heads
    qf = q.float().reshape(batch, kv_heads, group * sq, q.shape[-1])
    s = torch.matmul(qf, k.float().transpose(-1, -2)) * scale  # [B, Hkv, G*Sq, Sk]
    if mask is not None:
        m = mask.expand(batch, heads, sq, k.shape[2]).reshape(batch, kv_heads, group * sq, k.shape[2])
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
    lse = torch.logsumexp(s, dim=-1)  # -inf where nothing is visible (or no keys at all)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = torch.matmul(p, v.float())
    return out.reshape(batch, heads, sq, dv), lse.reshape(batch, heads, sq)


@torch.library.custom_op("autoshard::decode_attention", mutates_args=())
def _decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                         scale: float, group: str) -> torch.Tensor:
    pg = _pg(group)
    out, lse = _local_scores(q, k, v, mask, scale)
    mine = torch.cat([out, lse[..., None]], dim=-1)[None]
    everyone = all_gather_impl(mine, 0, [1] * pg.size(), pg, kind="decode_merge")  # [P, B, H, Sq, Dv + 1]
    outs, lses = everyone[..., :-1], everyone[..., -1]
    top = lses.amax(dim=0)
    weights = torch.exp(lses - torch.where(torch.isfinite(top), top, 0.0))  # [P, B, H, Sq]; 0 for -inf
    total = weights.sum(dim=0)
    merged = (weights[..., None] * outs).sum(dim=0) / torch.where(total > 0, total, 1.0)[..., None]
    return merged.to(q.dtype)


@_decode_attention_op.register_fake
def _(q, k, v, mask, scale, group):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


declare(torch.ops.autoshard.decode_attention.default)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Optional[torch.Tensor] = None,
                     scale: Optional[float] = None, group: str) -> torch.Tensor:
    """Attention of replicated queries ``q [B, H, Sq, D]`` over the keys and values every rank of ``group``
    holds (``k [B, Hkv, Sk_rank, D]``, ``v [.., Dv]``), merged: the one-process result on every rank.
    ``mask``: bool (True = visible) or additive, broadcastable to ``[B, H, Sq, Sk_rank]``, over this rank's keys."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.autoshard.decode_attention.default(q, k, v, mask, float(scale), group)
