"""A BERT-style encoder classifier in plain PyTorch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import GeluLayer, TextConfig

__all__ = ["BertConfig", "BertClassifier"]


@dataclass(frozen=True, kw_only=True)
class BertConfig(TextConfig):
    """The encoder's sizes, vocabulary and positions (:class:`TextConfig`), its classes and dropout."""

    classes: int = 3
    """Output classes."""
    dropout: float = 0.0
    """Dropout after attention and feed-forward."""


class Layer(GeluLayer):
    def __init__(self, cfg: BertConfig):
        super().__init__(cfg, qkv=nn.Linear(cfg.hidden, 3 * cfg.hidden), out=nn.Linear(cfg.hidden, cfg.hidden))
        self.dropout = cfg.dropout

    def forward(self, x, key_padding):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = key_padding[:, None, None, :]  # True where the key is a real token
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.norm1(x + F.dropout(self.out(a.transpose(1, 2).reshape(b, s, d)), self.dropout, self.training))
        return self.norm2(x + F.dropout(self.feed_forward(x), self.dropout, self.training))


class BertClassifier(nn.Module):
    """``forward(input_ids, attention_mask, labels=None) -> (loss or None, logits)``; masked mean pooling."""

    def __init__(self, cfg: BertConfig = BertConfig()):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.positions = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.norm = nn.LayerNorm(cfg.hidden)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.head = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, input_ids, attention_mask, labels=None):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]
        x = self.norm(self.tokens(input_ids) + self.positions(positions))
        keep = attention_mask.bool()
        for layer in self.layers:
            x = layer(x, keep)
        weights = attention_mask.to(x.dtype)[..., None]
        pooled = (x * weights).sum(1) / weights.sum(1)
        logits = self.head(pooled)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return loss, logits
