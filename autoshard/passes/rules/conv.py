"""Convolutions.

The batch dim passes through a convolution. A 1-d convolution (``conv1d``, input ``[B, C, L]`` or ``[C, L]``)
along a split sequence runs on shards with halos (Whisper-style audio front ends, Conformer / Mamba
convolutions):

* link: with stride 1 output position ``i`` is input position ``i`` when it reads it (``0 <= p <= d*(k-1)``: a
  "same" or a causal convolution keeps its input's layout), else ``i + (k-1)*d//2 - p`` (the kernel's centre), an
  ordinary offset edge, so input and output share a family; a strided convolution maps ``j`` to ``s*j - p``,
  which no offset expresses, so each side is a conditional seed of the other (``seed_along``): the input
  becomes a family of its own, with its own layout, whenever the output is split, and the other way round.
* rewrite: each rank computes the output positions its layout gives it. For every interval ``[a, b)`` of them
  it reads the input window ``[s*a - p, s*(b-1) - p + d*(k-1) + 1)`` -- from a whole input by local slicing
  (free), from a split one with ``autoshard::seq_windows`` (:mod:`~autoshard.runtime.conv_halo`: point to
  point, the halos only; booked forward and backward) -- and convolves it without padding: the window
  carries the zero padding at the sequence's ends. Kernel size, stride, padding (ints, ``"same"``,
  ``"valid"``), dilation and groups are all served; uneven shards and zigzag layouts need nothing special,
  the windows follow from the two layouts.

What is not split is reported: a convolution whose input is split along a dim it mixes (a 2-d or 3-d
convolution's spatial dims, a 1-d one's channels, a merged dim) gathers that input, recorded as a fallback.
A convolution over a whole input whose output is not a sequence (ViT's patch embedding: the sequence starts
after it, at the flattened patches) runs whole on every rank, as before, with nothing gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...placements import REPLICATE, Shard
from ...runtime.conv_halo import encode_windows
from ..ops import shape_of
from ..report import Fallback
from .registry import register
from .pointwise import mapped_args, run_whole, whole_args

__all__: list[str] = []  # the rules register themselves on import; nothing here is called from outside


def _one(value) -> int | None:
    """An int or a one-element tuple/list as an int, else None."""
    if isinstance(value, (tuple, list)):
        return int(value[0]) if len(value) == 1 else None
    return int(value) if isinstance(value, int) else None


@dataclass(frozen=True)
class _Along:
    """A convolution along its input's last dim (the sequence): which input positions an interval of output
    positions reads, and how this rank computes the interval from them."""

    stride: int
    """Output position ``j`` reads from input position ``stride * j`` on."""
    anchor: int
    """With stride 1: the input position ``i + anchor`` that output position ``i`` is linked to."""
    window: Callable[[int, int], tuple[int, int]]
    """``(a, b) -> (lo, hi)``: the input positions output positions ``[a, b)`` read (zeros outside the sequence)."""
    run: Callable[..., fx.Node]
    """``(rw, node, op, piece, a, b, lo, weight, bias)``: output positions ``[a, b)`` from ``piece``, the input
    positions ``[lo, hi)``, with this rank's weight and bias nodes."""


def _along(op) -> _Along | None:
    """How a 1-d convolution (``[B, C, L]`` or ``[C, L]``) or a grid convolution (:mod:`~autoshard.runtime.grid_conv`)
    runs along its input's last dim; None for any other convolution."""
    if "grid" in op.args:
        return _along_grid(op)
    src, weight = op["input"], op["weight"]
    if len(shape_of(weight)) != 3 or len(shape_of(src)) not in (2, 3):
        return None
    kernel, stride, dilation = shape_of(weight)[-1], _one(op["stride"]), _one(op["dilation"])
    padding = op["padding"]
    if padding == "valid":
        left = 0
    elif padding == "same":
        left = dilation * (kernel - 1) // 2 if dilation is not None else None
    else:
        left = _one(padding)
    if None in (stride, dilation, left):
        return None
    reach = dilation * (kernel - 1) + 1

    def run(rw, node, op, piece, a, b, lo, weight, bias):
        return rw.reemit(node, (piece, weight, bias, stride, 0, dilation, op["groups"]), {})
    return _Along(stride, _anchor(kernel, left, dilation), lambda a, b: (a * stride - left, (b - 1) * stride - left
                                                                          + reach), run)


