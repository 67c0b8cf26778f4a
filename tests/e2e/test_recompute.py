"""``recompute="layers"``: the compiler checkpoints every layer it finds in the graph, against one process.

* autoshard's Llama (float64, length 61, which 2 does not divide, ring and the all-gather): loss and every
  gradient within 1e-9 of one process, every layer a recomputed region (one ``tag_activation_checkpoint``
  call each in the rank's graph), 0 fallbacks, and the bytes sent -- the recomputed layers' collectives a
  second time in backward -- equal to the bytes booked.
* An unmodified transformers ``LlamaForCausalLM`` called as users call it (``labels=``, the logits returned
  with the loss), float32: within 1e-4 relative as ``test_training_step``'s runs (the rotary table is float32).
* A model that already checkpoints its layers keeps its own checkpoints (counted ``already``).
* ``offload=True``: the regions are :func:`~autoshard.runtime.offload.offloaded_checkpoint` calls, exact as
  well (on CPU the inputs are already in host memory and stay; the copies themselves and their prefetch
  are ``tests/runtime/test_offload.py``'s).
* The pass alone (``tests/unit``-sized, one process): a layer drawing random numbers is left as it is.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.testing.models import LlamaConfig, LlamaLM
from autoshard.passes.normalize import canonicalize
from autoshard.passes.recompute import recompute_layers
from autoshard.passes.regions import inline_regions
from autoshard.runtime import comm_counter
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

transformers = pytest.importorskip("transformers")

LAYERS = 3
CONFIG = dict(vocab_size=64, hidden=32, layers=LAYERS, heads=4, kv_heads=2, intermediate=64)


def _ours():
    return LlamaLM(LlamaConfig(**CONFIG))


def _hf():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).train()


def _hf_checkpointed(method: str = "gradient_checkpointing_enable"):
    """transformers' Llama with its own checkpointing turned on by ``method`` with its defaults, in a process where
    dynamo's setting for checkpointed side effects is as torch leaves it (autoshard's backend must set it)."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = False
    model = _hf()
    getattr(model, method)()
    return model


CASES = {  # name: (model, dtype, options); errors are relative to each tensor's largest magnitude
    "ring": (_ours, torch.float64, {"strategy": "ring"}),
    "allgather": (_ours, torch.float64, {"strategy": "allgather"}),
    "offload": (_ours, torch.float64, {"strategy": "ring", "offload": True}),
    "transformers": (_hf, torch.float32, {}),
    "already": (_hf_checkpointed, torch.float32, {}),
}


WORLDS = {2: tuple(CASES)}
"""The cases each world size runs. Checkpointed regions at 4 ranks (ring, Ulysses) are ``test_training_step``'s:
the regions this option makes are outlined and recomputed by the same code."""


def _run(names):
    out = {}
    for name in names:
        make, dtype, options = CASES[name]
        torch._dynamo.reset()
        torch.manual_seed(0)
        ids = torch.randint(0, 64, (2, 61))
        inputs, kwargs = ((ids, ids), None) if make is _ours else ((), dict(input_ids=ids, labels=ids, use_cache=False))
        with comm_counter() as sent:
            r = compare_with_one_process(make, lambda: inputs, kwargs=kwargs, dtype=dtype, outputs="gathered",
                                         recompute="layers", **options)
        out[name] = {"error": r.max_error(), "summary": r.summary(),
                     "fallbacks": r.fallbacks,
                     "counts": [g.passes["recompute"].counts for g in r.compiled_reports],
                     "outlined": [g.passes["outline"].counts["outlined"] for g in r.compiled_reports],
                     "recomputed": [len(g.recomputed) for g in r.compiled_reports],
                     "booked": sum(c.bytes_by_rank[dist.get_rank()] for g in r.compiled_reports for c in g.comms),
                     "measured": sent.payload_bytes_sent,
                     "offloaded": [g.passes["outline"].counts["offloaded"] for g in r.compiled_reports]}
    return out


@functools.cache
def _results(world: int):
    return run_on_ranks(_run, world, WORLDS[world], timeout=600)


@pytest.mark.parametrize("world, name", [(world, name) for world, names in WORLDS.items() for name in names])
def test_recomputed_layers_match_one_process(world, name):
    for rank, results in enumerate(_results(world)):
        r, where = results[name], f"{name} P={world} rank {rank}"
        assert r["error"] <= (1e-9 if CASES[name][1] == torch.float64 else 1e-4), f"{where}: {r['summary']}"
        assert r["fallbacks"] == [], f"{where}: {r['fallbacks']}"
        already = LAYERS if name == "already" else 0
        assert r["counts"] == [{"recomputed_layers": LAYERS - already, "already": already, "random": 0,
                                "interleaved": 0}], f"{where}: {r['counts']}"
        assert r["outlined"] == [LAYERS] and r["recomputed"] == [LAYERS], f"{where}: {r['outlined']} {r['recomputed']}"
        assert r["booked"] == r["measured"], f"{where}: bytes booked {r['booked']}, sent {r['measured']}"
        assert r["offloaded"] == [LAYERS if name == "offload" else 0], f"{where}: {r['offloaded']}"


def _one_liner(method: str):
    """``torch.compile(model, backend=autoshard.backend())`` on a model checkpointed by ``method``."""
    torch._dynamo.reset()
    ids = torch.randint(0, 64, (2, 61), generator=torch.Generator().manual_seed(3))
    r = compare_with_one_process(functools.partial(_hf_checkpointed, method), lambda: (),
                                 kwargs=dict(input_ids=ids, labels=ids), outputs="gathered")
    return r.max_error(), r.summary(), [a["strategy"] for a in r.attention], r.fallbacks


@pytest.mark.parametrize("method", ["gradient_checkpointing_enable", "activation_checkpointing_enable"])
def test_the_one_liner_distributes_layers_transformers_checkpoints(method):
    for error, summary, strategies, fallbacks in run_on_ranks(_one_liner, 2, method, timeout=300):
        assert error <= 1e-4, summary  # float32, as the transformers case above
        assert len(strategies) == LAYERS and "gathered-kv" not in strategies and "whole" not in strategies, strategies
        assert fallbacks == []


class _Block(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.fc, self.p = nn.Linear(8, 8), p

    def forward(self, x):
        return x + F.dropout(torch.tanh(self.fc(x)), self.p, self.training)


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(0.0), _Block(0.1), _Block(0.0)])

    def forward(self, x):
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        return torch.utils.checkpoint.checkpoint(self.blocks[2], x, use_reentrant=False)


def test_layers_found_from_module_stacks():
    """One process, the pass alone: block 0 becomes a region, block 1 draws random numbers (dropout 0.1 in
    training) and stays, block 2 keeps the model's own checkpoint."""
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_Blocks().train(), backend=grab, fullgraph=True)(torch.randn(2, 8))
    gm = graphs[0]
    regions = inline_regions(gm)
    canonicalize(gm)
    counts = recompute_layers(gm, regions, "layers")
    assert counts == {"recomputed_layers": 1, "already": 1, "random": 1, "interleaved": 0}, counts
    assert len(regions) == 2
    assert recompute_layers(gm, [], "none")["recomputed_layers"] == 0


def test_recompute_option_is_checked():
    with pytest.raises(ValueError, match="recompute"):
        autoshard.backend(recompute="everything")
