"""A factory for ``python -m autoshard plan``: a Llama-3-8B-shaped model on the meta device.

    python -m autoshard plan examples/plan_llama_8b.py:factory --world-size 64 --seq-len 1048576

32 layers, hidden 4096, 32 query heads and 8 key/value heads, SwiGLU 14336, vocabulary 128256, bf16.
Nothing is allocated: the model and the token ids live on the meta device.
"""

import torch

from autoshard.models import LlamaConfig, LlamaLM

CONFIG = LlamaConfig(vocab_size=128256, hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
                     rope_theta=500000.0)


def factory(seq_len: int):
    with torch.device("meta"):
        model = LlamaLM(CONFIG).to(torch.bfloat16)
        ids = torch.randint(0, CONFIG.vocab_size, (1, seq_len))
    return model, (ids, ids), {}
