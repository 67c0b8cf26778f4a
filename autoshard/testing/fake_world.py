"""A one-process fake world: a process group of any size whose collectives do nothing.

For code that must *plan* for P ranks -- build layouts, trace the compiler's passes, read shapes --
without starting processes. Collectives complete at once and leave their outputs unwritten, so values
computed inside are meaningless; shapes, ranks and world sizes are right.

    with fake_world(64, rank=3):
        plan = ...   # dist.get_world_size() == 64, dist.get_rank() == 3
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

__all__ = ["fake_world"]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Initialize the default group as a fake group of ``world_size`` ranks (this process is ``rank``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world: a default process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
