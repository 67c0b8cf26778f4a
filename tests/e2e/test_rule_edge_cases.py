"""Rule edge cases found in review, each against one process (outputs and parameter gradients):

* elementwise losses keep their extra arguments on shards (``beta``, ``delta``, per-position and
  broadcast ``weight``, ``pos_weight``; the weighted mean of ``mse_loss`` / ``l1_loss`` divides by the
  summed weights);
* ``arange`` in every spelling (keywords, a step), as a factory and inside a structured attention mask;
* selecting one position of a split value: no inf or NaN held by other ranks leaks into it, bool and
  integer values work;
* ``unbind`` off the sequence dim keeps the split (timm-style ``q, k, v = qkv.unbind(0)``), along it
  gathers.

Every case of one world size runs in one launch (a launch costs seconds); one pytest item per case.
"""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

DIM, HEADS = 8, 2


class Losses(nn.Module):
    """Every elementwise loss with its extra arguments, on a split sequence."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.register_buffer("class_weight", torch.rand(DIM) + 0.5)  # the BCEs have no weight gradients
        self.register_buffer("pos_weight", torch.rand(DIM) + 0.5)
        self.weight_scale = nn.Parameter(torch.rand(DIM) + 0.5)

    def forward(self, x, t, w):
        h = self.proj(autoshard.mark_sequence(x, 1))
        p, y = torch.sigmoid(h), torch.sigmoid(t)
        per_token = w[..., :1]  # [B, S, 1]: a weight per position
        return (F.smooth_l1_loss(h, t, beta=0.3),
                F.smooth_l1_loss(h, t, None, None, "sum", 0.2),  # positional, legacy arguments included
                F.smooth_l1_loss(h, t, reduction="none", beta=0.3),
                F.huber_loss(h, t, delta=0.4),
                F.huber_loss(h, t, "mean", 0.4, w),
                F.binary_cross_entropy(p, y, per_token),
                F.binary_cross_entropy(p, y, self.class_weight, reduction="sum"),
                F.binary_cross_entropy_with_logits(h, y, weight=per_token, pos_weight=self.pos_weight),
                F.binary_cross_entropy_with_logits(h, y, weight=self.class_weight, reduction="none"),
                F.mse_loss(h, t, weight=w * self.weight_scale),
                F.l1_loss(h, t, weight=w))


class Aranges(nn.Module):
    """``arange`` with keywords and steps: positions of the local tokens, and a causal mask built from them."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, 3 * DIM)

    def forward(self, x):
        h = self.proj(autoshard.mark_sequence(x, 1))
        b, s, _ = h.shape
        q, k, v = (t.view(b, s, HEADS, DIM // HEADS).transpose(1, 2) for t in h.chunk(3, -1))
        by_keyword = torch.arange(start=2, end=2 + 3 * s, step=3, dtype=h.dtype)
        positional = torch.arange(1, 1 + 2 * s, 2, dtype=h.dtype)
        tokens = torch.arange(end=s)
        causal = tokens[None, :] <= torch.arange(start=0, end=s)[:, None]
        stepped = tokens[None, :] <= torch.arange(0, 2 * s, step=2)[:, None]  # query i sees keys j <= 2 i: not causal
        return (h * by_keyword[None, :, None] + positional[:, None],
                F.scaled_dot_product_attention(q, k, v, attn_mask=causal),
                F.scaled_dot_product_attention(q, k, v, attn_mask=stepped))


class SelectOne(nn.Module):
    """One position of a split value whose other positions hold inf, and of split bool / integer values."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x, fill):
        h = self.proj(autoshard.mark_sequence(x, 1))
        z = h + fill  # inf at the last position
        positive = h > 0
        return z[:, 0] * 2, h[:, 0] * positive[:, 0], h[:, -1] * (positive.long()[:, -1] + 1)


class UnbindAttention(nn.Module):
    """timm's attention: ``qkv.reshape(...).permute(2, 0, 3, 1, 4).unbind(0)``; and unbinds of a split value
    along other dims and along the sequence."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x, along_sequence: bool):
        x = autoshard.mark_sequence(x, 1)
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = self.proj(o.transpose(1, 2).reshape(b, n, c))
        first, second = h.unbind(0)  # [S, C] each: the split moves to dim 0
        columns = h.unbind(2)         # [B, S] each
        out = (first * second, columns[0] - columns[-1])
        if along_sequence:
            tokens = h.unbind(1)
            out += (tokens[0] * tokens[-1],)
        return out


def _losses(seq):
    return compare_with_one_process(Losses, lambda: (torch.randn(2, seq, DIM), torch.randn(2, seq, DIM),
                                                     torch.rand(2, seq, DIM) + 0.1), dtype=torch.float64)


def _aranges(seq):
    return compare_with_one_process(Aranges, lambda: (torch.randn(2, seq, DIM),), dtype=torch.float64)


def _select_one(seq):
    def inputs():
        fill = torch.zeros(2, seq, DIM)
        fill[:, -1] = float("inf")
        return torch.randn(2, seq, DIM), fill

    return compare_with_one_process(SelectOne, inputs, dtype=torch.float64)


def _unbind(seq, along_sequence):
    return compare_with_one_process(UnbindAttention, lambda: (torch.randn(2, seq, DIM), along_sequence),
                                    dtype=torch.float64)


CASES = {"losses": (_losses,), "aranges": (_aranges,), "select": (_select_one,),
         "unbind": (_unbind, False), "unbind_along_sequence": (_unbind, True)}


def _run_cases(seq):
    results = {}
    for name, (fn, *args) in CASES.items():
        torch._dynamo.reset()
        r = fn(seq, *args)
        results[name] = {"error": r.max_error(), "summary": r.summary(), "fallbacks": r.fallbacks,
                         "attention": r.attention,
                         "placements": {k: v for rep in r.compiled_reports for k, v in rep.placements.items()}}
    return results


SEQ = {2: 9, 3: 13}
"""World size -> the length the cases run at (neither divides it)."""


@functools.cache
def _results(world: int) -> list[dict]:
    """Every rank's results by case: one launch per world size."""
    return run_on_ranks(_run_cases, world, SEQ[world], timeout=300)


def _unbind_keeps_the_split(r) -> None:
    assert not r["fallbacks"], r["fallbacks"]
    placed = r["placements"]  # [B, H, S, D] queries, keys and values split along S
    assert [placed[name] for name in ("q", "k", "v", "first", "second")] == ["S(2)"] * 3 + ["S(0)"] * 2, placed
    assert [a["strategy"] for a in r["attention"]] not in ([], ["whole"], ["gathered-kv"]), r["attention"]


def _unbind_along_the_sequence_is_gathered(r) -> None:
    assert any("unbinding the split sequence dim" in f for f in r["fallbacks"]), r["fallbacks"]


def _stepped_mask_stays_dense(r) -> None:
    assert any("not causal" in f for f in r["fallbacks"]), r["fallbacks"]


EXPECTED = {"unbind": _unbind_keeps_the_split, "unbind_along_sequence": _unbind_along_the_sequence_is_gathered,
            "aranges": _stepped_mask_stays_dense}
"""What a case must also show, beyond matching one process."""
ITEMS = [(world, name) for world in SEQ for name in CASES]


@pytest.mark.parametrize("world,name", [pytest.param(w, n, marks=[pytest.mark.slow] if w != 2 else []) for w, n in ITEMS],
                         ids=[f"P{w}-{n}" for w, n in ITEMS])  # the odd world in the slow tier
def test_rule_edge_cases_match_one_process(world, name):
    for rank, rank_results in enumerate(_results(world)):
        r = rank_results[name]
        where = f"{name} P={world} rank {rank}"
        assert r["error"] < 1e-9, f"{where}: {r['summary']}"
        if name in EXPECTED:
            EXPECTED[name](r)


class InPlace(nn.Module):
    """In-place ops on a split value whose result is unused (``x.mul_(3)``, ``F.relu(x, inplace=True)``,
    ``F.dropout(x, inplace=True)``), a gather of a value made before it is dropped in place, and a whole
    input dropped in place."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        if self.kind == "whole_input":  # x arrives whole (seq_dims), is dropped in place, then used whole
            d = F.dropout(x, 0.5, True, True)
            return self.proj(x), x.flip(1) * 1, d * 1
        h = torch.tanh(self.proj(autoshard.mark_sequence(x, 1)))
        before = h.flip(1)  # gathered before the in-place dropout
        h.mul_(3)
        F.relu(h, inplace=True)
        F.dropout(h, 0.5, True, True)
        return before, h.flip(1), h * 1


def _in_place(kinds):
    out = {}
    for kind in kinds:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = InPlace(kind).double()
        x = torch.randn(2, 9, 4, dtype=torch.float64)
        torch.manual_seed(1)
        ref = model(x.clone())
        options = {"seq_dims": {0: 1}} if kind == "whole_input" else {}
        compiled = torch.compile(model, backend=autoshard.backend(**options))
        torch.manual_seed(1)
        got = compiled(x.clone())
        out[kind] = max((a - b).abs().max().item() for a, b in zip(got, ref))
    return out


def test_in_place_ops_act_as_on_one_process():
    """Forward values only: the in-place ops act on values autograd saved (tanh's output), as written."""
    for errors in run_on_ranks(_in_place, 2, ["split", "whole_input"]):
        assert max(errors.values()) < 1e-12, errors


class KeywordTanhCap(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        scores = torch.tanh(input=(q @ k.transpose(-1, -2)) * 0.5 / 3.0) * 3.0
        return torch.softmax(scores, -1) @ v


def _keyword_tanh():
    r = compare_with_one_process(KeywordTanhCap, lambda: (torch.randn(2, 9, 8),), dtype=torch.float64)
    return r.max_error(), r.attention


def test_soft_cap_written_with_keywords_is_captured():
    for err, attention in run_on_ranks(_keyword_tanh, 2):
        assert err < 1e-9 and attention and attention[0]["softcap"] == 3.0, (err, attention)


class CrossAttentionMildFill(nn.Module):
    """Cross-attention to a memory that is not split (each rank's queries attend to the whole memory), under a
    -1e4 key-padding fill that hides every key of batch 1: those rows get softmax over the unmasked scores, as on
    one device."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(8, 8), nn.Linear(8, 16)

    def forward(self, x, memory, keep):
        b, s, _ = x.shape
        q = self.q(autoshard.mark_sequence(x, 1)).view(b, s, 2, 4).transpose(1, 2)
        k, v = self.kv(memory).view(b, memory.size(1), 2, 2, 4).permute(2, 0, 3, 1, 4)
        fill = torch.zeros(b, 1, 1, memory.size(1), dtype=x.dtype).masked_fill(~keep[:, None, None, :], -1e4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=fill).transpose(1, 2).reshape(b, s, 8)


def _cross_attention_mild_fill():
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1] = False
    r = compare_with_one_process(CrossAttentionMildFill, lambda: (torch.randn(2, 9, 8), torch.randn(2, 5, 8), keep),
                                 dtype=torch.float64)
    return r.max_error(), r.summary(), [a["strategy"] for a in r.attention], r.fallbacks


def test_rows_with_no_key_on_whole_tensors_get_the_unmasked_scores():
    for err, summary, strategies, fallbacks in run_on_ranks(_cross_attention_mild_fill, 2):
        assert err < 1e-9, summary
        assert strategies == ["local"] and fallbacks == [], (strategies, fallbacks)  # no query gathered
