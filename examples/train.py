"""Train a transformers Llama with sequence parallelism: the training loop a user copies.

    python examples/train.py --check                       # spawns 4 CPU ranks (gloo): (dp=2, sp=2)
    torchrun --nproc-per-node 4 examples/train.py --check
    torchrun --nproc-per-node 8 examples/train.py --dp 2 --seq-len 65536 --steps 100   # GPUs, unchanged

What it does, per step: a global batch of packed synthetic documents (several documents per sequence,
``position_ids`` restarting at each one, so attention stays inside each document; the first token of every
document is not a target), split over ``dp`` groups of ``sp`` ranks each (a ``(dp, sp)`` device mesh);
every rank of a dp group passes the same sequences, and autoshard splits them over the ``sp`` ranks.

* The model: ``LlamaForCausalLM`` from a config, transformers' activation checkpointing on every decoder layer,
  FSDP2 (``fully_shard``) over all ``dp x sp`` ranks, then ``autoshard.compile(model, mesh["sp"],
  grad_sync=False)`` (``torch.compile`` with autoshard's backend and the dynamo setting transformers' checkpointed
  layers need, for this model only): FSDP2 reduces the gradients (it averages over its ranks; ``grad_sync=False``
  leaves each rank P times its share, so the average is exact). FSDP2 cuts the model into one graph per layer; the
  mask transformers builds before them (packed documents) reaches every layer graph uncomputed, as its recipe, and
  each layer's attention is distributed on its structure.
* The loss: the mean over the *global* batch's target tokens. Every dp group's loss divides its sum by
  ``num_items_in_batch = global targets / dp`` so that FSDP2's average over the groups is that mean, however
  unevenly the targets fall on the groups.
* Mixed precision: ``torch.autocast`` in bf16 on GPUs (``--autocast on`` forces it on CPU too).
* ``--vary-lengths``: a new sequence length every step (padding-free batches): each graph compiles twice, dynamo's
  first static graph and its length class, and no later length compiles; the compilations are printed at the end
  (with ``--check`` the run fails if one was for a new sequence length).
* Printed at the first step: how every graph's attention runs (``autoshard.explain``), with a warning when one is
  not distributed (``--check`` fails then). Per step: the loss (with ``--check``, one-process training of the same
  model on the same global batch beside it, and the run fails if they differ by more than ``--tolerance``),
  tokens/s, and this rank's peak memory.
"""

from __future__ import annotations

import argparse
import copy
import resource
import sys
import time

import torch
import torch.distributed as dist

