"""Logits nobody reads cost nothing (``lazy_logits``): transformers' Llama called with ``labels=``, against one process.

A float32 ``LlamaForCausalLM`` (vocab 512, hidden 32: a vocabulary head; float32 because its loss upcasts the
logits with ``.float()``, which a float64 model would narrow, and such a loss is not chunked), length 61 (no world
size divides it), one training loop of three steps on 2 and 4 gloo ranks, each step checked against the same step
of an uncompiled copy on one process (loss, logits and every parameter gradient within 2e-5 of the reference's
largest magnitude):

1. ``loss.backward()`` only: the returned logits are a SplitTensor over a LazyLinear that is never computed, and
   the step makes exactly three products of the head (the chunked loss's logits, ``dh``, ``dW``; counted as the
   ATen matmuls with a vocabulary-sized dim). Then every rank reads them (``full_tensor()``): the one-process
   logits.
2. An objective that reads the logits (``loss + mean(logits^2)``): its gradient reaches the head through the lazy
   value as through the uncompiled head.
3. ``optimizer.step()`` with the logits held unread, then read: the logits of the weights the step ran with.

And ``lazy_logits=False`` returns them computed (a plain shard), four products.
"""

import functools

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.runtime.lazy_linear import LazyLinear
from autoshard.runtime.split_tensor import SplitTensor
from autoshard.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, TOLERANCE = 512, 61, 2e-5
_MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm")


def _head_products(profile) -> int:
    """The matmuls with a vocabulary-sized dim (the LM head's products) a profile recorded."""
    return sum(1 for e in profile.events() if e.name in _MATMULS
               and any(VOCAB in shape for shape in e.input_shapes if isinstance(shape, list)))


def _model():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to the reference's largest magnitude (at least 1)."""
    return ((got - want).abs().max() / want.abs().max().clamp(min=1)).item()


def _run(lazy: bool) -> dict:
    reference = _model()
    model = _model()
    compiled = autoshard.compile(model, lazy_logits=lazy)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    errors, facts = [], {}

    def check(objective):
        want = reference(input_ids=ids, labels=ids)
        objective(want).backward()
        with torch.profiler.profile(record_shapes=True) as profile:
            got = compiled(input_ids=ids, labels=ids)
            objective(got).backward()
        errors.append(_error(got.loss, want.loss))
        errors.extend(_error(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters()))
        return got, want, _head_products(profile)

    compiled(input_ids=ids, labels=ids).loss.backward()  # compile first
    model.zero_grad()
    got, want, facts["products"] = check(lambda out: out.loss)
    logits = got.logits
    local = logits.local if isinstance(logits, SplitTensor) else logits
    facts["lazy"] = isinstance(local, LazyLinear)
    facts["computed_after_backward"] = local.computed if facts["lazy"] else True
    errors.append(_error(logits.full_tensor(), want.logits))
    for m in (model, reference):
        m.zero_grad()

    check(lambda out: out.loss + out.logits.float().pow(2).mean())
    for m in (model, reference):
        m.zero_grad()

    got, want, _ = check(lambda out: out.loss)
    optimizer.step()
    reference_optimizer.step()
    errors.append(_error(got.logits.full_tensor(), want.logits))
    facts["error"] = max(errors)
    return facts


@functools.cache
def _results(world: int, lazy: bool):
    return run_on_ranks(_run, world, lazy, timeout=600)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_lazy_logits_match_one_process_and_cost_nothing_unread(world):
    for rank, facts in enumerate(_results(world, True)):
        where = f"P={world} rank {rank}"
        assert facts["error"] <= TOLERANCE, f"{where}: {facts}"
        assert facts["lazy"] and not facts["computed_after_backward"], f"{where}: {facts}"
        assert facts["products"] == 3, f"{where}: {facts['products']} products of the head in a loss-only step"


def test_lazy_logits_off_computes_them():
    for rank, facts in enumerate(_results(2, False)):
        assert facts["error"] <= TOLERANCE, f"rank {rank}: {facts}"
        assert not facts["lazy"] and facts["products"] == 4, f"rank {rank}: {facts}"


def test_hidden_state_held_in_host_memory_gives_the_same_value_and_gradients():
    """``lazy_linear(..., host=True)`` (with ``offload``): the value and the gradients of h, W, b are those of
    ``F.linear``, from the host copy it holds instead of ``h``."""
    from autoshard.runtime.lazy_linear import lazy_linear

    g = torch.Generator().manual_seed(0)
    h, w, b = (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
               for shape in ((2, 5, 8), (12, 8), (12,)))
    grad = torch.randn(2, 5, 12, generator=g, dtype=torch.float64)
    lazy = lazy_linear(h, w, b, host=True)
    assert not lazy.computed
    lazy.backward(grad)
    got = [t.grad.clone() for t in (h, w, b)]
    for t in (h, w, b):
        t.grad = None
    reference = torch.nn.functional.linear(h, w, b)
    reference.backward(grad)
    assert torch.equal(lazy.materialize(), reference.detach())
    assert all(torch.allclose(a, t.grad) for a, t in zip(got, (h, w, b)))
