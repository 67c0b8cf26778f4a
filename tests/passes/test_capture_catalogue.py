"""The catalogue of the attention spellings capture recognizes, one tiny function each, checked through dry-run plans.

Every function below takes ``m, q, k, v`` (the module, for its buffers; ``[B, H, S, D]`` projected from an input
marked as split along its dim 1) and spells attention one way: ``F.scaled_dot_product_attention`` with
``is_causal``, a boolean mask, an additive mask or ``enable_gqa``; hand-written ``softmax(q @ k^T * scale + mask) @
v`` with the mask added, ``masked_fill``ed or ``where``d in; K/V repeated for grouped-query attention
(``repeat_kv``); causal and bidirectional sliding windows; chunked local attention; key padding; packed documents;
a soft-cap; dropout; ALiBi; a relative-position table; attention sinks (gpt-oss); nanoGPT's ``tril`` buffer; a function marked with
:func:`autoshard.attention_function`. ``SPELLINGS`` lists them with what the plan must say: one pytest item each
plans the spelling on ``WORLD`` ranks (``autoshard.plan``: one process, no process group) and checks its
attention record -- distributed with the requested strategy, what structures its mask (the plan's ``mask``
column), its K/V head count, the output split along the queries -- and that nothing is gathered. After the
catalogue: masks that stay dense (given whole, or read from a buffer without values), scores that are no
attention, and a spelling capture misses (``xfail``).

A spelling capture learns (:mod:`autoshard.passes.capture`, :mod:`autoshard.passes.masks`) is a function here
and a line in ``SPELLINGS``.
"""

import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard

WORLD, BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 2, 16, 4, 2, 4
HIDDEN = HEADS * HEAD_DIM
WINDOW, CHUNK, CAP, MAX_DISTANCE = 3, 4, 5.0, 4


def _positions(q):
    """(query positions ``[S, 1]``, key positions ``[1, S]``)."""
    pos = torch.arange(q.size(-2), device=q.device)
    return pos[:, None], pos[None, :]


def _causal(q):
    """``[S, S]`` bool, True where the key is at or before the query."""
    q_pos, k_pos = _positions(q)
    return k_pos <= q_pos


def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))


# ----------------------------------------------------------------------------- F.scaled_dot_product_attention


