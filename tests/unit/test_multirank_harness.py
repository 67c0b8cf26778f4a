"""The multi-rank harness: results in rank order, tracebacks from failing ranks, timeouts, no leftovers."""

import os
import time

import pytest
import torch.distributed as dist

from autoshard.testing import RankFailure, RankTimeout, fake_world, run_on_ranks


def _rank_and_pid(tag):
    return dist.get_rank(), dist.get_world_size(), os.getpid(), tag


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()  # the others wait for rank 1 -- a realistic hang behind the failure
    return "unreachable"


def _deadlock():
    if dist.get_rank() == 0:
        time.sleep(1000)
    return dist.get_rank()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("world", [1, 2, 4])
def test_results_come_back_in_rank_order(world):
    results = run_on_ranks(_rank_and_pid, world, "x")
    assert [r[0] for r in results] == list(range(world))
    assert all(r[1] == world and r[3] == "x" for r in results)


def test_failing_rank_reports_its_traceback_and_leaves_nothing_behind():
    pids = [r[2] for r in run_on_ranks(_rank_and_pid, 2, None)]
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_fail_on_rank_one, 2, timeout=30)
    text = str(info.value)
    assert "rank(s) [1]" in text and "ValueError: rank one is unhappy" in text and "_fail_on_rank_one" in text
    assert not any(_alive(p) for p in pids)
    # the next call gets a fresh, healthy pool
    assert [r[0] for r in run_on_ranks(_rank_and_pid, 2, None)] == [0, 1]


def test_deadlock_fails_within_timeout_with_stacks():
    pids = [r[2] for r in run_on_ranks(_rank_and_pid, 2, None)]
    with pytest.raises(RankTimeout) as info:  # raised by the harness's 3 s timeout, not by a hang
        run_on_ranks(_deadlock, 2, timeout=3)
    text = str(info.value)
    assert "rank(s) [0]" in text and "_deadlock" in text  # rank 0's stack shows where it hangs
    assert not any(_alive(p) for p in pids)


def test_fake_world_plans_without_processes():
    with fake_world(64, rank=5):
        assert dist.get_world_size() == 64 and dist.get_rank() == 5
    assert not dist.is_initialized()
