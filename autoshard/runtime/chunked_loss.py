"""The LM head and its cross-entropy, chunked over tokens (``torch.ops.autoshard.linear_cross_entropy``).

``cross_entropy(linear(h, W, b).float(), target)`` materializes the logits ``[N, V]``, the log-softmax
autograd saves for backward (the same size, float32) and their gradient: at long context the largest
values of a step. The op computes the same loss a chunk of tokens at a time and keeps only the
per-token log-sum-exp ``[N]`` for backward, which recomputes each chunk's logits and turns them into
that chunk's ``dh`` rows and its share of ``dW`` (and ``db``). No ``[N, V]`` value exists at any time;
the working set is a few ``[N / chunks, V]`` values::

    torch.ops.autoshard.linear_cross_entropy(h, weight, bias, target, class_weight, ignore_index,
                                             label_smoothing, reduction, chunks, out_dtype) -> (loss, lse)

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
op itself never communicates. ``lse`` (``[N]``, compute dtype) is not differentiable.

The backward is a custom op of its own, ``autoshard::linear_cross_entropy_backward``, so inner compilers
(``aot_eager``, ``inductor``) see one opaque call instead of an unrolled loop they could reorder. Its
gradients are returned through autograd (never written to ``.grad``), so DDP / FSDP hooks see them;
``dW`` and ``db`` accumulate over the chunks in the compute dtype and are rounded once.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from .attention.local import compute_dtype, without_autocast

__all__ = ["linear_cross_entropy", "chunk_bounds", "chunks_for", "working_set_bytes"]

REDUCTIONS = ("none", "sum", "mean")


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each chunk of ``rows`` rows cut into ``chunks`` near-equal chunks (fewer when there
    are fewer rows than chunks; none for no rows)."""
    size = max(1, math.ceil(rows / max(1, chunks)))
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def chunks_for(max_rows: int, tokens_per_chunk: int) -> int:
    """How many chunks hold ``max_rows`` rows (the largest rank's) at ``tokens_per_chunk`` rows each. The
    compiler passes every rank the count of the largest rank, so all ranks run the same number of chunks."""
    return max(1, math.ceil(max_rows / max(1, tokens_per_chunk)))


def working_set_bytes(rows: int, classes: int, chunks: int, logits_dtype: torch.dtype, out_dtype: torch.dtype, *,
                      backward: bool = False) -> int:
    """The bytes of the largest chunk's ``[rows / chunks, V]`` values alive at once: what the op holds at its peak
    on top of its inputs and outputs. Forward: the chunk's logits and, in the compute dtype, their copy or the
    exponentials ``logsumexp`` makes of them. Backward: the logits in their dtype, their copy in the compute dtype
    turned in place into the gradient, and its cast back -- one chunk when the logits are in the compute dtype
    (made in place, never cast)."""
    bounds = chunk_bounds(rows, chunks)
    c = max((stop - start for start, stop in bounds), default=0)
    ct = compute_dtype(out_dtype)
    lower = logits_dtype != ct
    itemsize = torch.empty((), dtype=logits_dtype).element_size()
    ct_size = torch.empty((), dtype=ct).element_size()
    if backward and not lower:
        return c * classes * ct_size
    return c * classes * (ct_size + (2 * itemsize if lower else ct_size))


def _check(h, weight, bias, target, class_weight, reduction) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"autoshard.linear_cross_entropy: reduction={reduction!r} is not one of {REDUCTIONS}")
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

    def logits(self, start: int, stop: int, weight, bias) -> torch.Tensor:
        """The chunk's logits ``[c, V]`` computed in ``h``'s dtype, in the compute dtype (always a fresh tensor,
        the caller may write into it)."""
        z = F.linear(self.x[start:stop], weight, bias)
        return z if z.dtype == self.ct else z.to(self.ct)


def _forward(h, weight, bias, target, class_weight, ignore_index, smoothing, reduction, chunks, out_dtype):
    ct = compute_dtype(out_dtype)
    tok = _Tokens(h, weight, target, class_weight, ignore_index, smoothing, ct)
    rows = tok.x.size(0)
    lse = tok.x.new_empty(rows, dtype=ct)
    loss = tok.x.new_zeros(rows, dtype=ct)
    e = tok.smoothing
    for start, stop in chunk_bounds(rows, chunks):
        z = tok.logits(start, stop, weight, bias)
        chunk_lse = torch.logsumexp(z, dim=-1)
        lse[start:stop] = chunk_lse
        picked = z.gather(1, tok.safe[start:stop, None]).squeeze(1)
        part = (1.0 - e) * tok.target_weight(start, stop) * (chunk_lse - picked)
        if e:
            summed = z @ tok.w if tok.w is not None else z.sum(-1)
            part = part + (e / tok.classes) * (tok.w_sum * chunk_lse - summed)
        loss[start:stop] = torch.where(tok.valid[start:stop], part, torch.zeros((), dtype=ct, device=part.device))
        del z
    if reduction == "none":
        out = loss.reshape(target.shape)
    elif reduction == "sum":
        out = loss.sum()
    else:
        out = loss.sum() / tok.denominator()
    return out.to(out_dtype), lse


