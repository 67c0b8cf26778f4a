"""The rewritten graph handed to ``inner="aot_eager"`` and ``inner="inductor"``, on real ranks: a model
with dropout and attention gives the one-process outputs and gradients.

Dropout is the hard part for the inner compilers: every rank draws the one-process mask whole and keeps
its positions (``autoshard/runtime/random.py``), through a custom op AOTAutograd traces by its fake
implementation. The one-process reference and the compiled run start from the same seed, so equal
results mean equal masks, and an equal next draw afterwards means the default generator stayed in step.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.runtime.layouts import SequenceLayout
from autoshard.runtime.random import DRAWS
from autoshard.testing import run_on_ranks


class DropoutAttention(nn.Module):
    """Dropout before and after a causal attention: on the input, twice on the same value (two masks),
    and on the output viewed as (batch * sequence, width), where the sequence is a factor of a merged dim.

    ``last_dropout``: the function of the last dropout (``F.alpha_dropout`` runs on the gathered value).
    ``strided_heads``: the heads go into attention as strided views of the projection, as in most models.
    """

    def __init__(self, last_dropout=F.dropout, strided_heads: bool = False, width: int = 16, heads: int = 2):
        super().__init__()
        self.last_dropout, self.strided_heads, self.heads = last_dropout, strided_heads, heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        b, s, w = x.shape
        qkv = self.qkv(F.dropout(autoshard.mark_sequence(x, 1), 0.3, self.training))
        q, k, v = qkv.view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        if not self.strided_heads:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, w)
        y = self.out(F.dropout(a, 0.2, self.training) + F.dropout(a, 0.2, self.training))
        return self.last_dropout(y.reshape(b * s, w), 0.5, self.training).view(b, s, w)


def _run(call, model, x):
    """Output of ``call(x)``, gradients of ``model``'s parameters (of a fixed random weighting of the output)
    and the next draw of the default generator, from seed 1."""
    torch.manual_seed(1)
    out = call(x)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)).sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}, torch.rand(4, dtype=out.dtype)


def _against_one_process(inner, seq, dtype, training=True, **model_options):
    """Largest output and gradient errors against one process, whether the next draws agree, the placements
    of the dropout outputs and the nodes that fell back to whole values."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DropoutAttention(**model_options).to(dtype).train(training)
    x = torch.randn(2, seq, 16, dtype=dtype)
    reference = copy.deepcopy(model)
    ref_out, ref_grads, ref_next = _run(reference, reference, x)
    backend = autoshard.backend(inner=inner)
    out, grads, next_draw = _run(torch.compile(model, backend=backend), model, x)
    report = backend.compiled[-1].report
    errors = {"out": (out - ref_out).abs().max().item(),
              **{n: (grads[n] - g).abs().max().item() for n, g in ref_grads.items()}}
    dropout_placements = [p for name, p in report.placements.items() if "dropout" in name]
    return errors, torch.equal(next_draw, ref_next), dropout_placements, [f.node for f in report.fallbacks]


def _check(results, tolerance, fallbacks=()):
    for errors, same_next_draw, dropout_placements, fell_back in results:
        assert max(errors.values()) < tolerance, errors
        assert same_next_draw
        assert len(dropout_placements) == 4 and all(p.startswith("S(") for p in dropout_placements), \
            dropout_placements
        assert fell_back == list(fallbacks)


@pytest.mark.parametrize("world,seq", [(2, 12), pytest.param(3, 11, marks=pytest.mark.slow)])
def test_aot_eager_dropout_and_attention_match_one_process(world, seq):
    _check(run_on_ranks(_against_one_process, world, "aot_eager", seq, torch.float64), 1e-12)


def test_aot_eager_without_training_dropout_is_the_identity():
    _check(run_on_ranks(_against_one_process, 2, "aot_eager", 12, torch.float64, training=False), 1e-12)


def test_aot_eager_alpha_dropout_runs_on_the_gathered_value():
    results = run_on_ranks(_against_one_process, 2, "aot_eager", 12, torch.float64, last_dropout=F.alpha_dropout)
    _check(results, 1e-12, fallbacks=["reshape_1"])


def test_aot_eager_attention_on_strided_heads():
    """Heads as strided views of the projections, and the output viewed back: the op's fake strides must be
    the real ones for AOTAutograd's views to hold."""
    _check(run_on_ranks(_against_one_process, 2, "aot_eager", 12, torch.float64, strided_heads=True), 1e-12)


