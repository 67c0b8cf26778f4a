"""The LM head and its cross-entropy, chunked over tokens (``torch.ops.autoshard.linear_cross_entropy``).

``cross_entropy(linear(h, W, b).float(), target)`` materializes the logits ``[N, V]``, the log-softmax
autograd saves for backward (the same size, float32) and their gradient: at long context the largest
values of a step. The op computes the same loss a chunk of tokens at a time; no ``[N, V]`` value exists
at any time, the working set is a few ``[N / chunks, V]`` values::

    torch.ops.autoshard.linear_cross_entropy(h, weight, bias, target, class_weight, ignore_index, label_smoothing,
                                             reduction, chunks, out_dtype, grads) -> (loss, lse, dh, dW, db)

When the loss is reduced (``"sum"``, ``"mean"``) and autograd will want its gradients (``grads``, decided by
:func:`linear_cross_entropy` from grad mode and ``requires_grad``), each chunk's logits are turned into that
chunk's ``dh`` rows and its share of ``dW`` (and ``db``) right after its loss, for a loss gradient of 1; the
backward only scales them by the gradient it receives (a scalar). Three products of the head per step, the
fewest there are (the logits, ``dh``, ``dW``), where recomputing the logits in backward would make four; the
price is ``dW`` (a weight's size) held from forward to backward instead of ``h`` -- Liger-Kernel's fused
linear cross-entropy makes the same trade. A loss per token (``"none"``) or no gradient keeps only the
per-token log-sum-exp ``[N]``; then the backward is a custom op of its own,
``autoshard::linear_cross_entropy_backward``, that recomputes each chunk's logits.

``h`` is ``[N, H]`` (any leading dims are flattened; ``target`` holds ``N`` class indices in any shape).
The logits of a chunk are ``linear(h, weight, bias)`` in ``h``'s dtype -- the dtype the model's head ran
in; the caller casts -- then the loss is computed in :func:`compute_dtype` of ``out_dtype`` (float64
stays, everything else accumulates in float32) and returned in ``out_dtype``: the dtype the one-process
``cross_entropy`` returned (float32 after an upcast ``.float()`` of the logits, or under autocast).

Per counted token (``target != ignore_index``), with class weights ``w`` (ones without), ``C`` classes
and smoothing ``e``, as ``torch.nn.functional.cross_entropy`` defines it::

    loss_i = (1 - e) * w[t_i] * (lse_i - z_i[t_i]) + e / C * (sum(w) * lse_i - sum_c w_c z_ic)

``reduction``: ``"none"`` (``target``'s shape), ``"sum"``, or ``"mean"`` (the sum over the summed ``w[t_i]``
of the counted tokens). Under sequence parallelism the compiler asks each rank for its ``"sum"`` and
divides the all-reduced sums by the all-reduced denominators (:mod:`autoshard.passes.rules.loss`), so the
op itself never communicates. ``lse`` (``[N]``, compute dtype) and the gradients are not differentiable
(empty without ``grads``).

Inner compilers (``aot_eager``, ``inductor``) see one opaque call each way instead of an unrolled loop they
could reorder. The gradients are returned through autograd (never written to ``.grad``), so DDP / FSDP hooks
see them; ``dW`` and ``db`` accumulate over the chunks in the compute dtype and are rounded once (in 16-bit
dtypes the backward's scaling rounds once more).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .attention.local import compute_dtype, without_autocast
from .op_info import Arguments, Work, declare

__all__ = ["linear_cross_entropy", "chunk_bounds", "chunks_for", "working_set_bytes"]

REDUCTIONS = ("none", "sum", "mean")


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each chunk of ``rows`` rows cut into ``chunks`` near-equal chunks (fewer when there
    are fewer rows than chunks; none for no rows)."""
    size = max(1, math.ceil(rows / max(1, chunks)))
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def chunks_for(max_rows: int, tokens_per_chunk: int) -> int:
    """How many chunks hold ``max_rows`` rows (the largest rank's) at ``tokens_per_chunk`` rows each. The
    compiler passes every rank the count of the largest rank, so all ranks run the same number of chunks. A
    symbolic ``max_rows`` (a graph compiled for every length) gives the count as an expression, no guard."""
    per_chunk = max(1, tokens_per_chunk)
    return torch.sym_max(1, (max_rows + per_chunk - 1) // per_chunk)


def working_set_bytes(rows: int, classes: int, chunks: int, logits_dtype: torch.dtype, out_dtype: torch.dtype) -> int:
    """The bytes of the largest chunk's ``[rows / chunks, V]`` values alive at once, forward or backward: what the
    op holds at its peak on top of its inputs and outputs. The buffer every chunk's logits are written into (in
    the compute dtype, turned in place into their log-sum-exp terms and gradient) and, when the head's dtype is
    narrower, the logits as the head makes them or their gradient cast back to it."""
    bounds = chunk_bounds(rows, chunks)
    c = max((stop - start for start, stop in bounds), default=0)
    ct = compute_dtype(out_dtype)
    itemsize = torch.empty((), dtype=logits_dtype).element_size()
    ct_size = torch.empty((), dtype=ct).element_size()
    return c * classes * (ct_size + (itemsize if logits_dtype != ct else 0))


def _check(h, weight, bias, target, class_weight, reduction, grads=False) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"autoshard.linear_cross_entropy: reduction={reduction!r} is not one of {REDUCTIONS}")
    if grads and reduction == "none":
        raise ValueError("autoshard.linear_cross_entropy: gradients in forward need a reduced loss, not "
                         "reduction='none'")
    if weight.dim() != 2 or h.size(-1) != weight.size(1):
        raise ValueError(f"autoshard.linear_cross_entropy: h {tuple(h.shape)} and weight {tuple(weight.shape)} "
                         "do not make a linear layer")
    if h.numel() // max(1, h.size(-1)) != target.numel():
        raise ValueError(f"autoshard.linear_cross_entropy: {target.numel()} targets for "
                         f"{h.numel() // max(1, h.size(-1))} rows of h")
    if bias is not None and bias.shape != (weight.size(0),):
        raise ValueError(f"autoshard.linear_cross_entropy: bias {tuple(bias.shape)} for {weight.size(0)} classes")
    if class_weight is not None and class_weight.shape != (weight.size(0),):
        raise ValueError(f"autoshard.linear_cross_entropy: class weight {tuple(class_weight.shape)} for "
                         f"{weight.size(0)} classes")


