"""Memory of a block of code: its peak, measured by the operating system (Linux, CPU tensors), and the
sequence x sequence values it makes.

    with peak_memory() as m:
        out = fn(x); out.sum().backward()
    m.peak_bytes          # peak resident memory during the block, above what was resident at entry

The kernel's high-water mark (``VmHWM``) is reset at entry (``/proc/self/clear_refs``), so the figure
covers exactly the block. Large tensors are ``mmap``-ed by the C allocator and returned to the system
when freed, so resident memory follows live tensors closely; run with ``MALLOC_MMAP_THRESHOLD_=65536``
(as the benchmarks and rank workers here do) so that stays true after many frees. For CUDA tensors
use ``torch.cuda.max_memory_allocated`` instead.

    with sequence_squares(length=S) as found:
        loss = compiled(ids).loss; loss.backward()
    assert not found      # no tensor with two dims of S or more was made on this rank (an S x S mask or score)

:func:`sequence_squares` sees every op the block runs (compiled graphs run by an eager inner compiler, custom ops'
insides, user code between graphs); tensor subclasses that hold no such data themselves (a ``SplitTensor``'s
global shape, a deferred mask) are not counted: their insides are, where an op makes them.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["peak_memory", "PeakMemory", "LOW_MMAP_THRESHOLD_ENV", "sequence_squares"]

LOW_MMAP_THRESHOLD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""Environment that keeps glibc from caching freed large blocks (pass to workers you measure in)."""


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"{field}:\s+(\d+) kB", fh.read()).group(1)) * 1024


@dataclass
class PeakMemory:
    """Result of :func:`peak_memory`."""

    baseline_bytes: int = 0
    """Resident bytes at entry."""
    peak_bytes: int = 0
    """Peak resident bytes during the block, minus ``baseline_bytes``."""


@contextlib.contextmanager
def peak_memory() -> Iterator[PeakMemory]:
    """Measure the peak resident memory the block adds (see the module docstring)."""
    result = PeakMemory()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    result.baseline_bytes = _status("VmRSS")
    try:
        yield result
    finally:
        result.peak_bytes = max(0, _status("VmHWM") - result.baseline_bytes)


class _SequenceSquares(TorchDispatchMode):
    """Records the ops whose outputs have two dims of ``length`` or more (see the module docstring)."""

    def __init__(self, length: int):
        super().__init__()
        self.length = length
        self.found: list[tuple[str, tuple[int, ...]]] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # dynamo compiles under it instead of running the model eagerly

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if type(t) in (torch.Tensor, torch.nn.Parameter) and sum(int(s) >= self.length for s in t.shape) >= 2:
                self.found.append((str(func.overloadpacket), tuple(t.shape)))
        return out


@contextlib.contextmanager
def sequence_squares(length: int) -> Iterator[list[tuple[str, tuple[int, ...]]]]:
    """The (op, shape) of every tensor with two dims of ``length`` or more the block makes (see the module
    docstring)."""
    mode = _SequenceSquares(length)
    with mode:
        yield mode.found
