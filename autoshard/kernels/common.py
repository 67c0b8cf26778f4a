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
           "aligned_rows", "aligned_empty", "check_like"]

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


ROW_ALIGN_BYTES = 16


def _row_elements(dtype: torch.dtype) -> int:
    return max(1, ROW_ALIGN_BYTES // dtype.itemsize)


def aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels read it: unit stride in its last dim and every other stride a multiple of 16 bytes.

    Compiled for sm_90 (Triton 3.6, seen on an H200), the tile loads of bf16 / fp16 rows that start off 16-byte
    boundaries (a head dim of 12) read wrong values or fault, pipelined or not. Such a tensor is copied into rows padded
    to 16 bytes and returned as the view of its columns; the kernels mask the padding, so it is never read.
    Head dims that are multiples of 8 (every production model) are passed through untouched."""
    per_row = _row_elements(x.dtype)
    if x.stride(-1) == 1 and all(stride % per_row == 0 for stride, size in zip(x.stride()[:-1], x.shape[:-1])
                                 if size > 1):
        return x
    out = aligned_empty(x.shape, x.dtype, x.device)
    out.copy_(x)
    return out


def aligned_empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized tensor of ``shape`` whose rows start on 16-byte boundaries (see :func:`aligned_rows`):
    contiguous when the last dim allows it, else a view of the first ``shape[-1]`` columns of padded rows."""
    per_row = _row_elements(dtype)
    width = -(-shape[-1] // per_row) * per_row
    padded = torch.empty(*shape[:-1], width, dtype=dtype, device=device)
    return padded if width == shape[-1] else padded[..., :shape[-1]]


def check_like(name: str, x: torch.Tensor, shape, device) -> None:
    """Raise unless ``x`` is a tensor of ``shape`` on ``device``."""
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape) or x.device != device:
        got = f"{tuple(x.shape)} on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a tensor of shape {tuple(shape)} on {device}, got {got}")
