"""Packed documents: a training step's time and each rank's attention work, before and after (tables, no assertions).

    python benchmarks/packed.py                 # S = 16384, P = 2 (a few minutes)
    python benchmarks/packed.py --length 4096   # quicker
    python benchmarks/packed.py --mix long-tail --length 32768   # keys fetched by visibility, P = 2 and 4

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

``--mix long-tail`` measures the all-gather's keys fetched by visibility (:mod:`~autoshard.runtime.attention.
visible_keys`) instead: rows of ``--length`` tokens, each one document of 8K to 16K tokens (or a quarter of the row,
if shorter) among log-normal ones (median about 500 tokens, 16 to 4096), a new row every step (the same rows for
every run). Runs, interleaved: ``one process`` (``autoshard.compile`` on one rank: only the documents' rectangles
computed), then at P = 2 and 4 ``all-gather + dispatch`` (every key all-gathered, queries dispatched by work; as
before, ``visible_keys.FETCH = False``), ``visible keys`` (each rank fetches the keys its queries see, over the
compiled zigzag layout: ``placement.PLACE = False``) and ``placed`` (the default: the documents placed by their
lengths, :mod:`~autoshard.runtime.placement`). Columns: the step (slowest rank, the
fastest of the rounds' mean over the rows), its ratio to the all-gather's, bytes attention's collectives sent per
step (K/V, ids and masks gathered or fetched, dK/dV returned, queries dispatched; busiest rank, mean over the rows)
and their ratio, bytes every collective sent (with the parameters' gradients summed over the ranks), the attention
work's max/mean over ranks, compilations.

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
from autoshard.runtime import placement
from autoshard.runtime.attention import dispatch, local, visible_keys
from autoshard.runtime.attention.masks import MaskSpec
from autoshard.testing import run_on_ranks
from autoshard.testing.data import long_tail, positions_of
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


FETCH_RUNS = {"all-gather + dispatch": (False, False), "visible keys": (True, False), "placed": (True, True)}
"""Run -> (``visible_keys.FETCH``, ``placement.PLACE``)."""
ROWS = 3
"""Rows (packings) of the long-tail mix, one per step."""


def _long_tail_inputs(length: int, row: int) -> dict:
    ids = torch.randint(0, 8000, (1, length), generator=torch.Generator().manual_seed(row))
    return dict(input_ids=ids, labels=ids, position_ids=positions_of(long_tail(length, row)), use_cache=False)


ATTENTION_KINDS = ("all_gather", "reduce_scatter", "key_fetch", "dispatch")
"""The collectives attention makes in this model (the rest: the parameters' gradients summed, the loss's)."""


def _measure_fetch(length: int, repeat: int) -> dict:
    """Per run: (mean step seconds, mean bytes attention sent per step, attention FLOPs of the rows, compilations,
    mean bytes sent per step)."""
    runs = FETCH_RUNS if dist.get_world_size() > 1 else {"one process": (True, True)}
    models = {run: autoshard.compile(small_llama()) for run in runs}
    for run, model in models.items():
        visible_keys.FETCH, placement.PLACE = runs[run]
        model(**_long_tail_inputs(length, 0)).loss.backward()  # compiles
        model.zero_grad(set_to_none=True)
    out: dict[str, tuple] = {}
    for _ in range(repeat):
        for run, model in models.items():
            visible_keys.FETCH, placement.PLACE = runs[run]
            seconds = sent = total = work = 0
            for row in range(1, ROWS + 1):
                dist.barrier()
                with attention_flops() as flops, comm_counter() as comm:
                    start = time.perf_counter()
                    model(**_long_tail_inputs(length, row)).loss.backward()
                    seconds += time.perf_counter() - start
                model.zero_grad(set_to_none=True)
                sent += sum(comm.calls[kind].bytes_sent for kind in ATTENTION_KINDS if kind in comm.calls)
                total, work = total + comm.bytes_sent, work + flops.total
            measured = (seconds / ROWS, sent / ROWS, work, sum(model.autoshard_backend.compilations.values()),
                        total / ROWS)
            out[run] = min(out.get(run, measured), measured)
    return out


def _fetch_table(length: int, repeat: int) -> list[list]:
    one = run_on_ranks(_measure_fetch, 1, length, repeat, timeout=3600, env=LOW_MMAP_THRESHOLD_ENV)[0]["one process"]
    rows = [["one process", "", f"{one[0]:.2f} s", "", "", "", "", "", one[3]]]
    for world in (2, 4):
        ranks = run_on_ranks(_measure_fetch, world, length, repeat, timeout=3600, env=LOW_MMAP_THRESHOLD_ENV)
        base = max(r["all-gather + dispatch"][0] for r in ranks), max(r["all-gather + dispatch"][1] for r in ranks)
        for run in FETCH_RUNS:
            step, sent = max(r[run][0] for r in ranks), max(r[run][1] for r in ranks)
            work = [r[run][2] for r in ranks]
            rows.append([run, world, f"{step:.2f} s", f"{step / base[0]:.2f}", f"{sent / 2**20:,.1f} MiB",
                         f"{sent / base[1]:.2f}", f"{max(r[run][4] for r in ranks) / 2**20:,.1f} MiB",
                         f"{max(work) / (sum(work) / world):.2f}", max(r[run][3] for r in ranks)])
    return rows


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
    parser.add_argument("--mix", choices=("log-normal", "long-tail"), default="log-normal",
                        help="long-tail: the keys fetched by visibility against the all-gather, P = 2 and 4")
    args = parser.parse_args()
    if args.mix == "long-tail":
        lengths_seen = [long_tail(args.length, row) for row in range(1, ROWS + 1)]
        print_table(f"transformers Llama (vocab 8000, 4 layers, hidden 256, 8/2 heads, fp32), rows of {args.length} "
                    f"tokens of the long-tail mix ({', '.join(f'{len(d)} documents, longest {max(d)}' for d in lengths_seen)}), "
                    f"forward + backward, a new row each step",
                    ["run", "P", "step", "vs all-gather", "attention bytes/step", "vs all-gather", "all bytes/step",
                     "work max/mean", "compilations"], _fetch_table(args.length, args.repeat))
        return
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
