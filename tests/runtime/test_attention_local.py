"""The local attention primitive, the LSE merge, mask classification and the byte formulas, in one process
(plus one rank worker for the memory measurement)."""

from __future__ import annotations

import itertools
import math

import pytest
import sympy
import torch
import torch.nn.functional as F

from autoshard.runtime.attention import (MaskSpec, Visibility, attention_flops, local_attention,
                                         local_attention_backward, merge_attention)
from autoshard.runtime.attention import formulas
from autoshard.runtime.attention.base import bytes_sent
from autoshard.runtime.attention import local as local_impl
from autoshard.testing import run_on_ranks
from autoshard.testing.memory import LOW_MMAP_THRESHOLD_ENV, peak_memory

# (causal, window, key_mask, segment_ids)
MASKS = [
    (False, None, False, False),
    (True, None, False, False),
    (True, (5, 0), False, False),
    (False, (3, 4), False, False),
    (False, (0, -1), False, False),
    (False, None, True, False),
    (True, None, True, False),       # with key 0 masked the first rows see nothing: out 0, lse -inf
    (True, None, False, True),
    (True, (7, 0), True, True),
]
# (q_offset, k_offset) for Sq = 19 queries and Sk = 33 keys: aligned, keys before / after / around the queries
OFFSETS = [(0, 0), (40, 0), (0, 20), (10, 5), (5, 10), (60, 0), (100, 0)]


@pytest.fixture(params=["fused", "tiled"])
def path(request, monkeypatch):
    """'fused': the default (torch's fused kernel where a block fits, 512-tiles elsewhere); 'tiled': only
    the tiled online softmax, with tiles small enough that every block spans many of them."""
    if request.param == "tiled":
        monkeypatch.setattr(local_impl, "FUSED_BLOCKS", False)
        monkeypatch.setattr(local_impl, "TILE_Q", 8)
        monkeypatch.setattr(local_impl, "TILE_K", 16)
    return request.param


def _visible(q_offset, sq, k_offset, sk, causal, window, chunk=0):
    """The dense [sq, sk] visibility, written independently of MaskSpec."""
    i = torch.arange(q_offset, q_offset + sq).unsqueeze(1)
    j = torch.arange(k_offset, k_offset + sk).unsqueeze(0)
    mask = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        mask &= j <= i
    if window is not None:
        if window[0] >= 0:
            mask &= j >= i - window[0]
        if window[1] >= 0:
            mask &= j <= i + window[1]
    if chunk:
        mask &= torch.div(i, chunk, rounding_mode="floor") == torch.div(j, chunk, rounding_mode="floor")
    return mask


def _dense(q, k, v, q_offset, k_offset, causal, window, key_mask, segment_ids, scale, softcap=0.0, chunk=0):
    """Reference attention in float64 with an explicit mask; rows with no visible key give out 0, lse -inf.
    ``softcap``: the scaled scores become ``softcap * tanh(s / softcap)`` before the mask."""
    group = q.size(1) // k.size(1)
    keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = _visible(q_offset, q.size(2), k_offset, k.size(2), causal, window, chunk)[None, None]
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :]
    if segment_ids is not None:
        mask = mask & (segment_ids[0][:, None, :, None] == segment_ids[1][:, None, None, :])
    s = q @ keys.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return p @ values, lse


