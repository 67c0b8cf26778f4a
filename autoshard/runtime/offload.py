"""Checkpointed regions whose inputs wait for backward in host memory (``BackendConfig.offload``).

With every layer checkpointed, what a rank still holds between forward and backward is the layers' inputs:
``layers x tokens x hidden`` (Llama-8B at 512k tokens per rank: 32 x 4 GiB). ALST's answer, taken here: keep
them in host memory, and bring each back when backward reaches its layer.

A checkpoint saves its region's inputs once, outside its own saved-tensor hooks (``torch.utils.checkpoint``'s
``_NoopSaveInputs``); everything inside the region is recomputed. So :func:`offloaded_checkpoint` runs the
region's ``tag_activation_checkpoint`` under saved-tensor hooks of its own, and they see exactly the region's
inputs:

* a leaf that requires grad (a parameter) or a view of one, or a tensor already in host memory, stays as it is;
* anything else is copied to host memory (pinned) and comes back for backward -- as itself when someone else still
  holds it then (a buffer, an input the caller keeps: copying it back would only duplicate it on the device).

A value several regions take (the rotary tables every layer reads) is copied once: the hooks remember the
tensors they copied by identity (a weak reference checks the entry is still that tensor, its version that it was
not written since) and hand out the same host copy. Inside the region, the checkpoint's own hooks take precedence,
so nothing else is moved. A saved input written in place after it was saved raises when backward needs it, as
autograd's own check would (the copy to the host may have read either value).

**Prefetch.** On CUDA the copies run on a stream of their own (one per device), so they run beside the compute
stream instead of waiting in it: forward's copy of a layer's input to the host runs while the layer computes (the
allocator is told the copy stream reads the input, so its memory is not reused before the copy ends). With
``prefetch`` (``BackendConfig.offload_prefetch``), backward's first use of a region's inputs starts their copy back
and then prefetches the inputs of the region forward ran before it -- the region backward reaches next -- so that
copy runs during this region's recomputation and backward. Copies back are allocated from the compute stream's memory
(the copy stream waits for the compute stream's work queued before it) so that the compute stream reuses it. The
price is one more region's inputs on the device while a region runs backward (a layer's input: 6 GiB per rank for
Llama-8B at 6M tokens on 8 ranks), so it is a lever the memory policy may turn off; without it each region's inputs
come back when backward first uses them, the compute stream waiting for the copy. Each region keeps a weak
reference to the one before it (regions link only while the previous one's backward has not started), so nothing
outlives the backward that needs it. Two forwards before their backwards link too: the second's first region
prefetches the first's last (memory, not a wrong value).

**Sparing the host.** Host memory has a budget too (Llama-8B at 8M tokens on 8 ranks: 32 layer inputs of 8 GiB).
The outline pass keeps the last region's inputs on the device (a plain checkpoint: backward starts with them) and,
for every other region before it that the config spares (``BackendConfig.offload_spared``), calls this with
``rebuild``: an input that is the previous offloaded region's output gets no copy at all (:class:`_Rebuilt`) --
when backward first uses it, the previous region's inputs come back (their device copies die after), its body runs
without autograd, and its output is the value: one more forward of that region, no host bytes. Every call keeps its
body, its arguments as saved and its outputs (weakly) for that.

A plan runs the graph on fake CPU tensors, where every tensor would "stay": under :func:`planned_offload`
the hooks model the device instead -- a packed input is dropped (its bytes counted as host memory) and
restoring it allocates it anew, as the copy back does -- so the plan's peak is the device's. A plan does not
prefetch: it counts aside the bytes prefetching would hold (:attr:`PlannedOffload.prefetched`, from a region's
first use in backward until the previous region's inputs are restored), so one simulation gives the peak both with
and without prefetch (the memory policy weighs both from one plan). A plan runs each graph alone: regions
linked across a graph break (per-layer graphs) are not.

The hooks run only in eager execution: the outline pass emits :func:`offloaded_checkpoint` only with the
``"eager"`` inner compiler (the backend refuses ``offload=True`` with another one), since tracing compilers
would trace the copies instead of running them.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.fx
import torch.utils.checkpoint

__all__ = ["offloaded_checkpoint", "checkpoint_eagerly", "eager_checkpoints", "HostCopy", "PlannedOffload",
           "planned_offload"]

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


class _Copy:
    """What a host copy and a plan's stand-in for one share: the tensor it was made from (weakly), at which
    version; the value back on the device (:meth:`restore`)."""

    def __init__(self, t: torch.Tensor):
        self.source, self.version = weakref.ref(t), t._version
        self.restored: torch.Tensor | None = None

    def held(self) -> torch.Tensor | None:
        """The tensor itself while someone else holds it (unwritten since: else an error), or None."""
        t = self.source()
        if t is not None and t._version != self.version:
            raise RuntimeError(
                "autoshard: a tensor an offloaded checkpoint saved for backward (a checkpointed region's input) was "
                "modified by an inplace operation after it was saved; compute a new tensor instead")
        return t

    def prefetch(self) -> None:
        """Start bringing it back (once; nothing to do while it is held)."""
        raise NotImplementedError

    def prefetch_next(self, prefetch: bool) -> None:
        """Backward reached the region after this one's: with ``prefetch``, start bringing it back."""
        if prefetch:
            self.prefetch()

    def restore(self, keep: bool = True) -> torch.Tensor:
        """The tensor back on its device, ready for the compute stream: itself while held, else the copy back
        (made once and kept: regions that share the value share it; ``keep=False``: not kept)."""
        t = self.held()
        if t is not None:
            return t
        self.prefetch()
        restored = self._ready()
        if not keep:
            self.restored = None
        return restored

    def _ready(self) -> torch.Tensor:
        return self.restored


