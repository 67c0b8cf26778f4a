"""Calibration: a hardware profile (:class:`~autoshard.hardware.HardwareProfile`) measured on this machine.

    profile = autoshard.calibrate()                 # what python -m autoshard calibrate --out cpu.json writes
    autoshard.plan(model, args, world_size=8, hardware=profile).step_seconds

:func:`calibrate` measures the machine it runs on: its GPU, or the CPU with the threads each rank gets
(``torch.get_num_threads()``, recorded as :attr:`~autoshard.hardware.HardwareProfile.threads`: a plan for ranks
with other threads scales the rates, :meth:`~autoshard.hardware.HardwareProfile.with_threads`), through the kernels
a step runs (``torch.mm``, autoshard's local attention forward + backward, an elementwise add), and the collectives
of the process group when launched on several ranks (``torchrun --nproc-per-node N -m autoshard calibrate``). A CPU
profile's :attr:`~autoshard.hardware.HardwareProfile.concurrent_ranks` is its cores over the threads per rank: ranks
beyond it share cores, and the prediction slows them accordingly (by the
:attr:`~autoshard.hardware.HardwareProfile.sharing_efficiency` measured when more ranks than cores were launched).
Attention is timed at head dims 32 and 128 to fit its per-pair cost beyond the FLOPs
(:attr:`~autoshard.hardware.HardwareProfile.attention_pair_flops`). :func:`autoshard.hardware.save_profile` writes
a profile to a file that ``hardware=`` then reads.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from .hardware import HardwareProfile
from .runtime.attention.local import local_attention, local_attention_backward

__all__ = ["calibrate"]


def _seconds(fn, device: torch.device, repeat: int = 5) -> float:
    """The median wall time of ``fn()`` after a warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_rate(device: torch.device, dtype: torch.dtype, tokens: int) -> float:
    """FLOP/s of the products a transformer layer makes: ``[tokens, hidden] @ [hidden, out]`` and its backward's."""
    rates = []
    for k, n in ((1024, 1024), (1024, 4096), (4096, 1024), (256, 8192)):
        a = torch.randn(tokens, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        rates.append(2 * tokens * k * n / _seconds(lambda: a @ b, device))
    return statistics.median(rates)


def _attention_seconds(device: torch.device, dtype: torch.dtype, seq: int, dim: int) -> float:
    """Seconds of autoshard's local attention, forward + backward, causal, per visible (query, key) pair and head
    (``[1, 8, seq, dim]``, kv heads 2)."""
    heads, kv_heads = 8, 2
    q = torch.randn(1, heads, seq, dim, device=device, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, seq, dim, device=device, dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)

    def step():
        out, lse = local_attention(q, k, v, causal=True)
        local_attention_backward(dout, q, k, v, out.to(dtype), lse, causal=True)

    return _seconds(step, device, repeat=3) / (heads * seq * (seq + 1) / 2)


def _attention_rates(device: torch.device, seq: int) -> dict:
    """The attention fields of a profile: ``seconds per pair = (14 D + pair FLOPs) / rate`` fitted at head dims 32 and
    128 in the dtype the device trains in (bfloat16 on a GPU, float32 on a CPU), the other dtype's rate at 128."""
    main, other = (torch.bfloat16, torch.float32) if device.type == "cuda" else (torch.float32, torch.bfloat16)
    small, large = (_attention_seconds(device, main, seq, dim) for dim in (32, 128))
    rate = 14 * (128 - 32) / max(large - small, 1e-15)
    pair = max(0.0, rate * small - 14 * 32)
    other_rate = (14 * 128 + pair) / _attention_seconds(device, other, seq, 128)
    fp32, low = (rate, other_rate) if main is torch.float32 else (other_rate, rate)
    return dict(attention_flops=low, attention_flops_fp32=fp32, attention_pair_flops=pair)


def _memory_bandwidth(device: torch.device) -> float:
    """Bytes per second an elementwise op moves (an add: two reads and a write) on values a layer makes."""
    x, y = (torch.randn(4 * 2**20, device=device) for _ in range(2))
    return 3 * x.numel() * 4 / _seconds(lambda: x + y, device, repeat=10)


def _op_overhead(device: torch.device) -> float:
    """Seconds an op costs beyond its work (an add of one element)."""
    x = torch.ones(1, device=device)
    return _seconds(lambda: [x + x for _ in range(200)], device) / 200


def _collective_rates(device: torch.device) -> tuple[float, float]:
    """(latency per message, bandwidth) of the process group's all-gathers and all-to-alls, fitted to
    ``(P - 1) latency + sent / bandwidth`` at a small and a large message."""
    world = dist.get_world_size()
    times = {}
    for numel in (2**10, 2**22):
        per_rank = numel // world
        x = torch.randn(per_rank * world, device=device)
        gathered = torch.empty(per_rank * world, device=device)
        exchanged = torch.empty_like(x)

        def both():
            dist.all_gather_into_tensor(gathered, x[:per_rank])
            dist.all_to_all_single(exchanged, x)

        dist.barrier()
        seconds = torch.tensor(_seconds(both, device), device=device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        sent = 2 * per_rank * (world - 1) * 4  # what a rank sends in the two
        times[sent] = seconds.item() / 2
    (small, t_small), (large, t_large) = sorted(times.items())
    bandwidth = (large - small) / 2 / max(t_large - t_small, 1e-9)
    latency = max(0.0, t_small - small / 2 / bandwidth) / (world - 1)
    return latency, bandwidth


def calibrate(*, tokens: int = 4096) -> HardwareProfile:
    """Measure the machine this process runs on (see the module docstring): its CUDA device, or the CPU with this
    process's threads; with an initialized process group of several ranks (every rank must call this), rank 0
    measures the compute alone while the others wait (CPU ranks share cores: measured together, each would see a
    share of them) and every rank gets its figures, then all of them measure the collectives. Takes well under two
    minutes."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    measured = [_compute(device, tokens) if not distributed or dist.get_rank() == 0 else None]
    if distributed:
        dist.broadcast_object_list(measured, src=0)
    profile = measured[0]
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if distributed else 1))
    threads = 0 if cuda else torch.get_num_threads()
    if cuda:
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory
        concurrent = 0
        ranks_per_node = local_ranks
    else:
        name = f"cpu x{threads} thread(s)"
        memory = host // max(1, local_ranks)
        concurrent = max(1, len(os.sched_getaffinity(0)) // threads)
        ranks_per_node = max(local_ranks, concurrent)
    base = HardwareProfile()
    latency, bandwidth, sharing = base.intra_node_latency, base.intra_node_bandwidth, 1.0
    if distributed:
        latency, bandwidth = _collective_rates(device)
        world = dist.get_world_size()
        if concurrent and world > concurrent:  # more ranks than cores: how well they share them
            dist.barrier()
            together = torch.tensor(_matmul_rate(device, torch.float32, tokens // 4))
            dist.all_reduce(together, op=dist.ReduceOp.MIN)
            alone = [_matmul_rate(device, torch.float32, tokens // 4) if dist.get_rank() == 0 else None]
            dist.barrier()
            dist.broadcast_object_list(alone, src=0)
            sharing = min(1.0, world / concurrent * together.item() / alone[0])
        name += f", {dist.get_backend()} over {dist.get_world_size()} rank(s)"
    return HardwareProfile(name=name, ranks_per_node=ranks_per_node, intra_node_bandwidth=bandwidth,
                    inter_node_bandwidth=bandwidth, intra_node_latency=latency, inter_node_latency=latency,
                    step_overhead=profile["op_overhead"] * 10, memory_bytes=memory,
                    host_memory_bytes=host // max(1, local_ranks), concurrent_ranks=concurrent,
                    sharing_efficiency=sharing, threads=threads, **profile)


def _compute(device: torch.device, tokens: int) -> dict:
    """The compute figures of one rank's device (:class:`HardwareProfile` fields)."""
    profile = dict(matmul_flops=_matmul_rate(device, torch.bfloat16, tokens),
                   matmul_flops_fp32=_matmul_rate(device, torch.float32, tokens),
                   memory_bandwidth=_memory_bandwidth(device), op_overhead=_op_overhead(device),
                   **_attention_rates(device, tokens))
    if device.type == "cuda":
        pinned = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty_like(pinned, device=device)
        profile["host_bandwidth"] = pinned.numel() / _seconds(lambda: on_device.copy_(pinned), device)
    else:
        profile["host_bandwidth"] = profile["memory_bandwidth"] * 2 / 3  # a copy: one read, one write
    return profile
