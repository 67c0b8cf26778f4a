"""Triton attention kernels against a dense float64 reference whose mask is materialized from positions.

On a machine without a GPU every kernel runs on the CPU under ``TRITON_INTERPRET=1`` (set by this
directory's conftest) with 16x16 tiles, so shapes stay small (S <= 48) and mask cases are chosen to
make tiles fully visible, diagonal (band edge), ragged (sequence tail) and fully hidden. On CUDA the
same tests run compiled, plus larger shapes with the real block sizes, every candidate configuration,
and a check that ring steps at new offsets do not recompile.
"""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import pytest
import torch
import triton
import triton.language as tl

from autoshard.kernels import autotune
from autoshard.kernels.attention import triton_attention, triton_attention_backward, triton_attention_forward
from autoshard.kernels.attention_backward import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel
from autoshard.kernels.attention_forward import _attn_fwd_kernel
from autoshard.kernels.attention_tiles import _band_tiles
from autoshard.kernels.common import aligned_rows, triton_available
from autoshard.kernels.merge import triton_merge
from autoshard.runtime.attention import local as local_module
from autoshard.runtime.attention.dropout import AttentionDropout
from autoshard.runtime.attention.local import local_attention, local_attention_backward

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA (compiled kernels, real block sizes)")

# (atol, rtol); atol is relative to max(1, |reference|.max()) so gradients of any size compare alike.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}
slow = pytest.mark.slow
"""Interpreted on the CPU every case costs seconds: the grids keep one case per feature in the default suite (causal,
window, chunk, key mask, segments, fully masked rows, GQA / MQA, MLA, softcap, ALiBi, dropout, half precision, and
softcap with ALiBi) and mark the rest slow (``./dev test --all``): other cases of a feature, and combinations the
default cases' code paths already cover (dropout with softcap and ALiBi, ALiBi in half precision)."""


def default_only(cases, names):
    """``cases`` as pytest parameters, those whose name is not in ``names`` marked slow."""
    return [pytest.param(c, marks=() if c.name in names else slow) for c in cases]


# ----------------------------------------------------------------------------------------------------
# Reference.
# ----------------------------------------------------------------------------------------------------


def visible_mask(batch, sq, sk, *, q_offset=0, k_offset=0, causal=False, window=None, chunk=0, key_mask=None,
                 segment_ids=None):
    """[B, 1, Sq, Sk] bool: which key each query may attend, straight from the contract's definitions."""
    i = torch.arange(sq)[:, None] + q_offset
    j = torch.arange(sk)[None, :] + k_offset
    mask = torch.ones(batch, 1, sq, sk, dtype=torch.bool)
    if causal:
        mask &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            mask &= j >= i - left
        if right >= 0:
            mask &= j <= i + right
    if chunk:
        mask &= torch.div(i, chunk, rounding_mode="floor") == torch.div(j, chunk, rounding_mode="floor")
    if key_mask is not None:
        mask &= key_mask.cpu()[:, None, None, :]
    if segment_ids is not None:
        seg_q, seg_k = (s.cpu() for s in segment_ids)
        mask &= seg_q[:, None, :, None] == seg_k[:, None, None, :]
    return mask


def alibi_bias(slopes, sq, sk, q_offset=0, k_offset=0):
    """[H, Sq, Sk] float64 ALiBi bias slope[h] * (j_pos - i_pos) from global positions."""
    i = torch.arange(sq, dtype=torch.float64)[:, None] + q_offset
    j = torch.arange(sk, dtype=torch.float64)[None, :] + k_offset
    return slopes.detach().cpu().double()[:, None, None] * (j - i)


