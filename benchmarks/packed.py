"""Packed documents: a training step's time and each rank's attention work, before and after (tables, no assertions).

    python benchmarks/packed.py                 # S = 16384, P = 2 (a few minutes)
    python benchmarks/packed.py --length 4096   # quicker

Model: transformers ``LlamaForCausalLM`` from a config (vocab 8000, 4 layers, hidden 256, 8 heads / 2 kv heads,
float32, random weights), one row of S tokens packed with documents of log-normal lengths (mean about 1K tokens,
``position_ids`` restarting at each), forward + backward of the causal-LM loss. Runs, side by side in one launch
(each the faster of ``--repeat`` interleaved rounds, after a warm-up step):

* ``one process``: the model uncompiled (transformers' SDPA with the dense packed mask), one thread;
* ``P=2 as before``: ``autoshard.compile(model)`` on 2 gloo ranks, one thread each, with the documents read only as
  a mask (``local.DOCUMENT_BLOCKS = False``, ``dispatch.BALANCE = False``): every pair of one causal sequence is
  computed, as before issue 23;
* ``P=2 documents``: document rectangles only (pairs between documents never computed), queries not dispatched;
* ``P=2 balanced``: documents and the all-gather's dispatch of queries by work (the default).

Columns: ``step`` (the slowest rank), ``speed-up`` over ``as before``, efficiency ``T1 / (P x T_P)``, the attention
FLOPs of the step summed over ranks over the documents' own causal work (``sum/ideal``) and their ``max/mean`` over
ranks (:func:`~autoshard.runtime.attention.flops.attention_flops`), bytes the dispatch sent per rank, peak extra
resident memory of rank 0.

A second table prices the dispatch alone for P = 4 (``--length`` tokens, the same documents' distribution, five
batches): the ranks' work as laid out (contiguous, zigzag) and after it, from
:func:`~autoshard.runtime.attention.dispatch.balance` (no model run).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import autoshard
from autoshard.runtime import SequenceLayout, comm_counter
from autoshard.runtime.attention import attention_flops
from autoshard.runtime.attention import dispatch, local
from autoshard.runtime.attention.masks import MaskSpec
from autoshard.testing import run_on_ranks
from autoshard.testing.memory import LOW_MMAP_THRESHOLD_ENV, peak_memory

try:
    from _common import print_table, small_llama
except ImportError:  # run as a module
    from benchmarks._common import print_table, small_llama

RUNS = {"as before": (False, False), "documents": (True, False), "balanced": (True, True)}
"""Run -> (DOCUMENT_BLOCKS, BALANCE)."""
HEADS, HEAD_DIM = 8, 32


def lengths(total: int, seed: int) -> list[int]:
    """Document lengths of one packed row: log-normal, mean about 1K tokens, 16 to 4096."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    while sum(out) < total:
        out.append(int(torch.empty(1).log_normal_(6.6, 0.7, generator=gen).clamp(16, 4096)))
    out[-1] -= sum(out) - total
    return out


def _inputs(length: int) -> dict:
    ids = torch.randint(0, 8000, (1, length), generator=torch.Generator().manual_seed(length))
    positions = torch.cat([torch.arange(n) for n in lengths(length, 0)])[None]
    return dict(input_ids=ids, labels=ids, position_ids=positions, use_cache=False)


def _step(model, length: int) -> None:
    model(**_inputs(length)).loss.backward()
    model.zero_grad(set_to_none=True)


def _timed(model, length: int) -> tuple[float, int, int, int]:
    """(seconds, attention FLOPs, dispatch bytes sent, peak extra bytes) of one step."""
    with attention_flops() as flops, comm_counter() as sent, peak_memory() as mem:
        start = time.perf_counter()
        _step(model, length)
        seconds = time.perf_counter() - start
    return seconds, flops.total, sent.dispatch_bytes_sent, mem.peak_bytes


def _measure(length: int, repeat: int) -> dict:
    rank = dist.get_rank()
    out: dict[str, tuple] = {}
    models = {}
    for run, (documents, balance) in RUNS.items():
        local.DOCUMENT_BLOCKS, dispatch.BALANCE = documents, balance
        models[run] = autoshard.compile(small_llama())
        _step(models[run], length)  # compiles for this length
    reference = small_llama() if rank == 0 else None
    if rank == 0:
        _step(reference, 1024)  # warm-up
    for _ in range(repeat):
        if rank == 0:
            one = _timed(reference, length)
            out["one process"] = min(out.get("one process", one), one)
        dist.barrier()
        for run, (documents, balance) in RUNS.items():
            local.DOCUMENT_BLOCKS, dispatch.BALANCE = documents, balance
            dist.barrier()
            timed = _timed(models[run], length)
            out[run] = min(out.get(run, timed), timed)
    return out


def _work_table(length: int) -> list[list]:
    rows = []
    spec = MaskSpec.of(True)
    for seed in range(5):
        docs = lengths(length, seed + 1)
        ids = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(docs))[None]
        ideal = sum(n * (n + 1) // 2 for n in docs)
        for kind in ("contiguous", "zigzag"):
            plan = dispatch.balance(SequenceLayout.of(kind, length, 4), ids, spec)
            moved = sum(c.length for c, a in zip(plan.chunks, plan.assignee) if c.owner != a)
            before = max(plan.owner_work) / (sum(plan.owner_work) / 4)
            rows.append([seed, len(docs), kind, f"{sum(plan.work) / ideal:.3f}", f"{before:.2f}",
                         f"{plan.imbalance():.3f}", moved])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds; the fastest counts")
    args = parser.parse_args()
    docs = lengths(args.length, 0)
    ideal = sum(n * (n + 1) // 2 for n in docs) * HEADS * 14 * HEAD_DIM * 4  # 4 layers, forward 4D + backward 10D
    ranks = run_on_ranks(_measure, 2, args.length, args.repeat, timeout=3600, env=LOW_MMAP_THRESHOLD_ENV)
    t1 = ranks[0]["one process"][0]
    before = max(r["as before"][0] for r in ranks)
    rows = [["one process", f"{t1:.2f} s", "", "1.00", "", "", "", f"{ranks[0]['one process'][3] / 2**20:,.0f} MiB"]]
    for run in RUNS:
        step = max(r[run][0] for r in ranks)
        work = [r[run][1] for r in ranks]
        rows.append([f"P=2 {run}", f"{step:.2f} s", f"{before / step:.2f}x", f"{t1 / (2 * step):.2f}",
                     f"{sum(work) / ideal:.2f}", f"{max(work) / (sum(work) / 2):.2f}",
                     f"{max(r[run][2] for r in ranks) / 2**20:,.1f} MiB", f"{ranks[0][run][3] / 2**20:,.0f} MiB"])
    print_table(f"transformers Llama (vocab 8000, 4 layers, hidden 256, 8/2 heads, fp32), S={args.length} packed with "
                f"{len(docs)} documents (mean {args.length // len(docs)} tokens), forward + backward",
                ["run", "step", "speed-up", "T1/(P*TP)", "sum/ideal", "max/mean", "dispatch/rank", "peak rank 0"], rows)
    print_table(f"dispatch alone, P=4, S={args.length}: attention work (visible pairs) per rank",
                ["batch", "documents", "layout", "sum/ideal", "max/mean as laid out", "max/mean dispatched",
                 "positions moved"], _work_table(args.length))


if __name__ == "__main__":
    main()