class HostCopy(_Copy):
    """A tensor's copy in host memory and where it came from: a checkpoint's saved input here, the hidden state of
    lazy logits (:mod:`.lazy_linear`). From CUDA: pinned, both copies on the device's copy stream."""

    def __init__(self, t: torch.Tensor):
        super().__init__(t)
        self.device = t.device
        stream = _copy_stream(t.device)
        self.host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=stream is not None)
        self.copied = None  # the copy back's event (CUDA), until the compute stream waits for it
        if stream is None:
            self.host.copy_(t)
            return
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is computed
        with torch.cuda.stream(stream):
            self.host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # t's memory is not reused before the copy ends

    def prefetch(self) -> None:
        if self.restored is not None or self.held() is not None:
            return
        stream = _copy_stream(self.device)
        if stream is None:
            self.restored = self.host.to(self.device)
            return
        current = torch.cuda.current_stream(self.device)
        restored = torch.empty(self.host.size(), dtype=self.host.dtype, device=self.device)  # the compute stream's
        stream.wait_stream(current)  # the memory's previous users are done with it
        with torch.cuda.stream(stream):  # after the copy to the host, which ran on this stream
            restored.copy_(self.host, non_blocking=True)
            self.copied = stream.record_event()
        restored.record_stream(stream)  # freed unused: not reused before the copy ends
        self.restored = restored

    def _ready(self) -> torch.Tensor:
        if self.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied)
            self.copied = None
        return self.restored


class PlannedOffload:
    """What a plan's offload holds aside (:func:`planned_offload`)."""

    def __init__(self):
        self.host = 0
        """Bytes packed to host memory so far."""
        self.prefetched = 0
        """Bytes prefetching would hold on the device now and the simulation does not (yet): inputs of the region
        backward reaches next, not restored yet."""
        self.regions: list[int] = []
        """Bytes each offloaded region's call added to :attr:`host`, in forward's order (what sparing it saves)."""


