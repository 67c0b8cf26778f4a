"""Command line: ``python -m autoshard plan path/to/file.py:factory --world-size 64 --seq-len 1048576``.

``factory(seq_len)`` returns ``(model, args, kwargs)``; put the model and the inputs on the meta device
to plan sizes that do not fit this machine. Prints the plan; ``--json`` / ``--dot`` also write it. With
``--decode``, the plan of a decode step after that prompt (serving: KV cache per rank, bytes per step, memory).
``--hardware h100`` (or a profile file) prices the step on that hardware (:mod:`autoshard.hardware`).

``python -m autoshard calibrate --out FILE`` measures this machine into a profile file; launched on several ranks
(``torchrun --nproc-per-node N -m autoshard calibrate --out FILE``), its collectives too. A CPU profile records the
threads per rank it was measured with; ``plan --threads N`` prices ranks of N threads (default: what torchrun gives
them, one each when several ranks run).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from .config import LAYOUT_CHOICES, STRATEGY_CHOICES
from .calibration import calibrate
from .hardware import hardware, save_profile
from .planner import plan, plan_decode
from .policy import MemoryBudgetError

__all__ = ["main"]


def _load_factory(spec: str):
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise SystemExit(f"autoshard plan: expected path/to/file.py:factory, got {spec!r}")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if module_spec is None:
        raise SystemExit(f"autoshard plan: cannot import {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoshard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the plan of a model on N ranks (a dry run)")
    p.add_argument("factory", help="path/to/file.py:factory, factory(seq_len) -> (model, args, kwargs)")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--strategy", choices=STRATEGY_CHOICES, default="auto")
    p.add_argument("--layout", choices=LAYOUT_CHOICES, default="auto")
    p.add_argument("--outputs", choices=("split", "gathered", "sharded"), default="split")
    p.add_argument("--hardware", default="h100", metavar="NAME_OR_FILE",
                   help="the profile the step is priced on: a100, h100, h200, b200 or a calibrated file (default h100)")
    p.add_argument("--ranks-per-node", type=int, help="override the profile's ranks per node")
    p.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads per rank of the run: a CPU profile's rates, measured with the threads it records, "
                        "scale to them (FLOP/s in proportion, memory bandwidth as the square root; GPU profiles do not "
                        "change); default what torchrun gives: OMP_NUM_THREADS when set, else 1 with several ranks, "
                        "else the profile's own")
    p.add_argument("--memory-budget", type=float, metavar="GIB",
                   help="per-rank budget in GiB: the memory policy picks recomputation, chunks, tiles and offload to fit it")
    p.add_argument("--host-budget", type=float, metavar="GIB",
                   help="per-rank host memory in GiB that offloaded layer inputs may take (default: no limit)")
    p.add_argument("--recompute", choices=("none", "layers"), default="none")
    p.add_argument("--chunk-mlp", type=int, metavar="TOKENS", help="tokens per chunk of the MLPs (default: off)")
    p.add_argument("--tile-tokens", type=int, metavar="TOKENS",
                   help="tokens per tile of the token-local regions: norms, projections, MLP (default: off)")
    p.add_argument("--head-chunks", type=int, default=1, metavar="GROUPS",
                   help="head groups every attention runs one at a time (default 1: all heads at once)")
    p.add_argument("--chunk-loss", type=int, default=1024, metavar="TOKENS",
                   help="tokens per chunk of the LM head + loss (0: off)")
    p.add_argument("--no-lazy-logits", action="store_true",
                   help="lazy_logits=False: returned logits computed in the graph (default: when first read)")
    p.add_argument("--offload", action="store_true", help="keep checkpointed layers' inputs in host memory")
    p.add_argument("--no-offload-prefetch", dest="offload_prefetch", action="store_false",
                   help="with --offload: bring each layer's input back when backward uses it, not prefetched")
    p.add_argument("--offload-spared", type=int, default=0, metavar="REGIONS",
                   help="with --offload: regions whose inputs the host does not keep, from the last back (the last "
                        "stays on the device, every other one before it is rebuilt in backward; default 0)")
    p.add_argument("--dp-shard", type=int, default=1, metavar="RANKS",
                   help="ranks FSDP2 shards parameters, gradients and optimizer states over (dp x sp; 1: no FSDP)")
    p.add_argument("--optimizer", choices=("adamw", "adam"), help="count the optimizer's states")
    p.add_argument("--no-grad-sync", action="store_true",
                   help="grad_sync=False: leave the gradients' sum to FSDP2 / DDP (what to run under them)")
    p.add_argument("--rank", type=int, default=0, help="the rank whose view the plan shows")
    p.add_argument("--decode", action="store_true",
                   help="plan the decode step after a --seq-len-token prompt (autoshard.plan_decode) instead")
    p.add_argument("--json", help="also write the plan as JSON to this file")
    p.add_argument("--dot", help="also write the graph, coloured by placement, as Graphviz to this file")
    c = sub.add_parser("calibrate", help="measure this machine (and, launched on several ranks, its collectives) "
                                         "into a hardware profile file; a CPU's with this process's threads "
                                         "(OMP_NUM_THREADS sets them), which the file records")
    c.add_argument("--out", required=True, help="the JSON profile to write")
    c.add_argument("--tokens", type=int, default=4096, help="tokens of the products and attention measured")
    args = parser.parse_args(argv)
    if args.command == "calibrate":
        return _calibrate(args.out, args.tokens)

    model, model_args, model_kwargs = _load_factory(args.factory)(args.seq_len)
    if args.decode:
        print(plan_decode(model, model_args, model_kwargs, world_size=args.world_size, rank=args.rank,
                          layout="zigzag" if args.layout == "auto" else args.layout))
        return 0
    budget = int(args.memory_budget * 2**30) if args.memory_budget is not None else None
    try:
        topology = hardware(args.hardware)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.ranks_per_node is not None:
        topology = dataclasses.replace(topology, ranks_per_node=args.ranks_per_node)
    try:
        result = plan(model, model_args, model_kwargs, world_size=args.world_size, strategy=args.strategy,
                      layout=args.layout, outputs=args.outputs, topology=topology,
                      threads=args.threads, rank=args.rank, memory_budget=budget,
                      host_budget=int(args.host_budget * 2**30) if args.host_budget is not None else None,
                      recompute=args.recompute, chunk_mlp=args.chunk_mlp,
                      tile_tokens=args.tile_tokens, head_chunks=args.head_chunks,
                      chunk_loss=args.chunk_loss or None, offload=args.offload,
                      offload_prefetch=args.offload_prefetch, offload_spared=args.offload_spared,
                      dp_shard=args.dp_shard,
                      optimizer=args.optimizer, grad_sync=not args.no_grad_sync,
                      lazy_logits=not args.no_lazy_logits)
    except MemoryBudgetError as e:  # the plan's answer, not a crash: which budget would do, and what is left
        print(e, file=sys.stderr)
        return 1
    print(result)
    if args.json:
        Path(args.json).write_text(result.to_json())
    if args.dot:
        Path(args.dot).write_text(result.to_dot())
    return 0


def _calibrate(out: str, tokens: int) -> int:
    """``calibrate``: on the ranks ``torchrun`` launched (a process group over them) or alone."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    try:
        profile = calibrate(tokens=tokens)
    finally:
        if launched:
            dist.destroy_process_group()
    if not launched or int(os.environ["RANK"]) == 0:
        save_profile(profile, out)
        print("\n".join(f"{f.name}: {getattr(profile, f.name)}" for f in dataclasses.fields(profile)))
        print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
