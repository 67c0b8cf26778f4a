"""``autoshard.attention_function`` with what SDPA takes besides q, k, v: grouped-query K/V, a key mask (bool
or additive), a sliding window, on real ranks against one process. The decorated function is a hand-written
attention that honours every argument itself; under compilation it is distributed, its mask read back as
structure (a window, key padding), never gathered dense."""

import functools
import math

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

SEQ, WIDTH, HEADS, HEAD_DIM = 13, 16, 4, 4


@autoshard.attention_function
def written_out(q, k, v, *, causal=False, scale=None, attn_mask=None, window=None):
    """Attention as a user writes it: scores, masks, softmax; K/V repeated for grouped heads."""
    k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(q.size(-1)))
    offset = torch.arange(k.size(-2))[None, :] - torch.arange(q.size(-2))[:, None]
    hidden = torch.zeros_like(offset, dtype=torch.bool)
    if causal:
        hidden |= offset > 0
    if window is not None:
        left, right = window
        hidden |= (offset < -left) if left >= 0 else hidden
        hidden |= (offset > right) if right >= 0 else hidden
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        hidden = hidden | ~attn_mask
    elif attn_mask is not None:
        scores = scores + attn_mask
    return scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v


class Attending(nn.Module):
    def __init__(self, kv_heads: int, **call):
        super().__init__()
        self.kv_heads, self.call = kv_heads, call
        self.q = nn.Linear(WIDTH, HEADS * HEAD_DIM)
        self.kv = nn.Linear(WIDTH, 2 * kv_heads * HEAD_DIM)
        self.out = nn.Linear(HEADS * HEAD_DIM, WIDTH)

    def forward(self, x, keep=None):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, HEAD_DIM).permute(2, 0, 3, 1, 4)
        mask = None
        if keep is not None:  # key padding from the batch: bool, or added to the scores
            mask = keep[:, None, None, :].bool()
            if self.call.get("additive"):
                mask = torch.zeros(mask.shape, dtype=x.dtype).masked_fill(~mask, float("-inf"))
        call = {key: value for key, value in self.call.items() if key != "additive"}
        return self.out(written_out(q, k, v, attn_mask=mask, **call).transpose(1, 2).reshape(b, s, -1))


def _padding():
    keep = torch.ones(2, SEQ, dtype=torch.long)
    keep[1, 10:] = 0
    return keep


CASES = {  # name: (model kwargs, with key padding, what the plan must say of the mask)
    "gqa_causal": (dict(kv_heads=2, causal=True), False, {"causal": True, "window": None}),
    "bool_key_mask": (dict(kv_heads=4), True, {"causal": False, "key_mask": True}),
    "additive_key_mask_causal": (dict(kv_heads=2, causal=True, additive=True), True, {"causal": True, "key_mask": True}),
    "causal_window": (dict(kv_heads=2, causal=True, window=(3, -1)), False, {"causal": True, "window": (3, 0)}),
    "two_sided_window": (dict(kv_heads=4, window=(2, 3)), True, {"causal": False, "window": (2, 3), "key_mask": True}),
}


def _run_all():
    out = {}
    for name, (kwargs, padded, _) in CASES.items():
        torch._dynamo.reset()
        inputs = (lambda: (torch.randn(2, SEQ, WIDTH), _padding())) if padded else (lambda: (torch.randn(2, SEQ, WIDTH),))
        r = compare_with_one_process(functools.partial(Attending, **kwargs), inputs, dtype=torch.float64, strategy="ring")
        out[name] = (r.max_error(), r.summary(), r.fallbacks, r.attention)
    return out


@functools.cache
def _results():
    return run_on_ranks(_run_all, 2, timeout=300)


@pytest.mark.parametrize("name", CASES)
def test_attention_function_arguments_are_distributed_exactly(name):
    expected = CASES[name][2]
    for rank, result in enumerate(_results()):
        err, summary, fallbacks, attention = result[name]
        assert err < 1e-9, f"{name} rank {rank}: {summary}"
        assert fallbacks == [], f"{name} rank {rank}: {fallbacks}"
        (record,) = attention
        assert record["strategy"] == "ring" and not record.get("dense_mask"), f"{name}: {record}"
        for key, value in expected.items():
            got = record.get(key)
            got = tuple(got) if isinstance(got, list) else got
            assert (bool(got) if key == "key_mask" else got) == value, f"{name}: {key} is {got}, not {value}: {record}"


def test_outside_compilation_the_function_gets_only_the_given_arguments():
    seen = []

    @autoshard.attention_function
    def old_style(q, k, v, *, causal=False, scale=None):
        seen.append((causal, scale))
        return q

    q = torch.randn(1, 2, 3, 4)
    old_style(q, q, q, causal=True)
    assert seen == [(True, None)]
    with pytest.raises(ValueError, match="window is"):
        old_style(q, q, q, window=3)
