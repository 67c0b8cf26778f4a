"""Token-local MLP blocks chunked over this rank's tokens under activation checkpointing
(``BackendConfig.chunk_mlp``), against one process.

Cases, each at length 61 (neither world size divides it), batch 2, ``chunk_mlp=10``:

* ``llama`` -- :class:`autoshard.testing.models.LlamaLM`, SwiGLU ``down(silu(gate(x)) * up(x))``, no biases;
* ``bert`` -- :class:`autoshard.testing.models.BertClassifier`, ``ff2(gelu(ff1(x)))`` with biases, a padding mask;
* ``hf_llama`` -- transformers' ``LlamaForCausalLM`` from a tiny config (what users run);
* ``mixed`` -- a GELU MLP spelled out in GPT-2's tanh form (several pointwise ops), chunked, and a ReLU MLP whose
  activation is used outside it too, left whole (``unchunked_mlps``);
* ``checkpointed`` -- ``llama`` with every block under ``torch.utils.checkpoint(use_reentrant=False)``: the chunks'
  checkpoints nest inside the layers' (``outline`` cuts both regions out again);
* ``aot_eager`` -- ``checkpointed`` through the ``aot_eager`` inner compiler (the nested checkpoints traced);
* ``bf16`` -- ``llama`` with bfloat16 parameters: within ``BF16_TOL`` relative to each tensor's largest magnitude
  (the weights' gradients are summed chunk by chunk in bfloat16; the worst measured is 3.9e-2, an attention
  weight's, the same as without chunks; the MLP weights' are 2.0e-2 at most).

Checked at 2 ranks (every case) and 4 (``checkpointed``, for the file's time): outputs and every parameter
gradient within 1e-9 (float64), 0 fallbacks, every MLP chunked but ``mixed``'s second, and the same number of
chunks on every rank although the ranks' token shares differ (31/30 tokens per sequence at 2 ranks, 16/15 at 4:
at 10 tokens per chunk a count from the rank's own rows would differ).

Memory (counted, not timed; at 2 ranks): one SwiGLU layer of width 4096 over a batch of 32 sequences, ``chunk_mlp=64``. The
largest value any ATen op allocates (the legacy profiler's per-op ``cpu_memory_usage``) in the compiled forward
and, separately, in the backward is below a third of this rank's ``[tokens, intermediate]`` (about 30 MiB in
float64) with chunks -- measured: 2.0 MB in forward, a chunk's ``[60, 4096]``, and 3.2 MB in backward, the
parameters' gradient bucket -- and at least its size without (31-33 MB in both).
"""

import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import autoshard
from autoshard.testing.models import BertClassifier, BertConfig, LlamaConfig, LlamaLM
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

SEQ, BATCH, CHUNK, LAYERS = 61, 2, 10, 2
BF16_TOL = 5e-2
LLAMA = LlamaConfig(vocab_size=64, hidden=32, heads=4, kv_heads=2, intermediate=64, layers=LAYERS)


