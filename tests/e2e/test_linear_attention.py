"""Linear attention and state-space layers split along the sequence by state passing: transformers' Qwen3-Next,
Falcon-H1, Jamba and Mamba, unmodified.

Qwen3-Next alternates Gated DeltaNet layers (transformers' chunked torch form of the gated delta rule, a causal
``conv1d`` before it) with full attention, and its MLPs are experts; Falcon-H1 runs a Mamba2 mixer (transformers'
chunked scan) beside the attention in every layer; Jamba alternates Mamba (1) layers (a selective scan, position by
position) with attention, experts in every other layer; Mamba has Mamba layers alone (no attention: its scans seed
the split). Under ``autoshard.backend()`` the rule and the scans are recorded as one op each
(:mod:`autoshard.recognized`) and split by state passing (one all-gather of every piece's state;
:mod:`autoshard.runtime.recurrence`). Asserted on real ranks against one process (float32 -- transformers computes
both in float32 whatever the model's dtype -- 1e-4 relative, as the other transformers models): loss and every
gradient, 0 fallbacks, no S x S value, no activation gathered whole or moved between ranks, every attention
distributed, the state passed forward and its gradient backward; and the plan's bytes, state passing included, equal
to the bytes the run sent.
Lengths the world size does not divide, ring (contiguous) and zigzag (two pieces on a rank) layouts. ``generate()``
gives one process's tokens: the prefill split, the decode steps reading the passed final state and the conv state; a
prompt continued in a second chunk starts that chunk's recurrences from the cached state.
A new length every step compiles once more, for a length class that serves the later lengths.
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.passes.rules.recurrence import STATE_PASSING
from autoshard.runtime import comm_counter
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4


def _build(name: str, seq: int):
    """(model factory, forward kwargs): Qwen3-Next (Gated DeltaNet and attention layers, experts), Jamba (a Mamba
    layer, then an attention layer with experts), Mamba (Mamba layers alone) or Falcon-H1 (Mamba2 and attention side
    by side in every layer)."""
    if name == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=256, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32,
            layer_types=["linear_attention", "full_attention"])
        cls = transformers.Qwen3NextForCausalLM
    elif name == "mamba":
        cfg = transformers.MambaConfig(vocab_size=256, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2,
                                       conv_kernel=4, time_step_rank=8)
        cls = transformers.MambaForCausalLM
    elif name == "jamba":
        cfg = transformers.JambaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
            attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
            mamba_dt_rank=8, max_position_embeddings=256)
        cls = transformers.JambaForCausalLM
    else:
        cfg = transformers.FalconH1Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
            mamba_d_conv=4, mamba_chunk_size=8, max_position_embeddings=256)
        cls = transformers.FalconH1ForCausalLM
    if name != "mamba":  # Mamba has no attention
        cfg._attn_implementation = "sdpa"
    ids = torch.randint(0, 256, (2, seq))
    return (lambda: cls(cfg)), {"input_ids": ids, "labels": ids.clone()}


def _case(name: str, seq: int, strategy: str, count_bytes: bool) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)  # every rank builds the same model and inputs
    make, kwargs = _build(name, seq)
    r = compare_with_one_process(make, lambda: (), kwargs=kwargs, strategy=strategy)
    out = dict(error=r.max_error(), summary=r.summary(), fallbacks=r.fallbacks,
               strategies=[a["strategy"] for a in r.attention],
               squares=[v for report in r.compiled_reports for v in report.square_values],
               moved=[f"{t.kind} {t.node}" for report in r.compiled_reports for t in report.transitions
                      if t.reason != "output"],  # the logits the harness compares are gathered
               passing=sorted(c.phase for report in r.compiled_reports for c in report.comms
                              if c.reason == STATE_PASSING))
    if count_bytes:
        out["bytes"] = _planned_and_sent(make(), dict(kwargs, use_cache=False), strategy)
    return out


def _planned_and_sent(model, kwargs: dict, strategy: str) -> tuple:
    """(planned forward, sent forward, planned backward, sent backward) bytes of one training step."""
    torch._dynamo.reset()
    plan = autoshard.plan(model, (), kwargs, world_size=dist.get_world_size(), rank=dist.get_rank(),
                          strategy=strategy, outputs="gathered")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=autoshard.backend(strategy=strategy, outputs="gathered"))
    with comm_counter() as forward:
        loss = compiled(**kwargs).loss
    with comm_counter() as backward:
        loss.backward()
    return plan.bytes_sent("forward"), forward.payload_bytes_sent, plan.bytes_sent("backward"), backward.bytes_sent


def _generate(name: str, length: int) -> dict:
    """generate() on a prompt of ``length`` tokens: the prefill split (the layers' final states and conv states go
    to the cache whole), the decode steps on them; the tokens against the same model uncompiled on this rank."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    make, _ = _build(name, length)
    model = make().eval()
    prompt = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(1))
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
    backend = autoshard.backend()
    model.forward = torch.compile(model.forward, backend=backend)
    return dict(same=torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), expected),
                explain=autoshard.explain(backend))


