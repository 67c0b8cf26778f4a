"""The memory simulator: what a per-rank graph holds while it runs forward and backward, without running it.

Memory per rank is the peak of a simulated step, not a sum of worst cases. Each per-rank graph runs forward and
backward on fake tensors under a dispatch mode that follows every storage from the op that makes it to the moment
the last reference dies (:class:`LiveBytes`: what a caching-free allocator holds -- the CPU's resident set, a
GPU's allocated bytes). What autograd saves, the gradients as they accumulate, the gradients of the activations,
what the caller holds (the outputs) and the temporaries of every op are all in it, at the moments they exist
(:func:`graph_memory` runs one graph and sorts its peaks by kind, :class:`GraphMemory`):

* activation checkpointing (``tag_activation_checkpoint``, non-reentrant): forward keeps the regions' inputs (the
  checkpoint holds them) and nothing inside; backward reruns one region at a time, so the peak is the kept inputs
  + the largest region's recomputed activations + its backward's gradients -- the simulation reruns the regions
  as the run does;
* ops whose fake implementation allocates only their outputs add their working set while they run, as each op
  declares it in the op registry (:func:`~autoshard.runtime.op_info.working_set`: the chunked LM head + loss holds
  a chunk's ``[tokens / chunks, V]`` values, :func:`~autoshard.runtime.chunked_loss.working_set_bytes`; a
  distributed attention its strategy's gathered or head-split copies and float32 accumulators,
  :attr:`~autoshard.runtime.attention.base.Strategy.working_set`);
* backward starts from what a training step differentiates: a graph that returns a loss (a differentiable
  scalar) is differentiated from its losses alone -- the logits, a KV cache and hidden states returned beside it
  are held, not differentiated (``loss.backward()``); a graph without one (a layer of several graphs) from every
  differentiable output, with the caller's gradient of each.

How the graphs of a step add up (graph ``g``'s forward runs on top of what the graphs before it keep, its
backward on top of that and the gradients of the graphs after it) is :func:`autoshard.planner.fsdp.memory_estimate`.
The same fake run times every op (:class:`~autoshard.step_time.OpTimer`). A decode plan follows its step with
:class:`LiveBytes` too (:mod:`autoshard.planner.decode`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..hardware import HardwareProfile
from ..runtime.offload import PlannedOffload, planned_offload
from ..runtime.op_info import working_set
from ..step_time import OpTimer, run_timed

__all__ = ["Peak", "GraphMemory", "LiveBytes", "graph_memory"]


@dataclass(kw_only=True)
class Peak:
    """One graph's peak in one phase, above the graph's inputs, by kind (as in
    :class:`~autoshard.planner.result.MemoryEstimate`)."""

    saved: int = 0
    """Storages autograd saved in forward (outside checkpointed regions; the regions' inputs)."""
    kv_cache: int = 0
    """The keys and values of a returned KV cache, not saved."""
    outputs: int = 0
    """The graph's other outputs, not saved."""
    gradients: int = 0
    """The parameters' gradients."""
    transient: int = 0
    """The rest, and the working set of the op that runs."""
    op: str = ""
    """The op that ran at the peak."""

    @property
    def extra(self) -> int:
        """All of it."""
        return self.saved + self.kv_cache + self.outputs + self.gradients + self.transient


@dataclass(kw_only=True)
class GraphMemory:
    """What one per-rank graph holds when it runs forward and backward alone (:func:`graph_memory`)."""

    parameters: dict[int, tuple[str, torch.Tensor]]
    """id of the parameter (the same object in every graph that takes it) -> (its placeholder's name, the
    parameter)."""
    gradients: set[int]
    """The ids of the parameters it makes gradients for."""
    held: int
    """Bytes its forward leaves alive above its inputs (saved for backward, outputs)."""
    held_cache: int
    """Of ``held``: a returned KV cache's keys and values, not saved."""
    forward: Peak
    backward: Peak
    local: int
    """This rank's tokens (the per-position scale of the activation terms)."""
    host: int = 0
    """Bytes of checkpointed regions' inputs offloaded to host memory (``offload``)."""
    host_regions: tuple[int, ...] = ()
    """Of ``host``: what each offloaded region's call added, in forward's order."""
    stopped: bool = False
    """Whether the simulation stopped early, its live bytes past the cap it was given: the peaks are those reached
    by then (the memory policy's lower bound of an option that does not fit)."""
    prefetched: bool = False
    """Whether backward prefetches them a region early (``offload_prefetch``): ``forward`` and ``backward`` then
    hold the prefetched region."""
    with_prefetch: tuple[Peak, Peak] | None = None
    """With offload: the forward and backward peaks with prefetch (``forward`` and ``backward`` when
    ``prefetched``)."""
    timer: OpTimer | None = None
    """The time of its ops."""


class LiveBytes(TorchDispatchMode):
    """Follows every storage the ops make from their call to the death of its last reference (a weak reference's
    callback), and the peak of their sum: after each op (its inputs and outputs both alive) plus the op's working
    set (:func:`~autoshard.runtime.op_info.working_set`). At each new peak the live storages are kept, to be sorted
    by kind afterwards. With ``offload``, a second peak adds what prefetching would hold
    (``offload.prefetched``, counted as working set)."""

    def __init__(self, offload: PlannedOffload | None = None):
        super().__init__()
        self.offload = offload
        self.cap: int | None = None
        """Live bytes past which the simulation stops (:class:`_PastCap`), or None."""
        self.live: dict[int, tuple[int, int]] = {}  # storage address -> (serial, bytes)
        self.refs: dict[int, weakref.ref] = {}
        self.serial = 0
        self.total = 0
        self.phase = "forward"
        self.peaks: dict[str, tuple[int, dict[int, int], int, str]] = {}  # phase -> (bytes, serials, extra, op)
        self.peaks_prefetched: dict[str, tuple[int, dict[int, int], int, str]] = {}  # the same with prefetch

    def track(self, t: torch.Tensor) -> int:
        """Follow ``t``'s storage (once); returns its serial (addresses are reused, serials are not)."""
        st = t.untyped_storage()
        key = st._cdata
        if key not in self.live:
            self.serial += 1
            self.live[key] = (self.serial, st.nbytes())
            self.total += st.nbytes()

            def gone(_, key=key, serial=self.serial):
                if self.live.get(key, (None,))[0] == serial:
                    self.total -= self.live.pop(key)[1]
                    self.refs.pop(key, None)
            self.refs[key] = weakref.ref(st, gone)
        return self.live[key][0]

    def serial_of(self, t: torch.Tensor) -> int | None:
        """The serial of ``t``'s storage; None when it is not followed (a constant)."""
        entry = self.live.get(t.untyped_storage()._cdata)
        return None if entry is None else entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        extra = working_set(func, args, kwargs)
        snapshot = None
        both = ((self.peaks, extra),) + (((self.peaks_prefetched, extra + self.offload.prefetched),) if self.offload else ())
        for peaks, held in both:
            if self.total + held > peaks.get(self.phase, (-1,))[0]:
                snapshot = snapshot or dict(self.live.values())
                peaks[self.phase] = (self.total + held, snapshot, held, str(func))
        if self.cap is not None and self.total + extra > self.cap:
            raise _PastCap()
        return out


class _PastCap(Exception):
    """The simulation's live bytes passed its cap."""


def _fake_leaf(mode: FakeTensorMode, x: torch.Tensor) -> torch.Tensor:
    """``x`` in ``mode`` as a leaf: an input that an earlier graph computed (past a graph break) arrives with a
    gradient history that ends here -- backward stops at it, as it stops at the graph's boundary."""
    fake = mode.from_tensor(x)
    return fake.detach().requires_grad_() if fake.grad_fn is not None else fake


def graph_memory(compiled, example_inputs: list, world: int, root_length: int, topology: HardwareProfile,
            offload: bool = False, prefetch: bool = False, cap: int | None = None) -> GraphMemory:
    """Run the per-rank graph forward and backward on fake tensors (from its losses, or the caller's gradient of
    every differentiable output: ones; see the module docstring) and follow its live bytes and the time of its ops
    on ``topology`` (:class:`~autoshard.step_time.OpTimer`). ``cap``: stop once the live bytes above the inputs
    pass it (:attr:`GraphMemory.stopped`)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [_fake_leaf(mode, x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    placeholders = [n.name for n in compiled.graph_module.graph.nodes if n.op == "placeholder"]
    parameters = {id(orig): (name, x) for name, x, orig in zip(placeholders, inputs, example_inputs)
                  if isinstance(orig, torch.nn.Parameter)}
    timer = OpTimer(topology, world)
    packed: set[int] = set()

    def pack(t):
        serial = live.serial_of(t)
        if serial is not None:
            packed.add(serial)
        return t

    with planned_offload() as host, mode, LiveBytes(host if offload else None) as live, timer:
        for x in inputs:
            if isinstance(x, torch.Tensor):
                live.track(x)
        inputs_serials, base = {serial for serial, _ in live.live.values()}, live.total
        live.cap = None if cap is None else base + cap
        stopped, unread, output_serials, cache, held = False, set(), set(), {}, 0
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                results = run_timed(compiled.graph_module, inputs, timer)
                outputs = [t for t in tree_leaves(results) if isinstance(t, torch.Tensor)]
            # lazy logits (the head's input in their place): nobody reads them, so no gradient comes through them;
            # with offload the head's input waits in host memory (the device's copy dies with the output)
            unread = {id(results[i]) for i in compiled.lazy_outputs or ()}
            if offload and compiled.lazy_outputs:
                results = list(results)
                for i in compiled.lazy_outputs:
                    host.host += results[i].numel() * results[i].element_size()
                    results[i] = None
                outputs = [t for t in tree_leaves(results) if isinstance(t, torch.Tensor)]
            output_serials = {live.serial_of(t) for t in outputs}
            cache = {live.serial_of(results[i]): results[i].untyped_storage().nbytes()  # a returned KV cache's
                     for i in compiled.cache_outputs or ()}
            held = live.total - base
            live.phase = timer.phase = "backward"
            differentiable = [t for t in outputs if t.requires_grad and id(t) not in unread]
            losses = [t for t in differentiable if t.dim() == 0]
            differentiable = losses or differentiable
            if differentiable:
                torch.autograd.backward(differentiable, [torch.ones_like(t) for t in differentiable])
        except _PastCap:  # the option does not fit: the peaks so far say by how much at least
            stopped = True
        live.cap = None
        grads = {live.serial_of(p.grad) for _, p in parameters.values() if p.grad is not None}

    def peak(peaks: dict, phase: str) -> Peak:
        if phase not in peaks:
            return Peak()
        _, serials, extra, op = peaks[phase]
        kinds = {"saved": 0, "kv_cache": 0, "outputs": 0, "gradients": 0, "transient": extra}
        for serial, nbytes in serials.items():
            if serial in inputs_serials:
                continue
            kind = ("gradients" if serial in grads else "saved" if serial in packed else "kv_cache" if serial in cache
                    else "outputs" if serial in output_serials else "transient")
            kinds[kind] += nbytes
        return Peak(**kinds, op=op)

    peaks = live.peaks_prefetched if offload and prefetch else live.peaks
    return GraphMemory(parameters=parameters, gradients={i for i, (_, p) in parameters.items() if p.grad is not None},
                        held=held, held_cache=sum(n for serial, n in cache.items() if serial not in packed),
                        forward=peak(peaks, "forward"), backward=peak(peaks, "backward"),
                        local=-(-root_length // world), host=host.host, host_regions=tuple(host.regions),
                        stopped=stopped,
                        prefetched=offload and prefetch,
                        with_prefetch=(peak(live.peaks_prefetched, "forward"),
                                       peak(live.peaks_prefetched, "backward")) if offload else None,
                        timer=timer)
