"""Attention run with its q/k/v and output projections a key/value head group at a time (``head_chunks`` > 1, the
eager inner compiler: :mod:`autoshard.passes.heads`, :mod:`autoshard.runtime.head_groups`), against one process.

transformers' ``LlamaForCausalLM`` (tiny: hidden 64, 8 query and 4 key/value heads, 4 layers) and ``Qwen3ForCausalLM``
(per-head RMSNorms of q and k between the projections and the rotary embedding), called with ``labels=`` and
``use_cache=False`` at length 61 (no world size divides it), batch 2, in float64: loss, outputs and every parameter
gradient within 1e-6 (transformers' loss is float32), 0 fallbacks, every attention grouped, in the groups the heads
allow (Ulysses and the hybrid need a query head per rank in each group: at P=4, 2 groups of 4).

Default tier -- P=2: the all-gather alone; Ulysses with recomputed layers and tiles; the zigzag ring with recomputed
layers and offload sparing two layers the host (the last one's input stays on the device, the third's is rebuilt
from the second's in backward; the hooks move CPU tensors here as they would an accelerator's); Qwen3 with the ring.
P=4: Ulysses with recomputed layers, tiles and offload. Slow tier -- P=4: the all-gather, the zigzag ring, the hybrid
on a (ring 2, ulysses 2) mesh; P=2: a returned KV cache (its keys and values are read outside the region: the
attention stays whole, the op's own head groups run, still exact) and float32 under bfloat16 autocast (within the
error the same run without head groups makes, times 2).
"""

import functools

import pytest
import torch

from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

transformers = pytest.importorskip("transformers")

SEQ, BATCH, LAYERS, TOLERANCE = 61, 2, 4, 1e-6


def _config(cls):
    cfg = cls(hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=8,
              num_key_value_heads=4, head_dim=8, vocab_size=64, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    return cfg


def llama():
    return transformers.LlamaForCausalLM(_config(transformers.LlamaConfig))


def qwen3():
    return transformers.Qwen3ForCausalLM(_config(transformers.Qwen3Config))


def _kwargs(use_cache=False):
    torch.manual_seed(1)  # every rank passes the same batch
    ids = torch.randint(0, 64, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids, "use_cache": use_cache}


CASES = {  # name: (model, world, slow, expected groups per attention (0: none grouped), options)
    "allgather": (llama, 2, False, 4, {"strategy": "allgather", "head_chunks": 4}),
    "ulysses_tiles": (llama, 2, False, 4, {"strategy": "ulysses", "head_chunks": 4, "recompute": "layers",
                                           "tile_tokens": 10}),
    "zigzag_offload_spared": (llama, 2, False, 2, {"strategy": "zigzag", "head_chunks": 2, "recompute": "layers",
                                                   "offload": True, "offload_prefetch": False, "offload_spared": 2}),
    "qwen3_ring": (qwen3, 2, False, 4, {"strategy": "ring", "head_chunks": 4}),
    "ulysses_offload_at_4": (llama, 4, False, 2, {"strategy": "ulysses", "head_chunks": 4, "recompute": "layers",
                                                  "tile_tokens": 10, "offload": True}),
    "allgather_at_4": (llama, 4, True, 4, {"strategy": "allgather", "head_chunks": 4, "recompute": "layers"}),
    "zigzag_at_4": (llama, 4, True, 4, {"strategy": "zigzag", "head_chunks": 4, "tile_tokens": 10}),
    "hybrid_at_4": (llama, 4, True, 2, {"strategy": "hybrid", "head_chunks": 4, "recompute": "layers"}),
    "kv_cache": (llama, 2, True, 0, {"strategy": "allgather", "head_chunks": 4, "use_cache": True}),
    "autocast": (llama, 2, True, 4, {"strategy": "ulysses", "head_chunks": 4, "recompute": "layers",
                                     "autocast": torch.bfloat16}),
}


def _run(names: list[str]):
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.runtime import offload
    results = {}
    for name in names:
        make, world, _, _, options = CASES[name]
        options = dict(options)
        use_cache = options.pop("use_cache", False)
        rebuilt = []
        if options.get("offload"):  # move CPU tensors as an accelerator's would (on CPU they stay where they are)
            offload._HOST_DEVICE = "none: every tensor moves"
            prefetch = offload._Rebuilt.prefetch
            offload._Rebuilt.prefetch = lambda self: (rebuilt.append(self.restored is None), prefetch(self))
        group = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses")) \
            if options["strategy"] == "hybrid" else None
        runs = {}
        for grouped in ((True, False) if "autocast" in options else (True,)):
            torch._dynamo.reset()
            dtype = torch.float32 if "autocast" in options else torch.float64
            r = compare_with_one_process(make, lambda: (), kwargs=_kwargs(use_cache), dtype=dtype, group=group,
                                         outputs="gathered", **{**options, "head_chunks": options["head_chunks"]
                                                                if grouped else 1})
            runs[grouped] = r
        offload._HOST_DEVICE = "cpu"
        if options.get("offload"):
            offload._Rebuilt.prefetch = prefetch
        r = runs[True]
        results[name] = {"error": r.max_error(), "summary": r.summary(), "fallbacks": r.fallbacks,
                         "heads": [g.passes["heads"].counts for g in r.compiled_reports],
                         "outline": [g.passes["outline"].counts for g in r.compiled_reports], "rebuilt": rebuilt,
                         "whole_error": runs[False].max_error() if False in runs else None}
    return results


@functools.cache
def _results(world: int, slow: bool):
    names = [name for name, case in CASES.items() if case[1] == world and case[2] == slow]
    return run_on_ranks(_run, world, names, timeout=600)


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if case[2] else [])
                                  for name, case in CASES.items()])