class _Tokens:
    """What forward and backward share: the rows, their targets, the weights of their targets."""

    def __init__(self, h, weight, target, class_weight, ignore_index, smoothing, ct):
        self.x = h.reshape(-1, h.size(-1))
        self.t = target.reshape(-1)
        self.classes = weight.size(0)
        self.valid = self.t != ignore_index
        self.safe = torch.where(self.valid, self.t, torch.zeros_like(self.t))
        self.w = class_weight.to(ct) if class_weight is not None else None
        self.w_sum = self.w.sum() if self.w is not None else float(self.classes)
        self.wt = self.w[self.safe] if self.w is not None else None
        self.smoothing = float(smoothing)
        self.ct = ct

    def target_weight(self, start: int, stop: int):
        """``w[t_i]`` of the chunk's rows (1 without class weights)."""
        return self.wt[start:stop] if self.wt is not None else 1.0

    def denominator(self) -> torch.Tensor:
        """What ``"mean"`` divides by: the counted tokens, or their summed target weights."""
        if self.wt is None:
            return self.valid.sum().to(self.ct)
        return torch.where(self.valid, self.wt, torch.zeros((), dtype=self.ct, device=self.wt.device)).sum()

    def logits(self, start: int, stop: int, weight, bias, buffer: torch.Tensor) -> torch.Tensor:
        """The chunk's logits ``[c, V]`` computed in ``h``'s dtype, in the compute dtype, written into the first
        ``c`` rows of ``buffer`` (``[rows of the largest chunk, V]``, compute dtype; the caller may write into
        them). One buffer serves every chunk: a fresh ``[c, V]`` per chunk costs its page faults each time."""
        x, z = self.x[start:stop], buffer[:stop - start]
        if x.dtype != self.ct:
            z.copy_(F.linear(x, weight, bias))
        elif bias is not None:
            torch.addmm(bias, x, weight.t(), out=z)
        else:
            torch.mm(x, weight.t(), out=z)
        return z

    def buffer(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        """The ``[rows of the largest chunk, V]`` buffer :meth:`logits` writes into."""
        rows = max((stop - start for start, stop in bounds), default=0)
        return self.x.new_empty(rows, self.classes, dtype=self.ct)


class _Gradients:
    """``dh``, ``dW`` and ``db`` of the loss, made a chunk at a time from the chunk's logits (``dW`` and ``db``
    accumulate in the compute dtype and are rounded once, by :meth:`result`)."""

    def __init__(self, tok: _Tokens, h, weight, bias):
        self.tok, self.weight = tok, weight
        self.dh = torch.empty_like(tok.x)
        self.dw = torch.zeros(weight.shape, dtype=tok.ct, device=weight.device)
        self.db = torch.zeros(tok.classes, dtype=tok.ct, device=weight.device) if bias is not None else None
        self.w_row = tok.w if tok.w is not None else torch.ones(tok.classes, dtype=tok.ct, device=weight.device)
        self.h_shape, self.weight_dtype, self.bias_dtype = h.shape, weight.dtype, (bias.dtype if bias is not None
                                                                                    else None)

    def add(self, start: int, stop: int, z: torch.Tensor, g: torch.Tensor) -> None:
        """The chunk's share: ``z`` the softmax of its logits in the compute dtype (turned into their gradient in
        place), ``g`` the gradient of each row's loss (zero where not counted)."""
        tok, e, classes = self.tok, self.tok.smoothing, self.tok.classes
        wt = tok.target_weight(start, stop)
        z.mul_((g * ((1.0 - e) * wt + (e / classes) * tok.w_sum))[:, None])
        z.scatter_add_(1, tok.safe[start:stop, None], (-(1.0 - e) * g * wt)[:, None])
        if e:
            z.addr_(g, self.w_row, alpha=-e / classes)
        low = z.to(tok.x.dtype)                                     # the gradient of the logits in the head's dtype
        torch.mm(low, self.weight, out=self.dh[start:stop])
        if low.dtype == tok.ct:
            self.dw.addmm_(low.t(), tok.x[start:stop])
        else:
            self.dw.add_(low.t() @ tok.x[start:stop])
        if self.db is not None:
            self.db.add_(low.sum(0, dtype=tok.ct))

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dh, dW, db)`` in the dtypes of ``h``, the weight and the bias (``db`` empty without a bias)."""
        db = self.db.to(self.bias_dtype) if self.db is not None else self.dw.new_empty(0, dtype=self.weight_dtype)
        return self.dh.reshape(self.h_shape), self.dw.to(self.weight_dtype), db


def _row_gradients(tok: _Tokens, grad: torch.Tensor, reduction: str) -> torch.Tensor:
    """The gradient of each row's loss ``[N]`` (compute dtype, zero where not counted) from the reduced loss's."""
    rows, ct = tok.x.size(0), tok.ct
    if reduction == "none":
        g = grad.reshape(-1).to(ct)
    else:
        g = grad.to(ct).expand(rows)
        if reduction == "mean":
            g = g / tok.denominator()
    return torch.where(tok.valid, g, torch.zeros((), dtype=ct, device=g.device))


def _forward(h, weight, bias, target, class_weight, ignore_index, smoothing, reduction, chunks, out_dtype, grads):
    ct = compute_dtype(out_dtype)
    tok = _Tokens(h, weight, target, class_weight, ignore_index, smoothing, ct)
    rows = tok.x.size(0)
    lse = tok.x.new_empty(rows, dtype=ct)
    loss = tok.x.new_zeros(rows, dtype=ct)
    e = tok.smoothing
    if grads:
        unit = _row_gradients(tok, torch.ones((), dtype=ct, device=tok.x.device), reduction)
        gradients = _Gradients(tok, h, weight, bias)
    bounds = chunk_bounds(rows, chunks)
    buffer = tok.buffer(bounds)
    for start, stop in bounds:
        z = tok.logits(start, stop, weight, bias, buffer)
        picked = z.gather(1, tok.safe[start:stop, None]).squeeze(1)
        if e:
            summed = z @ tok.w if tok.w is not None else z.sum(-1)
        top = z.amax(-1)                                            # log-sum-exp, in place
        exp_sum = z.sub_(top[:, None]).exp_().sum(-1)
        chunk_lse = top + exp_sum.log()
        lse[start:stop] = chunk_lse
        part = (1.0 - e) * tok.target_weight(start, stop) * (chunk_lse - picked)
        if e:
            part = part + (e / tok.classes) * (tok.w_sum * chunk_lse - summed)
        loss[start:stop] = torch.where(tok.valid[start:stop], part, torch.zeros((), dtype=ct, device=part.device))
        if grads:
            gradients.add(start, stop, z.div_(exp_sum[:, None]), unit[start:stop])  # softmax
    del buffer
    if reduction == "none":
        out = loss.reshape(target.shape)
    elif reduction == "sum":
        out = loss.sum()
    else:
        out = loss.sum() / tok.denominator()
    return (out.to(out_dtype), lse, *(gradients.result() if grads else (h.new_empty(0) for _ in range(3))))


def _backward(grad, h, weight, bias, target, class_weight, lse, ignore_index, smoothing, reduction, chunks):
    tok = _Tokens(h, weight, target, class_weight, ignore_index, smoothing, lse.dtype)
    g = _row_gradients(tok, grad, reduction)
    gradients = _Gradients(tok, h, weight, bias)
    bounds = chunk_bounds(tok.x.size(0), chunks)
    buffer = tok.buffer(bounds)
    for start, stop in bounds:
        z = tok.logits(start, stop, weight, bias, buffer)
        gradients.add(start, stop, z.sub_(lse[start:stop, None]).exp_(), g[start:stop])  # softmax
    return gradients.result()


@torch.library.custom_op("autoshard::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             target: torch.Tensor, class_weight: Optional[torch.Tensor], ignore_index: int,
                             label_smoothing: float, reduction: str, chunks: int, out_dtype: torch.dtype,
                             grads: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor]:
    _check(h, weight, bias, target, class_weight, reduction, grads)
    with without_autocast(h):
        return _forward(h, weight, bias, target, class_weight, ignore_index, label_smoothing, reduction, chunks,
                        out_dtype, grads)


@_linear_cross_entropy_op.register_fake
def _(h, weight, bias, target, class_weight, ignore_index, label_smoothing, reduction, chunks, out_dtype, grads):
    _check(h, weight, bias, target, class_weight, reduction, grads)
    shape = target.shape if reduction == "none" else ()
    if grads:
        gradients = (torch.empty_like(h), torch.empty_like(weight),
                     torch.empty_like(bias) if bias is not None else weight.new_empty(0))
    else:
        gradients = tuple(h.new_empty(0) for _ in range(3))
    return h.new_empty(shape, dtype=out_dtype), h.new_empty(target.numel(), dtype=compute_dtype(out_dtype)), *gradients


@torch.library.custom_op("autoshard::linear_cross_entropy_backward", mutates_args=())
def _linear_cross_entropy_backward_op(grad: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                                      bias: Optional[torch.Tensor], target: torch.Tensor,
                                      class_weight: Optional[torch.Tensor], lse: torch.Tensor, ignore_index: int,
                                      label_smoothing: float, reduction: str,
                                      chunks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with without_autocast(h):
        return _backward(grad, h, weight, bias, target, class_weight, lse, ignore_index, label_smoothing, reduction,
                         chunks)


@_linear_cross_entropy_backward_op.register_fake
def _(grad, h, weight, bias, target, class_weight, lse, ignore_index, label_smoothing, reduction, chunks):
    db = torch.empty_like(bias) if bias is not None else weight.new_empty(0)
    return torch.empty_like(h), torch.empty_like(weight), db


def _setup(ctx, inputs, output):
    h, weight, bias, target, class_weight, ignore_index, label_smoothing, reduction, chunks, _out_dtype, grads = inputs
    ctx.grads = grads
    ctx.has_bias = bias is not None
    if grads:  # made in forward for a loss gradient of 1: backward scales them
        ctx.save_for_backward(*output[2:])
    else:
        ctx.save_for_backward(h, weight, bias, target, class_weight, output[1])
        ctx.config = (ignore_index, label_smoothing, reduction, chunks)
    ctx.mark_non_differentiable(*output[1:])


def _autograd_backward(ctx, grad, *_grad_saved):
    if ctx.grads:
        dh, dw, db = (x * grad.to(x.dtype) for x in ctx.saved_tensors)
    else:
        h, weight, bias, target, class_weight, lse = ctx.saved_tensors
        dh, dw, db = torch.ops.autoshard.linear_cross_entropy_backward(grad, h, weight, bias, target, class_weight,
                                                                       lse, *ctx.config)
    return dh, dw, (db if ctx.has_bias else None), None, None, None, None, None, None, None, None


_linear_cross_entropy_op.register_autograd(_autograd_backward, setup_context=_setup)

_SOFTMAX_PASSES = 3
"""Passes over the float32 ``[tokens, V]`` values per product (max, exp-sum, the probabilities or their
gradient)."""


def _rows(h: torch.Tensor) -> int:
    return h.numel() // max(1, h.size(-1))


def _work(a: Arguments, products: int) -> Work:
    """``products`` products of ``[tokens, H] x [H, V]`` and their softmax passes."""
    h, classes = a["h"], a["weight"].size(0)
    return Work(flops=products * 2 * _rows(h) * classes * h.size(-1), dtype=h.dtype,
                bytes=products * _SOFTMAX_PASSES * _rows(h) * classes * 4)


def _working_set(a: Arguments, out_dtype: torch.dtype) -> int:
    """A chunk's ``[tokens / chunks, V]`` values alive at once (:func:`working_set_bytes`)."""
    return working_set_bytes(_rows(a["h"]), a["weight"].size(0), a["chunks"], a["h"].dtype, out_dtype)


# forward: the logits, and the gradients of the hidden state and of the weight when it makes them; backward:
# the logits again and both gradients
declare(torch.ops.autoshard.linear_cross_entropy.default, flops=lambda a: _work(a, 3 if a["grads"] else 1),
        working_set=lambda a: _working_set(a, a["out_dtype"]))
declare(torch.ops.autoshard.linear_cross_entropy_backward.default, flops=lambda a: _work(a, 3),
        working_set=lambda a: _working_set(a, a["grad"].dtype))


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
                         *, class_weight: torch.Tensor | None = None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, reduction: str = "mean", chunks: int = 1,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(h, weight, bias).to(out_dtype), target, ...)`` in ``chunks`` chunks of tokens,
    without the ``[N, V]`` logits (see the module docstring). ``out_dtype`` defaults to ``h``'s dtype."""
    grads = reduction != "none" and torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (h, weight, bias))
    return torch.ops.autoshard.linear_cross_entropy(h, weight, bias, target, class_weight, ignore_index,
                                                    float(label_smoothing), reduction, chunks,
                                                    out_dtype or h.dtype, grads)[0]