def _reference_models_under_aot_eager():
    from autoshard.testing.models import BertClassifier, LlamaLM
    from autoshard.testing.equivalence import compare_with_one_process

    ids = lambda: torch.randint(0, 256, (2, 13))  # noqa: E731
    out = []
    for make, inputs in ((LlamaLM, lambda: (ids(), ids())),
                         (BertClassifier, lambda: (ids(), torch.ones(2, 13, dtype=torch.long), torch.tensor([0, 1])))):
        torch._dynamo.reset()
        r = compare_with_one_process(make, inputs, dtype=torch.float64, inner="aot_eager")
        out.append((make.__name__, r.max_error(), r.fallbacks, [a["strategy"] for a in r.attention]))
    return out


def test_reference_models_under_aot_eager_match_one_process():
    for results in run_on_ranks(_reference_models_under_aot_eager, 2, timeout=300):
        for name, err, fallbacks, strategies in results:
            assert err < 1e-9 and not fallbacks and strategies, (name, err, fallbacks, strategies)


def test_inductor_dropout_and_attention_match_one_process():
    _check(run_on_ranks(_against_one_process, 2, "inductor", 8, torch.float32, timeout=300), 1e-5)


@pytest.mark.parametrize("kind", sorted(DRAWS))
def test_every_ranks_draw_is_its_part_of_the_one_process_draw(kind):
    """``sequence_draw`` alone, every rank in this process, from the same seed: a rank's part is the
    one-process draw at the positions the rank holds (zigzag over 3 ranks, the sequence as the inner
    factor of a merged (batch * sequence) dim)."""
    rest = [3, 4, 2] if kind == "dropout2d" else [3, 4]  # dropout2d takes (N, C, H, W)
    layout = SequenceLayout.zigzag(10, 3)
    torch.manual_seed(0)
    whole = DRAWS[kind]([2 * 10, *rest], 0.4, torch.float64, torch.device("cpu")).view(2, 10, *rest)
    for rank in range(3):
        torch.manual_seed(0)
        part = torch.ops.autoshard.sequence_draw(kind, 0.4, [2 * 10, *rest], 0, [2, 10], 1, layout.encode(), rank,
                                                 "site", torch.float64, torch.device("cpu"))
        assert torch.equal(part.view(2, -1, *rest), whole[:, layout.positions(rank)])


class RandomFactories(nn.Module):
    """Noise made by factories on a split value's shape: ``rand``, ``randn_like`` (drawn as their one-process
    parts) and ``randint_like`` (drawn whole)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x):
        h = self.proj(autoshard.mark_sequence(x, 1))
        return h * torch.rand(h.shape, dtype=h.dtype) + torch.randn_like(h) + torch.randint_like(h, 3)


def _small_model(model_class, inner):
    """Largest output/gradient error of ``model_class`` (a 6-wide float64 model over 11 positions) against one
    process, whether the next draws agree, and the placements of the compiled graph."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = model_class().double()
    x = torch.randn(2, 11, 6, dtype=torch.float64)
    reference = copy.deepcopy(model)
    ref_out, ref_grads, ref_next = _run(reference, reference, x)
    backend = autoshard.backend(inner=inner)
    out, grads, next_draw = _run(torch.compile(model, backend=backend), model, x)
    error = max([(out - ref_out).abs().max().item()] + [(grads[n] - g).abs().max().item() for n, g in ref_grads.items()])
    return error, torch.equal(next_draw, ref_next), backend.compiled[-1].report.placements


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_random_factories_draw_the_one_process_numbers(world):
    for inner in ("eager", "aot_eager"):
        for error, same_next_draw, placements in run_on_ranks(_small_model, world, RandomFactories, inner):
            assert error < 1e-12 and same_next_draw, (inner, error)
            assert placements["rand"].startswith("S(") and placements["randn_like"].startswith("S("), placements


class InplaceDropout(nn.Module):
    """``F.dropout(..., inplace=True)`` changes its input: the later use of ``h`` sees the dropped value."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x):
        h = self.proj(autoshard.mark_sequence(x, 1)) + 1  # nothing saves h for the backward
        y = F.dropout(h, 0.5, self.training, inplace=True)
        return h * 2 + y


def test_inplace_dropout_changes_its_input_as_on_one_process():
    for inner in ("eager", "aot_eager"):
        for error, same_next_draw, _ in run_on_ranks(_small_model, 2, InplaceDropout, inner):
            assert error < 1e-12 and same_next_draw, (inner, error)
