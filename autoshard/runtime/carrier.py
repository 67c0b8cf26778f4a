"""``Carrier``: the base of the tensor subclasses that stand for a value held in another form.

The runtime hands three kinds of value across code it does not compile as tensors that are not what they hold:
a value split along the sequence (:class:`~autoshard.runtime.split_tensor.SplitTensor`: this rank's shard), a
value left uncomputed (:class:`~autoshard.runtime.deferred.DeferredTensor`: the small inputs of its recipe), the
logits computed on first read (:class:`~autoshard.runtime.lazy_linear.LazyLinear`: the head's inputs). Each is
a wrapper subclass with the value's shape, dtype and device, and each must answer every aten op the code around
it makes. Most of those answers are the same for all three, so they are written once, here (the role torchao's
``TorchAOBaseTensor`` plays for its quantized tensors):

* ``__torch_function__`` is disabled: the subclass is seen at dispatch only, where autograd has already run;
* metadata reads (:data:`METADATA_OPS`: shape, strides, dtype) are answered from a meta stand-in, without
  materializing the value;
* aliases (:data:`ALIAS_OPS`: ``detach``, ``alias``, the identity autograd makes of what an
  ``autograd.Function`` returns unchanged) are answered by :meth:`Carrier.aliased`, still a carrier;
* a carrier's own ops come next: its table :attr:`Carrier.own_ops` (op -> handler), a handler answering
  ``NotImplemented`` for a call it does not take;
* an in-place op that would write into a carrier raises :attr:`Carrier.in_place_error` (the value it would
  change is a temporary copy) -- or, where that is ``None``, writes into the materialized value;
* any other op runs on the plain value, :meth:`Carrier.materialize` of every carrier of the class among its
  arguments (carriers of another class are left to their own dispatch);
* :meth:`Carrier.warn_once` warns the first time, per class and process, a value is materialized where it
  costs (outside compiled code).

The dispatch runs eagerly (``torch._disable_dynamo``): dynamo would otherwise compile its frame when code it
traces meets a carrier. How a subclass flattens for dynamo (``__tensor_flatten__``) is its own: only the
carriers that cross compiled graphs have one (a lazy value never enters a graph, and must not look traceable).
"""

from __future__ import annotations

from typing import Callable, ClassVar

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_map

from .warn import warn

__all__ = ["Carrier", "METADATA_OPS", "ALIAS_OPS", "is_fake_or_meta"]

aten = torch.ops.aten

METADATA_OPS = {aten.is_floating_point.default, aten.is_complex.default, aten.dim.default, aten.numel.default,
                aten.sym_numel.default, aten.size.default, aten.sym_size.default, aten.stride.default,
                aten.sym_stride.default, aten.is_contiguous.default, aten.is_same_size.default}
"""Ops that read only shape, dtype or device: a carrier answers them from a meta stand-in, without materializing
(computing, gathering) its value."""
ALIAS_OPS = {aten.detach.default, aten.alias.default}
"""Ops whose result is their input itself: a carrier answers them with :meth:`Carrier.aliased`, which shares what
it holds (and what it computes)."""


def is_fake_or_meta(x: torch.Tensor) -> bool:
    """Whether ``x`` has no data (a fake or meta tensor: tracing, planning), so a carrier holding it has no value
    to materialize."""
    return is_fake(x) or x.device.type == "meta"


class Carrier(torch.Tensor):
    """A value held in another form (see the module docstring). Subclasses implement :meth:`materialize` and
    :meth:`aliased`, and may add :attr:`own_ops` and :attr:`in_place_error`."""

    own_ops: ClassVar[dict[torch._ops.OpOverload, Callable]] = {}
    """This carrier's own ops: op -> handler, called with the op's arguments; it returns the result, or
    ``NotImplemented`` to leave the call to the rules after it (in-place refusal, materialization)."""
    in_place_error: ClassVar[str | None] = None
    """The error an in-place op writing into a carrier of this class raises (``{op}``: the op); ``None``: the op
    writes into the materialized value."""
    keyword_carriers_written: ClassVar[bool] = False
    """Whether a carrier passed by keyword to an in-place op (``out=``) counts as written, whatever the op's
    schema says."""
    _warned: ClassVar[bool] = False
    """Whether :meth:`warn_once` has warned for this class (once per process)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def _wrapper(cls, shape, dtype: torch.dtype, device: torch.device):
        """A new carrier of this class with the value's ``shape``, ``dtype`` and ``device`` (what ``__new__`` fills)."""
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)

    def materialize(self) -> torch.Tensor:
        """The value, as a plain tensor."""
        raise NotImplementedError

    def aliased(self) -> "Carrier":
        """The result of an op of :data:`ALIAS_OPS` on this carrier."""
        raise NotImplementedError

    @classmethod
    def warn_once(cls, message: str) -> None:
        """Warn ``message`` unless this class has warned already."""
        if not cls._warned:
            cls._warned = True
            warn(message)

    @classmethod
    def _writes(cls, func, args, kwargs) -> bool:
        """Whether the in-place op ``func`` writes into a carrier of this class."""
        written = any(isinstance(a, cls) and arg.alias_info is not None and arg.alias_info.is_write
                      for a, arg in zip(args, func._schema.arguments))
        return written or (cls.keyword_carriers_written and any(isinstance(v, cls) for v in kwargs.values()))

    @classmethod
    @torch._disable_dynamo
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in METADATA_OPS:
            stand_in = tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta")
                                if isinstance(x, cls) else x, (args, kwargs))
            return func(*stand_in[0], **stand_in[1])
        if func in ALIAS_OPS:
            return args[0].aliased()
        handler = cls.own_ops.get(func)
        if handler is not None:
            out = handler(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if cls.in_place_error is not None and func._schema.is_mutable and cls._writes(func, args, kwargs):
            raise RuntimeError(cls.in_place_error.format(op=func))
        value = tree_map(lambda x: x.materialize() if isinstance(x, cls) else x, (args, kwargs))
        return func(*value[0], **value[1])