def _case(seed, heads, kv_heads, key_mask, segments, sq=19, sk=33, batch=2, dim=24, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, sq, dim, generator=g, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(batch, kv_heads, sk, dim, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    dout = torch.randn(batch, heads, sq, dim, generator=g, dtype=torch.float64).to(dtype)
    km = None
    if key_mask:
        km = torch.rand(batch, sk, generator=g) > 0.3
        km[:, 0] = False
    seg = (torch.randint(0, 3, (batch, sq), generator=g), torch.randint(0, 3, (batch, sk), generator=g)) if segments \
        else None
    return q, k, v, dout, km, seg


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (3, 1)])
def test_local_attention_matches_dense(path, heads, kv_heads):
    for n, ((causal, window, use_km, use_seg), (q_offset, k_offset)) in enumerate(itertools.product(MASKS, OFFSETS)):
        q, k, v, dout, km, seg = _case(n, heads, kv_heads, use_km, use_seg)
        kw = dict(q_offset=q_offset, k_offset=k_offset, causal=causal, window=window, key_mask=km, segment_ids=seg)
        out, lse = local_attention(q, k, v, **kw)
        dq, dk, dv = local_attention_backward(dout, q, k, v, out, lse, **kw)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = _dense(*leaves, q_offset, k_offset, causal, window, km, seg, 1 / math.sqrt(q.size(-1)))
        ref_out.backward(dout)
        where = f"mask {(causal, window, use_km, use_seg)} offsets {(q_offset, k_offset)}"
        assert out.dtype == lse.dtype == torch.float64
        torch.testing.assert_close(out, ref_out.detach(), rtol=1e-10, atol=1e-12, msg=where)
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), where
        torch.testing.assert_close(lse.nan_to_num(neginf=0.0), ref_lse.nan_to_num(neginf=0.0), rtol=1e-10, atol=1e-12)
        for name, got, ref in (("dq", dq, leaves[0].grad), ("dk", dk, leaves[1].grad), ("dv", dv, leaves[2].grad)):
            assert torch.isfinite(got).all(), (where, name)
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12, msg=f"{where} {name}")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_low_precision_inputs_accumulate_in_fp32(path, dtype, tol):
    for n, (causal, window, use_km, use_seg) in enumerate(MASKS):
        q, k, v, dout, km, seg = _case(n, 6, 2, use_km, use_seg, dtype=dtype)
        kw = dict(q_offset=10, k_offset=5, causal=causal, window=window, key_mask=km, segment_ids=seg)
        out, lse = local_attention(q, k, v, **kw)
        grads = local_attention_backward(dout, q, k, v, out, lse, **kw)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out, _ = _dense(*leaves, 10, 5, causal, window, km, seg, 1 / math.sqrt(q.size(-1)))
        ref_out.backward(dout.double())
        assert out.dtype == lse.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
        for got, ref in zip((out, *grads), (ref_out.detach(), *(t.grad for t in leaves))):
            assert (got.double() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_softcap_matches_dense(path, dtype, tol):
    """Soft-capped scores (Gemma2: ``softcap * tanh(s / softcap)`` on the scaled scores, before the mask),
    forward and backward, on every mask, with blocks on the diagonal and fully visible (where the fused
    kernel would serve them without the cap). A scale of 1 makes the scores large enough (std ~5) that the cap of 2 bends most of them."""
    offsets = [(0, 0), (40, 0)]
    for n, ((causal, window, use_km, use_seg), (q_offset, k_offset)) in enumerate(itertools.product(MASKS, offsets)):
        q, k, v, dout, km, seg = _case(n, 6, 2, use_km, use_seg, dtype=dtype)
        kw = dict(q_offset=q_offset, k_offset=k_offset, causal=causal, window=window, key_mask=km, segment_ids=seg,
                  scale=1.0, softcap=2.0)
        out, lse = local_attention(q, k, v, **kw)
        grads = local_attention_backward(dout, q, k, v, out, lse, **kw)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = _dense(*leaves, q_offset, k_offset, causal, window, km, seg, 1.0, 2.0)
        ref_out.backward(dout.double())
        where = f"mask {(causal, window, use_km, use_seg)} offsets {(q_offset, k_offset)}"
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), where
        got_lse, want_lse = lse.double().nan_to_num(neginf=0.0), ref_lse.nan_to_num(neginf=0.0)
        assert (got_lse - want_lse).abs().max() <= tol * want_lse.abs().max(), where
        for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out.detach(), *(t.grad for t in leaves))):
            assert got.dtype == dtype, (where, name)
            assert (got.double() - ref).abs().max() <= tol * ref.abs().max(), (where, name)


