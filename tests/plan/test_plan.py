"""Dry-run plans: predicted bytes equal measured bytes, plans are deterministic and round-trip,
the backend's dry run and the command line work, nothing needs a process group, and a KV cache a training call
returns is named with its fix."""

import functools
import json
import logging
import subprocess
import sys
import warnings

import pytest
import sympy
import torch
import torch.distributed as dist

import autoshard
from autoshard.config import BackendConfig
from autoshard.hardware import HardwareProfile
from autoshard.passes.pipeline import compile_graph
from autoshard.testing.models import BertClassifier, HandwrittenLM, LlamaConfig, LlamaLM, ViTClassifier, ViTConfig
from autoshard.planner import Plan
from autoshard.planner.capture import capture
from autoshard.policy import MemoryBudgetError
from autoshard.runtime import comm_counter
from autoshard.runtime.groups import SequenceGroups
from autoshard.runtime.attention import formulas
from autoshard.testing import run_on_ranks

STRATEGIES = ["ring", "zigzag", "allgather", "ulysses"]


def _model_and_inputs(name: str, seq: int):
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, seq))
    if name == "llama":
        return LlamaLM().double(), (ids, ids.clone())
    if name == "handwritten":
        return HandwrittenLM().double(), (ids, ids.clone())
    if name == "bert":
        mask = torch.ones(2, seq, dtype=torch.long)
        mask[0, seq // 2:] = 0
        return BertClassifier().double(), (ids, mask, torch.tensor([0, 2]))
    return ViTClassifier(ViTConfig(image=16)).double(), (torch.randn(2, 3, 16, 16).double(), torch.tensor([1, 3]))


def _predicted_vs_measured(cases):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for name, seq, strategy in cases:
        torch._dynamo.reset()
        model, inputs = _model_and_inputs(name, seq)
        plan = autoshard.plan(model, inputs, world_size=world, strategy=strategy, rank=rank, outputs="gathered")
        torch._dynamo.reset()  # outputs gathered in the graph, so that what the sums below read is counted there
        compiled = torch.compile(model, backend=autoshard.backend(strategy=strategy, outputs="gathered"))
        with comm_counter() as forward:
            outputs = compiled(*inputs)
        loss = sum(o.sum() for o in outputs if isinstance(o, torch.Tensor) and o.is_floating_point())
        with comm_counter() as backward:
            loss.backward()
        measured_forward = forward.payload_bytes_sent
        out.append((name, seq, strategy, plan.bytes_sent("forward"), measured_forward, plan.bytes_sent("backward"),
                    backward.bytes_sent))
    return out


def _byte_cases(world: int) -> list[tuple]:
    """Lengths the layouts split evenly (4P), and uneven ones (llama at 4P + 1; ViT's 16 patches + CLS = 17 tokens);
    every case at 2 ranks, llama and ViT at 3 (an odd world), bert and the hand-written model at 4."""
    cases = [(name, 4 * world, s) for name in ("llama", "bert", "handwritten") for s in STRATEGIES]
    cases += [("llama", 4 * world + 1, s) for s in STRATEGIES] + [("vit", 17, s) for s in ("ring", "ulysses")]
    return [c for c in cases if world == 2 or (world == 3) == (c[0] in ("llama", "vit"))]


DEFAULT_TIER = {("bert", "zigzag"), ("handwritten", "allgather"), ("vit", "ulysses")}
"""The cases of the default suite besides llama's (zigzag and all-gather at a length 2 divides, ring and Ulysses at one
it does not): each other model once, at 2 ranks; the rest are marked slow and measured in a launch of their own."""


def _slow(world: int, name: str, seq: int, strategy: str) -> bool:
    if name == "llama":  # every strategy once: zigzag and all-gather at the even length, ring and Ulysses the other
        return world > 2 or (strategy in ("zigzag", "allgather")) != (seq % world == 0)
    return world > 2 or (name, strategy) not in DEFAULT_TIER


@functools.cache
def _bytes(world: int, slow: bool) -> list[dict]:
    """Every rank's (predicted forward, measured forward, predicted backward, measured backward) by case: one
    launch per world size and tier."""
    cases = [c for c in _byte_cases(world) if _slow(world, *c) == slow]
    return [{(name, seq, strategy): rest for name, seq, strategy, *rest in results}
            for results in run_on_ranks(_predicted_vs_measured, world, cases, timeout=600)]


BYTE_CASES = [(world, *case) for world in (2, 3, 4) for case in _byte_cases(world)]


@pytest.mark.parametrize("world,name,seq,strategy",
                         [pytest.param(*c, marks=[pytest.mark.slow] if _slow(*c) else [])
                          for c in BYTE_CASES],
                         ids=["-".join(map(str, c)) for c in BYTE_CASES])
def test_predicted_bytes_equal_measured_bytes(world, name, seq, strategy):
    """On every rank, forward and backward."""
    for rank, results in enumerate(_bytes(world, _slow(world, name, seq, strategy))):
        pf, mf, pb, mb = results[(name, seq, strategy)]
        assert (pf, pb) == (mf, mb), f"{name} S={seq} {strategy} P={world} rank {rank}: predicted " \
                                     f"{pf}/{pb}, measured {mf}/{mb} (forward/backward)"


def test_plan_needs_no_process_group_and_round_trips():
    assert not dist.is_initialized()
    model, inputs = _model_and_inputs("llama", 64)
    plan = autoshard.plan(model, inputs, world_size=8)
    again = autoshard.plan(model, inputs, world_size=8)
    assert plan.to_json() == again.to_json()  # deterministic
    restored = Plan.from_json(plan.to_json())
    assert restored.to_json() == plan.to_json()
    assert [a.strategy for a in plan.attention] == [a.strategy for a in restored.attention]
    text = str(plan)
    assert text.startswith("autoshard plan: 8 ranks") and "layer" in text
    assert plan.fallbacks == [] and len(plan.attention) == 2
    dot = plan.to_dot()
    assert dot.startswith("digraph") and "lightblue" in dot and "->" in dot
    # every collective: an int per rank and a formula that gives it when P divides S
    subs = {formulas.SYMBOLS[k]: v for k, v in plan.symbols.items() if k in formulas.SYMBOLS}
    for c in plan.collectives:
        assert isinstance(c.bytes_per_rank, int) and len(c.bytes_by_rank) == 8
        if c.formula is not None and c.kind != "realign":
            value = sympy.sympify(c.formula).subs(subs)
            value = value.subs(formulas.values(dtype=torch.float64, **{k: v for k, v in plan.symbols.items()
                                                                       if k in ("B", "S", "H", "Hkv", "D", "P")}))
            assert int(value) == c.bytes_per_rank, (c, value)
    assert plan.memory_per_rank.total == (plan.memory_per_rank.parameters + plan.memory_per_rank.gradients
                                          + plan.memory_per_rank.saved_activations + plan.memory_per_rank.outputs
                                          + plan.memory_per_rank.transient)


def test_plan_says_which_lengths_its_compilation_serves():
    """The plan's length class: from the zigzag layout's 2P (shorter, the family is laid out contiguously: another
    class) to where the cost model switches strategy; a plan just outside it plans that other class."""
    model = LlamaLM()
    plan = autoshard.plan(model, (torch.zeros(1, 64, dtype=torch.long),) * 2, world_size=4)
    lengths = plan.length_class()
    assert lengths["low"] == 8 and lengths["below"] == "allgather on the contiguous layout", lengths
    assert lengths["above"] == "zigzag" and lengths["high"] > 64, lengths
    assert "length class: one compilation (a graph of symbolic lengths) serves S = 8 to " in str(plan), str(plan)
    shorter = autoshard.plan(model, (torch.zeros(1, 7, dtype=torch.long),) * 2, world_size=4)
    assert {(a.strategy, a.layout) for a in shorter.attention} == {("allgather", "contiguous")}
    assert shorter.length_class() == {"low": 1, "high": 7, "below": "", "above": "allgather on the zigzag layout"}


def test_plan_on_the_meta_device():
    with torch.device("meta"):
        model = LlamaLM()
        ids = torch.randint(0, 256, (1, 4096))
    plan = autoshard.plan(model, (ids, ids), world_size=16)
    assert plan.symbols["S"] == 4096 and plan.symbols["P"] == 16
    assert plan.memory_per_rank.saved_activations > 0


def _dry_run():
    """(compiled output, eager output, what the backend logged on this rank)."""
    logged = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("autoshard")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        model, inputs = _model_and_inputs("llama", 16)
        out = torch.compile(model, backend=autoshard.backend(dry_run=True))(*inputs)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return out[0].item(), model(*inputs)[0].item(), logged


def test_dry_run_logs_the_plan_and_runs_unsharded():
    """Rank 0 logs the plan of 2 ranks (once per graph); every rank runs the graph whole, as one process."""
    results = run_on_ranks(_dry_run, 2)
    for compiled, eager, _ in results:
        assert compiled == eager
    (first, *_), logged_by_others = results[0][2], [r[2] for r in results[1:]]
    assert first.startswith("autoshard plan: 2 ranks") and "attention call(s)" in first, results[0][2]
    assert logged_by_others == [[]], logged_by_others


def test_command_line(tmp_path):
    factory = tmp_path / "factory.py"
    factory.write_text(
        "import torch\nfrom autoshard.testing.models import LlamaLM\n"
        "def make(seq_len):\n"
        "    with torch.device('meta'):\n"
        "        m = LlamaLM(); ids = torch.randint(0, 256, (1, seq_len))\n"
        "    return m, (ids, ids), {}\n")
    out = subprocess.run([sys.executable, "-m", "autoshard", "plan", f"{factory}:make", "--world-size", "16",
                          "--seq-len", "8192", "--json", str(tmp_path / "p.json"), "--dot", str(tmp_path / "p.dot")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "autoshard plan: 16 ranks" in out.stdout
    assert json.loads((tmp_path / "p.json").read_text())["world_size"] == 16
    assert (tmp_path / "p.dot").read_text().startswith("digraph")


def test_hybrid_is_planned_on_the_mesh_the_topology_implies():
    model, inputs = _model_and_inputs("llama", 17)
    plan = autoshard.plan(model, inputs, world_size=4, strategy="hybrid", topology=HardwareProfile(ranks_per_node=2))
    assert plan.attention[0].strategy == "hybrid" and plan.attention[0].layout == "zigzag"
    assert "(ring 2, ulysses 2)" in plan.attention[0].reason
    with pytest.raises(ValueError, match="cannot be planned on 4 ranks: the group fits in one node"):
        autoshard.plan(model, inputs, world_size=4, strategy="hybrid")


class _LossOnly(torch.nn.Module):
    """The reference Llama returning only its loss (a training step that never reads the logits)."""

    def __init__(self):
        super().__init__()
        self.llama = LlamaLM(LlamaConfig(layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64))

    def forward(self, ids, labels):
        return self.llama(ids, labels)[0]


def test_plan_says_whether_the_lm_head_and_loss_are_chunked():
    """A loss-only step gets the chunked head; a model that also returns its logits gets the chunked loss and
    returns its logits lazily (``lazy_logits=False``: keeps its head for them); chunk_loss=None leaves the loss
    whole; the plan says which."""
    ids = torch.randint(0, 256, (1, 64))
    torch._dynamo.reset()
    chunked = autoshard.plan(_LossOnly(), (ids, ids), world_size=2)
    torch._dynamo.reset()
    returned = autoshard.plan(_LossOnly().llama, (ids, ids), world_size=2)
    torch._dynamo.reset()
    kept = autoshard.plan(_LossOnly().llama, (ids, ids), world_size=2, lazy_logits=False)
    torch._dynamo.reset()
    whole = autoshard.plan(_LossOnly(), (ids, ids), world_size=2, chunk_loss=None)
    assert chunked.losses == {"chunked": 1, "unchunked": 0, "logits_kept": 0, "lazy_logits": 0}, chunked.losses
    assert "1 chunked over the rank's tokens" in str(chunked) and "also returning" not in str(chunked)
    assert returned.losses == {"chunked": 1, "unchunked": 0, "logits_kept": 1, "lazy_logits": 1}, returned.losses
    assert "computed when first read" in str(returned) and "also returning" not in str(returned)
    assert kept.losses == {"chunked": 1, "unchunked": 0, "logits_kept": 1, "lazy_logits": 0}, kept.losses
    assert "1 head(s) also returning their logits" in str(kept)
    logits = 32 * 256 * 4  # this rank's [tokens, vocab] float32
    assert kept.memory_per_rank.total - returned.memory_per_rank.total >= logits // 2, \
        (kept.memory_per_rank, returned.memory_per_rank)
    assert whole.losses == {"chunked": 0, "unchunked": 1, "lazy_logits": 0}, whole.losses
    assert "1 not chunked" in str(whole)
    assert Plan.from_json(chunked.to_json()).losses == chunked.losses


def _hf_llama(use_cache: bool | None, **options) -> Plan:
    """The plan of a tiny transformers Llama on meta called for training with ``labels`` (``use_cache`` None: at
    transformers' default, True) on 4 ranks."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()
    ids = torch.randint(0, 256, (1, 256), device="meta")
    kwargs = dict(input_ids=ids, labels=ids) | ({} if use_cache is None else dict(use_cache=use_cache))
    torch._dynamo.reset()
    return autoshard.plan(model, (), kwargs, world_size=4, **options)


def test_plan_names_a_returned_kv_cache_and_its_fix():
    """A training call at transformers' default ``use_cache=True`` returns every layer's keys and values: with
    checkpointed layers autograd does not save them, so the caller's cache is its own term of the peak, named with
    ``use_cache=False``; without the cache, or with the attention saving them anyway, there is none."""
    cached = _hf_llama(None, recompute="layers")
    cache = 2 * 2 * (1 * 2 * (256 // 4) * 16 * 2)  # layers x (K, V) x [B, Hkv, S / P, D] bfloat16
    assert cached.memory_per_rank.kv_cache == cache, cached.memory_per_rank
    assert f"returned KV cache {cache // 1024}.00 KiB" in str(cached) and "use_cache=False" in str(cached)
    uncached = _hf_llama(False, recompute="layers")
    assert uncached.memory_per_rank.kv_cache == 0 and "KV cache" not in str(uncached)
    assert uncached.memory_per_rank.total == cached.memory_per_rank.total - cache
    saved = _hf_llama(None)  # the attention saves the keys and values the cache returns: no bytes of its own
    assert saved.memory_per_rank.kv_cache == 0 and "KV cache" not in str(saved)
    assert Plan.from_json(cached.to_json()).memory_per_rank == cached.memory_per_rank
    with pytest.raises(MemoryBudgetError, match=r"returned KV cache 16\.00 KiB.*use_cache=False"):  # no lever removes it
        _hf_llama(None, memory_budget=2**16)


def test_a_compiled_training_call_that_returns_a_kv_cache_warns():
    """The compiler (not a plan) warns with the fix where a call with grad enabled returns a KV cache of
    checkpointed layers; not where autograd saves the keys and values anyway (no checkpoints), not under
    ``no_grad`` (a prefill's cache is its point), nor without one."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model, ids = transformers.LlamaForCausalLM(config).train(), torch.randint(0, 256, (1, 64))
    for use_cache, grad, recompute, warns in ((True, True, "layers", True), (True, True, "none", False),
                                              (True, False, "layers", False), (False, True, "layers", False)):
        torch._dynamo.reset()
        with torch.set_grad_enabled(grad):
            (gm, _, _), = capture(model, (), dict(input_ids=ids, labels=ids, use_cache=use_cache))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                compiled = compile_graph(gm, config=BackendConfig(recompute=recompute),
                                         groups=SequenceGroups.planned(0, 2))
        assert len(compiled.cache_outputs) == (2 if use_cache else 0)
        assert any("use_cache=False" in str(w.message) for w in caught) == warns, [str(w.message) for w in caught]
