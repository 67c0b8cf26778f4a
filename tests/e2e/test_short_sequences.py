"""Sequences shorter than the world (issue 25: a prompt shorter than the world size works; a rank may hold no
prompt token): the contiguous layout leaves the last ranks empty instead of refusing the sequence.

At 4 ranks, transformers Llama (GQA, float64): ``generate()`` from a 3-token prompt gives one process's tokens with
the prefill distributed and every decode step on the sharded cache (the empty rank takes the first new token); one
training step on 3 tokens gives one process's loss and every gradient.
"""

import pytest
import torch

import autoshard
from autoshard.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

LENGTH, WORLD = 3, 4


def _model():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double()


def _ids():
    return torch.randint(0, 256, (1, LENGTH), generator=torch.Generator().manual_seed(1))


def _generate(model):
    return model.eval().generate(_ids(), max_new_tokens=5, do_sample=False)


def _train(model, run=None):
    loss = (model if run is None else run)(input_ids=_ids(), labels=_ids()).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _rank() -> dict:
    model, backend = _model(), autoshard.backend()
    model.forward = torch.compile(model.forward, backend=backend)
    tokens = _generate(model)
    strategies = [a["strategy"] for record in backend.compiled for a in record.report.attention]
    trained = _model().train()
    loss, grads = _train(trained, autoshard.compile(trained))
    return dict(tokens=tokens, strategies=strategies, loss=loss, grads=grads)


def test_a_sequence_shorter_than_the_world():
    results = run_on_ranks(_rank, WORLD, timeout=600)
    tokens = _generate(_model())
    loss, grads = _train(_model().train())
    for r in results:
        assert torch.equal(r["tokens"], tokens), (r["tokens"], tokens)
        assert set(r["strategies"]) == {"allgather", "decode"}, r["strategies"]
        assert abs(r["loss"] - loss) <= 1e-6 * abs(loss), (r["loss"], loss)  # transformers' loss is float32
        for name, grad in grads.items():
            error = ((r["grads"][name] - grad).abs().max() / grad.abs().max()).item()
            assert error <= 1e-9, (name, error)
