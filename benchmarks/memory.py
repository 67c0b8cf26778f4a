"""Per-rank peak memory of a training step: one process vs P=2, chunked loss, and the memory policy.

    python benchmarks/memory.py                  # S = 8192 and 16384
    python benchmarks/memory.py --seq 4096       # what a small machine can run
    python benchmarks/memory.py --cap 3          # the longest S whose step fits 3 GiB per rank, each way
    python benchmarks/memory.py --model moe      # a mixture-of-experts model (Qwen3-MoE) instead
    python benchmarks/memory.py --model hybrid   # linear attention + attention + experts (Qwen3-Next)
    python benchmarks/memory.py --model jamba    # Mamba (1) + attention + experts (Jamba)

A transformers Llama from a config (vocabulary 32000, hidden 256, 4 layers, 8 query / 2 key-value heads,
float32, CPU): forward + backward of the loss at S tokens, batch 1. The step is the base model, the
``lm_head`` and transformers' own ``ForCausalLMLoss`` (``logits.float()``, labels padded and shifted,
``cross_entropy``) returning the loss only: ``LlamaForCausalLM.forward`` also returns the logits, and a
value the caller gets cannot be chunked away. ``--model moe``: transformers' Qwen3-MoE of the same sizes, every
layer's MLP 8 experts of width 256 with 2 per token (its default ``grouped_mm`` experts), loss only (no router
loss). ``--model hybrid``: transformers' Qwen3-Next of the same sizes, three Gated DeltaNet layers (8 value / 4 key
heads of 32, transformers' chunked torch form of the rule, split by state passing) and one attention layer, the
experts of ``moe`` and a shared expert. ``--model jamba``: transformers' Jamba of the same sizes, Mamba (1) layers
(state 16, expand 2, transformers' selective scan position by position, split by state passing) and attention
layers alternating, the experts of ``moe`` in every other layer.

* ``one process``: the plain model, uncompiled (autoshard compiles nothing on one rank);
* ``P=2, whole loss``: compiled over 2 gloo ranks with ``chunk_loss=None``: each rank holds its
  ``[S/2, 32000]`` logits, their float32 log-softmax (saved for backward) and their gradient;
* ``P=2, chunked``: the default ``chunk_loss`` (1024 tokens per chunk);
* ``P=2, policy``: ``memory_budget=--budget`` (default 512 MiB): the memory policy (:mod:`autoshard.policy`)
  takes the cheapest of MLP chunking, tiles of the token-local regions, attention in head groups, layer
  recomputation (and offload: a no-op on CPU, where the layers' inputs already are in host memory) whose plan
  fits; the ``levers`` column says what it chose.

``--cap GIB`` instead doubles S from ``--start`` (4096) for each way of running (``--ways``: all) until the step's
measured peak per rank exceeds the cap (the policy run gets the cap as its budget), and prints the longest S that
fit.

Memory is the operating system's: the peak resident set of each rank's process during the step, above
what was resident before it (``autoshard.testing.memory.peak_memory``: ``VmHWM`` reset through
``/proc/self/clear_refs``), in workers started with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors
leave the resident set at once. It counts every byte torch allocates (tracemalloc would see none of
them); the step runs once first (compiling, warming up), then the parameters' gradients are
cleared, so the figure is the step's activations, gradients and temporaries. ``logits`` is the size of
one rank's float32 ``[tokens, V]`` logits, for scale. Times are printed for information only.

Measured (2 shared CPU cores, torch 2.13 CPU, transformers 5.24; ``--budget 0.5``)::

         S  run               peak/rank  x one  step s  levers
      8192  one process          3811 MiB   1.00    30.9  -
      8192  P=2, whole loss      1905 MiB   0.50    14.6  -
      8192  P=2, chunked          656 MiB   0.17     8.0  chunk_loss
      8192  P=2, policy           399 MiB   0.10     8.4  chunk_loss; chunk_mlp=1024
     16384  one process          7623 MiB   1.00    40.8  -
     16384  P=2, whole loss      3811 MiB   0.50    29.4  -
     16384  P=2, chunked         1061 MiB   0.14    31.6  chunk_loss
     16384  P=2, policy           326 MiB   0.04    40.1  chunk_loss; recompute='layers'

``--model hybrid --seq 4096 --ways "one process" "P=2, whole loss" "P=2, chunked"`` (Qwen3-Next: three Gated DeltaNet
layers split by state passing, one attention layer, experts; same machine, transformers 5.25)::

         S  run               peak/rank  x one  step s  levers
      4096  one process          2338 MiB   1.00    10.3  -
      4096  P=2, whole loss      1049 MiB   0.45     7.8  -
      4096  P=2, chunked          457 MiB   0.20     7.1  chunk_loss

``--model jamba --seq 1024 --ways "one process" "P=2, whole loss" "P=2, chunked"`` (Jamba: Mamba (1) layers split by
state passing, attention layers, experts; same machine; transformers' selective scan runs position by position and
its backward takes time quadratic in the length it scans, hence the short S and the step times)::

         S  run               peak/rank  x one  step s
      1024  one process           676 MiB   1.00    92.1
      1024  P=2, whole loss       266 MiB   0.39    24.9
      1024  P=2, chunked          208 MiB   0.31    24.6

``--cap 1 --max-seq 32768`` (longest S under 1 GiB per rank): one process < 4096 (4096: 1906 MiB); P=2 whole
loss 4096; P=2 chunked 8192 (16384: 1061 MiB); P=2 policy 32768, the longest tried (849 MiB). With tiles and head
groups in the policy's ladder, ``--cap 1 --ways "P=2, policy" --start 32768 --max-seq 65536``: 771 MiB at 32768,
714 MiB at 65536 (the longest tried).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.multirank import RankFailure
from autoshard.testing.memory import LOW_MMAP_THRESHOLD_ENV, peak_memory

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 32000, 256, 4, 8, 2
EXPERTS, TOP_K = 8, 2


class LossOnly(nn.Module):
    """``LlamaForCausalLM`` up to its loss, returning the loss alone."""

    def __init__(self, llama):
        super().__init__()
        self.llama = llama

    def forward(self, ids, labels):
        h = self.llama.model(input_ids=ids, use_cache=False).last_hidden_state
        logits = self.llama.lm_head(h)
        return self.llama.loss_function(logits, labels, self.llama.config.vocab_size)


def _model(kind: str) -> nn.Module:
    """``llama``, ``moe`` (Qwen3-MoE), ``hybrid`` (Qwen3-Next) or ``jamba``, float32, random weights."""
    import transformers

    sizes = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=65536,
                 attn_implementation="sdpa")
    if kind == "moe":
        cfg, cls = transformers.Qwen3MoeConfig(num_experts=EXPERTS, num_experts_per_tok=TOP_K, head_dim=HIDDEN // HEADS,
                                               moe_intermediate_size=HIDDEN, **sizes), transformers.Qwen3MoeForCausalLM
    elif kind == "jamba":
        cfg = transformers.JambaConfig(
            num_experts=EXPERTS, num_experts_per_tok=TOP_K, attn_layer_period=2, attn_layer_offset=1,
            expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16, mamba_expand=2, **sizes)
        cls = transformers.JambaForCausalLM
    elif kind == "hybrid":
        cfg = transformers.Qwen3NextConfig(
            num_experts=EXPERTS, num_experts_per_tok=TOP_K, head_dim=HIDDEN // HEADS, moe_intermediate_size=HIDDEN,
            shared_expert_intermediate_size=HIDDEN, linear_num_key_heads=KV_HEADS * 2, linear_num_value_heads=HEADS,
            linear_key_head_dim=HIDDEN // HEADS, linear_value_head_dim=HIDDEN // HEADS,
            layer_types=["linear_attention"] * (LAYERS - 1) + ["full_attention"], **sizes)
        cls = transformers.Qwen3NextForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**sizes), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    return LossOnly(cls(cfg)).float()


def step(seq: int, options: dict | None, kind: str = "llama") -> dict:
    """This rank's peak extra resident bytes and seconds of one forward + backward at ``seq`` tokens: the plain
    ``kind`` model (``options`` None) or compiled with the backend ``options``."""
    model = _model(kind)
    ids = torch.randint(0, VOCAB, (1, seq))
    run = model
    backend = None
    if options is not None:
        backend = autoshard.backend(**options)
        run = torch.compile(model, backend=backend, dynamic=False)
    run(ids, ids).backward()  # compile and warm up at this length: the measured step is the second
    model.zero_grad(set_to_none=True)
    with peak_memory() as measured:
        start = time.perf_counter()
        loss = run(ids, ids)
        loss.backward()
        seconds = time.perf_counter() - start
    reports = [g.report for g in backend.compiled] if backend else []
    policies = [r.memory_policy for r in reports if r.memory_policy is not None]
    levers = ("chunk_loss" if sum(r.passes["chunking"].counts["chunked_losses"] for r in reports) else "") + \
        "".join(f"; {p.chosen.describe() if p.chosen else 'nothing fits'}" for p in policies)
    return {"peak": measured.peak_bytes, "seconds": seconds, "loss": float(loss.detach()), "levers": levers or "-"}


def runs(budget: int) -> dict[str, tuple[int, dict | None]]:
    """The ways of running compared: name -> (ranks, backend options or None for the plain model)."""
    return {"one process": (1, None), "P=2, whole loss": (2, {"chunk_loss": None}), "P=2, chunked": (2, {}),
            "P=2, policy": (2, {"memory_budget": budget})}


def measure(seq: int, ranks: int, options: dict | None, timeout: float, kind: str = "llama") -> dict:
    results = run_on_ranks(step, ranks, seq, options, kind, timeout=timeout, env=LOW_MMAP_THRESHOLD_ENV)
    return {**results[0], "peak": max(r["peak"] for r in results), "seconds": max(r["seconds"] for r in results)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="*", default=[8192, 16384], help="sequence lengths")
    parser.add_argument("--budget", type=float, default=0.5, help="memory_budget of the policy run, GiB per rank")
    parser.add_argument("--cap", type=float, help="print the longest S (doubling from 4096) under this GiB per rank")
    parser.add_argument("--max-seq", type=int, default=131072, help="the longest S --cap tries")
    parser.add_argument("--start", type=int, default=4096, help="the first S --cap tries")
    parser.add_argument("--ways", nargs="*", help="the ways of running to measure (default: all)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--model", choices=("llama", "moe", "hybrid", "jamba"), default="llama",
                        help="the model (see above)")
    args = parser.parse_args()
    ways = runs(int((args.cap if args.cap is not None else args.budget) * 2**30))
    ways = {name: way for name, way in ways.items() if args.ways is None or name in args.ways}
    if args.cap is not None:  # the policy's budget is the cap
        print(f"longest S whose step fits {args.cap} GiB per rank (doubling from {args.start}, up to {args.max_seq})")
        for name, (ranks, options) in ways.items():
            seq, fits = args.start, None
            while seq <= args.max_seq:
                try:
                    peak = measure(seq, ranks, options, args.timeout, args.model)["peak"]
                except RankFailure as e:  # the policy's MemoryBudgetError: no option fits the cap
                    print(f"  {name:<16} S={seq:>7}: refused ({str(e).splitlines()[-1][:160]})", flush=True)
                    break
                print(f"  {name:<16} S={seq:>7}: {peak / 2**20:>8.0f} MiB", flush=True)
                if peak > args.cap * 2**30:
                    break
                fits, seq = seq, seq * 2
            print(f"{name:<16} longest S under the cap: {fits or f'< {args.start}'}", flush=True)
        return
    rows = []
    for seq in args.seq:
        one = None
        for name, (ranks, options) in ways.items():
            r = measure(seq, ranks, options, args.timeout, args.model)
            one = one or r["peak"]
            rows.append((seq, name, r["peak"], r["peak"] / one, (seq // ranks) * VOCAB * 4, r["seconds"], r["loss"],
                         r["levers"]))
    header = (f"{'S':>6}  {'run':<16} {'peak/rank':>10} {'x one':>6} {'logits/rank':>12} {'step s':>7} {'loss':>8}  "
              f"levers")
    print(header)
    print("-" * len(header))
    for seq, name, peak, ratio, logits, seconds, loss, levers in rows:
        print(f"{seq:>6}  {name:<16} {peak / 2**20:>6.0f} MiB {ratio:>6.2f} {logits / 2**20:>8.0f} MiB {seconds:>7.1f} "
              f"{loss:>8.4f}  {levers}")


if __name__ == "__main__":
    main()
