"""Run a function on N ranks (separate processes, gloo on 127.0.0.1) and collect every rank's result.

    from autoshard.testing import run_on_ranks

    def check(scale):                         # module level, so workers can import it
        x = torch.full((2,), float(dist.get_rank()))
        return autoshard.runtime.all_reduce(x).mul(scale)

    results = run_on_ranks(check, 4, 2.0)     # [rank 0's result, ..., rank 3's result]

Design:

* **Persistent workers.** Starting a process and importing torch costs seconds, so each world size
  gets a pool of worker processes that is started once and reused by many calls. The pool's
  rendezvous store lives in the calling process on a port the OS picks (port 0), so pools never clash,
  also under pytest-xdist.
* **Failures carry the rank's traceback.** When a rank raises, the call raises :class:`RankFailure`
  with that rank's traceback (and those of other ranks that failed within a short grace period).
* **Hangs fail, within a timeout.** When ranks have not answered by the deadline, their Python
  stacks are dumped (faulthandler, ``SIGUSR1``) into the error, and the pool is killed.
* **Nothing leaks.** After any failure or timeout the pool's processes -- and only those -- are
  killed; the next call starts a fresh pool. Pools are closed when the calling process exits.

Each call runs with a fresh dynamo cache, one intra-op thread per rank (configurable) and the
default process group initialized (``torch.distributed.get_rank()`` works inside ``fn``).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["run_on_ranks", "RankFailure", "RankTimeout", "shutdown_pools"]

DEFAULT_TIMEOUT = 60.0


class RankFailure(RuntimeError):
    """A rank raised; the message holds its traceback."""


class RankTimeout(RuntimeError):
    """Some ranks did not finish in time; the message holds their stacks."""


@dataclass
class _Task:
    fn: Callable
    args: tuple
    kwargs: dict
    threads: int


def _worker(rank: int, world_size: int, port: int, conn, stack_file: str, env: dict) -> None:
    os.environ.update(env)
    with open(stack_file, "w") as fh:
        faulthandler.register(signal.SIGUSR1, file=fh, all_threads=True)
        import torch
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=600))
        conn.send_bytes(pickle.dumps(("ready", None)))
        while True:
            try:
                task: _Task | None = pickle.loads(conn.recv_bytes())
            except EOFError:
                return
            if task is None:
                dist.destroy_process_group()
                return
            torch.set_num_threads(task.threads)
            torch._dynamo.reset()
            try:
                result = task.fn(*task.args, **task.kwargs)
                payload = pickle.dumps(("ok", result))
            except BaseException:  # noqa: BLE001 -- report everything, including SystemExit
                payload = pickle.dumps(("error", traceback.format_exc()))
            conn.send_bytes(payload)


class _Pool:
    def __init__(self, key: tuple, world_size: int, env: dict):
        import torch.distributed as dist

        self.key = key
        self.world_size = world_size
        self.store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        ctx = mp.get_context("spawn")
        self.tmpdir = tempfile.mkdtemp(prefix="autoshard-ranks-")
        self.stack_files = [os.path.join(self.tmpdir, f"rank{r}.stacks") for r in range(world_size)]
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world_size, self.store.port, child,
                                                     self.stack_files[rank], env), daemon=True)
            with _environment(env):  # in the child's environment from its start (malloc reads it then)
                proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self._collect(DEFAULT_TIMEOUT, "start-up")

    def run(self, task: _Task, timeout: float) -> list[Any]:
        blob = pickle.dumps(task)
        for conn in self.conns:
            conn.send_bytes(blob)
        return self._collect(timeout, getattr(task.fn, "__qualname__", repr(task.fn)))

    def _collect(self, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        first_error_at = None
        while len(results) + len(errors) < self.world_size:
            now = time.monotonic()
            if first_error_at is not None and now - first_error_at > 3.0:
                break  # other ranks are probably stuck waiting for the failed one
            if now > deadline:
                break
            for rank, conn in enumerate(self.conns):
                if rank in results or rank in errors:
                    continue
                if not self.procs[rank].is_alive() and not conn.poll():
                    errors[rank] = f"process exited with code {self.procs[rank].exitcode}"
                    first_error_at = first_error_at or time.monotonic()
                    continue
                if conn.poll(0.01):
                    try:
                        status, value = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        errors[rank] = f"process exited with code {self.procs[rank].exitcode}"
                        first_error_at = first_error_at or time.monotonic()
                        continue
                    if status == "error":
                        errors[rank] = value
                        first_error_at = first_error_at or time.monotonic()
                    else:
                        results[rank] = value
        if errors:
            self.kill()
            detail = "\n".join(f"----- rank {r} -----\n{tb}" for r, tb in sorted(errors.items()))
            raise RankFailure(f"{what}: rank(s) {sorted(errors)} of {self.world_size} failed\n{detail}")
        if len(results) < self.world_size:
            stuck = [r for r in range(self.world_size) if r not in results]
            stacks = self._dump_stacks(stuck)
            self.kill()
            raise RankTimeout(f"{what}: rank(s) {stuck} of {self.world_size} did not finish within "
                              f"{timeout:.0f} s\n{stacks}")
        return [results[r] for r in range(self.world_size)]

    def _dump_stacks(self, ranks: list[int]) -> str:
        for r in ranks:
            if self.procs[r].is_alive():
                try:
                    os.kill(self.procs[r].pid, signal.SIGUSR1)
                except OSError:
                    pass
        time.sleep(0.5)
        out = []
        for r in ranks:
            try:
                with open(self.stack_files[r]) as fh:
                    out.append(f"----- rank {r} stacks -----\n{fh.read()}")
            except OSError:
                pass
        return "\n".join(out)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except (OSError, BrokenPipeError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        if _pools.get(self.key) is self:
            del _pools[self.key]


@contextlib.contextmanager
def _environment(env: dict):
    """``os.environ`` updated with ``env`` inside the block (spawned children inherit it)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_pools: dict[tuple, _Pool] = {}


def run_on_ranks(fn: Callable, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, threads: int = 1,
                 env: dict[str, str] | None = None, **kwargs) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks at once and return their results in rank order.

    ``fn`` must be importable (a module-level function). ``timeout``: seconds for the whole call;
    ``threads``: intra-op threads per rank; ``env``: extra environment variables for the workers (a
    pool per distinct ``env``; a variable this process already has with the given value changes nothing).
    Raises :class:`RankFailure` (with the rank's traceback) when a rank raises and :class:`RankTimeout` (with
    the stuck ranks' stacks) when ranks hang.
    """
    if not 1 <= world_size <= 8:
        raise ValueError(f"run_on_ranks: world_size must be in 1..8, got {world_size}")
    env = {name: value for name, value in (env or {}).items() if os.environ.get(name) != value}  # workers inherit
    key = (world_size, tuple(sorted(env.items())))
    pool = _pools.get(key)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _Pool(key, world_size, env)
        _pools[key] = pool
    return pool.run(_Task(fn, args, kwargs, threads), timeout)


def shutdown_pools() -> None:
    """Stop every worker pool this process started."""
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()


atexit.register(shutdown_pools)
