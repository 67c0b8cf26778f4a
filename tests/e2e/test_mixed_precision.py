"""Mixed precision: ``torch.autocast`` around the compiled call, and models whose parameters are bfloat16.

Each model runs on one process and compiled with autoshard on the same full inputs
(:func:`~autoshard.testing.equivalence.compare_with_one_process`, ``autocast=torch.bfloat16``: both forwards
under CPU autocast, the backwards outside it), S = 61 (neither world size divides it):

* transformers ``LlamaForCausalLM`` (hidden 64, 2 layers, 4 heads / 2 kv heads, vocab 256; sdpa at 2
  ranks, eager at 4), left padding in the second row: RoPE in float32 meets bfloat16 projections, so
  SDPA gets float32 queries and keys and bfloat16 values and casts them (eager: its matmuls do); the
  distributed attention must get them cast the same way, and the padded rows that see no key get what
  the ``finfo.min`` fill gives them, in bfloat16;
* the reference ``LlamaLM`` with bfloat16 parameters (no autocast) at 2 and 4 ranks;
* the reference ``HandwrittenLM`` (``softmax(QK^T)V`` written out) under autocast, at 2 ranks;
* a self-attention whose forward opens its own autocast region (dynamo traces it as ``_enter_autocast``
  / ``_exit_autocast`` nodes) and upcasts the queries inside it, at 2 ranks;
* products that contract the split sequence and add a bias after the all-reduce (token mixing), and a
  softmax over the sequence, under autocast at 2 ranks.

Checked: loss, outputs and every parameter gradient within the bfloat16 tolerances below, outputs and
gradients in the reference's dtypes, 0 fallbacks, attention distributed with the requested strategy in
bfloat16, the bytes booked at compile time equal to the bytes sent (attention traffic in bfloat16), and
under autocast every matmul, softmax and loss op of the compiled forward in a dtype the
one-process forward ran it in. The tolerances are relative to each tensor's largest magnitude. bfloat16
keeps 8 significant bits (eps 2**-7 = 7.8e-3): a different summation order (blocks of keys merged
through the LSE, gradient shares summed over ranks) moves results by a few eps. Measured worst errors
(any rank, P=2 and 4) are 1.0e-2 under autocast (1.5e-2 for the reference ``LlamaLM`` under autocast,
not run here) and 2.2e-2 with bfloat16 parameters, whose gradient shares are summed in bfloat16; the
tolerances are about twice those. Numbers alone cannot tell bfloat16 from float32 on models this small
(autocast itself moves these gradients by 1-2.5e-2 from float32), so the dtypes are asserted as well.

The public :func:`autoshard.runtime.attention` under autocast casts like SDPA (checked against SDPA under
autocast). Bad input: a dtype a strategy cannot compute in -- kernels="triton" with float64 (every
autocast dtype is served) -- fails on every rank with an error naming the fix, without a hang.

One launch per world size; each returns every case's results.
"""

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.testing.models import HandwrittenConfig, HandwrittenLM, LlamaConfig, LlamaLM
from autoshard.runtime import attention, comm_counter, shard_sequence
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

transformers = pytest.importorskip("transformers")

WORLDS = (2, 4)
SEQ = 61
AUTOCAST_TOL = 3e-2
BF16_PARAMS_TOL = 5e-2
PUBLIC_ATTENTION_TOL = 2.5e-2
"""The public attention alone, one op in bfloat16 against SDPA's: 1.1e-2 measured (the key gradient)."""
WATCHED_OPS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._softmax", "aten._log_softmax",
               "aten.nll_loss_forward")
"""Ops autocast runs in a lower precision or in float32 (and softmax, which CUDA autocast runs in float32)."""