def sdpa(m, q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def sdpa_is_causal(m, q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_bool_mask(m, q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(q))


def sdpa_tril_mask(m, q, k, v):
    s = q.size(-2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(s, s, dtype=torch.bool).tril())


def sdpa_additive_triu(m, q, k, v):
    s = q.size(-2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.full((s, s), float("-inf")).triu(1))


def sdpa_additive_where(m, q, k, v):
    additive = torch.where(_causal(q), 0.0, torch.finfo(q.dtype).min)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=additive[None, None])


def sdpa_enable_gqa(m, q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def sdpa_dropout(m, q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)


def _repeat_kv(x, times: int):
    """transformers' ``repeat_kv``."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, times, s, d).reshape(b, h * times, s, d)


def sdpa_repeat_kv(m, q, k, v):
    times = q.size(1) // k.size(1)
    return F.scaled_dot_product_attention(q, _repeat_kv(k, times), _repeat_kv(v, times), is_causal=True)


# ----------------------------------------------------------------------------- hand-written softmax(QK^T)V


def handwritten(m, q, k, v):
    return _scores(q, k).softmax(-1) @ v


def handwritten_added_mask(m, q, k, v):
    additive = torch.zeros(q.size(-2), q.size(-2)).masked_fill(~_causal(q), float("-inf"))
    return F.softmax(_scores(q, k) + additive, dim=-1) @ v


def handwritten_masked_fill(m, q, k, v):
    return _scores(q, k).masked_fill(~_causal(q), float("-inf")).softmax(-1) @ v


def handwritten_where(m, q, k, v):
    return torch.where(_causal(q), _scores(q, k), float("-inf")).softmax(-1) @ v


def handwritten_scale_first(m, q, k, v):
    """The scale on q, a multiplication by ``1 / sqrt(D)`` on the scores' other side."""
    scores = (1.0 / math.sqrt(q.size(-1))) * (q @ k.transpose(-2, -1))
    return scores.masked_fill(~_causal(q), float("-inf")).softmax(-1) @ v


def handwritten_mild_fill(m, q, k, v):
    """Masked scores set to -1e4, not -inf (a row that sees no key would attend to every key)."""
    return _scores(q, k).masked_fill(~_causal(q), -1e4).softmax(-1) @ v


def handwritten_buffer_tril(m, q, k, v):
    """nanoGPT: a ``tril(ones)`` buffer, read back as causal because the plan sees its values."""
    s = q.size(-2)
    return _scores(q, k).masked_fill(m.bias[:, :, :s, :s] == 0, float("-inf")).softmax(-1) @ v


def handwritten_softcap(m, q, k, v):
    """Gemma2's attention logit cap, ``tanh(s / c) * c``, before the mask."""
    capped = torch.tanh(_scores(q, k) / CAP) * CAP
    return capped.masked_fill(~_causal(q), float("-inf")).softmax(-1) @ v


def handwritten_dropout(m, q, k, v):
    probs = _scores(q, k).masked_fill(~_causal(q), float("-inf")).softmax(-1)
    return F.dropout(probs, 0.1, training=True) @ v


def handwritten_float32_softmax(m, q, k, v):
    """The softmax upcast and cast back (HF's eager attention)."""
    probs = F.softmax(_scores(q, k).masked_fill(~_causal(q), float("-inf")), dim=-1, dtype=torch.float32)
    return probs.to(q.dtype) @ v


# ----------------------------------------------------------------------------- mask structures


def causal_window(m, q, k, v):
    q_pos, k_pos = _positions(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(k_pos <= q_pos) & (k_pos > q_pos - WINDOW))


def bidirectional_window(m, q, k, v):
    """ModernBERT's local layers: ``abs(q - k) <= w``."""
    q_pos, k_pos = _positions(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(q_pos - k_pos).abs() <= WINDOW)


def chunked(m, q, k, v):
    """Llama-4's chunked local attention."""
    q_pos, k_pos = _positions(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=q_pos // CHUNK == k_pos // CHUNK)


def chunked_causal(m, q, k, v):
    q_pos, k_pos = _positions(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(q_pos // CHUNK == k_pos // CHUNK) & (k_pos <= q_pos))


def key_padding(m, q, k, v, keep):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :].bool())


def causal_key_padding(m, q, k, v, keep):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_causal(q)[None, None] & keep[:, None, None, :].bool())


def packed_documents(m, q, k, v, documents):
    same = documents[:, None, :, None] == documents[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=same & _causal(q))


def alibi(m, q, k, v):
    """ALiBi as the paper writes it: ``-slope * (q - k)`` added to the scores, then a causal ``masked_fill``."""
    q_pos, k_pos = _positions(q)
    scores = _scores(q, k) + -m.slopes[:, None, None] * (q_pos - k_pos)
    return scores.masked_fill(~_causal(q), float("-inf")).softmax(-1) @ v


def alibi_bloom(m, q, k, v):
    """ALiBi as Bloom writes it: ``slope * k`` plus an additive causal mask, through SDPA."""
    s = q.size(-2)
    bias = (m.slopes[:, None] * torch.arange(s, dtype=q.dtype)[None, :]).view(1, -1, 1, s)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias + torch.full((s, s), float("-inf")).triu(1))


def relative_position(m, q, k, v):
    """A learned bias per head and clamped distance (T5-like, without the buckets)."""
    q_pos, k_pos = _positions(q)
    distance = (k_pos - q_pos).clamp(-MAX_DISTANCE, MAX_DISTANCE) + MAX_DISTANCE
    bias = m.distance_bias(distance).permute(2, 0, 1)[None]
    return F.softmax(q @ k.transpose(-2, -1) + bias, dim=-1) @ v


def sinks(m, q, k, v):
    """gpt-oss's attention sinks: one learned logit per head joins every row's softmax (the max subtracted first),
    its column then dropped; a causal sliding window added in."""
    q_pos, k_pos = _positions(q)
    visible = _causal(q) & (k_pos > q_pos - WINDOW)
    scores = _scores(q, k) + torch.where(visible, 0.0, float("-inf"))
    column = m.sinks.reshape(1, -1, 1, 1).expand(q.size(0), -1, q.size(-2), -1)
    combined = torch.cat([scores, column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return F.softmax(combined, dim=-1)[..., :-1] @ v


def sinks_amax(m, q, k, v):
    """Attention sinks with the row maximum taken by ``amax`` and a causal ``masked_fill``."""
    scores = _scores(q, k).masked_fill(~_causal(q), float("-inf"))
    combined = torch.cat([scores, m.sinks[None, :, None, None].expand(*scores.shape[:-1], 1)], dim=-1)
    return (combined - combined.amax(-1, keepdim=True)).softmax(-1)[:, :, :, :-1] @ v


@autoshard.attention_function
def _marked(q, k, v, *, causal=False, scale=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def marked_function(m, q, k, v):
    return _marked(q, k, v, causal=True)


# ----------------------------------------------------------------------------- what stays dense or is not captured


def dense_input_mask(m, q, k, v, allowed):
    """A mask the model is given whole: nothing says how it is made."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def relu_scores(m, q, k, v):
    """Scores through a relu before the softmax: looks like attention, but is none distributed attention computes."""
    return torch.relu(_scores(q, k)).softmax(-1) @ v


def alibi_subtracted(m, q, k, v):
    """ALiBi with its bias subtracted, ``scores - slope * (q - k)``: the same attention as :func:`alibi`."""
    q_pos, k_pos = _positions(q)
    scores = _scores(q, k) - m.slopes[:, None, None] * (q_pos - k_pos)
    return scores.masked_fill(~_causal(q), float("-inf")).softmax(-1) @ v


# ----------------------------------------------------------------------------- the catalogue


def _keep():
    keep = torch.ones(BATCH, SEQ, dtype=torch.long)
    keep[1, SEQ - 5:] = 0
    return keep


def _documents():
    return torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])


def _allowed():
    return torch.rand(SEQ, SEQ, generator=torch.Generator().manual_seed(0)) > 0.3


SPELLINGS = {  # name: (function, extra inputs, the plan's mask, K/V heads)
    "sdpa": (sdpa, None, "none", HEADS),
    "sdpa_is_causal": (sdpa_is_causal, None, "causal", HEADS),
    "sdpa_bool_mask": (sdpa_bool_mask, None, "causal", HEADS),
    "sdpa_tril_mask": (sdpa_tril_mask, None, "causal", HEADS),
    "sdpa_additive_triu": (sdpa_additive_triu, None, "causal", HEADS),
    "sdpa_additive_where": (sdpa_additive_where, None, "causal", HEADS),
    "sdpa_enable_gqa": (sdpa_enable_gqa, None, "causal", KV_HEADS),
    "sdpa_repeat_kv": (sdpa_repeat_kv, None, "causal", KV_HEADS),
    "sdpa_dropout": (sdpa_dropout, None, "causal, dropout", HEADS),
    "handwritten": (handwritten, None, "none", HEADS),
    "handwritten_added_mask": (handwritten_added_mask, None, "causal", HEADS),
    "handwritten_masked_fill": (handwritten_masked_fill, None, "causal", HEADS),
    "handwritten_where": (handwritten_where, None, "causal", HEADS),
    "handwritten_scale_first": (handwritten_scale_first, None, "causal", HEADS),
    "handwritten_mild_fill": (handwritten_mild_fill, None, "causal", HEADS),
    "handwritten_buffer_tril": (handwritten_buffer_tril, None, "causal", HEADS),
    "handwritten_softcap": (handwritten_softcap, None, "causal", HEADS),
    "handwritten_dropout": (handwritten_dropout, None, "causal, dropout", HEADS),
    "handwritten_float32_softmax": (handwritten_float32_softmax, None, "causal", HEADS),
    "causal_window": (causal_window, None, "causal, window", HEADS),
    "bidirectional_window": (bidirectional_window, None, "window", HEADS),
    "chunked": (chunked, None, f"chunk {CHUNK}", HEADS),
    "chunked_causal": (chunked_causal, None, f"causal, chunk {CHUNK}", HEADS),
    "key_padding": (key_padding, _keep, "key_mask", HEADS),
    "causal_key_padding": (causal_key_padding, _keep, "causal, key_mask", HEADS),
    "packed_documents": (packed_documents, _documents, "causal, segment_ids", HEADS),
    "alibi": (alibi, None, "causal, alibi", HEADS),
    "alibi_bloom": (alibi_bloom, None, "causal, alibi", HEADS),
    "relative_position": (relative_position, None, "position_bias", HEADS),
    "sinks": (sinks, None, "causal, window, sinks", HEADS),
    "sinks_amax": (sinks_amax, None, "causal, sinks", HEADS),
    "marked_function": (marked_function, None, "causal", HEADS),
}


class Attend(nn.Module):
    """Projects a ``[B, S, HIDDEN]`` input marked as split along dim 1 to q, k, v and attends as ``spelling`` does.
    Grouped-query spellings get ``KV_HEADS`` K/V heads."""

    def __init__(self, spelling, kv_heads: int = HEADS):
        super().__init__()
        self.spelling, self.kv_heads = spelling, kv_heads
        self.q = nn.Linear(HIDDEN, HIDDEN)
        self.kv = nn.Linear(HIDDEN, 2 * kv_heads * HEAD_DIM)
        self.register_buffer("bias", torch.ones(SEQ, SEQ).tril().view(1, 1, SEQ, SEQ))
        self.register_buffer("slopes", 2.0 ** -torch.arange(1.0, HEADS + 1))
        self.distance_bias = nn.Embedding(2 * MAX_DISTANCE + 1, HEADS)
        self.sinks = nn.Parameter(torch.randn(HEADS))

    def forward(self, x, *extra):
        x = autoshard.mark_sequence(x, 1)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, HEAD_DIM).permute(2, 0, 3, 1, 4)
        return self.spelling(self, q, k, v, *extra)


def _plan(spelling, extra=None, kv_heads=HEADS, **options):
    torch._dynamo.reset()
    torch.manual_seed(0)
    inputs = (torch.randn(BATCH, SEQ, HIDDEN),) + ((extra(),) if extra is not None else ())
    return autoshard.plan(Attend(spelling, kv_heads), inputs, world_size=WORLD, **options)


@functools.cache
def _planned(name: str):
    """The plan of a spelling of the catalogue, with the ring strategy."""
    spelling, extra, _, kv_heads = SPELLINGS[name]
    return _plan(spelling, extra, kv_heads, strategy="ring")


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling_is_captured_and_structured(name):
    _, _, mask, kv_heads = SPELLINGS[name]
    plan = _planned(name)
    assert [(a.strategy, a.mask) for a in plan.attention] == [("ring", mask)], plan.attention
    assert (plan.attention[0].shape["H"], plan.attention[0].shape["Hkv"]) == (HEADS, kv_heads)
    assert plan.fallbacks == [], plan.fallbacks
    assert plan.placements[plan.attention[0].node] == "S(2)", plan.placements  # split along the query positions


def test_key_padding_mask_is_a_split_key_mask():
    """The key mask is materialized as a ``[B, S]`` value (``keep.bool()``: ``ne``) and split like the tokens."""
    assert _planned("causal_key_padding").placements["g0.ne"] == "S(1)"


def test_mask_the_model_is_given_stays_dense_and_gathers_kv():
    plan = _plan(dense_input_mask, _allowed, strategy="ring")
    [attention] = plan.attention
    assert (attention.strategy, attention.mask) == ("gathered-kv", "dense"), attention
    assert attention.reason.startswith(
        "attention with a mask that is not causal / window / padding / segments: its mask is an input of this graph "
        "made by code autoshard did not compile"), attention.reason  # said once, with why and what to do
    assert [(f.node, f.op) for f in plan.fallbacks] == [("g0.k", "gather"), ("g0.v", "gather")], plan.fallbacks


def test_mask_from_a_buffer_on_the_meta_device_is_unknown():
    """nanoGPT's ``tril`` buffer without values (a model built on the meta device): planned dense, never causal."""
    torch._dynamo.reset()
    with torch.device("meta"):
        model, x = Attend(handwritten_buffer_tril), torch.randn(BATCH, SEQ, HIDDEN)
    [attention] = autoshard.plan(model, (x,), world_size=WORLD, strategy="ring").attention
    assert (attention.strategy, attention.mask) == ("gathered-kv", "unknown"), attention
    assert "module state l_self_buffers_bias_" in attention.reason, attention.reason


def test_scores_through_another_function_are_not_attention():
    """Not captured, and said where: the fallback names the line (and module) that looks like attention."""
    plan = _plan(relu_scores, strategy="ring")
    assert plan.attention == []
    (fallback,) = plan.fallbacks
    assert "through relu" in fallback.reason and "test_capture_catalogue.py\", line" in fallback.reason \
        and "in relu_scores" in fallback.reason, fallback.reason


def test_subtracted_bias_is_captured():
    assert [a.mask for a in _plan(alibi_subtracted, strategy="ring").attention] == ["causal, alibi"]
