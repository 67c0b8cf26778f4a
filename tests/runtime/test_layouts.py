"""Sequence layouts: coverage, balance, derived layouts, and shard/unshard on real ranks."""

import pytest
import torch

from autoshard.runtime import SequenceLayout, comm_counter, sequence_positions, shard_sequence, unshard_sequence
from autoshard.testing import run_on_ranks


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("length,world", [(8, 2), (9, 2), (17, 4), (64, 4), (10, 3), (7, 1)])
def test_layout_tiles_sequence_and_is_balanced(kind, length, world):
    lay = SequenceLayout.of(kind, length, world)
    positions = torch.cat([lay.positions(r) for r in range(world)])
    assert sorted(positions.tolist()) == list(range(length))
    assert max(lay.local_lengths) - min(lay.local_lengths) <= (1 if kind == "contiguous" else 2)
    for r in range(world):
        assert lay.positions(r).tolist() == sorted(lay.positions(r).tolist())
        for p in lay.positions(r).tolist():
            assert lay.owner(p) == r
    assert SequenceLayout.decode(lay.encode()) == lay


def test_zigzag_chunks():
    lay = SequenceLayout.zigzag(16, 4)  # 8 chunks of 2
    assert lay.local_intervals(0) == ((0, 2), (14, 16))
    assert lay.local_intervals(3) == ((6, 10),)  # chunks 3 and 4 are adjacent


def test_contiguous_layout_of_a_sequence_shorter_than_the_world_leaves_the_last_ranks_empty():
    layout = SequenceLayout.contiguous(3, 4)
    assert layout.local_lengths == (1, 1, 1, 0) and layout.intervals[3] == ()
    assert layout.positions(3).numel() == 0 and layout.owner(2) == 2
    shifted = layout.derive(-1, 4)  # one position before the root: it goes to the holder of root position 0
    assert shifted.local_lengths == (2, 1, 1, 0)


def test_layout_the_world_cannot_serve():
    with pytest.raises(ValueError, match="only 5 positions"):
        SequenceLayout.zigzag(5, 4)
    with pytest.raises(ValueError, match="unknown layout"):
        SequenceLayout.of("striped", 8, 2)


@pytest.mark.parametrize("offset,length", [(1, 16), (-1, 18), (0, 10), (3, 4)])
def test_derived_layout_follows_root_owner(offset, length):
    root = SequenceLayout.zigzag(17, 2)
    lay = root.derive(offset, length)
    for i in range(length):
        anchor = min(max(i + offset, 0), root.length - 1)
        assert lay.owner(i) == root.owner(anchor)


def _round_trip(kind: str, length: int, dim: int):
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, length, 5, generator=g, dtype=torch.float64).movedim(1, dim).contiguous()
    weight = torch.randn(full.shape, generator=g, dtype=torch.float64)
    x = full.clone().requires_grad_()
    with comm_counter() as cc:
        local = shard_sequence(x, dim, layout=kind)
        sent_by_shard = cc.bytes_sent
        local_pos = sequence_positions(length, layout=kind)
        back = unshard_sequence(local * 2, dim, layout=kind, length=length)
        (back * weight).sum().backward()
    return local.detach(), local_pos, back.detach(), x.grad, sent_by_shard, cc.calls["all_gather"].bytes_sent


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("length", [24, 25, 27])
def test_shard_unshard_round_trip(world, kind, length):
    dim = 1
    results = run_on_ranks(_round_trip, world, kind, length, dim)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, length, 5, generator=g, dtype=torch.float64)
    weight = torch.randn(full.shape, generator=g, dtype=torch.float64)
    lay = SequenceLayout.of(kind, length, world)
    for rank, (local, pos, back, grad, shard_bytes, gather_bytes) in enumerate(results):
        assert pos.tolist() == lay.positions(rank).tolist()
        torch.testing.assert_close(local, full[:, pos], rtol=0, atol=0)
        torch.testing.assert_close(back, full * 2, rtol=0, atol=0)       # exact original length
        torch.testing.assert_close(grad, weight * 2, rtol=0, atol=0)     # logical-tensor gradient
        assert shard_bytes == 0                                           # sharding moves nothing
        # forward unshard + backward of shard (a gather of the gradient), each a padded all-gather
        assert gather_bytes == 2 * (world - 1) * 3 * lay.max_local_length * 5 * 8


def _unshard_without_length(length: int):
    x = torch.arange(length, dtype=torch.float32)
    return unshard_sequence(shard_sequence(x, 0, layout="zigzag"), 0, layout="zigzag")


def test_unshard_finds_the_length():
    for out in run_on_ranks(_unshard_without_length, 3, 20):
        assert out.tolist() == list(range(20))