def geometric_slopes(heads, device=DEVICE):
    """The ALiBi paper's slopes 2 ** (-8 (i + 1) / H), float32 [H]."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], dtype=torch.float32, device=device)


def reference(q, k, v, dout, *, scale=None, softcap=0.0, alibi_slopes=None, dropout=None, **mask_args):
    """Dense float64 attention: (out, lse, dq, dk, dv); rows with no visible key give out 0, lse -inf.
    ``softcap``: the scaled scores become ``softcap * tanh(s / softcap)`` before the mask. ``alibi_slopes``
    [H]: the dense bias ``slope[h] * (j_pos - i_pos)`` (global positions) is added after the cap, before the mask.
    ``dropout`` (an :class:`AttentionDropout`): the normalized probabilities are multiplied by exactly the mask of
    ``dropout.keep`` (the torch path's definition) times ``1 / (1 - p)``; lse stays that of the scores."""
    q, k, v = (x.detach().cpu().double().requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    mask = visible_mask(q.shape[0], q.shape[2], k.shape[2], **mask_args)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes, q.shape[2], k.shape[2], mask_args.get("q_offset", 0),
                           mask_args.get("k_offset", 0))
    s = s.masked_fill(~mask, float("-inf"))
    any_visible = mask.any(-1, keepdim=True)
    p = torch.softmax(torch.where(any_visible, s, 0.0), dim=-1) * mask
    if dropout is not None:
        keep = dropout.keep(q.shape[0], q.shape[1], mask_args.get("q_offset", 0), q.shape[2],
                            mask_args.get("k_offset", 0), k.shape[2])
        p = p * (keep.cpu().double() * dropout.scale)
    out = p @ v.repeat_interleave(group, 1)
    out.backward(dout.detach().cpu().double())
    return out.detach(), torch.logsumexp(s.detach(), dim=-1), q.grad, k.grad, v.grad


def assert_close(name, actual, expected, dtype):
    atol, rtol = TOLERANCES[dtype]
    expected = expected.detach().cpu().double()  # the torch path's results stay on the device
    finite = expected[torch.isfinite(expected)]
    magnitude = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    assert not torch.isnan(actual).any(), f"{name} has NaN"
    torch.testing.assert_close(actual.detach().cpu().double(), expected, atol=atol * magnitude, rtol=rtol,
                               msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------------------------------
# Cases.
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    sq: int = 40
    sk: int = 40
    q_offset: int = 0
    k_offset: int = 0
    causal: bool = False
    window: Optional[Tuple[int, int]] = None
    chunk: int = 0
    key_mask: Optional[str] = None  # "random" | "batch0_empty"
    segments: bool = False
    batch: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    v_dim: Optional[int] = None  # v / out head dim (MLA); None: head_dim

    def __str__(self):
        return self.name


def make_inputs(case: Case, dtype, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

    v_dim = case.v_dim or case.head_dim
    q = randn(case.batch, case.heads, case.sq, case.head_dim)
    k = randn(case.batch, case.kv_heads, case.sk, case.head_dim)
    v = randn(case.batch, case.kv_heads, case.sk, v_dim)
    dout = randn(case.batch, case.heads, case.sq, v_dim)
    key_mask = None
    if case.key_mask is not None:
        key_mask = torch.rand(case.batch, case.sk, generator=g) < 0.7
        if case.key_mask == "batch0_empty":
            key_mask[0] = False
        key_mask = key_mask.to(device)
    segment_ids = None
    if case.segments:  # packed sequences: segment of a GLOBAL position, so q and k blocks agree
        end = max(case.q_offset + case.sq, case.k_offset + case.sk)
        seg = torch.cumsum(torch.rand(case.batch, end, generator=g) < 0.12, dim=1)
        segment_ids = (seg[:, case.q_offset:case.q_offset + case.sq].to(device),
                       seg[:, case.k_offset:case.k_offset + case.sk].to(device))
    mask_args = dict(q_offset=case.q_offset, k_offset=case.k_offset, causal=case.causal, window=case.window,
                     chunk=case.chunk, key_mask=key_mask, segment_ids=segment_ids)
    return q, k, v, dout, mask_args


# With 16x16 tiles under the interpreter (64x64 or more when compiled): which tiles each case makes
# full, band edge (diagonal), ragged or hidden is noted per case.
MASK_CASES = [
    Case("dense_ragged", sq=33, sk=45),  # no mask: full tiles and a ragged key tail
    Case("causal_aligned", sq=48, sk=48, causal=True),  # diagonal tiles, full below, hidden above
    Case("causal_unaligned", sq=37, sk=45, q_offset=20, k_offset=7, causal=True),
    Case("causal_keys_in_past", sq=40, sk=40, q_offset=48, causal=True),  # whole block full (ring step)
    Case("causal_keys_in_future", sq=40, sk=40, k_offset=48, causal=True),  # whole block hidden
    Case("causal_one_key_visible", sq=24, sk=40, q_offset=0, k_offset=23, causal=True),  # one pair visible
    Case("window_both_sides", sq=45, sk=48, q_offset=8, k_offset=3, window=(10, 5)),
    Case("sliding_window_causal", sq=48, sk=48, causal=True, window=(12, -1)),  # hidden left tiles too
    Case("window_left_only", sq=40, sk=48, q_offset=30, window=(7, -1)),
    Case("window_right_only", sq=40, sk=48, k_offset=10, window=(-1, 3)),
    Case("key_mask_causal", sq=40, sk=40, causal=True, key_mask="random"),
    Case("key_mask_only", sq=33, sk=40, key_mask="random"),
    Case("segments_causal", sq=48, sk=48, causal=True, segments=True),
    Case("segments_offsets", sq=40, sk=36, q_offset=24, k_offset=6, segments=True),
    Case("everything", sq=45, sk=41, q_offset=19, k_offset=2, causal=True, window=(17, -1), key_mask="random",
         segments=True),
    Case("fully_masked_rows", sq=40, sk=40, q_offset=16, k_offset=30, window=(6, 2), key_mask="batch0_empty"),
    Case("mha", sq=40, sk=40, causal=True, heads=2, kv_heads=2),
    Case("mqa", sq=40, sk=40, causal=True, window=(20, -1), heads=4, kv_heads=1),
    # chunked local attention: block-diagonal, so tiles outside a row tile's chunks are never visited
    Case("chunk_aligned", sq=48, sk=48, chunk=16),  # one full tile per chunk, the rest hidden
    Case("chunk_causal_unaligned", sq=33, sk=35, q_offset=5, k_offset=3, causal=True, chunk=12),  # straddling tiles
    Case("chunk_wide_causal_ring", sq=24, sk=40, q_offset=40, k_offset=8, causal=True, chunk=40),  # one chunk edge
    Case("chunk_key_mask", sq=24, sk=30, q_offset=3, causal=True, chunk=7, key_mask="random"),
    Case("chunk_disjoint", sq=16, sk=16, q_offset=32, k_offset=8, chunk=16),  # no chunk in common: hidden
]

# MLA: v's head dim Dv differs from q / k's D, narrower (D 24 -> BLOCK_D 32, Dv 12 -> BLOCK_DV 16) or wider
# (D 16, Dv 40 -> BLOCK_DV 64), both padded, through full, band-edge, ragged and masked tiles.
MLA_CASES = [
    Case("mla_causal_gqa", sq=40, sk=45, q_offset=5, causal=True, head_dim=24, v_dim=12),
    Case("mla_dense_ragged_wide_v", sq=33, sk=45, head_dim=16, v_dim=40),
    Case("mla_key_mask_mqa", sq=33, sk=40, key_mask="random", heads=4, kv_heads=1, head_dim=24, v_dim=12),
    Case("mla_segments_window_wide_v", sq=40, sk=36, q_offset=24, k_offset=6, causal=True, window=(17, -1),
         segments=True, head_dim=16, v_dim=40),
]


# ALiBi (Bloom, MPT, Falcon): blocks of a ring at nonzero offsets, so the bias must come from GLOBAL positions,
# through full (unmasked), band-edge, ragged and masked tiles; GQA / MQA (slopes per query head) and MLA.
ALIBI_CASES = [
    Case("alibi_causal_ring_q32", sq=40, sk=40, q_offset=32, causal=True),  # full tiles below the diagonal band
    Case("alibi_dense_ring_k40", sq=33, sk=45, k_offset=40),  # non-causal, keys ahead, ragged tails
    Case("alibi_causal_aligned_mqa", sq=48, sk=48, causal=True, heads=4, kv_heads=1),
    Case("alibi_causal_keys_in_past_far", sq=40, sk=40, q_offset=4096, k_offset=4040, causal=True),  # all full
    Case("alibi_key_mask_causal_ring", sq=40, sk=40, q_offset=32, causal=True, key_mask="random"),
    Case("alibi_window_segments", sq=45, sk=41, q_offset=19, k_offset=2, causal=True, window=(17, -1),
         key_mask="random", segments=True),
    Case("alibi_fully_masked_rows", sq=40, sk=40, q_offset=16, k_offset=30, window=(6, 2), key_mask="batch0_empty"),
    Case("alibi_mla_causal_gqa", sq=40, sk=45, q_offset=5, causal=True, head_dim=24, v_dim=12),
    Case("alibi_mla_ring_wide_v", sq=33, sk=40, k_offset=40, key_mask="random", head_dim=16, v_dim=40),
]


def dropout_kwargs(dropout: Optional[AttentionDropout]) -> dict:
    """The Triton functions' dropout arguments for ``dropout`` (what local.py passes them)."""
    if dropout is None:
        return {}
    return dict(dropout_p=dropout.p, dropout_seed=dropout.seed, dropout_head_offset=dropout.head_offset)


def make_dropout(p, head_offset=0, seed=1234567, device=DEVICE) -> AttentionDropout:
    return AttentionDropout(p, torch.tensor(seed, dtype=torch.int64, device=device), head_offset)


def run_and_check(case: Case, dtype, device=DEVICE, scale=None, softcap=0.0, alibi_slopes=None, dropout=None):
    q, k, v, dout, mask_args = make_inputs(case, dtype, device)
    extra = dict(scale=scale, softcap=softcap, alibi_slopes=alibi_slopes)
    out, lse = triton_attention_forward(q, k, v, **extra, **dropout_kwargs(dropout), **mask_args)
    dq, dk, dv = triton_attention_backward(dout, q, k, v, out, lse, **extra, **dropout_kwargs(dropout), **mask_args)
    for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert x.dtype == torch.float32 and x.device == q.device, f"{name}: {x.dtype} on {x.device}"
    expected = reference(q, k, v, dout, **extra, dropout=dropout, **mask_args)
    for name, actual, exp in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), expected):
        assert_close(f"{case.name} {dtype} {name}", actual, exp, dtype)
    return out, lse, (dq, dk, dv), expected


# ----------------------------------------------------------------------------------------------------
# Tests.
# ----------------------------------------------------------------------------------------------------


def test_runs_on_this_machine():
    assert triton_available(DEVICE)
    if not ON_GPU:  # the interpreter, not a compiled kernel, must be what runs on the CPU
        assert type(_attn_fwd_kernel.fn).__name__ == "InterpretedFunction"
        assert not triton_available("cuda")


def test_importing_autoshard_does_not_require_triton():
    code = "import sys; sys.modules['triton'] = None; import autoshard, autoshard.kernels"  # triton unimportable
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("case", default_only(MASK_CASES, (  # each mask kind once; GQA/MQA and ragged tiles elsewhere
    "causal_unaligned", "window_both_sides", "key_mask_causal", "segments_offsets", "fully_masked_rows",
    "chunk_causal_unaligned")), ids=str)
def test_masks_forward_backward_fp32(case):
    run_and_check(case, torch.float32)


@pytest.mark.parametrize("head_dim, dtype", [(h, d) if (h, d) in ((24, torch.bfloat16), (64, torch.float16))
                                             else pytest.param(h, d, marks=slow)
                                             for d in (torch.bfloat16, torch.float16) for h in (16, 24, 32, 64)],
                         ids=str)
def test_dtypes_and_head_dims(dtype, head_dim):
    case = Case(f"d{head_dim}", sq=37, sk=41, q_offset=11, k_offset=4, causal=True, window=(25, -1),
                batch=1, heads=2, kv_heads=1, head_dim=head_dim)
    run_and_check(case, dtype)


@pytest.mark.parametrize("case", default_only([c for c in MASK_CASES if c.name in (
    "dense_ragged", "causal_unaligned", "everything")], ("causal_unaligned",)), ids=str)
def test_softcap_forward_backward_fp32(case):
    """Soft-capped scores (Gemma2): a scale of 1 makes the scores large enough that the cap of 2 bends
    most of them, through full, band-edge and ragged tiles and every mask kind."""
    run_and_check(case, torch.float32, scale=1.0, softcap=2.0)


@pytest.mark.parametrize("case", default_only(MLA_CASES, ("mla_causal_gqa", "mla_dense_ragged_wide_v")), ids=str)
def test_mla_v_head_dim_forward_backward_fp32(case):
    out, lse, (dq, dk, dv), _ = run_and_check(case, torch.float32)
    assert out.shape == (case.batch, case.heads, case.sq, case.v_dim) and lse.shape == (case.batch, case.heads, case.sq)
    assert dq.shape[-1] == dk.shape[-1] == case.head_dim and dv.shape[-1] == case.v_dim


@pytest.mark.parametrize("case", [pytest.param(c, marks=slow) for c in MLA_CASES[:2]], ids=str)
def test_mla_v_head_dim_softcap_fp32(case):
    run_and_check(case, torch.float32, scale=1.0, softcap=2.0)


@pytest.mark.parametrize("dtype, head_dim, v_dim", [(torch.bfloat16, 24, 12),
                                                    pytest.param(torch.float16, 16, 40, marks=slow)], ids=str)
def test_mla_v_head_dim_half_precision(dtype, head_dim, v_dim):
    case = Case(f"mla_d{head_dim}_dv{v_dim}", sq=37, sk=41, q_offset=11, k_offset=4, causal=True, window=(25, -1),
                batch=1, heads=2, kv_heads=1, head_dim=head_dim, v_dim=v_dim)
    run_and_check(case, dtype)


@pytest.mark.parametrize("case", default_only(ALIBI_CASES, ("alibi_causal_ring_q32", "alibi_mla_ring_wide_v")), ids=str)
def test_alibi_forward_backward_fp32(case):
    run_and_check(case, torch.float32, alibi_slopes=geometric_slopes(case.heads))


@pytest.mark.parametrize("case", default_only([c for c in ALIBI_CASES if c.name in (
    "alibi_causal_ring_q32", "alibi_dense_ring_k40", "alibi_key_mask_causal_ring", "alibi_mla_causal_gqa")],
    ("alibi_key_mask_causal_ring",)), ids=str)
def test_alibi_softcap_fp32(case):
    """The bias is added after the cap (so it is not capped) and the cap's derivative still applies to dS."""
    run_and_check(case, torch.float32, scale=1.0, softcap=2.0, alibi_slopes=geometric_slopes(case.heads))


@slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [c for c in ALIBI_CASES if c.name in (
    "alibi_causal_ring_q32", "alibi_dense_ring_k40", "alibi_mla_causal_gqa")], ids=str)
