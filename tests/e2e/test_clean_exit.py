"""Jobs that ran autoshard exit cleanly: 20 fresh 2-rank jobs (gloo; 3 in the default suite, the 20 marked slow);
every process exits with code 0 and prints nothing about ``terminate``.

The failure this guards against is a race at interpreter exit: a gloo worker thread that releases a
collective's tensors needs the GIL while Python shuts down, and aborts the process (see
:mod:`autoshard.runtime.groups`); it hit between one job in twenty and one in five. So besides the exit
codes, every process checks the cause itself, deterministically: an ``atexit`` hook that runs after
autoshard's own (it is registered before autoshard is imported, and hooks run last-registered first)
fails the process (code 3) when gloo's threads are still alive, i.e. when a process group would outlive
the hooks into the interpreter's shutdown.

Every job runs all cases on both ranks: the runtime attention with every strategy (ring, zigzag,
allgather, ulysses, and hybrid on a (2, 1) mesh), without a mask and with a causal, key and
packed-document mask at once, forward and backward; then a small model compiled with the autoshard
backend, forward and backward. Rank 0 ends with ``destroy_process_group()``; rank 1 forgets it, and must
exit cleanly with autoshard's warning.

Starting an interpreter and importing torch costs more than a job does, so this file, run as a script,
is a template: it imports torch and autoshard once (as a user's script does at its top, before any
process group exists) and forks each job's ranks from it (about 2 s of CPU per rank). Each rank then
initializes its group, imports ``torch._dynamo`` at its first custom op (after the group exists, as in a
fresh process) and exits through the interpreter's whole shutdown.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LAUNCHES = 20
"""The stress run's launches (marked slow); the default suite launches ``FEW``: each process's exit hook catches the
race deterministically, so a few jobs check the exit path and twenty give the race its chances too."""
FEW = 3
WORLD = 2
FORGETS = 1  # the rank that exits without destroy_process_group()
FORGOT_WARNING = "autoshard: the process exited with torch.distributed still initialized"


@pytest.mark.timeout(900)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks its ranks and reads /proc/self/task")
@pytest.mark.parametrize("launches", [FEW, pytest.param(LAUNCHES, marks=pytest.mark.slow)])
def test_jobs_exit_cleanly(tmp_path, launches):
    result = subprocess.run([sys.executable, __file__, str(launches), str(tmp_path)], capture_output=True,
                            text=True, timeout=840)
    assert result.returncode == 0, f"the template failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    exits = json.loads(result.stdout.splitlines()[-1])
    assert len(exits) == launches * WORLD
    for job in exits:
        log = (tmp_path / job["log"]).read_text()
        where = f"job {job['launch']} rank {job['rank']}"
        assert job["status"] == "exited 0", f"{where}: {job['status']}\n{log[-3000:]}"
        assert "terminate" not in log.lower(), f"{where} printed:\n{log[-3000:]}"
        assert (FORGOT_WARNING in log) == (job["rank"] == FORGETS), f"{where}:\n{log[-3000:]}"


# ---------------------------------------------------------------------------- the template (run as a script)


def _no_group_threads_at_exit() -> None:
    """Fail the process when gloo threads outlive the exit hooks (their names: ``gloo_*``, ``pt_gloo_*``)."""
    import os

    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as fh:
                names.append(fh.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    alive = [n for n in names if "gloo" in n]
    if alive:
        sys.stderr.write(f"clean-exit check: gloo threads alive after the exit hooks: {alive}\n")
        sys.stderr.flush()
        os._exit(3)


def _attention_cases() -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.runtime import attention, shard_sequence

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 12, 8, generator=g, dtype=torch.float64) for heads in (4, 2, 2))
    key_mask = torch.rand(2, 12, generator=g) > 0.3
    key_mask[:, 0] = True
    documents = torch.cumsum(torch.rand(2, 12, generator=g) < 0.2, 1)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ring", "ulysses"))
    for strategy, layout in (("ring", "contiguous"), ("zigzag", "zigzag"), ("allgather", "contiguous"),
                             ("ulysses", "contiguous"), ("hybrid", "zigzag")):
        for masks in ({}, {"causal": True, "key_mask": key_mask, "segment_ids": documents}):
            ql, kl, vl = (shard_sequence(t, 2, layout=layout).detach().requires_grad_() for t in (q, k, v))
            shards = {name: shard_sequence(m, 1, layout=layout) if isinstance(m, torch.Tensor) else m
                      for name, m in masks.items()}
            out = attention(ql, kl, vl, group=mesh if strategy == "hybrid" else None, strategy=strategy,
                            layout=layout, **shards)
            out.sum().backward()


def _compiled_model() -> None:
    import torch
    import torch.nn.functional as F

    import autoshard

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

        def forward(self, x):
            q, k, v = self.qkv(x).view(x.size(0), x.size(1), 3, 2, 8).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(x.shape)).square().mean()

    torch.manual_seed(0)
    model = Attention().double()
    torch.compile(model, backend=autoshard.backend())(torch.randn(2, 13, 16, dtype=torch.float64)).backward()


def _rank(rank: int, port: int) -> None:
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)  # a stuck rank fails and exits, never outlives the test
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    _attention_cases()
    _compiled_model()
    if rank != FORGETS:
        dist.destroy_process_group()


def _launch(index: int, logs: str) -> list[dict]:
    """Fork the ranks of one job; each writes its output to its log and exits through the interpreter's shutdown."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = {}
    for rank in range(WORLD):
        log = f"job{index}.rank{rank}.log"
        pid = os.fork()
        if pid == 0:  # the rank: its own output, then the job, then a normal exit (SystemExit unwinds to the top)
            fd = os.open(os.path.join(logs, log), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            _rank(rank, port)
            sys.exit(0)
        pids[rank] = pid, log
    exits = []
    for rank, (pid, log) in pids.items():
        status = os.waitpid(pid, 0)[1]
        code = os.waitstatus_to_exitcode(status)
        exits.append(dict(launch=index, rank=rank, log=log,
                          status=f"exited {code}" if code >= 0 else f"killed by signal {-code}"))
    return exits


if __name__ == "__main__":
    import atexit
    import gc

    atexit.register(_no_group_threads_at_exit)  # before autoshard's hook, so it runs after it
    import torch  # noqa: F401  (what each rank would import first)

    import autoshard  # noqa: F401

    gc.freeze()  # as a pre-fork server does: the ranks' collections skip the template's objects (a third less CPU)
    launches, logs = int(sys.argv[1]), sys.argv[2]
    print(json.dumps([record for index in range(launches) for record in _launch(index, logs)]), flush=True)
