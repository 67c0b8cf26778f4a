"""Checkpointed regions whose inputs wait for backward in host memory (``BackendConfig.offload``).

With every layer checkpointed, what a rank still holds between forward and backward is the layers' inputs:
``layers x tokens x hidden`` (Llama-8B at 512k tokens per rank: 32 x 4 GiB). ALST's answer, taken here: keep
them in host memory, and bring each back when backward reaches its layer.

A checkpoint saves its region's inputs once, outside its own saved-tensor hooks (``torch.utils.checkpoint``'s
``_NoopSaveInputs``); everything inside the region is recomputed. So :func:`offloaded_checkpoint` runs the
region's ``tag_activation_checkpoint`` under saved-tensor hooks of its own, and they see exactly the region's
inputs:

* a leaf that requires grad (a parameter) or a tensor already in host memory stays as it is;
* anything else is copied to host memory (pinned) and copied back for backward.

A value several regions take (the rotary tables every layer reads) is copied once: the hooks remember the
tensors they copied during this forward by identity (a weak reference checks the entry is still that
tensor) and hand out the same host copy. Inside the region, the checkpoint's own hooks take precedence, so
nothing else is moved.

**Double-buffered.** On CUDA the copies run on a stream of their own (one per device), so they overlap the compute
stream instead of waiting in it: forward's copy of a layer's input to the host runs while the layer computes (the
allocator is told the copy stream reads the input, so its memory is not reused before the copy ends); with
``prefetch`` (``BackendConfig.offload_prefetch``), backward's first use of a region's inputs also starts the copy
back of the inputs of the region forward ran before it -- the region backward reaches next -- so that copy
overlaps this region's recomputation and backward. Its price is one more region's inputs on the device while a
region runs backward (a layer's input: 6 GiB per rank for Llama-8B at 6M tokens on 8 ranks), so it is a lever the
memory policy may turn off; without it each region's inputs come back when backward first uses them, the compute
stream waiting for the copy. Each region keeps a weak reference to the one before it, so nothing outlives the
backward that needs it.

A plan runs the graph on fake CPU tensors, where every tensor would "stay": under :func:`planned_offload`
the hooks model the device instead -- a packed input is dropped (its bytes counted as host memory) and
restoring it allocates it anew, as the copy back does -- so the plan's peak is the device's. A plan does not
prefetch: it counts aside the bytes prefetching would hold early (:attr:`PlannedOffload.ahead`, from a region's
first use in backward until the previous region's inputs are restored), so one simulation gives the peak both with
and without double-buffering (the memory policy weighs both from one plan).

The hooks run only in eager execution: the outline pass emits :func:`offloaded_checkpoint` only with the
``"eager"`` inner compiler (the backend refuses ``offload=True`` with another one), since tracing compilers
would trace the copies instead of running them.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

__all__ = ["offloaded_checkpoint", "HostCopy", "PlannedOffload", "planned_offload"]

_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint

_streams: dict[torch.device, "torch.cuda.Stream"] = {}
"""The copy stream of each CUDA device."""


def _copy_stream(device: torch.device):
    """The stream host copies of ``device`` run on, or None (not CUDA: copies are synchronous)."""
    if device.type != "cuda":
        return None
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


class HostCopy:
    """A tensor's copy in host memory and where it came from: a checkpoint's saved input here, the hidden state of
    lazy logits (:mod:`.lazy_linear`). From CUDA: pinned, both copies on the device's copy stream."""

    def __init__(self, t: torch.Tensor):
        self.device = t.device
        stream = _copy_stream(t.device)
        self.host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=stream is not None)
        if stream is None:
            self.host.copy_(t)
        else:
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is computed
            with torch.cuda.stream(stream):
                self.host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # t's memory is not reused before the copy ends
        self.restored: torch.Tensor | None = None
        self.copied = None  # the copy back's event (CUDA)
        self.waited = False

    def prefetch(self) -> None:
        """Start the copy back to the device (once; on CUDA on the copy stream, the compute stream not waiting)."""
        if self.restored is not None:
            return
        stream = _copy_stream(self.device)
        if stream is None:
            self.restored = self.host.to(self.device)
            return
        with torch.cuda.stream(stream):  # after the copy to the host, which ran on this stream
            self.restored = self.host.to(self.device, non_blocking=True)
            self.copied = stream.record_event()

    def restore(self, keep: bool = True) -> torch.Tensor:
        """The tensor back on its device, ready for the compute stream (copied once and kept: regions that share
        the value share the copy; ``keep=False``: not kept, the next call copies again)."""
        self.prefetch()
        restored = self.restored
        if self.copied is not None and not self.waited:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.copied)
            restored.record_stream(current)  # used on the compute stream: freed after its work there
            self.waited = True
        if not keep:
            self.restored, self.copied, self.waited = None, None, False
        return restored