def test_alibi_half_precision(case, dtype):
    run_and_check(replace(case, head_dim=max(case.head_dim, 32)), dtype, alibi_slopes=geometric_slopes(case.heads))


def test_alibi_slopes_are_per_query_head():
    """GQA: query heads sharing a kv head but with different slopes give different outputs, and a zero slope
    is exactly no ALiBi."""
    case = Case("alibi_heads", sq=24, sk=40, q_offset=16, causal=True, heads=4, kv_heads=1)
    q, k, v, dout, mask_args = make_inputs(case, torch.float32)
    q = q[:, :1].expand_as(q).contiguous()  # the same query in every head
    slopes = torch.tensor([0.0, 0.5, 0.0, 0.125], device=DEVICE)
    out, lse = triton_attention_forward(q, k, v, alibi_slopes=slopes, **mask_args)
    plain, plain_lse = triton_attention_forward(q, k, v, **mask_args)
    torch.testing.assert_close(out[:, 0], plain[:, 0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse[:, 2], plain_lse[:, 2], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out[:, 1], plain[:, 1]) and not torch.allclose(out[:, 1], out[:, 3])
    expected = reference(q, k, v, dout, alibi_slopes=slopes, **mask_args)
    assert_close("per-head out", out, expected[0], torch.float32)
    assert_close("per-head lse", lse, expected[1], torch.float32)


def test_alibi_ring_steps_merge_to_full_attention():
    """A query block at q_offset 32 over the keys [0, 72) split into two ring steps (k_offset 0 and 40): the
    merged steps and the summed backward shares equal one dense ALiBi attention over all keys."""
    heads, kv_heads, d = 4, 2, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, heads, 24, d, generator=g).to(DEVICE)
    k = torch.randn(1, kv_heads, 72, d, generator=g).to(DEVICE)
    v = torch.randn(1, kv_heads, 72, d, generator=g).to(DEVICE)
    dout = torch.randn(1, heads, 24, d, generator=g).to(DEVICE)
    slopes = geometric_slopes(heads)
    steps = [(0, 40), (40, 72)]
    parts = [triton_attention_forward(q, k[:, :, a:b], v[:, :, a:b], q_offset=32, k_offset=a, causal=True,
                                      alibi_slopes=slopes) for a, b in steps]
    out, lse = triton_merge(*parts[0], *parts[1])
    grads = [triton_attention_backward(dout, q, k[:, :, a:b], v[:, :, a:b], out, lse, q_offset=32, k_offset=a,
                                       causal=True, alibi_slopes=slopes) for a, b in steps]
    dq = grads[0][0] + grads[1][0]
    dk = torch.cat([grads[0][1], grads[1][1]], 2)
    dv = torch.cat([grads[0][2], grads[1][2]], 2)
    expected = reference(q, k, v, dout, alibi_slopes=slopes, q_offset=32, causal=True)
    for name, actual, exp in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), expected):
        assert_close(f"ring alibi {name}", actual, exp, torch.float32)


@slow
def test_alibi_autograd_function_single_block():
    case = Case("alibi_autograd", sq=40, sk=40, q_offset=8, causal=True, key_mask="random", head_dim=32)
    q, k, v, dout, mask_args = make_inputs(case, torch.bfloat16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    slopes = geometric_slopes(case.heads)
    out = triton_attention(q, k, v, alibi_slopes=slopes, **mask_args)
    out.backward(dout)
    expected = reference(q, k, v, dout, alibi_slopes=slopes, **mask_args)
    for name, actual, exp in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad),
                                 expected[:1] + expected[2:]):
        assert_close(f"alibi autograd {name}", actual, exp, torch.bfloat16)


def test_alibi_is_a_compile_time_flag():
    assert "HAS_ALIBI" in autotune.TUNING_KEY


@pytest.mark.parametrize("slopes", [
    torch.ones(3), torch.ones(2, 1), torch.ones(1, 2), torch.ones(2, dtype=torch.float64),
    torch.ones(2, dtype=torch.bfloat16), [0.5, 0.25]], ids=["len3", "2x1", "1x2", "float64", "bf16", "list"])
def test_alibi_slopes_errors(slopes):
    q = torch.zeros(1, 2, 8, 16, device=DEVICE)
    if isinstance(slopes, torch.Tensor):
        slopes = slopes.to(DEVICE)
    with pytest.raises(ValueError, match="alibi_slopes"):
        triton_attention_forward(q, q, q, alibi_slopes=slopes)
    with pytest.raises(ValueError, match="alibi_slopes"):
        triton_attention_backward(q, q, q, q, q, torch.zeros(1, 2, 8, device=DEVICE), alibi_slopes=slopes)


