"""Which implementation runs a block: the Triton kernels or the torch path.

``kernels="torch"`` forces the torch path, ``"triton"`` forces the Triton kernels
(:mod:`autoshard.kernels.attention`; on CPU only under ``TRITON_INTERPRET=1``; inputs they cannot serve
raise their clear error), ``"auto"`` picks Triton when the tensors are on a CUDA device, the kernels
import and they serve the block's dtype and head dim (float16 / bfloat16 / float32, head dim up to
``MAX_HEAD_DIM``), else torch -- so a float64 model or a 512-wide head runs on the torch path instead of
failing. A forced ``"triton"`` with a dtype the kernels do not compute in fails up front
(:func:`check_triton_dtype`, from the op's local checks: every rank, before any communication), naming
the fix.

The kernels are imported with this module (importing autoshard imports Triton anyway, through
``torch._dynamo``), and the local primitive and the merge call them from here. Triton is a dependency on Linux
only: where it is absent, ``"auto"`` takes the torch path everywhere and a forced ``"triton"`` raises Triton's
``ImportError`` when a block would run (:func:`choose_triton`).
"""

from __future__ import annotations

import torch

from .call import AttentionInputError

try:
    from ...kernels.attention import (_SUPPORTED_DTYPES, MAX_HEAD_DIM, triton_attention_backward,
                                      triton_attention_forward)
    from ...kernels.merge import triton_merge
    _TRITON_MISSING: ImportError | None = None
except ImportError as missing:  # no Triton on this platform: choose_triton never selects the kernels
    _TRITON_MISSING = missing
    triton_attention_forward = triton_attention_backward = triton_merge = None

__all__ = ["KERNELS", "use_triton", "choose_triton", "check_triton_dtype", "triton_attention_forward",
           "triton_attention_backward", "triton_merge"]

KERNELS = ("auto", "torch", "triton")


def use_triton(kernels: str, x: torch.Tensor) -> bool:
    """True when ``kernels`` selects the Triton kernels for a block whose tensors are like ``x`` ([B, H, S, D])."""
    return choose_triton(kernels, x.device.type, x.dtype, x.size(-1))


def choose_triton(kernels: str, device_type: str, dtype: torch.dtype, head_dim: int) -> bool:
    """The decision of :func:`use_triton` from the block's device type, dtype and head dim."""
    if kernels not in KERNELS:
        raise ValueError(f"autoshard.attention: kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels == "triton" and _TRITON_MISSING is not None:
        raise _TRITON_MISSING
    if kernels != "auto":
        return kernels == "triton"
    if device_type != "cuda" or _TRITON_MISSING is not None:
        return False
    return dtype in _SUPPORTED_DTYPES and 1 <= head_dim <= MAX_HEAD_DIM


def check_triton_dtype(kernels: str, x: torch.Tensor) -> None:
    """With ``kernels="triton"``: raise :class:`AttentionInputError` when the kernels cannot compute in ``x``'s
    dtype (float16, bfloat16 and float32 only; autocast's dtypes are all served)."""
    if kernels != "triton" or _TRITON_MISSING is not None:  # without Triton, choose_triton raises its error
        return
    if x.dtype not in _SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in _SUPPORTED_DTYPES)
        raise AttentionInputError(
            f"autoshard.attention: kernels='triton' computes in {names}, but the attention's inputs are {x.dtype}; "
            f"pass kernels='auto' (Triton where it serves the dtype, the torch path elsewhere) or kernels='torch', "
            f"or cast the model to one of those dtypes (or run it under torch.autocast)")
