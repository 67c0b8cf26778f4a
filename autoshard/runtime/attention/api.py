"""The distributed attention op (``torch.ops.autoshard.attention``) and the public :func:`attention`.

The op is what the compiler emits; it is opaque to tracing (a ``torch.library`` custom op with a fake
implementation), and its registered backward is itself a custom op, ``autoshard::attention_backward``.
Both dispatch by ``strategy`` name to the algorithms registered in :mod:`.base`, so every algorithm
shares the wiring and the checks::

    torch.ops.autoshard.attention(q, k, v, key_mask, segment_ids, alibi_slopes, position_bias, sinks, dropout_seed,
                                  strategy, layout, group, ring_group, causal, window_left, window_right, chunk, scale,
                                  softcap, dropout_p, kernels) -> (out, lse)

Its schema, its implementations and its callers take the arguments after the tensors from :class:`OpConfig`.

``chunk`` (0: none) is chunked local attention, query ``i`` sees key ``j`` only if ``i // chunk == j //
chunk`` (Llama-4's local layers; see :class:`.masks.MaskSpec`).

``softcap`` (0: none) caps the scaled scores, ``softcap * tanh(s / softcap)``, before the mask (Gemma2).

``alibi_slopes`` (None: none) is ALiBi (Bloom, MPT): a ``[H]`` float32 tensor, the same on every rank; every score
gets ``slope[h] * (k_pos - q_pos)`` of its global positions, after the cap and before the mask. The slopes get
no gradient.

``position_bias`` (None: none) is a relative-position bias ``[H, 2R + 1]`` (T5's learned buckets, tabulated per
distance), the same on every rank: every score gets ``position_bias[h, k_pos - q_pos + R]``. Its gradient is this
rank's share (the gradients of its queries' scores), so its callers sum it over the ranks.

``sinks`` (None: none) are attention sinks (gpt-oss): a ``[H]`` tensor, the same on every rank, one learned logit
per query head that joins every row's softmax denominator as a key whose value is zero. They are applied once,
after the strategy, to the whole rows it returns: ``lse' = logaddexp(lse, sinks[h])``, ``out' = out * exp(lse -
lse')`` -- so every strategy, layout, mask and kernel serves them unchanged. The backward needs nothing else: a
zero-value key adds nothing to ``dP``, so the strategies' backward on ``(out', lse')`` is exact, and the sinks'
gradient is ``-sum_rows exp(sinks[h] - lse') * rowsum(dout * out')`` -- this rank's share (its queries' rows), so
its callers sum it over the ranks, as the bias's.

``dropout_p`` (0: none) drops attention probabilities by a mask hashed from ``dropout_seed`` (a 0-d int64 tensor,
the same on every rank) and the elements' global indices, the same for every strategy and world size
(:mod:`.dropout`); the backward uses the same mask.

``out`` has ``q``'s dtype; ``lse`` is float32 (float64 for float64 inputs), natural log, and not
differentiable. The op checks its inputs with local information only (shapes the layout implies,
heads the group can split, a dtype the forced Triton kernels cannot compute in), so a consistent
mistake raises the same clear error on every rank.

Mixed precision: like a fused kernel, the op computes in the dtype of its inputs (autocast is off
inside it; blocks accumulate and merge in float32) and autocast does not cast them. Its callers do: the
compiler to the dtype the one-device attention computed in, :func:`attention` as SDPA under autocast.

:func:`attention` is the entry point for code that shards by hand. Beyond the op's local checks it
confirms once per call signature that all ranks agree (shapes, dtypes, strategy, masks) with one small
all-gather, counted under the accountant kind ``"metadata"``; an input error on any rank is then
raised on every rank instead of leaving the others waiting in a collective. Without ``seq_len`` (and
with a layout given by name) the global length is the sum of the shards, which that exchange
provides on every call: pass ``seq_len`` to skip it after the first call.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..collectives import gather_table
from ..groups import GroupLike, metadata_device, resolve_group
from ..redistribute import grad_sync
from ..layouts import LAYOUTS, SequenceLayout
from ..op_info import Arguments, declare
from .backend import KERNELS, check_triton_dtype
from .base import STRATEGIES, AttentionShape, Strategy
from .call import AttentionInputError, Call
from .head_chunks import chunked_backward, chunked_forward
from .local import compute_dtype, without_autocast
from .masks import MaskSpec

__all__ = ["attention", "OpConfig", "attention_op_shape"]

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------- validation (local)


def _check_tensors(q, k, v, key_mask, segment_ids) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise AttentionInputError(f"autoshard.attention: {name} must be a 4-D tensor [B, heads, S_local, D], got "
                                      f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise AttentionInputError(f"autoshard.attention: q, k, v must share one floating dtype of {_DTYPES}, got "
                                  f"{q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise AttentionInputError(f"autoshard.attention: q, k, v must be on one device, got {q.device}, {k.device}, "
                                  f"{v.device}")
    B, H, S, D = q.shape
    if k.shape[:3] != v.shape[:3] or k.size(0) != B or k.size(2) != S or k.size(3) != D or not v.size(3):
        raise AttentionInputError(
            f"autoshard.attention: k must be [B, Hkv, S_local, D] and v [B, Hkv, S_local, Dv] matching q [B, H, "
            f"S_local, D] = {list(q.shape)} in B, S_local and D (v's head dim Dv may differ), got k {list(k.shape)}, "
            f"v {list(v.shape)}")
    if H % k.size(1):
        raise AttentionInputError(f"autoshard.attention: the {H} query heads must be a multiple of the {k.size(1)} "
                                  f"kv heads (GQA/MQA: H divisible by Hkv)")
    _check_token_mask("key_mask", key_mask, q, "bool", lambda dtype: dtype == torch.bool)
    _check_token_mask("segment_ids", segment_ids, q, "integer",
                      lambda dtype: not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool))


def _check_token_mask(name: str, mask, q: torch.Tensor, kind: str, dtype_ok) -> None:
    """A per-token mask must be this rank's [B, S_local] shard of the right kind, on q's device."""
    if mask is None:
        return
    B, S = q.size(0), q.size(2)
    if (not isinstance(mask, torch.Tensor) or mask.shape != (B, S) or not dtype_ok(mask.dtype)
            or mask.device != q.device):
        got = f"{list(mask.shape)} {mask.dtype} on {mask.device}" if isinstance(mask, torch.Tensor) else type(mask)
        raise AttentionInputError(f"autoshard.attention: {name} must be this rank's shard, a [B, S_local] = "
                                  f"[{B}, {S}] {kind} tensor on {q.device}, got {got}")


def _check_slopes(alibi_slopes, q: torch.Tensor) -> None:
    """ALiBi slopes must be one float32 per query head, on q's device."""
    if alibi_slopes is None:
        return
    if (not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.shape != (q.size(1),)
            or alibi_slopes.dtype != torch.float32 or alibi_slopes.device != q.device):
        got = (f"{list(alibi_slopes.shape)} {alibi_slopes.dtype} on {alibi_slopes.device}"
               if isinstance(alibi_slopes, torch.Tensor) else type(alibi_slopes).__name__)
        raise AttentionInputError(f"autoshard.attention: alibi_slopes must be a [H] = [{q.size(1)}] float32 tensor on "
                                  f"{q.device} (one slope per query head), got {got}")


