"""Predicted against measured step time: calibrate this machine, plan, run, compare (tables, no asserts).

    python benchmarks/step_time.py                                    # S = 4096, 8192, 16384; P = 1, 2, 4 (~30 min)
    python benchmarks/step_time.py --lengths 4096 --worlds 2 --repeat 2   # quicker
    python benchmarks/step_time.py --calibrate process --lengths 4096 --worlds 2 --strategies zigzag

1. ``autoshard.calibrate()`` on ``max(--worlds)`` gloo ranks, one thread each (the compute on rank 0 alone
   while the others wait, the collectives on all of them); with ``--calibrate process``, in this process with its
   default threads instead (what ``python -m autoshard calibrate --out FILE`` measures), the plan scaling its rates to
   the ranks' one thread (``HardwareProfile.with_threads``). With ``--profile FILE`` the profile is written there, or
   read from it when the file exists (one calibration for several runs).
2. For every S, P and strategy that applies (P = 1: the default; P > 1: ring, zigzag, ulysses, allgather):
   ``autoshard.plan(model on meta, world_size=P, strategy=..., topology=profile, threads=1).step_seconds`` against the
   median over ``--repeat`` steps (after a warm-up step) of the slowest rank of
   ``autoshard.compile(model, strategy=...)`` on P gloo ranks, one thread per rank; with ``--levers`` also the
   default strategy with ``recompute="layers"`` and with ``chunk_mlp=1024`` (recomputation priced again).

Model: transformers ``LlamaForCausalLM`` (vocab 8000, hidden 256, 4 layers, 8 / 2 heads, SwiGLU 688, fp32), forward
+ backward of the causal-LM loss over one sequence of S tokens. ``error`` is predicted / measured - 1; a profile
measured with several threads adds ``unscaled``: the same for the plan priced at the profile's threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist

import autoshard
from autoshard.calibration import calibrate
from autoshard.hardware import load_profile, save_profile
from autoshard.testing import run_on_ranks

try:
    from _common import print_table
except ImportError:  # run as a module
    from benchmarks._common import print_table

VOCAB = 8000
STRATEGIES = ("ring", "zigzag", "ulysses", "allgather")


def _model(device: str = "cpu"):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg).train()


def _calibrate_ranks() -> dict:
    profile = calibrate()
    return dataclasses.asdict(profile) if dist.get_rank() == 0 else {}


def _measure(length: int, options: dict, repeat: int) -> float:
    """Median step seconds on this rank (after a warm-up) of ``autoshard.compile(model, **options)``."""
    model = _model()
    compiled = autoshard.compile(model, **options)
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))

    def step():
        compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _predict(length: int, world: int, options: dict, profile, threads: int = 1) -> tuple[float, str]:
    """The plan's step seconds and strategy for ranks of ``threads`` threads (the measured ranks have one)."""
    model = _model("meta")
    ids = torch.zeros(1, length, dtype=torch.long, device="meta")
    plan = autoshard.plan(model, (), dict(input_ids=ids, labels=ids, use_cache=False), world_size=world,
                          topology=profile, threads=threads, **options)
    return plan.step_seconds, plan.attention[0].strategy


LEVERS = {"recompute": {"recompute": "layers"}, "chunk_mlp": {"chunk_mlp": 1024}}
"""``--levers``: rows with the memory levers on (the default strategy), whose recomputation the prediction prices."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--levers", action="store_true", help=f"also the default strategy with {', '.join(LEVERS)}")
    parser.add_argument("--repeat", type=int, default=3, help="measured steps; the median counts")
    parser.add_argument("--calibrate", choices=("ranks", "process"), default="ranks",
                        help="where the profile is measured: on max(--worlds) ranks of one thread (default), or in "
                             "this process with its default threads, scaled to the ranks' one thread")
    parser.add_argument("--profile", help="the calibrated profile: written when missing, read when present "
                                           "(default: calibrate, keep nothing)")
    args = parser.parse_args()

    if args.profile and os.path.exists(args.profile):
        profile = load_profile(args.profile)
    else:
        start = time.perf_counter()
        if args.calibrate == "process":
            profile = calibrate()
        else:
            profile = autoshard.HardwareProfile(**run_on_ranks(_calibrate_ranks, max(max(args.worlds), 2), threads=1,
                                                        timeout=600)[0])
        print(f"calibrated in {time.perf_counter() - start:.0f} s" + (f" -> {args.profile}" if args.profile else ""))
        if args.profile:
            save_profile(profile, args.profile)
    print(f"profile: {profile}")

    unscaled = profile.threads > 1  # also the plan at the threads the profile was measured with
    rows, errors = [], []
    for length in args.lengths:
        for world in args.worlds:
            runs = {None: {}} if world == 1 else {s: {"strategy": s} for s in args.strategies}
            runs.update({lever: options for lever, options in LEVERS.items() if args.levers})
            for name, options in runs.items():
                predicted, chosen = _predict(length, world, options, profile)
                if "strategy" in options and chosen != options["strategy"]:
                    continue  # the strategy does not apply here (the plan says what runs instead)
                measured = max(run_on_ranks(_measure, world, length, options, args.repeat, threads=1, timeout=7200))
                errors.append(predicted / measured - 1)
                label = chosen if name is None else name if "strategy" in options else f"{chosen}, {name}"
                rows.append([length, world, label, f"{measured:.2f}", f"{predicted:.2f}", f"{errors[-1]:+.1%}"])
                if unscaled:
                    as_measured = _predict(length, world, options, profile, profile.threads)[0]
                    rows[-1].append(f"{as_measured / measured - 1:+.1%}")
                print("  ".join(map(str, rows[-1])), flush=True)
    print_table(f"Step time predicted on {profile.name} against measured (median of {args.repeat})",
                ["S", "P", "run", "measured s", "predicted s", "error"]
                + ([f"unscaled ({profile.threads} threads)"] if unscaled else []), rows)
    if errors:
        print(f"\nmean |error| {statistics.mean(abs(e) for e in errors):.1%}, worst {max(errors, key=abs):+.1%}")


if __name__ == "__main__":
    main()