def _continue(name: str, first: int, second: int) -> dict:
    """A prompt of ``first`` tokens, then ``second`` more continuing its cache (a multi-turn chat's next turn): the
    second chunk's recurrences start from the cached state; the logits against the same model uncompiled."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    make, _ = _build(name, first)
    model = make().eval()
    ids = torch.randint(0, 256, (1, first + second), generator=torch.Generator().manual_seed(2))
    backend = autoshard.backend(outputs="gathered")
    compiled = torch.compile(model.forward, backend=backend)
    logits = []
    with torch.no_grad():
        for run in (model.forward, compiled):
            head = run(ids[:, :first], use_cache=True)
            tail = run(ids[:, first:], past_key_values=head.past_key_values, use_cache=True)
            logits.append(torch.cat([head.logits, tail.logits], 1))
    return dict(error=(logits[1] - logits[0]).abs().max().item(), explain=autoshard.explain(backend))


def _lengths(name: str, lengths: list[int]) -> dict:
    """Training losses at a new length every step (a padding-free run) against the same model uncompiled, and what
    the backend compiled for them."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    make, _ = _build(name, 8)
    model = make()
    reference = make()
    reference.load_state_dict(model.state_dict())
    compiled = autoshard.compile(model)
    errors = []
    for n in lengths:
        ids = torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(n))
        loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
        expected = reference(input_ids=ids, labels=ids, use_cache=False).loss
        errors.append(abs((loss - expected) / expected).item())
    backend = compiled.autoshard_backend
    return dict(errors=errors, compilations=sum(backend.compilations.values()),
                fallbacks=[f for record in backend.compiled for f in record.report.fallbacks])


CASES = {2: [("qwen3_next", 14, "zigzag", False), ("falcon_h1", 13, "ring", True), ("mamba", 15, "zigzag", True)],
         4: [("qwen3_next", 13, "ring", True), ("falcon_h1", 15, "zigzag", False), ("jamba", 14, "ring", False)]}
"""(model, length, strategy, whether the plan's bytes are checked too), by world size."""

GENERATE = {2: "qwen3_next", 4: "jamba"}
"""The model generate() runs, by world size."""


@functools.cache
def _results(world: int) -> list[list[dict]]:
    return run_on_ranks(_run, world, CASES[world], timeout=600)


