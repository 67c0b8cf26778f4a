"""The gated delta rule split along the sequence (:func:`autoshard.runtime.recurrence.split_gated_delta_rule`) on
real ranks, against the recurrence run position by position on one process: every rank's output, the final state and
the gradients of query, key, value, decay and beta, in float64 (tolerance 1e-10), contiguous and zigzag layouts,
lengths the world size does not divide, grouped value heads.

The implementation registered here is the recurrence written out step by step (no chunks): the state passing is
checked against an independent form of the rule, not against the chunked one it runs.
"""

import pytest
import torch
import torch.distributed as dist

from autoshard.runtime.groups import group_name
from autoshard.runtime.layouts import SequenceLayout
from autoshard.runtime.recurrence import register_implementation, split_gated_delta_rule
from autoshard.testing import run_on_ranks

B, HK, HV, DK, DV = 2, 2, 4, 5, 3
TOLERANCE = dict(rtol=1e-10, atol=1e-10)


def stepwise(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=True,
             use_qk_l2norm_in_kernel=False):
    """The gated delta rule one position at a time: ``S <- exp(g) S``, ``S <- S + beta k (v - S^T k)^T``,
    ``out = S^T q / sqrt(Dk)`` (query and key L2-normalized first when asked)."""
    query, key = (x.repeat_interleave(value.shape[2] // x.shape[2], 2) for x in (query, key))
    if use_qk_l2norm_in_kernel:
        query, key = (torch.nn.functional.normalize(x, dim=-1, eps=1e-6) for x in (query, key))
    state = (initial_state if initial_state is not None
             else value.new_zeros(value.shape[0], value.shape[2], key.shape[-1], value.shape[-1])).to(value.dtype)
    outs = []
    for t in range(value.shape[1]):
        k, q = key[:, t], query[:, t] * key.shape[-1] ** -0.5
        state = state * g[:, t].exp()[..., None, None]
        delta = (value[:, t] - torch.einsum("bhkv,bhk->bhv", state, k)) * beta[:, t, :, None]
        state = state + torch.einsum("bhk,bhv->bhkv", k, delta)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q))
    return torch.stack(outs, 1), state


register_implementation("tests.stepwise", stepwise)


def _inputs(length: int):
    gen = torch.Generator().manual_seed(length)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return [rand(B, length, HK, DK), rand(B, length, HK, DK), rand(B, length, HV, DV),
            -torch.rand(B, length, HV, generator=gen, dtype=torch.float64), torch.rand(B, length, HV, generator=gen,
                                                                                   dtype=torch.float64)]


def _weights(length: int):
    gen = torch.Generator().manual_seed(1000 + length)
    return (torch.randn(B, length, HV, DV, generator=gen, dtype=torch.float64),
            torch.randn(B, HV, DK, DV, generator=gen, dtype=torch.float64))


def _on_rank(kind: str, length: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = getattr(SequenceLayout, kind)(length, world)
    whole = _inputs(length)
    mine = [x.index_select(1, layout.positions(rank)).requires_grad_() for x in whole]
    out, state = split_gated_delta_rule(*mine, "tests.stepwise", 64, True, layout.encode(), rank, group_name(None))
    w_out, w_state = _weights(length)
    loss = (out * w_out.index_select(1, layout.positions(rank))).sum() + (state * w_state).sum() / world
    loss.backward()
    return out.detach(), state.detach(), [x.grad for x in mine]


@pytest.mark.parametrize("world,kind,length", [(2, "contiguous", 13), (2, "zigzag", 14), (3, "contiguous", 2),
                                               pytest.param(3, "contiguous", 11, marks=pytest.mark.slow),
                                               pytest.param(4, "zigzag", 19, marks=pytest.mark.slow)])
def test_state_passing_equals_the_recurrence_on_one_process(world, kind, length):
    whole = [x.clone().requires_grad_() for x in _inputs(length)]
    out, state = stepwise(*whole, use_qk_l2norm_in_kernel=True)
    w_out, w_state = _weights(length)
    ((out * w_out).sum() + (state * w_state).sum()).backward()
    layout = getattr(SequenceLayout, kind)(length, world)
    for rank, (r_out, r_state, r_grads) in enumerate(run_on_ranks(_on_rank, world, kind, length)):
        torch.testing.assert_close(r_out, out.detach().index_select(1, layout.positions(rank)), **TOLERANCE, msg=f"rank {rank} output")
        torch.testing.assert_close(r_state, state.detach(), **TOLERANCE, msg=f"rank {rank} final state")
        for name, got, x in zip(("query", "key", "value", "g", "beta"), r_grads, whole):
            torch.testing.assert_close(got, x.grad.index_select(1, layout.positions(rank)), **TOLERANCE,
                                       msg=f"rank {rank} gradient of {name}")