import autoshard


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4, help="ranks to spawn without torchrun")
    p.add_argument("--dp", type=int, default=2, help="data-parallel groups; sp = world size / dp")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=253)
    p.add_argument("--vary-lengths", action="store_true",
                   help="a new sequence length every step, up to --seq-len (padding-free batches): compiled once per "
                        "length class, the compilations printed at the end")
    p.add_argument("--batch-per-dp", type=int, default=1, help="sequences per dp group per step")
    p.add_argument("--docs-per-seq", type=int, default=3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--autocast", choices=["auto", "on", "off"], default="auto", help="auto: bf16 on GPUs only")
    p.add_argument("--check", action="store_true", help="train the model on one process too and compare losses")
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest relative loss difference with --check")
    return p.parse_args(argv)


def make_model(args, device):
    import transformers

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max(args.seq_len, 256))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def packed_batch(args, step: int, device):
    """(input_ids, position_ids, labels) of the global batch: ``docs-per-seq`` documents of random lengths
    per sequence, positions restarting at each document, each document's first token not a target."""
    gen = torch.Generator().manual_seed(1000 + step)
    rows = args.dp * args.batch_per_dp
    length = args.seq_len - int(torch.randint(0, args.seq_len // 4, (1,), generator=gen)) if args.vary_lengths \
        else args.seq_len
    ids = torch.randint(0, args.vocab, (rows, length), generator=gen)
    positions = torch.empty_like(ids)
    labels = ids.clone()
    for r in range(rows):
        cuts = torch.randperm(length - 1, generator=gen)[:args.docs_per_seq - 1].add(1).sort().values.tolist()
        for start, stop in zip([0, *cuts], [*cuts, length]):
            positions[r, start:stop] = torch.arange(stop - start)
            labels[r, start] = -100
    return ids.to(device), positions.to(device), labels.to(device)


def targets(labels: torch.Tensor) -> int:
    """Target tokens of a batch as transformers' causal-LM loss counts them (labels shifted by one)."""
    return int((labels[:, 1:] != -100).sum())


def peak_memory(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def report_attention(compiled, rank: int) -> int:
    """Print (rank 0) how every compiled graph's attention runs; warn about attention that is not distributed.
    Returns how many are not."""
    records = compiled.autoshard_backend.compiled
    undistributed = [a for r in records for a in r.report.attention if a["strategy"] in ("gathered-kv", "whole")]
    if rank == 0:
        strategies = sorted({a["strategy"] for r in records for a in r.report.attention})
        print(f"attention: {', '.join(strategies) or 'none'} -- autoshard.explain():", flush=True)
        print(autoshard.explain(compiled), flush=True)
    if undistributed:
        print(f"WARNING rank {rank}: attention not distributed: {[a.get('reason') for a in undistributed]}",
              file=sys.stderr, flush=True)
    return len(undistributed)


def main(args) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.dp:
        raise SystemExit(f"--dp {args.dp} does not divide the {world} ranks")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = init_device_mesh(device.type, (args.dp, world // args.dp), mesh_dim_names=("dp", "sp"))
    dp = mesh.get_local_rank("dp")
    use_autocast = args.autocast == "on" or (args.autocast == "auto" and device.type == "cuda")

    model = make_model(args, device)
    reference = copy.deepcopy(model) if args.check else None
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    compiled = autoshard.compile(model, mesh["sp"], grad_sync=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr) if args.check else None

    worst = 0.0
    for step in range(args.steps):
        ids, positions, labels = packed_batch(args, step, device)
        mine = slice(dp * args.batch_per_dp, (dp + 1) * args.batch_per_dp)
        per_group = torch.tensor(targets(labels) / args.dp, device=device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            loss = compiled(input_ids=ids[mine], position_ids=positions[mine], labels=labels[mine],
                            num_items_in_batch=per_group, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - start
        if step == 0:
            undistributed = report_attention(compiled, rank)
            if args.check and undistributed:
                raise SystemExit(f"rank {rank}: {undistributed} attention call(s) not distributed")
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh["dp"].get_group())
        total /= args.dp  # the mean over the global batch's targets
        line = (f"step {step}: {ids.shape[1]} tokens, loss {total.item():.6f}  "
                f"tokens/s {ids[mine].numel() / seconds:,.0f} per dp group  "
                f"peak {peak_memory(device) / 2**20:,.0f} MiB (rank {rank})")
        if reference is not None:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                ref_loss = reference(input_ids=ids, position_ids=positions, labels=labels, use_cache=False).loss
            ref_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            difference = abs(total.item() - ref_loss.item()) / abs(ref_loss.item())
            worst = max(worst, difference)
            line += f"  one process {ref_loss.item():.6f} (relative difference {difference:.1e})"
        if rank == 0:
            print(line, flush=True)
    if rank == 0 and args.vary_lengths:
        print(autoshard.explain(compiled).splitlines()[0], flush=True)  # the compilations and their causes
    if args.check and args.vary_lengths and compiled.autoshard_backend.compilations["new sequence length"]:
        raise SystemExit(f"rank {rank}: a compilation per sequence length: "
                         f"{dict(compiled.autoshard_backend.compilations)}")
    if args.check and worst > args.tolerance:
        raise SystemExit(f"rank {rank}: the loss differs from one-process training by {worst:.1e} (relative)")
    if rank == 0 and args.check:
        print(f"OK: {args.steps} steps on (dp={args.dp}, sp={world // args.dp}) match one-process training "
              f"(largest relative loss difference {worst:.1e})")


if __name__ == "__main__":
    options = parse(sys.argv[1:])
    autoshard.launch.run(main, options.world_size, options)
