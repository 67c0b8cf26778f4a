"""``generate()`` with the KV cache split along the sequence (issue 25): an unmodified transformers Llama (GQA),
``model.forward = torch.compile(model.forward, backend=autoshard.backend())``, the same prompts on every rank.

Asserts, at 2 and 4 ranks (and 1024 new tokens at 2; those two and the StaticCache at 4 ranks are marked slow), with
prompt lengths the world size does not divide and a left-padded batch of two:
greedy and seeded sampled tokens equal one process's; every layer's cache is a ``SplitTensor`` whose shard is the
rank's share of the cache layout (the prompt as the prefill split it, new tokens round robin); each decode step
merges attention with one all-gather per layer whose bytes do not depend on the context length (the same at
two prompt lengths); decoding more tokens compiles nothing new (one graph serves every step once dynamo made the
length dynamic); ``explain()`` reports the decode attention and no fallback.
"""

import pytest
import torch

import autoshard
from autoshard.runtime.accounting import comm_counter
from autoshard.runtime.kv_cache import CacheLayout
from autoshard.runtime.split_tensor import SplitTensor
from autoshard.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BATCH, NEW = 4, 2, 16, 2, 2, 5


def _built(config, model, **options):
    """A small float64 model of ``model``'s family with the test's head shape (seeded weights, SDPA, eval)."""
    cfg = config(hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=LAYERS,
                 num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=256, **options)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model(cfg).double().eval()


def _model():
    return _built(transformers.LlamaConfig, transformers.LlamaForCausalLM, max_position_embeddings=2048)


