"""Hardware profiles: what a rank computes, moves and holds per second, built in or measured.

    autoshard.hardware("h100")                    # a built-in profile (a :class:`HardwareProfile`)
    autoshard.hardware("cpu.json")                # one ``python -m autoshard calibrate --out cpu.json`` wrote
    autoshard.plan(model, args, world_size=8, hardware="h100").step_seconds

A profile is a :class:`HardwareProfile`: the cost model chooses attention strategies with it and the
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
  (:attr:`HardwareProfile.attention_pair_flops` 0: head dim 128 measured, smaller ones not);
* elementwise ops sustain 80% of the HBM bandwidth; NVLink collectives 80% of the link (NCCL's bus bandwidth on
  8 GPUs), the network 80% of the adapter; 25 us per message between nodes, 5 us inside one (NCCL's small-message
  latency); a kernel launch 4 us;
* host copies run at 80% of the PCIe link (pinned memory): 25 GB/s on PCIe 4, 50 GB/s on PCIe 5.

**Calibrated profiles** measure the machine they run on (:func:`autoshard.calibration.calibrate`, ``python -m
autoshard calibrate --out FILE``); :func:`save_profile` and :func:`load_profile` write and read them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["HardwareProfile", "PROFILES", "hardware", "save_profile", "load_profile"]

_GiB = 2**30


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """A cluster, as the cost model and the step-time prediction see it: what one rank computes, moves and holds.
    The defaults are an H100 SXM node (:data:`PROFILES` ``["h100"]`` says where each figure comes from);
    :func:`hardware` gives the built-in profiles by name and reads calibrated ones from files
    (``python -m autoshard calibrate``)."""

    name: str = "h100"
    """What the profile describes (a built-in's name, or where it was calibrated)."""
    ranks_per_node: int = 8
    """Ranks that share the fast intra-node links."""
    intra_node_bandwidth: float = 450e9
    """Bytes per second a rank sends to ranks of its node."""
    inter_node_bandwidth: float = 50e9
    """Bytes per second a rank sends to other nodes."""
    intra_node_latency: float = 3e-6
    """Seconds per message inside a node (a collective over P ranks sends P - 1 of them)."""
    inter_node_latency: float = 10e-6
    """Seconds per message between nodes."""
    attention_flops: float = 400e12
    """Attention FLOP/s a rank sustains in 16-bit (forward and backward together, FLOPs counted as
    :class:`~autoshard.runtime.attention.base.AttentionShape` does)."""
    attention_flops_fp32: float = 40e12
    """The same in float32 (and float64)."""
    attention_pair_flops: float = 0.0
    """What each visible (query, key) pair and head costs beyond the products' ``14 D`` FLOPs (forward + backward: the
    softmax's exponentials, the mask, the online rescaling), in FLOPs at the attention rate: it makes small head dims
    slower per FLOP. 0: folded into the rate (the built-in profiles, measured at head dim 128)."""
    matmul_flops: float = 700e12
    """Matrix-multiply FLOP/s a rank sustains in 16-bit (``2 M N K`` per product)."""
    matmul_flops_fp32: float = 50e12
    """The same in float32 (PyTorch's default: no TF32)."""
    step_overhead: float = 20e-6
    """Seconds each ring step costs beyond its compute and traffic (launches, synchronization)."""
    op_overhead: float = 4e-6
    """Seconds every other op costs beyond its arithmetic and memory traffic (a kernel launch; an eager CPU op's
    dispatch)."""
    memory_bandwidth: float = 3.0e12
    """Bytes per second of device memory an elementwise op sustains (reads and writes together; a ring merges
    every block's partial output through it)."""
    memory_bytes: int = 80 * 2**30
    """Memory per rank."""
    host_memory_bytes: int = 256 * 2**30
    """Host memory per rank (offloaded activations live there)."""
    host_bandwidth: float = 40e9
    """Bytes per second between a rank's device and pinned host memory, each way."""
    concurrent_ranks: int = 0
    """Ranks of a node that compute at full speed at once (a CPU's cores over each rank's threads); more ranks on
    a node share them, each computing that much slower. 0: every rank has its own device."""
    sharing_efficiency: float = 1.0
    """How much of the cores ranks beyond :attr:`concurrent_ranks` get when they share them (1: perfect time slicing;
    context switches and caches make it less)."""
    threads: int = 0
    """CPU threads per rank the compute figures were measured with (a CPU calibration's ``torch.get_num_threads()``;
    :meth:`with_threads` prices ranks with other threads). 0: each rank has a device whose speed its host's threads do
    not change (a GPU)."""

    def __post_init__(self):
        rates = (self.intra_node_bandwidth, self.inter_node_bandwidth, self.attention_flops, self.memory_bandwidth,
                 self.memory_bytes, self.attention_flops_fp32, self.matmul_flops, self.matmul_flops_fp32,
                 self.host_memory_bytes, self.host_bandwidth)
        times = (self.intra_node_latency, self.inter_node_latency, self.step_overhead, self.op_overhead)
        if (self.ranks_per_node < 1 or min(rates) <= 0 or min(times) < 0 or self.concurrent_ranks < 0
                or self.attention_pair_flops < 0 or not 0 < self.sharing_efficiency <= 1 or self.threads < 0):
            raise ValueError(f"HardwareProfile: ranks per node, bandwidths, FLOP/s and memory must be positive and "
                             f"latencies not negative: {self}")
        if self.threads and not self.concurrent_ranks:
            raise ValueError(f"HardwareProfile: a CPU profile (threads {self.threads}) needs its concurrent ranks "
                             f"(the cores over the threads): {self}")

    def bandwidth(self, ranks: int) -> float:
        """Bandwidth of a collective over ``ranks`` consecutive ranks."""
        return self.intra_node_bandwidth if ranks <= self.ranks_per_node else self.inter_node_bandwidth

    def latency(self, ranks: int) -> float:
        """Seconds per message of a collective over ``ranks`` consecutive ranks."""
        return self.intra_node_latency if ranks <= self.ranks_per_node else self.inter_node_latency

    def collective_seconds(self, nbytes: float, ranks: int) -> float:
        """Seconds of a collective over ``ranks`` ranks in which a rank sends ``nbytes``: ``P - 1`` messages' latency
        and the bytes over the links they cross (0 on one rank)."""
        if ranks <= 1:
            return 0.0
        return (ranks - 1) * self.latency(ranks) + nbytes / self.bandwidth(ranks)

    def slowdown(self, ranks: int) -> float:
        """How much slower a rank computes when ``ranks`` ranks run (:attr:`concurrent_ranks`): 1 with a device each."""
        sharing = min(ranks, self.ranks_per_node)
        if not self.concurrent_ranks or sharing <= self.concurrent_ranks:
            return 1.0
        return sharing / self.concurrent_ranks / self.sharing_efficiency

    def with_threads(self, threads: int | None = None, *, world: int = 1) -> "HardwareProfile":
        """This profile for a run whose ranks get ``threads`` CPU threads each (:attr:`threads`); None: what torchrun
        gives a rank of a ``world``-rank run -- ``OMP_NUM_THREADS`` when set, else one thread when several ranks run
        (torchrun sets it so for more than one rank per node, and :func:`autoshard.testing.run_on_ranks` runs one per
        rank), else the profile's own (a lone process keeps PyTorch's default, what a calibration in one process
        measured). A profile without threads (a GPU's) is returned as it is.

        The model, for a CPU rank on the cores the profile saw (:attr:`concurrent_ranks` x :attr:`threads`; threads
        beyond them add nothing):

        * matrix multiplies and attention split their work over the threads: their FLOP/s scale in proportion to
          them (measured on 2 cores, 1 -> 2 threads: float32 products x1.9, attention x2.1; assumed for 16-bit
          products too, though a CPU without 16-bit matrix units runs them on one thread: x1.0 on that machine);
        * memory-bound ops split their bytes over the threads but share one memory system: bandwidth scales as the
          square root of the threads (measured there: an add x1.6, noisy from x1.2 to x2.0);
        * an op's overhead (its dispatch, on one thread) does not change;
        * :attr:`concurrent_ranks` becomes the cores over the new threads (ranks beyond them share the cores,
          :meth:`slowdown`)."""
        if not self.threads:
            return self
        if threads is None:
            threads = int(os.environ.get("OMP_NUM_THREADS") or (1 if world > 1 else self.threads))
        if threads < 1:
            raise ValueError(f"HardwareProfile.with_threads: threads per rank must be positive, got {threads}")
        if threads == self.threads:
            return self
        cores = self.concurrent_ranks * self.threads
        compute = min(threads, cores) / self.threads
        memory = compute ** 0.5
        concurrent = max(1, cores // threads)
        return dataclasses.replace(
            self, name=f"{self.name}, at {threads} thread(s) per rank", threads=threads, concurrent_ranks=concurrent,
            ranks_per_node=max(self.ranks_per_node, concurrent), matmul_flops=self.matmul_flops * compute,
            matmul_flops_fp32=self.matmul_flops_fp32 * compute, attention_flops=self.attention_flops * compute,
            attention_flops_fp32=self.attention_flops_fp32 * compute, memory_bandwidth=self.memory_bandwidth * memory,
            host_bandwidth=self.host_bandwidth * memory)

    def matmul_rate(self, dtype: torch.dtype) -> float:
        """Matrix-multiply FLOP/s in ``dtype``."""
        return self.matmul_flops if _sixteen_bit(dtype) else self.matmul_flops_fp32

    def attention_rate(self, dtype: torch.dtype) -> float:
        """Attention FLOP/s in ``dtype``."""
        return self.attention_flops if _sixteen_bit(dtype) else self.attention_flops_fp32


def _sixteen_bit(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and torch.finfo(dtype).bits <= 16


def _gpu(name: str, *, bf16: float, fp32: float, hbm: float, memory: int, nvlink: float, network: float,
         host: int, pcie: float) -> HardwareProfile:
    """A profile from a GPU's peaks and the efficiencies of the module docstring."""
    return HardwareProfile(name=name, ranks_per_node=8, intra_node_bandwidth=0.8 * nvlink,
                           inter_node_bandwidth=0.8 * network, intra_node_latency=5e-6, inter_node_latency=25e-6,
                           attention_flops=0.35 * bf16, attention_flops_fp32=0.4 * fp32, matmul_flops=0.7 * bf16,
                           matmul_flops_fp32=0.8 * fp32, step_overhead=20e-6, op_overhead=4e-6,
                           memory_bandwidth=0.8 * hbm, memory_bytes=memory, host_memory_bytes=host,
                           host_bandwidth=0.8 * pcie)


PROFILES: dict[str, HardwareProfile] = {
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


def hardware(spec: str | os.PathLike | HardwareProfile) -> HardwareProfile:
    """The profile ``spec`` names: a :class:`HardwareProfile` as it is, a built-in name (:data:`PROFILES`),
    or a JSON file :func:`save_profile` wrote. An unknown name lists the known ones."""
    if isinstance(spec, HardwareProfile):
        return spec
    key = str(spec).lower()
    if key in PROFILES:
        return PROFILES[key]
    if Path(spec).is_file():
        return load_profile(spec)
    raise ValueError(f"autoshard: unknown hardware {str(spec)!r}: not a profile file and not one of "
                     f"{', '.join(sorted(PROFILES))} (python -m autoshard calibrate --out FILE measures this machine)")


def save_profile(profile: HardwareProfile, path: str | os.PathLike) -> None:
    """Write ``profile`` as JSON (every field)."""
    Path(path).write_text(json.dumps(dataclasses.asdict(profile), indent=1, sort_keys=True) + "\n")


def load_profile(path: str | os.PathLike) -> HardwareProfile:
    """The profile a JSON file holds; a missing or unknown field is named. A file written before profiles recorded
    their :attr:`HardwareProfile.threads` gets the threads its name says it was calibrated with (``cpu x2
    thread(s)``), none for a GPU's (:attr:`HardwareProfile.concurrent_ranks` 0); a CPU profile whose name
    does not say them is refused."""
    data = json.loads(Path(path).read_text())
    if "threads" not in data:
        data["threads"] = _old_threads(data, path)
    fields = {f.name for f in dataclasses.fields(HardwareProfile)}
    missing, unknown = sorted(fields - set(data)), sorted(set(data) - fields)
    if missing or unknown:
        raise ValueError(f"autoshard: hardware profile {str(path)!r}: "
                         + "; ".join(([f"missing field(s) {', '.join(missing)}"] if missing else [])
                                     + ([f"unknown field(s) {', '.join(unknown)}"] if unknown else [])))
    return HardwareProfile(**data)


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
