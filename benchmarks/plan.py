"""The planner's predictions against measurements, and its own cost (tables, no assertions).

    python benchmarks/plan.py            # both tables (S = 8192 and 16384)
    python benchmarks/plan.py --quick    # smaller sizes (S = 2048 and 4096; the 8B plan at 65,536 tokens)

1. memory: the plan's predicted per-rank peak of one forward + backward against the peak measured on real
   ranks (gloo on the CPU, float32), for the model of ``benchmarks/memory.py`` (a transformers
   ``LlamaForCausalLM`` from its config: vocabulary 32000, hidden 256, 4 layers, 8 query / 2 key-value heads,
   returning its loss only) on P = 2 and 4 ranks, in four configurations:

   * ``plain``: ``chunk_loss=None`` (each rank holds its ``[S/P, 32000]`` logits, their log-softmax and their
     gradient);
   * ``checkpointed``: the same with transformers' gradient checkpointing (non-reentrant): the layers are
     recomputed one at a time in backward;
   * ``chunked``: the default ``chunk_loss`` (the LM head + loss a chunk of tokens at a time);
   * ``fsdp2``: ``chunked`` with FSDP2 (``fully_shard`` on every layer, then the root) over the same ranks
     (``grad_sync=False``), planned with ``dp_shard=P``;
   * ``levers``: ``chunked`` with every layer recomputed, its token-local regions tiled (``tile_tokens=2048``) and
     its attention in 2 head groups (``head_chunks=2``).

   Measured: the peak resident set of each rank's process during the second step (the first compiles), above
   what was resident before it (``autoshard.testing.memory.peak_memory``, workers with
   ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave the resident set at once), plus the parameters (or
   the rank's FSDP2 shards of them) that were resident before it, as the plan counts them. The table shows the
   largest rank's.
2. the plan of a 32-layer, hidden 4096, 32/8-head Llama shape at 1,048,576 tokens on 64 ranks (meta
   device): wall time and peak resident memory of ``python -m autoshard plan`` (targets: 30 s, 2 GiB).

Measured (2 shared CPU cores, torch 2.13 CPU, transformers 5.x; ``python benchmarks/plan.py``, 40 minutes)::

   config             S  P  predicted MiB  measured MiB  ratio   peak (plan)
   plain           8192  2         1982.7        1982.5  1.000   g0 backward: aten._log_softmax_backward_data.default
   checkpointed    8192  2         1606.1        1606.0  1.000   g1 backward: aten._log_softmax_backward_data.default
   chunked         8192  2          732.7         732.5  1.000   g0 forward: autoshard.linear_cross_entropy.default
   fsdp2           8192  2          760.4         763.2  0.996   g0 forward: autoshard.linear_cross_entropy.default
   plain          16384  2         3888.4        3888.1  1.000   g0 backward: aten._log_softmax_backward_data.default
   checkpointed   16384  2         3135.2        3134.9  1.000   g1 backward: aten._log_softmax_backward_data.default
   chunked        16384  2         1138.4        1138.4  1.000   g0 forward: autoshard.linear_cross_entropy.default
   fsdp2          16384  2         1166.1        1172.7  0.994   g0 forward: autoshard.linear_cross_entropy.default
   plain           8192  4         1029.8        1029.9  1.000   g0 backward: aten._log_softmax_backward_data.default
   checkpointed    8192  4          841.5         841.2  1.000   g1 backward: aten._log_softmax_backward_data.default
   chunked         8192  4          529.9         529.9  1.000   g0 forward: autoshard.linear_cross_entropy.default
   fsdp2           8192  4          538.2         540.4  0.996   g0 forward: autoshard.linear_cross_entropy.default
   plain          16384  4         1982.7        1982.5  1.000   g0 backward: aten._log_softmax_backward_data.default
   checkpointed   16384  4         1606.1        1606.2  1.000   g1 backward: aten._log_softmax_backward_data.default
   chunked        16384  4          732.7         732.5  1.000   g0 forward: autoshard.linear_cross_entropy.default
   fsdp2          16384  4          741.1         744.4  0.996   g0 forward: autoshard.linear_cross_entropy.default
   8B plan at 1,048,576 tokens on 64 ranks: wall 23.2 s, peak resident 0.52 GiB
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.memory import LOW_MMAP_THRESHOLD_ENV, peak_memory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import VOCAB, _model as loss_only_llama  # noqa: E402  (benchmarks/memory.py's model)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("plain", "checkpointed", "chunked", "fsdp2", "levers")
LEVERS = {"recompute": "layers", "tile_tokens": 2048, "head_chunks": 2}
"""The ``levers`` configuration's backend options: every layer recomputed, its token-local regions in tiles of 2048
tokens, its attention in 2 head groups."""
TARGET = 0.15
"""The largest relative difference of predicted from measured the plan aims at."""


def _model(config: str) -> torch.nn.Module:
    model = loss_only_llama()
    if config == "checkpointed":
        model.llama.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _options(config: str) -> dict:
    """The backend options of a configuration."""
    if config in ("plain", "checkpointed"):
        return {"chunk_loss": None}
    return {"grad_sync": False} if config == "fsdp2" else LEVERS if config == "levers" else {}


def measured_peak(config: str, seq_len: int) -> int:
    """Peak resident bytes of one forward + backward of the compiled model on this rank (see the docstring)."""
    model = _model(config)
    if config == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.llama.model.layers:
            fully_shard(layer)
        fully_shard(model)
    ids = torch.randint(0, VOCAB, (1, seq_len))
    compiled = torch.compile(model, backend=autoshard.backend(**_options(config)), dynamic=False)
    compiled(ids, ids).backward()  # compile, warm up
    model.zero_grad(set_to_none=True)
    with peak_memory() as measured:
        loss = compiled(ids, ids)
        loss.backward()
    resident = sum((p.to_local() if hasattr(p, "to_local") else p).untyped_storage().nbytes()
                   for p in model.parameters())
    return measured.peak_bytes + resident


def predicted(config: str, seq_len: int, world: int) -> autoshard.Plan:
    torch._dynamo.reset()
    with torch.device("meta"):
        model = _model(config)
        ids = torch.randint(0, VOCAB, (1, seq_len))
    return autoshard.plan(model, (ids, ids), world_size=world, dp_shard=world if config == "fsdp2" else 1,
                          **_options(config))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per measured run")
    parser.add_argument("--configs", nargs="*", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--lengths", type=int, nargs="*", help="sequence lengths (default 8192 16384)")
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4], help="ranks")
    parser.add_argument("--no-8b", action="store_true", help="skip the 8B plan")
    opts = parser.parse_args()
    lengths = opts.lengths or ((2048, 4096) if opts.quick else (8192, 16384))

    print("\n1. per-rank peak memory of forward + backward, transformers Llama (hidden 256, 4 layers, vocabulary "
          "32000), float32, CPU")
    header = (f"   {'config':<13} {'S':>6} {'P':>2} {'predicted MiB':>14} {'measured MiB':>13} {'ratio':>6}   "
              "peak (plan)")
    print(header)
    worst = 0.0
    for world in opts.worlds:
        for seq in lengths:
            for config in opts.configs:
                plan = predicted(config, seq, world)
                measured = max(run_on_ranks(measured_peak, world, config, seq, timeout=opts.timeout,
                                            env=LOW_MMAP_THRESHOLD_ENV))
                ratio = plan.memory_per_rank.total / measured
                worst = max(worst, abs(ratio - 1))
                print(f"   {config:<13} {seq:>6} {world:>2} {plan.memory_per_rank.total / 2**20:>14.1f} "
                      f"{measured / 2**20:>13.1f} {ratio:>6.3f}   {plan.memory_per_rank.peak_at}", flush=True)
    print(f"   largest difference {worst:.1%} (target: within {TARGET:.0%})")
    if opts.no_8b:
        return

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