def _check_position_bias(position_bias, q: torch.Tensor, length: int) -> None:
    """A relative-position bias must be ``[H, 2R + 1]``, floating, on q's device, reaching every distance."""
    if position_bias is None:
        return
    if (not isinstance(position_bias, torch.Tensor) or position_bias.dim() != 2 or position_bias.size(0) != q.size(1)
            or position_bias.size(1) % 2 == 0 or position_bias.size(1) < 2 * length - 1
            or not position_bias.is_floating_point() or position_bias.device != q.device):
        got = (f"{list(position_bias.shape)} {position_bias.dtype} on {position_bias.device}"
               if isinstance(position_bias, torch.Tensor) else type(position_bias).__name__)
        raise AttentionInputError(f"autoshard.attention: position_bias must be a floating [H, 2R + 1] tensor on "
                                  f"{q.device} with H = {q.size(1)} and R >= {length - 1} (the farthest distance), "
                                  f"got {got}")


def _validate(q, k, v, key_mask, segment_ids, call: Call) -> Strategy:
    """Every check that needs only this rank's information; returns the strategy."""
    if call.strategy not in STRATEGIES:
        raise AttentionInputError(f"autoshard.attention: unknown strategy {call.strategy!r}; expected one of "
                                  f"{tuple(STRATEGIES)}")
    _check_tensors(q, k, v, key_mask, segment_ids)
    _check_slopes(call.alibi_slopes, q)
    _check_position_bias(call.position_bias, q, call.layout.length)
    check_triton_dtype(call.kernels, q)
    if not (isinstance(call.head_chunks, int) and call.head_chunks >= 1):
        raise AttentionInputError(f"autoshard.attention: head_chunks must be a positive int (1: all heads at once), "
                                  f"got {call.head_chunks!r}")
    if not (call.softcap >= 0.0 and math.isfinite(call.softcap)):
        raise AttentionInputError(f"autoshard.attention: softcap must be a finite number >= 0 (0: no capping), got "
                                  f"{call.softcap}")
    if call.dropout_p and not (0.0 < call.dropout_p < 1.0 and isinstance(call.dropout_seed, torch.Tensor)
                               and call.dropout_seed.shape == () and call.dropout_seed.dtype == torch.int64):
        raise AttentionInputError(f"autoshard.attention: dropout needs 0 < dropout_p < 1 and a 0-d int64 dropout_seed, "
                                  f"got dropout_p={call.dropout_p}, dropout_seed={call.dropout_seed!r}")
    strategy = STRATEGIES[call.strategy]
    seq_rank = strategy.check(q, k, v, call)
    expected = call.layout.local_length(seq_rank)
    if q.size(2) != expected:
        raise AttentionInputError(
            f"autoshard.attention: sequence rank {seq_rank} holds {q.size(2)} positions, but the {call.layout.kind} "
            f"layout of {call.layout.length} positions on {call.layout.world_size} ranks gives it {expected}; pass "
            f"this rank's shard (shard_sequence(x, dim=2, layout=...)) and the global length (seq_len=)")
    return strategy


