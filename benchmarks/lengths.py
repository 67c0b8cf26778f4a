"""Variable sequence lengths: compilations and time per token of a training loop whose packed length changes
every step, against the same loop at one length (a table, no assertions).

    python benchmarks/lengths.py                     # 2900-4096 and 12000-16384 tokens, P = 2 and 4 (long)
    python benchmarks/lengths.py --ranges 2900-4096 --worlds 2 --steps 6     # quicker
    python benchmarks/lengths.py --ranges 2900-4096 --worlds 2 --fsdp        # the README's FSDP2 recipe

Model: transformers ``LlamaForCausalLM`` from a config (vocab 8000, 4 layers, hidden 256, 8 heads / 2 kv heads,
float32, random weights), ``autoshard.compile(model)`` on P gloo ranks (one thread each), one row per step packed
with documents of 200-900 tokens (``position_ids`` restarting at each, as transformers'
``DataCollatorWithFlattening`` makes them), forward + backward of the causal-LM loss and an SGD step. Two loops in
one launch, each after a warm-up step at its first length:

* ``varying``: ``--steps`` steps, each at a new length drawn from the range (what a padding-free fine-tuning run
  sees: every micro-batch a different total length);
* ``fixed``: the same number of steps at the range's top length (the same documents' distribution).

The varying loop runs twice: compiled once per length (``length_classes=False``) and once per length class
(``length_classes=True``).

Columns: the compilations the backend counted (the warm-up's included; dynamo keeps a graph's dynamic sizes from
one loop to the next, so a loop after the first may start with the dynamic graph), tokens,
seconds, milliseconds per 1K tokens, and ``varying / fixed`` of the time per token -- the price of a new length.
Issue 37's goal: at most 3 compilations for 12 lengths, ``varying / fixed`` <= 1.10.

Measured (2 shared CPU cores, torch 2.13 CPU; ``--ranges 2900-4096 --worlds 2,4``, ``--ranges 12000-16384 --worlds
2`` and ``--worlds 4``, separate runs of 8310ca7 on a quiet machine; noise is +-15% on a busy one, where the same
runs measured 1.16 at 2900-4096 on 4 ranks and 1.20 at 12000-16384 on 2)::

        lengths  P                 loop  compilations  tokens  seconds  ms / 1K tokens  varying / fixed
      2900-4096  2  varying, per length            13   40928     13.0           318.1             1.49
      2900-4096  2     varying, classes             1   40928      9.0           219.2             1.03
      2900-4096  2                fixed             1   49152     10.5           213.6             1.00
      2900-4096  4  varying, per length            13   40928     21.8           533.7             1.79
      2900-4096  4     varying, classes             1   40928     13.2           322.5             1.08
      2900-4096  4                fixed             1   49152     14.6           297.4             1.00
    12000-16384  2  varying, per length            13  178702     37.6           210.4             1.14
    12000-16384  2     varying, classes             1  178702     33.3           186.2             1.01
    12000-16384  2                fixed             1  196608     36.4           185.3             1.00
    12000-16384  4  varying, per length            13  178702     47.2           264.3             1.18
    12000-16384  4     varying, classes             1  178702     39.2           219.3             0.98
    12000-16384  4                fixed             1  196608     43.9           223.3             1.00

(The same loop on one process without autoshard, causal rows, ``12000-16384``: varying / fixed 0.90 -- a varying
row is shorter on average, and attention costs more per token the longer the row.)

``--inputs sharded`` (each rank passes its part of the row, ``autoshard.shard_inputs``; the same machine and commit,
``--ranges 2900-4096 --worlds 2,4``)::

        lengths  P                 loop  compilations  tokens  seconds  ms / 1K tokens  varying / fixed
      2900-4096  2  varying, per length            13   40928     11.8           288.3             1.37
      2900-4096  2     varying, classes             1   40928      8.8           215.9             1.03
      2900-4096  2                fixed             1   49152     10.3           209.7             1.00
      2900-4096  4  varying, per length            13   40928     18.9           462.8             1.56
      2900-4096  4     varying, classes             1   40928     13.4           327.5             1.10
      2900-4096  4                fixed             1   49152     14.6           297.6             1.00

``--fsdp`` (the README's training recipe: transformers' checkpointing, FSDP2 per decoder layer and root, so the model
runs as 7 graphs, the rotary tables and the mask handed to the layer graphs uncomputed; ``--ranges 2900-4096 --worlds
2``; before this recipe's classes the per-length loop is what every loop did, and past 8 lengths dynamo's recompile
limit left layer frames uncompiled)::

        lengths  P                 loop  compilations  tokens  seconds  ms / 1K tokens  varying / fixed
      2900-4096  2  varying, per length            73   40928     45.1          1102.9             0.94
      2900-4096  2     varying, classes             4   40928     44.0          1074.5             0.92
      2900-4096  2                fixed             0   49152     57.5          1169.7             1.00

(The fixed loop runs at the range's top length, where attention costs more per token; a loop after the first reuses
the graphs dynamo kept: 0 and 4 compilations there, 7 graphs twice each in a fresh process.)

"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.data import packed_row

try:
    from _common import print_table, small_llama
except ImportError:  # run as a module
    from benchmarks._common import print_table, small_llama


def _batch(length: int, seed: int) -> dict:
    """One packed row of ``length`` tokens: documents of 200-900 tokens, positions restarting at each."""
    return packed_row(length, (200, 900), 8000, torch.Generator().manual_seed(seed))


def _loop(lengths: list[int], seed: int, classes: bool, inputs: str, fsdp: bool) -> tuple[int, float, int]:
    """(compilations, the warm-up's included; seconds and tokens of the steps after the first, a warm-up) at
    ``lengths``; ``classes``: the backend's ``length_classes``; ``inputs``: its ``inputs`` (``"sharded"``: each
    rank passes its part of the row, ``autoshard.shard_inputs``); ``fsdp``: the README's recipe (transformers'
    checkpointing, FSDP2 on every decoder layer and the root)."""
    from torch.distributed.fsdp import fully_shard

    model = small_llama()
    if fsdp:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    compiled = autoshard.compile(model, length_classes=classes, inputs=inputs, grad_sync=not fsdp)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(length: int, i: int) -> None:
        batch = _batch(length, seed + i)
        compiled(**(autoshard.shard_inputs(batch) if inputs == "sharded" else batch)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(lengths[0], 0)
    dist.barrier()
    start = time.perf_counter()
    for i, length in enumerate(lengths[1:], 1):
        step(length, i)
    dist.barrier()
    seconds = time.perf_counter() - start
    return sum(compiled.autoshard_backend.compilations.values()), seconds, sum(lengths[1:])


def _measure(low: int, high: int, steps: int, inputs: str, fsdp: bool) -> dict:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(low)
    varying = [high] + [int(torch.randint(low, high + 1, (1,), generator=gen)) for _ in range(steps)]
    return {"varying, per length": _loop(varying, 0, False, inputs, fsdp),
            "varying, classes": _loop(varying, 0, True, inputs, fsdp),
            "fixed": _loop([high] * (steps + 1), 0, True, inputs, fsdp)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranges", default="2900-4096,12000-16384", help="comma-separated low-high token ranges")
    parser.add_argument("--worlds", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per loop (new lengths in 'varying')")
    parser.add_argument("--inputs", default="replicated", choices=("replicated", "sharded"),
                        help="the backend's inputs: whole rows on every rank, or each rank's part (shard_inputs)")
    parser.add_argument("--fsdp", action="store_true",
                        help="the README's recipe: transformers' checkpointing, FSDP2 per decoder layer and root")
    args = parser.parse_args()
    rows = []
    for text in args.ranges.split(","):
        low, high = (int(x) for x in text.split("-"))
        for world in (int(w) for w in args.worlds.split(",")):
            result = run_on_ranks(_measure, world, low, high, args.steps, args.inputs, args.fsdp, timeout=3600)[0]
            per_token = {run: seconds / tokens for run, (_, seconds, tokens) in result.items()}
            for run, (compilations, seconds, tokens) in result.items():
                rows.append([f"{low}-{high}", world, run, compilations, tokens, f"{seconds:.1f}",
                             f"{1e3 * per_token[run] * 1e3:.1f}",
                             f"{per_token[run] / per_token['fixed']:.2f}"])
    print_table(f"{args.steps} training steps per loop, transformers Llama (4 layers, hidden 256), CPU gloo, "
                f"inputs={args.inputs}" + (", FSDP2 + checkpointing" if args.fsdp else ""),
                ["lengths", "P", "loop", "compilations", "tokens", "seconds", "ms / 1K tokens", "varying / fixed"],
                rows)


if __name__ == "__main__":
    main()
