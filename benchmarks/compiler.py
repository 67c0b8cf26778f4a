"""The compiler's costs and gains on the Llama-style reference model (tables, no assertions).

    python benchmarks/compiler.py                 # all three tables
    python benchmarks/compiler.py --quick         # small sizes, seconds

1. compile overhead: the autoshard passes alone (annotate .. rewrite) on a 32-layer model's graph;
2. memory: per-rank peak resident memory of forward+backward at S tokens, P=2 vs one process;
3. compiled vs hand-sharded: step time of the compiled model vs the same model written by hand with
   ``autoshard.runtime.attention`` / ``shard_sequence``, both at P=2, measured alternately in one run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autoshard
from autoshard.testing.models import LlamaConfig, LlamaLM
from autoshard.testing.models.llama import rope, rotate
from autoshard.runtime import attention, sequence_positions, shard_sequence
from autoshard.runtime.redistribute import reduce_partial
from autoshard.testing import run_on_ranks
from autoshard.testing.memory import LOW_MMAP_THRESHOLD_ENV, peak_memory


# ----------------------------------------------------------------------------- 1. compile overhead


def compile_overhead(layers: int, repeats: int = 3) -> tuple[list[float], dict[str, float]]:
    """Seconds of ``compile_graph`` on the dynamo graph of a ``layers``-layer model (rank 0 of 2, fake world),
    and each pass's seconds in the run of median total."""
    from autoshard.config import BackendConfig
    from autoshard.passes.pipeline import compile_graph
    from autoshard.runtime.groups import sequence_groups
    from autoshard.testing import fake_world

    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = LlamaLM(LlamaConfig(layers=layers))
    ids = torch.randint(0, 256, (1, 128))
    times, per_pass = [], []
    with fake_world(2):
        for _ in range(repeats):
            graphs.clear()
            torch._dynamo.reset()
            torch.compile(model, backend=grab)(ids, ids)
            start = time.perf_counter()
            compiled = compile_graph(graphs[0], config=BackendConfig(), groups=sequence_groups(dist.group.WORLD))
            times.append(time.perf_counter() - start)
            per_pass.append({name: stats.seconds for name, stats in compiled.report.passes.items()})
    middle = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]
    return times, per_pass[middle]


# ----------------------------------------------------------------------------- 2. memory


def _config(args) -> LlamaConfig:
    return LlamaConfig(layers=args["layers"], hidden=args["hidden"], heads=8, kv_heads=4, intermediate=4 * args["hidden"])


def peak_step_memory(args: dict, compiled: bool) -> int:
    """Peak resident bytes of one forward+backward on this rank (compiled over the ranks, or plain)."""
    torch.manual_seed(0)
    model = LlamaLM(_config(args))
    ids = torch.randint(0, 256, (1, args["seq_len"]))
    run = torch.compile(model, backend=autoshard.backend(outputs="sharded")) if compiled else model
    run(ids[:, :64], ids[:, :64])[0].backward()  # compile and warm up on a short sequence
    model.zero_grad(set_to_none=True)
    with peak_memory() as measured:
        loss, _ = run(ids, ids)
        loss.backward()
    return measured.peak_bytes


# ----------------------------------------------------------------------------- 3. compiled vs hand-sharded


def hand_sharded_step(model: LlamaLM, ids: torch.Tensor, labels: torch.Tensor, layout: str, strategy: str):
    """The Llama-style model sharded by hand: what the compiler should match."""
    cfg = model.cfg
    seq = ids.shape[1]
    h = model.embed(shard_sequence(ids, 1, layout=layout))
    cos, sin = rope(sequence_positions(seq, layout=layout), cfg.hidden // cfg.heads, cfg.rope_theta, h.dtype)
    for block in model.blocks:
        x = block.attn_norm(h)
        a = block.attn
        b, s, _ = x.shape
        q = rotate(a.q(x).view(b, s, a.heads, a.head_dim).transpose(1, 2), cos, sin)
        k = rotate(a.k(x).view(b, s, a.kv_heads, a.head_dim).transpose(1, 2), cos, sin)
        v = a.v(x).view(b, s, a.kv_heads, a.head_dim).transpose(1, 2)
        out = attention(q, k, v, strategy=strategy, layout=layout, causal=True, seq_len=seq)
        h = h + a.o(out.transpose(1, 2).reshape(b, s, -1))
        m = block.mlp_norm(h)
        h = h + block.down(F.silu(block.gate(m)) * block.up(m))
    logits = F.linear(model.norm(h), model.embed.weight)
    shifted = shard_sequence(F.pad(labels, (0, 1), value=cfg.ignore_index)[:, 1:], 1, layout=layout)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=cfg.ignore_index,
                            reduction="sum")
    group = dist.group.WORLD.group_name
    count = (shifted != cfg.ignore_index).sum().to(total.dtype)
    loss = reduce_partial(total, "sum", group) / reduce_partial(count, "sum", group)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    return loss


