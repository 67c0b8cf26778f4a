"""Attention on whole or gathered keys, and the query rows that see no key.

The compiled graph runs these where the distributed attention op leaves something to do, and the capture pass
(:mod:`autoshard.passes.capture`) spells the one-device attention with them:

* :func:`soft_capped_attention`: scores ``softcap * tanh(s / softcap)`` (Gemma2) on whole tensors, the scores
  materialized (SDPA has no soft-cap);
* :func:`uniform_attention`: what softmax gives rows whose scores all round to an additive mask's ~finfo.min
  fill, with softmax's gradient at equal scores;
* :func:`fill_empty_rows`: the rows that see no key under an additive mask get what one device gives them.

Such rows can sit on some ranks only (left padding under a causal mask leaves the first rank's rows empty), so
every rank takes the same path whatever its own rows are: a ~finfo.min fill is always computed from all-reduced
sums; for a milder fill (or soft-capped scores) the ranks first all-reduce whether any row anywhere is empty (one
integer), and only then all gather the keys and values, together. That decision is a branch on a value, so it
runs inside the custom op ``autoshard::fill_gathered_empty_rows``, opaque to AOTAutograd and Inductor; its
backward recomputes the forward (the same collectives, in the same order on every rank) and differentiates it.
The traffic of :func:`fill_empty_rows` is declared by the attention rule (:mod:`autoshard.passes.rules.attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..collectives import all_gather, all_reduce
from ..op_info import declare
from .local import without_autocast

__all__ = ["uniform_attention", "soft_capped_attention", "attend_to_every_key", "fill_empty_rows",
           "gathers_for_empty_rows"]


def uniform_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, length: int,
                      total=lambda t: t) -> torch.Tensor:
    """Attention in which every score is equal -- what softmax gives rows whose scores all round to an
    additive mask's ~finfo.min fill. The value is the mean of ``v`` over all ``length`` keys; the gradient is
    softmax's at equal scores (the scores still depend on q and k for autograd), written with the
    first-order expansion ``p_j = (1 + e_j - mean(e)) / length`` of zero-valued ``e = s - s.detach()``, which
    has exactly that value and that gradient. ``total`` sums a per-rank partial over ranks (the keys are
    split), identity on one device."""
    group_size = q.size(-3) // k.size(-3)
    expand = lambda t: t.repeat_interleave(group_size, dim=-3)  # noqa: E731  kv heads -> query heads
    kv = expand(total(torch.einsum("bhsd,bhse->bhde", k, v.detach())))  # the scores' part: no gradient to v
    k_mean = expand(total(k.sum(-2, keepdim=True))) / length
    v_mean = expand(total(v.sum(-2, keepdim=True))) / length
    first = torch.einsum("bhsd,bhde->bhse", q, kv) * (scale / length)
    centre = (q * k_mean).sum(-1, keepdim=True) * scale
    return v_mean + (first - first.detach()) - (centre - centre.detach()) * v_mean


def soft_capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                          scale: float, softcap: float, dropout_p: float = 0.0,
                          empty_rows: str = "zero") -> torch.Tensor:
    """Attention whose scaled scores ``s`` become ``softcap * tanh(s / softcap)`` before the mask (Gemma2), on
    whole tensors with the scores materialized (SDPA has no soft-cap). ``mask``: bool (True = attend), an
    additive float mask, or None. A row a bool mask hides entirely gets what ``empty_rows`` says (see
    :class:`~autoshard.passes.masks.MaskData`): 0 (``"zero"``), uniform attention to every key with
    the gradient softmax has at equal scores (``"uniform"``, a ~finfo.min fill), or attention with the
    unmasked scores (``"scores"``, a milder fill)."""
    group_size = q.size(-3) // k.size(-3)
    k, v = (t.repeat_interleave(group_size, dim=-3) for t in (k, v))
    s = q @ k.transpose(-1, -2) * scale
    s = softcap * torch.tanh(s / softcap)
    empty = None
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask
    elif mask is not None:
        empty = ~mask.any(-1, keepdim=True)
        on_empty_rows = s - s.detach() if empty_rows == "uniform" else s if empty_rows == "scores" else 0.0
        s = torch.where(empty, on_empty_rows, s.masked_fill(~mask, float("-inf")))
    p = torch.softmax(s, -1, dtype=torch.promote_types(s.dtype, torch.float32)).to(q.dtype)
    if empty is not None and empty_rows == "zero":
        p = p.masked_fill(empty, 0.0)
    if dropout_p:
        p = F.dropout(p, dropout_p)
    return p @ v


def attend_to_every_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float,
                        sizes: list[int], group: str, uniform: bool) -> torch.Tensor:
    """Unmasked attention of this rank's queries to every key -- what softmax gives a row whose scores are all
    shifted by the same mild fill -- or, when ``uniform``, the uniform attention of a ~finfo.min fill with
    its gradient (for soft-capped scores, which :func:`uniform_attention` cannot serve). Keys and values
    are gathered in rank order (``sizes``: every rank's number of keys), which softmax does not mind;
    all_gather's backward sums every rank's share of their gradient."""
    keys, values = (all_gather(t, -2, group=group, sizes=sizes) for t in (k, v))
    if softcap:  # rows that see no key, given what the fill gives them
        no_key_visible = torch.zeros((), dtype=torch.bool, device=q.device).expand(*q.shape[:-1], keys.size(-2))
        return soft_capped_attention(q, keys, values, no_key_visible, scale=scale, softcap=softcap,
                                     empty_rows="uniform" if uniform else "scores")
    return F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=k.size(-3) != q.size(-3))


def _anywhere(flags: torch.Tensor, group: str) -> bool:
    """Whether any element of ``flags`` is set on any rank: the same answer on every rank."""
    return bool(all_reduce(flags.any().to(torch.int32).reshape(1), "max", group=group))


def gathers_for_empty_rows(mode: str, softcap: float) -> bool:
    """Whether :func:`fill_empty_rows` asks if any row is empty and gathers the keys only then (a mild fill, or
    soft-capped scores), rather than always computing :func:`uniform_attention` from all-reduced sums."""
    return mode == "scores" or bool(softcap)


def fill_empty_rows(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float, softcap: float, sizes: list[int], mode: str, group: str) -> torch.Tensor:
    """Query rows that see no key, as an additive mask makes them (``sizes``: every rank's number of keys):
    ``"uniform"`` (a ~finfo.min fill) attends uniformly to all keys (:func:`uniform_attention`); ``"scores"``
    (a milder fill) attends to all keys with the unmasked scores (:func:`attend_to_every_key`), gathering
    them only when some rank has such a row. With soft-capped scores (``softcap``) the uniform rows'
    gradient goes through each key's cap, so they too are computed on gathered keys, only when some rank
    has such a row (through ``autoshard::fill_gathered_empty_rows``)."""
    if gathers_for_empty_rows(mode, softcap):
        return torch.ops.autoshard.fill_gathered_empty_rows(out, lse, q, k, v, scale, softcap, sizes, mode, group)
    empty = torch.isneginf(lse).unsqueeze(-1)
    # the sums feed this rank's rows: their gradients are per-rank shares, summed by all_reduce's backward
    uniform = uniform_attention(q, k, v, scale, sum(sizes), lambda t: all_reduce(t, "sum", group=group))
    return torch.where(empty, uniform.to(out.dtype), out)


def _fill_gathered(out, lse, q, k, v, scale, softcap, sizes, mode, group) -> torch.Tensor:
    """The gathering branch of :func:`fill_empty_rows`, as plain autograd code."""
    empty = torch.isneginf(lse).unsqueeze(-1)
    if not _anywhere(empty, group):
        return out
    every_key = attend_to_every_key(q, k, v, scale, softcap, sizes, group, uniform=mode == "uniform")
    return torch.where(empty, every_key.to(out.dtype), out)


def _own_storage(result: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``result``, copied when it shares storage with an input (a custom op's outputs may not alias)."""
    ptr = result.untyped_storage().data_ptr()
    return result.clone() if any(t.untyped_storage().data_ptr() == ptr for t in inputs) else result


@torch.library.custom_op("autoshard::fill_gathered_empty_rows", mutates_args=())
def _fill_gathered_op(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float, softcap: float, sizes: list[int], mode: str, group: str) -> torch.Tensor:
    with without_autocast(q):
        result = _fill_gathered(out, lse, q, k, v, scale, softcap, sizes, mode, group).contiguous()
    return _own_storage(result, out, lse, q, k, v)


@_fill_gathered_op.register_fake
def _(out, lse, q, k, v, scale, softcap, sizes, mode, group):
    return out.new_empty(out.shape)


def _autograd_inside_op():
    """Autograd on again inside a custom op's kernel, which the dispatcher runs below autograd (the autograd
    keys excluded, grad mode off), so the recomputed forward records a graph to differentiate."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradOther, keys.AutogradNestedTensor, keys.AutogradFunctionality):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


@torch.library.custom_op("autoshard::fill_gathered_empty_rows_backward", mutates_args=())
def _fill_gathered_backward_op(grad: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor,
                               k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float, sizes: list[int],
                               mode: str, group: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for ``out``, ``q``, ``k``, ``v``: the forward recomputed with autograd and differentiated
    (every rank takes the same branch, so the collectives and their backwards match)."""
    with torch.enable_grad(), _autograd_inside_op(), without_autocast(q):
        inputs = [t.detach().requires_grad_() for t in (out, q, k, v)]
        result = _fill_gathered(inputs[0], lse, *inputs[1:], scale, softcap, sizes, mode, group)
        grads = torch.autograd.grad(result, inputs, grad, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else _own_storage(g.contiguous(), grad, out, lse, q, k, v)
                 for g, t in zip(grads, inputs))


@_fill_gathered_backward_op.register_fake
def _(grad, out, lse, q, k, v, scale, softcap, sizes, mode, group):
    return tuple(t.new_empty(t.shape) for t in (out, q, k, v))


declare(torch.ops.autoshard.fill_gathered_empty_rows_backward.default)


def _fill_gathered_setup(ctx, inputs, output):
    out, lse, q, k, v, *ctx.options = inputs
    ctx.save_for_backward(out, lse, q, k, v)


def _fill_gathered_backward(ctx, grad):
    d_out, dq, dk, dv = torch.ops.autoshard.fill_gathered_empty_rows_backward(grad, *ctx.saved_tensors, *ctx.options)
    return (d_out, None, dq, dk, dv) + (None,) * len(ctx.options)


_fill_gathered_op.register_autograd(_fill_gathered_backward, setup_context=_fill_gathered_setup)
declare(torch.ops.autoshard.fill_gathered_empty_rows.default)
