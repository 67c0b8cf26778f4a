"""Token-local regions tiled over this rank's tokens under activation checkpointing (``BackendConfig.tile_tokens``),
and attention run a head group at a time (``head_chunks``), against one process.

Cases, at length 61 (neither world size divides it), batch 2, ``tile_tokens=10``:

* ``hf_llama`` -- transformers' ``LlamaForCausalLM`` (tiny config, 2 layers) called with ``labels=``: its regions
  are the first layer's RMSNorm + q/k/v projections, then, from each layer's o_proj on, the residual add, the
  post-attention RMSNorm, the SwiGLU MLP, the next residual add and the next layer's RMSNorm + projections (the
  last one ends at the final norm): 3 regions;
* ``hf_llama_layers`` -- the same with ``recompute="layers"`` and ``head_chunks=2``: a tile never straddles a
  layer's checkpoint, so each layer's regions stop at its edge (RMSNorm + projections; o_proj to the residual add
  after the MLP) and the final norm is its own: 5 regions, the tiles' checkpoints nested in the layers'; the
  attention runs its 2 key/value heads (and their query heads) one group at a time;
* ``ulysses_heads`` -- ``hf_llama_layers`` with Ulysses: each head group's all-to-alls (2 query heads per group: one
  per rank at P=2; at P=4 the groups would hold fewer query heads than ranks, so the call runs whole);
* ``bert`` -- :class:`autoshard.testing.models.BertClassifier`: LayerNorm, GELU MLP, biases, a padding mask;
* ``autocast`` -- ``hf_llama_layers`` (tiles, head groups) in float32 under ``torch.autocast(bfloat16)``: within ``AUTOCAST_TOL``
  relative (the same run without tiles measures the same order: bfloat16 matmuls), and every op ran in the
  dtype it runs in on one process.

Checked at 2 ranks (every case) and 4 (``hf_llama_layers``): loss, outputs and every parameter gradient within
1e-9 (float64; the loss is float32 in transformers' ``ForCausalLMLoss``: 1e-6), 0 fallbacks, the expected
regions tiled, none left, and the same number of tiles on every rank although the ranks' token shares differ.
FSDP2 on a (dp, sp) mesh with tiles: ``tests/e2e/test_training_step.py`` (``fsdp_tiles``).
"""

import functools

import pytest
import torch

from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process
from autoshard.testing.models import BertClassifier, BertConfig

transformers = pytest.importorskip("transformers")

SEQ, BATCH, TILE, LAYERS = 61, 2, 10, 2
AUTOCAST_TOL = 5e-2
WATCHED_OPS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.pow", "aten.mean", "aten.rsqrt", "aten.silu")
"""Ops whose dtypes under autocast are compared with one process (the matmuls autocast lowers, the norm's float32
ops it must keep)."""


def hf_llama():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg)


def _ids():
    torch.manual_seed(1)  # every rank passes the same batch
    return torch.randint(0, 64, (BATCH, SEQ))


def _llama_kwargs():
    return {"input_ids": _ids(), "labels": _ids()}


def _bert_inputs():
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 5:] = 0
    return _ids(), mask, torch.tensor([0, 2])


CASES = {  # name: (model factory, inputs, keyword inputs, dtype, tolerance, regions tiled, other options)
    "hf_llama": (hf_llama, lambda: (), _llama_kwargs, torch.float64, 1e-6, 3, {}),
    "hf_llama_layers": (hf_llama, lambda: (), _llama_kwargs, torch.float64, 1e-6, 5,
                        {"recompute": "layers", "head_chunks": 2}),
    "bert": (lambda: BertClassifier(BertConfig(hidden=32, intermediate=64, layers=LAYERS)), _bert_inputs, None,
             torch.float64, 1e-9, None, {}),
    "autocast": (hf_llama, lambda: (), _llama_kwargs, torch.float32, AUTOCAST_TOL, 5,
                 {"recompute": "layers", "head_chunks": 2, "autocast": torch.bfloat16}),
    "ulysses_heads": (hf_llama, lambda: (), _llama_kwargs, torch.float64, 1e-6, 5,
                      {"recompute": "layers", "head_chunks": 2, "strategy": "ulysses"}),
}
AT_4 = ("hf_llama_layers", "ulysses_heads")
SLOW_AT_2 = ("bert", "autocast")
"""2-rank cases of the slow tier (the default tier tiles transformers Llama's regions, alone, with recomputed layers
and head groups, and with Ulysses)."""


def _cases(world: int) -> list[str]:
    return [name for name in CASES if world == 2 or name in AT_4]


def _slow(name: str, world: int) -> bool:
    return world == 4 or name in SLOW_AT_2


def _run(world: int, slow: bool):
    results = {}
    for name in (n for n in _cases(world) if _slow(n, world) == slow):
        make, inputs, kwargs, dtype, _, _, options = CASES[name]
        torch._dynamo.reset()
        r = compare_with_one_process(make, inputs, kwargs=kwargs() if kwargs else None, dtype=dtype,
                                     outputs="gathered", tile_tokens=TILE, **options)
        results[name] = {"error": r.max_error(), "summary": r.summary(), "fallbacks": r.fallbacks,
                         "tile": [g.passes["tile"].counts for g in r.compiled_reports],
                         "dtypes": (r.op_dtypes, r.reference_op_dtypes)}
    return results


@functools.cache
def _results(world: int, slow: bool):
    return run_on_ranks(_run, world, world, slow, timeout=600)


@pytest.mark.parametrize("name,world", [pytest.param(name, world, marks=[pytest.mark.slow] if _slow(name, world)
                                                     else []) for world in (2, 4) for name in _cases(world)])
def test_tiled_layers_match_one_process(name, world):
    tolerance, regions = CASES[name][4], CASES[name][5]
    tiles = []
    for rank, results in enumerate(_results(world, _slow(name, world))):
        r = results[name]
        where = f"{name} P={world} rank {rank}"
        assert r["error"] <= tolerance, f"{where}: {r['summary']}"
        assert r["fallbacks"] == [], f"{where}: {r['fallbacks']}"
        (counts,) = r["tile"]  # one graph
        assert counts["untiled_regions"] == 0 and counts["tiled_regions"] > 0, f"{where}: {counts}"
        if regions is not None:
            assert counts["tiled_regions"] == regions, f"{where}: {counts}"
        tiles.append(counts["tiles"])
        if name == "autocast":  # every op autocast acts on ran in a dtype one process ran it in
            ran, reference = r["dtypes"]
            for op in WATCHED_OPS:
                assert ran.get(op, set()) <= reference.get(op, set()), \
                    f"{where}: {op} ran with {ran.get(op)}, one process with {reference.get(op)}"
    # the largest rank holds ceil(61 / P) tokens per sequence, another one fewer: its own count could be smaller
    assert len(set(tiles)) == 1, f"{name} P={world}: tiles per rank {tiles}"
    largest = BATCH * -(-SEQ // world)
    assert tiles[0] % -(-largest // TILE) == 0, f"{name} P={world}: {tiles[0]} tiles, {largest} rows"