# (causal, window, key_mask, chunk): chunked local attention (Llama-4) alone and with the other masks
CHUNK_MASKS = [(False, None, False, 8), (True, None, True, 5), (True, (6, 0), False, 8), (True, None, False, 40)]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_chunked_attention_matches_dense(path, dtype, tol):
    """``chunk=C`` (query i sees key j only if i // C == j // C) against the dense reference, forward and
    backward, at offsets that put chunk boundaries inside the blocks, at their edges and around them; the
    FLOPs counted are exactly the visible pairs (the tiles outside the chunks are skipped)."""
    for n, ((causal, window, use_km, chunk), (q_offset, k_offset)) in enumerate(
            itertools.product(CHUNK_MASKS, [(0, 0), (16, 24), (3, 40)])):
        q, k, v, dout, km, _ = _case(n, 6, 2, use_km, False, dtype=dtype)
        kw = dict(q_offset=q_offset, k_offset=k_offset, causal=causal, window=window, chunk=chunk, key_mask=km)
        with attention_flops() as flops:
            out, lse = local_attention(q, k, v, **kw)
        grads = local_attention_backward(dout, q, k, v, out, lse, **kw)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = _dense(*leaves, q_offset, k_offset, causal, window, km, None, 1 / math.sqrt(q.size(-1)),
                                  chunk=chunk)
        ref_out.backward(dout.double())
        where = f"mask {(causal, window, use_km, chunk)} offsets {(q_offset, k_offset)}"
        pairs = int(_visible(q_offset, 19, k_offset, 33, causal, window, chunk).sum())
        assert flops.forward == 4 * 2 * 6 * 24 * pairs, where
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), where
        expected = (ref_out.detach(), *(t.grad for t in leaves))
        for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), expected):
            assert got.dtype == dtype, (where, name)
            assert (got.double() - ref).abs().max() <= tol * max(ref.abs().max(), 1e-300), (where, name)


def test_softcap_is_checked():
    q, k, v, _, _, _ = _case(0, 2, 2, False, False)
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        local_attention(q, k, v, softcap=-1.0)


def test_strided_inputs(path):
    """Inputs laid out [B, S, H, D] and transposed (as models produce them) give the same result."""
    q, k, v, dout, km, _ = _case(1, 6, 2, True, False)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout)]
    assert not strided[0].is_contiguous()
    for kw in (dict(causal=True, q_offset=14, k_offset=0), dict(key_mask=km, window=(4, 4))):
        out, lse = local_attention(q, k, v, **kw)
        strided_out, strided_lse = local_attention(*strided[:3], **kw)
        torch.testing.assert_close(strided_out, out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(strided_lse, lse, rtol=1e-12, atol=1e-12)
        for got, ref in zip(local_attention_backward(strided[3], *strided[:3], out, lse, **kw),
                            local_attention_backward(dout, q, k, v, out, lse, **kw)):
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_fully_masked_rows_give_zero_and_minus_inf():
    q, k, v, dout, _, _ = _case(0, 2, 2, False, False)
    key_mask = torch.zeros(2, 33, dtype=torch.bool)
    key_mask[:, 10:] = True  # causal rows 0..9 see only masked keys
    out, lse = local_attention(q, k, v, causal=True, key_mask=key_mask)
    dq, dk, dv = local_attention_backward(dout, q, k, v, out, lse, causal=True, key_mask=key_mask)
    assert torch.equal(out[:, :, :10], torch.zeros_like(out[:, :, :10]))
    assert torch.isneginf(lse[:, :, :10]).all() and torch.isfinite(lse[:, :, 10:]).all()
    assert torch.equal(dq[:, :, :10], torch.zeros_like(dq[:, :, :10]))
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    # current torch's SDPA agrees (older versions gave NaN on such rows)
    dense = torch.tril(torch.ones(19, 33, dtype=torch.bool)) & key_mask[:, None, None, :]
    torch.testing.assert_close(out.to(q.dtype), F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
                               rtol=1e-10, atol=1e-12)


def test_hidden_blocks_return_at_once_and_flops_count_visible_pairs():
    q, k, v, _, _, _ = _case(0, 4, 2, False, False)
    with attention_flops() as flops:
        out, lse = local_attention(q, k, v, q_offset=0, k_offset=19, causal=True)  # keys after every query
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
        assert flops.forward == 0 and flops.calls == 0
        local_attention(q, k, v, q_offset=10, k_offset=5, causal=True)
    pairs = int(_visible(10, 19, 5, 33, True, None).sum())
    assert flops.forward == 4 * 2 * 4 * 24 * pairs  # 4 * batch * heads * D per visible pair


def test_mask_spec_classification_matches_dense():
    g = torch.Generator().manual_seed(0)
    for n in range(800):
        causal = bool(torch.randint(0, 2, (), generator=g))
        window = tuple(int(x) for x in torch.randint(-1, 6, (2,), generator=g))
        window = None if torch.rand((), generator=g) < 0.3 else window
        q0, k0 = (int(x) for x in torch.randint(0, 24, (2,), generator=g))
        sq, sk = (int(x) for x in torch.randint(1, 9, (2,), generator=g))
        chunk = 0 if n % 2 else int(torch.randint(1, 7, (), generator=g))  # half of the cases chunked
        spec = MaskSpec.of(causal, window, chunk)
        dense = _visible(q0, sq, k0, sk, causal, window, chunk)
        expected = Visibility.HIDDEN if not dense.any() else Visibility.FULL if dense.all() else Visibility.PARTIAL
        assert spec.classify(q0, sq, k0, sk) is expected, (causal, window, chunk, q0, sq, k0, sk)
        assert spec.visible_pairs(q0, sq, k0, sk) == int(dense.sum())
        assert torch.equal(spec.visible(q0, sq, k0, sk), dense)


def test_mask_spec_rejects_bad_windows():
    with pytest.raises(ValueError, match="-1 for unbounded"):
        MaskSpec.of(window=(3, -2))
    with pytest.raises(ValueError, match="pair of ints"):
        MaskSpec.of(window=(3,))
    with pytest.raises(ValueError, match="chunk must be an int >= 0"):
        MaskSpec.of(chunk=-8)


def test_merge_of_halves_equals_the_whole():
    q, k, v, _, km, _ = _case(3, 4, 4, True, False)
    whole_out, whole_lse = local_attention(q, k, v, causal=True, key_mask=km)
    a = local_attention(q, k[:, :, :12], v[:, :, :12], causal=True, key_mask=km[:, :12])
    b = local_attention(q, k[:, :, 12:], v[:, :, 12:], k_offset=12, causal=True, key_mask=km[:, 12:])
    out, lse = merge_attention(*a, *b)
    torch.testing.assert_close(out, whole_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-12, atol=1e-12)
    assert torch.isneginf(lse[:, :, 0]).all() and torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))


