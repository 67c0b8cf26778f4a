"""``LazyLinear``: the output of a linear layer that is computed when it is first read.

A causal LM called with ``labels=`` returns its logits beside the loss (transformers' ``*ForCausalLM``), and
most training loops read only the loss. With the loss chunked (:mod:`autoshard.passes.chunking`), nothing in the
graph needs the ``[S / P, V]`` logits any more: at long context they are the largest value of the step (128 GiB
per rank for Llama-3-8B at 4M tokens on 8 ranks), and their product is one more pass of the LM head over the
rank's tokens. The graph (:mod:`autoshard.passes.lazy`) returns them lazily instead: a tensor subclass with the
logits' shape, dtype and device that holds the hidden state ``[S / P, H]`` the head reads (the head's weight and
bias are the model's own) and computes ``linear(h, W, b)`` the first time any op reads it -- then keeps the
result, so later reads compute nothing. A caller that drops the logits unread pays for neither the product nor
the memory; one that reads them gets the one-process value (the same op in the same dtype).

Autograd: the lazy value is the output of an ``autograd.Function`` of ``(h, W, b)``; an op on it records the lazy
value as its input, so a loss computed from the logits by the caller sends its gradient back through the head
(``dh = g W``, ``dW = g^T h``, ``db = sum g``) as the uncompiled head would. A loss that does not read them never
reaches that function.

The value must be the one of the weights the step ran with: an optimizer step first computes every lazy value
still held (a global step pre-hook: a loop that reads the logits after ``optimizer.step()`` gets the step's
logits, and one that dropped them pays nothing); a value whose inputs were changed otherwise (FSDP2 frees a
resharded parameter's storage after backward; an in-place update by hand) raises when read, never computes
from the new weights.

Metadata reads (shape, dtype, ``requires_grad``) compute nothing; ``detach`` and aliases stay lazy and share the
computed value; in-place changes compute the value and write into it (it is then an ordinary tensor under the
hood). Under sequence parallelism the logits leave the graph split (:class:`~autoshard.runtime.split_tensor.SplitTensor`
over this rank's ``LazyLinear``): a gather computes every rank's shard where it is used.

With ``offload`` (the layers' inputs kept in host memory) the hidden state waits in host memory too: at millions of
tokens its ``[S / P, H]`` is as large as a layer's input, and nothing reads it on the device unless the logits are
read (then it comes back for the product, and for its gradient).

The head's dtype is recorded when the graph runs (under ``torch.autocast`` the head's product runs in the
autocast dtype): the value is computed with autocast off, from ``h``, ``W`` and ``b`` cast to it, and the
gradient of each is returned in its own dtype.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .carrier import Carrier
from .offload import HostCopy

__all__ = ["LazyLinear", "lazy_linear"]


class _Pending:
    """What a lazy value and its aliases share: the inputs until it is computed, then the value. ``h`` may be a
    :class:`~autoshard.runtime.offload.HostCopy` (:func:`lazy_linear`'s ``host``): it goes back to ``device`` to be
    read."""

    def __init__(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device):
        self.inputs: tuple | None = (h, weight, bias)
        self.device = device
        self.versions = tuple(x._version if isinstance(x, torch.Tensor) else None for x in self.inputs)
        self.dtype = dtype
        self.value: torch.Tensor | None = None
        _PENDING.add(self)

    def changed(self) -> bool:
        """Whether an input was written since the value was made (its version moved, or its storage was freed:
        FSDP2 reshards a parameter by resizing its storage to nothing)."""
        return any(isinstance(x, torch.Tensor) and (x._version != v or x.untyped_storage().nbytes() == 0)
                   for x, v in zip(self.inputs, self.versions))

    def compute(self) -> torch.Tensor:
        if self.value is None:
            if self.changed():
                raise RuntimeError(
                    "autoshard: these logits were returned uncomputed (nobody had read them: "
                    "autoshard.runtime.lazy_linear.LazyLinear) and the LM head's weight (or the hidden state) has "
                    "changed since -- FSDP2 resharded it after backward, or it was updated in place outside an "
                    "optimizer step. Read the logits before the weights change, or compile with lazy_logits=False")
            h, weight, bias = ((x.restore(keep=False) if isinstance(x, HostCopy) else x).to(self.device, self.dtype)
                               if x is not None else None for x in self.inputs)
            with torch.autocast(h.device.type, enabled=False):
                self.value = F.linear(h, weight, bias)
            self.inputs = None  # the hidden state is no longer held for this value
            _PENDING.discard(self)
        return self.value


_PENDING: "weakref.WeakSet[_Pending]" = weakref.WeakSet()
"""Lazy values not computed yet that someone still holds."""


def _compute_pending(optimizer, args, kwargs) -> None:
    """Before any optimizer step: compute the lazy values still held (their weights are about to change), unless
    their inputs already changed (they raise when read)."""
    for pending in list(_PENDING):
        if pending.value is None and not pending.changed():
            pending.compute()


register_optimizer_step_pre_hook(_compute_pending)


class LazyLinear(Carrier):
    """``linear(h, weight, bias)`` computed on first read (see the module docstring)."""

    pending: _Pending

    @staticmethod
    def __new__(cls, pending: _Pending, shape: torch.Size, device: torch.device):
        out = cls._wrapper(shape, pending.dtype, device)
        out.pending = pending
        return out

    def __repr__(self) -> str:
        state = "computed" if self.pending.value is not None else "not computed"
        return f"LazyLinear(shape={tuple(self.shape)}, dtype={self.dtype}, {state})"

    @property
    def computed(self) -> bool:
        """Whether the value has been computed (read) yet."""
        return self.pending.value is not None

    def materialize(self) -> torch.Tensor:
        """The value, computed on the first call (a plain tensor, kept for later reads)."""
        return self.pending.compute()

    def aliased(self) -> LazyLinear:
        return LazyLinear(self.pending, self.shape, self.device)  # it shares what is computed


class _Lazy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, dtype, host):
        if host:  # the device's copy dies with the graph's output; backward and the value read the host's
            ctx.host_h = HostCopy(h.detach())
            ctx.save_for_backward(weight, bias)
        else:
            ctx.host_h = None
            ctx.save_for_backward(h, weight, bias)
        kept = ctx.host_h if host else h.detach()
        pending = _Pending(kept, weight.detach(), bias.detach() if bias is not None else None, dtype, h.device)
        return LazyLinear(pending, (*h.shape[:-1], weight.size(0)), h.device)

    @staticmethod
    def backward(ctx, grad):
        if ctx.host_h is not None:
            h, (weight, bias) = ctx.host_h.restore(keep=False), ctx.saved_tensors
        else:
            h, weight, bias = ctx.saved_tensors
        rows = grad.reshape(-1, grad.size(-1))
        dh = dw = db = None
        if ctx.needs_input_grad[0]:
            dh = (grad @ weight.to(grad.dtype)).to(h.dtype)
        if ctx.needs_input_grad[1]:
            dw = (rows.t() @ h.reshape(-1, h.size(-1)).to(grad.dtype)).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            db = rows.sum(0).to(bias.dtype)
        return dh, dw, db, None, None


def lazy_linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                dtype: torch.dtype | None = None, host: bool = False) -> LazyLinear:
    """``linear(h, weight, bias)`` in ``dtype`` (default ``h``'s), computed when first read: a :class:`LazyLinear`.
    ``host``: hold ``h`` in host memory until then (pinned; with ``offload``, whose layer inputs wait there too)."""
    return _Lazy.apply(h, weight, bias, dtype or h.dtype, host)
