"""Packed documents through a compiled transformers Llama (issue 23): work proportional to the documents, balanced.

One row of 4096 tokens packed with a dozen documents of log-normal lengths (tens to about a thousand tokens,
``position_ids`` restarting at each), ``autoshard.compile`` with the default strategy choice, 4 ranks, one training
step. Asserts: loss and every gradient equal one process's (float64); the attention FLOPs every rank counted
(:func:`~autoshard.runtime.attention.flops.attention_flops`, forward and backward) sum to exactly the documents' own
causal work (before: the work of one causal sequence of 4096, 9.67x theirs); and max/mean over ranks <= 1.10 (as laid out,
the zigzag layout leaves the rank holding the long documents' tails with ~1.4x the mean). ``explain()`` reports the
work per rank, and the plan of the same batch predicts every rank's work exactly.
"""

import pytest
import torch

import autoshard
from autoshard.runtime.attention import attention_flops
from autoshard.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

SEQ = 4096
HEADS, HEAD_DIM = 4, 16
TOLERANCE = 1e-6
"""Relative, float64 model: transformers computes its loss from ``logits.float()``."""


def _lengths() -> list[int]:
    gen = torch.Generator().manual_seed(3)
    out = []
    while sum(out) < SEQ:
        out.append(int(torch.empty(1).log_normal_(5.5, 0.8, generator=gen).clamp(20, 1000)))
    out[-1] -= sum(out) - SEQ
    return out


def _model():
    cfg = transformers.LlamaConfig(hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=HEADS, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=SEQ)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double().train()


def _inputs() -> dict:
    ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in _lengths()])[None]
    return dict(input_ids=ids, labels=ids.clone(), position_ids=positions, use_cache=False)


def _step(model, run=None) -> tuple[torch.Tensor, dict]:
    loss = (model if run is None else run)(**_inputs()).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _rank() -> dict:
    model = _model()
    compiled = autoshard.compile(model)
    with attention_flops() as flops:
        loss, grads = _step(model, compiled)
    attention = [a for r in compiled.autoshard_backend.compiled for a in r.report.attention]
    return dict(loss=loss, grads=grads, flops=flops.total, strategies=[a["strategy"] for a in attention],
                explain=autoshard.explain(compiled))


def test_packed_llama_work_is_the_documents_and_balanced():
    results = run_on_ranks(_rank, 4, timeout=600)
    loss, grads = _step(_model())
    for r in results:
        assert abs(r["loss"] - loss) <= TOLERANCE * abs(loss), (r["loss"], loss)
        for name, grad in grads.items():
            error = ((r["grads"][name] - grad).abs().max() / grad.abs().max()).item()
            assert error <= TOLERANCE, (name, error)
    assert results[0]["strategies"] == ["allgather"], results[0]["strategies"]
    lengths = _lengths()
    documents = sum(n * (n + 1) // 2 for n in lengths) * HEADS * 14 * HEAD_DIM  # forward 4D + backward 10D per pair
    work = [r["flops"] for r in results]
    assert sum(work) == documents, (sum(work), documents, SEQ * (SEQ + 1) // 2 * HEADS * 14 * HEAD_DIM)
    assert max(work) / (sum(work) / len(work)) <= 1.10, work
    assert "attention work per rank" in results[0]["explain"], results[0]["explain"]
    plan = autoshard.plan(_model(), kwargs=_inputs(), world_size=4)  # the plan knows each rank's work, exactly
    assert [w * HEADS * 14 * HEAD_DIM for w in plan.documents["work"]] == work, (plan.documents, work)
    assert plan.documents["laid_out_imbalance"] > 1.2 and "packed documents (" in str(plan)
