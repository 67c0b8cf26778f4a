"""Which implementation runs a block: the Triton kernels or the torch path.

``kernels="torch"`` forces the torch path, ``"triton"`` forces the Triton kernels
(:mod:`autoshard.kernels.attention`; on CPU only under ``TRITON_INTERPRET=1``), ``"auto"`` picks Triton
when the tensors are on a CUDA device and the kernels import, else torch. The kernels module is
imported lazily, so the runtime works where Triton is absent.
"""

from __future__ import annotations

import torch

__all__ = ["KERNELS", "use_triton"]

KERNELS = ("auto", "torch", "triton")


def use_triton(kernels: str, x: torch.Tensor) -> bool:
    """True when ``kernels`` selects the Triton kernels for tensors like ``x``."""
    if kernels == "triton":
        return True
    if kernels == "auto" and x.is_cuda:
        try:
            import autoshard.kernels.attention  # noqa: F401
        except ImportError:
            return False
        return True
    if kernels not in KERNELS:
        raise ValueError(f"autoshard.attention: kernels must be one of {KERNELS}, got {kernels!r}")
    return False
