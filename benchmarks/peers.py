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
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import distributed, print_table

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
    args = parser.parse_args()
    if importlib.util.find_spec("deepspeed") is None:
        print("DeepSpeed is not installed, so there is no peer to compare with; see the install lines in "
              "benchmarks/peers.py's docstring.")
        return
    lengths = args.seq or ([1024, 2048] if args.quick else [8192, 16384, 32768])
    rows = []
    for length in lengths:
        for causal in (False, True):
            peer = run_on_ranks(distributed, WORLD, "peer", "contiguous", length, causal, deepspeed_ulysses,
                                threads=1, env=LOW_MMAP_THRESHOLD_ENV, timeout=TIMEOUT)
            peer_time = max(r[0] for r in peer)
            mask = "causal" if causal else "full"
            rows.append([f"{length // 1024}k", mask, "DeepSpeed-Ulysses + SDPA", f"{peer_time:.2f}", "1.00", "-",
                         f"{max(r[2] for r in peer) / 2**20:.0f} MiB"])
            for strategy, layout in OURS:
                ours = run_on_ranks(distributed, WORLD, strategy, layout, length, causal, threads=1,
                                    env=LOW_MMAP_THRESHOLD_ENV, timeout=TIMEOUT)
                t = max(r[0] for r in ours)
                sent, peak = max(r[1] for r in ours), max(r[2] for r in ours)
                rows.append([f"{length // 1024}k", mask, f"autoshard {strategy}", f"{t:.2f}", f"{peer_time / t:.2f}",
                             f"{sent / 2**20:.1f} MiB", f"{peak / 2**20:.0f} MiB"])
            print(f"done S={length} {mask}", flush=True)
    print_table(f"P={WORLD} ranks x 1 thread, forward + backward, B=1 H=8 D=64 float32 (seconds; speed-up = peer time "
                f"/ time)", ["S", "mask", "run", "T_P", "speed-up vs peer", "sent/rank", "peak/rank"], rows)


if __name__ == "__main__":
    sys.exit(main())
