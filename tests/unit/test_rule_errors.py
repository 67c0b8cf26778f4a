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
