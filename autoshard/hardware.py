"""Hardware profiles: what a rank computes, moves and holds per second, built in or measured.

    autoshard.hardware("h100")                    # a built-in profile (a, :class:`~autoshard.cost.Topology`)
    autoshard.hardware("cpu.json")                # one ``python -m autoshard calibrate --out cpu.json`` wrote
    autoshard.plan(model, args, world_size=8, hardware="h100").step_seconds

A profile is a :class:`~autoshard.cost.Topology`: the cost model chooses attention strategies with it and the
step-time prediction (:mod:`autoshard.step_time`) prices every op of a planned step with it.

**Built-in profiles** (:data:`PROFILES`): one 8-GPU node's GPU as its vendor specifies it, times the efficiency a
sustained kernel reaches. The figures and their sources:

=================  =========  =========  =========  =========
per GPU            A100 SXM   H100 SXM   H200 SXM   B200
=================  =========  =========  =========  =========
BF16 dense peak    312 TF     989 TF     989 TF     2250 TF
FP32 (no TF32)     19.5 TF    67 TF      67 TF      75 TF
HBM bandwidth      2.04 TB/s  3.35 TB/s  4.8 TB/s   8 TB/s
memory             80 GiB     80 GiB     141 GB     180 GB
NVLink, each way   300 GB/s   450 GB/s   450 GB/s   900 GB/s
network per GPU    25 GB/s    50 GB/s    50 GB/s    50 GB/s
host memory / GPU  128 GiB    256 GiB    256 GiB    512 GiB
host link          PCIe 4     PCIe 5     PCIe 5     PCIe 5
=================  =========  =========  =========  =========

Sources: NVIDIA's A100, H100, H200 and HGX B200 datasheets (dense tensor-core peaks, HBM, NVLink), the DGX A100 /
DGX H100 / DGX H200 / DGX B200 user guides (one 200 Gb/s HDR or 400 Gb/s NDR ConnectX adapter per GPU; 1, 2, 2
and 4 TB of host memory per node). Efficiencies applied (stated, not measured unless said so):

* matrix multiplies sustain 70% of the 16-bit peak and 80% of the FP32 peak (cuBLAS on large GEMMs);
* attention (autoshard's Triton kernels, forward + backward, FLOPs counted as FlashAttention counts them):
  **measured** 306-409 TF/s on one H200 in bf16 (``bash benchmarks/gpu_check.sh``, S = 16k, D = 128), so 35% of
  peak on Hopper; the same 35% is assumed on A100 and B200, and 40% of the FP32 peak; no per-pair cost beyond it
  (:attr:`~autoshard.cost.Topology.attention_pair_flops` 0: head dim 128 measured, smaller ones not);
* elementwise ops sustain 80% of the HBM bandwidth; NVLink collectives 80% of the link (NCCL's bus bandwidth on
  8 GPUs), the network 80% of the adapter; 25 us per message between nodes, 5 us inside one (NCCL's small-message
  latency); a kernel launch 4 us;
* host copies run at 80% of the PCIe link (pinned memory): 25 GB/s on PCIe 4, 50 GB/s on PCIe 5.

**Calibrated profiles** (:func:`calibrate`, ``python -m autoshard calibrate --out FILE``) measure the machine they
run on: its GPU, or the CPU with the threads each rank gets (``torch.get_num_threads()``, recorded as
:attr:`~autoshard.cost.Topology.threads`: a plan for ranks with other threads scales the rates,
:meth:`~autoshard.cost.Topology.with_threads`), through the kernels a step runs (``torch.mm``, autoshard's local
attention forward + backward, an elementwise add), and the collectives of the process group when launched on several
ranks (``torchrun --nproc-per-node N -m autoshard calibrate``). A CPU profile's
:attr:`~autoshard.cost.Topology.concurrent_ranks` is its cores over the threads per rank: ranks beyond it share cores,
and the prediction slows them accordingly (by the :attr:`~autoshard.cost.Topology.sharing_efficiency` measured when
more ranks than cores were launched). Attention is timed at head dims 32 and 128 to fit its per-pair
cost beyond the FLOPs (:attr:`~autoshard.cost.Topology.attention_pair_flops`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .cost import Topology

__all__ = ["PROFILES", "hardware", "calibrate", "save_profile", "load_profile"]

_GiB = 2**30


def _gpu(name: str, *, bf16: float, fp32: float, hbm: float, memory: int, nvlink: float, network: float,
         host: int, pcie: float) -> Topology:
    """A profile from a GPU's peaks and the efficiencies of the module docstring."""
    return Topology(name=name, ranks_per_node=8, intra_node_bandwidth=0.8 * nvlink, inter_node_bandwidth=0.8 * network,
                    intra_node_latency=5e-6, inter_node_latency=25e-6, attention_flops=0.35 * bf16,
                    attention_flops_fp32=0.4 * fp32, matmul_flops=0.7 * bf16, matmul_flops_fp32=0.8 * fp32,
                    step_overhead=20e-6, op_overhead=4e-6, memory_bandwidth=0.8 * hbm, memory_bytes=memory,
                    host_memory_bytes=host, host_bandwidth=0.8 * pcie)


