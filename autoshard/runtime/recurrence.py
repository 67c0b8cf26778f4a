"""Linear recurrences split along the sequence by state passing: the gated delta rule (``autoshard::gated_delta_rule``)
and Mamba2's chunked scan (``autoshard::ssd_chunk_scan``).

Linear-attention and state-space layers carry a state along the sequence instead of attending to keys: Gated
DeltaNet (Qwen3-Next, Qwen3.5, OLMo-Hybrid) a ``[B, H, Dk, Dv]`` state that decays, is corrected towards each
position's value (the delta rule) and is read by its query; Mamba2 (Falcon-H1, Bamba) a ``[B, H, P, N]`` state that
decays by ``exp(dt A)`` and takes ``dt B x`` at each position, read by ``C``. The model's own function computes it
(transformers' chunked torch form, or a kernel); :mod:`autoshard.recognized` makes dynamo record that call as one op
(its implementation named by a string, looked up in :data:`IMPLEMENTATIONS`), so the compiler sees one node with
the sequence on dim 1 of its inputs instead of a loop over chunks unrolled into the graph.

**State passing** (:func:`split_recurrence`, what the rule of :mod:`autoshard.passes.rules.recurrence` emits). Both
recurrences are linear in their values and initial state together. Run over one piece of the sequence from an
initial state ``X``, the output is ``out(X) = out(0) + out_{v=0}(X)`` and the final state ``F(X) = T(X) + E``, with
``E = F(0)`` and ``T`` linear: the delta rule's state evolves column by column (``T(X) = M X``, ``M`` ``Dk x Dk``
per head), SSD's row by row (``T(X) = X M``, ``M`` ``N x N``). So each rank runs each of its pieces once with the
values widened by that many zero channels and the initial state widened by the identity: the first channels give
``out(0)`` and ``E``, the last give ``M``. One all-gather of every piece's ``[E | M]`` (a few states per rank, however
long the sequence) lets every rank fold the pieces before each of its own, in sequence order, into that piece's
incoming state ``X``; a second run from ``X`` with zero values gives the correction ``out_{v=0}(X)``. Every layout
is served (a zigzag rank holds two pieces, each with its own incoming state); the work per rank is about two local
runs over ``S / P`` positions, against one run over ``S`` on one process. The final state (a cache's) is the fold
over every piece, the same on every rank.

The ops' backward recomputes the forward under autograd and differentiates it (the way activation checkpointing
does): the implementation is the model's own code, whose backward autograd already knows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .collectives import all_gather
from .layouts import SequenceLayout
from .op_info import declare

__all__ = ["IMPLEMENTATIONS", "RECURRENCES", "Recurrence", "pieces_per_rank", "register_implementation",
           "split_recurrence", "state_dtype", "state_passing_bytes"]

IMPLEMENTATIONS: dict[str, Callable] = {}
"""Name -> the function a recurrence op runs, with transformers' signature: for ``autoshard::gated_delta_rule``
``fn(query, key, value, g=, beta=, chunk_size=, initial_state=, output_final_state=True, use_qk_l2norm_in_kernel=) ->
(out, final state)`` (query and key ``[B, S, Hk, Dk]``, value ``[B, S, Hv, Dv]``, ``g`` and ``beta`` ``[B, S, Hv]``,
the state ``[B, Hv, Dk, Dv]``); for ``autoshard::ssd_chunk_scan`` (Mamba2's state space duality) ``fn(x, dt, A, B,
C, chunk_size=, D=, dt_bias=, initial_states=, dt_softplus=, dt_limit=, return_final_states=True) -> (out, final
state)`` (``x`` ``[B, S, H, P]``, ``dt`` ``[B, S, H]``, ``B`` and ``C`` ``[B, S, G, N]``, the state
``[B, H, P, N]``)."""


def register_implementation(name: str, fn: Callable) -> None:
    """Make ``fn`` the implementation a recurrence op runs when called with ``implementation=name``."""
    IMPLEMENTATIONS[name] = fn


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a recurrence op's state (and of the scan's output) for inputs of ``dtype``: float32, float64 for
    float64 inputs."""
    return torch.promote_types(torch.float32, dtype)


def _implementation(name: str) -> Callable:
    if name not in IMPLEMENTATIONS:
        raise KeyError(f"autoshard: no recurrence implementation {name!r} registered "
                       f"(known: {sorted(IMPLEMENTATIONS)})")
    return IMPLEMENTATIONS[name]


