"""Shared pieces of the benchmarks: inputs, timed runs on ranks, table printing, the small training model.

Runs happen in rank workers (:func:`autoshard.testing.run_on_ranks`) started with
``MALLOC_MMAP_THRESHOLD_=65536`` so the resident-memory peak (``autoshard.testing.memory``) follows
live tensors. Every figure is a timed forward + backward after a small warm-up call; with repeats, the
runs being compared take turns (so a burst of load elsewhere on the machine hits them alike) and the
fastest repeat counts.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoshard.runtime import SequenceLayout, attention, comm_counter
from autoshard.testing.memory import peak_memory

__all__ = ["one_process", "distributed", "best_of", "print_table", "small_llama", "HEADS", "HEAD_DIM"]

HEADS, HEAD_DIM = 8, 64


def _inputs(length: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, HEADS, length, HEAD_DIM, generator=g) for _ in range(4)]  # q, k, v, dout


def _timed(fn) -> tuple[float, int]:
    """Seconds and peak extra resident bytes of ``fn()``."""
    with peak_memory() as mem:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return seconds, mem.peak_bytes


def one_process(length: int, causal: bool) -> tuple[float, int]:
    """``F.scaled_dot_product_attention`` forward + backward on the whole sequence, in this process."""

    def run(n: int):
        q, k, v, dout = _inputs(n)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        return lambda: F.scaled_dot_product_attention(*leaves, is_causal=causal).backward(dout)

    run(512)()
    return _timed(run(length))


def distributed(strategy: str, layout: str, length: int, causal: bool, peer=None) -> tuple[float, int, int]:
    """One rank's (seconds, bytes sent, peak extra bytes) of a forward + backward of ``strategy`` on this
    rank's shard. ``peer(q, k, v, causal)``: a function to run instead of ours (same inputs)."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def run(n: int):
        lay = SequenceLayout.of(layout, n, world)
        pos = lay.positions(rank)
        q, k, v, dout = (t[:, :, pos].contiguous() for t in _inputs(n))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        if peer is not None:
            return lambda: peer(*leaves, causal).backward(dout)
        return lambda: attention(*leaves, strategy=strategy, layout=layout, causal=causal,
                                 seq_len=n).backward(dout)

    run(1024)()
    step = run(length)
    dist.barrier()
    with comm_counter() as cc:
        seconds, peak = _timed(step)
    sent = cc.payload_bytes_sent
    return seconds, sent, peak


def best_of(repeat: int, runs: dict[str, Callable[[], tuple]]) -> dict[str, tuple]:
    """Each run's result tuple ``(seconds, ...)`` from its fastest of ``repeat`` turns, runs interleaved."""
    best: dict[str, tuple] = {}
    for _ in range(repeat):
        for name, run in runs.items():
            result = run()
            if name not in best or result[0] < best[name][0]:
                best[name] = result
    return best


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    """A plain-text table with right-aligned columns."""
    cells = [columns] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def small_llama():
    """The training benchmarks' model (packed documents, variable lengths): transformers ``LlamaForCausalLM`` from a
    config -- vocab 8000, 4 layers, hidden 256, 8 heads / 2 kv heads, SDPA, float32, seeded random weights."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()