def test_unknown_kernels_are_rejected():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="kernels must be one of"):
        local_attention(q, q, q, kernels="cuda")


# ---------------------------------------------------------------------------- formulas


def test_hybrid_formula_reduces_to_ring_and_ulysses():
    f = formulas
    for direction in ("forward", "backward"):
        hybrid = bytes_sent("hybrid", direction)
        ring = hybrid.subs({f.P_u: 1, f.P_r: f.P})
        ulysses = hybrid.subs({f.P_r: 1, f.P_u: f.P})
        assert sympy.simplify(ring - bytes_sent("ring", direction)) == 0
        assert sympy.simplify(ulysses - bytes_sent("ulysses", direction)) == 0


def test_formula_values():
    subs = formulas.values(B=1, S=1024, H=8, Hkv=2, D=64, P=4, dtype=torch.bfloat16, key_mask=True)
    # ring forward: 3 blocks of 256 tokens, each token 2 * 2 heads * 64 * 2 bytes + 1 mask byte
    assert bytes_sent("ring").subs(subs) == 3 * 256 * (2 * 2 * 64 * 2 + 1)
    assert bytes_sent("zigzag", "backward").subs(subs) == 3 * 256 * (2 * 2 * 64 * 2 + 1 + 2 * 2 * 64 * 4)


# ---------------------------------------------------------------------------- memory


def _peak_extra_memory(seq: int, dim: int) -> dict[str, int]:
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 1, seq, dim, generator=g) for _ in range(4))
    key_mask = torch.rand(1, seq, generator=g) > 0.1
    peaks = {}
    for name, kw in (("tiled (causal + key_mask)", dict(causal=True, key_mask=key_mask)),
                     ("fused (causal)", dict(causal=True))):
        warm = {k: v[:, :1024] if isinstance(v, torch.Tensor) else v for k, v in kw.items()}  # first-use buffers
        local_attention_backward(*(t[:, :, :1024] for t in (dout, q, k, v)), *local_attention(
            *(t[:, :, :1024] for t in (q, k, v)), **warm), **warm)
        with peak_memory() as mem:
            out, lse = local_attention(q, k, v, **kw)
            local_attention_backward(dout, q, k, v, out, lse, **kw)
        peaks[name] = mem.peak_bytes
    return peaks


def test_torch_path_memory_is_far_below_the_scores():
    seq, dim = 8192, 64
    scores = seq * seq * 4  # the [S x S] float32 scores of one (batch, head): 256 MiB
    (peaks,) = run_on_ranks(_peak_extra_memory, 1, seq, dim, env=LOW_MMAP_THRESHOLD_ENV, timeout=120)
    print(f"\npeak extra memory at S_local={seq}, D={dim}: "
          + ", ".join(f"{k}: {v / 2**20:.1f} MiB ({v / scores:.3f} of the scores)" for k, v in peaks.items()))
    for name, peak in peaks.items():
        assert 0 < peak < scores / 8, (name, peak)