class _Planned(_Copy):
    """A plan's stand-in for a host copy: the tensor's metadata; restoring it allocates it again."""

    def __init__(self, t: torch.Tensor, plan: PlannedOffload):
        super().__init__(t)
        self.meta = (t.size(), t.stride(), t.dtype, t.device)
        self.nbytes = t.untyped_storage().nbytes()
        self.plan, self.prefetched = plan, False
        plan.host += self.nbytes

    def prefetch_next(self, prefetch: bool) -> None:
        """Prefetching (on or not: a plan weighs both) would bring it back now: count it aside until restored."""
        if self.restored is None and not self.prefetched and self.held() is None:
            self.prefetched = True
            self.plan.prefetched += self.nbytes

    def prefetch(self) -> None:
        if self.restored is not None or self.held() is not None:
            return
        if self.prefetched:  # now allocated in the simulation: no longer aside
            self.plan.prefetched -= self.nbytes
        size, stride, dtype, device = self.meta
        self.restored = torch.empty_strided(size, stride, dtype=dtype, device=device)


class _OffloadedCall:
    """One call of an offloaded checkpoint (a run of its region): the copies of its inputs, and (weakly) the call
    forward ran before it; what a later region needs to rebuild this one's output (its body, its arguments as
    saved, its outputs weakly, the autocast state it ran under)."""

    def __init__(self, previous: _OffloadedCall | None, prefetch: bool):
        self.previous = weakref.ref(previous) if previous is not None and not previous.started else None
        self.prefetch = prefetch
        self.copies: list[_Copy] = []
        self.started = False
        self.body = None
        self.arguments: list = []
        self.outputs: list[weakref.ref | None] = []
        self.autocast: tuple = ()
        self.saved_as: dict[int, _Copy] = {}
        """id of an input tensor -> how it was saved (its copy), while the call runs."""

    def first_use(self) -> None:
        """Backward reached this region: with prefetch, start bringing back its inputs, then the previous region's
        (a plan counts those aside, prefetch or not)."""
        if self.started:
            return
        self.started = True
        previous = self.previous() if self.previous is not None else None
        if self.prefetch and _planning is None:  # its own first: the copy stream runs them in order
            for copy in self.copies:
                copy.prefetch()
        for copy in previous.copies if previous is not None else ():
            copy.prefetch_next(self.prefetch)


class _Rebuilt(_Copy):
    """A region's input that backward computes again from the region before it (``rebuild``): that region's
    inputs come back (for this only: their device copies die after it), its body runs without autograd, and the
    output this region took is the value."""

    def __init__(self, t: torch.Tensor, region: _OffloadedCall, index: int):
        super().__init__(t)
        self.region, self.index = region, index

    def prefetch_next(self, prefetch: bool) -> None:
        """Never ahead: it is computed when backward uses it."""

    def prefetch(self) -> None:
        if self.restored is not None or self.held() is not None:
            return
        region = self.region
        arguments = [a.restore(keep=False) if isinstance(a, _Copy) else a for a in region.arguments]
        device, enabled, dtype = region.autocast
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            self.restored = region.body(*arguments)[self.index]


class _Saved:
    """What the hooks save for one region input: its copy, and the call that saved it."""

    def __init__(self, copy: _Copy, call: _OffloadedCall):
        self.copy, self.call = copy, call


_copied: dict[int, tuple[weakref.ref, _Copy]] = {}
"""id of a tensor copied -> (a weak reference to it, its copy)."""

_last: weakref.ref | None = None
"""The offloaded call forward ran last (weakly)."""

_planning: PlannedOffload | None = None
"""Under :func:`planned_offload`: what the plan's offload holds aside."""

_HOST_DEVICE = "cpu"
"""The device type of host memory (the tests name another, so that CPU tensors move as an accelerator's would)."""


@contextlib.contextmanager
def planned_offload():
    """Model offload on the device a plan stands for (see the module docstring); yields the
    :class:`PlannedOffload` it counts in. The regions a plan runs do not link to the ones running around it."""
    global _planning, _last
    outer = _planning, _last
    _planning, _last = PlannedOffload(), None
    try:
        yield _planning
    finally:
        _planning, _last = outer


def _stays(t: torch.Tensor) -> bool:
    """Whether a saved tensor stays where it is: a parameter or a view of one (a gradient-sync wrapper's: copying
    it would free nothing), or already in host memory (on the device a plan stands for, nothing is in host
    memory)."""
    base = t if t._base is None else t._base
    return (base.is_leaf and base.requires_grad) or (t.device.type == _HOST_DEVICE and _planning is None)


