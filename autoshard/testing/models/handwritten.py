"""A causal LM whose attention is written out by hand (no ``scaled_dot_product_attention``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import GeluLayer, TextConfig

__all__ = ["HandwrittenConfig", "HandwrittenLM"]


@dataclass(frozen=True, kw_only=True)
class HandwrittenConfig(TextConfig):
    """The model's sizes, vocabulary and positions (:class:`TextConfig`); a feed-forward 4 times
    the default ``hidden`` wide."""

    intermediate: int = 256
    """Feed-forward width."""


class Block(GeluLayer):
    def __init__(self, cfg: HandwrittenConfig):
        super().__init__(cfg, qkv=nn.Linear(cfg.hidden, 3 * cfg.hidden), proj=nn.Linear(cfg.hidden, cfg.hidden))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        a = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.feed_forward(self.norm2(x))


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