@needs_gpu
def test_alibi_slopes_on_another_device():
    q = torch.zeros(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="alibi_slopes"):
        triton_attention_forward(q, q, q, alibi_slopes=torch.ones(2))


# ----------------------------------------------------------------------------------------------------
# Dropout on the attention probabilities: the hashed mask of autoshard.runtime.attention.dropout, bit for bit.
# ----------------------------------------------------------------------------------------------------

# (case, head_offset): full, band-edge, ragged and masked tiles; GQA / MQA / MHA; ring blocks at nonzero offsets,
# positions past 2**16 (the high bits of the hash's inputs); the heads of a Ulysses rank (head_offset); MLA.
DROPOUT_CASES = [
    pytest.param(Case("drop_dense_ragged", sq=33, sk=45), 0, id="drop_dense_ragged", marks=slow),
    pytest.param(Case("drop_causal_ring_gqa", sq=37, sk=45, q_offset=20, k_offset=7, causal=True), 6,
                 id="drop_causal_ring_gqa"),
    pytest.param(Case("drop_causal_aligned_mha", sq=48, sk=48, causal=True, heads=2, kv_heads=2), 0,
                 id="drop_causal_aligned_mha", marks=slow),
    pytest.param(Case("drop_key_mask_mqa_far", sq=33, sk=40, q_offset=70000, k_offset=69990, key_mask="random",
                      heads=4, kv_heads=1), 3, id="drop_key_mask_mqa_far"),
    pytest.param(Case("drop_everything", sq=45, sk=41, q_offset=19, k_offset=2, causal=True, window=(17, -1),
                      key_mask="random", segments=True), 1, id="drop_everything", marks=slow),
    pytest.param(Case("drop_fully_masked_rows", sq=40, sk=40, q_offset=16, k_offset=30, window=(6, 2),
                      key_mask="batch0_empty"), 0, id="drop_fully_masked_rows", marks=slow),
    pytest.param(Case("drop_mla_causal_gqa", sq=40, sk=45, q_offset=5, causal=True, head_dim=24, v_dim=12), 2,
                 id="drop_mla_causal_gqa", marks=slow),
    pytest.param(Case("drop_mla_wide_v_ring", sq=33, sk=45, k_offset=40, head_dim=16, v_dim=40), 0,
                 id="drop_mla_wide_v_ring", marks=slow),
]


@pytest.mark.parametrize("p", [0.1, pytest.param(0.5, marks=slow)])
@pytest.mark.parametrize("case, head_offset", DROPOUT_CASES)
def test_dropout_forward_backward_fp32(case, head_offset, p):
    """out, lse, dq, dk, dv against the float64 reference that applies ``AttentionDropout.keep``'s mask; fp32
    tolerance (1e-5), far below what one element kept or dropped differently changes."""
    run_and_check(case, torch.float32, dropout=make_dropout(p, head_offset))


def score_terms(kind: str, heads: int) -> dict:
    """Soft-capping (scale 1, cap 2: most scores bent) and / or ALiBi slopes, by name ("" for neither)."""
    extra = dict(scale=1.0, softcap=2.0) if "softcap" in kind else {}
    if "alibi" in kind:
        extra["alibi_slopes"] = geometric_slopes(heads)
    return extra


@pytest.mark.parametrize("kind, case, p", [
    pytest.param("softcap", Case("drop_softcap_ring", sq=37, sk=45, q_offset=20, k_offset=7, causal=True), 0.1,
                 marks=slow),
    pytest.param("alibi", Case("drop_alibi_ring", sq=40, sk=40, q_offset=32, causal=True, key_mask="random"), 0.5,
                 marks=slow),
    pytest.param("softcap_alibi", Case("drop_softcap_alibi_mla", sq=40, sk=45, q_offset=5, causal=True, head_dim=24,
                                       v_dim=12), 0.5, marks=slow),
], ids=["softcap", "alibi", "softcap_alibi_mla"])
def test_dropout_with_softcap_and_alibi_fp32(kind, case, p):
    run_and_check(case, torch.float32, dropout=make_dropout(p, head_offset=4), **score_terms(kind, case.heads))


