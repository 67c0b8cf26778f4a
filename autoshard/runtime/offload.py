"""Checkpointed regions whose inputs wait for backward in host memory (``BackendConfig.offload``).

With every layer checkpointed, what a rank still holds between forward and backward is the layers' inputs:
``layers x tokens x hidden`` (Llama-8B at 512k tokens per rank: 32 x 4 GiB). ALST's answer, taken here: keep
them in host memory, and bring each back when backward reaches its layer.

A checkpoint saves its region's inputs once, outside its own saved-tensor hooks (``torch.utils.checkpoint``'s
``_NoopSaveInputs``); everything inside the region is recomputed. So :func:`offloaded_checkpoint` runs the
region's ``tag_activation_checkpoint`` under saved-tensor hooks of its own, and they see exactly the region's
inputs:

* a leaf that requires grad (a parameter) or a tensor already in host memory stays as it is;
* anything else is copied to host memory (pinned, asynchronously) and copied back on the first unpack.

A value several regions take (the rotary tables every layer reads) is copied once: the hooks remember the
tensors they copied during this forward by identity (a weak reference checks the entry is still that
tensor) and hand out the same host copy. Inside the region, the checkpoint's own hooks take precedence, so
nothing else is moved.

A plan runs the graph on fake CPU tensors, where every tensor would "stay": under :func:`planned_offload`
the hooks model the device instead -- a packed input is dropped (its bytes counted as host memory) and
unpacking allocates it anew, as the copy back does -- so the plan's peak is the device's.

The hooks run only in eager execution: the outline pass emits :func:`offloaded_checkpoint` only with the
``"eager"`` inner compiler (the backend refuses ``offload=True`` with another one), since tracing compilers
would trace the copies instead of running them.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

__all__ = ["offloaded_checkpoint", "HostCopy", "planned_offload"]

_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


class HostCopy:
    """A tensor's copy in host memory (pinned and asynchronous from CUDA), and where it came from: a checkpoint's
    saved input here, the hidden state of lazy logits (:mod:`.lazy_linear`)."""

    def __init__(self, t: torch.Tensor):
        self.device = t.device
        pinned = torch.cuda.is_available() and t.device.type == "cuda"
        self.host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pinned).copy_(t, non_blocking=pinned)
        self.restored: torch.Tensor | None = None

    def restore(self) -> torch.Tensor:
        """The tensor back on its device (copied once; regions that share the value share the copy)."""
        if self.restored is None:
            self.restored = self.host.to(self.device, non_blocking=True)
        return self.restored


_copied: dict[int, tuple[weakref.ref, HostCopy]] = {}
"""id of a tensor copied during a forward -> (a weak reference to it, its copy)."""


class _Planned:
    """A plan's stand-in for a host copy: the tensor's metadata; unpacking allocates it again."""

    def __init__(self, t: torch.Tensor):
        self.meta = (t.size(), t.stride(), t.dtype, t.device)
        self.restored: torch.Tensor | None = None

    def restore(self) -> torch.Tensor:
        if self.restored is None:
            size, stride, dtype, device = self.meta
            self.restored = torch.empty_strided(size, stride, dtype=dtype, device=device)
        return self.restored


_planning: list[int] | None = None
"""Under :func:`planned_offload`: the host bytes packed so far (one entry)."""


@contextlib.contextmanager
def planned_offload():
    """Model offload on the device a plan stands for (see the module docstring); yields a one-entry list that
    holds the host bytes the packed inputs take."""
    global _planning
    outer, _planning = _planning, [0]
    try:
        yield _planning
    finally:
        _planning = outer


def _stays(t: torch.Tensor) -> bool:
    """Whether a saved tensor stays where it is: a parameter, or already in host memory (on the device a plan
    stands for, nothing is in host memory)."""
    return (t.is_leaf and t.requires_grad) or (t.device.type == "cpu" and _planning is None)


def _pack(t: torch.Tensor):
    if _stays(t):
        return t
    entry = _copied.get(id(t))
    if entry is not None and entry[0]() is t:
        return entry[1]
    if _planning is not None:
        _planning[0] += t.untyped_storage().nbytes()
    copy = HostCopy(t) if _planning is None else _Planned(t)
    _copied[id(t)] = (weakref.ref(t, lambda _, key=id(t): _copied.pop(key, None)), copy)
    return copy


def _unpack(packed):
    return packed.restore() if isinstance(packed, (HostCopy, _Planned)) else packed


def offloaded_checkpoint(body, *args, **kwargs):
    """``tag_activation_checkpoint(body, *args, **kwargs)`` with the region's inputs kept in host memory until
    backward (see the module docstring)."""
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        return _CHECKPOINT(body, *args, **kwargs)
