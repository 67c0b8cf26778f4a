"""Linear recurrences split along the sequence by state passing: the gated delta rule (``autoshard::gated_delta_rule``).

Linear-attention layers (Gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo-Hybrid) carry a state ``S`` of shape
``[B, H, Dk, Dv]`` along the sequence instead of attending to keys: at each position the state decays, is corrected
towards the position's value (the delta rule) and is read by its query. The model's own function computes it
(transformers' chunked torch form, or a kernel); :mod:`autoshard.recognized` makes dynamo record that call as one
``autoshard::gated_delta_rule`` (its implementation named by a string, looked up in :data:`IMPLEMENTATIONS`), so
the compiler sees one node with the sequence on dim 1 of its inputs instead of an unrolled loop over chunks.

**State passing** (:func:`split_gated_delta_rule`, what the rule of :mod:`autoshard.passes.rules.recurrence` emits).
The recurrence is linear in its values and initial state together. Run over one piece of the sequence from an initial
state ``X``, its output is ``out(X) = out(0) + out_{v=0}(X)`` and its final state ``F(X) = M X + E`` with ``E = F(0)``
and ``M`` (``Dk x Dk`` per head) the final state reached from the identity with zero values. So each rank runs each
of its pieces once with the values widened by ``Dk`` zero columns and the initial state ``[0 | I]``: the first ``Dv``
columns give ``out(0)`` and ``E``, the last ``Dk`` give ``M``. One all-gather of every piece's ``[E | M]`` (``B * H *
Dk * (Dv + Dk)`` numbers per piece, however long the sequence) lets every rank fold the pieces before each of its own,
in sequence order, into that piece's incoming state ``X``; a second run from ``X`` with zero values gives the
correction ``out_{v=0}(X)``. Every layout is served (a zigzag rank holds two pieces, each with its own incoming
state); the work per rank is about ``2 + Dk / Dv`` local runs over ``S / P`` positions, against one run over ``S``
on one process. The final state (a cache's) is the fold over every piece, the same on every rank.

The op's backward recomputes the forward under autograd and differentiates it (the way activation checkpointing
does): the implementation is the model's own code, whose backward autograd already knows; for a kernel with a
backward of its own that is the kernel's.
"""

from __future__ import annotations

from typing import Callable

import torch

from .collectives import all_gather
from .layouts import SequenceLayout
from .op_info import declare

__all__ = ["IMPLEMENTATIONS", "register_implementation", "split_gated_delta_rule", "state_dtype", "state_passing_bytes"]

IMPLEMENTATIONS: dict[str, Callable] = {}
"""Name -> the function ``autoshard::gated_delta_rule`` runs: ``fn(query, key, value, g=, beta=, chunk_size=,
initial_state=, output_final_state=True, use_qk_l2norm_in_kernel=) -> (out, final state)``, transformers'
signature (query and key ``[B, S, Hk, Dk]``, value ``[B, S, Hv, Dv]``, ``g`` and ``beta`` ``[B, S, Hv]``)."""


def register_implementation(name: str, fn: Callable) -> None:
    """Make ``fn`` the implementation ``autoshard::gated_delta_rule(..., implementation=name)`` runs."""
    IMPLEMENTATIONS[name] = fn


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the op's state for inputs of ``dtype``: float32, float64 for float64 inputs."""
    return torch.promote_types(torch.float32, dtype)


def _run(q, k, v, g, beta, initial_state, implementation: str, chunk_size: int, use_qk_l2norm: bool):
    if implementation not in IMPLEMENTATIONS:
        raise KeyError(f"autoshard::gated_delta_rule: no implementation {implementation!r} registered "
                       f"(known: {sorted(IMPLEMENTATIONS)})")
    return IMPLEMENTATIONS[implementation](q, k, v, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                                           output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)


@torch.library.custom_op("autoshard::gated_delta_rule", mutates_args=())
def _gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: torch.Tensor | None, implementation: str, chunk_size: int,
                      use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out, state = _run(q, k, v, g, beta, initial_state, implementation, chunk_size, use_qk_l2norm)
    return out.contiguous(), state.to(state_dtype(q.dtype)).contiguous()


