"""A 2-d convolution over a token sequence that is a grid: ``autoshard::grid_conv``.

Image and video transformers convolve their tokens as an image inside a block -- Sana's Mix-FFN, PVT's and
SegFormer's depth-wise ``DWConv``::

    grid = tokens.unflatten(1, (H, W)).permute(0, 3, 1, 2)     # [B, C, H, W]
    out = conv2d(silu(conv2d(grid, w1)), w2, padding=1, groups=C)
    tokens = out.flatten(2).transpose(1, 2)                  # [B, H*W, C]

The tokens are the grid's cells in row-major order, so each of these convolutions is a function of the token
sequence itself. ``grid_conv(x, weight, bias, height, width, padding, dilation, groups)`` takes ``x`` as
``[B, C, N]`` (or ``[C, N]``), ``N = height * width``, and returns the output's cells in the same order,
``[B, C_out, N]``: ``conv2d`` on ``x`` viewed as the grid, flattened back. The ``grid`` pass
(:mod:`autoshard.passes.grid`) writes a block's grid in this form, so its sequence is never cut into two dims;
the convolution rule (:mod:`autoshard.passes.rules.conv`) runs it on a rank's tokens with the rows around them.
Only convolutions that keep the grid's size take this form: stride 1, padding ``dilation * (kernel - 1) / 2``
on both dims. Its backward is ``conv2d``'s (``aten.convolution_backward``) on the same views.
"""

from __future__ import annotations

from typing import Optional

import math

import torch
import torch.nn.functional as F

from .op_info import Work, declare

__all__ = ["grid_conv"]


def _batched(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 3 else x.unsqueeze(0)


@torch.library.custom_op("autoshard::grid_conv", mutates_args=())
def grid_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], height: int, width: int,
              padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    """``conv2d`` (stride 1) of ``x`` (``[B, C, height * width]`` or ``[C, height * width]``) viewed as the
    ``height x width`` grid, flattened back to the cells' order."""
    grid = x.unflatten(-1, (height, width))
    return F.conv2d(grid, weight, bias, 1, padding, dilation, groups).flatten(-2)


@grid_conv.register_fake
def _(x, weight, bias, height, width, padding, dilation, groups):
    return x.new_empty((*x.shape[:-2], weight.shape[0], x.shape[-1]))


def _setup(ctx, inputs, output):
    x, weight, bias, height, width, padding, dilation, groups = inputs
    ctx.save_for_backward(x, weight)
    ctx.config = (height, width, padding, dilation, groups, bias is not None, x.dim())


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    height, width, padding, dilation, groups, has_bias, ndim = ctx.config
    grid = _batched(x).unflatten(-1, (height, width))
    grad_grid = _batched(grad).unflatten(-1, (height, width))
    gx, gw, gb = torch.ops.aten.convolution_backward(
        grad_grid, grid, weight, [weight.shape[0]] if has_bias else None, [1, 1], padding, dilation, False, [0, 0],
        groups, [ctx.needs_input_grad[0], ctx.needs_input_grad[1], has_bias and ctx.needs_input_grad[2]])
    if gx is not None:
        gx = gx.flatten(-2)
        gx = gx if ndim == 3 else gx.squeeze(0)
    return gx, gw, gb, None, None, None, None, None


grid_conv.register_autograd(_backward, setup_context=_setup)


def _work(a) -> Work:
    """A convolution's multiply-adds: every output cell, every output channel, a kernel over its group's inputs."""
    weight, x = a["weight"], a["x"]
    cells = x.shape[-1] * (x.shape[0] if x.dim() == 3 else 1)
    return Work(flops=2 * cells * math.prod(weight.shape), dtype=x.dtype)


declare(torch.ops.autoshard.grid_conv.default, flops=_work)