@pytest.mark.parametrize("p", [0.1, pytest.param(0.5, marks=slow)])
@pytest.mark.parametrize("causal", [pytest.param(False, marks=slow), True], ids=["dense", "causal"])
def test_dropout_mask_is_bit_exact(causal, p):
    """The kernels' mask read back exactly and compared with ``AttentionDropout.keep`` (& the visibility mask),
    element by element: q = 0 makes every visible probability 1 / n_i (n_i the row's visible keys), k and v
    are unit vectors (``k_j = v_j = e_j``, so D = Dv = 64 >= Sk), and

    * forward: ``out[i, j] = p z_ij`` -- kept where > 0;
    * dk/dv kernel, ``dout[h, i] = e_(g Sq + i)`` (g the head's place in its GQA group): ``dv[j, g Sq + i] = p z_ij``;
    * dq kernel, ``dout = 1``: ``dP = z``, so ``z_ij = n_i dq[i, j] / scale + delta_i`` -- kept where > 0.5 / (1 - p).
    Positions past 2**16, a seed near 2**31 and a head offset exercise the high bits of the hash."""
    batch, heads, kv_heads, sq, sk, d = 2, 4, 2, 24, 40, 64
    group = heads // kv_heads
    q_offset, k_offset = (70016, 70000) if causal else (70000, 69990)
    dropout = make_dropout(p, head_offset=5, seed=2**31 - 2)
    q = torch.zeros(batch, heads, sq, d, device=DEVICE)
    unit = torch.eye(sk, d, device=DEVICE).expand(batch, kv_heads, sk, d).contiguous()
    kw = dict(q_offset=q_offset, k_offset=k_offset, causal=causal, scale=0.25, **dropout_kwargs(dropout))
    visible = visible_mask(batch, sq, sk, q_offset=q_offset, k_offset=k_offset, causal=causal)  # [B, 1, Sq, Sk]
    expected = dropout.keep(batch, heads, q_offset, sq, k_offset, sk).cpu() & visible
    n_visible = visible.sum(-1, keepdim=True).double()  # [B, 1, Sq, 1]
    assert (n_visible > 0).all()

    out, lse = triton_attention_forward(q, unit, unit, **kw)
    assert (out[..., sk:] == 0).all()
    assert torch.equal(out[..., :sk].cpu() > 0, expected), "forward mask"
    kept = out[..., :sk].cpu().double() * n_visible
    torch.testing.assert_close(kept, expected.double() * dropout.scale, atol=1e-6, rtol=1e-6)
    _, plain_lse = triton_attention_forward(q, unit, unit, q_offset=q_offset, k_offset=k_offset, causal=causal,
                                            scale=0.25)
    torch.testing.assert_close(lse, plain_lse, atol=1e-6, rtol=1e-6)  # lse: before dropout

    rows = torch.eye(group * sq, d, device=DEVICE).view(group, sq, d)  # head g's row i -> e_(g Sq + i)
    dout = rows.repeat(heads // group, 1, 1).expand(batch, heads, sq, d).contiguous()
    _, _, dv = triton_attention_backward(dout, q, unit, unit, out, lse, **kw)
    dv_keep = dv[..., :group * sq].cpu().view(batch, kv_heads, sk, group, sq).permute(0, 1, 3, 4, 2)
    assert torch.equal(dv_keep.reshape(batch, heads, sq, sk) > 0, expected), "dk/dv kernel mask"

    ones = torch.ones(batch, heads, sq, d, device=DEVICE)
    delta = out.sum(-1)  # rowsum(dout * out)
    dq, _, _ = triton_attention_backward(ones, q, unit, unit, out, lse, delta=delta, **kw)
    z = dq[..., :sk].cpu().double() * n_visible / 0.25 + delta.cpu().double()[..., None]
    assert torch.equal((z > 0.5 * dropout.scale) & visible, expected), "dq kernel mask"


@pytest.mark.parametrize("p", [0.1, pytest.param(0.5, marks=slow)])
def test_dropout_half_precision(p):
    """bf16 inputs with dropout, against the float64 reference at the bf16 tolerance (2e-2 absolute relative to
    the largest reference value, 2e-2 relative)."""
    case = Case("drop_bf16", sq=37, sk=41, q_offset=11, k_offset=4, causal=True, window=(25, -1), key_mask="random",
                batch=1, heads=4, kv_heads=2, head_dim=32)
    run_and_check(case, torch.bfloat16, dropout=make_dropout(p, head_offset=2))


@pytest.mark.parametrize("p", [0.1, pytest.param(0.5, marks=slow)])
@pytest.mark.parametrize("case, kind", [
    pytest.param(Case("torch_path_ring_gqa", sq=37, sk=45, q_offset=20, k_offset=7, causal=True), "", marks=slow),
    (Case("torch_path_key_mask_mqa_far", sq=33, sk=40, q_offset=70000, k_offset=69990, key_mask="random", heads=4,
          kv_heads=1), "alibi"),
    pytest.param(Case("torch_path_mla_softcap", sq=40, sk=45, q_offset=5, causal=True, window=(20, -1), head_dim=24,
                      v_dim=12), "softcap", marks=slow),
    pytest.param(Case("torch_path_fully_masked_rows", sq=40, sk=40, q_offset=16, k_offset=30, window=(6, 2),
                      key_mask="batch0_empty"), "", marks=slow),
], ids=["ring_gqa", "key_mask_mqa_far_alibi", "mla_softcap", "fully_masked_rows"])
def test_dropout_matches_the_torch_path(case, kind, p, monkeypatch):
    """``local_attention`` / ``local_attention_backward`` with ``kernels="triton"`` (these kernels, through
    local.py's arguments) against ``kernels="torch"`` (the tiled torch path, with tiles of 24 x 20 so its tiles
    and the kernels' differ), forward and backward, with the same ``AttentionDropout``."""
    monkeypatch.setattr(local_module, "TILE_Q", 24)
    monkeypatch.setattr(local_module, "TILE_K", 20)
    extra = score_terms(kind, case.heads)
    q, k, v, dout, mask_args = make_inputs(case, torch.float32)
    dropout = make_dropout(p, head_offset=3, seed=987654321)
    results = {}
    for kernels in ("triton", "torch"):
        kw = dict(**mask_args, **extra, dropout=dropout, kernels=kernels)
        out, lse = local_attention(q, k, v, **kw)
        results[kernels] = (out, lse, *local_attention_backward(dout, q, k, v, out, lse, **kw))
    for name, actual, expected in zip(("out", "lse", "dq", "dk", "dv"), results["triton"], results["torch"]):
        assert_close(f"{case.name} p={p} {name} vs torch path", actual, expected.double(), torch.float32)
    expected = reference(q, k, v, dout, dropout=dropout, **extra, **mask_args)
    assert_close(f"{case.name} p={p} torch path out vs reference", results["torch"][0], expected[0], torch.float32)


def test_dropout_ring_steps_merge_to_full_attention():
    """Two ring steps (keys [0, 40) and [40, 72) at their global offsets) merged through the pre-dropout lse, and
    their backward shares summed, equal one dense attention with the mask over all keys."""
    heads, kv_heads, d = 4, 2, 16
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, heads, 24, d, generator=g).to(DEVICE)
    k = torch.randn(1, kv_heads, 72, d, generator=g).to(DEVICE)
    v = torch.randn(1, kv_heads, 72, d, generator=g).to(DEVICE)
    dout = torch.randn(1, heads, 24, d, generator=g).to(DEVICE)
    dropout = make_dropout(0.3, head_offset=8)
    steps = [(0, 40), (40, 72)]
    parts = [triton_attention_forward(q, k[:, :, a:b], v[:, :, a:b], q_offset=32, k_offset=a, causal=True,
                                      **dropout_kwargs(dropout)) for a, b in steps]
    out, lse = triton_merge(*parts[0], *parts[1])
    grads = [triton_attention_backward(dout, q, k[:, :, a:b], v[:, :, a:b], out, lse, q_offset=32, k_offset=a,
                                       causal=True, **dropout_kwargs(dropout)) for a, b in steps]
    dq = grads[0][0] + grads[1][0]
    dk = torch.cat([grads[0][1], grads[1][1]], 2)
    dv = torch.cat([grads[0][2], grads[1][2]], 2)
    expected = reference(q, k, v, dout, dropout=dropout, q_offset=32, causal=True)
    for name, actual, exp in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), expected):
        assert_close(f"ring dropout {name}", actual, exp, torch.float32)


@slow
def test_dropout_autograd_function_single_block():
    case = Case("drop_autograd", sq=40, sk=40, q_offset=8, causal=True, key_mask="random", head_dim=32)
    q, k, v, dout, mask_args = make_inputs(case, torch.bfloat16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    dropout = make_dropout(0.2, head_offset=1)
    out = triton_attention(q, k, v, **dropout_kwargs(dropout), **mask_args)
    out.backward(dout)
    expected = reference(q, k, v, dout, dropout=dropout, **mask_args)
    for name, actual, exp in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad),
                                 expected[:1] + expected[2:]):
        assert_close(f"dropout autograd {name}", actual, exp, torch.bfloat16)


def test_dropout_is_a_compile_time_flag_and_p_zero_is_off():
    assert "HAS_DROPOUT" in autotune.TUNING_KEY
    case = Case("drop_zero", sq=33, sk=40, q_offset=7, causal=True)
    q, k, v, dout, mask_args = make_inputs(case, torch.float32)
    out, lse = triton_attention_forward(q, k, v, **mask_args)
    off_out, off_lse = triton_attention_forward(q, k, v, dropout_p=0.0, dropout_seed=torch.tensor(5), **mask_args)
    assert torch.equal(out, off_out) and torch.equal(lse, off_lse)
    on_out, on_lse = triton_attention_forward(q, k, v, **dropout_kwargs(make_dropout(0.5)), **mask_args)
    assert not torch.allclose(on_out, out)
    torch.testing.assert_close(on_lse, lse, atol=1e-6, rtol=1e-6)
    # different seeds and head offsets give different masks
    other_seed, _ = triton_attention_forward(q, k, v, **dropout_kwargs(make_dropout(0.5, seed=7)), **mask_args)
    other_heads, _ = triton_attention_forward(q, k, v, **dropout_kwargs(make_dropout(0.5, head_offset=1)),
                                              **mask_args)
    assert not torch.allclose(other_seed, on_out) and not torch.allclose(other_heads, on_out)


@pytest.mark.parametrize("bad", [
    dict(dropout_p=1.0, dropout_seed=torch.tensor(1)), dict(dropout_p=-0.1, dropout_seed=torch.tensor(1)),
    dict(dropout_p=0.1), dict(dropout_p=0.1, dropout_seed=torch.tensor(1, dtype=torch.int32)),
    dict(dropout_p=0.1, dropout_seed=torch.tensor([1])), dict(dropout_p=0.1, dropout_seed=3),
    dict(dropout_p=0.1, dropout_seed=torch.tensor(1), dropout_head_offset=-1),
], ids=["p1", "p_negative", "no_seed", "int32_seed", "1d_seed", "int_seed", "negative_head_offset"])
def test_dropout_errors(bad):
    q = torch.zeros(1, 2, 8, 16, device=DEVICE)
    bad = {name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in bad.items()}
    with pytest.raises(ValueError, match="dropout"):
        triton_attention_forward(q, q, q, **bad)
    with pytest.raises(ValueError, match="dropout"):
        triton_attention_backward(q, q, q, q, q, torch.zeros(1, 2, 8, device=DEVICE), **bad)


