"""Decode plans (``autoshard.plan_decode``, ``python -m autoshard plan --decode``): the KV cache per rank is the
layout's share, the bytes per step are the merges' all-gathers (the same at every context length), the memory is
parameters + the share + the step's working set; the model lives on meta, nothing is computed."""

import textwrap

import pytest
import torch

import autoshard
from autoshard.__main__ import main

transformers = pytest.importorskip("transformers")

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BATCH, WORLD = 2, 4, 2, 16, 2, 4


def _model():
    cfg = transformers.LlamaConfig(hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=256,
                                   max_position_embeddings=4096, attn_implementation="sdpa")
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg).eval()


def _plan(context: int, **options):
    ids = torch.zeros(BATCH, context, dtype=torch.long, device="meta")
    return autoshard.plan_decode(_model(), kwargs=dict(input_ids=ids), world_size=WORLD, **options)


def test_decode_plan_counts_the_cache_share_and_a_context_free_merge():
    short, long = _plan(61), _plan(1001, rank=3)
    per_position = LAYERS * 2 * BATCH * KV_HEADS * HEAD_DIM * 4  # keys and values, fp32
    for plan, context in ((short, 61), (long, 1001)):
        assert plan.fallback == "" and plan.attention_calls == LAYERS and plan.context == context
        assert plan.kv_cache_bytes_whole == context * per_position == sum(plan.kv_cache_bytes_by_rank)
        assert max(plan.kv_cache_bytes_by_rank) - min(plan.kv_cache_bytes_by_rank) <= per_position
        assert plan.memory_per_rank == (plan.parameters + plan.kv_cache_bytes_by_rank[plan.rank] + plan.step_peak)
        params = sum(p.numel() * 4 for p in _model().parameters())
        assert plan.parameters == params and plan.step_peak > 0
    merge = LAYERS * (WORLD - 1) * BATCH * HEADS * (HEAD_DIM + 1) * 4  # fp32 (out, lse) of one query per head
    assert short.bytes_per_step == long.bytes_per_step == merge
    assert "2 decode attention(s)" in str(long)


def test_the_command_line_prints_a_decode_plan(tmp_path, capsys):
    factory = tmp_path / "factory.py"
    factory.write_text(textwrap.dedent(f"""
        import torch, transformers

        def prompt(seq_len):
            cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers={LAYERS},
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                           attn_implementation="sdpa")
            with torch.device("meta"):
                model = transformers.LlamaForCausalLM(cfg).eval()
            return model, (), dict(input_ids=torch.zeros(1, seq_len, dtype=torch.long, device="meta"))
    """))
    assert main(["plan", f"{factory}:prompt", "--world-size", "8", "--seq-len", "4096", "--decode"]) == 0
    out = capsys.readouterr().out
    assert "decode plan: 8 ranks, a 4,096-token context" in out and "KV cache per rank 256.00 KiB (whole: 2.00 MiB" in out, out


def test_a_sliding_window_model_plans_its_window():
    """Mistral's sliding-window layers hold their window, not the prompt: the plan's cache is the window's."""
    cfg = transformers.MistralConfig(hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=256,
                                     max_position_embeddings=4096, sliding_window=64, attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.MistralForCausalLM(cfg).eval()
    plan = autoshard.plan_decode(model, kwargs=dict(input_ids=torch.zeros(1, 1001, dtype=torch.long, device="meta")),
                                 world_size=WORLD)
    per_position = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    assert plan.fallback == "" and plan.context == 1001 and plan.attention_calls == LAYERS
    assert plan.kv_cache_bytes_whole == 63 * per_position == sum(plan.kv_cache_bytes_by_rank)
