"""Recurrences split along the sequence (:func:`autoshard.runtime.recurrence.split_recurrence`) on real ranks, against
the recurrence run position by position on one process: every rank's output, the final state and the gradient of
every input, in float64 (tolerance 1e-10), for the gated delta rule, Mamba2's scan and Mamba (1)'s selective scan,
contiguous and zigzag layouts, lengths the world size does not divide, a sequence shorter than the world, grouped
heads, a selective scan without its gate, a delta rule and an SSD scan that start from a given state.

The implementations registered here are the recurrences written out step by step (no chunks): state passing is
checked against an independent form of each rule, not against the chunked one transformers runs.
"""

import pytest
import torch
import torch.fx as fx
import torch.distributed as dist
import torch.nn.functional as F

from autoshard.runtime.groups import group_name
from autoshard.runtime.layouts import SequenceLayout
from autoshard.runtime.offload import eager_checkpoints
from autoshard.runtime.recurrence import register_implementation, split_recurrence
from autoshard.testing import run_on_ranks

BATCH, GROUPS, HEADS, KEY, VALUE, CHANNELS = 2, 2, 4, 5, 3, 6
TOLERANCE = dict(rtol=1e-10, atol=1e-10)


def delta_rule_stepwise(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=True,
                        use_qk_l2norm_in_kernel=False):
    """The gated delta rule one position at a time: ``S <- exp(g) S``, ``S <- S + beta k (v - S^T k)^T``,
    ``out = S^T q / sqrt(Dk)`` (query and key L2-normalized first when asked)."""
    query, key = (x.repeat_interleave(value.shape[2] // x.shape[2], 2) for x in (query, key))
    if use_qk_l2norm_in_kernel:
        query, key = (F.normalize(x, dim=-1, eps=1e-6) for x in (query, key))
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


def ssd_stepwise(x, dt, A, B, C, chunk_size=64, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
                 dt_limit=(0.0, float("inf")), return_final_states=True):
    """Mamba2's scan one position at a time: ``h <- exp(dt A) h + dt x B^T``, ``y = h C + D x``."""
    dt = dt + dt_bias if dt_bias is not None else dt
    dt = (F.softplus(dt) if dt_softplus else dt).clamp(*dt_limit)
    B, C = (t.repeat_interleave(x.shape[2] // t.shape[2], 2) for t in (B, C))
    h = initial_states if initial_states is not None else x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[-1])
    outs = []
    for t in range(x.shape[1]):
        h = h * (dt[:, t] * A).exp()[..., None, None] + torch.einsum("bh,bhp,bhn->bhpn", dt[:, t], x[:, t], B[:, t])
        outs.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]) + (D[:, None] * x[:, t] if D is not None else 0))
    return torch.stack(outs, 1), h


def selective_scan_stepwise(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                            return_last_state=True, **kwargs):
    """Mamba (1)'s selective scan one position at a time, in transformers' layout (channels first, the sequence
    last): ``h <- exp(dt A) h + dt B x``, ``y = (h C + D x) silu(z)``."""
    dt = dt + delta_bias[:, None] if delta_bias is not None else dt
    dt = F.softplus(dt) if delta_softplus else dt
    h = hidden_states.new_zeros(hidden_states.shape[0], hidden_states.shape[1], A.shape[-1])
    outs = []
    for t in range(hidden_states.shape[-1]):
        h = h * (dt[:, :, t, None] * A).exp() + torch.einsum("bd,bn,bd->bdn", dt[:, :, t], B[:, :, t],
                                                              hidden_states[:, :, t])
        y = torch.einsum("bdn,bn->bd", h, C[:, :, t]) + (D * hidden_states[:, :, t] if D is not None else 0)
        outs.append(y * F.silu(z[:, :, t]) if z is not None else y)
    return torch.stack(outs, -1), h


register_implementation("tests.delta_rule_stepwise", delta_rule_stepwise)
register_implementation("tests.ssd_stepwise", ssd_stepwise)
register_implementation("tests.selective_scan_stepwise", selective_scan_stepwise)


