"""Recognized calls (:mod:`autoshard.recognized`): a model module's gated delta rule is recorded as one op, through
the wrappers transformers puts around it, and a graph traced through it before it was recognized is warned about.

The "model module" is made here (a module named under ``transformers.models.``, its function the step-by-step rule of
``tests/runtime/test_recurrence.py`` wrapped as transformers wraps it: ``functools.wraps`` inside an ``nn.Module``
standing for the function), so the test needs no model and runs on one process.
"""

import functools
import sys
import types

import pytest
import torch

from autoshard.recognized import recognize_loaded, warn_if_traced_through
from tests.runtime.test_recurrence import delta_rule_stepwise

NAME = "torch_chunk_gated_delta_rule"


def _model_module(name: str) -> types.ModuleType:
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        out, state = delta_rule_stepwise(query, key, value, g, beta, initial_state=initial_state,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return out, state if output_final_state else None

    @functools.wraps(torch_chunk_gated_delta_rule)
    def wrapped(*args, **kwargs):  # transformers' fallback to its torch form
        return torch_chunk_gated_delta_rule(*args, **kwargs)

    class Func(torch.nn.Module):  # the hub-kernel layer standing for the function
        def forward(self, *args, **kwargs):
            return wrapped(*args, **kwargs)

    module = types.ModuleType(name)
    setattr(module, NAME, Func())
    sys.modules[name] = module
    return module


def _layer(module):
    def layer(q, k, v, g, beta):
        out, _ = getattr(module, NAME)(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        return out * 2
    return layer


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(1, 9, 2, 4, generator=gen), torch.randn(1, 9, 2, 4, generator=gen),
            torch.randn(1, 9, 2, 3, generator=gen), -torch.rand(1, 9, 2, generator=gen),
            torch.rand(1, 9, 2, generator=gen))


def _graphs(fn, inputs) -> list:
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=record)(*inputs)
    return graphs, out


def test_a_loaded_model_modules_rule_is_one_op_computing_the_same():
    module = _model_module("transformers.models.autoshard_test_recognized")
    recognize_loaded()
    (gm,), out = _graphs(_layer(module), _inputs())
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("gated_delta_rule" in str(t) for t in targets) == 1, targets
    assert not any("einsum" in str(t) for t in targets), targets  # nothing of the rule's own steps was traced
    torch.testing.assert_close(out, _layer(module)(*_inputs()), rtol=1e-6, atol=1e-6)


def test_a_graph_traced_through_the_rule_is_warned_and_the_rule_recognized_next_time():
    module = _model_module("transformers.models.autoshard_test_traced_through")  # loaded after recognize_loaded
    (gm,), _ = _graphs(_layer(module), _inputs())
    with pytest.warns(UserWarning, match=f"traced through {NAME} before autoshard recognized it"):
        warn_if_traced_through(gm)
    (gm,), _ = _graphs(_layer(module), _inputs())
    assert any("gated_delta_rule" in str(n.target) for n in gm.graph.nodes)