def _backward(grad, h, weight, bias, target, class_weight, lse, ignore_index, smoothing, reduction, chunks):
    ct = lse.dtype
    tok = _Tokens(h, weight, target, class_weight, ignore_index, smoothing, ct)
    rows, e, classes = tok.x.size(0), tok.smoothing, tok.classes
    if reduction == "none":
        g = grad.reshape(-1).to(ct)
    else:
        g = grad.to(ct).expand(rows)
        if reduction == "mean":
            g = g / tok.denominator()
    g = torch.where(tok.valid, g, torch.zeros((), dtype=ct, device=g.device))
    dh = torch.empty_like(tok.x)
    dw = torch.zeros(weight.shape, dtype=ct, device=weight.device)
    db = torch.zeros(classes, dtype=ct, device=weight.device) if bias is not None else None
    w_row = tok.w if tok.w is not None else torch.ones(classes, dtype=ct, device=weight.device)
    for start, stop in chunk_bounds(rows, chunks):
        gc = g[start:stop]
        wt = tok.target_weight(start, stop)
        dz = tok.logits(start, stop, weight, bias)
        dz.sub_(lse[start:stop, None]).exp_()                      # softmax
        dz.mul_((gc * ((1.0 - e) * wt + (e / classes) * tok.w_sum))[:, None])
        dz.scatter_add_(1, tok.safe[start:stop, None], (-(1.0 - e) * gc * wt)[:, None])
        if e:
            dz.addr_(gc, w_row, alpha=-e / classes)
        low = dz.to(tok.x.dtype)                                   # the gradient of the logits in the head's dtype
        torch.mm(low, weight, out=dh[start:stop])
        if low.dtype == ct:
            dw.addmm_(low.t(), tok.x[start:stop])
        else:
            dw.add_(low.t() @ tok.x[start:stop])
        if db is not None:
            db.add_(low.sum(0, dtype=ct))
        del dz, low
    dh = dh.reshape(h.shape)
    return dh, dw.to(weight.dtype), (db.to(bias.dtype) if db is not None else weight.new_empty(0))


@torch.library.custom_op("autoshard::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             target: torch.Tensor, class_weight: Optional[torch.Tensor], ignore_index: int,
                             label_smoothing: float, reduction: str, chunks: int,
                             out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _check(h, weight, bias, target, class_weight, reduction)
    with without_autocast(h):
        return _forward(h, weight, bias, target, class_weight, ignore_index, label_smoothing, reduction, chunks,
                        out_dtype)


@_linear_cross_entropy_op.register_fake
def _(h, weight, bias, target, class_weight, ignore_index, label_smoothing, reduction, chunks, out_dtype):
    _check(h, weight, bias, target, class_weight, reduction)
    shape = target.shape if reduction == "none" else ()
    return h.new_empty(shape, dtype=out_dtype), h.new_empty(target.numel(), dtype=compute_dtype(out_dtype))


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
    h, weight, bias, target, class_weight, ignore_index, label_smoothing, reduction, chunks, _out_dtype = inputs
    ctx.save_for_backward(h, weight, bias, target, class_weight, output[1])
    ctx.config = (ignore_index, label_smoothing, reduction, chunks)
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1])


def _autograd_backward(ctx, grad, _grad_lse):
    h, weight, bias, target, class_weight, lse = ctx.saved_tensors
    dh, dw, db = torch.ops.autoshard.linear_cross_entropy_backward(grad, h, weight, bias, target, class_weight, lse,
                                                                   *ctx.config)
    return dh, dw, (db if ctx.has_bias else None), None, None, None, None, None, None, None


_linear_cross_entropy_op.register_autograd(_autograd_backward, setup_context=_setup)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None,
                         *, class_weight: torch.Tensor | None = None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, reduction: str = "mean", chunks: int = 1,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(h, weight, bias).to(out_dtype), target, ...)`` in ``chunks`` chunks of tokens,
    without the ``[N, V]`` logits (see the module docstring). ``out_dtype`` defaults to ``h``'s dtype."""
    return torch.ops.autoshard.linear_cross_entropy(h, weight, bias, target, class_weight, ignore_index,
                                                    float(label_smoothing), reduction, int(chunks),
                                                    out_dtype or h.dtype)[0]
