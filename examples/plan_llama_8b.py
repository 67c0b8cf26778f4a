"""Factories for ``python -m autoshard plan``: transformers' ``LlamaForCausalLM`` with Llama-3-8B's shape, on meta.

    python -m autoshard plan examples/plan_llama_8b.py:factory --world-size 64 --seq-len 1048576
    python -m autoshard plan examples/plan_llama_8b.py:factory --world-size 64 --seq-len 1048576 \\
        --memory-budget 80 --dp-shard 64 --optimizer adamw
    python -m autoshard plan examples/plan_llama_8b.py:train --world-size 8 --seq-len 8388608 \\
        --memory-budget 80 --host-budget 240 --dp-shard 8 --optimizer adamw --no-grad-sync
    python -m autoshard plan examples/plan_llama_8b.py:prompt --world-size 8 --seq-len 1048576 --decode
    python -m autoshard plan examples/plan_llama_8b.py:packed --world-size 8 --seq-len 131072 --hardware h100

32 layers, hidden 4096, 32 query heads and 8 key/value heads, SwiGLU 14336, vocabulary 128256, RoPE theta
500000, bfloat16, the model transformers builds from that config, unmodified. Nothing is allocated: the model
and the token ids live on the meta device.

* ``factory``: called as users call it, ``model(input_ids=ids, labels=ids)``: the loss *and* the logits are
  returned (the logits lazily: computed when first read, so the plan holds their ``[tokens / P, 4096]`` input,
  not ``[tokens / P, 128256]``; ``--no-lazy-logits`` to plan them computed), and so is the KV cache
  (transformers' default ``use_cache=True``): with checkpointed layers its keys and values are held for the
  caller alone -- 80 GiB per rank at 5,242,880 tokens on 8 ranks, which the plan names with its fix
  (``train``'s ``use_cache=False``);
* ``train``: a training step's call, ``model(input_ids=ids, labels=ids, use_cache=False)`` (no KV cache returned:
  transformers turns it off itself under gradient checkpointing), the logits returned lazily;
* ``prompt``: serving, ``model(input_ids=ids)`` in eval mode: with ``--decode`` the plan of a decode step after
  that prompt (the KV cache split along the sequence);
* ``packed``: ``train`` on a row of packed documents of a long-tailed mix, their ``position_ids`` concrete: the
  plan counts each rank's attention work and the keys each rank fetches (``packed documents`` in its text);
* ``loss_only``: a training step that keeps only ``.loss`` inside the compiled code: the logits are dead in
  the graph, so no ``[tokens, vocab]`` value exists at all (with lazy logits, ``factory`` plans the same).
"""

import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

from autoshard.testing.data import long_tail, positions_of

CONFIG = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, attn_implementation="sdpa")


def _model(seq_len: int) -> nn.Module:
    config = LlamaConfig(max_position_embeddings=seq_len, **CONFIG)
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16).train()


class LossOnly(nn.Module):
    """The model's loss, nothing else of its output."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def factory(seq_len: int):
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq_len), device="meta")
    return _model(seq_len), (), dict(input_ids=ids, labels=ids)


def train(seq_len: int):
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq_len), device="meta")
    return _model(seq_len), (), dict(input_ids=ids, labels=ids, use_cache=False)


def packed(seq_len: int):
    """``train`` on one row packed with long-tailed documents (one of 8K to 16K tokens among log-normal ones, median
    about 500: :func:`autoshard.testing.data.long_tail`), their concrete ``position_ids`` on the CPU so the plan reads
    the documents: each rank's attention work and the keys it fetches."""
    model, args, kwargs = train(seq_len)
    return model, args, dict(kwargs, position_ids=positions_of(long_tail(seq_len, 1)))


def loss_only(seq_len: int):
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq_len), device="meta")
    return LossOnly(_model(seq_len)), (ids, ids), {}


def prompt(seq_len: int):
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq_len), device="meta")
    return _model(seq_len).eval(), (), dict(input_ids=ids)