@_gated_delta_rule.register_fake
def _(q, k, v, g, beta, initial_state, implementation, chunk_size, use_qk_l2norm):
    batch, length, _, key_dim = k.shape
    heads, value_dim = v.shape[-2:]
    return (q.new_empty((batch, length, heads, value_dim)),
            q.new_empty((batch, heads, key_dim, value_dim), dtype=state_dtype(q.dtype)))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6])
    ctx.config = inputs[6:]


def _backward(ctx, grad_out, grad_state):
    saved = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(need) if t is not None else None
                  for t, need in zip(saved, ctx.needs_input_grad[:6])]
        out, state = _run(*leaves, *ctx.config)
        pairs = [(o, go) for o, go in ((out, grad_out), (state, grad_state)) if go is not None]
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [go for _, go in pairs], allow_unused=True)
                     if wanted else ())
    return (*(next(grads) if t is not None and t.requires_grad else None for t in leaves), None, None, None)


_gated_delta_rule.register_autograd(_backward, setup_context=_setup)
declare(torch.ops.autoshard.gated_delta_rule.default)


def split_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           implementation: str, chunk_size: int, use_qk_l2norm: bool, layout: list[int], rank: int,
                           group: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule of a sequence split by ``layout`` (encoded) along dim 1 of every input, on this
    ``rank``'s positions, by state passing over ``group`` (see the module docstring): this rank's output and the
    whole sequence's final state (:func:`state_dtype`, the same on every rank)."""
    layout = SequenceLayout.decode(layout)
    batch, _, heads, value_dim = v.shape
    key_dim = k.shape[-1]
    state_shape = (batch, heads, key_dim, value_dim)
    dtype = state_dtype(q.dtype)
    start_state = torch.cat([q.new_zeros(state_shape, dtype=dtype),
                             torch.eye(key_dim, dtype=dtype, device=q.device).expand(batch, heads, -1, -1)], -1)
    pieces, offset = [], 0
    for lo, hi in layout.local_intervals(rank):
        inputs = [x.narrow(1, offset, hi - lo) for x in (q, k, v, g, beta)]
        offset += hi - lo
        wide = torch.cat([inputs[2], inputs[2].new_zeros(inputs[2].shape[:-1] + (key_dim,))], -1)
        out, state = torch.ops.autoshard.gated_delta_rule(*inputs[:2], wide, *inputs[3:], start_state, implementation,
                                                          chunk_size, use_qk_l2norm)
        pieces.append((inputs, out[..., :value_dim], state))
    most = max(len(layout.local_intervals(r)) for r in range(layout.world_size))  # ranks may hold fewer pieces
    # The all-gather's backward is a collective every rank must join, so on every rank the output depends on every
    # gathered state (``anchor``, a zero) and the gathered states on the inputs (the padding, a zero multiple of
    # their sum): the first piece's incoming state is a constant, and a rank may hold no position at all.
    padding = torch.zeros_like(start_state) + sum(x.sum() for x in (q, k, v, g, beta)) * 0
    states = [state for _, _, state in pieces] + [padding] * (most - len(pieces))
    every = all_gather(torch.stack(states), 0, group=group)
    anchor = every.sum() * 0
    starts = [(lo, r, i) for r in range(layout.world_size) for i, (lo, _) in enumerate(layout.local_intervals(r))]
    incoming, fold = {}, q.new_zeros(state_shape, dtype=dtype)
    for _, r, i in sorted(starts):
        incoming[r, i] = fold
        piece = every[r * most + i]
        fold = piece[..., value_dim:] @ fold + piece[..., :value_dim]
    outs = []
    for i, (inputs, out, _) in enumerate(pieces):
        correction, _ = torch.ops.autoshard.gated_delta_rule(*inputs[:2], torch.zeros_like(inputs[2]), *inputs[3:],
                                                             incoming[rank, i], implementation, chunk_size,
                                                             use_qk_l2norm)
        outs.append(out + correction + anchor)
    if not outs:  # a rank holding no position (a sequence shorter than the world)
        return torch.zeros_like(v) + anchor, fold
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)), fold


def state_passing_bytes(batch: int, heads: int, key_dim: int, value_dim: int, pieces: int, itemsize: int) -> int:
    """Bytes one rank contributes to the all-gather of :func:`split_gated_delta_rule`: its pieces' ``[E | M]``
    states of ``itemsize`` bytes an element."""
    return pieces * batch * heads * key_dim * (value_dim + key_dim) * itemsize