def _prompts(length: int):
    ids = torch.randint(3, 256, (BATCH, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones_like(ids)
    ids[1, :6], mask[1, :6] = 0, 0  # the second prompt is left-padded
    return dict(input_ids=ids, attention_mask=mask, pad_token_id=0)


def _generate(model, length: int, new: int = NEW, sample: bool = False, **options):
    if sample:
        torch.manual_seed(5)
    return model.generate(**_prompts(length), max_new_tokens=new, do_sample=sample, top_k=20 if sample else None,
                          return_dict_in_generate=True, **options)


def _rank(lengths, longer: int) -> dict:
    model, backend = _model(), autoshard.backend()
    model.forward = torch.compile(model.forward, backend=backend)
    rank = torch.distributed.get_rank()
    out = {"tokens": [], "merges": [], "shares": []}
    for length in lengths:
        with comm_counter() as counter:
            result = _generate(model, length)
        if length == lengths[0]:  # the same prompt, many more steps: every decode step reuses a graph
            compiled = len(backend.compiled)
            out["longer"] = _generate(model, length, new=longer, min_new_tokens=longer).sequences
            out["new_compiles"] = len(backend.compiled) - compiled
        merge = counter.calls["decode_merge"]
        out["tokens"].append(result.sequences)
        out["merges"].append((merge.count, merge.bytes_sent))
        for layer in result.past_key_values.layers:
            for cache in (layer.keys, layer.values):
                assert isinstance(cache, SplitTensor), type(cache)
                total = cache.shape[-2]
                rule = cache.layout_rule
                assert isinstance(rule, CacheLayout) and total == length + NEW - 1, (rule, total)
                out["shares"].append((cache.local.shape[-2], rule.local_length(rank, total), total))
    out["sampled"] = _generate(model, lengths[0], sample=True).sequences
    out["explain"] = autoshard.explain(backend)
    return out


@pytest.mark.parametrize("world, lengths, longer", [(2, (29, 61), 3 * NEW),
                                                    pytest.param(2, (29, 61), 1024, marks=pytest.mark.slow),
                                                    pytest.param(4, (31, 45), 3 * NEW, marks=pytest.mark.slow)])
def test_generate_with_a_sequence_sharded_kv_cache(world, lengths, longer):
    results = run_on_ranks(_rank, world, lengths, longer, timeout=600)
    model = _model()
    expected = [_generate(model, length).sequences for length in lengths]
    longer = _generate(model, lengths[0], new=longer, min_new_tokens=longer).sequences
    sampled = _generate(model, lengths[0], sample=True).sequences
    per_call = (world - 1) * BATCH * HEADS * 1 * (HEAD_DIM + 1) * 4  # fp32 (out, lse) of one query per head
    for r in results:
        for got, want in zip(r["tokens"], expected):
            assert torch.equal(got, want), (got, want)
        assert torch.equal(r["longer"], longer) and torch.equal(r["sampled"], sampled)
        for local, share, total in r["shares"]:
            assert local == share and abs(local - total / world) <= 1, (local, share, total)
        assert r["merges"][0] == r["merges"][1] == (LAYERS * (NEW - 1), LAYERS * (NEW - 1) * per_call), r["merges"]
        assert r["new_compiles"] == 0, r["new_compiles"]
        assert "decode" in r["explain"] and "fallback(s)" in r["explain"], r["explain"]
        assert all(" 0 fallback(s)" in line for line in r["explain"].splitlines() if line.startswith("graph")), r["explain"]


WINDOW = 12


def _mistral():
    return _built(transformers.MistralConfig, transformers.MistralForCausalLM, max_position_embeddings=512,
                  sliding_window=WINDOW)


def _window_rank(lengths, new) -> dict:
    model, backend = _mistral(), autoshard.backend()
    model.forward = torch.compile(model.forward, backend=backend)
    rank = torch.distributed.get_rank()
    out = {"tokens": [], "merges": [], "shares": []}
    for length in lengths:
        with comm_counter() as counter:
            result = _generate(model, length, new=new)
        merge = counter.calls["decode_merge"]
        out["tokens"].append(result.sequences)
        out["merges"].append((merge.count, merge.bytes_sent))
        for layer in result.past_key_values.layers:
            for cache in (layer.keys, layer.values):
                assert isinstance(cache, SplitTensor) and isinstance(cache.layout_rule, CacheLayout), cache
                end = cache.cache_start + cache.shape[-2]  # the positions seen, relabeled from the prompt's window
                share = cache.layout_rule.local_length(rank, end, cache.cache_start)
                out["shares"].append((cache.local.shape[-2], share, cache.shape[-2]))
    compiled = len(backend.compiled)
    out["longer"] = _generate(model, lengths[0], new=2 * new).sequences
    out["new_compiles"] = len(backend.compiled) - compiled
    out["explain"] = autoshard.explain(backend)
    return out


@pytest.mark.slow  # a cache variant of the decode above (its plan: tests/plan/test_decode_plan.py)
def test_generate_with_a_sliding_window_cache():
    """Mistral's sliding-window layers keep only their window (``DynamicSlidingWindowLayer``: the cache is the last
    ``window - 1`` positions of the appended one): sharded, each rank drops its own positions that leave the window.
    One prompt longer than the window (the prefill's cache is a window of the prompt), one shorter that the decode
    steps fill past it; a left-padded batch; tokens equal one process's at P=2."""
    lengths, new = (29, 7), 9
    results = run_on_ranks(_window_rank, 2, lengths, new, timeout=600)
    model = _mistral()
    expected = [_generate(model, length, new=new).sequences for length in lengths]
    longer = _generate(model, lengths[0], new=2 * new).sequences
    per_call = BATCH * HEADS * 1 * (HEAD_DIM + 1) * 4
    held = [0, 0]
    for rank, r in enumerate(results):
        for got, want in zip(r["tokens"], expected):
            assert torch.equal(got, want), (got, want)
        assert torch.equal(r["longer"], longer)
        for local, share, total in r["shares"]:
            assert local == share and total == WINDOW - 1, (local, share, total)
        held[rank] = sum(local for local, _, _ in r["shares"])
        assert r["merges"][0] == r["merges"][1] == (LAYERS * (new - 1), LAYERS * (new - 1) * per_call), r["merges"]
        assert r["new_compiles"] == 0, r["new_compiles"]
        assert all(" 0 fallback(s)" in line for line in r["explain"].splitlines() if line.startswith("graph")), r["explain"]
        assert "decode" in r["explain"], r["explain"]
    assert sum(held) == len(lengths) * LAYERS * 2 * (WINDOW - 1), held  # keys and values: each entry on one rank


def _static_shares(result, rank: int) -> list[tuple[int, int, int]]:
    """(local length, the layout's share of the rank, capacity) of every layer's fixed-size keys and values, each
    asserted a ``SplitTensor`` of a ``CacheLayout``."""
    shares = []
    for layer in result.past_key_values.layers:
        for cache in (layer.keys, layer.values):
            assert isinstance(cache, SplitTensor) and isinstance(cache.layout_rule, CacheLayout), cache
            shares.append((cache.local.shape[-2], cache.layout_rule.local_length(rank, cache.shape[-2]),
                           cache.shape[-2]))
    return shares


def _static_rank(lengths) -> dict:
    import warnings

    rank = torch.distributed.get_rank()
    model, backend = _model(), autoshard.backend()
    model.forward = torch.compile(model.forward, backend=backend)
    out = {"tokens": [], "merges": [], "shares": []}
    for length in lengths:
        with comm_counter() as counter:
            result = _generate(model, length, cache_implementation="static")
        merge = counter.calls["decode_merge"]
        out["tokens"].append(result.sequences)
        out["merges"].append((merge.count, merge.bytes_sent))
        out["shares"] += _static_shares(result, rank)
    out["sampled"] = _generate(model, lengths[0], sample=True, cache_implementation="static").sequences
    out["explain"] = autoshard.explain(backend)
    config = transformers.CompileConfig(backend=autoshard.backend())  # transformers compiles the decode steps
    config._compile_all_devices = True  # (on CPU only when asked to); the prefill runs uncompiled
    plain = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _generate(plain, lengths[0], cache_implementation="static", compile_config=config)
    out["compile_config"] = (result.sequences, [str(w.message) for w in caught if "KV cache" in str(w.message)])
    return out


@pytest.mark.slow
def test_generate_with_a_static_cache():
    """transformers' StaticCache (``cache_implementation="static"``): the prefill allocates the fixed-size buffers
    and writes the prompt with ``index_copy_``; sharded, each rank's buffer holds its share of the cache's
    positions, the prefill attends as any self-attention (the static mask's structure recovered) and every decode
    step writes the new position on the rank that holds it. At 4 ranks, two prompt lengths the world does not
    divide, a left-padded batch, greedy and sampled: one process's tokens, 0 fallbacks, merge bytes per step
    the same at both lengths. Through ``CompileConfig`` (the prefill uncompiled, the cache whole on every rank)
    the tokens are right too and a warning names the cache."""
    lengths = (29, 42)
    results = run_on_ranks(_static_rank, 4, lengths, timeout=600)
    model = _model()
    expected = [_generate(model, length, cache_implementation="static").sequences for length in lengths]
    sampled = _generate(model, lengths[0], sample=True, cache_implementation="static").sequences
    per_call = 3 * BATCH * HEADS * 1 * (HEAD_DIM + 1) * 4
    for r in results:
        for got, want in zip(r["tokens"], expected):
            assert torch.equal(got, want), (got, want)
        assert torch.equal(r["sampled"], sampled)
        for local, share, total in r["shares"]:
            assert local == share and abs(local - total / 4) <= 1, (local, share, total)
        assert r["merges"][0] == r["merges"][1] == (LAYERS * (NEW - 1), LAYERS * (NEW - 1) * per_call), r["merges"]
        assert all(" 0 fallback(s)" in line for line in r["explain"].splitlines() if line.startswith("graph")), r["explain"]
        assert "allgather" in r["explain"] and "decode" in r["explain"], r["explain"]
        tokens, warned = r["compile_config"]
        assert torch.equal(tokens, expected[0]), (tokens, expected[0])
        assert len(warned) == 1 and "StaticCache" in warned[0] and "layers[0].keys" in warned[0], warned


def _one_prompt(length: int, masked: bool) -> dict:
    ids = torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(length))
    return dict(input_ids=ids, pad_token_id=0, **({"attention_mask": torch.ones_like(ids)} if masked else {}))


def _generate_one(model, length: int, masked: bool):
    return model.generate(**_one_prompt(length, masked), max_new_tokens=NEW, do_sample=False,
                          cache_implementation="static", return_dict_in_generate=True)


def _static_one_rank(runs) -> dict:
    import warnings

    rank = torch.distributed.get_rank()
    model, backend = _model(), autoshard.backend()
    model.forward = torch.compile(model.forward, backend=backend)
    out = {"tokens": [], "merges": [], "shares": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for length, masked in runs:
            with comm_counter() as counter:
                result = _generate_one(model, length, masked)
            merge = counter.calls["decode_merge"]
            out["tokens"].append(result.sequences)
            out["merges"].append((merge.count, merge.bytes_sent))
            out["shares"] += _static_shares(result, rank)
    out["warned"] = [str(w.message) for w in caught if str(w.message).startswith("autoshard")]
    out["explain"] = autoshard.explain(backend)
    return out


def test_generate_with_a_static_cache_at_batch_size_one():
    """One prompt (the common serving case), with and without an attention mask: transformers drops the all-visible
    mask and its SDPA attention reads the empty cache's first ``S`` positions under ``is_causal`` (no mask input);
    the prefill still attends as a causal self-attention and the cache leaves split. At P=2, two prompt lengths
    (the second, without a mask, through the dynamic-shape graph): one process's tokens, every layer's buffer a
    ``SplitTensor`` of the cache layout, one decode merge per layer and step, 0 fallbacks, no warning."""
    runs = ((13, True), (22, False))
    results = run_on_ranks(_static_one_rank, 2, runs, timeout=600)
    model = _model()
    expected = [_generate_one(model, length, masked).sequences for length, masked in runs]
    per_call = HEADS * 1 * (HEAD_DIM + 1) * 4  # one other rank's fp32 (out, lse) of one query per head
    for r in results:
        for got, want in zip(r["tokens"], expected):
            assert torch.equal(got, want), (got, want)
        for local, share, total in r["shares"]:
            assert local == share and abs(local - total / 2) <= 1, (local, share, total)
        assert r["merges"] == [(LAYERS * (NEW - 1), LAYERS * (NEW - 1) * per_call)] * len(runs), r["merges"]
        graphs = [line for line in r["explain"].splitlines() if line.startswith("graph")]
        assert all(" 0 fallback(s)" in line for line in graphs), r["explain"]
        assert "decode" in r["explain"] and not r["warned"], (r["explain"], r["warned"])
