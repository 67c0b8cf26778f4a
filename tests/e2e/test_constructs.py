"""Constructs third-party model code uses, each in a small model written here, against one process:

* ``buffer_mask`` -- the hand-written GPT of nanoGPT / minGPT: a causal mask read from a registered buffer,
  ``att.masked_fill(self.bias[:, :, :T, :T] == 0, -inf)``; the buffer's values make it causal, and a
  guard checks on every call that they have not changed;
* ``rope_complex`` -- Llama-1's (Meta reference) RoPE in complex form: ``polar(ones, outer(arange(S),
  inv_freq))``, ``view_as_complex``, a complex product, ``view_as_real``; the angles are built for the local
  positions only;
* ``eos_pooling`` -- a CLIP-style text encoder pooled at its end-of-text token, ``h[arange(B), (ids ==
  eos).int().argmax(-1)]``, a ``[B, B]`` contrastive loss (not a sequence x sequence value), ``max`` with
  indices, ``argmin`` with ties across ranks, and a slice that leaves some ranks no position;
* ``latent_attention`` -- DeepSeek's multi-head latent attention: a value head dim (4) other than the query
  and key head dim (8), keys written into a ``new_empty`` buffer by slice assignment and ``copy_`` (made
  out-of-place by the ``functionalize`` pass, then split), a router gate ``zeros_like(s).scatter_(-1, topk, 1)``;
* ``alibi`` -- ALiBi as the paper writes it (``-slope * (q - k)`` added to hand-written scores, or ``slope * (q -
  k)`` subtracted from them, then a causal ``masked_fill``) and as Bloom does (``slope * k`` plus an additive
  causal mask, through SDPA): the slopes are found from the graph and carried to the distributed op, which adds
  the bias from global positions;
* ``relative_bias`` -- T5's learned relative-position buckets (``relative_attention_bias(bucket(k - q))``, the
  bucketing with ``log``, ``where``, ``min``), in an encoder layer and a causal decoder layer: the bucket
  computation is emitted again on the vector of every distance, the table looked up there (a ``[H, 2S - 1]``
  bias, not S x S) and carried to the distributed op; the table's gradient is the sum of the ranks' shares;
* ``pinned_key`` -- HunyuanVideo's token refiner: ``m[q] & m[k]`` of a padding mask ``m`` (``view(B, 1, 1,
  S).repeat(1, 1, S, 1)`` and its transpose), then ``mask[:, :, :, 0] = True`` (a ``cat`` once functionalized), so a
  padding query sees key 0 alone: read as a key mask with key 0 joined, and a ``where`` giving those rows key 0's
  value; rows padded at the end and at the start (key 0 itself padding), every row in the loss;
* ``scan_vmap`` -- a state-space model with no attention (an ``associative_scan`` layer, a ``torch.vmap``
  layer): it runs whole, with the warning, and gives the one-process results (the ``_vmap_*_nesting``
  calls dynamo emits, unused values, stay in the graph).

Each model: hidden 32, 2 layers, a length neither world size divides (61; 13 for the scan), every case
of a world size in one launch (2 and 4 ranks), float64: loss, outputs and every parameter gradient within
1e-9 relative, 0 fallbacks, no S x S value, attention distributed with the asserted strategy, the bytes
the report books equal to the bytes sent.
"""

import functools
import math
import warnings

import pytest
import torch
import torch.utils.checkpoint
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._higher_order_ops.associative_scan import associative_scan

from autoshard.runtime import comm_counter
from autoshard.runtime.sequence_ops import constant_band
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

HIDDEN, HEADS, VOCAB, LAYERS, SEQ, EOS = 32, 4, 64, 2, 61, 3


