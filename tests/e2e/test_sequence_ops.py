"""Ops that mix positions along the split sequence, each against one process (values and gradients):
softmax / logsumexp / var / amax / mean over the sequence, cumsum, shifts (a halo), selecting and
slicing positions, concatenating and padding along the sequence."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process


class SequenceOps(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(6, 6)
        self.cls = nn.Parameter(torch.randn(1, 1, 6))

    def forward(self, x):
        h = torch.tanh(self.proj(autoshard.mark_sequence(x, 1)))
        k = self.kind
        if k == "softmax":      # attention pooling: weights over the sequence
            w = F.softmax(h[..., :1] * 3, dim=1)
            return (w * h).sum(1), w
        if k == "logsumexp":
            return torch.logsumexp(h, dim=1)
        if k == "var":
            return h.var(1), h.std(1, keepdim=True) * h
        if k == "amax":
            return h.amax(1) + h.amin(1), torch.max(h)
        if k == "mean":
            return h.mean(1), h.mean()
        if k == "cumsum":
            return h.cumsum(1) * h
        if k == "shift":        # x[t+1] - x[t]: the halo of one position
            return h[:, 1:] - h[:, :-1]
        if k == "select":       # first and last tokens, and a slice out of the middle
            return h[:, 0] * h[:, -1], h[:, 2:5]
        if k == "cat_pad":      # a CLS token in front, a pad at the end
            return F.pad(torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1), (0, 0, 0, 2)) * 2
        raise ValueError(k)


KINDS = ["softmax", "logsumexp", "var", "amax", "mean", "cumsum", "shift", "select", "cat_pad"]


def _check(kinds, seq, layout):
    out = {}
    for kind in kinds:
        torch._dynamo.reset()
        r = compare_with_one_process(lambda: SequenceOps(kind), lambda: (torch.randn(2, seq, 6),),
                                     dtype=torch.float64, layout=layout)
        out[kind] = (r.max_error(), r.summary())
    return out


@pytest.mark.parametrize("world,seq,layout", [(2, 9, "contiguous"),
                                              pytest.param(3, 13, "zigzag", marks=pytest.mark.slow),
                                              pytest.param(4, 11, "contiguous", marks=pytest.mark.slow)])
def test_sequence_mixing_ops_are_exact(world, seq, layout):
    for result in run_on_ranks(_check, world, KINDS, seq, layout, timeout=300):
        for kind, (err, summary) in result.items():
            assert err < 1e-9, f"{kind}: {summary}"
