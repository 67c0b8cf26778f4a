"""Convolutions.

The batch dim passes through a convolution; its spatial dims mix neighbouring positions, so a value
split along a spatial dim is gathered first (recorded as a fallback). ViT's patch embedding is the
common case and runs on the whole image: the sequence starts after it, at the flattened patches.
"""

from __future__ import annotations

from ...placements import REPLICATE
from ..ops import shape_of
from . import register
from .pointwise import mapped_args, whole_args

__all__: list[str] = []  # the rules register themselves on import; nothing here is called from outside


def link_conv(ctx, node, op):
    src = op["input"]
    if len(shape_of(src)) == len(shape_of(node)) and shape_of(src)[0] == shape_of(node)[0]:
        ctx.link_dims(node, 0, src, 0)


def rewrite_conv(rw, node, op):
    out = rw.out_shard(node)
    src = op["input"]
    if out is None or out.dim != 0:
        rw.done(node, rw.reemit(node, *whole_args(rw, node)), REPLICATE)
        return
    convert = lambda n: rw.input(n, out) if n is src else rw.input(n, REPLICATE, partial_grad=True)  # noqa: E731
    rw.done(node, rw.reemit(node, *mapped_args(node, convert)), out)


register("conv", link=link_conv, rewrite=rewrite_conv)
