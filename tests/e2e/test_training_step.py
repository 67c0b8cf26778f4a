"""autoshard inside a training step, against the same step on one process.

* Activation checkpointing (transformers' ``gradient_checkpointing_enable``: every decoder layer reaches the
  backend as a ``tag_activation_checkpoint`` subgraph): attention inside the checkpointed layers is
  distributed, the layers are still checkpointed (one recomputed region per layer in the report), loss
  and every gradient match one process, and the bytes each rank sends, recomputation included, are the
  bytes the report books -- under the eager and the aot_eager inner compilers.
* DDP over the ``dp`` axis of a (dp=2, sp=2) mesh, autoshard over ``sp``: the gradients equal the
  full-batch gradient of one process.
* A mesh whose axes are not sequence axes is refused with the sub-mesh to pass, on every rank.

Models: transformers ``LlamaForCausalLM`` with a small config (hidden 64, 2 layers, 4 / 2 heads, vocab 256,
random weights, nothing downloaded), lengths the world size does not divide, float32: loss and gradients
within 1e-4 relative (float32 rounding through two attention layers measures ~1e-6). One launch per world
size; one pytest item per case.
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.runtime import comm_counter
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
CHECKPOINT_CASES = [(2, 61, "zigzag", "eager"), (2, 62, "ring", "aot_eager"), (4, 63, "ring", "eager"),
                    (4, 61, "ulysses", "eager")]


def _llama(checkpointing: bool):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _checkpointed(seq: int, strategy: str, inner: str) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, seq))
    with comm_counter() as sent:
        r = compare_with_one_process(functools.partial(_llama, True), lambda: (),
                                     kwargs=dict(input_ids=ids, labels=ids, use_cache=False), strategy=strategy,
                                     inner=inner)
    rank = dist.get_rank()
    return {"error": r.max_error(), "summary": r.summary(), "fallbacks": r.fallbacks, "attention": r.attention,
            "recomputed": [rep.recomputed for rep in r.compiled_reports],
            "predicted": sum(c.bytes_by_rank[rank] for rep in r.compiled_reports for c in rep.comms),
            "measured": sent.payload_bytes_sent}


def _ddp_over_dp() -> dict:
    """DDP over dp, autoshard over sp; each dp group takes two of the four sequences of the global batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    refused = {}
    for name, bad in (("dp_sp", mesh), ("unnamed", init_device_mesh("cpu", (2, 2)))):
        try:
            autoshard.backend(bad)
        except ValueError as exc:
            refused[name] = str(exc)
    torch.manual_seed(0)
    model = _llama(False)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 256, (4, 29))
    reference(input_ids=ids, labels=ids).loss.backward()

    dp = mesh.get_local_rank("dp")
    mine = ids[2 * dp:2 * dp + 2]
    compiled = torch.compile(model, backend=autoshard.backend(mesh["sp"]))
    ddp = DistributedDataParallel(compiled, process_group=mesh["dp"].get_group())
    ddp(input_ids=mine, labels=mine).loss.backward()
    ref = dict(reference.named_parameters())
    worst = max((p.grad - ref[n].grad).abs().max().item() / ref[n].grad.abs().max().item()
                for n, p in model.named_parameters())
    return {"refused": refused, "grad_error": worst}


def _run(world: int):
    out = {case: _checkpointed(*case[1:]) for case in CHECKPOINT_CASES if case[0] == world}
    if world == 4:
        out["ddp"] = _ddp_over_dp()
    return out


@functools.cache
def _results(world: int):
    return run_on_ranks(_run, world, world, timeout=600)


@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=["-".join(map(str, c)) for c in CHECKPOINT_CASES])
def test_activation_checkpointing_keeps_attention_distributed(case):
    world, seq, strategy, inner = case
    for rank, results in enumerate(_results(world)):
        r = results[case]
        where = f"checkpointed Llama S={seq} {strategy} {inner} P={world} rank {rank}"
        assert r["error"] <= TOLERANCE, f"{where}: {r['summary']}"
        assert r["fallbacks"] == [], f"{where}: {r['fallbacks']}"
        assert len(r["attention"]) == 2 and all(a["strategy"] == strategy for a in r["attention"]), \
            f"{where}: {r['attention']}"
        (recomputed,) = r["recomputed"]  # one graph; one checkpointed region per layer, whose collectives rerun
        assert sorted(recomputed) == [0, 1] and all(v > 0 for v in recomputed.values()), f"{where}: {recomputed}"
        assert r["measured"] == r["predicted"], f"{where}: measured {r['measured']} bytes, booked {r['predicted']}"


def test_ddp_over_dp_of_a_dp_sp_mesh_matches_the_full_batch():
    for rank, results in enumerate(_results(4)):
        r = results["ddp"]
        assert r["grad_error"] <= TOLERANCE, f"rank {rank}: gradient error {r['grad_error']:.2e}"
        assert "mesh['sp']" in r["refused"]["dp_sp"], r["refused"]
        assert "unnamed" in r["refused"]["unnamed"], r["refused"]


def test_plan_states_the_recomputation_policy():
    """The dry run of a checkpointed model says which regions backward recomputes and what they send again;
    the recomputed collectives are among the plan's backward collectives."""
    torch._dynamo.reset()
    ids = torch.randint(0, 256, (1, 130))
    plan = autoshard.plan(_llama(True), kwargs=dict(input_ids=ids, labels=ids, use_cache=False), world_size=4,
                          strategy="ring")
    assert sorted(plan.recomputed) == ["g0.region0", "g0.region1"] and all(plan.recomputed.values()), plan.recomputed
    again = [c for c in plan.collectives if c.reason == "recomputed (activation checkpointing)"]
    assert again and all(c.phase == "backward" for c in again)
    assert sum(c.bytes_per_rank for c in again) == sum(plan.recomputed.values())
    assert "2 region(s) recomputed whole in backward" in str(plan)
    assert autoshard.Plan.from_json(plan.to_json()).recomputed == plan.recomputed
