"""Bytes each third-party construct moves per attention layer, from the dry-run plan (a table, no assertions).

    python benchmarks/constructs.py                  # S=4096, P=4
    python benchmarks/constructs.py --seq-len 8192 --world-size 8

The models are the ones ``tests/e2e/test_constructs.py`` (and the dropout and chunked-attention tests) check
against one process; here each is planned at a long length on the CPU (so buffers have their values), and the
table shows, per construct, the strategy chosen, the score terms carried to the distributed op, the forward and
backward bytes one rank sends for one attention layer (the plan's figures, which the tests check equal the
bytes measured) and the plan's fallbacks (0: nothing gathered that was not planned).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
import torch.nn as nn

import autoshard

TESTS = Path(__file__).resolve().parents[1] / "tests" / "e2e"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, TESTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cases(seq: int) -> dict:
    c, d, k = _module("test_constructs"), _module("test_attention_dropout"), _module("test_chunked_attention")

    def nanogpt():
        model = c.NanoGPT()
        model.wpe = nn.Embedding(seq, c.HIDDEN)
        for block in model.h:  # nanoGPT's block_size must cover the length
            block.bias = torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq)
        return model

    def clip():
        model = c.ClipText()
        model.position = nn.Embedding(seq, c.HIDDEN)
        return model

    ids = torch.randint(4, c.VOCAB, (1, seq))
    ids[0, -1] = c.EOS
    tokens = (ids, ids.clone())
    return {
        "1 buffer causal mask (nanoGPT)": (nanogpt, tokens),
        "2 attention-prob dropout": (d.DropLM, tokens),
        "3 MLA (Dv != D, in-place keys)": (c.latent_lm, tokens),
        "4 complex RoPE (Llama-1)": (c.LlamaOne, tokens),
        "5 chunked local attention": (lambda: k.ChunkedLM("masked_fill"), (ids,)),
        "6 eos pooling (CLIP text)": (clip, (ids, torch.randn(1, 16))),
        "9 ALiBi (paper, Bloom)": (c.alibi_lm, tokens),
        "9 T5 relative buckets": (c.relative_lm, tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    print(f"bytes one rank sends per attention layer, S={args.seq_len}, P={args.world_size} (plan, float32)\n")
    print(f"{'construct':34s} {'strategy':10s} {'mask / terms':28s} {'fwd KiB':>9s} {'bwd KiB':>9s}  fallbacks")
    for name, (make, inputs) in _cases(args.seq_len).items():
        torch.manual_seed(0)
        torch._dynamo.reset()
        plan = autoshard.plan(make(), inputs, world_size=args.world_size)
        for decision in plan.attention[:1]:  # every layer of these models moves the same
            fwd, bwd = (sum(c.bytes_per_rank for c in plan.collectives if c.node == decision.node and c.phase == phase)
                        for phase in ("forward", "backward"))
            print(f"{name:34s} {decision.strategy:10s} {decision.mask:28s} {fwd / 1024:9.1f} {bwd / 1024:9.1f}  "
                  f"{len(plan.fallbacks)}")


if __name__ == "__main__":
    main()
