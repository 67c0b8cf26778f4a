"""More unmodified Hugging Face architectures, and the rules they needed, against one process.

* Falcon reads its fused qkv with constant lists (``fused_qkv[..., [-2], :]``), new decoder architecture
  and the old one (multi-query, parallel attention);
* ModernBERT's local layers use transformers' bidirectional sliding window, ``abs(q - kv) <= w``: a
  two-sided window, sdpa and eager;
* Qwen3-MoE with ``batched_mm`` experts repeats each token per expert slot (``repeat_interleave`` of a
  merged ``[B*S, D]``).

Models: small configs with random weights (hidden 64, 2 layers, S <= 64, nothing downloaded), loss and
every parameter gradient within 1e-4 relative (float32), 0 fallbacks, no S x S value, attention
distributed with the requested strategy. Rules: small modules in float64, exact, the fallbacks that must
happen reported. Everything runs in one launch of 2 ranks; a model whose class the installed transformers
lacks is skipped.
"""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

transformers = pytest.importorskip("transformers")

WORLD = 2
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _batched_mm_experts() -> bool:
    try:
        from transformers.integrations import moe
    except ImportError:
        return False
    return hasattr(moe, "batched_mm_experts_forward")


def _falcon(new_architecture: bool):
    shape = dict(new_decoder_architecture=True, num_kv_heads=2) if new_architecture else dict(
        new_decoder_architecture=False, multi_query=True, parallel_attn=True)
    return transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                                     alibi=False, hidden_dropout=0.0, attention_dropout=0.0, **shape, **TOKENS)


def _modernbert():
    return transformers.ModernBertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, vocab_size=256, max_position_embeddings=128,
                                         local_attention=8, layer_types=["sliding_attention", "full_attention"],
                                         cls_token_id=1, sep_token_id=2, **TOKENS)


def _qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **TOKENS)
    cfg._experts_implementation = "batched_mm"
    return cfg


MODELS = {  # name: (config class, model class, config, sequence classification)
    "falcon": ("FalconConfig", "FalconForCausalLM", lambda: _falcon(True), False),
    "falcon_old": ("FalconConfig", "FalconForCausalLM", lambda: _falcon(False), False),
    "modernbert": ("ModernBertConfig", "ModernBertForSequenceClassification", _modernbert, True),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _qwen3_moe, False),
}
MODEL_CASES = [("falcon", 63, "sdpa", "ring"), ("falcon_old", 64, "sdpa", "zigzag"),
               ("modernbert", 61, "sdpa", "ring"), ("modernbert", 62, "eager", "zigzag"),
               ("qwen3_moe", 63, "sdpa", "ring")]


def _missing(name: str) -> str | None:
    config_cls, model_cls, _, _ = MODELS[name]
    absent = [c for c in (config_cls, model_cls) if not hasattr(transformers, c)]
    if name == "qwen3_moe" and not _batched_mm_experts():
        absent.append("batched_mm experts")
    return ", ".join(absent) or None


def _model(name: str, seq: int, impl: str):
    """(model factory, forward kwargs)."""
    _, model_cls, make_config, classify = MODELS[name]
    cfg = make_config()
    cfg._attn_implementation = impl
    ids = torch.randint(3, 256, (2, seq))
    kwargs = {"input_ids": ids, "labels": ids.clone()}
    if classify:  # right padding in the second row
        mask = torch.ones(2, seq, dtype=torch.long)
        mask[1, seq - 5:] = 0
        kwargs = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask, "labels": torch.tensor([0, 1])}
    return (lambda: getattr(transformers, model_cls)(cfg)), kwargs


# ----------------------------------------------------------------------------- rule modules

DIM, HEADS = 8, 2


class ListIndex(nn.Module):
    """Falcon-style reads of a fused qkv with constant lists on the head dims (one list, two non-adjacent
    lists: the indexed dims move to the front), and optionally a list on the split dim (gathers)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)

    def forward(self, x, on_sequence: bool):
        x = autoshard.mark_sequence(x, 1)
        b, s, _ = x.shape
        fused = self.qkv(x).view(b, s, HEADS, 3, DIM // HEADS)
        q, k, v = (fused[..., index, :].squeeze(3).transpose(1, 2) for index in ([0], [-2], [2]))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = (o, fused[..., [-1, 0], :].sum(3), fused[:, :, [1, 0], :, [0, -1]])
        if on_sequence:
            out += (fused[:, [0, -1]],)
        return out


class Repeats(nn.Module):
    """``repeat_interleave`` by an int: of the merged ``[B*S, D]`` per expert slot (MoE), along the split
    dim, along another dim, of a whole value that becomes the sequence; and flattened (gathers)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.bias = nn.Parameter(torch.randn(1, DIM))

    def forward(self, x, w, flattened: bool):
        h = self.proj(autoshard.mark_sequence(x, 1))
        b, s, d = h.shape
        slots = h.reshape(b * s, d).repeat_interleave(2, dim=0) * w.reshape(-1, 1)  # w: [B, S, 2]
        moe = slots.view(b * s, 2, d).sum(1).view(b, s, d)
        along = torch.repeat_interleave(h, 3, dim=1).view(b, s, 3, d) * torch.arange(3.0, dtype=h.dtype)[:, None]
        wider = h.repeat_interleave(2, dim=-1)
        positions = self.bias.repeat_interleave(s, dim=0)  # [S, D]: split where it is made
        out = (moe, along.sum(2), wider, h + positions)
        if flattened:
            out += (h.repeat_interleave(2),)
        return out


