"""A ViT-style image classifier in plain PyTorch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import GeluLayer, TransformerConfig

__all__ = ["ViTConfig", "ViTClassifier"]


@dataclass(frozen=True, kw_only=True)
class ViTConfig(TransformerConfig):
    """The encoder's sizes (:class:`TransformerConfig`), its images and classes."""

    image: int = 32
    """Image side in pixels."""
    patch: int = 8
    """Patch side in pixels (the sequence is (image / patch)^2 patches plus the CLS token)."""
    channels: int = 3
    """Input channels."""
    classes: int = 5
    """Output classes."""


class Layer(GeluLayer):
    def __init__(self, cfg: ViTConfig):
        q, k, v = (nn.Linear(cfg.hidden, cfg.hidden) for _ in range(3))
        super().__init__(cfg, q=q, k=k, v=v, o=nn.Linear(cfg.hidden, cfg.hidden))

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm1(x)
        split = lambda t: t.view(b, s, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)))
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        return x + self.feed_forward(self.norm2(x))


class ViTClassifier(nn.Module):
    """``forward(pixels, labels=None) -> (loss or None, logits)``; reads the CLS token."""

    def __init__(self, cfg: ViTConfig = ViTConfig()):
        super().__init__()
        patches = (cfg.image // cfg.patch) ** 2
        self.embed = nn.Conv2d(cfg.channels, cfg.hidden, cfg.patch, stride=cfg.patch)
        self.cls = nn.Parameter(torch.randn(1, 1, cfg.hidden) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, patches + 1, cfg.hidden) * 0.02)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, pixels, labels=None):
        x = self.embed(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x)[:, 0])
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return loss, logits