PROFILES: dict[str, Topology] = {
    "a100": _gpu("a100", bf16=312e12, fp32=19.5e12, hbm=2.039e12, memory=80 * _GiB, nvlink=300e9, network=25e9,
                 host=128 * _GiB, pcie=32e9),
    "h100": _gpu("h100", bf16=989e12, fp32=67e12, hbm=3.35e12, memory=80 * _GiB, nvlink=450e9, network=50e9,
                 host=256 * _GiB, pcie=64e9),
    "h200": _gpu("h200", bf16=989e12, fp32=67e12, hbm=4.8e12, memory=141 * 10**9, nvlink=450e9, network=50e9,
                 host=256 * _GiB, pcie=64e9),
    "b200": _gpu("b200", bf16=2250e12, fp32=75e12, hbm=8e12, memory=180 * 10**9, nvlink=900e9, network=50e9,
                 host=512 * _GiB, pcie=64e9),
}
"""The built-in profiles, by name (see the module docstring for their figures and sources)."""


def hardware(spec: str | os.PathLike | Topology) -> Topology:
    """The profile ``spec`` names: a :class:`~autoshard.cost.Topology` as it is, a built-in name (:data:`PROFILES`),
    or a JSON file :func:`save_profile` wrote. An unknown name lists the known ones."""
    if isinstance(spec, Topology):
        return spec
    key = str(spec).lower()
    if key in PROFILES:
        return PROFILES[key]
    if Path(spec).is_file():
        return load_profile(spec)
    raise ValueError(f"autoshard: unknown hardware {str(spec)!r}: not a profile file and not one of "
                     f"{', '.join(sorted(PROFILES))} (python -m autoshard calibrate --out FILE measures this machine)")


def save_profile(profile: Topology, path: str | os.PathLike) -> None:
    """Write ``profile`` as JSON (every field)."""
    Path(path).write_text(json.dumps(dataclasses.asdict(profile), indent=1, sort_keys=True) + "\n")


def load_profile(path: str | os.PathLike) -> Topology:
    """The profile a JSON file holds; a missing or unknown field is named. A file written before profiles recorded
    their :attr:`~autoshard.cost.Topology.threads` gets the threads its name says it was calibrated with (``cpu x2
    thread(s)``), none for a GPU's (:attr:`~autoshard.cost.Topology.concurrent_ranks` 0); a CPU profile whose name
    does not say them is refused."""
    data = json.loads(Path(path).read_text())
    if "threads" not in data:
        data["threads"] = _old_threads(data, path)
    fields = {f.name for f in dataclasses.fields(Topology)}
    missing, unknown = sorted(fields - set(data)), sorted(set(data) - fields)
    if missing or unknown:
        raise ValueError(f"autoshard: hardware profile {str(path)!r}: "
                         + "; ".join(([f"missing field(s) {', '.join(missing)}"] if missing else [])
                                     + ([f"unknown field(s) {', '.join(unknown)}"] if unknown else [])))
    return Topology(**data)


def _old_threads(data: dict, path: str | os.PathLike) -> int:
    """The threads of a profile file written without them (see :func:`load_profile`)."""
    if not data.get("concurrent_ranks"):
        return 0
    match = re.match(r"cpu x(\d+) thread", str(data.get("name", "")))
    if match is None:
        raise ValueError(f"autoshard: hardware profile {str(path)!r}: a CPU profile without the threads per rank its "
                         f"rates were measured with (field threads; its name {data.get('name')!r} does not say "
                         f"them): the rates scale with the threads, so it cannot price ranks; add the field or "
                         f"recalibrate (python -m autoshard calibrate --out FILE)")
    return int(match.group(1))


# ----------------------------------------------------------------------------------------------- calibration


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
    from .runtime.attention.local import local_attention, local_attention_backward

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


def calibrate(*, tokens: int = 4096) -> Topology:
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
    base = Topology()
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
    return Topology(name=name, ranks_per_node=ranks_per_node, intra_node_bandwidth=bandwidth,
                    inter_node_bandwidth=bandwidth, intra_node_latency=latency, inter_node_latency=latency,
                    step_overhead=profile["op_overhead"] * 10, memory_bytes=memory,
                    host_memory_bytes=host // max(1, local_ranks), concurrent_ranks=concurrent,
                    sharing_efficiency=sharing, threads=threads, **profile)


def _compute(device: torch.device, tokens: int) -> dict:
    """The compute figures of one rank's device (:class:`~autoshard.cost.Topology` fields)."""
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