def test_fp32_head_dim_not_power_of_two_with_scale():
    run_and_check(Case("d40", sq=20, sk=30, causal=True, batch=1, heads=2, kv_heads=2, head_dim=40),
                  torch.float32, scale=0.3)


def test_bf16_inputs_with_fp32_dout():
    """Ring strategies hand the backward a float32 dout (the merged out is float32)."""
    case = Case("fp32_dout", sq=33, sk=40, q_offset=7, causal=True, key_mask="random", head_dim=32)
    q, k, v, dout, mask_args = make_inputs(case, torch.bfloat16)
    dout = torch.randn(dout.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out, lse = triton_attention_forward(q, k, v, **mask_args)
    grads = triton_attention_backward(dout, q, k, v, out, lse, **mask_args)
    expected = reference(q, k, v, dout, **mask_args)
    for name, actual, exp in zip(("dq", "dk", "dv"), grads, expected[2:]):
        assert_close(f"fp32 dout {name}", actual, exp, torch.bfloat16)


def test_empty_blocks():
    q, k, v = (torch.randn(1, 2, n, 16, device=DEVICE) for n in (8, 0, 0))
    out, lse = triton_attention_forward(q, k, v)
    assert (out == 0).all() and torch.isneginf(lse).all()
    dq, dk, dv = triton_attention_backward(torch.ones_like(q), q, k, v, out, lse)
    assert (dq == 0).all() and dk.shape == dv.shape == (1, 2, 0, 16)
    out, lse = triton_attention_forward(q[:, :, :0], q, q)
    assert out.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)


def test_fully_masked_rows_are_zero_with_neg_inf_lse_and_no_nan_gradients():
    case = next(c for c in MASK_CASES if c.name == "fully_masked_rows")
    q, k, v, dout, mask_args = make_inputs(case, torch.float32)
    out, lse = triton_attention_forward(q, k, v, **mask_args)
    dq, dk, dv = triton_attention_backward(dout, q, k, v, out, lse, **mask_args)
    empty = ~visible_mask(case.batch, case.sq, case.sk, **mask_args).any(-1)[:, 0]  # [B, Sq]
    assert empty[0].all() and empty.any() and not empty[1].all()
    assert (out.cpu()[empty[:, None].expand(-1, case.heads, -1)] == 0).all()
    assert torch.isneginf(lse.cpu()[empty[:, None].expand(-1, case.heads, -1)]).all()
    assert (dq.cpu()[empty[:, None].expand(-1, case.heads, -1)] == 0).all()
    assert (dk[0] == 0).all() and (dv[0] == 0).all()  # batch 0 masks every key
    assert all(torch.isfinite(x).all() for x in (out, dq, dk, dv))


@pytest.mark.parametrize("v_dim", [None, pytest.param(40, marks=slow)], ids=["dv_is_d", "mla_dv40"])
def test_ring_steps_merge_and_accumulate_to_the_full_result(v_dim):
    """Two key blocks at their global offsets, merged with triton_merge; the backward of each block
    from the FINAL out / lse (and a shared delta) sums to the gradients over all keys."""
    full = Case("ring", sq=24, sk=40, q_offset=24, causal=True, key_mask="random", segments=True, v_dim=v_dim)
    q, k, v, dout, mask_args = make_inputs(full, torch.float32)
    key_mask, (seg_q, seg_k) = mask_args["key_mask"], mask_args["segment_ids"]
    split = 17
    blocks = [dict(k_offset=0, sl=slice(0, split)), dict(k_offset=split, sl=slice(split, full.sk))]
    partial = []
    for blk in blocks:
        kw = dict(q_offset=full.q_offset, k_offset=blk["k_offset"], causal=True, key_mask=key_mask[:, blk["sl"]],
                  segment_ids=(seg_q, seg_k[:, blk["sl"]]))
        blk["kw"] = kw
        partial.append(triton_attention_forward(q, k[:, :, blk["sl"]], v[:, :, blk["sl"]], **kw))
    out, lse = triton_merge(*partial[0], *partial[1])
    delta = (dout.float() * out).sum(-1)
    grads = [triton_attention_backward(dout, q, k[:, :, b["sl"]], v[:, :, b["sl"]], out, lse, delta=delta, **b["kw"])
             for b in blocks]
    dq = grads[0][0] + grads[1][0]
    dk = torch.cat([grads[0][1], grads[1][1]], dim=2)
    dv = torch.cat([grads[0][2], grads[1][2]], dim=2)
    expected = reference(q, k, v, dout, **mask_args)
    for name, actual, exp in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), expected):
        assert_close(f"ring {name}", actual, exp, torch.float32)


def test_merge_kernel():
    g = torch.Generator().manual_seed(3)
    batch, heads, seq, head_dim = 2, 3, 37, 24
    out_a, out_b = (torch.randn(batch, heads, seq, head_dim, generator=g) for _ in range(2))
    lse_a, lse_b = (torch.randn(batch, heads, seq, generator=g) * 3 for _ in range(2))
    lse_a[0, 0, :5] = float("-inf")  # a contributes nothing
    lse_b[0, 1, 3:9] = float("-inf")  # b contributes nothing
    lse_a[1, 2, 10:14] = float("-inf")  # neither: out 0, lse -inf
    lse_b[1, 2, 10:14] = float("-inf")
    out_a[lse_a == float("-inf")] = 0.0
    out_b[lse_b == float("-inf")] = 0.0
    # out_b as a non-contiguous view, and bf16: the kernel reads strides and merges in fp32
    out_b_view = out_b.transpose(1, 2).contiguous().transpose(1, 2)
    dev = [x.to(DEVICE) for x in (out_a, lse_a, out_b_view, lse_b)]
    out, lse = triton_merge(*dev)
    lse_ref = torch.logaddexp(lse_a.double(), lse_b.double())
    w_a = torch.where(torch.isneginf(lse_a), 0.0, torch.exp(lse_a.double() - lse_ref)).nan_to_num(0.0)
    w_b = torch.where(torch.isneginf(lse_b), 0.0, torch.exp(lse_b.double() - lse_ref)).nan_to_num(0.0)
    out_ref = out_a.double() * w_a[..., None] + out_b.double() * w_b[..., None]
    assert out.dtype == lse.dtype == torch.float32
    assert_close("merge lse", lse, lse_ref, torch.float32)
    assert_close("merge out", out, out_ref, torch.float32)
    assert torch.isneginf(lse[1, 2, 10:14].cpu()).all() and (out[1, 2, 10:14] == 0).all()


@pytest.mark.parametrize("v_dim", [None, pytest.param(16, marks=slow)], ids=["dv_is_d", "mla_dv16"])
def test_autograd_function_single_block_in_input_dtype(v_dim):
    case = Case("autograd", sq=40, sk=40, causal=True, window=(15, -1), key_mask="random", head_dim=32, v_dim=v_dim)
    q, k, v, dout, mask_args = make_inputs(case, torch.bfloat16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = triton_attention(q, k, v, **mask_args)
    out.backward(dout)
    assert out.dtype == q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16
    expected = reference(q, k, v, dout, **mask_args)
    for name, actual, exp in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad),
                                 expected[:1] + expected[2:]):
        assert_close(f"autograd {name}", actual, exp, torch.bfloat16)


def test_non_contiguous_inputs():
    """q/k/v as [B, S, H, D] storage viewed as [B, H, S, D] (what a model's transpose produces)."""
    case = Case("strided", sq=33, sk=40, causal=True, q_offset=7)
    q, k, v, dout, mask_args = make_inputs(case, torch.float32)
    q, k, v, dout = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, dout))
    assert not q.is_contiguous()
    out, lse = triton_attention_forward(q, k, v, **mask_args)
    grads = triton_attention_backward(dout, q, k, v, out, lse, **mask_args)
    for name, actual, exp in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                 reference(q, k, v, dout, **mask_args)):
        assert_close(f"strided {name}", actual, exp, torch.float32)