def _copy_of(t: torch.Tensor) -> _Copy:
    """``t``'s host copy, made once per tensor (again once it was written)."""
    entry = _copied.get(id(t))
    if entry is not None and entry[0]() is t and entry[1].version == t._version:
        return entry[1]
    copy = HostCopy(t) if _planning is None else _Planned(t, _planning)
    _copied[id(t)] = (weakref.ref(t, lambda _, key=id(t): _copied.pop(key, None)), copy)
    return copy


def _hooks(call: _OffloadedCall, rebuild: bool):
    source = call.previous() if rebuild and call.previous is not None else None

    def pack(t: torch.Tensor):
        if _stays(t):
            return t
        index = next((i for i, out in enumerate(source.outputs) if out is not None and out() is t), None) \
            if source is not None else None
        copy = _Rebuilt(t, source, index) if index is not None else _copy_of(t)
        call.saved_as[id(t)] = copy
        call.copies.append(copy)
        return _Saved(copy, call)

    def unpack(saved):
        if not isinstance(saved, _Saved):
            return saved
        saved.call.first_use()
        return saved.copy.restore()

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def offloaded_checkpoint(body, *args, prefetch: bool = True, eagerly: bool = False, rebuild: bool = False,
                         **kwargs):
    """``tag_activation_checkpoint(body, *args, **kwargs)`` with the region's inputs kept in host memory until
    backward; ``prefetch``: backward's first use of them prefetches the previous region's (see the module
    docstring); ``rebuild``: an input that is the previous offloaded region's output is not kept at all --
    backward computes it again from that region's inputs; ``eagerly``: run as :func:`checkpoint_eagerly`."""
    global _last
    call = _OffloadedCall(_last() if _last is not None else None, prefetch)
    _last = weakref.ref(call)
    host = _planning.host if _planning is not None else 0
    with _hooks(call, rebuild):
        outputs = (checkpoint_eagerly if eagerly else _CHECKPOINT)(body, *args, **kwargs)
    if _planning is not None:
        _planning.regions.append(_planning.host - host)
    call.body = body  # what a later region's rebuild needs: the inputs as saved (never the device tensors)
    call.arguments = [call.saved_as.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args]
    call.saved_as = {}
    call.outputs = [weakref.ref(t) if isinstance(t, torch.Tensor) else None
                    for t in (outputs if isinstance(outputs, (tuple, list)) else (outputs,))]
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    call.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    return outputs


def checkpoint_eagerly(body, *args, **kwargs):
    """``tag_activation_checkpoint(body, *args, **kwargs)`` in a rank graph that runs as it is (``inner="eager"``):
    ``torch.utils.checkpoint.checkpoint``, non-reentrant. The op's own eager path checkpoints through a
    selective-checkpoint dispatch mode that every op of the region passes through (so that a compiler can tag them):
    beneath it a custom op's implementation runs below the autocast dispatch key, autocast off, and the model's own
    code inside a recurrence op fails where it relies on autocast (transformers' Mamba scan multiplies a bfloat16 by
    a float32 tensor). (Dropout inside a recomputed region draws the same mask either way: measured.)"""
    kwargs.pop("use_reentrant", None)
    return torch.utils.checkpoint.checkpoint(body, *args, use_reentrant=False, **kwargs)


def eager_checkpoints(gm: torch.fx.GraphModule) -> int:
    """Point every ``tag_activation_checkpoint`` call of ``gm`` and of its bodies at :func:`checkpoint_eagerly`, and
    every :func:`offloaded_checkpoint` at its eager form; returns how many."""
    changed = 0
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        before = changed
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target is _CHECKPOINT:
                node.target = checkpoint_eagerly
            elif node.op == "call_function" and node.target is offloaded_checkpoint:
                node.kwargs = {**node.kwargs, "eagerly": True}
            else:
                continue
            changed += 1
        if changed > before:
            module.recompile()
    return changed
