"""A Llama-style causal language model in plain PyTorch."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import TransformerConfig

__all__ = ["LlamaConfig", "LlamaLM"]


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(TransformerConfig):
    """The model's sizes (:class:`TransformerConfig`; ``intermediate`` the SwiGLU width), its vocabulary,
    key/value heads, RoPE and norm."""

    vocab_size: int = 256
    """Token vocabulary."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention when fewer than ``heads``)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    eps: float = 1e-6
    """RMSNorm epsilon."""
    ignore_index: int = -100
    """Label value the loss ignores."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.hidden // cfg.heads
        self.q = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.k = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.hidden, cfg.eps), RMSNorm(cfg.hidden, cfg.eps)
        self.attn = Attention(cfg)
        self.gate = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaLM(nn.Module):
    """``forward(input_ids, labels=None) -> (loss or None, logits)``; the embedding is tied to the LM head."""

    def __init__(self, cfg: LlamaConfig = LlamaConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        nn.init.normal_(self.embed.weight, std=0.02)  # the tied LM head starts near uniform

    def forward(self, input_ids, labels=None):
        h = self.embed(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = rope(positions, self.cfg.hidden // self.cfg.heads, self.cfg.rope_theta, h.dtype)
        for block in self.blocks:
            h = block(h, cos, sin)
        logits = F.linear(self.norm(h), self.embed.weight)
        if labels is None:
            return None, logits
        shifted = F.pad(labels, (0, 1), value=self.cfg.ignore_index)[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                               ignore_index=self.cfg.ignore_index)
        return loss, logits
