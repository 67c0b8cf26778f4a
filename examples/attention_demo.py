"""Distributed attention by hand on 2 CPU ranks, checked against one process.

    python examples/attention_demo.py              # spawns 2 ranks (gloo)
    torchrun --nproc-per-node 2 examples/attention_demo.py

Every rank builds the same full q, k, v (GQA: 8 query heads, 2 kv heads), keeps its shard of the
sequence, and runs causal attention with the ring strategy (contiguous shards) and the zigzag
strategy (zigzag shards, balanced causal work). Output and gradients must equal
``F.scaled_dot_product_attention`` on the whole sequence in one process, and the bytes each rank
sends must equal the strategy's formula.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autoshard
from autoshard.runtime import attention, comm_counter, sequence_positions, shard_sequence
from autoshard.runtime.attention.base import bytes_sent
from autoshard.runtime.attention.formulas import values


def main():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 8, 2, 1000, 64   # 1000 is divisible by 2P = 4: exact byte formulas
    q, k, v, dout = (torch.randn(batch, h, seq, dim, dtype=torch.float64) for h in (heads, kv_heads, kv_heads, heads))

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    reference.backward(dout)

    for strategy, layout in (("ring", "contiguous"), ("zigzag", "zigzag")):
        local = [shard_sequence(t, 2, layout=layout).requires_grad_() for t in (q, k, v)]
        pos = sequence_positions(seq, layout=layout)
        with comm_counter() as fwd:
            out = attention(*local, strategy=strategy, layout=layout, causal=True, seq_len=seq)
        with comm_counter() as bwd:
            out.backward(dout[:, :, pos])
        diffs = torch.tensor([(out - reference[:, :, pos]).abs().max().item()]
                             + [(t.grad - f.grad[:, :, pos]).abs().max().item() for t, f in zip(local, full)])
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        subs = values(B=batch, S=seq, H=heads, Hkv=kv_heads, D=dim, P=world, dtype=q.dtype)
        # (the first call also exchanges a few bytes of "metadata": the ranks confirm they agree on the call)
        sent = [c.payload_bytes_sent for c in (fwd, bwd)]
        expected = [int(bytes_sent(strategy, d).subs(subs)) for d in ("forward", "backward")]
        if rank == 0:
            print(f"{strategy:>6} ({layout} shards, causal, {world} ranks): max |diff| vs one process: "
                  f"out {diffs[0]:.1e}, dq {diffs[1]:.1e}, dk {diffs[2]:.1e}, dv {diffs[3]:.1e}; "
                  f"sent per rank: forward {sent[0]:,} B (formula {expected[0]:,}), "
                  f"backward {sent[1]:,} B (formula {expected[1]:,})", flush=True)
        assert diffs.max() < 1e-10 and sent == expected, (strategy, diffs, sent, expected)
    if rank == 0:
        print("distributed attention equals one process: OK")


if __name__ == "__main__":
    autoshard.launch.run(main, world_size=2)
