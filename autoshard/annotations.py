"""Annotations for what inference cannot know. Each is a graph-visible marker: an op dynamo records in
the graph (never a monkey-patch), which the compiler reads and which is an identity (or plain SDPA) when
the model runs anywhere else.

``mark_sequence(x, dim)``
    ``x``'s dim ``dim`` is a sequence: split it (when no attention reveals it, e.g. a model without
    attention, or an input that reaches attention only through ops the rules do not follow).
``whole(x)``
    ``x`` must be whole here (gathered) -- before a module that needs the entire sequence.
``token_local(fn)``
    ``fn`` works position by position: ops inside it that the rules do not know run on each rank's
    positions as they are, instead of on gathered inputs.
``attention_function(fn)``
    ``fn(q, k, v, causal=..., scale=..., attn_mask=..., window=...)`` computes
    ``scaled_dot_product_attention`` with those arguments (a custom kernel, say): under ``torch.compile``
    it is recorded as one attention and replaced by distributed attention; outside compilation ``fn``
    itself runs. K and V may have fewer heads than Q (grouped-query attention). ``attn_mask`` is SDPA's
    (bool: attend; float: added to the scores), ``window=(left, right)`` flash-attention's sliding window
    (query ``i`` sees keys ``i - left .. i + right``; -1: no bound on that side). Under compilation the
    window and ``causal`` become one boolean mask written from positions, which the compiler reads back as
    a band (:mod:`autoshard.passes.masks`): no dense mask is made or sent.

Runnable examples are in ``examples/annotations.py``.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["mark_sequence", "whole", "token_local", "attention_function"]

_lib = torch.library.Library("autoshard", "FRAGMENT")
_lib.define("mark_sequence(Tensor(a) x, int dim) -> Tensor(a)")
_lib.define("whole(Tensor(a) x) -> Tensor(a)")
_lib.define("token_local_enter(Tensor(a) x) -> Tensor(a)")
_lib.define("token_local_exit(Tensor(a) x) -> Tensor(a)")
_lib.define("marked_attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, bool causal, float? scale) -> Tensor")

for _name in ("mark_sequence", "whole", "token_local_enter", "token_local_exit"):
    _lib.impl(_name, (lambda x, *args: x.view_as(x)), "CompositeImplicitAutograd")
_lib.impl("marked_attention",
          lambda q, k, v, attn_mask, causal, scale: F.scaled_dot_product_attention(
              q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale, enable_gqa=k.size(-3) != q.size(-3)),
          "CompositeImplicitAutograd")


def mark_sequence(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` unchanged; tells the compiler that ``x``'s dim ``dim`` is a sequence to split."""
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"autoshard.mark_sequence: dim {dim} does not exist in a {x.dim()}-D tensor "
                         f"of shape {tuple(x.shape)}")
    return torch.ops.autoshard.mark_sequence(x, dim % x.dim())


def whole(x: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged; the compiler gathers it here if it is split."""
    return torch.ops.autoshard.whole(x)


def _map_tensors(fn, tree):
    return torch.utils._pytree.tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, tree)


def token_local(fn: Callable) -> Callable:
    """Decorate a function (or a module's ``forward``) that computes every position independently."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        args, kwargs = _map_tensors(torch.ops.autoshard.token_local_enter, (args, kwargs))
        return _map_tensors(torch.ops.autoshard.token_local_exit, fn(*args, **kwargs))

    return wrapper


def _banded(q: torch.Tensor, k: torch.Tensor, attn_mask, causal: bool, window) -> torch.Tensor | None:
    """``attn_mask`` with the keys outside ``window`` (and, when ``causal``, after the query) hidden; None when
    nothing is hidden. A band from positions, as the compiler reads masks."""
    left, right = window if window is not None else (-1, -1)
    right = 0 if causal else right
    if left < 0 and right < 0:
        return attn_mask
    offset = torch.arange(k.size(-2), device=q.device)[None, :] - torch.arange(q.size(-2), device=q.device)[:, None]
    band = (offset >= -left) if left >= 0 else None
    if right >= 0:
        band = offset <= right if band is None else band & (offset <= right)
    if attn_mask is None:
        return band
    if attn_mask.dtype == torch.bool:
        return attn_mask & band
    return attn_mask.masked_fill(~band, float("-inf"))


def attention_function(fn: Callable) -> Callable:
    """Decorate ``fn(q, k, v, *, causal=False, scale=None, attn_mask=None, window=None)`` -- equivalent to
    ``scaled_dot_product_attention`` with those arguments (see the module docstring) -- so that compiled models
    distribute it. ``fn`` receives ``attn_mask`` and ``window`` only when they are given."""
    @functools.wraps(fn)
    def wrapper(q, k, v, *, causal: bool = False, scale: float | None = None, attn_mask: torch.Tensor | None = None,
                window: tuple[int, int] | None = None):
        if window is not None and not (isinstance(window, (tuple, list)) and len(window) == 2
                                       and all(isinstance(w, int) for w in window)):
            raise ValueError(f"autoshard.attention_function: window is (left, right) in positions (-1: unbounded), "
                             f"not {window!r}")
        if torch.compiler.is_compiling():
            if attn_mask is None and window is None:
                return torch.ops.autoshard.marked_attention(q, k, v, None, causal, scale)
            return torch.ops.autoshard.marked_attention(q, k, v, _banded(q, k, attn_mask, causal, window), False, scale)
        given = {name: value for name, value in (("attn_mask", attn_mask), ("window", window)) if value is not None}
        return fn(q, k, v, causal=causal, scale=scale, **given)

    return wrapper
