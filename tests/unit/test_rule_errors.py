"""An error inside a rule names the node it was rewriting: the pass, the op, the node and the user's line, with
the rule's own exception chained."""

import dataclasses

import pytest
import torch

import autoshard
from autoshard.testing.models import LlamaLM
from autoshard.passes.rules import RULES


class _Broken(Exception):
    pass


def _broken(rw, node, op):
    raise _Broken("the rule broke")


def test_an_error_inside_a_rule_names_the_node(monkeypatch):
    monkeypatch.setitem(RULES, "embedding", dataclasses.replace(RULES["embedding"], rewrite=_broken))
    torch._dynamo.reset()
    ids = torch.randint(0, 256, (1, 12))
    with pytest.raises(Exception) as info:
        autoshard.plan(LlamaLM(), (ids, ids), world_size=2, strategy="ring")
    error = info.value
    while error is not None and not str(error).startswith("autoshard pass 'rewrite'"):
        error = error.__cause__ or error.__context__
    assert error is not None, f"no error names the node: {info.value!r}"
    message = str(error)
    assert "failed on embedding node" in message and "torch.nn.functional.embedding" in message, message
    assert "user code: " in message and "embed" in message.split("user code: ")[1].splitlines()[0], message
    assert "_Broken: the rule broke" in message, message
    assert isinstance(error.__cause__, _Broken)


class _ThreeWay(torch.nn.Module):
    def forward(self, x):
        x = autoshard.mark_sequence(x, 1)
        return torch.einsum("bsd,bse,bsf->def", x, x, x)  # einsum's binder takes two operands


def test_a_call_its_binder_does_not_take_is_unbound_not_without_a_rule():
    torch._dynamo.reset()
    plan = autoshard.plan(_ThreeWay(), torch.randn(2, 8, 3), world_size=2)
    why = "unbound einsum: einsum of 3 operands: the product rule takes two"
    expected = [("g0.x", "gather", why), ("g0.einsum", str(torch.einsum), why)]  # its input gathered, the call whole
    assert [(f.node, f.op, f.reason) for f in plan.fallbacks] == expected, plan.fallbacks


class _WriteThroughACopy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        windows = h.unfold(1, 2, 1)  # a view with no rule: the rule gathers a whole copy of h
        windows.mul_(2)  # on one process this changes h
        q = h.unsqueeze(1)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)


def test_a_write_into_a_whole_copy_of_a_split_value_is_an_error_not_a_lost_write():
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        autoshard.plan(_WriteThroughACopy(), torch.randn(1, 6, 8), world_size=2)
    assert "writes into windows, a whole copy of h, which is split along the sequence" in str(info.value), info.value
    assert "windows.mul_(2)" in str(info.value), info.value
