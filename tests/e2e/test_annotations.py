"""Annotations on real ranks: each changes what the compiler does, and results stay exact. The models are
the README example's (``examples/annotations.py``), plus a mixture of experts."""

import functools
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

_spec = importlib.util.spec_from_file_location(
    "examples_annotations", Path(__file__).resolve().parents[2] / "examples" / "annotations.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


class Experts(nn.Module):
    """Top-2 mixture of experts dispatched like transformers does it: sort the (token, expert) pairs by
    expert, gather the tokens, run each expert on its slice, put them back with an inverse permutation
    written in place. Every step mixes the token dim globally, yet the result is per token."""

    def __init__(self, experts: int = 4, width: int = 8):
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.w = nn.Parameter(torch.randn(experts, width, width) * 0.3)

    @autoshard.token_local
    def dispatch(self, h):
        tokens = h.reshape(-1, h.shape[-1])
        weights, expert = torch.topk(self.router(tokens).softmax(-1), 2, dim=-1)
        order = torch.sort(expert.reshape(-1))
        sorted_expert, perm = order[0], order[1]
        picked = tokens[perm // 2]
        out = torch.einsum("td,tde->te", picked, self.w[sorted_expert]) * weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=h.device)
        return out[inverse].view(tokens.shape[0], 2, -1).sum(1).view(h.shape)

    def forward(self, x):
        return self.dispatch(autoshard.mark_sequence(x, 1))


CASES = {
    "mark_sequence": (example.TokenMLP, lambda: (torch.randn(2, 7, 8),)),
    "whole": (example.Reverse, lambda: (torch.randn(2, 7, 8),)),
    "token_local": (example.Sparse, lambda: (torch.randn(2, 7, 8),)),
    "attention_function": (example.WithMyAttention, lambda: (torch.randn(2, 9, 16),)),
    "token_local_moe": (Experts, lambda: (torch.randn(2, 9, 8),)),
}


def _check_all():
    out = {}
    for name, (model, inputs) in CASES.items():
        torch._dynamo.reset()
        r = compare_with_one_process(model, inputs, dtype=torch.float64, strategy="ring")
        out[name] = (r.max_error(), r.summary(), r.fallbacks, r.transitions, r.attention)
    return out


@functools.cache
def _results() -> list[dict]:
    """Every rank's results by case: one launch."""
    return run_on_ranks(_check_all, 2, timeout=300)


CHANGES = {  # what each annotation changed, from (transitions, attention records)
    # mark_sequence split the MLP (a partial mean was reduced)
    "mark_sequence": lambda transitions, attention: any(t.startswith("all_reduce") for t in transitions),
    # whole gathered the value before the flip
    "whole": lambda transitions, attention: any(t.startswith("all_gather h") for t in transitions),
    # token_local kept topk / scatter on shards: nothing is gathered, the output leaves split
    "token_local": lambda transitions, attention: transitions == [],
    # the marked attention became distributed attention
    "attention_function": lambda transitions, attention: [a["strategy"] for a in attention] == ["ring"],
    # the mixture of experts dispatched each rank's tokens locally: nothing is gathered
    "token_local_moe": lambda transitions, attention: transitions == [],
}


@pytest.mark.parametrize("name", list(CASES))
def test_annotation_changes_the_plan_and_keeps_results_exact(name):
    for rank, result in enumerate(_results()):
        err, summary, fallbacks, transitions, attention = result[name]
        assert err < 1e-9, f"{name} rank {rank}: {summary}"
        assert fallbacks == [], f"{name} rank {rank}: {fallbacks}"
        assert CHANGES[name](transitions, attention), f"{name} rank {rank}: {transitions}, {attention}"