def test_head_groups_match_one_process(name):
    _, world, slow, groups, _ = CASES[name]
    for rank, results in enumerate(_results(world, slow)):
        r = results[name]
        where = f"{name} P={world} rank {rank}"
        tolerance = 2 * r["whole_error"] if r["whole_error"] is not None else TOLERANCE
        assert r["error"] <= tolerance, f"{where}: {r['summary']}"
        assert r["fallbacks"] == [], f"{where}: {r['fallbacks']}"
        (counts,) = r["heads"]  # one graph
        if CASES[name][4].get("offload_spared"):  # the last layer's input kept, the third's rebuilt, once
            assert r["outline"] == [{"outlined": LAYERS, "offloaded": LAYERS - 1, "rebuilt": 1}], r["outline"]
            assert r["rebuilt"] == [True], f"{where}: rebuilds {r['rebuilt']}"
        if groups:
            assert counts["grouped_attentions"] == LAYERS and counts["ungrouped_attentions"] == 0, f"{where}: {counts}"
            assert counts["head_groups"] == LAYERS * groups, f"{where}: {counts}"
        else:
            assert counts["grouped_attentions"] == 0 and counts["ungrouped_attentions"] == LAYERS, f"{where}: {counts}"
            assert counts["ungrouped_reasons"] == {"a value of the region is read outside it": LAYERS}, counts


def _lengths_run() -> dict:
    import autoshard
    torch.manual_seed(0)
    model = llama().double()
    compiled = autoshard.compile(model, head_chunks=4, recompute="layers")
    out = {}
    for n in LENGTHS:
        torch.manual_seed(n)
        ids = torch.randint(0, 64, (1, n))
        model.zero_grad(set_to_none=True)
        loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        out[n] = (loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()})
    heads = [r.report.passes["heads"].counts["grouped_attentions"] for r in compiled.autoshard_backend.compiled]
    return dict(results=out, compilations=sum(compiled.autoshard_backend.compilations.values()), heads=heads)


LENGTHS = (61, 90, 123)


def test_head_groups_serve_a_length_class():
    """Rows of a new length every step with head groups (their bodies spell this rank's length: a graph of a length
    class takes it as an input of the grouped call): from the second length one compilation serves every length, each
    graph's attentions grouped; loss and every gradient of each length equal one process's."""
    (rank0, *_) = results = run_on_ranks(_lengths_run, 2, timeout=600)
    assert rank0["compilations"] == 2 and rank0["heads"] == [LAYERS, LAYERS], (rank0["compilations"], rank0["heads"])
    torch.manual_seed(0)
    reference = llama().double()
    for n in LENGTHS:
        torch.manual_seed(n)
        ids = torch.randint(0, 64, (1, n))
        reference.zero_grad(set_to_none=True)
        loss = reference(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        for rank, result in enumerate(results):
            got_loss, grads = result["results"][n]
            assert abs(got_loss - loss.detach()) <= TOLERANCE, (n, rank, got_loss, loss)
            for name, p in reference.named_parameters():
                error = ((grads[name] - p.grad).abs().max() / p.grad.abs().max()).item()
                assert error <= TOLERANCE, (n, rank, name, error)
