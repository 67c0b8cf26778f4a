"""Chunked local attention (Llama-4's local layers) written by hand, against one process.

A small language model (hidden 32, 2 layers) interleaves a *chunked* local layer, whose mask is built
from positions floor-divided by the chunk size (``pos[:, None] // C == pos[None, :] // C``, with causal
``kv <= q``), with a global causal layer. The mask reaches attention in three spellings: a boolean SDPA
``attn_mask``, an additive SDPA mask (``zeros.masked_fill(~mask, finfo.min)``) and ``masked_fill(-inf)`` before a
hand-written softmax; one variant also ands in a key padding mask. Each must be captured as ``chunk=8``
(no S x S value, no fallback), run with the requested strategy, and match one process in float64 to
1e-9 relative, at P=2 and P=4 with S=61 (which neither divides). One launch per world size; one pytest
item per case.

Dry-run plans (one process) check the other spellings of the chunk index: ``torch.div(..., rounding_mode=
"floor")``, an offset that is a multiple of the chunk (the same chunks), and offsets that shift the chunks
(a constant, or transformers' per-row left padding ``(pos - pad[b]) // C``), which are not position-only
chunks and become segment ids (``[B, S]``, still no S x S value).
"""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

HIDDEN, HEADS, VOCAB, CHUNK, SEQ = 32, 4, 64, 8, 61


class Layer(nn.Module):
    """Pre-norm attention and MLP; the mask arrives as a ``[B|1, 1, S, S]`` boolean and is applied in ``style``."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, x, mask, style: str):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
        if style == "bool":
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif style == "additive":
            additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, torch.finfo(q.dtype).min)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=additive)
        else:  # masked_fill before a hand-written softmax
            scores = (q @ k.transpose(-1, -2)) * (HIDDEN // HEADS) ** -0.5
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.out(o.transpose(1, 2).reshape(b, s, HIDDEN))
        return x + self.mlp(self.norm2(x))


class ChunkedLM(nn.Module):
    """Layer 0: chunked local attention (chunk ``CHUNK``, causal); layer 1: global causal attention."""

    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, attention_mask=None):
        pos = torch.arange(ids.size(1), device=ids.device)
        causal = pos[None, :] <= pos[:, None]
        chunk_q, chunk_k = pos[:, None] // CHUNK, pos[None, :] // CHUNK
        masks = [(causal & (chunk_q == chunk_k))[None, None], causal[None, None]]
        if attention_mask is not None:  # key padding
            keys = attention_mask[:, None, None, :].bool()
            masks = [m & keys for m in masks]
        x = self.embed(ids)
        for layer, mask in zip(self.layers, masks):
            x = layer(x, mask, self.style)
        return self.head(x)


# (mask spelling, key padding, strategy)
CASES = [("bool", False, "ring"), ("additive", True, "zigzag"), ("masked_fill", False, "zigzag")]
WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]


def _inputs(padded: bool):
    ids = torch.randint(0, VOCAB, (2, SEQ))
    if not padded:
        return (ids,)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, SEQ - 3:] = 0  # right padding that leaves every row a visible key of its chunk
    return ids, mask


def _run(cases):
    results = {}
    for style, padded, strategy in cases:
        torch._dynamo.reset()
        torch.manual_seed(0)  # every rank builds the same inputs
        inputs = _inputs(padded)
        r = compare_with_one_process(lambda: ChunkedLM(style), lambda: inputs, dtype=torch.float64, strategy=strategy)
        results[(style, padded, strategy)] = {
            "error": r.max_error(), "summary": r.summary(), "fallbacks": r.fallbacks, "attention": r.attention,
            "squares": [v for g in r.compiled_reports for v in g.square_values]}
    return results


@functools.cache
def _results(world: int):
    return run_on_ranks(_run, world, CASES, timeout=300)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_chunked_local_attention_matches_one_process(case, world):
    style, padded, strategy = case
    for rank, results in enumerate(_results(world)):
        r = results[case]
        where = f"{style} padded={padded} {strategy} S={SEQ} P={world} rank {rank}"
        assert r["error"] <= 1e-9, f"{where}: {r['summary']}"
        assert r["fallbacks"] == [], f"{where}: {r['fallbacks']}"
        assert r["squares"] == [], f"{where}: S x S values {r['squares']}"
        attention = r["attention"]
        assert [a["strategy"] for a in attention] == [strategy] * 2, f"{where}: {attention}"
        assert [(a["chunk"], a["causal"], a["key_mask"]) for a in attention] == [
            (CHUNK, True, padded), (0, True, padded)], f"{where}: {attention}"


class ChunkIndex(nn.Module):
    """One causal attention whose chunk index of position ``p`` is spelled ``spelling``."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)

    def forward(self, x, pad):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
        pos = torch.arange(s)
        chunks = {"div_floor": lambda: torch.div(pos, CHUNK, rounding_mode="floor")[None],
                  "aligned_offset": lambda: ((pos + 2 * CHUNK) // CHUNK)[None],
                  "shifted": lambda: ((pos + 3) // CHUNK)[None],
                  "left_padding": lambda: (pos[None, :] - pad[:, None]) // CHUNK}[self.spelling]()
        same = chunks[:, :, None] == chunks[:, None, :]
        mask = (same & (pos[None, :] <= pos[:, None]))[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("spelling, mask", [("div_floor", f"causal, chunk {CHUNK}"),
                                            ("aligned_offset", f"causal, chunk {CHUNK}"),
                                            ("shifted", "causal, segment_ids"),
                                            ("left_padding", "causal, segment_ids")])
def test_chunk_index_spellings_are_structured(spelling, mask):
    torch._dynamo.reset()
    plan = autoshard.plan(ChunkIndex(spelling), (torch.randn(2, SEQ, HIDDEN), torch.tensor([3, 0])), world_size=2,
                          strategy="ring")
    assert [(a.strategy, a.mask) for a in plan.attention] == [("ring", mask)]
    assert plan.fallbacks == []
