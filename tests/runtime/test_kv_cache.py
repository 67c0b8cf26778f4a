"""The sharded KV cache's layout: new positions round robin, every rank's share within one of the others'."""

import pytest
import torch

from autoshard.runtime.kv_cache import MIN_ROOM, CacheLayout, cache_append, room
from autoshard.runtime.layouts import SequenceLayout


@pytest.mark.parametrize("kind, prompt, world", [("contiguous", 37, 2), ("zigzag", 37, 4), ("contiguous", 5, 3)])
def test_cache_layout_grows_round_robin_and_stays_balanced(kind, prompt, world):
    cache = CacheLayout(SequenceLayout.of(kind, prompt, world))
    for length in range(prompt, prompt + 3 * world + 2):
        layout = cache.at(length)
        shares = [cache.local_length(r, length) for r in range(world)]
        assert shares == list(layout.local_lengths) and sum(shares) == length
        assert max(shares) - min(shares) <= 1, shares
        for r in range(world):
            assert torch.equal(cache.positions(r, length), layout.positions(r)), (r, length)
        if length > prompt:
            assert cache.owner(length - 1) == layout.owner(length - 1)
    assert cache.at(prompt) == cache.prompt and hash(cache) == hash(CacheLayout(cache.prompt))


def test_cache_append_keeps_the_new_positions_of_its_rank():
    cache = CacheLayout(SequenceLayout.contiguous(5, 2))  # shares 3 and 2: position 5 goes to rank 1, 6 to rank 0
    new = torch.arange(8.0).view(1, 1, 2, 4)
    kept = [cache_append(torch.zeros(1, 1, cache.local_length(r, 5), 4), new, 2, past_length=5, cache=cache, rank=r)
            for r in range(2)]
    assert [k.shape[2] for k in kept] == [cache.local_length(r, 7) for r in range(2)] == [4, 3]
    assert torch.equal(kept[1][0, 0, -1], new[0, 0, 0]) and torch.equal(kept[0][0, 0, -1], new[0, 0, 1])


def test_a_window_of_the_cache_holds_each_ranks_positions_past_its_start():
    """A sliding-window cache keeps the positions ``[start, length)``: each rank its own of them, in local order,
    and the window's layout is the grown cache's from ``start``, relabeled from 0."""
    cache = CacheLayout(SequenceLayout.zigzag(9, 2))
    length, start = 14, 6
    window = cache.at(length, start)
    assert window.length == length - start
    for r in range(2):
        held = cache.positions(r, length, start=start)
        assert torch.equal(held, cache.positions(r, length)[cache.positions(r, length) >= start])
        assert torch.equal(held - start, window.positions(r))
        assert cache.local_length(r, length, start) == len(held) == window.local_length(r)


def test_appending_writes_in_place_and_never_over_another_views_rows():
    """A shard in a storage with room grows without a copy (the same storage, strides independent of the length);
    a second append to the same past (a branch from an older cache) copies rather than overwrite the first's rows."""
    cache = CacheLayout(SequenceLayout.contiguous(3, 1))
    past = torch.arange(24.0).view(1, 2, 3, 4)
    first = cache_append(past, torch.full((1, 2, 1, 4), -1.0), 2, past_length=3, cache=cache, rank=0)
    second = cache_append(first, torch.full((1, 2, 1, 4), -2.0), 2, past_length=4, cache=cache, rank=0)
    assert second.data_ptr() == first.data_ptr() and second.stride() == first.stride()  # in place, same strides
    assert torch.equal(second[:, :, :3], past) and (second[:, :, 3] == -1).all() and (second[:, :, 4] == -2).all()
    branch = cache_append(first, torch.full((1, 2, 1, 4), -3.0), 2, past_length=4, cache=cache, rank=0)
    assert branch.data_ptr() != first.data_ptr() and (second[:, :, 4] == -2).all() and (branch[:, :, 4] == -3).all()
    held, extended = room(second, 2, MIN_ROOM + 8)  # past the storage's room: a bigger one, the rows copied
    assert held.data_ptr() != second.data_ptr() and torch.equal(held, second) and extended.shape[2] == 5 + MIN_ROOM + 8