def _inputs(kind: str, length: int, from_state: bool) -> tuple[list, list, torch.Tensor | None, list]:
    """(sequence inputs, other inputs, initial state, config) of ``kind`` at ``length`` positions; the recurrences
    that take an initial state start from a random one when ``from_state`` (a cache's, a prompt continued)."""
    gen = torch.Generator().manual_seed(length)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    unit = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    if kind == "gated_delta_rule":
        return ([rand(BATCH, length, GROUPS, KEY), rand(BATCH, length, GROUPS, KEY), rand(BATCH, length, HEADS, VALUE),
                 -unit(BATCH, length, HEADS), unit(BATCH, length, HEADS)], [],
                rand(BATCH, HEADS, KEY, VALUE) if from_state else None, ["tests.delta_rule_stepwise", 64, True])
    if kind == "ssd_chunk_scan":
        return ([rand(BATCH, length, HEADS, VALUE), rand(BATCH, length, HEADS), rand(BATCH, length, GROUPS, KEY),
                 rand(BATCH, length, GROUPS, KEY)], [-unit(HEADS), rand(HEADS), rand(HEADS)],
                rand(BATCH, HEADS, VALUE, KEY) if from_state else None,
                ["tests.ssd_stepwise", 64, True, 0.0, float("inf")])
    gate = rand(BATCH, length, CHANNELS) if length != 2 else None  # the gate is optional: left out in one case
    return ([rand(BATCH, length, CHANNELS), rand(BATCH, length, CHANNELS), rand(BATCH, length, KEY),
             rand(BATCH, length, KEY), gate], [-unit(CHANNELS, KEY), rand(CHANNELS), rand(CHANNELS)], None,
            ["tests.selective_scan_stepwise", True])  # transformers' selective scan takes no initial state


def _one_process(kind: str, sequence: list, others: list, initial: torch.Tensor | None, config: list):
    if kind == "gated_delta_rule":
        return delta_rule_stepwise(*sequence, initial_state=initial, use_qk_l2norm_in_kernel=config[2])
    if kind == "ssd_chunk_scan":
        x, dt, B, C = sequence
        A, D, dt_bias = others
        return ssd_stepwise(x, dt, A, B, C, D=D, dt_bias=dt_bias, initial_states=initial, dt_softplus=config[2],
                            dt_limit=tuple(config[3:]))
    x, dt, B, C, z = (t.transpose(1, 2) if t is not None else None for t in sequence)
    A, D, delta_bias = others
    out, state = selective_scan_stepwise(x, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=config[1])
    return out.transpose(1, 2), state


def _weights(out_shape, state_shape):
    gen = torch.Generator().manual_seed(1000)
    return (torch.randn(*out_shape, generator=gen, dtype=torch.float64),
            torch.randn(*state_shape, generator=gen, dtype=torch.float64))


