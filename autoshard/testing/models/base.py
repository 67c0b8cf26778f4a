"""What the reference models share: a transformer's sizes (each model's configuration adds its own), a text
model's vocabulary and position table, and the parts of a LayerNorm + GELU layer but its attention (BERT's, ViT's
and the handwritten GPT's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
import torch.nn.functional as F

__all__ = ["TransformerConfig", "TextConfig", "GeluLayer"]


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """A transformer's widths and counts (the base of each model's configuration)."""

    hidden: int = 64
    """Model width."""
    layers: int = 2
    """Transformer layers (blocks)."""
    heads: int = 4
    """Attention heads (query heads where keys and values have fewer)."""
    intermediate: int = 128
    """Feed-forward width."""


@dataclass(frozen=True, kw_only=True)
class TextConfig(TransformerConfig):
    """A transformer reading token ids through an embedding and a learned position table (BERT, GPT)."""

    vocab_size: int = 256
    """Token vocabulary."""
    max_positions: int = 512
    """Learned position table size."""


class GeluLayer(nn.Module):
    """Two LayerNorms and a GELU feed-forward; a model's layer passes its attention's ``projections`` (made before
    the feed-forward's, so each model draws its weights in its own order) and writes ``forward``."""

    def __init__(self, cfg: TransformerConfig, **projections: nn.Module):
        super().__init__()
        self.heads = cfg.heads
        self.norm1, self.norm2 = nn.LayerNorm(cfg.hidden), nn.LayerNorm(cfg.hidden)
        for name, projection in projections.items():
            self.add_module(name, projection)
        self.ff1, self.ff2 = nn.Linear(cfg.hidden, cfg.intermediate), nn.Linear(cfg.intermediate, cfg.hidden)

    def feed_forward(self, x):
        return self.ff2(F.gelu(self.ff1(x)))
