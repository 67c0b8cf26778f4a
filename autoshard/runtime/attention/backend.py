"""Which implementation runs a block: the Triton kernels or the torch path.

``kernels="torch"`` forces the torch path, ``"triton"`` forces the Triton kernels
(:mod:`autoshard.kernels.attention`; on CPU only under ``TRITON_INTERPRET=1``; inputs they cannot serve
raise their clear error), ``"auto"`` picks Triton when the tensors are on a CUDA device, the kernels
import and they serve the block's dtype and head dim (float16 / bfloat16 / float32, head dim up to
``MAX_HEAD_DIM``), else torch -- so a float64 model or a 512-wide head runs on the torch path instead of
failing. The kernels module is imported lazily, so the runtime works where Triton is absent.
"""

from __future__ import annotations

import torch

__all__ = ["KERNELS", "use_triton", "choose_triton"]

KERNELS = ("auto", "torch", "triton")


def use_triton(kernels: str, x: torch.Tensor) -> bool:
    """True when ``kernels`` selects the Triton kernels for a block whose tensors are like ``x`` ([B, H, S, D])."""
    return choose_triton(kernels, x.device.type, x.dtype, x.size(-1))


def choose_triton(kernels: str, device_type: str, dtype: torch.dtype, head_dim: int) -> bool:
    """The decision of :func:`use_triton` from the block's device type, dtype and head dim."""
    if kernels not in KERNELS:
        raise ValueError(f"autoshard.attention: kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels != "auto":
        return kernels == "triton"
    if device_type != "cuda":
        return False
    try:
        from autoshard.kernels.attention import _SUPPORTED_DTYPES, MAX_HEAD_DIM
    except ImportError:
        return False
    return dtype in _SUPPORTED_DTYPES and 1 <= head_dim <= MAX_HEAD_DIM