class SelfAttention(nn.Module):
    """One causal self-attention; with ``autocast_inside`` its forward opens a bfloat16 autocast region and
    upcasts the queries to float32 inside it (SDPA casts them back)."""

    def __init__(self, autocast_inside: bool):
        super().__init__()
        self.autocast_inside = autocast_inside
        self.qkv = nn.Linear(16, 48, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        region = torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast_inside else contextlib.nullcontext()
        with region:
            q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
            q = q.float() if self.autocast_inside else q
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.to(x.dtype)


class TokenMixing(nn.Module):
    """Products that contract the split sequence, with a bias added after the all-reduce: a linear over the
    positions (MLP-Mixer) and an ``addmm``; and a softmax over the positions."""

    def __init__(self):
        super().__init__()
        self.proj, self.mix = nn.Linear(16, 16), nn.Linear(SEQ, 16)

    def forward(self, x):
        h = self.proj(autoshard.mark_sequence(x, 1))
        pooled = (F.softmax(h[..., :1], dim=1) * h).sum(1)
        return pooled, self.mix(h.transpose(1, 2)), torch.addmm(self.mix.bias, h[0].transpose(0, 1), h[1])


def _hf_llama(impl: str):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2)
    cfg._attn_implementation = impl
    return transformers.LlamaForCausalLM(cfg)


def _cases(world: int) -> dict:
    """name -> (model factory, inputs factory, forward kwargs, compare options)."""
    ids = torch.randint(3, 256, (2, SEQ))
    x = torch.randn(2, SEQ, 16)
    padding = torch.ones(2, SEQ, dtype=torch.long)
    padding[1, :7] = 0
    hf_kwargs = {"input_ids": ids, "attention_mask": padding, "labels": ids.clone()}
    cases = {
        "hf_llama": (functools.partial(_hf_llama, "sdpa" if world == 2 else "eager"), lambda: (), hf_kwargs,
                     dict(autocast=torch.bfloat16, strategy="zigzag" if world == 2 else "ulysses")),
        "llama_bf16_params": (lambda: LlamaLM(LlamaConfig()), lambda: (ids, ids), {},
                              dict(dtype=torch.bfloat16, strategy="ring")),
    }
    if world == 2:
        cases["handwritten"] = (lambda: HandwrittenLM(HandwrittenConfig()), lambda: (ids, ids), {},
                                dict(autocast=torch.bfloat16, strategy="allgather"))
        cases["autocast_inside"] = (lambda: SelfAttention(True), lambda: (x,), {}, dict(strategy="ring"))
        cases["token_mixing"] = (TokenMixing, lambda: (x,), {}, dict(autocast=torch.bfloat16))
    return cases


