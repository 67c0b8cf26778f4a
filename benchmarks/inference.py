"""Generation with a sequence-sharded KV cache: one process against P=2, side by side at long prompts.

    python benchmarks/inference.py                      # prompts of 8192, 16384 and 32768 tokens, 32 new tokens
    python benchmarks/inference.py --seq 4096 --new 16  # what a small machine runs quickly
    python benchmarks/inference.py --prompts 10 --new 8 --range 2048-4096   # new prompt lengths, P=2

A KV-heavy transformers Llama from a config (vocabulary 8000, hidden 256, 4 layers, 8 query and 8 key-value heads
of 32: 8 KiB of cache per token in float32), ``generate()`` greedy from one prompt of S tokens, CPU:

* ``one process``: the plain model, uncompiled, with the machine's 2 threads;
* ``P=2``: ``model.forward = torch.compile(model.forward, backend=autoshard.backend())`` on 2 gloo ranks of one
  thread each, the same prompt on both (:mod:`autoshard.passes.decode`: the prefill split, the cache kept split).

Per run: the prefill (prompt to first token) in seconds, the median latency of the decode steps after it (a
streamer timestamps every token; the first steps, which compile at P=2, fall outside the median), the peak resident
memory the generate adds to the process (``autoshard.testing.memory.peak_memory``, the largest rank's), and the KV
cache bytes the rank holds at the end (the storages of its shards at P=2, with their room to grow in place). Each rank runs one generate at S first (compiling,
warming up), then the measured one; the tokens of both ways are checked equal. Times are for information: the machine
is shared and noisy.

Measured (2 shared CPU cores, torch 2.13 CPU, transformers 5.25, ``python benchmarks/inference.py``)::

         S  run         prefill s decode ms/token peak/rank MiB x one KV/rank MiB x one
      8192  one process      1.74            25.5           194  1.00        64.2  1.00
      8192  P=2              2.09            19.0            84  0.43        34.0  0.53
     16384  one process      6.45            52.5           388  1.00       128.2  1.00
     16384  P=2              6.21            38.0           168  0.43        68.0  0.53
     32768  one process     21.25            91.0           776  1.00       256.2  1.00
     32768  P=2             17.86            43.3           336  0.43       136.0  0.53

``--prompts N``: at P=2, one compiled model serves two warm-up prompts of other lengths, then N prompts of N
different lengths (``varying``), against a second process that serves the same warm-ups and then N prompts of one
length (``fixed``): the compilations of the warm-up + of the measured prompts, the median prefill (and
``varying / fixed``) and the median decode step. Measured the same way::

    prompts                      compilations prefill s x fixed decode ms/token
    fixed 2944-2944 x10              5 +    0      0.66    1.00            16.0
    varying 2120-4007 x10            5 +    0      0.62    0.94            17.9

Nothing compiles after the warm-up: the prefill's length class serves every prompt and one decode graph serves
every step of every prompt (the cache carriers' rule is read at each call). Before (commit 98c8b0a, the same
command): ``6 + 2`` compilations, and the decode steps of new prompts at 36.0 ms/token -- dynamo recompiled the
decode step for every prompt until its recompile limit, then ran it uncompiled, the cache gathered whole.

One process's decode step is dominated by ``DynamicCache``'s ``torch.cat``, which copies the whole cache every
step; at P=2 each rank's shard grows in place in a storage with room (a sixteenth more: the KV column's 0.53), so a
step copies no cache and costs the new token's work, the rank's attention and one gloo all-gather per layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.memory import LOW_MMAP_THRESHOLD_ENV, peak_memory

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 8000, 256, 4, 8, 8


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=1 << 17,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float().eval()


class _Clock:
    """A generate() streamer that timestamps the prompt and every new token."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _cache_bytes(cache) -> int:
    """The bytes of the storages the cache's tensors live in (a rank's shards at P=2, with their room to grow)."""
    storages = {}
    for layer in cache.layers:
        for x in (layer.keys, layer.values):
            storage = getattr(x, "local", x).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run(seq: int, new: int, compiled: bool) -> dict:
    """One rank's figures for a generate of ``new`` tokens from a ``seq``-token prompt."""
    model = _model()
    if compiled:
        model.forward = torch.compile(model.forward, backend=autoshard.backend())
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    model.generate(ids, max_new_tokens=new, do_sample=False)  # compile and warm up at this length
    clock = _Clock()
    with peak_memory() as measured:
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, do_sample=False, streamer=clock, return_dict_in_generate=True)
    steps = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]
    return {"tokens": out.sequences, "prefill": clock.times[1] - start, "decode": statistics.median(steps),
            "peak": measured.peak_bytes, "kv": _cache_bytes(out.past_key_values)}


