"""Start a function on every rank, from a plain ``python script.py`` or from ``torchrun``.

    def main():
        ...  # torch.distributed is initialized here

    if __name__ == "__main__":
        autoshard.launch.run(main, world_size=2)

Under ``torchrun`` (``WORLD_SIZE`` in the environment) ``main`` runs once in each process torchrun
started, with the process group initialized from the environment. Otherwise ``world_size`` processes
are spawned on this machine, joined by a TCP store on a free local port (gloo on CPU, NCCL when every
rank has a GPU).
"""

from __future__ import annotations

import datetime
import os
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run"]


def _entry(rank: int, world_size: int, port: int, main: Callable, args: tuple) -> None:
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=(rank == 0), timeout=datetime.timedelta(seconds=120))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    if use_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank, world_size=world_size)
    try:
        main(*args)
        # every rank is done before any tears down: rank 0 hosts the store the others still talk to
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(main: Callable, world_size: int = 2, *args) -> None:
    """Run ``main(*args)`` on ``world_size`` ranks (or on torchrun's ranks when started by torchrun)."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if use_cuda else "gloo")
        try:
            main(*args)
        finally:
            dist.destroy_process_group()
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(world_size, port, main, args), nprocs=world_size, join=True)
