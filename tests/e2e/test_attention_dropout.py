"""Dropout on attention probabilities, distributed: the mask is a hash of a per-call seed and global positions
(:mod:`autoshard.runtime.attention.dropout`), so it is the same whatever the strategy, the layout and the
world size, and the backward uses the forward's mask.

* ``test_dropout_matches_the_hashed_mask_on_one_process``: a model with hand-written attention dropout
  (nanoGPT's ``attn_dropout``) and SDPA's ``dropout_p``, compiled at P=2 and 4 (ring, zigzag, ulysses,
  allgather), gives the loss and every gradient of the same model on one process with the hashed mask of the
  same seeds, float64, 1e-9 relative; the attention is distributed (no S x S value, 0 fallbacks).
* ``test_mask_keeps_one_minus_p_independently``: the kept fraction is 1 - p within 5 sigma, neighbours are
  uncorrelated, seeds and heads give different masks.
* ``test_blocks_use_one_mask``: attention computed whole and in blocks at global offsets, forward and backward,
  agree exactly.
"""

import copy
import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.runtime.attention.dropout import AttentionDropout, draw_seed
from autoshard.runtime.attention.local import local_attention, local_attention_backward
from autoshard.testing import run_on_ranks

HIDDEN, HEADS, VOCAB, SEQ, P_DROP = 32, 4, 64, 29, 0.25


class DropAttention(nn.Module):
    def __init__(self, sdpa: bool):
        super().__init__()
        self.sdpa = sdpa
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.attn_dropout = nn.Dropout(P_DROP)
        self.hashed = False  # the reference: the same attention with the hashed mask

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if self.hashed:
            y = _hashed_attention(q, k, v)
        elif self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=P_DROP if self.training else 0.0)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
            att = att.masked_fill(torch.ones(s, s, dtype=torch.bool, device=x.device).tril().logical_not(), -math.inf)
            y = self.attn_dropout(att.softmax(-1)) @ v
        return x + self.out(y.transpose(1, 2).reshape(b, s, HIDDEN))


def _hashed_attention(q, k, v):
    """Causal attention whose probabilities are dropped by the hashed mask of the next seed."""
    b, h, s, _ = q.shape
    dropout = AttentionDropout(P_DROP, draw_seed("reference", q.device))
    probs = ((q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))).masked_fill(
        torch.ones(s, s, dtype=torch.bool).tril().logical_not(), -math.inf).softmax(-1)
    return (probs * dropout.keep(b, h, 0, s, 0, s).to(probs.dtype) * dropout.scale) @ v


class DropLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([DropAttention(sdpa=False), DropAttention(sdpa=True)])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).view(-1, VOCAB), labels.view(-1))


def _relative(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _run(strategy: str) -> dict:
    torch.manual_seed(0)
    model = DropLM().double()
    reference = copy.deepcopy(model)
    for layer in reference.layers:
        layer.hashed = True
    ids = torch.randint(0, VOCAB, (2, SEQ))
    torch.manual_seed(1)
    ref_loss = reference(ids, ids)
    ref_loss.backward()
    torch._dynamo.reset()
    backend = autoshard.backend(strategy=strategy, outputs="gathered")
    compiled = torch.compile(model, backend=backend)
    torch.manual_seed(1)
    loss = compiled(ids, ids)
    loss.backward()
    reports = [graph.report for graph in backend.compiled]
    return {
        "loss": _relative(loss.detach(), ref_loss.detach()),
        "grads": max(_relative(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters())),
        "attention": [a for g in reports for a in g.attention],
        "fallbacks": [f for g in reports for f in g.fallbacks],
        "squares": [v for g in reports for v in g.square_values],
    }


@functools.cache
def _results(world: int, strategy: str):
    return run_on_ranks(_run, world, strategy, timeout=300)


@pytest.mark.parametrize("world,strategy", [(2, "ring"), (2, "ulysses"),
                                            *(pytest.param(4, name, marks=pytest.mark.slow)
                                              for name in ("zigzag", "allgather"))])
def test_dropout_matches_the_hashed_mask_on_one_process(world, strategy):
    for rank, r in enumerate(_results(world, strategy)):
        where = f"P={world} {strategy} rank {rank}"
        assert r["loss"] <= 1e-9 and r["grads"] <= 1e-9, f"{where}: {r}"
        assert r["fallbacks"] == [] and r["squares"] == [], f"{where}: {r}"
        assert [a["strategy"] for a in r["attention"]] == [strategy] * 2, f"{where}: {r['attention']}"
        assert all(a["dropout"] == P_DROP for a in r["attention"]), f"{where}: {r['attention']}"


def test_mask_keeps_one_minus_p_independently():
    seed = torch.tensor(12345)
    keep = AttentionDropout(P_DROP, seed).keep(2, 4, 0, 256, 0, 256).double()
    n = keep.numel()
    assert abs(keep.mean().item() - (1 - P_DROP)) < 5 * math.sqrt(P_DROP * (1 - P_DROP) / n)
    centred = keep - keep.mean()
    for shifted in (centred[..., 1:, :], centred[..., :, 1:]):  # neighbouring queries, neighbouring keys
        a = centred[..., :shifted.size(-2), :shifted.size(-1)]
        corr = (a * shifted).mean() / (a.std() * shifted.std())
        assert abs(corr.item()) < 0.01, corr
    other_seed = AttentionDropout(P_DROP, torch.tensor(12346)).keep(2, 4, 0, 256, 0, 256).double()
    assert (other_seed != keep).double().mean() > 0.3
    assert (keep[:, 0] != keep[:, 1]).double().mean() > 0.3


def test_blocks_use_one_mask():
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 4, 40, 8, generator=g, dtype=torch.float64) for _ in range(4))
    dropout = AttentionDropout(0.3, torch.tensor(99))
    out, lse = local_attention(q, k, v, causal=True, dropout=dropout, kernels="torch")
    grads = local_attention_backward(dout, q, k, v, out, lse, causal=True, dropout=dropout, kernels="torch")
    for cut in (16, 33):
        top, low = (slice(0, cut), slice(cut, 40))
        out_top, _ = local_attention(q[:, :, top], k[:, :, top], v[:, :, top], causal=True, dropout=dropout,
                                     kernels="torch")
        out_low, lse_low = local_attention(q[:, :, low], k, v, q_offset=cut, causal=True, dropout=dropout,
                                           kernels="torch")
        torch.testing.assert_close(torch.cat([out_top, out_low], 2), out, rtol=1e-12, atol=1e-12)
        dq_low, dk_low, dv_low = local_attention_backward(dout[:, :, low], q[:, :, low], k, v, out[:, :, low],
                                                          lse[:, :, low], q_offset=cut, causal=True, dropout=dropout,
                                                          kernels="torch")
        torch.testing.assert_close(dq_low, grads[0][:, :, low], rtol=1e-12, atol=1e-12)
