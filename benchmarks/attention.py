"""Distributed attention on CPU ranks against one process: time, scaling, bytes, memory.

    python benchmarks/attention.py            # S in {4k, 8k, 16k, 32k}: takes a while (tens of minutes)
    python benchmarks/attention.py --quick    # S in {1k, 2k}: seconds

B=1, H=8, D=64, float32, causal and not. Columns:

* ``T1`` / ``T1x2``: ``F.scaled_dot_product_attention`` forward + backward on the whole sequence in one
  process with 1 / 2 intra-op threads;
* ``T_P``: the strategy at ``P = 2`` ranks with 1 thread each (the slowest rank's forward + backward);
* ``T1/(P*T_P)``: scaling efficiency against one thread (ideal 1.0);
* ``T1x2/T_P``: the same hardware (2 cores) used by one process instead (ideal 1.0 on this machine);
* ``sent/rank``: bytes each rank sends (forward + backward), ``peak/rank``: its peak extra resident memory.

Numbers are single timed runs (after a small warm-up) on a shared machine: read them as ratios.
"""

from __future__ import annotations

import argparse

from _common import distributed, one_process, print_table

from autoshard.testing import run_on_ranks
from autoshard.testing.memory import LOW_MMAP_THRESHOLD_ENV

STRATEGIES = [("ring", "contiguous"), ("zigzag", "zigzag"), ("allgather", "contiguous"), ("ulysses", "contiguous")]
WORLD = 2
TIMEOUT = 3600.0


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="S in {1k, 2k} (a smoke run)")
    parser.add_argument("--seq", type=int, nargs="*", help="sequence lengths (default 4k 8k 16k 32k)")
    args = parser.parse_args()
    lengths = args.seq or ([1024, 2048] if args.quick else [4096, 8192, 16384, 32768])
    rows = []
    for length in lengths:
        for causal in (False, True):
            (t1, m1), = run_on_ranks(one_process, 1, length, causal, threads=1, env=LOW_MMAP_THRESHOLD_ENV,
                                     timeout=TIMEOUT)
            (t1x2, _), = run_on_ranks(one_process, 1, length, causal, threads=2, env=LOW_MMAP_THRESHOLD_ENV,
                                      timeout=TIMEOUT)
            rows.append([f"{length // 1024}k", "causal" if causal else "full", "one process", f"{t1:.2f}",
                         f"{t1x2:.2f}", "", "", "", "0", _mib(m1)])
            for strategy, layout in STRATEGIES:
                ranks = run_on_ranks(distributed, WORLD, strategy, layout, length, causal, threads=1,
                                     env=LOW_MMAP_THRESHOLD_ENV, timeout=TIMEOUT)
                tp = max(r[0] for r in ranks)
                rows.append([f"{length // 1024}k", "causal" if causal else "full", f"{strategy} P={WORLD}", "", "",
                             f"{tp:.2f}", f"{t1 / (WORLD * tp):.2f}", f"{t1x2 / tp:.2f}",
                             f"{max(r[1] for r in ranks) / 2**20:.1f} MiB", _mib(max(r[2] for r in ranks))])
            print(f"done S={length} {'causal' if causal else 'full'}", flush=True)
    print_table("attention forward + backward, B=1 H=8 D=64 float32 (seconds)",
                ["S", "mask", "run", "T1", "T1x2", "T_P", "T1/(P*T_P)", "T1x2/T_P", "sent/rank", "peak/rank"], rows)


if __name__ == "__main__":
    main()
