"""The one-liner on a Llama-style causal LM: 2 CPU ranks, checked against one process.

    python examples/llama.py                      # spawns 2 ranks (gloo)
    torchrun --nproc-per-node 2 examples/llama.py

Every rank passes the same full batch. Rank 0 prints the plan (what will be split, how attention
is distributed and why, every collective and its bytes, memory per rank); then the compiled model
runs, and its loss and every parameter gradient must equal the plain model's on one process.
"""

import copy

import torch
import torch.distributed as dist

import autoshard
from autoshard.testing.models import LlamaConfig, LlamaLM


def main(seq_len: int = 250):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = LlamaLM(LlamaConfig(layers=2, hidden=64, heads=4, kv_heads=2)).double()
    one_process = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, seq_len))
    labels = ids.clone()
    labels[:, :5] = -100  # ignored prompt tokens

    if rank == 0:  # what will happen, before it happens (no process group needed for this)
        print(autoshard.plan(model, (ids, labels), world_size=dist.get_world_size()))
        print()

    backend = autoshard.backend()  # the default group; autoshard.backend(mesh) for a DeviceMesh
    compiled = torch.compile(model, backend=backend)
    loss, logits = compiled(ids, labels)
    loss.backward()

    ref_loss, ref_logits = one_process(ids, labels)
    ref_loss.backward()
    grad_err = max((p.grad - q.grad).abs().max().item() / q.grad.abs().max().item()
                   for p, q in zip(model.parameters(), one_process.parameters()))
    logits_diff = (logits.full_tensor() - ref_logits).abs().max().item()  # they come back split: gathered once
    if rank == 0:
        print(f"loss {loss.item():.12f} (one process {ref_loss.item():.12f}); "
              f"logits max diff {logits_diff:.1e}; "
              f"max relative gradient diff {grad_err:.1e}")
    assert abs(loss.item() - ref_loss.item()) < 1e-9 and grad_err < 1e-9


if __name__ == "__main__":
    autoshard.launch.run(main, world_size=2)
