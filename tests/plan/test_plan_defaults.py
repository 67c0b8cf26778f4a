"""Plans of models called as their users call them -- default arguments, built on the meta device -- say what
a run does.

* Unmodified transformers models with only ``input_ids`` and ``labels`` (so ``use_cache`` at its default:
  a ``DynamicCache`` starts from ``torch.tensor([])`` on the inputs' device and is returned), built on the
  meta device: the plan is the plan of the same model on the CPU, to the byte (the attention decisions, every
  value's placement, the collectives, the memory). Llama's is also the run's: on 2 ranks, each rank's plan
  says the strategy, layout and mask of every attention and the placement of every value that rank's
  compiled graph reports.
* The hand-written models of the e2e tests (nanoGPT's buffer mask, Llama-1's complex RoPE, CLIP's eos
  pooling, chunked local attention, a Whisper-style convolution front end), default backend options:
  the plan on meta says what the run on 2 ranks reports, except nanoGPT's, whose causal mask is read from a
  buffer's values, which the meta device does not have: that plan says the mask is unknown and why
  (never causal), and the plan of the model on the CPU says what the run reports.

Tiny configs; the e2e tests' model classes and builders are imported from their files.
"""

import functools
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.planner.result import MASK_TERMS
from autoshard.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

WORLD = 2
MASK_FLAGS = MASK_TERMS


def _e2e(name: str):
    """The e2e test module ``name`` (tests are not a package: loaded from its file)."""
    path = Path(__file__).resolve().parents[1] / "e2e" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"plan_defaults_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hf, hf_more = _e2e("test_hf_models"), _e2e("test_hf_more_models")
constructs, chunked, conv = _e2e("test_constructs"), _e2e("test_chunked_attention"), _e2e("test_conv_frontend")
dropout = _e2e("test_attention_dropout")


def _on(device: str, make, inputs: tuple, kwargs: dict):
    """The model made on ``device`` and the inputs moved there."""
    with torch.device(device):
        model = make()
    move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return model, tuple(map(move, inputs)), {k: move(v) for k, v in kwargs.items()}


def _plan(device: str, make, inputs: tuple = (), kwargs: dict | None = None, **options):
    torch._dynamo.reset()
    model, inputs, kwargs = _on(device, make, inputs, kwargs or {})
    return autoshard.plan(model, inputs, kwargs, **options)


def _planned(plan) -> tuple[list, dict]:
    """(per attention: node, strategy, layout, mask; value -> placement) of a plan."""
    return [(a.node, a.strategy, a.layout, a.mask) for a in plan.attention], plan.placements


def _ran(make, inputs: tuple, kwargs: dict) -> tuple[list, dict]:
    """The same as :func:`_planned`, from the reports of a run with the default backend on this rank."""
    torch._dynamo.reset()
    backend = autoshard.backend()
    torch.compile(make(), backend=backend)(*inputs, **kwargs)
    attention, placements = [], {}
    for index, graph in enumerate(backend.compiled):
        for a in graph.report.attention:
            mask = ", ".join(k if k != "chunk" else f"chunk {a[k]}" for k in MASK_FLAGS if a.get(k)) or "none"
            attention.append((f"g{index}.{a['node']}", a["strategy"], a.get("layout", "-"), mask))
        placements.update({f"g{index}.{k}": v for k, v in graph.report.placements.items()})
    return attention, placements


# ----------------------------------------------------------------------------- transformers


def _hf(name: str):
    """(model factory, default-argument kwargs) of a small transformers model: input_ids and labels only."""
    torch.manual_seed(0)
    make, kwargs = hf_more._model(name, 64, "sdpa") if name in hf_more.MODELS else hf.build(name, 64, "sdpa")
    return make, {k: v for k, v in kwargs.items() if k in ("input_ids", "labels")}


HF_MODELS = ["llama", "mistral", "bert", *(pytest.param(name, marks=pytest.mark.slow) for name in ("gpt2", "falcon"))]


@pytest.mark.parametrize("name", HF_MODELS)
def test_transformers_model_plans_on_meta_with_default_arguments(name):
    if name in hf_more.MODELS and hf_more._missing(name):
        pytest.skip(f"transformers {transformers.__version__} lacks {hf_more._missing(name)}")
    make, kwargs = _hf(name)
    meta = _plan("meta", make, kwargs=kwargs, world_size=64)
    cpu = _plan("cpu", make, kwargs=kwargs, world_size=64)
    assert meta.attention and meta.fallbacks == [], str(meta)
    assert _planned(meta) == _planned(cpu)
    assert meta.to_json() == cpu.to_json()