def step_times(args: dict, steps: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    compiled_model = LlamaLM(_config(args))
    hand_model = copy.deepcopy(compiled_model)
    ids = torch.randint(0, 256, (1, args["seq_len"]))
    backend = autoshard.backend(outputs="sharded")
    compiled = torch.compile(compiled_model, backend=backend)
    compiled(ids, ids)[0].backward()
    strategy = backend.compiled[0].report.attention[0]["strategy"]
    layout = backend.compiled[0].report.attention[0]["layout"]
    hand_sharded_step(hand_model, ids, ids, layout, strategy)
    times = {"compiled": [], "hand": []}
    for _ in range(steps):
        for name in ("compiled", "hand"):
            model = compiled_model if name == "compiled" else hand_model
            model.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            if name == "compiled":
                compiled(ids, ids)[0].backward()
            else:
                hand_sharded_step(hand_model, ids, ids, layout, strategy)
            times[name].append(time.perf_counter() - start)
    times["strategy"] = [strategy, layout]
    return times


# ----------------------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--seq-len", type=int, default=16384, help="tokens for the memory table")
    parser.add_argument("--step-seq-len", type=int, default=4096, help="tokens for the step-time table")
    opts = parser.parse_args()
    layers, mem_seq, step_seq, steps = (32, opts.seq_len, opts.step_seq_len, 5) if not opts.quick else (8, 1024, 512, 2)

    overhead, per_pass = compile_overhead(layers)
    print(f"\n1. compile overhead of the autoshard passes, {layers}-layer Llama-style graph")
    print(f"   median {statistics.median(overhead):.2f} s over {len(overhead)} runs (target <= 2 s); by pass:")
    print("   " + "  ".join(f"{name} {seconds:.3f}" for name, seconds in per_pass.items()))

    args = {"seq_len": mem_seq, "layers": 2, "hidden": 256}
    one = run_on_ranks(peak_step_memory, 1, args, False, timeout=3600, env=LOW_MMAP_THRESHOLD_ENV)[0]
    two = run_on_ranks(peak_step_memory, 2, args, True, timeout=3600, env=LOW_MMAP_THRESHOLD_ENV)
    print(f"\n2. peak memory of forward+backward, S={mem_seq}, hidden 256, 2 layers, float32")
    print(f"   {'':<18}{'peak MiB':>12}{'vs one process':>16}")
    print(f"   {'one process':<18}{one / 2**20:>12.1f}{1.0:>16.2f}")
    for rank, peak in enumerate(two):
        print(f"   {'P=2 rank ' + str(rank):<18}{peak / 2**20:>12.1f}{peak / one:>16.2f}")
    print("   (target <= 0.60)")

    args = {"seq_len": step_seq, "layers": 2, "hidden": 256}
    times = run_on_ranks(step_times, 2, args, steps, timeout=3600)[0]
    compiled, hand = statistics.median(times["compiled"]), statistics.median(times["hand"])
    print(f"\n3. step time (forward+backward), S={step_seq}, P=2, {times['strategy'][0]} on the "
          f"{times['strategy'][1]} layout, median of {steps}")
    print(f"   compiled {compiled * 1e3:.1f} ms, hand-sharded {hand * 1e3:.1f} ms, ratio {compiled / hand:.3f} "
          "(target within 5%)")


if __name__ == "__main__":
    main()