def _public_attention() -> dict:
    """The public attention under autocast on float32 shards against SDPA under autocast on the whole tensors."""
    q = torch.randn(2, 4, SEQ, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, SEQ, 16, requires_grad=True) for _ in range(2))
    weights = torch.randn(2, 4, SEQ, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (reference.float() * weights).sum().backward()
    ref_grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(*(shard_sequence(t, 2) for t in (q, k, v)), strategy="ring", causal=True, seq_len=SEQ)
    (out.float() * shard_sequence(weights, 2)).sum().backward()
    pairs = {"out": (out, shard_sequence(reference.detach(), 2)),
             **{f"grad {n}": (t.grad, g) for n, t, g in zip("qkv", (q, k, v), ref_grads)}}
    errors = {name: ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
              for name, (a, b) in pairs.items()}
    return {"errors": errors, "dtypes": (out.dtype, reference.dtype, q.grad.dtype)}


def _forced_triton_float64() -> str:
    """What the compiled float64 model with kernels="triton" raises on this rank."""
    try:
        compare_with_one_process(lambda: SelfAttention(False), lambda: (torch.randn(2, SEQ, 16),),
                                 dtype=torch.float64, kernels="triton")
    except Exception as e:  # noqa: BLE001  the test asserts which one, on every rank
        return f"{type(e).__name__}: {e}"
    return "no error"


def _run(world: int) -> dict:
    results = {}
    torch.manual_seed(0)  # every rank builds the same inputs
    for name, (make, inputs, kwargs, options) in _cases(world).items():
        torch._dynamo.reset()
        with comm_counter() as sent:
            r = compare_with_one_process(make, inputs, kwargs=kwargs, outputs="gathered", **options)  # bytes in the graph
        results[name] = {"options": options, "error": r.max_error(), "summary": r.summary(), "dtypes": r.dtypes,
                         "fallbacks": r.fallbacks, "attention": r.attention, "op_dtypes": r.op_dtypes,
                         "reference_op_dtypes": r.reference_op_dtypes, "measured": sent.payload_bytes_sent,
                         "booked": sum(c.bytes_by_rank[dist.get_rank()] for rep in r.compiled_reports
                                       for c in rep.comms)}
    torch.manual_seed(0)
    results["public_attention"] = _public_attention()
    if world == 2:
        torch._dynamo.reset()
        results["forced_triton_float64"] = _forced_triton_float64()
    return results


@functools.cache
def _results(world: int) -> list[dict]:
    return run_on_ranks(_run, world, world, timeout=300)


CASES = [(world, name) for world in WORLDS
         for name in ("hf_llama", "llama_bf16_params")
         + (("handwritten", "autocast_inside", "token_mixing") if world == 2 else ())]


@pytest.mark.parametrize("world,name", [pytest.param(w, n, marks=[pytest.mark.slow] if w != 2 else []) for w, n in CASES],
                         ids=[f"P{w}-{n}" for w, n in CASES])
def test_matches_one_process_in_its_dtypes(world, name):
    for rank, results in enumerate(_results(world)):
        r, options = results[name], results[name]["options"]
        tolerance = BF16_PARAMS_TOL if options.get("dtype") == torch.bfloat16 else AUTOCAST_TOL
        where = f"{name} P={world} rank {rank}"
        assert r["dtypes"] == {}, f"{where}: outputs or gradients in other dtypes than one process: {r['dtypes']}"
        assert r["error"] <= tolerance, f"{where}: {r['summary']}"
        assert r["fallbacks"] == [], f"{where}: {r['fallbacks']}"
        assert r["booked"] == r["measured"], f"{where}: bytes booked {r['booked']}, sent {r['measured']}"
        ran, reference = r["op_dtypes"], r["reference_op_dtypes"]
        for op in WATCHED_OPS:  # under autocast: every op it acts on ran in a dtype one process ran it in
            assert ran.get(op, set()) <= reference.get(op, set()), \
                f"{where}: {op} ran with {ran.get(op)}, one process with {reference.get(op)}"
        if "strategy" in options:
            assert r["attention"] and all(a["strategy"] == options["strategy"] and a["dtype"] == "bfloat16"
                                          for a in r["attention"]), f"{where}: {r['attention']}"
        if "strategy" in options and "autocast" in options:
            assert ran["autoshard.attention"] == {("bfloat16", "float32")}, f"{where}: {ran['autoshard.attention']}"


@pytest.mark.parametrize("world", [pytest.param(w, marks=[pytest.mark.slow] if w != 2 else []) for w in WORLDS])
def test_public_attention_casts_like_sdpa_under_autocast(world):
    for rank, results in enumerate(_results(world)):
        r = results["public_attention"]
        assert r["dtypes"] == (torch.bfloat16, torch.bfloat16, torch.float32), f"P={world} rank {rank}: {r['dtypes']}"
        assert max(r["errors"].values()) <= PUBLIC_ATTENTION_TOL, f"P={world} rank {rank}: {r['errors']}"


def test_a_dtype_the_kernels_cannot_compute_in_fails_on_every_rank_naming_the_fix():
    for rank, results in enumerate(_results(2)):
        error = results["forced_triton_float64"]
        assert error.startswith("AttentionInputError") and "torch.float64" in error, f"rank {rank}: {error}"
        assert "kernels='auto'" in error and "kernels='torch'" in error, f"rank {rank}: {error}"
