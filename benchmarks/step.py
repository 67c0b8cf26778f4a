"""A whole training step against the hand-wired ALST recipe (DeepSpeed Ulysses) and one process (tables, no asserts).

    pip install -c constraints.txt deepspeed        # the peer: benchmark-only, never a dependency of autoshard
    python benchmarks/step.py                       # S = 8192, 16384; P = 2, 4; plus a packed row (tens of minutes)
    python benchmarks/step.py --lengths 4096 --worlds 2 --repeat 1   # quicker

Model: transformers ``LlamaForCausalLM`` from a config (vocab 8000, hidden 256, 4 layers, 8 / 2 heads, SwiGLU 688,
fp32, random weights), forward + backward of the causal-LM loss over one sequence of S tokens; gloo, one thread per
rank. Runs, each the faster of ``--repeat`` interleaved rounds after a warm-up step:

* ``one process``: the model uncompiled, one thread;
* ``ALST (DeepSpeed Ulysses)``: the peer recipe by hand -- DeepSpeed's ``UlyssesSPAttentionHF`` registered with
  transformers (its all-to-all around SDPA), every rank its contiguous S/P tokens with global ``position_ids``,
  labels pre-shifted, the loss as all-reduced (sum, count), the gradients all-reduced;
* ``autoshard``: ``autoshard.compile(model)`` with the defaults (every rank passes the whole sequence); with
  ``--variants`` also Ulysses forced, the loss not chunked, and both.

``packed`` rows: the sequence packed with documents of 1024 tokens (``position_ids`` restarting), the same three
runs. Columns: step (the slowest rank), efficiency ``T1 / (P x TP)``, ``autoshard / peer``, peak extra resident
memory of rank 0 (``MALLOC_MMAP_THRESHOLD_=65536`` so it follows live tensors) and what autoshard's attention ran as.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.memory import LOW_MMAP_THRESHOLD_ENV, peak_memory

try:
    from _common import print_table
except ImportError:  # run as a module
    from benchmarks._common import print_table

VOCAB, DOCUMENT = 8000, 1024
PEER_ENV = {**LOW_MMAP_THRESHOLD_ENV, "AUTOSHARD_BENCH_PEER": "1"}
"""The peer runs in a pool of its own: DeepSpeed replaces transformers' SDPA attention process-wide."""


def _model():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