def _run(cases) -> list[dict]:
    world = dist.get_world_size()
    extra = [_generate(GENERATE[world], 37)] + ([_lengths("falcon_h1", [37, 41, 53, 60])] if world == 2 else
                                                 [_continue("qwen3_next", 33, 27)])
    return [_case(*case) for case in cases] + extra


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_linear_attention_and_state_space_layers_pass_their_state(world):
    for rank, results in enumerate(_results(world)):
        for (name, seq, strategy, _), r in zip(CASES[world], results):
            where = f"{name} S={seq} {strategy} P={world} rank {rank}"
            assert r["error"] <= TOLERANCE, f"{where}: {r['summary']}"
            assert r["fallbacks"] == [] and r["squares"] == [], f"{where}: {r['fallbacks']} {r['squares']}"
            assert r["moved"] == [], f"{where}: activations gathered or moved between ranks: {r['moved']}"
            attentions = set() if name == "mamba" else {strategy}  # Mamba has none: its recurrences seed the split
            assert set(r["strategies"]) == attentions, f"{where}: {r['strategies']}"
            assert r["passing"] and r["passing"].count("forward") == r["passing"].count("backward"), \
                f"{where}: state passing booked {r['passing']}"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_plan_books_the_state_passing_the_run_sends(world):
    for rank, results in enumerate(_results(world)):
        for (name, seq, strategy, count_bytes), r in zip(CASES[world], results):
            if count_bytes:
                planned_forward, sent_forward, planned_backward, sent_backward = r["bytes"]
                assert (planned_forward, planned_backward) == (sent_forward, sent_backward), (name, seq, rank)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_generate_prefills_split_and_decodes_from_the_passed_state(world):
    for rank, results in enumerate(_results(world)):
        r = results[len(CASES[world])]
        assert r["same"], f"rank {rank}: tokens differ from one process\n{r['explain']}"
        graphs = [line for line in r["explain"].splitlines() if line.startswith("graph")]
        assert "allgather" in graphs[0] and "1 recurrence(s) passing their state" in graphs[0], r["explain"]
        assert all(" 0 fallback(s)" in line for line in graphs), r["explain"]
        assert all("decode" in line for line in graphs[1:]), r["explain"]


def test_new_lengths_share_one_compilation():
    """A new length every step (37, 41, 53, 60 tokens): the first compiles for its length, the next for a length
    class that serves the rest -- the scans, their convolutions' halos and the state passing computed per call."""
    for rank, results in enumerate(_results(2)):
        r = results[-1]
        assert max(r["errors"]) <= 1e-6, f"rank {rank}: relative loss errors {r['errors']}"
        assert r["compilations"] == 2 and r["fallbacks"] == [], (rank, r)


@pytest.mark.slow
def test_a_continued_prompt_starts_its_recurrences_from_the_cached_state():
    """The second chunk's recurrence is split too, its first piece starting from the cache's state (its attention,
    over the cached keys and the new ones, runs whole: keys that are not the queries' sequence)."""
    for rank, results in enumerate(_results(4)):
        r = results[-1]
        assert r["error"] <= 1e-5, f"rank {rank}: logits differ by {r['error']}\n{r['explain']}"
        graphs = [line for line in r["explain"].splitlines() if line.startswith("graph")]
        assert len(graphs) == 2 and all("1 recurrence(s) passing their state" in line for line in graphs), r["explain"]


def _checkpointed_under_autocast(name: str, seq: int) -> dict:
    """One training step of ``name`` with transformers' gradient checkpointing under bfloat16 autocast, against one
    process doing the same: the largest relative differences of the loss and of the gradients, and the fallbacks."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    make, kwargs = _build(name, seq)
    model = make().train()
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = autoshard.compile(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(**kwargs).loss
        expected = reference(**kwargs).loss
    loss.backward()
    expected.backward()
    grads = [((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in zip(model.parameters(),
                                                                           reference.parameters()) if q.grad is not None]
    backend = compiled.autoshard_backend
    return dict(loss=abs((loss - expected) / expected).item(), grads=max(grads),
                fallbacks=[f for record in backend.compiled for f in record.report.fallbacks])


@pytest.mark.slow
def test_a_hybrid_trains_with_checkpointing_under_autocast():
    """Jamba (a Mamba (1) layer: transformers' scan multiplies a bfloat16 by a float32 tensor, which only autocast
    runs) with transformers' gradient checkpointing under bfloat16 autocast: the checkpointed regions run under the
    caller's autocast (they failed in forward before). bfloat16 tolerances: the loss within 1e-3, each gradient's
    norm-wise difference within 5e-2 of one process under the same autocast."""
    for rank, r in enumerate(run_on_ranks(_checkpointed_under_autocast, 2, "jamba", 30, timeout=600)):
        assert r["loss"] < 1e-3 and r["grads"] < 5e-2 and r["fallbacks"] == [], (rank, r)