class NanoAttention(nn.Module):
    """nanoGPT's ``CausalSelfAttention``, slow path."""

    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("bias", torch.tril(torch.ones(128, 128)).view(1, 1, 128, 128))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.c_attn(x).split(HIDDEN, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class NanoGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(128, HIDDEN)
        self.h = nn.ModuleList(NanoAttention() for _ in range(LAYERS))
        self.ln_f, self.lm_head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device))
        for block in self.h:
            x = x + block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def apply_rotary_emb(x, freqs_cis):
    """Llama-1's ``apply_rotary_emb``: pairs of features as complex numbers, rotated by ``freqs_cis``."""
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, x_.shape[1], 1, x_.shape[-1])  # reshape_for_broadcast
    return torch.view_as_real(x_ * freqs_cis).flatten(3).type_as(x)


class MetaAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))

    def forward(self, x, freqs_cis):
        b, s, _ = x.shape
        xq, xk, xv = (w(x).view(b, s, HEADS, HIDDEN // HEADS) for w in (self.wq, self.wk, self.wv))
        xq, xk = apply_rotary_emb(xq, freqs_cis), apply_rotary_emb(xk, freqs_cis)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, HIDDEN))


class LlamaOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(MetaAttention() for _ in range(LAYERS))
        self.norm, self.output = nn.RMSNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens, labels):
        dim = HIDDEN // HEADS
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        freqs = torch.outer(torch.arange(tokens.size(1), device=tokens.device), inv_freq).float()
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = h + layer(h, freqs_cis)
        logits = self.output(self.norm(h)).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


class TextBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.qkv, self.out = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(self.ln(x)).chunk(3, -1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(o.transpose(1, 2).reshape(b, s, HIDDEN))


class ClipText(nn.Module):
    """A CLIP-style text tower pooled at the end-of-text token, a contrastive loss against image features,
    and other reads of the sequence at data-dependent positions."""

    def __init__(self):
        super().__init__()
        self.token, self.position = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(128, HIDDEN)
        self.blocks = nn.ModuleList(TextBlock() for _ in range(LAYERS))
        self.ln_final, self.projection = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 16, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, ids, image_features):
        b, s = ids.shape
        x = self.token(ids) + self.position(torch.arange(s, device=ids.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln_final(x)
        pooled = x[torch.arange(b, device=x.device), (ids == EOS).int().argmax(dim=-1)]
        text = F.normalize(self.projection(pooled), dim=-1)
        logits = self.logit_scale.exp() * text @ F.normalize(image_features, dim=-1).t()  # [B, B]
        labels = torch.arange(b, device=x.device)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        best, where = x.max(dim=1)
        first_negative = (x[..., 0] > 0).int().argmin(dim=1)  # ties everywhere: the first position wins
        head, head_where = x[:, :3].min(dim=1)  # three positions: ranks beyond the first hold none
        return loss, best, where, first_negative, head, head_where


NOPE, ROPE, VDIM, LATENT, EXPERTS = 6, 2, 4, 16, 4


class LatentAttention(nn.Module):
    """DeepSeek-style multi-head latent attention: q/k head dim ``NOPE + ROPE`` = 8, value head dim 4, keys
    assembled in a fresh buffer (``new_empty``, slice assignment, ``copy_`` of a part shared by every head), and
    a router's top-2 one-hot gate built in place (``zeros_like(scores).scatter_``)."""

    def __init__(self):
        super().__init__()
        self.wq, self.wkv_a = nn.Linear(HIDDEN, HEADS * (NOPE + ROPE)), nn.Linear(HIDDEN, LATENT + ROPE)
        self.wkv_b, self.wo = nn.Linear(LATENT, HEADS * (NOPE + VDIM)), nn.Linear(HEADS * VDIM, HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS)
        self.expert_scale = nn.Parameter(torch.randn(EXPERTS, HIDDEN) / 4)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, HEADS, NOPE + ROPE).transpose(1, 2)
        latent, k_pe = self.wkv_a(x).split([LATENT, ROPE], dim=-1)
        k_nope, v = self.wkv_b(latent).view(b, s, HEADS, NOPE + VDIM).transpose(1, 2).split([NOPE, VDIM], dim=-1)
        k = k_nope.new_empty(b, HEADS, s, NOPE + ROPE)
        k[:, :, :, :NOPE] = k_nope
        k[:, :, :, NOPE:].copy_(k_pe.unsqueeze(1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        scores = self.router(x)
        gate = torch.zeros_like(scores).scatter_(-1, scores.topk(2, dim=-1).indices, 1.0)
        return x + self.wo(o.transpose(1, 2).reshape(b, s, HEADS * VDIM)) * (1 + gate @ self.expert_scale)


def alibi_slopes(heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes (a power-of-two head count): a geometric sequence from 2^(-8 / heads)."""
    start = 2 ** (-8 / heads)
    return torch.tensor([start ** (i + 1) for i in range(heads)])


class AlibiAttention(nn.Module):
    """ALiBi, as the paper writes it (hand-written: ``-slope * (q - k)`` added to the scores, or ``slope * (q - k)``
    subtracted from them, then a causal ``masked_fill``) or as Bloom does (``slope * k`` plus an additive causal
    mask, through SDPA)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.register_buffer("slopes", alibi_slopes(HEADS), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        pos = torch.arange(s, device=x.device)
        if self.form in ("paper", "subtracted"):  # subtracted: scores - slope * (q - k), the same bias
            distance = pos[None, :, None] - pos[None, None, :]
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
            att = (scores + -self.slopes[:, None, None] * distance if self.form == "paper"
                   else scores - self.slopes[:, None, None] * distance)
            att = att.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
            y = att.softmax(-1) @ v
        else:
            alibi = (self.slopes[:, None] * pos[None, :].float()).view(1, HEADS, 1, s)
            causal = torch.full((s, s), float("-inf"), device=x.device).triu(1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=alibi + causal)
        return x + self.out(y.transpose(1, 2).reshape(b, s, HIDDEN))


def relative_position_bucket(relative_position, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128):
    """T5's bucketing of ``k - q`` (transformers' ``T5Attention._relative_position_bucket``): exact for small
    distances, logarithmic up to ``max_distance``, one bucket beyond."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    if_large = max_exact + (torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact)
                            * (num_buckets - max_exact)).to(torch.long)
    if_large = torch.min(if_large, torch.full_like(if_large, num_buckets - 1))
    return relative_buckets + torch.where(is_small, relative_position, if_large)


class RelativeAttention(nn.Module):
    """T5's self-attention: unscaled scores plus a learned bias per head and distance bucket
    (``relative_attention_bias(bucket(k - q))``), bidirectional (an encoder) or causal (a decoder, the bias plus
    an additive ``finfo.min`` mask)."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.qkv, self.o = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False), nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.relative_attention_bias = nn.Embedding(32, HEADS)

    def compute_bias(self, length: int, device):
        context_position = torch.arange(length, dtype=torch.long, device=device)[:, None]
        memory_position = torch.arange(length, dtype=torch.long, device=device)[None, :]
        bucket = relative_position_bucket(memory_position - context_position, bidirectional=not self.causal)
        return self.relative_attention_bias(bucket).permute([2, 0, 1]).unsqueeze(0)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        bias = self.compute_bias(s, x.device)
        if self.causal:
            bias = bias + torch.full((s, s), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device).triu(1)
        weights = F.softmax(q @ k.transpose(3, 2) + bias, dim=-1)  # T5 upcasts half precision; this runs float64
        return x + self.o((weights @ v).transpose(1, 2).reshape(b, s, HIDDEN))


def _combine(a, b):
    (gate_a, value_a), (gate_b, value_b) = a, b
    return gate_a * gate_b, value_a * gate_b + value_b


class ScanBlock(nn.Module):
    """A gated linear recurrence h_t = g_t h_{t-1} + x_t by ``associative_scan``."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        gate, value = self.inp(x).chunk(2, -1)
        _, h = associative_scan(_combine, (torch.sigmoid(gate), value), dim=1, combine_mode="generic")
        return x + self.out(h)


class VmapBlock(nn.Module):
    """A per-sample mix through ``torch.vmap``."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.vmap(lambda row: self.mix(row) * row.mean(0))(x)


class StackLM(nn.Module):
    """Embeddings, a stack of residual layers (each adds its own input), an optional final norm, an LM head, the
    mean cross-entropy: the frame of the construct models below."""

    def __init__(self, layers, norm: nn.Module | None = None, head_bias: bool = True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(layers)
        self.norm, self.head = norm or nn.Identity(), nn.Linear(HIDDEN, VOCAB, bias=head_bias)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(self.norm(x)).view(-1, VOCAB), labels.view(-1))


class Checkpointed(nn.Module):
    """A layer under activation checkpointing, as a training step runs it."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False)


def checkpointed(make):
    """``make()`` with every layer checkpointed: the score terms are built inside the checkpointed regions."""
    def build():
        model = make()
        model.layers = nn.ModuleList(Checkpointed(layer) for layer in model.layers)
        return model
    return build


def latent_lm():
    return StackLM([LatentAttention() for _ in range(LAYERS)], nn.RMSNorm(HIDDEN), head_bias=False)


def alibi_lm():
    return StackLM([AlibiAttention(form) for form in ("paper", "bloom", "subtracted")], nn.LayerNorm(HIDDEN),
                   head_bias=False)


def relative_lm():
    return StackLM([RelativeAttention(causal=False), RelativeAttention(causal=True)])


def scan_lm():
    return StackLM([ScanBlock(), VmapBlock()])


class PinnedKeyAttention(nn.Module):
    """Bidirectional attention under HunyuanVideo's refiner mask (built by :class:`RefinerLM`)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        return x + self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, -1))


class RefinerLM(nn.Module):
    """HunyuanVideo's ``HunyuanVideoIndividualTokenRefiner`` mask over a padded batch, as it writes it."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)
        self.layers = nn.ModuleList(PinnedKeyAttention() for _ in range(LAYERS))

    def forward(self, ids, labels, padding):
        b, s = ids.shape
        rows = padding.bool().view(b, 1, 1, s).repeat(1, 1, s, 1)
        mask = (rows & rows.transpose(2, 3)).bool()
        mask[:, :, :, 0] = True
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, mask)
        return F.cross_entropy(self.head(x).view(-1, VOCAB), labels.view(-1))


def _padded_tokens():
    padding = torch.ones(2, SEQ, dtype=torch.long)
    padding[0, 41:], padding[1, :5] = 0, 0  # the end of one row, the start (key 0 too) of the other
    return *_tokens(), padding


def _tokens(seq=SEQ):
    ids = torch.randint(4, VOCAB, (2, seq))
    return ids, ids.clone()


def _clip_inputs():
    ids = torch.randint(4, VOCAB, (2, SEQ))
    ids[0, SEQ - 1] = EOS               # on the last rank
    ids[1, 20], ids[1, 45] = EOS, EOS   # on two ranks: the first wins
    return ids, torch.randn(2, 16)


CASES = {  # name: (model, inputs, strategy; None: no attention)
    "buffer_mask": (NanoGPT, _tokens, "ring"),
    "rope_complex": (LlamaOne, _tokens, "zigzag"),
    "eos_pooling": (ClipText, _clip_inputs, "zigzag"),
    "latent_attention": (latent_lm, _tokens, "ulysses"),
    "alibi": (alibi_lm, _tokens, "zigzag"),
    "relative_bias": (relative_lm, _tokens, "ring"),
    "alibi_checkpointed": (checkpointed(alibi_lm), _tokens, "zigzag"),
    "latent_checkpointed": (checkpointed(latent_lm), _tokens, "ulysses"),
    "pinned_key": (RefinerLM, _padded_tokens, "ring"),
    "scan_vmap": (scan_lm, functools.partial(_tokens, 13), None),  # short: dynamo traces the scan slowly
}
WORLDS = (2, pytest.param(4, marks=pytest.mark.slow))


def _run():
    results = {}
    for name, (model, inputs, strategy) in CASES.items():
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught, comm_counter() as sent:
            warnings.simplefilter("always")
            r = compare_with_one_process(model, inputs, dtype=torch.float64, outputs="gathered",  # bytes in the graph
                                         **({"strategy": strategy} if strategy else {}))
        results[name] = {
            "error": r.max_error(), "summary": r.summary(), "fallbacks": r.fallbacks, "attention": r.attention,
            "squares": [v for g in r.compiled_reports for v in g.square_values],
            "placements": {k: v for g in r.compiled_reports for k, v in g.placements.items()},
            "comms": [(c.kind, c.node, c.phase, c.reason) for g in r.compiled_reports for c in g.comms],
            "booked": sum(c.bytes_by_rank[dist.get_rank()] for g in r.compiled_reports for c in g.comms),
            "measured": sent.payload_bytes_sent, "warnings": [str(w.message) for w in caught]}
    return results


@functools.cache
def _results(world: int):
    return run_on_ranks(_run, world, timeout=300)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(CASES))
def test_construct_matches_one_process(name, world):
    strategy = CASES[name][2]
    for rank, results in enumerate(_results(world)):
        r = results[name]
        where = f"{name} P={world} rank {rank}"
        assert r["error"] <= 1e-9, f"{where}: {r['summary']}"
        assert r["fallbacks"] == [], f"{where}: {r['fallbacks']}"
        assert r["squares"] == [], f"{where}: S x S values {r['squares']}"
        assert r["booked"] == r["measured"], f"{where}: bytes booked {r['booked']}, sent {r['measured']}"
        if strategy is None:  # no attention: whole, and said so
            assert r["attention"] == [], f"{where}: {r['attention']}"
            assert any("runs whole on every rank" in w for w in r["warnings"]), f"{where}: {r['warnings']}"
            continue
        attention, layers = r["attention"], 3 if name.startswith("alibi") else LAYERS
        assert len(attention) == layers and all(a["strategy"] == strategy for a in attention), f"{where}: {attention}"
        causal = {"relative_bias": [False, True], "pinned_key": [False] * layers}.get(name, [True] * layers)
        assert [a["causal"] for a in attention] == causal, f"{where}: {attention}"
        if name.startswith("alibi"):  # every form: the slopes carried to the distributed op
            assert all(a["alibi"] for a in attention), f"{where}: {attention}"
        if name == "relative_bias":  # the learned table tabulated per distance, its gradient summed over ranks
            assert all(a["position_bias"] for a in attention), f"{where}: {attention}"
        if name == "rope_complex":  # the angles of the local positions only
            assert r["placements"]["freqs_cis"].startswith("S(0"), f"{where}: {r['placements']}"
        if name == "eos_pooling":  # small collectives: candidates all-gathered, the pooled rows all-reduced
            reasons = {(kind, node): why for kind, node, phase, why in r["comms"] if phase == "forward"}
            assert reasons[("all_gather", "argmax")] == "extreme candidates", f"{where}: {r['comms']}"
            assert ("all_reduce", "pooled") in reasons, f"{where}: {r['comms']}"
            assert not any(kind == "all_gather" and node.startswith("x") for kind, node in reasons), r["comms"]


def test_band_guard_verifies_a_changed_buffer_again():
    """``autoshard::check_band`` passes a buffer that still holds its band after an in-place change and fails
    one that no longer does."""
    mask = torch.tril(torch.ones(6, 6)).view(1, 1, 6, 6)
    band = constant_band(mask)
    check = torch.ops.autoshard.check_band.default
    check(mask, band.inside, band.outside, band.lo, band.hi, "bias")
    mask.mul_(1.0)  # a new version, the same values
    check(mask, band.inside, band.outside, band.lo, band.hi, "bias")
    mask[0, 0, 0, 5] = 1.0
    with pytest.raises(RuntimeError, match="no longer holds the mask"):
        check(mask, band.inside, band.outside, band.lo, band.hi, "bias")