class Checkpointed(nn.Module):
    """A block run under ``torch.utils.checkpoint``."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False)


def checkpointed_llama():
    model = LlamaLM(LLAMA)
    model.blocks = nn.ModuleList(Checkpointed(b) for b in model.blocks)
    return model


class Mixed(nn.Module):
    """One attention layer, then an MLP whose GELU is spelled out (GPT-2's tanh form: several pointwise ops), then
    a ReLU MLP whose activation is also used outside it (left whole)."""

    def __init__(self):
        super().__init__()
        self.embed, self.qkv = nn.Embedding(64, 32), nn.Linear(32, 96)
        self.fc1, self.fc2, self.fc3, self.fc4 = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, ids):
        x = self.embed(ids)
        b, s, _ = x.shape
        q, k, v = (z.view(b, s, 4, 8).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, 32)
        h = self.fc1(x)
        x = x + self.fc2(0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0)))))
        a = F.relu(self.fc3(x))
        return x + self.fc4(a) + a[..., :32]


def hf_llama():
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg)


def _ids(vocab: int = 64, batch: int = BATCH):
    torch.manual_seed(1)  # every rank passes the same batch
    return torch.randint(0, vocab, (batch, SEQ))


def _bert_inputs():
    ids = _ids()
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 5:] = 0
    return ids, mask, torch.tensor([0, 2])


CASES = {  # name: (model factory, inputs, keyword inputs (a factory) or None, dtype, other backend options)
    "llama": (lambda: LlamaLM(LLAMA), lambda: (_ids(),) * 2, None, torch.float64, {}),
    "bert": (lambda: BertClassifier(BertConfig(hidden=32, intermediate=64, layers=LAYERS)), _bert_inputs, None,
             torch.float64, {}),
    "hf_llama": (hf_llama, lambda: (), lambda: {"input_ids": _ids()}, torch.float64, {}),  # the logits: float64
    # (with labels, transformers' loss upcasts the logits to float32)
    "mixed": (Mixed, lambda: (_ids(),), None, torch.float64, {}),
    "checkpointed": (checkpointed_llama, lambda: (_ids(),) * 2, None, torch.float64, {}),
    "aot_eager": (checkpointed_llama, lambda: (_ids(),) * 2, None, torch.float64, {"inner": "aot_eager"}),
    "bf16": (lambda: LlamaLM(LLAMA), lambda: (_ids(),) * 2, None, torch.bfloat16, {}),
}
CHECKPOINTED = ("checkpointed", "aot_eager")
AT_4 = ("checkpointed",)
"""The cases run at 4 ranks too (the others at 2 only, for the file's time; the 4-rank ones are marked slow)."""
SLOW_AT_2 = ("bert", "mixed", "aot_eager", "bf16")
"""2-rank cases of the slow tier, in the 4-rank launch's place (the default tier: a hand-written and a transformers
Llama, and checkpointed layers)."""


def _cases(world: int) -> list[str]:
    return [name for name in CASES if world == 2 or name in AT_4]


def _slow(name: str, world: int) -> bool:
    return world == 4 or name in SLOW_AT_2


def _run(world: int, slow: bool):
    results = {}
    for name in (n for n in _cases(world) if _slow(n, world) == slow):
        make, inputs, kwargs, dtype, options = CASES[name]
        torch._dynamo.reset()
        r = compare_with_one_process(make, inputs, kwargs=kwargs() if kwargs else None, dtype=dtype, outputs="gathered", chunk_mlp=CHUNK,
                                     **options)
        results[name] = {"error": r.max_error(), "summary": r.summary(), "fallbacks": r.fallbacks,
                         "chunk_mlp": [g.passes["tile"].counts for g in r.compiled_reports],
                         "outlined": sum(g.passes["outline"].counts["outlined"] for g in r.compiled_reports)}
    if world == 2 and not slow:
        results["memory"] = {chunk: _largest_op_allocations(chunk) for chunk in (64, None)}
    return results


def _largest_op_allocations(chunk_mlp):
    """(largest bytes one ATen op allocated in the compiled forward, in the backward, this rank's
    ``[tokens, intermediate]`` in float64 at the fewest tokens any rank holds)."""
    torch._dynamo.reset()
    cfg = LlamaConfig(vocab_size=64, hidden=32, heads=4, kv_heads=2, intermediate=4096, layers=1)
    torch.manual_seed(0)
    model = LlamaLM(cfg).double()
    compiled = torch.compile(model, backend=autoshard.backend(chunk_mlp=chunk_mlp))
    ids = _ids(batch=32)
    compiled(ids, ids)[0].backward()  # compile first; then count

    def largest(prof):
        return max(e.cpu_memory_usage for e in prof.function_events if e.name.startswith("aten::"))

    with torch.autograd.profiler.profile(profile_memory=True, use_kineto=False) as forward:
        loss = compiled(ids, ids)[0]
    with torch.autograd.profiler.profile(profile_memory=True, use_kineto=False) as backward:
        loss.backward()
    rows = ids.size(0) * (SEQ // torch.distributed.get_world_size())
    return largest(forward), largest(backward), rows * cfg.intermediate * 8


@functools.cache
def _results(world: int, slow: bool):
    return run_on_ranks(_run, world, world, slow, timeout=600)


@pytest.mark.parametrize("name,world", [pytest.param(name, world, marks=[pytest.mark.slow] if _slow(name, world)
                                                     else []) for world in (2, 4) for name in _cases(world)])
def test_chunked_mlp_matches_one_process(name, world):
    tolerance = BF16_TOL if CASES[name][3] == torch.bfloat16 else 1e-9
    counts = []
    for rank, results in enumerate(_results(world, _slow(name, world))):
        r = results[name]
        where = f"{name} P={world} rank {rank}"
        assert r["error"] <= tolerance, f"{where}: {r['summary']}"
        assert r["fallbacks"] == [], f"{where}: {r['fallbacks']}"
        assert len(r["chunk_mlp"]) == 1, f"{where}: {r['chunk_mlp']}"
        chunked, unchunked = (1, 1) if name == "mixed" else (LAYERS, 0)
        assert r["chunk_mlp"][0]["chunked_mlps"] == chunked and r["chunk_mlp"][0]["unchunked_mlps"] == unchunked, \
            f"{where}: {r['chunk_mlp']}"
        assert r["outlined"] == (LAYERS if name in CHECKPOINTED else 0), f"{where}: {r['outlined']} regions outlined"
        counts.append(r["chunk_mlp"][0]["mlp_chunks"])
    # the largest rank holds ceil(61 / P) tokens per sequence, another one fewer: its own count would be smaller
    largest = BATCH * -(-SEQ // world)
    assert counts == [chunked * -(-largest // CHUNK)] * world, f"{name} P={world}: chunks per rank {counts}"
    assert -(-(largest - BATCH) // CHUNK) < -(-largest // CHUNK)


def test_chunked_mlp_never_allocates_the_intermediate():
    world = 2
    for rank, results in enumerate(_results(world, False)):
        (forward, backward, whole), (forward_unchunked, backward_unchunked, _) = \
            results["memory"][64], results["memory"][None]
        where = f"P={world} rank {rank}"
        assert forward < whole / 3 and backward < whole / 3, \
            f"{where}: an op allocated {forward} B in forward, {backward} B in backward with chunks; [tokens, I] {whole} B"
        assert forward_unchunked >= whole and backward_unchunked >= whole, \
            f"{where}: without chunks the largest op allocated {forward_unchunked} / {backward_unchunked} B"


def test_chunk_mlp_option_is_checked():
    with pytest.raises(ValueError, match="chunk_mlp"):
        autoshard.backend(chunk_mlp=0)
