"""Recognized calls (:mod:`autoshard.recognized`): a model module's gated delta rule is recorded as one op, through
the wrappers transformers puts around it, and a graph traced through it before it was recognized is warned about.
Its kernel form too: where transformers' wrapper would call a kernel package (fla) instead of the torch form, the op
runs the kernel, packed documents (``cu_seqlens``) included.

The "model module" is made here (a module named under ``transformers.models.``, its function the step-by-step rule of
``tests/runtime/test_recurrence.py`` wrapped as transformers wraps it: ``functools.wraps`` inside an ``nn.Module``
standing for the function), so the test needs no model and runs on one process.
"""

import functools
import sys
import types

import pytest
import torch

import autoshard

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


KERNEL_CALLS: list = []


def _kernel_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                             use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """A kernel package's rule (fla's signature: no ``chunk_size``, a ``cu_seqlens``), the step-by-step one here."""
    KERNEL_CALLS.append(cu_seqlens)
    return delta_rule_stepwise(q, k, v, g, beta, initial_state=initial_state,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


@functools.cache
def _kernel_form_module() -> types.ModuleType:
    """A model module whose rule is wrapped by transformers' ``use_kernel_func_from_hub_with_fallback`` with a kernel
    package installed (one with no device list: transformers calls it on any device)."""
    kernels = types.ModuleType("autoshard_test_kernels")
    kernels.kernel_gated_delta_rule = _kernel_gated_delta_rule
    sys.modules[kernels.__name__] = kernels
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    @use_kernel_func_from_hub_with_fallback("kernel_gated_delta_rule", kernels.__name__)
    def torch_chunk_gated_delta_rule(*args, **kwargs):
        raise AssertionError("the torch form ran where transformers calls the kernel")

    module = types.ModuleType("transformers.models.autoshard_test_kernel_form")
    setattr(module, NAME, torch_chunk_gated_delta_rule)
    sys.modules[module.__name__] = module
    recognize_loaded()
    return module


class _Packed(torch.nn.Module):
    """The rule over two packed documents (4 and 5 positions), on projected inputs."""

    def __init__(self):
        super().__init__()
        self.module = _kernel_form_module()

    def forward(self, q, k, v, g, beta):
        out, _ = getattr(self.module, NAME)(q * 1.5, k * 1.5, v * 1.5, g=g, beta=beta, use_qk_l2norm_in_kernel=True,
                                            cu_seqlens=torch.tensor([0, 4, 9]))
        return out * 2


def test_a_kernel_form_is_one_op_that_runs_the_kernel():
    """The graph holds one op, which calls the kernel where the model would (the torch form never runs), with the
    packed documents' ``cu_seqlens`` passed on."""
    KERNEL_CALLS.clear()
    (gm,), out = _graphs(_Packed(), _inputs())
    assert sum("gated_delta_rule" in str(n.target) for n in gm.graph.nodes) == 1
    assert KERNEL_CALLS and all(torch.equal(c, torch.tensor([0, 4, 9])) for c in KERNEL_CALLS), KERNEL_CALLS
    q, k, v, g, beta = _inputs()
    expected, _ = delta_rule_stepwise(q * 1.5, k * 1.5, v * 1.5, g, beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, expected * 2, rtol=1e-6, atol=1e-6)


def test_a_recurrence_over_packed_documents_runs_whole_and_says_why():
    """State passing does not restart the state at document boundaries: the plan gathers the rule's inputs, each a
    fallback naming the packed documents."""
    torch._dynamo.reset()
    plan = autoshard.plan(_Packed(), _inputs(), world_size=2)
    assert plan.fallbacks and all("packed documents" in f.reason for f in plan.fallbacks), plan.fallbacks
