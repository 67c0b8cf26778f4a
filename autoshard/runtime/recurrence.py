"""Linear recurrences split along the sequence by state passing: the gated delta rule (``autoshard::gated_delta_rule``),
Mamba2's chunked scan (``autoshard::ssd_chunk_scan``) and Mamba (1)'s selective scan (``autoshard::selective_scan``).

Linear-attention and state-space layers carry a state along the sequence instead of attending to keys: Gated
DeltaNet (Qwen3-Next, Qwen3.5, OLMo-Hybrid) a ``[B, H, Dk, Dv]`` state that decays, is corrected towards each
position's value (the delta rule) and is read by its query; Mamba2 (Falcon-H1, Bamba) a ``[B, H, P, N]`` state that
decays by ``exp(dt A)`` and takes ``dt B x`` at each position, read by ``C``; Mamba (1) (Mamba, Falcon-Mamba, Jamba,
Zamba) a ``[B, D, N]`` state that does the same with ``A`` per channel and state entry. The model's own function
computes it (transformers' torch form, or a kernel); :mod:`autoshard.recognized` makes dynamo record that call as one
op (its implementation named by a string, looked up in :data:`IMPLEMENTATIONS`), so the compiler sees one node with
the sequence on dim 1 of its inputs instead of a loop unrolled into the graph.

**State passing** (:func:`split_recurrence`, what the rule of :mod:`autoshard.passes.rules.recurrence` emits). Each
recurrence is linear in its values and initial state together. Run over one piece of the sequence from an initial
state ``X``, the output is ``out(X) = out(0) + out_{v=0}(X)`` and the final state ``F(X) = T(X) + E``, with
``E = F(0)`` and ``T`` linear: the delta rule's state evolves column by column (``T(X) = M X``, ``M`` ``Dk x Dk``
per head), SSD's row by row (``T(X) = X M``, ``M`` ``N x N``), the selective scan's entry by entry
(``T(X) = M * X``, ``M = exp(A sum dt)``). Each rank sums each of its pieces up as ``[E | M]`` (:class:`Recurrence`):
where the function takes an initial state, by one run with the values widened by zero channels and the initial state
widened by the identity (:class:`WidenedRecurrence`: the first channels give ``out(0)`` and ``E``, the last ``M``);
the selective scan's functions take none, so its ``M`` and correction are written out (:class:`SelectiveScan`). One
all-gather of every piece's ``[E | M]`` (a few states per rank, however long the sequence) lets every rank fold the
pieces before each of its own, in sequence order, into that piece's incoming state ``X``, and add the correction
``out_{v=0}(X)``. Every layout is served (a zigzag rank holds two pieces, each with its own incoming state); the work
per rank is about two local runs over ``S / P`` positions, against one run over ``S`` on one process. The final
state (a cache's) is the fold over every piece, the same on every rank; a given initial state (a cache's, when a
prompt is continued) is the first piece's incoming state.

The ops' backward recomputes the forward under autograd and differentiates it (the way activation checkpointing
does): the implementation is the model's own code, whose backward autograd already knows.
"""

from __future__ import annotations

import abc
import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .collectives import all_gather
from .layouts import SequenceLayout
from .op_info import declare

__all__ = ["IMPLEMENTATIONS", "RECURRENCES", "Recurrence", "SelectiveScan", "WidenedRecurrence", "pieces_per_rank",
           "register_implementation", "split_recurrence", "state_dtype", "state_passing_bytes"]

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


