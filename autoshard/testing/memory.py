"""Peak memory of a block of code, measured by the operating system (Linux, CPU tensors).

    with peak_memory() as m:
        out = fn(x); out.sum().backward()
    m.peak_bytes          # peak resident memory during the block, above what was resident at entry

The kernel's high-water mark (``VmHWM``) is reset at entry (``/proc/self/clear_refs``), so the figure
covers exactly the block. Large tensors are ``mmap``-ed by the C allocator and returned to the system
when freed, so resident memory follows live tensors closely; run with ``MALLOC_MMAP_THRESHOLD_=65536``
(as the benchmarks and rank workers here do) so that stays true after many frees. For CUDA tensors
use ``torch.cuda.max_memory_allocated`` instead.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Iterator

__all__ = ["peak_memory", "PeakMemory", "LOW_MMAP_THRESHOLD_ENV"]

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