def test_rows_off_16_byte_boundaries_are_realigned():
    """bf16 rows of 12 values (24 bytes) read wrong values in the kernels compiled for sm_90 (seen on an H200):
    ``aligned_rows`` copies them into 16-byte rows and leaves aligned tensors alone, and the results come back
    contiguous with the values of a dense run."""
    odd = torch.randn(1, 2, 5, 12, dtype=torch.bfloat16, device=DEVICE)
    aligned = aligned_rows(odd)
    assert torch.equal(aligned, odd) and all(s * 2 % 16 == 0 for s in aligned.stride()[:-1])
    even = torch.randn(1, 2, 5, 16, dtype=torch.bfloat16, device=DEVICE)
    assert aligned_rows(even) is even and aligned_rows(even.transpose(1, 2)).data_ptr() == even.data_ptr()
    case = Case("mla_bf16_odd_rows", sq=21, sk=23, causal=True, batch=1, heads=2, kv_heads=1, head_dim=24, v_dim=12)
    out, lse, grads, _ = run_and_check(case, torch.bfloat16)
    assert out.is_contiguous() and all(g.is_contiguous() for g in grads)


@pytest.mark.parametrize("bad, error, match", [
    (dict(q=torch.zeros(1, 2, 8, 300), k=torch.zeros(1, 2, 8, 300), v=torch.zeros(1, 2, 8, 300)), ValueError,
     "head dim 300"),
    (dict(v=torch.zeros(1, 2, 8, 300)), ValueError, "v head dim 300"),
    (dict(v=torch.zeros(1, 2, 7, 16)), ValueError, r"v \[B, Hkv, Sk, Dv\]"),
    (dict(v=torch.zeros(1, 1, 8, 16)), ValueError, r"v \[B, Hkv, Sk, Dv\]"),
    (dict(k=torch.zeros(1, 2, 8, 16, dtype=torch.float16)), TypeError, "share a dtype"),
    (dict(q=torch.zeros(1, 3, 8, 16)), ValueError, "multiple of the kv heads"),
    (dict(window=(-2, 0)), ValueError, "window bounds"),
    (dict(key_mask=torch.ones(1, 7, dtype=torch.bool)), ValueError, "key_mask"),
    (dict(segment_ids=(torch.zeros(1, 8), torch.zeros(1, 8))), TypeError, "integer"),
    (dict(scale=0.0), ValueError, "scale"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(q_offset=2 ** 31), ValueError, "q_offset"),
    (dict(q=torch.zeros(1, 2, 8, 16, dtype=torch.float64)), TypeError, "float64"),
])
def test_clear_errors(bad, error, match):
    args = dict(q=torch.zeros(1, 2, 8, 16), k=torch.zeros(1, 2, 8, 16), v=torch.zeros(1, 2, 8, 16))
    args = {name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in {**args, **bad}.items()}
    if isinstance(args.get("segment_ids"), tuple):
        args["segment_ids"] = tuple(s.to(DEVICE) for s in args["segment_ids"])
    if "key_mask" in args:
        args["key_mask"] = args["key_mask"].to(DEVICE)
    with pytest.raises(error, match=match):
        triton_attention_forward(**args)


H100_SMEM = 232448  # bytes of shared memory one block may use on Hopper (227 KB)


@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize("head_dim, v_dim", [(64, 64), (128, 128), (256, 256), (256, 128), (64, 128)])
@pytest.mark.parametrize("masked", [False, True])
def test_config_pruning(kernel, head_dim, v_dim, masked):
    """The autotuner's candidates are pruned per dtype, head dims and mask kind to what fits (the
    estimates were calibrated on sm_90 compiles); the compiled kernels' configurations, not the
    interpreter's single one, are checked here. (256, 128): MLA's padded D = 192, Dv = 128."""
    candidates = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                  for m, n, w, s in autotune.CANDIDATES[kernel] + autotune.FP32_CANDIDATES]
    flags = dict(BLOCK_D=head_dim, BLOCK_DV=v_dim, SQ_BUCKET=1 << 14, SK_BUCKET=1 << 14, HAS_LEFT=False,
                 HAS_RIGHT=True, HAS_KEY_MASK=masked, HAS_SEG=False)
    bf16 = torch.empty(0, dtype=torch.bfloat16)
    kept = autotune.fitting_configs(kernel, candidates, dict(Q=bf16, **flags), H100_SMEM)
    assert kept and all(autotune.shape(c) in autotune.CANDIDATES[kernel] for c in kept)
    for c in kept:
        m, n, warps, stages = autotune.shape(c)
        smem, live = autotune.resources(kernel, m, n, head_dim, v_dim, stages, 2, masked)
        assert (n if kernel == "dkdv" else m) >= 16 * warps
        assert smem <= H100_SMEM and live <= autotune.REGISTER_BUDGET * 32 * warps or len(kept) == 1
    if max(head_dim, v_dim) <= 128:  # the preferred (first) candidate fits at the head dims that matter most
        assert autotune.shape(kept[0]) == autotune.CANDIDATES[kernel][0]
    fp32 = autotune.fitting_configs(kernel, candidates, dict(Q=bf16.float(), **flags), H100_SMEM)
    assert [autotune.shape(c) for c in fp32] == autotune.FP32_CANDIDATES
    short = autotune.fitting_configs(kernel, candidates, dict(Q=bf16, **{**flags, "SQ_BUCKET": 32, "SK_BUCKET": 64}),
                                     H100_SMEM)
    assert all(c.kwargs["BLOCK_M"] <= 32 and c.kwargs["BLOCK_N"] <= 64 for c in short) or short == kept
    small_gpu = autotune.fitting_configs(kernel, candidates, dict(Q=bf16, **flags), 48 * 1024)
    assert len(small_gpu) >= 1  # a GPU with little shared memory still gets a configuration


# ----------------------------------------------------------------------------------------------------
# Tile classification: the loop bounds visit exactly the tiles holding a visible pair, and the
# unmasked phase exactly the tiles every row sees entirely.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _band_tiles_probe(Params, Out, BLOCK: tl.constexpr, HAS_BEFORE: tl.constexpr, HAS_AFTER: tl.constexpr,
                      HAS_CHUNK: tl.constexpr):
    i = tl.program_id(0)
    first_pos = tl.load(Params + 7 * i)
    last_pos = tl.load(Params + 7 * i + 1)
    other_offset = tl.load(Params + 7 * i + 2)
    other_len = tl.load(Params + 7 * i + 3)
    before = tl.load(Params + 7 * i + 4)
    after = tl.load(Params + 7 * i + 5)
    chunk = tl.load(Params + 7 * i + 6)
    lo, full_lo, full_hi, hi = _band_tiles(first_pos, last_pos, other_offset, other_len, before, after, chunk,
                                           BLOCK, HAS_BEFORE, HAS_AFTER, HAS_CHUNK)
    slot = tl.arange(0, 4)
    tl.store(Out + 4 * i + slot, tl.where(slot == 0, lo, tl.where(slot == 1, full_lo, tl.where(slot == 2, full_hi, hi))))


@pytest.mark.parametrize("has_before, has_after, has_chunk", [
    pytest.param(*flags, marks=[] if flags in ((True, True, False), (True, True, True)) else slow) for flags in (
        (False, False, False), (True, False, False), (False, True, False), (True, True, False), (False, False, True),
        (True, True, True))])
