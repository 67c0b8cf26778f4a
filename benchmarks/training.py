"""A training step's memory with activation checkpointing: P=2 vs one process (tables, no assertions).

    python benchmarks/training.py                  # S = 8192 and 16384
    python benchmarks/training.py --lengths 2048   # quicker

Model: transformers ``LlamaForCausalLM`` from a config (vocab 32000, 4 layers, hidden 256, 8 heads / 2 kv
heads, SwiGLU 688, float32, random weights), ``gradient_checkpointing_enable()``, one sequence of S tokens
with labels: forward + backward of the loss. Figures per S:

* ``one process``: the model uncompiled on one process, checkpointed;
* ``P=2 whole <outputs>``: the model compiled with ``autoshard.backend(outputs=...)`` on 2 gloo ranks,
  checkpointed layers rewritten and still checkpointed (the report's recomputed regions are counted);
  ``gathered`` all-gathers the ``[1, S, 32000]`` logits onto every rank, ``split`` (the default) returns
  them as a SplitTensor that nothing gathers here;
* ``P=2 per-block split``: every decoder layer compiled on its own (``layer.compile(backend=...)``), the
  rest eager: the layers pass their outputs on split; the final norm, LM head and loss run whole. Checkpointed by
  autoshard (``recompute="layers"``: each layer graph recomputed whole), not by transformers: its checkpoint runs
  the layer inside ``torch.utils.checkpoint``, where dynamo is disabled, so a layer compiled on its own would run
  uncompiled;
* ``packed``: the recipe long-context users run -- the sequence packed with documents of about 1K tokens
  (``position_ids`` restarting at each), FSDP2 (``fully_shard``) on every layer and the root over both ranks,
  ``autoshard.compile(model, grad_sync=False)``; FSDP2 cuts the model into one graph per layer and the mask
  reaches each layer graph as its recipe (``one process packed`` is its baseline);
* ``attention``: how the attention of the step's graphs ran (the strategies, or ``gathered-kv`` / ``whole``);
* ``peak/rank``: peak extra resident memory of the step (the larger of the two ranks), and its ratio to one
  process; ``sent/rank``: bytes each rank sends in the step (recomputation included), ``recomputed``: of
  those, what backward's recomputation of the checkpointed layers sends again.

Every run happens in the rank workers, one after the other (the one-process run on rank 0 while rank 1
waits), each after a warm-up step at a short length, with ``MALLOC_MMAP_THRESHOLD_=65536`` so resident
memory follows live tensors.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import autoshard
from autoshard.runtime import comm_counter
from autoshard.testing import run_on_ranks
from autoshard.testing.memory import LOW_MMAP_THRESHOLD_ENV, peak_memory

try:
    from _common import print_table
except ImportError:  # run as a module
    from benchmarks._common import print_table

RUNS = ("whole gathered", "whole split", "per-block split", "FSDP2 packed")
LAYERS = 4
DOCUMENT = 1024
"""Tokens per packed document."""


def _model(checkpointing: bool = True):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=LAYERS,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32768)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _step(model, length: int, packed: bool = False) -> None:
    ids = torch.randint(0, 32000, (1, length), generator=torch.Generator().manual_seed(length))
    extra = {"position_ids": (torch.arange(length) % DOCUMENT)[None]} if packed else {}
    model(input_ids=ids, labels=ids, use_cache=False, **extra).loss.backward()
    model.zero_grad(set_to_none=True)


def _attention(reports) -> str:
    """How the attention of ``reports`` ran: each strategy and how many calls."""
    strategies = [a["strategy"] for r in reports for a in r.attention]
    return ", ".join(f"{strategies.count(k)} {k}" for k in sorted(set(strategies))) or "-"


def _measure(lengths: list[int]) -> dict:
    rank = dist.get_rank()
    out = {}
    model = _model()
    for length in lengths:
        for packed in (False, True):
            if rank == 0:
                _step(model, 256, packed)
                with peak_memory() as mem:
                    _step(model, length, packed)
                out[(length, "one process packed" if packed else "one process")] = (mem.peak_bytes, 0, 0, "-")
            dist.barrier()
    for run in RUNS:
        torch._dynamo.reset()
        model = _model(checkpointing=not run.startswith("per-block"))
        packed = run.endswith("packed")
        if packed:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            model = autoshard.compile(fully_shard(model), grad_sync=False)
            backend = model.autoshard_backend
        elif run.startswith("per-block"):
            backend = autoshard.backend(outputs="split", recompute="layers")
            for layer in model.model.layers:
                layer.compile(backend=backend)
        else:
            model = autoshard.compile(model, outputs=run.split()[1])
            backend = model.autoshard_backend
        for length in lengths:
            _step(model, 256, packed)
            dist.barrier()
            seen = len(backend.compiled)
            with comm_counter() as sent, peak_memory() as mem:
                _step(model, length, packed)
            reports = [g.report for g in list(backend.compiled)[seen:]]  # the graphs compiled for this length
            out[(length, f"P=2 {run}")] = (mem.peak_bytes, sent.payload_bytes_sent,
                                           sum(sum(r.recomputed.values()) for r in reports), _attention(reports))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    args = parser.parse_args()
    ranks = run_on_ranks(_measure, 2, args.lengths, timeout=3600, env=LOW_MMAP_THRESHOLD_ENV)
    rows = []
    for length in args.lengths:
        for name in ("one process", "one process packed", *(f"P=2 {run}" for run in RUNS)):
            base = ranks[0][(length, "one process packed" if name.endswith("packed") else "one process")][0]
            peak = max(r[(length, name)][0] for r in ranks if (length, name) in r)
            sent = max(r[(length, name)][1] for r in ranks if (length, name) in r)
            again = max(r[(length, name)][2] for r in ranks if (length, name) in r)
            rows.append([length, name, f"{peak / 2**20:,.0f} MiB", f"{peak / base:.2f}",
                         f"{sent / 2**20:,.1f} MiB", f"{again / 2**20:,.1f} MiB", ranks[0][(length, name)][3]])
    print_table("transformers Llama (vocab 32000, 4 layers, hidden 256, 8/2 heads, fp32), activation checkpointing, "
                f"forward + backward; packed: documents of {DOCUMENT} tokens",
                ["S", "run", "peak/rank", "vs one process", "sent/rank", "recomputed", "attention"], rows)


if __name__ == "__main__":
    main()