def _recomputing_autograd(op, run: Callable, tensors: int) -> None:
    """``op``'s autograd: save its ``tensors`` tensor inputs, and in backward run ``run`` on them (and the rest of the
    inputs) under autograd and differentiate it."""
    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:tensors])
        ctx.config = inputs[tensors:]

    def backward(ctx, grad_out, grad_state):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) if t is not None else None
                      for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[:tensors])]
            out, state = run(*leaves, *ctx.config)
            pairs = [(o, go) for o, go in ((out, grad_out), (state, grad_state)) if go is not None]
            wanted = [t for t in leaves if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [go for _, go in pairs], allow_unused=True)
                         if wanted else ())
        return (*(next(grads) if t is not None and t.requires_grad else None for t in leaves),
                *(None for _ in ctx.config))

    op.register_autograd(backward, setup_context=setup)


# ----------------------------------------------------------------------------- the gated delta rule


def _run_gated_delta_rule(q, k, v, g, beta, initial_state, implementation: str, chunk_size: int,
                          use_qk_l2norm: bool):
    out, state = _implementation(implementation)(q, k, v, g=g, beta=beta, chunk_size=chunk_size,
                                                 initial_state=initial_state, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=use_qk_l2norm)
    return out.contiguous(), state.to(state_dtype(q.dtype)).contiguous()


@torch.library.custom_op("autoshard::gated_delta_rule", mutates_args=())
def _gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: torch.Tensor | None, implementation: str, chunk_size: int,
                      use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_gated_delta_rule(q, k, v, g, beta, initial_state, implementation, chunk_size, use_qk_l2norm)


@_gated_delta_rule.register_fake
def _(q, k, v, g, beta, initial_state, implementation, chunk_size, use_qk_l2norm):
    batch, length, _, key_dim = k.shape
    heads, value_dim = v.shape[-2:]
    return (q.new_empty((batch, length, heads, value_dim)),
            q.new_empty((batch, heads, key_dim, value_dim), dtype=state_dtype(q.dtype)))


_recomputing_autograd(_gated_delta_rule, _run_gated_delta_rule, 6)
declare(torch.ops.autoshard.gated_delta_rule.default)


# ----------------------------------------------------------------------------- Mamba2's chunked scan (SSD)


def _run_ssd_chunk_scan(x, dt, B, C, A, D, dt_bias, initial_state, implementation: str, chunk_size: int,
                        dt_softplus: bool, dt_min: float, dt_max: float):
    out, state = _implementation(implementation)(x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias,
                                                 initial_states=initial_state, dt_softplus=dt_softplus,
                                                 dt_limit=(dt_min, dt_max), return_final_states=True)
    return out.to(state_dtype(x.dtype)).contiguous(), state.to(state_dtype(x.dtype)).contiguous()


@torch.library.custom_op("autoshard::ssd_chunk_scan", mutates_args=())
def _ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, A: torch.Tensor,
                    D: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_state: torch.Tensor | None,
                    implementation: str, chunk_size: int, dt_softplus: bool, dt_min: float,
                    dt_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_ssd_chunk_scan(x, dt, B, C, A, D, dt_bias, initial_state, implementation, chunk_size, dt_softplus,
                               dt_min, dt_max)


@_ssd_chunk_scan.register_fake
def _(x, dt, B, C, A, D, dt_bias, initial_state, implementation, chunk_size, dt_softplus, dt_min, dt_max):
    batch, _, heads, head_dim = x.shape
    dtype = state_dtype(x.dtype)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((batch, heads, head_dim, B.shape[-1]), dtype=dtype)


_recomputing_autograd(_ssd_chunk_scan, _run_ssd_chunk_scan, 8)
declare(torch.ops.autoshard.ssd_chunk_scan.default)


# ----------------------------------------------------------------------------- state passing


@dataclass(frozen=True, kw_only=True)
class Recurrence:
    """What state passing needs to know of a recurrence op."""

    op: Any
    """The op (``torch.ops.autoshard.<name>``): ``op(*sequence inputs, *other inputs, initial state, *config)``."""
    values: int
    """Which sequence input holds the values (the recurrence is linear in them and the initial state together)."""
    value_dim: int
    """The state's dim the values' last dim becomes: -1 (the delta rule's ``[Dk, Dv]``: the state's columns evolve
    alone, ``X <- T X``) or -2 (SSD's ``[P, N]``: its rows do, ``X <- X T``)."""
    other: Callable[[list], int]
    """The size of the state's other dim, from the sequence inputs."""
    output_dtype: Callable[[list], torch.dtype]
    """The output's dtype, from the sequence inputs."""