def _along_grid(op) -> _Along:
    """A grid convolution keeps the grid's size (stride 1, padding ``dilation * (kernel - 1) / 2``): output cell ``i``
    is linked to input cell ``i``. Positions ``[a, b)`` are computed from whole rows: rows ``a // W`` to the one
    holding ``b - 1`` with ``padding`` rows around them (rows outside the grid are the zeros of the window), as a
    ``conv2d`` padded along the row only, then cut to ``[a, b)``."""
    width = op["grid"][1]
    (pad_rows, pad_cols), dilation = op["padding"], op["dilation"]

    def window(a, b):
        return (a // width - pad_rows) * width, ((b + width - 1) // width + pad_rows) * width

    def run(rw, node, op, piece, a, b, lo, weight, bias):
        dim = len(shape_of(op["input"])) - 1
        grid = rw.call(torch.unflatten, piece, dim, (-1, width))
        out = rw.call(F.conv2d, grid, weight, bias, 1, [0, pad_cols], dilation, op["groups"])
        return rw.call(torch.narrow, rw.call(torch.flatten, out, dim), dim, a - lo - pad_rows * width, b - a)
    return _Along(1, 0, window, run)


def _anchor(kernel: int, left: int, dilation: int) -> int:
    """Which input position a stride-1 output position ``i`` is linked to, as ``i + anchor``: ``i`` itself whenever
    ``i`` is one of the positions it reads (a "same" convolution, and a causal one -- padded by ``d*(k-1)`` and cut
    back to the input's length, as Mamba's and Gated DeltaNet's are), so that output keeps the input's layout and
    the layers after it need no realignment; else the kernel's centre."""
    if 0 <= left <= dilation * (kernel - 1) and left % dilation == 0:
        return 0
    return dilation * (kernel - 1) // 2 - left


def link_conv(ctx, node, op):
    src = op["input"]
    if len(shape_of(src)) == len(shape_of(op["weight"])) - (1 if "grid" in op.args else 0):  # batched
        ctx.link_dims(node, 0, src, 0)
    along = _along(op)
    if along is None:
        return
    dim = len(shape_of(src)) - 1
    if along.stride == 1:
        ctx.link_dims(node, dim, src, dim, along.anchor)
    else:
        ctx.seed_along((src, dim, 0), (node, dim, 0))
        ctx.seed_along((node, dim, 0), (src, dim, 0))


def rewrite_conv(rw, node, op):
    out = rw.out_shard(node)
    src = op["input"]
    along = _along(op)
    if out is not None and out.dim == 0:  # the sequence rides the batch dim: position by position
        convert = lambda n: rw.input(n, out) if n is src else rw.input(n, REPLICATE, partial_grad=True)  # noqa: E731
        rw.done(node, rw.reemit(node, *mapped_args(node, convert)), out)
        return
    have = rw.placement(src)
    spatial = len(shape_of(src)) - 1
    if along is None or out is None or out.factors or out.dim != spatial or (
            isinstance(have, Shard) and (have.dim != spatial or have.factors)):
        run_whole(rw, node, _unsplit_reason(op, along, have, spatial))
        return
    if not all(out.layout.local_intervals(r) for r in range(rw.world)):
        reason = "a rank holds none of the convolution's output positions"
        whole = rw.reemit(node, *whole_args(rw, node, reason))
        if not isinstance(have, Shard):  # nothing was gathered (that is recorded): the convolution itself ran whole
            rw.report.fallbacks.append(Fallback(node.name, str(node.target), reason))
        rw.done(node, rw.shard_value(node, whole, out), out)
        return
    rw.done(node, _split_conv(rw, node, op, along, out, have), out)


def _unsplit_reason(op, along, have, spatial: int) -> str:
    """Why a convolution runs whole: a fallback when its input is split (it is then gathered), else nothing."""
    if not isinstance(have, Shard):
        return ""
    if along is None:
        return f"a {len(shape_of(op['weight'])) - 2}-d convolution mixes its input's split dim {have.dim}"
    if have.dim != spatial or have.factors:
        return f"a convolution mixes its input's split dim {have.dim} (channels, or a merged dim)"
    return "the output of a convolution over the split sequence is not split"


def _split_conv(rw, node: fx.Node, op, along: _Along, out: Shard, have) -> fx.Node:
    """The output positions ``out`` gives this rank, from one input window per interval of them."""
    src = op["input"]
    dim, length = out.dim, shape_of(src)[out.dim]
    windows = [[along.window(a, b) for a, b in out.layout.local_intervals(r)] for r in range(rw.world)]
    mine = windows[rw.rank]
    if isinstance(have, Shard) and all(tuple(map(tuple, w)) == have.layout.local_intervals(r)
                                       for r, w in enumerate(windows)):  # a kernel of 1: each rank's own positions
        pieces = _pieces(rw, rw.input(src, have), dim, mine)
    elif isinstance(have, Shard):
        fetched = rw.call(torch.ops.autoshard.seq_windows.default, rw.input(src, have), dim, have.layout.encode(),
                          encode_windows(windows), rw.groups.sequence)
        pieces = _pieces(rw, fetched, dim, mine)
    else:
        whole = rw.input(src, REPLICATE, partial_grad=True)
        pieces = [_window_of_whole(rw, whole, dim, length, lo, hi) for lo, hi in mine]
    weight = rw.input(op["weight"], REPLICATE, partial_grad=True)
    bias = rw.input(op["bias"], REPLICATE, partial_grad=True)
    outs = [along.run(rw, node, op, piece, a, b, lo, weight, bias)
            for piece, (a, b), (lo, _) in zip(pieces, out.layout.local_intervals(rw.rank), mine)]
    return outs[0] if len(outs) == 1 else rw.call(torch.cat, outs, dim)


def _pieces(rw, fetched: fx.Node, dim: int, windows) -> list[fx.Node]:
    """The windows of ``fetched``, which holds them one after the other along ``dim``."""
    starts = [sum(hi - lo for lo, hi in windows[:i]) for i in range(len(windows))]
    return [fetched if len(windows) == 1 else rw.call(torch.narrow, fetched, dim, start, hi - lo)
            for start, (lo, hi) in zip(starts, windows)]


def _window_of_whole(rw, whole: fx.Node, dim: int, length: int, lo: int, hi: int) -> fx.Node:
    """Positions ``[lo, hi)`` of a whole value along its last dim ``dim``, zeros outside ``[0, length)``."""
    start = min(max(lo, 0), length)
    stop = max(min(hi, length), start)
    piece = rw.call(torch.narrow, whole, dim, start, stop - start)
    if start - lo or hi - stop:
        piece = rw.call(F.pad, piece, [start - lo, hi - stop])
    return piece


register("conv", link=link_conv, rewrite=rewrite_conv)