def test_band_tiles_visit_exactly_the_needed_tiles(has_before, has_after, has_chunk):
    block, n = 16, 160
    g = torch.Generator().manual_seed(int(has_before) * 2 + int(has_after) + 4 * int(has_chunk))
    first = torch.randint(0, 120, (n,), generator=g)
    params = torch.stack([first, first + torch.randint(0, 2 * block, (n,), generator=g),
                          torch.randint(0, 120, (n,), generator=g), torch.randint(1, 80, (n,), generator=g),
                          torch.randint(0, 40, (n,), generator=g), torch.randint(0, 40, (n,), generator=g),
                          torch.randint(1, 48, (n,), generator=g)], 1)
    params[:8, 4:6] = 0  # band of width 1 (causal diagonal)
    out = torch.empty(n, 4, dtype=torch.int32, device=DEVICE)
    _band_tiles_probe[(n,)](params.to(torch.int32).to(DEVICE), out, BLOCK=block, HAS_BEFORE=has_before,
                            HAS_AFTER=has_after, HAS_CHUNK=has_chunk)
    for (first_pos, last_pos, offset, length, before, after, chunk), (lo, full_lo, full_hi, hi) in zip(
            params.tolist(), out.cpu().tolist()):
        rows = torch.arange(first_pos, last_pos + 1)[:, None]
        pos = torch.arange(length)[None, :] + offset
        seen = torch.ones(rows.shape[0], length, dtype=torch.bool)
        if has_before:
            seen &= pos >= rows - before
        if has_after:
            seen &= pos <= rows + after
        if has_chunk:
            seen &= pos // chunk == rows // chunk
        tiles = range(0, length, block)
        needed = {t for t in tiles if seen[:, t:t + block].any()}
        fully = {t for t in tiles if t + block <= length and seen[:, t:t + block].all()}
        visited_partial = list(range(lo, full_lo, block)) + list(range(full_hi, hi, block))
        visited_full = list(range(full_lo, full_hi, block))
        visited = visited_partial + visited_full
        where = (f"rows [{first_pos}, {last_pos}] offset {offset} len {length} band (-{before}, +{after}) "
                 f"chunk {chunk if has_chunk else None}")
        assert len(visited) == len(set(visited)), f"tile visited twice: {where}"
        assert set(visited) == needed, f"visited {sorted(visited)} != needed {sorted(needed)}: {where}"
        assert set(visited_full) == fully, f"full {visited_full} != {sorted(fully)}: {where}"


# ----------------------------------------------------------------------------------------------------
# CUDA only: real block sizes, every candidate configuration, no recompilation across ring steps.
# ----------------------------------------------------------------------------------------------------

GPU_CASES = [
    Case("gpu_causal_d128", sq=700, sk=700, causal=True, batch=1, heads=4, kv_heads=2, head_dim=128),
    Case("gpu_ring_d64", sq=513, sk=640, q_offset=600, k_offset=200, causal=True, window=(500, -1),
         batch=2, heads=4, kv_heads=1, head_dim=64),
    Case("gpu_masks_d128", sq=384, sk=450, q_offset=100, k_offset=30, causal=True, key_mask="random",
         segments=True, batch=2, heads=2, kv_heads=2, head_dim=128),
    Case("gpu_dense_d96", sq=300, sk=333, batch=1, heads=2, kv_heads=1, head_dim=96),
    Case("gpu_mla_d192_dv128", sq=400, sk=450, q_offset=50, causal=True, batch=1, heads=4, kv_heads=2, head_dim=192,
         v_dim=128),  # DeepSeek-V3's head dims
]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_large_shapes(case, dtype):
    run_and_check(case, dtype)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_softcap(dtype):
    """The soft-capped kernels compiled, at the real block sizes (Gemma2's cap of 50 on unit-scale scores)."""
    run_and_check(GPU_CASES[1], dtype, scale=1.0, softcap=50.0)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", [GPU_CASES[1], GPU_CASES[2], GPU_CASES[4]], ids=str)
def test_gpu_alibi(case, dtype):
    """The ALiBi kernels compiled, at the real block sizes, on ring blocks at nonzero offsets."""
    run_and_check(case, dtype, alibi_slopes=geometric_slopes(case.heads))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", [GPU_CASES[1], GPU_CASES[2], GPU_CASES[4]], ids=str)
def test_gpu_dropout(case, dtype):
    """The dropout kernels compiled (uint32 hash on the GPU), at the real block sizes, on ring blocks."""
    run_and_check(case, dtype, dropout=make_dropout(0.25, head_offset=3, seed=2**31 - 2))


@needs_gpu
def test_gpu_every_candidate_config():
    """Each fitting candidate of each kernel, forced one at a time (bypassing the autotuner)."""
    case = Case("configs", sq=520, sk=600, q_offset=90, k_offset=10, causal=True, window=(400, -1),
                key_mask="random", batch=1, heads=4, kv_heads=2, head_dim=128)
    kernels = {"fwd": _attn_fwd_kernel, "dq": _attn_bwd_dq_kernel, "dkdv": _attn_bwd_dkdv_kernel}
    saved = {name: (k.configs, dict(k.cache)) for name, k in kernels.items()}
    q = torch.empty(1, device=DEVICE, dtype=torch.bfloat16)
    flags = dict(BLOCK_D=128, BLOCK_DV=128, SQ_BUCKET=1024, SK_BUCKET=1024, HAS_LEFT=True, HAS_RIGHT=True,
                 HAS_KEY_MASK=True, HAS_SEG=False)
    try:
        for name, kernel in kernels.items():
            for config in autotune.fitting_configs(name, saved[name][0], dict(Q=q, **flags),
                                                   autotune.max_shared_memory(q.device)):
                kernel.configs = [config]
                kernel.cache.clear()
                run_and_check(replace(case, name=f"{name} {config}"), torch.bfloat16)
    finally:
        for name, kernel in kernels.items():
            kernel.configs, kernel.cache = saved[name][0], saved[name][1]


@needs_gpu
def test_gpu_ring_steps_do_not_recompile():
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_cache_hook"):
        pytest.skip("this Triton has no jit_cache_hook")
    case = Case("steps", sq=256, sk=256, causal=True, batch=1, heads=2, kv_heads=2, head_dim=64)
    q, k, v, dout, _ = make_inputs(case, torch.bfloat16)

    def step(q_offset, k_offset):
        out, lse = triton_attention_forward(q, k, v, q_offset=q_offset, k_offset=k_offset, causal=True)
        triton_attention_backward(dout, q, k, v, out, lse, q_offset=q_offset, k_offset=k_offset, causal=True)

    step(0, 0)  # diagonal block: compiles (and tunes) the band specialization
    compiles = []
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda *args, **kwargs: compiles.append(kwargs.get("repr"))  # None: compile
    try:
        for q_offset, k_offset in ((256, 100), (1000, 990), (4096, 4001), (37, 5)):
            step(q_offset, k_offset)  # every one a partial band: the same specialization
    finally:
        knobs.runtime.jit_cache_hook = previous
    assert compiles == [], f"recompiled for new offsets: {compiles}"


@pytest.mark.parametrize("sorted_ids", [True, pytest.param(False, marks=slow)], ids=["packed", "unsorted"])
def test_documents_narrow_the_tiles(sorted_ids):
    """Packed documents (ids sorted per row): every query tile visits only the key tiles of its documents, and the
    dk/dv programs only the query tiles of theirs; a row whose ids are not sorted (an id in two runs) keeps the
    whole range and the ids' mask. Long documents over many tiles, with an offset block as a ring step has."""
    case = Case("documents", sq=96, sk=112, q_offset=40, k_offset=24, causal=True, batch=2, segments=True)
    q, k, v, dout, mask_args = make_inputs(case, torch.float32, DEVICE)
    lengths = torch.tensor([7, 33, 50, 1, 45])  # covers positions [0, 136)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    rows = torch.stack([ids, ids.flip(0) if not sorted_ids else ids // 2])  # the flipped row is decreasing
    mask_args["segment_ids"] = (rows[:, 40:136].to(DEVICE), rows[:, 24:136].to(DEVICE))
    out, lse = triton_attention_forward(q, k, v, **mask_args)
    grads = triton_attention_backward(dout, q, k, v, out, lse, **mask_args)
    for name, actual, exp in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                 reference(q, k, v, dout, **mask_args)):
        assert_close(f"documents {name}", actual, exp, torch.float32)