RECURRENCES = {
    "gated_delta_rule": Recurrence(op=torch.ops.autoshard.gated_delta_rule, values=2, value_dim=-1,
                                   other=lambda sequence: sequence[1].shape[-1],
                                   output_dtype=lambda sequence: sequence[0].dtype),
    "ssd_chunk_scan": Recurrence(op=torch.ops.autoshard.ssd_chunk_scan, values=0, value_dim=-2,
                                 other=lambda sequence: sequence[2].shape[-1],
                                 output_dtype=lambda sequence: state_dtype(sequence[0].dtype)),
}
"""The recurrence ops state passing serves, by name."""


def split_recurrence(kind: str, sequence: list[torch.Tensor], others: list[torch.Tensor | None], config: list,
                     layout: list[int], rank: int, group: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence ``kind`` (:data:`RECURRENCES`) of a sequence split by ``layout`` (encoded) along dim 1 of every
    ``sequence`` input, on this ``rank``'s positions, by state passing over ``group`` (see the module docstring): this
    rank's output and the whole sequence's final state (:func:`state_dtype`, the same on every rank). ``others``: the
    op's inputs with no sequence (whole), ``config`` its non-tensor arguments."""
    recurrence, layout = RECURRENCES[kind], SequenceLayout.decode(layout)
    values = sequence[recurrence.values]
    batch, _, heads, value_size = values.shape
    other, dim, dtype = recurrence.other(sequence), recurrence.value_dim, state_dtype(values.dtype)
    state_shape = (batch, heads) + ((other, value_size) if dim == -1 else (value_size, other))
    start_state = torch.cat([values.new_zeros(state_shape, dtype=dtype),
                             torch.eye(other, dtype=dtype, device=values.device).expand(batch, heads, -1, -1)], dim)

    def run(inputs: list, new_values: torch.Tensor, initial: torch.Tensor):
        inputs = inputs[:recurrence.values] + [new_values] + inputs[recurrence.values + 1:]
        return recurrence.op(*inputs, *others, initial, *config)

    pieces, offset = [], 0
    for lo, hi in layout.local_intervals(rank):
        inputs = [x.narrow(1, offset, hi - lo) for x in sequence]
        offset += hi - lo
        mine = inputs[recurrence.values]
        out, state = run(inputs, torch.cat([mine, mine.new_zeros(mine.shape[:-1] + (other,))], -1), start_state)
        pieces.append((inputs, out[..., :value_size], state))
    # The all-gather's backward is a collective every rank must join, and so is the sum of the whole inputs'
    # gradients, so on every rank the output depends on every gathered state and every whole input (``anchor``, a
    # zero) and the gathered states on the inputs (the padding, a zero multiple of their sum): the first piece's
    # incoming state is a constant, and a rank may hold no position at all.
    most = pieces_per_rank(layout)  # ranks may hold fewer pieces
    padding = torch.zeros_like(start_state) + sum(x.sum() for x in sequence) * 0
    every = all_gather(torch.stack([state for _, _, state in pieces] + [padding] * (most - len(pieces))), 0,
                       group=group)
    anchor = (every.sum() + sum(x.sum() for x in others if x is not None)) * 0  # the whole inputs too
    starts = [(lo, r, i) for r in range(layout.world_size) for i, (lo, _) in enumerate(layout.local_intervals(r))]
    incoming, fold = {}, values.new_zeros(state_shape, dtype=dtype)
    for _, r, i in sorted(starts):
        incoming[r, i] = fold
        piece = every[r * most + i]
        transition, entering = piece.narrow(dim, value_size, other), piece.narrow(dim, 0, value_size)
        fold = (transition @ fold if dim == -1 else fold @ transition) + entering
    outs = []
    for i, (inputs, out, _) in enumerate(pieces):
        correction, _ = run(inputs, torch.zeros_like(inputs[recurrence.values]), incoming[rank, i])
        outs.append(out + correction + anchor)
    if not outs:  # a rank holding no position (a sequence shorter than the world)
        return torch.zeros_like(values, dtype=recurrence.output_dtype(sequence)) + anchor, fold
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)), fold


def pieces_per_rank(layout: SequenceLayout) -> int:
    """How many pieces of the sequence each rank contributes to the state all-gather: the most any rank holds (the
    others pad)."""
    return max(len(layout.local_intervals(r)) for r in range(layout.world_size))


def state_passing_bytes(state_shape: tuple, other: int, value_dim: int, pieces: int, itemsize: int) -> int:
    """Bytes one rank contributes to the all-gather of :func:`split_recurrence`: its pieces' widened states (the
    state ``state_shape`` with ``other`` more entries along ``value_dim``) of ``itemsize`` bytes an element."""
    widened = list(state_shape)
    widened[value_dim] += other
    return pieces * math.prod(widened) * itemsize
