"""A causal LM whose attention is written out by hand (no ``scaled_dot_product_attention``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["HandwrittenConfig", "HandwrittenLM"]


@dataclass(frozen=True, kw_only=True)
class HandwrittenConfig:
    vocab_size: int = 256
    """Token vocabulary."""
    hidden: int = 64
    """Model width."""
    layers: int = 2
    """Transformer blocks."""
    heads: int = 4
    """Attention heads."""
    max_positions: int = 512
    """Learned position table size."""


class Block(nn.Module):
    def __init__(self, cfg: HandwrittenConfig):
        super().__init__()
        self.heads = cfg.heads
        self.norm1, self.norm2 = nn.LayerNorm(cfg.hidden), nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ff1, self.ff2 = nn.Linear(cfg.hidden, 4 * cfg.hidden), nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        a = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.ff2(F.gelu(self.ff1(self.norm2(x))))


class HandwrittenLM(nn.Module):
    """``forward(input_ids, labels=None) -> (loss or None, logits)``."""

    def __init__(self, cfg: HandwrittenConfig = HandwrittenConfig()):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.positions = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size)

    def forward(self, input_ids, labels=None):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tokens(input_ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if labels is None:
            return None, logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return loss, logits
