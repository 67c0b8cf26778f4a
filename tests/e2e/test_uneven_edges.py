"""Inputs that leave ranks in different situations, against one process (values and gradients):

* a slice of the sequence that leaves the first rank no position of it, under every reduction and
  softmax that all-reduces over the sequence (the empty rank joins with the reduction's identity);
* an additive attention mask with a mild fill (-1e4) and left padding under a causal mask, so that the
  first rank's first row sees no key while the other ranks' rows all see keys (one device attends with
  the unmasked scores there; every rank must take the same path);
* shards that do not fit the layout ``unshard_sequence`` is given: the same clear error on every rank
  within the timeout, never an error on some ranks while the others wait in the gather.

One compile per world size, with every case in one model; one launch per world size for the errors.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.runtime import shard_sequence, unshard_sequence
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

DIM, HEADS = 8, 2
SLICE_START = 4
"""With ``3 * world`` positions (contiguous), rank 0 holds positions 0-2: none of ``h[:, 4:]``."""


class UnevenEdges(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)

    def forward(self, x, keep):
        h = torch.tanh(self.proj(autoshard.mark_sequence(x, 1)))
        return self.sliced_reductions(h[:, SLICE_START:]), self.padded_attention(h, keep)

    @staticmethod
    def sliced_reductions(t):
        truth = (t > 0).any(1).to(t.dtype) + (t > -0.9).all(1).to(t.dtype)
        return (t.amax(1) + t.amin(1), torch.max(t), F.softmax(3 * t, dim=1), F.log_softmax(t, dim=1),
                torch.logsumexp(t, 1), t.var(1), t.mean(1) * truth)

    def padded_attention(self, h, keep):
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        causal = torch.ones(s, s, dtype=torch.bool, device=h.device).tril()
        outs = []
        for allowed in (causal & keep[:, None, None, :].bool(), causal[None, None]):  # padded, and no empty row
            mask = torch.zeros(allowed.shape, dtype=h.dtype, device=h.device).masked_fill(~allowed, -1e4)
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        return outs


def _compare(seq: int, inner: str):
    keep = torch.ones(2, seq, dtype=torch.long)
    keep[0, 0] = 0  # batch 0's first key is padding: its first row sees no key, and only rank 0 holds it
    r = compare_with_one_process(UnevenEdges, lambda: (torch.randn(2, seq, DIM), keep), dtype=torch.float64,
                                 layout="contiguous", inner=inner)
    return r.max_error(), r.summary(), r.attention


@pytest.mark.parametrize("world,inner", [(2, "eager"), (4, "eager"), (2, "aot_eager")])
def test_empty_shards_and_rows_with_no_key_on_one_rank(world, inner):
    """Under aot_eager too: whether any rank has an empty row is a branch on a value, inside a custom op."""
    for rank, (err, summary, attention) in enumerate(run_on_ranks(_compare, world, 3 * world, inner, timeout=120)):
        assert err < 1e-9, f"rank {rank}: {summary}"
        assert len(attention) == 2 and all(a["strategy"] != "whole" for a in attention), attention


def _unshard_errors(cases: list[dict]) -> list[str]:
    """Each case's ``unshard_sequence`` on this rank: the error it raised, or "no error"."""
    rank = dist.get_rank()
    out = []
    for case in cases:
        lengths = case["held"]
        try:
            unshard_sequence(torch.zeros(2, lengths[rank]), 1, length=case["length"][rank])
            out.append("no error")
        except ValueError as exc:
            out.append(str(exc))
    return out


def _round_trip(length: int) -> torch.Tensor:
    x = torch.arange(2.0 * length).view(2, length).requires_grad_()
    whole = unshard_sequence(shard_sequence(x, 1), 1)
    whole.sum().backward()
    return whole.detach(), x.grad


@pytest.mark.parametrize("world", [2, 3, 4])
def test_unshard_rejects_shards_that_do_not_fit_on_every_rank(world):
    """3 * world + 1 positions, contiguous: rank 0 holds 4, the others 3. A length one short puts rank 0 alone
    off the layout; the extra position on the last rank instead puts ranks 0 and world - 1 off it; ranks
    passing different lengths disagree. After the errors the group still works."""
    n = 3 * world + 1
    even = [4] + [3] * (world - 1)
    cases = [dict(held=even, length=[n - 1] * world),
             dict(held=[3] * (world - 1) + [4], length=[None] * world),
             dict(held=even, length=[n + r for r in range(world)])]
    results = run_on_ranks(_unshard_errors, world, cases, timeout=30)
    for case, messages in zip(cases, zip(*results)):
        assert len(set(messages)) == 1, (case, messages)  # the same on every rank
    one_short, last_long, differ = results[0]
    assert "rank(s) [0] hold [4] positions along dim 1" in one_short
    assert f"rank(s) [0, {world - 1}] hold [3, 4] positions" in last_long
    assert "the ranks differ in length" in differ
    for whole, grad in run_on_ranks(_round_trip, world, n, timeout=30):
        assert whole.tolist() == torch.arange(2.0 * n).view(2, n).tolist()
        assert grad.tolist() == torch.ones(2, n).tolist()
