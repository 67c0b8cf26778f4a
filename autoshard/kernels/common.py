"""What the Triton kernels share: whether Triton interprets them, the device check, tile loads and stores, and
the block sizes of the head dim and of the row-wise kernels.

Triton decides between compiling and interpreting a ``@triton.jit`` function when it is decorated, i.e. when
the kernel modules are imported: ``TRITON_INTERPRET=1`` must be set before (the kernel tests' conftest does).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["INTERPRET", "MIN_BLOCK_D", "triton_available", "load_tile", "store_tile", "padded_dim", "row_block",
           "last_dim_contiguous", "check_like"]

MIN_BLOCK_D = 16  # tl.dot needs every dimension >= 16


def interpreter_requested() -> bool:
    """Whether Triton interprets (rather than compiles) the kernels: it reads TRITON_INTERPRET when a function is
    decorated, i.e. when the kernel modules are imported."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


INTERPRET = interpreter_requested()


def triton_available(device) -> bool:
    """Whether the kernels can run on ``device``: a CUDA device (with CUDA available), or the CPU when
    ``TRITON_INTERPRET=1`` was set before they were imported."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and INTERPRET


@triton.jit
def load_tile(ptrs, rows, n_rows, cols, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Load a [rows, BLOCK_D] tile, zero-filling rows >= n_rows (when CHECK_ROWS) and padded columns."""
    if CHECK_ROWS:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def store_tile(ptrs, value, rows, n_rows, cols, HEAD_DIM: tl.constexpr):
    """Store the rows < n_rows and columns < HEAD_DIM of a tile, cast to the destination dtype."""
    tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM))


def padded_dim(head_dim: int) -> int:
    """Head dim padded to a power of two >= 16 (tl.dot's minimum); the padding is masked."""
    return max(triton.next_power_of_2(head_dim), MIN_BLOCK_D)


def row_block(width: int) -> int:
    """Rows per program of the row-wise kernels (delta, merge) over ``width`` columns: about 4k elements per tile."""
    return 16 if INTERPRET else max(16, min(128, 4096 // width))


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` with unit stride in its last dim (the kernels' tile loads assume it)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def check_like(name: str, x: torch.Tensor, shape, device) -> None:
    """Raise unless ``x`` is a tensor of ``shape`` on ``device``."""
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape) or x.device != device:
        got = f"{tuple(x.shape)} on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a tensor of shape {tuple(shape)} on {device}, got {got}")