def _recomputing_autograd(op, run: Callable) -> None:
    """``op``'s autograd: save its tensor inputs, and in backward run ``run`` on its inputs under autograd and
    differentiate it (``run`` takes the op's arguments and returns its output, or a tuple of its outputs), under the
    autocast the forward ran under, as activation checkpointing does."""
    def setup(ctx, inputs, output):
        ctx.tensor_at = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_at))
        ctx.arguments = [None if isinstance(x, torch.Tensor) else x for x in inputs]
        ctx.autocast = [(device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                        if torch.is_autocast_enabled(device)]  # backward recomputes under the forward's autocast

    def backward(ctx, *grad_outputs):
        arguments = list(ctx.arguments)
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            arguments[i] = t.detach().requires_grad_(ctx.needs_input_grad[i])
        wanted = [i for i in ctx.tensor_at if arguments[i].requires_grad]
        with torch.enable_grad(), contextlib.ExitStack() as autocast:
            for device, dtype in ctx.autocast:
                autocast.enter_context(torch.autocast(device, dtype=dtype))
            outputs = run(*arguments)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            pairs = [(o, go) for o, go in zip(outputs, grad_outputs) if go is not None]
            grads = (torch.autograd.grad([o for o, _ in pairs], [arguments[i] for i in wanted],
                                         [go for _, go in pairs], allow_unused=True) if wanted else ())
        by_index = dict(zip(wanted, grads))
        return tuple(by_index.get(i) for i in range(len(arguments)))

    op.register_autograd(backward, setup_context=setup)


# ----------------------------------------------------------------------------- the gated delta rule


def _packed(**arguments) -> dict:
    """The packed-document arguments given (a kernel's: fla's ``cu_seqlens``, mamba-ssm's ``seq_idx``), for the
    implementation's call: the ones left out are not passed at all (a torch form may not take them)."""
    return {name: value for name, value in arguments.items() if value is not None}


def _run_gated_delta_rule(q, k, v, g, beta, initial_state, implementation: str, chunk_size: int,
                          use_qk_l2norm: bool, cu_seqlens=None):
    out, state = _implementation(implementation)(q, k, v, g=g, beta=beta, chunk_size=chunk_size,
                                                 initial_state=initial_state, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=use_qk_l2norm, **_packed(cu_seqlens=cu_seqlens))
    return out.contiguous(), state.to(state_dtype(q.dtype)).contiguous()


@torch.library.custom_op("autoshard::gated_delta_rule", mutates_args=())
def _gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: torch.Tensor | None, implementation: str, chunk_size: int,
                      use_qk_l2norm: bool, cu_seqlens: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_gated_delta_rule(q, k, v, g, beta, initial_state, implementation, chunk_size, use_qk_l2norm,
                                 cu_seqlens)


@_gated_delta_rule.register_fake
def _(q, k, v, g, beta, initial_state, implementation, chunk_size, use_qk_l2norm, cu_seqlens=None):
    batch, length, _, key_dim = k.shape
    heads, value_dim = v.shape[-2:]
    states = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1  # packed: one state per document
    return (q.new_empty((batch, length, heads, value_dim)),
            q.new_empty((states, heads, key_dim, value_dim), dtype=state_dtype(q.dtype)))


_recomputing_autograd(_gated_delta_rule, _run_gated_delta_rule)
declare(torch.ops.autoshard.gated_delta_rule.default)


# ----------------------------------------------------------------------------- Mamba2's chunked scan (SSD)


def _run_ssd_chunk_scan(x, dt, B, C, A, D, dt_bias, initial_state, implementation: str, chunk_size: int,
                        dt_softplus: bool, dt_min: float, dt_max: float, seq_idx=None, cu_seqlens=None):
    out, state = _implementation(implementation)(x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias,
                                                 initial_states=initial_state, dt_softplus=dt_softplus,
                                                 dt_limit=(dt_min, dt_max), return_final_states=True,
                                                 **_packed(seq_idx=seq_idx, cu_seqlens=cu_seqlens))
    return out.to(state_dtype(x.dtype)).contiguous(), state.to(state_dtype(x.dtype)).contiguous()


@torch.library.custom_op("autoshard::ssd_chunk_scan", mutates_args=())
def _ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, A: torch.Tensor,
                    D: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_state: torch.Tensor | None,
                    implementation: str, chunk_size: int, dt_softplus: bool, dt_min: float,
                    dt_max: float, seq_idx: torch.Tensor | None = None,
                    cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_ssd_chunk_scan(x, dt, B, C, A, D, dt_bias, initial_state, implementation, chunk_size, dt_softplus,
                               dt_min, dt_max, seq_idx, cu_seqlens)


@_ssd_chunk_scan.register_fake
def _(x, dt, B, C, A, D, dt_bias, initial_state, implementation, chunk_size, dt_softplus, dt_min, dt_max,
      seq_idx=None, cu_seqlens=None):
    batch, _, heads, head_dim = x.shape
    dtype = state_dtype(x.dtype)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((batch, heads, head_dim, B.shape[-1]), dtype=dtype)


_recomputing_autograd(_ssd_chunk_scan, _run_ssd_chunk_scan)
declare(torch.ops.autoshard.ssd_chunk_scan.default)


# ----------------------------------------------------------------------------- Mamba (1)'s selective scan


def _run_selective_scan(x, dt, B, C, z, A, D, delta_bias, implementation: str, delta_softplus: bool):
    channels_first = [t.transpose(1, 2) if t is not None else None for t in (x, dt, B, C, z)]
    x_, dt_, B_, C_, z_ = channels_first
    out, state = _implementation(implementation)(x_, dt_, A, B_, C_, D=D, z=z_, delta_bias=delta_bias,
                                                 delta_softplus=delta_softplus, return_last_state=True)
    return (out.transpose(1, 2).to(_selective_scan_dtype(x, D)).contiguous(),
            state.to(state_dtype(x.dtype)).contiguous())


def _selective_scan_dtype(x: torch.Tensor, D: torch.Tensor | None) -> torch.dtype:
    """The selective scan's output dtype: the input's, promoted with the skip weight ``D``'s (transformers passes it
    in float32)."""
    return torch.promote_types(x.dtype, D.dtype) if D is not None else x.dtype


@torch.library.custom_op("autoshard::selective_scan", mutates_args=())
def _selective_scan(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, z: torch.Tensor | None,
                    A: torch.Tensor, D: torch.Tensor | None, delta_bias: torch.Tensor | None, implementation: str,
                    delta_softplus: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _run_selective_scan(x, dt, B, C, z, A, D, delta_bias, implementation, delta_softplus)


@_selective_scan.register_fake
def _(x, dt, B, C, z, A, D, delta_bias, implementation, delta_softplus):
    batch, _, channels = x.shape
    return (x.new_empty(x.shape, dtype=_selective_scan_dtype(x, D)),
            x.new_empty((batch, channels, A.shape[-1]), dtype=state_dtype(x.dtype)))


_recomputing_autograd(_selective_scan, _run_selective_scan)
declare(torch.ops.autoshard.selective_scan.default)


def _run_selective_scan_correction(cumulative_dt, C, z, A, incoming):
    decay = torch.exp(A[None, None] * cumulative_dt[..., None])  # [B, S, D, N]: what the incoming state keeps
    out = torch.einsum("bsdn,bsn,bdn->bsd", decay, C.to(decay.dtype), incoming.to(decay.dtype))
    return out * torch.nn.functional.silu(z) if z is not None else out


@torch.library.custom_op("autoshard::selective_scan_correction", mutates_args=())
def _selective_scan_correction(cumulative_dt: torch.Tensor, C: torch.Tensor, z: torch.Tensor | None, A: torch.Tensor,
                               incoming: torch.Tensor) -> torch.Tensor:
    """What a piece of a selective scan adds to its output when it starts from ``incoming`` instead of zero:
    ``C_t . (exp(A cum dt_t) * incoming)``, gated by ``silu(z_t)`` (``cumulative_dt``: the piece's ``dt`` summed
    from its start, ``[B, S, D]``)."""
    return _run_selective_scan_correction(cumulative_dt, C, z, A, incoming)


@_selective_scan_correction.register_fake
def _(cumulative_dt, C, z, A, incoming):
    dtype = torch.promote_types(A.dtype, cumulative_dt.dtype)
    return cumulative_dt.new_empty(cumulative_dt.shape,
                                   dtype=torch.promote_types(dtype, z.dtype) if z is not None else dtype)


_recomputing_autograd(_selective_scan_correction, _run_selective_scan_correction)
declare(torch.ops.autoshard.selective_scan_correction.default)


# ----------------------------------------------------------------------------- state passing


class Recurrence(abc.ABC):
    """What state passing needs to know of a recurrence op: how one piece of the sequence runs from a zero state and
    sums itself up (its final state from zero ``E`` and its transition ``T``, stacked along one dim of the state),
    how the summaries fold in sequence order, and what a piece adds to its output from an incoming state."""

    op: Any
    """The op (``torch.ops.autoshard.<name>``): ``op(*sequence inputs, *other inputs, [initial state], *config)``."""
    values: int
    """Which sequence input holds the values: the output has their positions (and their layout)."""
    summary_dim: int
    """The state's dim along which a summary stacks ``[E | T]``."""

    @abc.abstractmethod
    def state_shape(self, sequence: list) -> tuple[int, ...]:
        """The final state's shape, from the sequence inputs."""

    @abc.abstractmethod
    def transition_size(self, sequence: list) -> int:
        """``T``'s size along :attr:`summary_dim`."""

    @abc.abstractmethod
    def output_dtype(self, sequence: list, others: list) -> torch.dtype:
        """The output's dtype."""

    def summary_shape(self, sequence: list) -> tuple[int, ...]:
        """The shape of one piece's summary ``[E | T]``."""
        shape = list(self.state_shape(sequence))
        shape[self.summary_dim] += self.transition_size(sequence)
        return tuple(shape)

    @abc.abstractmethod
    def from_zero(self, inputs: list, others: list, config: list) -> tuple[torch.Tensor, torch.Tensor]:
        """A piece run from a zero state: (its output, its summary)."""

    @abc.abstractmethod
    def fold(self, state: torch.Tensor, summary: torch.Tensor) -> torch.Tensor:
        """The state after a piece summed up by ``summary`` that starts from ``state``."""

    @abc.abstractmethod
    def correction(self, inputs: list, others: list, config: list, incoming: torch.Tensor) -> torch.Tensor:
        """What a piece adds to its output when it starts from ``incoming`` instead of zero."""


@dataclass(frozen=True, kw_only=True)
class WidenedRecurrence(Recurrence):
    """A recurrence that takes an initial state: linear in its values and initial state together, with a transition
    ``T`` that mixes the state along one dim (the delta rule's ``Dk``, SSD's ``N``). One run sums a piece up: the
    values widened by ``T``'s size in zero channels, the initial state widened by the identity. The correction is a
    second run from the incoming state with zero values."""

    op: Any
    values: int
    value_dim: int
    """The state's dim the values' last dim becomes: -1 (the delta rule's ``[Dk, Dv]``: the state's columns evolve
    alone, ``X <- T X``) or -2 (SSD's ``[P, N]``: its rows do, ``X <- X T``). Summaries stack along it."""
    other: Callable[[list], int]
    """The size of the state's other dim (``T``'s), from the sequence inputs."""
    dtype_of_output: Callable[[list], torch.dtype]
    """The output's dtype, from the sequence inputs."""

    @property
    def summary_dim(self) -> int:
        return self.value_dim

    def state_shape(self, sequence):
        batch, _, heads, value_size = sequence[self.values].shape
        other = self.other(sequence)
        return (batch, heads) + ((other, value_size) if self.value_dim == -1 else (value_size, other))

    def transition_size(self, sequence):
        return self.other(sequence)

    def output_dtype(self, sequence, others):
        return self.dtype_of_output(sequence)

    def _run(self, inputs, new_values, others, initial, config):
        inputs = inputs[:self.values] + [new_values] + inputs[self.values + 1:]
        return self.op(*inputs, *others, initial, *config)

    def from_zero(self, inputs, others, config):
        values, other = inputs[self.values], self.other(inputs)
        dtype, value_size = state_dtype(values.dtype), values.shape[-1]
        eye = torch.eye(other, dtype=dtype, device=values.device).expand(*self.state_shape(inputs)[:2], -1, -1)
        start = torch.cat([values.new_zeros(self.state_shape(inputs), dtype=dtype), eye], self.value_dim)
        out, summary = self._run(inputs, torch.cat([values, values.new_zeros(values.shape[:-1] + (other,))], -1),
                                 others, start, config)
        return out[..., :value_size], summary

    def fold(self, state, summary):
        value_size = state.shape[self.value_dim]
        transition = summary.narrow(self.value_dim, value_size, summary.shape[self.value_dim] - value_size)
        entering = summary.narrow(self.value_dim, 0, value_size)
        return (transition @ state if self.value_dim == -1 else state @ transition) + entering

    def correction(self, inputs, others, config, incoming):
        out, _ = self._run(inputs, torch.zeros_like(inputs[self.values]), others, incoming, config)
        return out


@dataclass(frozen=True, kw_only=True)
class SelectiveScan(Recurrence):
    """Mamba (1)'s selective scan: a ``[B, D, N]`` state that decays by ``exp(A dt)`` elementwise (``A`` per channel
    and state entry) and takes ``dt B x``, read by ``C``, gated by ``silu(z)``. Its functions take no initial state, so
    the transition and the correction are written out: over a piece the state decays by ``exp(A sum dt)``
    (diagonal), and the incoming state adds ``C_t . (exp(A cum dt_t) * X)`` at each position
    (``autoshard::selective_scan_correction``). Summaries stack ``[E | T]`` along ``N``."""

    op: Any = torch.ops.autoshard.selective_scan
    values: int = 0
    summary_dim: int = -1

    def state_shape(self, sequence):
        batch, _, channels = sequence[0].shape
        return batch, channels, sequence[2].shape[-1]

    def transition_size(self, sequence):
        return sequence[2].shape[-1]

    def output_dtype(self, sequence, others):
        return _selective_scan_dtype(sequence[0], others[1])

    @staticmethod
    def _cumulative_dt(inputs, others, config):
        dt, delta_bias = inputs[1], others[2]
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)
        if config[1]:  # delta_softplus
            dt = torch.nn.functional.softplus(dt)
        return dt.to(state_dtype(dt.dtype)).cumsum(1)

    def from_zero(self, inputs, others, config):
        out, final = self.op(*inputs, *others, *config)
        transition = torch.exp(others[0] * self._cumulative_dt(inputs, others, config)[:, -1, :, None])
        return out, torch.cat([final, transition.to(final.dtype)], -1)

    def fold(self, state, summary):
        size = state.shape[-1]
        return summary[..., size:] * state + summary[..., :size]

    def correction(self, inputs, others, config, incoming):
        return torch.ops.autoshard.selective_scan_correction(self._cumulative_dt(inputs, others, config), inputs[3],
                                                             inputs[4], others[0], incoming)


RECURRENCES: dict[str, Recurrence] = {
    "gated_delta_rule": WidenedRecurrence(op=torch.ops.autoshard.gated_delta_rule, values=2, value_dim=-1,
                                          other=lambda sequence: sequence[1].shape[-1],
                                          dtype_of_output=lambda sequence: sequence[0].dtype),
    "ssd_chunk_scan": WidenedRecurrence(op=torch.ops.autoshard.ssd_chunk_scan, values=0, value_dim=-2,
                                        other=lambda sequence: sequence[2].shape[-1],
                                        dtype_of_output=lambda sequence: state_dtype(sequence[0].dtype)),
    "selective_scan": SelectiveScan(),
}
"""The recurrence ops state passing serves, by name."""


def split_recurrence(kind: str, sequence: list[torch.Tensor | None], others: list[torch.Tensor | None],
                     initial_state: torch.Tensor | None, config: list, layout: list[int], rank: int,
                     group: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence ``kind`` (:data:`RECURRENCES`) of a sequence split by ``layout`` (encoded) along dim 1 of every
    ``sequence`` input (None: an input the call does without), on this ``rank``'s positions, by state passing over
    ``group`` (see the module docstring): this rank's output and the whole sequence's final state
    (:func:`state_dtype`, the same on every rank). ``others``: the op's inputs with no sequence (whole),
    ``initial_state`` the state the sequence starts from (whole; None: zero -- a cache's, when a prompt is continued:
    the first piece's incoming state), ``config`` its non-tensor arguments."""
    recurrence, layout = RECURRENCES[kind], SequenceLayout.decode(layout)
    values = sequence[recurrence.values]
    dtype, given = state_dtype(values.dtype), [x for x in sequence if x is not None]
    pieces, offset = [], 0
    for lo, hi in layout.local_intervals(rank):
        inputs = [x.narrow(1, offset, hi - lo) if x is not None else None for x in sequence]
        offset += hi - lo
        out, summary = recurrence.from_zero(inputs, others, config)
        pieces.append((inputs, out, summary))
    # The all-gather's backward is a collective every rank must join, and so is the sum of the whole inputs'
    # gradients, so on every rank the output depends on every gathered summary and every whole input (``anchor``, a
    # zero) and the gathered summaries on the inputs (the padding, a zero multiple of their sum): the first piece's
    # incoming state is a constant, and a rank may hold no position at all.
    most = pieces_per_rank(layout)  # ranks may hold fewer pieces
    padding = values.new_zeros(recurrence.summary_shape(sequence), dtype=dtype) + sum(x.sum() for x in given) * 0
    every = all_gather(torch.stack([summary for _, _, summary in pieces] + [padding] * (most - len(pieces))), 0,
                       group=group)
    whole = [x for x in others + [initial_state] if x is not None]
    anchor = (every.sum() + sum(x.sum() for x in whole)) * 0  # the whole inputs too
    starts = [(lo, r, i) for r in range(layout.world_size) for i, (lo, _) in enumerate(layout.local_intervals(r))]
    fold = (initial_state.to(dtype) if initial_state is not None
            else values.new_zeros(recurrence.state_shape(sequence), dtype=dtype))
    incoming = {}
    for _, r, i in sorted(starts):
        incoming[r, i] = fold
        fold = recurrence.fold(fold, every[r * most + i])
    outs = [out + recurrence.correction(inputs, others, config, incoming[rank, i]).to(out.dtype) + anchor
            for i, (inputs, out, _) in enumerate(pieces)]
    if not outs:  # a rank holding no position (a sequence shorter than the world)
        return torch.zeros_like(values, dtype=recurrence.output_dtype(sequence, others)) + anchor, fold
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)), fold


def pieces_per_rank(layout: SequenceLayout) -> int:
    """How many pieces of the sequence each rank contributes to the state all-gather: the most any rank holds (the
    others pad)."""
    return max(len(layout.local_intervals(r)) for r in range(layout.world_size))


def state_passing_bytes(summary_shape: tuple, pieces: int, itemsize: int) -> int:
    """Bytes one rank contributes to the all-gather of :func:`split_recurrence`: its ``pieces`` summaries of
    ``summary_shape`` (:meth:`Recurrence.summary_shape`), ``itemsize`` bytes an element."""
    return pieces * math.prod(summary_shape) * itemsize
