"""The planner's predictions against measurements, and its own cost (tables, no assertions).

    python benchmarks/plan.py            # both tables
    python benchmarks/plan.py --quick    # smaller sizes

1. memory: the plan's predicted per-rank peak for forward+backward of the Llama-style model at two
   sequence lengths vs the peak resident memory measured on real ranks (P=2, CPU, float32);
2. the plan of a 32-layer, hidden 4096, 32/8-head Llama shape at 1,048,576 tokens on 64 ranks (meta
   device): wall time and peak resident memory of ``python -m autoshard plan`` (targets: 30 s, 2 GiB).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

import autoshard
from autoshard.models import LlamaConfig, LlamaLM
from autoshard.testing import run_on_ranks
from autoshard.testing.memory import LOW_MMAP_THRESHOLD_ENV, peak_memory

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(layers=2, hidden=256, heads=8, kv_heads=4, intermediate=1024)


def measured_peak(seq_len: int) -> int:
    """Peak resident bytes of one forward+backward of the compiled model on this rank."""
    torch.manual_seed(0)
    model = LlamaLM(LlamaConfig(**CONFIG))
    ids = torch.randint(0, 256, (1, seq_len))
    compiled = torch.compile(model, backend=autoshard.backend(outputs="sharded"))
    compiled(ids, ids)[0].backward()  # compile, warm up
    model.zero_grad(set_to_none=True)
    with peak_memory() as measured:
        loss, _ = compiled(ids, ids)
        loss.backward()
    # the parameters were resident before the block: add them, as the plan counts them
    return measured.peak_bytes + sum(p.numel() * p.element_size() for p in model.parameters())


def predicted_peak(seq_len: int, world: int) -> int:
    with torch.device("meta"):
        model = LlamaLM(LlamaConfig(**CONFIG))
        ids = torch.randint(0, 256, (1, seq_len))
    return autoshard.plan(model, (ids, ids), world_size=world, outputs="sharded").memory_per_rank.total


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    opts = parser.parse_args()
    lengths = (2048, 4096) if opts.quick else (8192, 16384)

    print("\n1. per-rank peak memory of forward+backward, Llama-style (hidden 256, 2 layers), P=2, float32")
    print(f"   {'S':>7} {'predicted MiB':>14} {'measured MiB (rank 0, 1)':>26} {'predicted/measured':>20}")
    for seq in lengths:
        predicted = predicted_peak(seq, 2)
        measured = run_on_ranks(measured_peak, 2, seq, timeout=3600, env=LOW_MMAP_THRESHOLD_ENV)
        print(f"   {seq:>7} {predicted / 2**20:>14.1f} {measured[0] / 2**20:>12.1f} {measured[1] / 2**20:>12.1f} "
              f"{predicted / max(measured):>20.2f}")
    print("   (target: within 20%)")

    print("\n2. planning an 8B Llama shape at 1,048,576 tokens on 64 ranks (meta device)")
    seq = 1 << 20 if not opts.quick else 1 << 16
    start = time.perf_counter()
    code = ("import resource, sys; from autoshard.__main__ import main; main(sys.argv[1:]); "
            "print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code, "plan", "examples/plan_llama_8b.py:factory", "--world-size",
                          "64", "--seq-len", str(seq), "--outputs", "sharded"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    wall = time.perf_counter() - start
    rss = next((int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("MAXRSS")), 0) * 1024
    head = "\n".join("   " + line for line in out.stdout.splitlines()[:6])
    print(head)
    print(f"   wall {wall:.1f} s (target 30 s), peak resident {rss / 2**30:.2f} GiB (target 2 GiB)")


if __name__ == "__main__":
    main()