def _on_rank(kind: str, layout_kind: str, length: int, from_state: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = getattr(SequenceLayout, layout_kind)(length, world)
    sequence, others, initial, config = _inputs(kind, length, from_state)
    positions = layout.positions(rank)
    mine = [x.index_select(1, positions).requires_grad_() if x is not None else None for x in sequence]
    whole = [x.requires_grad_() for x in others + ([initial] if initial is not None else [])]
    out, state = split_recurrence(kind, mine, whole[:len(others)], initial, config, layout.encode(), rank,
                                  group_name(None))
    whole_out, _ = _one_process(kind, *_inputs(kind, length, from_state))
    w_out, w_state = _weights(whole_out.shape, state.shape)
    ((out * w_out.index_select(1, positions)).sum() + (state * w_state).sum() / world).backward()
    return out.detach(), state.detach(), [x.grad for x in mine if x is not None], [x.grad for x in whole]


CASES = [(2, "contiguous", 13, False), (2, "zigzag", 14, True), (3, "contiguous", 2, False),
         pytest.param(3, "contiguous", 11, True, marks=pytest.mark.slow),
         pytest.param(4, "zigzag", 19, False, marks=pytest.mark.slow)]
"""(world size, layout, length, whether the recurrences that take an initial state start from one)."""


@pytest.mark.parametrize("kind", ["gated_delta_rule", "ssd_chunk_scan", "selective_scan"])
@pytest.mark.parametrize("world,layout_kind,length,from_state", CASES)
def test_state_passing_equals_the_recurrence_on_one_process(kind, world, layout_kind, length, from_state):
    sequence, others, initial, config = _inputs(kind, length, from_state)
    sequence = [x.requires_grad_() if x is not None else None for x in sequence]
    whole = [x.requires_grad_() for x in others + ([initial] if initial is not None else [])]
    out, state = _one_process(kind, sequence, others, initial, config)
    w_out, w_state = _weights(out.shape, state.shape)
    ((out * w_out).sum() + (state * w_state).sum()).backward()
    layout = getattr(SequenceLayout, layout_kind)(length, world)
    whole_grads = [torch.zeros_like(x) for x in whole]
    for rank, (r_out, r_state, r_grads, r_whole_grads) in enumerate(run_on_ranks(_on_rank, world, kind, layout_kind,
                                                                                  length, from_state)):
        positions = layout.positions(rank)
        torch.testing.assert_close(r_out, out.detach().index_select(1, positions), **TOLERANCE,
                                   msg=f"rank {rank} output")
        torch.testing.assert_close(r_state, state.detach(), **TOLERANCE, msg=f"rank {rank} final state")
        for i, (got, x) in enumerate(zip(r_grads, [x for x in sequence if x is not None])):
            torch.testing.assert_close(got, x.grad.index_select(1, positions), **TOLERANCE,
                                       msg=f"rank {rank} gradient of sequence input {i}")
        whole_grads = [total + got for total, got in zip(whole_grads, r_whole_grads)]
    for i, (total, x) in enumerate(zip(whole_grads, whole)):  # each rank's share of a whole input's gradient
        torch.testing.assert_close(total, x.grad, **TOLERANCE,
                                   msg=f"gradient of whole input {i} (the initial state last), summed over ranks")


def _mixing_dtypes(hidden_states, dt, A, B, C, **kwargs):
    """The step-by-step scan, then a product of a bfloat16 and a float32 tensor: only autocast runs it (as
    transformers' Mamba (1) scan does with a bfloat16 model under autocast)."""
    out, state = selective_scan_stepwise(hidden_states.float(), dt.float(), A, B.float(), C.float(), **kwargs)
    eye = torch.eye(out.shape[1])
    return torch.matmul(eye, out.to(hidden_states.dtype)), state


register_implementation("tests.mixing_dtypes", _mixing_dtypes)


def test_backward_recomputes_under_the_forwards_autocast():
    """The ops' backward reruns the model's function: under the autocast the forward ran under, as activation
    checkpointing does (outside it, the bfloat16 x float32 product above fails)."""
    (x, dt, B, C, z), (A, D, delta_bias), _, _ = _inputs("selective_scan", 5, False)
    x = x.to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = torch.ops.autoshard.selective_scan(x, dt.float(), B.float(), C.float(), z.float(), A.float(), None,
                                                    None, "tests.mixing_dtypes", True)
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()


def test_a_checkpointed_region_run_eagerly_keeps_the_callers_autocast():
    """A rank graph's checkpointed region run as it is (``inner="eager"``) runs under the caller's autocast, as
    Jamba trained with transformers' checkpointing under bfloat16 autocast needs: torch's own eager path of
    ``tag_activation_checkpoint`` runs a custom op's implementation below the autocast dispatch key (the product
    above fails there); :func:`eager_checkpoints` points the region at torch's plain checkpoint."""
    (x, dt, B, C, z), (A, _, _), _, _ = _inputs("selective_scan", 5, False)
    x = x.to(torch.bfloat16).requires_grad_()

    class Body(torch.nn.Module):
        def forward(self, x, dt, B, C, z, A):
            return torch.ops.autoshard.selective_scan(x, dt, B, C, z, A, None, None, "tests.mixing_dtypes", True)[0]

    root = torch.nn.Module()
    root.body = fx.symbolic_trace(Body())
    graph = fx.Graph()
    inputs = [graph.placeholder(name) for name in ("x", "dt", "B", "C", "z", "A")]
    graph.output(graph.call_function(torch.ops.higher_order.tag_activation_checkpoint,
                                     (graph.get_attr("body"), *inputs), {"use_reentrant": False}))
    region = fx.GraphModule(root, graph)
    args = (x, dt.float(), B.float(), C.float(), z.float(), A.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="dtype|scalar type"):
            region(*args)
        assert eager_checkpoints(region) == 1
        out = region(*args)
    out.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