def _batch(length: int, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    positions = (torch.arange(length) % DOCUMENT if packed else torch.arange(length))[None]
    return ids, positions


def _timed(step) -> tuple[float, int]:
    with peak_memory() as mem:
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
    return seconds, mem.peak_bytes


VARIANTS = {"autoshard, ulysses": {"strategy": "ulysses"}, "autoshard, loss not chunked": {"chunk_loss": None},
            "autoshard, ulysses, loss not chunked": {"strategy": "ulysses", "chunk_loss": None}}
"""``--variants``: autoshard with options other than the defaults, as more rows."""


def _ours(length: int, packed: bool, repeat: int, whole: bool, options: dict | None = None) -> dict:
    """(seconds, peak bytes, attention) of autoshard's step (``options``: :func:`autoshard.compile`'s), or of one
    process's when ``whole``."""
    base = _model()
    model = base if whole else autoshard.compile(base, **(options or {}))

    def step():
        ids, positions = _batch(length, packed)
        model(input_ids=ids, labels=ids, position_ids=positions, use_cache=False).loss.backward()
        base.zero_grad(set_to_none=True)

    if whole and dist.get_rank():
        return {}
    step()
    best = min((_timed(step) for _ in range(repeat)), key=lambda r: r[0])
    attention = "-" if whole else ", ".join(sorted({a["strategy"] for r in model.autoshard_backend.compiled
                                                      for a in r.report.attention}))
    return {"seconds": best[0], "peak": best[1], "attention": attention}


def _peer(length: int, packed: bool, repeat: int) -> dict:
    """The ALST recipe by hand (see the module docstring)."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from torch.distributed.nn.functional import all_reduce

    deepspeed.init_distributed(dist_backend="gloo")
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # the pool's processes serve several runs: undo the previous run's groups and its wrapper around SDPA
    parallel_state_sp._release_sequence_parallel_groups()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation="sdpa",
                                                    sequence_parallel_size=world, micro_batch_size=1,
                                                    seq_length=length, seq_length_is_variable=False)
    local = length // world
    rows = slice(rank * local, (rank + 1) * local)
    params = [p for p in model.parameters() if p.requires_grad]

    def step():
        ids, positions = _batch(length, packed)
        shifted = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
        if packed:
            shifted[:, :-1][positions[:, 1:] == 0] = -100  # a document's first token is not the last one's target
        logits = model(input_ids=ids[:, rows], position_ids=positions[:, rows], use_cache=False).logits
        targets = shifted[:, rows]
        total = all_reduce(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                                           reduction="sum"))
        count = (shifted != -100).sum()
        (total / count).backward()
        for p in params:  # each rank holds P times its share (the all-reduce's backward): average them
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        model.zero_grad(set_to_none=True)

    step()
    best = min((_timed(step) for _ in range(repeat)), key=lambda r: r[0])
    return {"seconds": best[0], "peak": best[1], "attention": "ulysses (DeepSpeed)"}


def _run(fn, world: int, *args, env=LOW_MMAP_THRESHOLD_ENV) -> dict:
    ranks = run_on_ranks(fn, world, *args, threads=1, env=env, timeout=7200)
    ranks = [r for r in ranks if r]
    return {"seconds": max(r["seconds"] for r in ranks), "peak": ranks[0]["peak"], "attention": ranks[0]["attention"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds; the fastest counts")
    parser.add_argument("--variants", action="store_true", help=f"also autoshard with {', '.join(VARIANTS)}")
    args = parser.parse_args()
    cases = [(s, w, False) for s in args.lengths for w in args.worlds] + [(args.lengths[0], 2, True)]
    best: dict = {}
    for _ in range(args.repeat):  # interleaved rounds: a burst of load elsewhere hits every run alike
        for length, world, packed in cases:
            runs = {(length, 1, packed, "one process"): lambda: _run(_ours, 1, length, packed, 1, True),
                    (length, world, packed, "ALST (DeepSpeed Ulysses)"):
                        lambda: _run(_peer, world, length, packed, 1, env=PEER_ENV),
                    (length, world, packed, "autoshard"): lambda: _run(_ours, world, length, packed, 1, False)}
            for name, options in (VARIANTS.items() if args.variants else ()):
                runs[(length, world, packed, name)] = functools.partial(_run, _ours, world, length, packed, 1, False,
                                                                        options)
            for key, run in runs.items():
                if key[1] == 1 and world != min(w for s, w, p in cases if (s, p) == (length, packed)):
                    continue  # one process does not depend on P: once per (S, data) and round
                result = run()
                if key not in best or result["seconds"] < best[key]["seconds"]:
                    best[key] = result
    rows = []
    for length, world, packed in cases:
        one = best[(length, 1, packed, "one process")]
        peer = best[(length, world, packed, "ALST (DeepSpeed Ulysses)")]
        for name in ("one process", "ALST (DeepSpeed Ulysses)", "autoshard", *(VARIANTS if args.variants else ())):
            r = one if name == "one process" else best[(length, world, packed, name)]
            p = 1 if name == "one process" else world
            rows.append([length, world, "packed" if packed else "", name, f"{r['seconds']:.2f} s",
                         f"{one['seconds'] / (p * r['seconds']):.2f}",
                         f"{r['seconds'] / peer['seconds']:.2f}" if name.startswith("autoshard") else "",
                         f"{r['peak'] / 2**20:,.0f} MiB", r["attention"]])
    print_table(f"transformers Llama (vocab {VOCAB}, 4 layers, hidden 256, 8/2 heads, fp32), one training step "
                f"(forward + backward), gloo, 1 thread per rank, fastest of {args.repeat}; load {os.getloadavg()[0]:.1f}",
                ["S", "P", "data", "run", "step", "T1/(P*TP)", "autoshard/peer", "peak rank 0", "attention"], rows)


if __name__ == "__main__":
    main()