def _rules(seq: int) -> dict:
    runs = {"list_index": (ListIndex, lambda: (torch.randn(2, seq, DIM), False)),
            "list_index_on_sequence": (ListIndex, lambda: (torch.randn(2, seq, DIM), True)),
            "repeats": (Repeats, lambda: (torch.randn(2, seq, DIM), torch.rand(2, seq, 2), False)),
            "repeats_flattened": (Repeats, lambda: (torch.randn(2, seq, DIM), torch.rand(2, seq, 2), True))}
    results = {}
    for name, (model, inputs) in runs.items():
        torch._dynamo.reset()
        r = compare_with_one_process(model, inputs, dtype=torch.float64)
        results[name] = {"error": r.max_error(), "summary": r.summary(), "fallbacks": r.fallbacks,
                         "placements": {k: v for rep in r.compiled_reports for k, v in rep.placements.items()}}
    return results


# ----------------------------------------------------------------------------- one launch


def _run(cases, seq):
    models = {}
    for name, length, impl, strategy in cases:
        torch._dynamo.reset()
        torch.manual_seed(0)  # every rank builds the same inputs
        make, kwargs = _model(name, length, impl)
        r = compare_with_one_process(make, lambda: (), kwargs=kwargs, strategy=strategy)
        models[(name, length, impl, strategy)] = {
            "error": r.max_error(), "summary": r.summary(), "fallbacks": r.fallbacks, "attention": r.attention,
            "squares": [v for g in r.compiled_reports for v in g.square_values],
            "placements": {k: v for rep in r.compiled_reports for k, v in rep.placements.items()}}
    return models, _rules(seq)


@functools.cache
def _results():
    cases = [case for case in MODEL_CASES if _missing(case[0]) is None]
    return run_on_ranks(_run, WORLD, cases, 9, timeout=300)


@pytest.mark.parametrize("case", MODEL_CASES, ids=["-".join(map(str, c)) for c in MODEL_CASES])
def test_hf_model_matches_one_process(case):
    missing = _missing(case[0])
    if missing:
        pytest.skip(f"transformers {transformers.__version__} lacks {missing}")
    name, seq, impl, strategy = case
    for rank, (models, _) in enumerate(_results()):
        r = models[case]
        where = f"{name} {impl} S={seq} {strategy} P={WORLD} rank {rank}"
        assert r["error"] <= 1e-4, f"{where}: {r['summary']}"
        assert r["fallbacks"] == [], f"{where}: {r['fallbacks']}"
        assert r["squares"] == [], f"{where}: S x S values {r['squares']}"
        assert r["attention"] and all(a["strategy"] == strategy for a in r["attention"]), f"{where}: {r['attention']}"
        if name == "modernbert":  # the local layer's window is structured (both sides), not a dense mask
            assert [a["window"] for a in r["attention"]] == [(4, 4), None], f"{where}: {r['attention']}"
        if name == "qwen3_moe":  # the per-slot copies of the tokens stay split: [B*S*top_k] with S inside
            repeated = [p for n, p in r["placements"].items() if n.startswith("selected_hidden_states")]
            assert repeated and all(p.startswith("S(0:1/3)") for p in repeated), f"{where}: {r['placements']}"


RULES = {  # rule module case: what it must show beyond matching one process exactly
    "list_index": lambda r: r["fallbacks"] == [] and [r["placements"][n] for n in ("q", "k", "v")] == ["S(2)"] * 3,
    "list_index_on_sequence": lambda r: any("a list" in f for f in r["fallbacks"]),
    "repeats": lambda r: r["fallbacks"] == [],
    "repeats_flattened": lambda r: any("flattened" in f for f in r["fallbacks"]),
}


@pytest.mark.parametrize("name", list(RULES))
def test_list_index_and_repeat_interleave_rules(name):
    for rank, (_, rules) in enumerate(_results()):
        r = rules[name]
        assert r["error"] < 1e-9, f"{name} rank {rank}: {r['summary']}"
        assert RULES[name](r), f"{name} rank {rank}: fallbacks {r['fallbacks']}, placements {r['placements']}"