# ---------------------------------------------------------------------------- the custom ops


def _like_q(q: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A meta tensor shaped like ``q`` with the last dim ``head_dim``, its dims in ``q``'s memory order: the layout
    of the output (head dim ``Dv``) and of ``dq`` (``D``)."""
    order = sorted(range(q.dim()), key=lambda d: q.stride(d), reverse=True)
    return torch.empty_permuted((*q.shape[:-1], head_dim), order, dtype=q.dtype, device="meta")


def _laid_out(*items: tuple[torch.Tensor, torch.Tensor | None, torch.dtype]) -> tuple[torch.Tensor, ...]:
    """Each ``(tensor, like, dtype)``: the tensor in ``dtype``, with the strides of ``torch.empty_like(like)``
    (contiguous for ``like=None``; ``like`` may be a meta tensor) and its own storage, cast and laid out by at most
    one copy. The fake implementations promise exactly these strides, which
    AOTAutograd and Inductor plan the following views with; laid out like ``q`` (heads a strided view of the
    projection, as in most models), the output's ``transpose(1, 2).reshape`` back to the hidden size is a view,
    not a copy. Own storage: a custom op's outputs may not alias, and strategies may return the halves of
    one stacked buffer."""
    seen, out = set(), []
    for t, like, dtype in items:
        ref = torch.empty_like(like, device="meta") if like is not None else t.new_empty(t.shape, device="meta")
        strides = ref.stride()  # what empty_like gives, without allocating it
        if t.dtype != dtype or t.stride() != strides or t.untyped_storage().data_ptr() in seen:
            t = torch.empty_strided(t.shape, strides, dtype=dtype, device=t.device).copy_(t)
        seen.add(t.untyped_storage().data_ptr())
        out.append(t)
    return tuple(out)


@dataclass(frozen=True)
class OpConfig:
    """The op's arguments after its tensors, in their order: the op schemas, the implementations and every
    caller (:func:`attention`, the compiler's rewrite) take them from here."""

    strategy: str
    layout: list[int]
    """:meth:`SequenceLayout.encode`."""
    group: str
    ring_group: str
    causal: bool
    window_left: int
    window_right: int
    chunk: int
    scale: float
    softcap: float
    dropout_p: float
    kernels: str
    head_chunks: int = 1

    def args(self) -> tuple:
        """The arguments, in the op's order."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @property
    def mask(self) -> MaskSpec:
        """The position mask its ``causal``, ``window_left``, ``window_right`` and ``chunk`` arguments are (the op
        schema keeps them as scalars)."""
        return MaskSpec(self.causal, (self.window_left, self.window_right), self.chunk)

    def call(self, alibi_slopes, position_bias, dropout_seed, position_bias_grad=None) -> Call:
        """The :class:`Call` these arguments and the op's score-term tensors describe."""
        return Call(strategy=self.strategy, layout=SequenceLayout.decode(self.layout), group=self.group,
                    ring_group=self.ring_group, spec=self.mask,
                    scale=self.scale, softcap=self.softcap, alibi_slopes=alibi_slopes, dropout_p=self.dropout_p,
                    dropout_seed=dropout_seed, position_bias=position_bias, position_bias_grad=position_bias_grad,
                    kernels=self.kernels, head_chunks=self.head_chunks)


_SCHEMA_TYPES = {"str": "str", "list[int]": "SymInt[]", "bool": "bool", "int": "SymInt", "float": "float"}
_MASKS = ("key_mask", "segment_ids")
_TERMS = ("alibi_slopes", "position_bias", "sinks", "dropout_seed")
"""The op's optional tensors after the masks."""


def _schema(tensors: tuple[str, ...], returns: int) -> str:
    """An op schema: the required ``tensors``, the optional masks and score terms, :class:`OpConfig`, and ``returns``
    tensors."""
    args = ([f"Tensor {name}" for name in tensors] + [f"Tensor? {name}" for name in _MASKS + _TERMS]
            + [f"{_SCHEMA_TYPES[f.type]} {f.name}" for f in dataclasses.fields(OpConfig)])
    return f"({', '.join(args)}) -> ({', '.join(['Tensor'] * returns)})"


@torch.library.custom_op("autoshard::attention", mutates_args=(), schema=_schema(("q", "k", "v"), 2))
def _attention_op(q, k, v, key_mask, segment_ids, alibi_slopes, position_bias, sinks, dropout_seed, *config):
    call = OpConfig(*config).call(alibi_slopes, position_bias, dropout_seed)
    _check_sinks(sinks, q)
    with without_autocast(q):
        out, lse = chunked_forward(_validate(q, k, v, key_mask, segment_ids, call), q, k, v, key_mask, segment_ids,
                                   call)
        if sinks is not None:
            out, lse = _with_sinks(out, lse, sinks)
    return _laid_out((out, _like_q(q, v.size(-1)), q.dtype), (lse, None, compute_dtype(q.dtype)))


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of rows whose softmax also counts one zero-value key of logit ``sinks[h]``."""
    with_sink = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    return (out * torch.exp(lse - with_sink).unsqueeze(-1).to(out.dtype)), with_sink


def _sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """This rank's share of the sinks' gradient: ``-sum_rows P(sink) * rowsum(dout * out)``, ``P(sink) = exp(sinks[h]
    - lse)`` (``out``, ``lse`` the op's, sinks included)."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return -(torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse) * delta).sum((0, 2)).to(sinks.dtype)


def _check_sinks(sinks, q: torch.Tensor) -> None:
    """Sinks must be one floating logit per query head, on q's device."""
    if sinks is None:
        return
    if (not isinstance(sinks, torch.Tensor) or sinks.shape != (q.size(1),) or not sinks.is_floating_point()
            or sinks.device != q.device):
        got = (f"{list(sinks.shape)} {sinks.dtype} on {sinks.device}" if isinstance(sinks, torch.Tensor)
               else type(sinks).__name__)
        raise AttentionInputError(f"autoshard.attention: sinks must be a floating [H] = [{q.size(1)}] tensor on "
                                  f"{q.device} (one logit per query head), got {got}")


@_attention_op.register_fake
def _(q, k, v, key_mask, segment_ids, alibi_slopes, position_bias, sinks, dropout_seed, *config):
    return (torch.empty_like(_like_q(q, v.size(-1)), device=q.device),
            q.new_empty(q.shape[:-1], dtype=compute_dtype(q.dtype)))


@torch.library.custom_op("autoshard::attention_backward", mutates_args=(),
                         schema=_schema(("dout", "q", "k", "v", "out", "lse"), 4))
def _attention_backward_op(dout, q, k, v, out, lse, key_mask, segment_ids, alibi_slopes, position_bias, sinks,
                           dropout_seed, *config):
    """``(dq, dk, dv, d_position_bias)``; the last is this rank's share of the bias's gradient (its queries' scores),
    empty without a bias. With ``sinks``, ``out`` and ``lse`` are the op's (sinks included): the strategies'
    backward is exact on them (the sinks' own gradient is :func:`_sinks_grad`)."""
    bias_grad = _bias_grad_like(position_bias, q)
    call = OpConfig(*config).call(alibi_slopes, position_bias, dropout_seed,
                                  bias_grad if position_bias is not None else None)
    with without_autocast(q):
        dq, dk, dv = chunked_backward(STRATEGIES[call.strategy], dout, q, k, v, out, lse, key_mask, segment_ids, call)
    like = position_bias if position_bias is not None else bias_grad
    return _laid_out((dq, q, q.dtype), (dk, k, k.dtype), (dv, v, v.dtype), (bias_grad, like, like.dtype))


def _bias_grad_like(position_bias: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The accumulator of the bias's gradient (compute dtype), or an empty tensor without a bias."""
    if position_bias is None:
        return q.new_zeros(0, dtype=compute_dtype(q.dtype))
    return torch.zeros_like(position_bias, dtype=compute_dtype(q.dtype))


@_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, key_mask, segment_ids, alibi_slopes, position_bias, sinks, dropout_seed, *config):
    like = position_bias if position_bias is not None else q.new_empty(0, dtype=compute_dtype(q.dtype))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(like)


def _setup(ctx, inputs, output):
    q, k, v, key_mask, segment_ids, *rest = inputs
    terms, config = rest[:len(_TERMS)], rest[len(_TERMS):]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_mask, segment_ids, *terms)
    ctx.config = config
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, key_mask, segment_ids, alibi_slopes, position_bias, sinks, dropout_seed = ctx.saved_tensors
    dq, dk, dv, d_bias = torch.ops.autoshard.attention_backward(dout, q, k, v, out, lse, key_mask, segment_ids,
                                                                alibi_slopes, position_bias, sinks, dropout_seed,
                                                                *ctx.config)
    d_sinks = _sinks_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[7] else None
    return ((dq, dk, dv, None, None, None, d_bias if position_bias is not None else None, d_sinks, None)
            + (None,) * len(ctx.config))


_attention_op.register_autograd(_backward, setup_context=_setup)


def attention_op_shape(a: Arguments) -> tuple[AttentionShape, OpConfig, bool]:
    """The shape (global length, this rank's heads), the configuration and the direction (True: the backward op,
    which takes the output's gradient ``dout``) of one attention op from its arguments by name."""
    q, k, v, segment_ids = a["q"], a["k"], a["v"], a["segment_ids"]
    config = OpConfig(**{f.name: a[f.name] for f in dataclasses.fields(OpConfig)})
    shape = AttentionShape(batch=q.shape[0], seq=SequenceLayout.decode(config.layout).length, heads=q.shape[1],
                           kv_heads=k.shape[1], head_dim=q.shape[3], dtype=q.dtype, mask=config.mask,
                           key_mask=a["key_mask"] is not None,
                           segment_ids_dtype=segment_ids.dtype if segment_ids is not None else None,
                           value_head_dim=v.shape[3] if v.shape[3] != q.shape[3] else 0)
    return shape, config, "dout" in a


def _working_set(a: Arguments) -> int:
    """Its strategy's working set (:attr:`.base.Strategy.working_set`: the gathered or head-split copies, the
    float32 accumulators), its head groups one at a time."""
    shape, config, backward = attention_op_shape(a)
    return STRATEGIES[config.strategy].working_set(shape, SequenceLayout.decode(config.layout).world_size,
                                                  config.head_chunks, backward)


declare(torch.ops.autoshard.attention.default, working_set=_working_set)
declare(torch.ops.autoshard.attention_backward.default, working_set=_working_set)


# ---------------------------------------------------------------------------- cross-rank agreement

_SIGNATURE = ("B", "H", "Hkv", "D", "Dv", "dtype", "device", "strategy", "layout", "seq_len", "causal", "window_left",
              "window_right", "chunk", "key_mask", "segment_ids", "scale", "softcap", "terms", "kernels")
_agreed: set = set()


def _code(x) -> int:
    """A process-independent int for a small value (str hashes are salted per process; int tuples are not)."""
    if isinstance(x, (bool, int)):
        return int(x)
    if isinstance(x, float):
        return struct.unpack("<q", struct.pack("<d", x))[0]
    if isinstance(x, SequenceLayout):
        return hash(tuple(x.encode()))
    return hash(tuple(str(x).encode()))


def _signature(q, k, v, key_mask, segment_ids, strategy, layout, seq_len, spec, scale, softcap, terms: int,
               kernels) -> tuple[int, ...]:
    shapes = (q.size(0), q.size(1), k.size(1), q.size(3), v.size(3)) if _is4d(q) and _is4d(k) and _is4d(v) else (
        0, 0, 0, 0, 0)
    return tuple(_code(x) for x in (
        *shapes, q.dtype if isinstance(q, torch.Tensor) else None,
        q.device.type if isinstance(q, torch.Tensor) else "", strategy, layout,
        -1 if seq_len is None else seq_len, spec.causal, *spec.window, spec.chunk, key_mask is not None,
        segment_ids.dtype if isinstance(segment_ids, torch.Tensor) else None, float(scale or 0.0),
        float(softcap), terms, kernels))


def _is4d(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 4


def _exchange(pgs: list[dist.ProcessGroup], row: list[int]) -> torch.Tensor:
    """Every rank's ``row`` as a [sequence ranks, len(row)] table (hybrid: gathered along both mesh axes)."""
    table = torch.tensor(row, dtype=torch.int64, device=metadata_device(pgs[0])).unsqueeze(0)
    for pg in pgs:  # the Ulysses / sequence axis first, then the ring axis
        table = gather_table(table, pg)
    return table


def _agree(table: torch.Tensor, error: AttentionInputError | None) -> None:
    """Raise on every rank when any rank failed its checks or the ranks' signatures differ."""
    ok = table[:, 0].tolist()
    if error is not None:
        raise error
    if not all(ok):
        bad = [r for r, flag in enumerate(ok) if not flag]
        raise AttentionInputError(
            f"autoshard.attention: sequence rank(s) {bad} rejected their inputs (their error names the constraint); "
            f"this rank's inputs were valid")
    signatures = table[:, 2:]
    for col, name in enumerate(_SIGNATURE):
        values = signatures[:, col].tolist()
        if len(set(values)) > 1:
            raise AttentionInputError(
                f"autoshard.attention: the ranks disagree on {name} (per sequence rank: {values}); every rank must "
                f"call attention with the same configuration and its own shard of the same tensors")


# ---------------------------------------------------------------------------- the public function


def _groups(group, strategy: str) -> list[dist.ProcessGroup]:
    mesh_groups = STRATEGIES[strategy].mesh_groups
    if mesh_groups is not None:
        return mesh_groups(group)
    if isinstance(group, DeviceMesh) and group.ndim != 1:
        raise AttentionInputError(
            f"autoshard.attention: a {group.ndim}-D DeviceMesh is for strategy 'hybrid'; for {strategy!r} pass the "
            f"1-D sub-mesh of the sequence axis (mesh['sp']) or a ProcessGroup")
    return [resolve_group(group)]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: GroupLike = None,
    strategy: str = "ring",
    layout: str | SequenceLayout = "contiguous",
    causal: bool = False,
    window: tuple[int, int] | None = None,
    chunk: int = 0,
    key_mask: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    kernels: str = "auto",
    seq_len: int | None = None,
    dropout_p: float = 0.0,
    head_chunks: int = 1,
) -> torch.Tensor:
    """Attention over a sequence sharded across ranks; returns this rank's shard of the output.

    ``q``, ``k``, ``v``: this rank's sequence shards ``[B, H|Hkv, S_local, D]`` (made by ``shard_sequence(x, 2,
    layout=layout)``); GQA/MQA when ``k``/``v`` have fewer heads. The result equals, on this rank's
    positions, ``F.scaled_dot_product_attention`` over the whole sequence with the equivalent dense mask
    (a row with no visible key gives 0, as SDPA does in current torch; older versions gave NaN).

    ``group``: a ProcessGroup, a 1-D DeviceMesh or None (the default group); for ``strategy="hybrid"`` a 2-D
    DeviceMesh (see :mod:`.hybrid`). ``strategy``: ``"ring"``, ``"zigzag"`` (needs ``layout="zigzag"``),
    ``"allgather"``, ``"ulysses"`` or ``"hybrid"``. ``layout``: ``"contiguous"``, ``"zigzag"`` or a
    :class:`SequenceLayout`. ``causal`` / ``window=(left, right)`` (-1 unbounded) / ``chunk`` (chunked local
    attention, ``i // chunk == j // chunk``; 0: none) / ``key_mask`` (``[B, S_local]``
    bool shard, True = attend) / ``segment_ids`` (``[B, S_local]`` int shard; attend within a segment):
    structured masks, never an S x S tensor. ``scale``: default ``1/sqrt(D)``. ``softcap``: when positive, the
    scaled scores ``s`` become ``softcap * tanh(s / softcap)`` before the mask (Gemma2's attention logit
    soft-capping; 0, the default, leaves them). ``alibi_slopes``: ALiBi's ``[H]`` float32 slopes, whole on every
    rank: every score gets ``slope[h] * (k_pos - q_pos)`` (global positions). ``position_bias``: a relative-position
    bias ``[H, 2R + 1]``, whole on every rank (``R`` at least the global length - 1): every score gets
    ``position_bias[h, k_pos - q_pos + R]``; its gradient is summed over the ranks (torch path only). ``sinks``:
    attention sinks (gpt-oss), ``[H]`` logits whole on every rank, each a zero-value key in every row of its head's
    softmax; their gradient is summed over the ranks. ``kernels``:
    ``"auto"``,
    ``"torch"`` or ``"triton"``. ``seq_len``: the global length (default: the sum of the shards, found by
    a small exchange on every call). ``head_chunks``: run the heads in that many groups, one at a time
    (:mod:`.head_chunks`). ``dropout_p`` must be 0. Under ``torch.autocast`` ``q``, ``k``, ``v`` are
    cast as SDPA casts them: to the autocast dtype, float64 excepted.
    """
    q, k, v = (_autocast_input(t) for t in (q, k, v))
    if dropout_p:
        raise AttentionInputError(
            f"autoshard.attention: dropout is not part of distributed attention (dropout_p={dropout_p}); pass "
            f"dropout_p=0.0 (attention dropout is usually disabled for long-context training)")
    if strategy not in STRATEGIES:  # checked here too: it decides which groups to resolve
        raise AttentionInputError(f"autoshard.attention: unknown strategy {strategy!r}; expected one of "
                                  f"{tuple(STRATEGIES)}")
    if kernels not in KERNELS:
        raise AttentionInputError(f"autoshard.attention: kernels must be one of {KERNELS}, got {kernels!r}")
    if not isinstance(layout, SequenceLayout) and layout not in LAYOUTS:
        raise AttentionInputError(f"autoshard.attention: unknown layout {layout!r}; expected one of {LAYOUTS} or a "
                                  f"SequenceLayout")
    if isinstance(layout, SequenceLayout):
        if seq_len not in (None, layout.length):
            raise AttentionInputError(f"autoshard.attention: seq_len={seq_len} but {layout!r} has length "
                                      f"{layout.length}")
        seq_len = layout.length
    spec = MaskSpec.of(causal, window, chunk)
    pgs = _groups(group, strategy)
    world = math.prod(pg.size() for pg in pgs)
    names = [pg.group_name for pg in pgs] + [""]
    for pg in pgs:  # every rank's queries add to the bias's and the sinks' gradients: the sum is whole
        if isinstance(position_bias, torch.Tensor):
            position_bias = grad_sync(position_bias, pg.group_name)
        if isinstance(sinks, torch.Tensor):
            sinks = grad_sync(sinks, pg.group_name)

    def make_call(length: int) -> Call:
        lay = layout if isinstance(layout, SequenceLayout) else SequenceLayout.of(layout, length, world)
        return Call(strategy=strategy, layout=lay, group=names[0], ring_group=names[1], spec=spec,
                    scale=float(scale), softcap=float(softcap), alibi_slopes=alibi_slopes, position_bias=position_bias,
                    kernels=kernels, head_chunks=int(head_chunks))

    error, call = None, None
    try:
        _check_tensors(q, k, v, key_mask, segment_ids)
        _check_slopes(alibi_slopes, q)
        _check_sinks(sinks, q)
        scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale)
        if seq_len is not None:
            call = make_call(seq_len)
            _validate(q, k, v, key_mask, segment_ids, call)
    except ValueError as e:  # AttentionInputError, or a layout the world size cannot serve
        error = e
    signature = _signature(q, k, v, key_mask, segment_ids, strategy, layout, seq_len, spec, scale, softcap,
                           (alibi_slopes is not None) + 2 * (position_bias is not None) + 4 * (sinks is not None),
                           kernels)
    key = (tuple(names), signature, q.size(2) if _is4d(q) else -1)
    if error is None and call is not None and key in _agreed:
        return _run(q, k, v, key_mask, segment_ids, sinks, call)
    table = _exchange(pgs, [int(error is None), q.size(2) if _is4d(q) else -1, *signature])
    _agree(table, error)
    if call is None:  # the global length is the sum of the shards
        call = make_call(int(table[:, 1].sum()))
        expected = list(call.layout.local_lengths)
        if table[:, 1].tolist() != expected:
            raise AttentionInputError(
                f"autoshard.attention: the shards hold {table[:, 1].tolist()} positions per sequence rank, but the "
                f"{call.layout.kind} layout of their {call.layout.length} positions gives {expected}; shard with "
                f"shard_sequence(x, dim=2, layout={call.layout.kind!r})")
        _validate(q, k, v, key_mask, segment_ids, call)
    else:
        if len(_agreed) > 4096:
            _agreed.clear()
        _agreed.add(key)
    return _run(q, k, v, key_mask, segment_ids, sinks, call)


def _autocast_input(t):
    """``t`` as an op of autocast's lower-precision list (SDPA's) receives it: a floating tensor other than float64,
    on a device type where autocast is on, in the autocast dtype; anything else as it is."""
    if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
            and torch.amp.is_autocast_available(t.device.type) and torch.is_autocast_enabled(t.device.type)):
        return t.to(torch.get_autocast_dtype(t.device.type))
    return t


def _run(q, k, v, key_mask, segment_ids, sinks, call: Call) -> torch.Tensor:
    config = OpConfig(call.strategy, call.layout.encode(), call.group, call.ring_group, call.spec.causal,
                      *call.spec.window, call.spec.chunk, call.scale, call.softcap, 0.0, call.kernels,
                      call.head_chunks)
    out, _ = torch.ops.autoshard.attention(q, k, v, key_mask, segment_ids, call.alibi_slopes, call.position_bias,
                                           sinks, None, *config.args())
    return out
