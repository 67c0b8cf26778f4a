"""Sharding by hand: layouts, shard / unshard, and the bytes they move, checked against one process.

    python examples/layouts.py           # spawns 2 ranks (gloo)
    torchrun --nproc-per-node 2 examples/layouts.py

Every rank holds the same full batch; each keeps only its zigzag shard of the sequence, runs a
token-local MLP on it, and the shards are gathered back. Output and gradients must equal the
one-process computation, and the bytes moved must equal the layout's formula.
"""

import torch
import torch.distributed as dist

import autoshard
from autoshard.runtime import SequenceLayout, comm_counter, shard_sequence, unshard_sequence


def main():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    batch, seq, hidden = 2, 1001, 64   # 1001 is not divisible by 2P: uneven shards, no padding
    x = torch.randn(batch, seq, hidden, dtype=torch.float64)
    mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)).double()

    ref_x = x.clone().requires_grad_()
    ref = mlp(ref_x)
    ref.square().mean().backward()

    x_sp = x.clone().requires_grad_()
    with comm_counter() as cc:
        local = shard_sequence(x_sp, 1, layout="zigzag")
        out = unshard_sequence(mlp(local), 1, layout="zigzag", length=seq)
        out.square().mean().backward()

    layout = SequenceLayout.zigzag(seq, world)
    ok_out = torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    ok_grad = torch.allclose(x_sp.grad, ref_x.grad, rtol=1e-12, atol=1e-12)
    expected_bytes = 2 * (world - 1) * batch * layout.max_local_length * hidden * 8
    data_bytes = cc.payload_bytes_sent  # less the lengths unshard exchanges to check the shards
    for r in range(world):
        if r == rank:
            print(f"rank {rank}: holds positions {layout.local_intervals(rank)} ({layout.local_length(rank)} of {seq}); "
                  f"output equal: {ok_out}, input grad equal: {ok_grad}; "
                  f"sent {data_bytes:,} B of data (formula {expected_bytes:,} B)", flush=True)
        dist.barrier()
    assert ok_out and ok_grad and data_bytes == expected_bytes


if __name__ == "__main__":
    autoshard.launch.run(main, world_size=2)
