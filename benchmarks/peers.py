"""Peer baseline: DeepSpeed-Ulysses' ``DistributedAttention`` around torch SDPA, against our strategies.

    python benchmarks/peers.py              # S in {8k, 16k, 32k}, causal and not (several minutes)
    python benchmarks/peers.py --quick      # S in {1k, 2k}

Same run, same inputs (B=1, H=8, D=64, float32, each rank's contiguous shard), P=2 ranks with one
thread each, forward + backward; the slowest rank's time, its bytes sent and peak extra memory.
DeepSpeed's layer gets its native ``[S_local, B, H, D]`` view of the same tensors and runs
``F.scaled_dot_product_attention`` on ``[B, H/P, S, D]`` between its all-to-alls.

DeepSpeed's collectives bypass autoshard's byte accountant (``sent/rank`` shows ``-``); it moves four
``[B, H, S_local, D]`` tensors each way (q, k, v, out forward; dout, dq, dk, dv backward), ours add the
LSE and, in the backward, q, k, v and out again (the custom op keeps only its inputs and outputs).

DeepSpeed is not a dependency of autoshard. To install it for CPU benchmarking (torch stays as is):

    .venv/bin/pip install -c constraints.txt hjson msgpack ninja packaging psutil py-cpuinfo "pydantic>=2" tqdm einops
    DS_BUILD_OPS=0 .venv/bin/pip install -c constraints.txt --no-deps --no-build-isolation deepspeed
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import best_of, distributed, print_table

from autoshard.testing import run_on_ranks
from autoshard.testing.memory import LOW_MMAP_THRESHOLD_ENV

OURS = [("ulysses", "contiguous"), ("zigzag", "zigzag"), ("ring", "contiguous")]
WORLD = 2
TIMEOUT = 3600.0


class _SDPA(torch.nn.Module):
    """The local attention DeepSpeed wraps: SDPA on its [S, B, h, D] tensors."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=self.causal)
        return out.permute(2, 0, 1, 3)


@functools.lru_cache(maxsize=None)
def _deepspeed_layer(causal: bool):
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    return DistributedAttention(_SDPA(causal), dist.group.WORLD, scatter_idx=2, gather_idx=0)


def deepspeed_ulysses(q, k, v, causal: bool):
    """DeepSpeed-Ulysses on our [B, H, S_local, D] shards (as its [S_local, B, H, D] views)."""
    out = _deepspeed_layer(causal)(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), batch_dim_idx=1)
    return out.permute(1, 2, 0, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="S in {1k, 2k} (a smoke run)")
    parser.add_argument("--seq", type=int, nargs="*", help="sequence lengths (default 8k 16k 32k)")
    parser.add_argument("--repeat", type=int, default=1, help="interleaved repeats; the fastest counts")
    args = parser.parse_args()
    if importlib.util.find_spec("deepspeed") is None:
        print("DeepSpeed is not installed, so there is no peer to compare with; see the install lines in "
              "benchmarks/peers.py's docstring.")
        return
    lengths = args.seq or ([1024, 2048] if args.quick else [8192, 16384, 32768])
    rows = []
    for length in lengths:
        for causal in (False, True):
            runs = {"peer": functools.partial(_run, "peer", "contiguous", length, causal, deepspeed_ulysses)}
            runs.update({s: functools.partial(_run, s, layout, length, causal) for s, layout in OURS})
            best = best_of(args.repeat, runs)
            peer_time, _, peer_peak = best["peer"]
            size, mask = f"{length // 1024}k", "causal" if causal else "full"
            rows.append([size, mask, "DeepSpeed-Ulysses + SDPA", f"{peer_time:.2f}", "1.00", "-",
                         f"{peer_peak / 2**20:.0f} MiB"])
            for strategy, _ in OURS:
                t, sent, peak = best[strategy]
                rows.append([size, mask, f"autoshard {strategy}", f"{t:.2f}", f"{peer_time / t:.2f}",
                             f"{sent / 2**20:.1f} MiB", f"{peak / 2**20:.0f} MiB"])
            print(f"done S={length} {mask}", flush=True)
    print_table(f"P={WORLD} ranks x 1 thread, forward + backward, B=1 H=8 D=64 float32 (seconds, best of "
                f"{args.repeat}; speed-up = peer time / time; load average at the end {os.getloadavg()[0]:.1f} on "
                f"{os.cpu_count()} cores)", ["S", "mask", "run", "T_P", "speed-up vs peer", "sent/rank", "peak/rank"],
                rows)


def _run(strategy: str, layout: str, length: int, causal: bool, peer=None) -> tuple:
    ranks = run_on_ranks(distributed, WORLD, strategy, layout, length, causal, peer, threads=1,
                         env=LOW_MMAP_THRESHOLD_ENV, timeout=TIMEOUT)
    return tuple(max(r[i] for r in ranks) for i in range(3))  # the slowest rank; most bytes; highest peak


if __name__ == "__main__":
    sys.exit(main())