def prompts(lengths: list[int], warm_up: list[int], new: int) -> dict:
    """One rank's figures for ``generate()`` over prompts of ``lengths`` after warm-up prompts of ``warm_up``, one
    compiled model: the prefill of each measured prompt, the median decode step, and the compilations during the
    warm-up and the measured prompts."""
    model, backend = _model(), autoshard.backend()
    model.forward = torch.compile(model.forward, backend=backend)
    generator = torch.Generator().manual_seed(1)
    for seq in warm_up:
        model.generate(torch.randint(0, VOCAB, (1, seq), generator=generator), max_new_tokens=new, do_sample=False)
    warm = len(backend.compiled)
    prefills, steps = [], []
    for seq in lengths:
        clock = _Clock()
        start = time.perf_counter()
        model.generate(torch.randint(0, VOCAB, (1, seq), generator=generator), max_new_tokens=new, do_sample=False,
                       streamer=clock)
        prefills.append(clock.times[1] - start)
        steps += [b - a for a, b in zip(clock.times[1:], clock.times[2:])]
    return {"warm": warm, "measured": len(backend.compiled) - warm, "prefill": statistics.median(prefills),
            "decode": statistics.median(steps)}


def compare_prompts(count: int, low: int, high: int, new: int, timeout: float) -> None:
    """At P=2: ``count`` prompts of different lengths in ``[low, high]`` against ``count`` prompts of one length
    (their median), both after the same two warm-up prompts: compilations, median prefill and decode step."""
    rng = torch.Generator().manual_seed(3)
    lengths = sorted({int(n) for n in torch.randint(low, high + 1, (4 * count,), generator=rng)})
    order = torch.randperm(len(lengths), generator=rng)[:count + 2]
    chosen = [lengths[i] for i in order]
    warm_up, varying = chosen[:2], chosen[2:]
    fixed = [sorted(varying)[len(varying) // 2]] * count
    print(f"{'prompts':<28} {'compilations':>12} {'prefill s':>9} {'x fixed':>7} {'decode ms/token':>15}")
    rows = {}
    for name, prompt_lengths in (("fixed", fixed), ("varying", varying)):
        results = run_on_ranks(prompts, 2, prompt_lengths, warm_up, new, timeout=timeout, threads=1,
                               env=LOW_MMAP_THRESHOLD_ENV)
        rows[name] = {"prefill": max(r["prefill"] for r in results), "decode": max(r["decode"] for r in results),
                      "warm": results[0]["warm"], "measured": results[0]["measured"]}
    for name, prompt_lengths in (("fixed", fixed), ("varying", varying)):
        r = rows[name]
        label = f"{name} {min(prompt_lengths)}-{max(prompt_lengths)} x{len(prompt_lengths)}"
        print(f"{label:<28} {r['warm']:>5} + {r['measured']:>4} {r['prefill']:>9.2f} "
              f"{r['prefill'] / rows['fixed']['prefill']:>7.2f} {1e3 * r['decode']:>15.1f}", flush=True)


def measure(seq: int, new: int, world: int, timeout: float) -> dict:
    results = run_on_ranks(run, world, seq, new, world > 1, timeout=timeout, threads=2 // world,
                           env=LOW_MMAP_THRESHOLD_ENV)
    return {"tokens": results[0]["tokens"], "prefill": max(r["prefill"] for r in results),
            "decode": max(r["decode"] for r in results), "peak": max(r["peak"] for r in results),
            "kv": max(r["kv"] for r in results)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="*", default=[8192, 16384, 32768], help="prompt lengths")
    parser.add_argument("--new", type=int, default=32, help="new tokens per generate")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--prompts", type=int, default=0,
                        help="instead: this many prompts of different lengths against as many of one length, at P=2")
    parser.add_argument("--range", default="2048-4096", help="with --prompts: low-high prompt lengths")
    args = parser.parse_args()
    if args.prompts:
        low, high = map(int, args.range.split("-"))
        compare_prompts(args.prompts, low, high, args.new, args.timeout)
        return
    mib = 1 << 20
    print(f"{'S':>6}  {'run':<11} {'prefill s':>9} {'decode ms/token':>15} {'peak/rank MiB':>13} {'x one':>5} "
          f"{'KV/rank MiB':>11} {'x one':>5}")
    for seq in args.seq:
        one = measure(seq, args.new, 1, args.timeout)
        two = measure(seq, args.new, 2, args.timeout)
        if not torch.equal(one["tokens"], two["tokens"]):
            raise SystemExit(f"S={seq}: the tokens of P=2 differ from one process's")
        for name, r in (("one process", one), ("P=2", two)):
            print(f"{seq:>6}  {name:<11} {r['prefill']:>9.2f} {1e3 * r['decode']:>15.1f} {r['peak'] / mib:>13.0f} "
                  f"{r['peak'] / one['peak']:>5.2f} {r['kv'] / mib:>11.1f} {r['kv'] / one['kv']:>5.2f}", flush=True)


if __name__ == "__main__":
    main()
