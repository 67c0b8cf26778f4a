"""The four annotations, each on a small model, on 2 CPU ranks, checked against one process.

    python examples/annotations.py
    torchrun --nproc-per-node 2 examples/annotations.py

* ``mark_sequence`` -- a model without attention: nothing reveals the sequence, so mark it;
* ``whole`` -- code that needs the entire sequence (``flip``): gather it explicitly;
* ``token_local`` -- per-token code with ops the compiler has no rules for (``topk``, ``scatter``):
  let them run on each rank's tokens;
* ``attention_function`` -- your own attention kernel with SDPA's meaning: it is distributed.
"""

import math

import torch
import torch.distributed as dist
import torch.nn as nn

import autoshard
from autoshard.testing.equivalence import compare_with_one_process


class TokenMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))

    def forward(self, x):
        x = autoshard.mark_sequence(x, 1)  # dim 1 of x is the sequence
        return self.mlp(x).mean(1)         # the mean over the split sequence is made exact


class Reverse(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(autoshard.mark_sequence(x, 1))
        return self.proj(autoshard.whole(h).flip(1))  # flip needs every position


class Sparse(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    @autoshard.token_local
    def keep_top2(self, h):  # each token keeps its two largest features
        values, index = h.topk(2, dim=-1)
        return torch.zeros_like(h).scatter(-1, index, values)

    def forward(self, x):
        return self.proj(self.keep_top2(self.proj(autoshard.mark_sequence(x, 1))))


@autoshard.attention_function
def my_attention(q, k, v, *, causal=False, scale=None):
    scores = q @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(q.size(-1)))
    if causal:
        n = q.size(-2)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


class WithMyAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return self.out(my_attention(q, k, v, causal=True).transpose(1, 2).reshape(b, s, 16))


def main():
    for model, width in ((TokenMLP, 8), (Reverse, 8), (Sparse, 8), (WithMyAttention, 16)):
        torch._dynamo.reset()
        result = compare_with_one_process(model, lambda: (torch.randn(2, 11, width),), dtype=torch.float64)
        if dist.get_rank() == 0:
            moved = "; ".join(result.transitions) or "nothing outside attention"
            print(f"{model.__name__:>16}: max relative error {result.max_error():.1e}; moved: {moved}"
                  + (f"; attention: {result.attention[0]['strategy']}" if result.attention else ""))
        assert result.max_error() < 1e-9 and not result.fallbacks


if __name__ == "__main__":
    autoshard.launch.run(main, world_size=2)
