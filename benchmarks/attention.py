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

Times are the fastest of ``--repeat`` interleaved runs (default 1); on a shared machine read them as
ratios and mind the load average printed with the table.
"""

from __future__ import annotations

import argparse
import functools
import os

from _common import best_of, distributed, one_process, print_table

from autoshard.testing import run_on_ranks
from autoshard.testing.memory import LOW_MMAP_THRESHOLD_ENV

STRATEGIES = [("ring", "contiguous"), ("zigzag", "zigzag"), ("allgather", "contiguous"), ("ulysses", "contiguous")]
WORLD = 2
TIMEOUT = 3600.0


def _one_process(length: int, causal: bool, threads: int) -> tuple:
    return run_on_ranks(one_process, 1, length, causal, threads=threads, env=LOW_MMAP_THRESHOLD_ENV,
                        timeout=TIMEOUT)[0]


def _strategy(strategy: str, layout: str, length: int, causal: bool) -> tuple:
    ranks = run_on_ranks(distributed, WORLD, strategy, layout, length, causal, threads=1, env=LOW_MMAP_THRESHOLD_ENV,
                         timeout=TIMEOUT)
    return tuple(max(r[i] for r in ranks) for i in range(3))  # the slowest rank; most bytes; highest peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="S in {1k, 2k} (a smoke run)")
    parser.add_argument("--seq", type=int, nargs="*", help="sequence lengths (default 4k 8k 16k 32k)")
    parser.add_argument("--repeat", type=int, default=1, help="interleaved repeats; the fastest counts")
    args = parser.parse_args()
    lengths = args.seq or ([1024, 2048] if args.quick else [4096, 8192, 16384, 32768])
    rows = []
    for length in lengths:
        for causal in (False, True):
            runs = {"T1": functools.partial(_one_process, length, causal, 1),
                    "T1x2": functools.partial(_one_process, length, causal, 2)}
            runs.update({s: functools.partial(_strategy, s, layout, length, causal) for s, layout in STRATEGIES})
            best = best_of(args.repeat, runs)
            (t1, m1), t1x2 = best["T1"], best["T1x2"][0]
            size, mask = f"{length // 1024}k", "causal" if causal else "full"
            rows.append([size, mask, "one process", f"{t1:.2f}", f"{t1x2:.2f}", "", "", "", "0",
                         f"{m1 / 2**20:.0f} MiB"])
            for strategy, _ in STRATEGIES:
                tp, sent, peak = best[strategy]
                rows.append([size, mask, f"{strategy} P={WORLD}", "", "", f"{tp:.2f}", f"{t1 / (WORLD * tp):.2f}",
                             f"{t1x2 / tp:.2f}", f"{sent / 2**20:.1f} MiB", f"{peak / 2**20:.0f} MiB"])
            print(f"done S={length} {mask}", flush=True)
    print_table(f"attention forward + backward, B=1 H=8 D=64 float32 (seconds; best of {args.repeat}; load average "
                f"at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)",
                ["S", "mask", "run", "T1", "T1x2", "T_P", "T1/(P*T_P)", "T1x2/T_P", "sent/rank", "peak/rank"], rows)


if __name__ == "__main__":
    main()