class PlannedOffload:
    """What a plan's offload holds aside (:func:`planned_offload`)."""

    def __init__(self):
        self.host = 0
        """Bytes packed to host memory so far."""
        self.ahead = 0
        """Bytes prefetching would hold on the device now and the simulation does not (yet): inputs of the region
        backward reaches next, not restored yet."""


class _Planned:
    """A plan's stand-in for a host copy: the tensor's metadata; restoring it allocates it again."""

    def __init__(self, t: torch.Tensor, plan: PlannedOffload):
        self.meta = (t.size(), t.stride(), t.dtype, t.device)
        self.nbytes = t.untyped_storage().nbytes()
        self.plan, self.early = plan, False
        self.restored: torch.Tensor | None = None
        plan.host += self.nbytes

    def hold_ahead(self) -> None:
        """Prefetching would bring it back now: count it aside until it is restored."""
        if self.restored is None and not self.early:
            self.early = True
            self.plan.ahead += self.nbytes

    def prefetch(self) -> None:
        if self.restored is None:
            size, stride, dtype, device = self.meta
            self.restored = torch.empty_strided(size, stride, dtype=dtype, device=device)
            if self.early:
                self.plan.ahead -= self.nbytes

    def restore(self) -> torch.Tensor:
        self.prefetch()
        return self.restored


class _Region:
    """One offloaded checkpoint call: the copies of its inputs, and (weakly) the region forward ran before it."""

    def __init__(self, previous: _Region | None, prefetch: bool):
        self.previous = weakref.ref(previous) if previous is not None else None
        self.prefetch = prefetch
        self.copies: list = []
        self.started = False

    def first_use(self) -> None:
        """Backward reached this region: with prefetch, start bringing back the previous region's inputs (a plan
        counts them aside, prefetch or not)."""
        if self.started:
            return
        self.started = True
        previous = self.previous() if self.previous is not None else None
        for copy in previous.copies if previous is not None else ():
            if isinstance(copy, _Planned):
                copy.hold_ahead()
            elif self.prefetch:
                copy.prefetch()


class _Saved:
    """What the hooks save for one region input: its copy, and the region that saved it."""

    def __init__(self, copy, region: _Region):
        self.copy, self.region = copy, region


_copied: dict[int, tuple[weakref.ref, HostCopy | _Planned]] = {}
"""id of a tensor copied during a forward -> (a weak reference to it, its copy)."""

_last: weakref.ref | None = None
"""The region forward ran last (weakly)."""

_planning: PlannedOffload | None = None
"""Under :func:`planned_offload`: what the plan's offload holds aside."""


@contextlib.contextmanager
def planned_offload():
    """Model offload on the device a plan stands for (see the module docstring); yields the
    :class:`PlannedOffload` it counts in."""
    global _planning
    outer, _planning = _planning, PlannedOffload()
    try:
        yield _planning
    finally:
        _planning = outer


def _stays(t: torch.Tensor) -> bool:
    """Whether a saved tensor stays where it is: a parameter, or already in host memory (on the device a plan
    stands for, nothing is in host memory)."""
    return (t.is_leaf and t.requires_grad) or (t.device.type == "cpu" and _planning is None)


def _copy_of(t: torch.Tensor) -> HostCopy | _Planned:
    """``t``'s host copy, made once per tensor."""
    entry = _copied.get(id(t))
    if entry is not None and entry[0]() is t:
        return entry[1]
    copy = HostCopy(t) if _planning is None else _Planned(t, _planning)
    _copied[id(t)] = (weakref.ref(t, lambda _, key=id(t): _copied.pop(key, None)), copy)
    return copy


def _hooks(region: _Region):
    def pack(t: torch.Tensor):
        if _stays(t):
            return t
        copy = _copy_of(t)
        region.copies.append(copy)
        return _Saved(copy, region)

    def unpack(saved):
        if not isinstance(saved, _Saved):
            return saved
        saved.region.first_use()
        return saved.copy.restore()

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def offloaded_checkpoint(body, *args, prefetch: bool = True, **kwargs):
    """``tag_activation_checkpoint(body, *args, **kwargs)`` with the region's inputs kept in host memory until
    backward; ``prefetch``: backward's first use of them starts bringing back the previous region's (see the
    module docstring)."""
    global _last
    region = _Region(_last() if _last is not None else None, prefetch)
    _last = weakref.ref(region)
    with _hooks(region):
        return _CHECKPOINT(body, *args, **kwargs)