def _llama_plan_and_run():
    rank = dist.get_rank()
    make, kwargs = _hf("llama")
    return (_planned(_plan("meta", make, kwargs=kwargs, world_size=WORLD, rank=rank)),
            _ran(make, (), kwargs))


def test_transformers_llama_plan_on_meta_is_the_run():
    for rank, (planned, ran) in enumerate(run_on_ranks(_llama_plan_and_run, WORLD, timeout=300)):
        assert planned[0] == ran[0], f"rank {rank}: attention planned {planned[0]}, run {ran[0]}"
        assert planned[1] == ran[1], f"rank {rank}: placements differ"


# ----------------------------------------------------------------------------- hand-written models


MODELS = {  # name: (model factory, inputs)
    "buffer_mask": (constructs.NanoGPT, constructs._tokens),
    "rope_complex": (constructs.LlamaOne, constructs._tokens),
    "eos_pooling": (constructs.ClipText, constructs._clip_inputs),
    "chunked_additive_padded": (lambda: chunked.ChunkedLM("additive"), lambda: chunked._inputs(True)),
    "chunked_masked_fill": (lambda: chunked.ChunkedLM("masked_fill"), lambda: chunked._inputs(False)),
    "audio_encoder": (conv.AudioEncoder, lambda: (torch.randn(2, conv.FEATURES, conv.FRAMES),)),
    "latent_attention": (constructs.latent_lm, constructs._tokens),
    "alibi": (constructs.alibi_lm, constructs._tokens),
    "relative_bias": (constructs.relative_lm, constructs._tokens),
    "attention_dropout": (dropout.DropLM, lambda: constructs._tokens(dropout.SEQ)),
}
NEEDS_VALUES = {"buffer_mask"}
"""Models whose run reads values a model on meta does not have (nanoGPT's mask: a buffer's values)."""


SLOW = ("rope_complex", "chunked_masked_fill", "chunked_additive_padded", "latent_attention", "alibi", "relative_bias",
        "attention_dropout")
"""Models planned and run in the slow tier's launch (the capture catalogue plans their spellings in the default
suite)."""


def _plans_and_runs(names: list[str]):
    rank, out = dist.get_rank(), {}
    for name in names:
        make, inputs = MODELS[name]
        torch.manual_seed(0)  # every rank the same inputs
        args = inputs()
        meta = _plan("meta", make, args, world_size=WORLD, rank=rank)
        out[name] = {"meta": _planned(meta), "cpu": _planned(_plan("cpu", make, args, world_size=WORLD, rank=rank)),
                     "run": _ran(make, args, {}), "meta_reasons": [a.reason for a in meta.attention],
                     "meta_fallbacks": len(meta.fallbacks)}
    return out


@functools.cache
def _plans_and_runs_of(slow: bool) -> list[dict]:
    """Every rank's plans and runs of the models of one tier: one launch per tier."""
    return run_on_ranks(_plans_and_runs, WORLD, [name for name in MODELS if (name in SLOW) == slow], timeout=300)


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else [])
                                  for name in MODELS])
def test_hand_written_model_plan_is_the_run(name):
    for rank, results in enumerate(_plans_and_runs_of(name in SLOW)):
        r = results[name]
        where = f"{name} P={WORLD} rank {rank}"
        assert r["run"][0], f"{where}: no attention distributed"
        assert r["cpu"][0] == r["run"][0], f"{where}: attention planned on the CPU {r['cpu'][0]}, run {r['run'][0]}"
        assert r["cpu"][1] == r["run"][1], f"{where}: placements planned on the CPU differ from the run's"
        if name not in NEEDS_VALUES:
            assert r["meta"] == r["cpu"], f"{where}: the plan on meta differs from the plan on the CPU"


def test_buffer_mask_on_meta_is_unknown_not_causal():
    """On meta the buffer has no values: the plan must not assume the causal mask they hold on the CPU. It
    plans the mask as it is there (dense: K/V gathered, fallbacks) and says which buffer it could not read."""
    for rank, results in enumerate(_plans_and_runs_of(False)):
        r = results["buffer_mask"]
        where = f"buffer_mask P={WORLD} rank {rank}"
        assert all(mask == "causal" for *_, mask in r["cpu"][0]), f"{where}: {r['cpu'][0]}"
        attention = r["meta"][0]
        assert len(attention) == constructs.LAYERS, f"{where}: {attention}"
        assert all(strategy == "gathered-kv" and mask == "unknown" for _, strategy, _, mask in attention), \
            f"{where}: {attention}"
        assert r["meta_fallbacks"] > 0, where
        for reason in r["meta_reasons"]:
            assert "bias" in reason and "values are unknown" in reason, f"{where}: {reason}"
