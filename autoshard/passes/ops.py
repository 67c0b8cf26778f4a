"""The canonical op vocabulary: what a dynamo graph node *is*, independent of how it was spelled.

Dynamo hands the backend torch-level graphs: ``torch._C._nn.linear(x, w)``, ``x.view((2, 16, -1, 16))``,
``operator.getitem(x, (Ellipsis, None))``, ``F.cross_entropy(..., reduction='mean')``. The same operation
arrives under many spellings (function or method, varargs or tuple, positional or keyword). This
module maps every node to one :class:`Op`: a canonical ``name`` plus its arguments bound by name.

Binding is done by Python itself: each canonical op has a *binder*, a function whose signature
mirrors the torch API, called with the node's ``args``/``kwargs``. Methods bind with ``self`` as the first
argument. Elementwise ops are recognized generically through ATen's ``pointwise`` tag, so the
vocabulary covers every pointwise torch function and method without listing them.

Why not re-trace to ATen with ``make_fx``: on a 32-layer model that costs 4-5 s, over the compiler's
2 s budget, and dynamo's graph already carries a FakeTensor for every node (``meta["example_value"]``).
"""

from __future__ import annotations

import builtins
import functools
import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import annotations as _annotations  # noqa: F401 -- defines the markers' ops
from ..runtime.symbolic import as_size, hint_of, size_key
from ..runtime import grid_conv as _grid_conv  # noqa: F401 -- defines autoshard::grid_conv
from ..runtime import recurrence as _recurrence  # noqa: F401 -- defines the recurrence ops
from ..runtime import sequence_ops as _sequence_ops  # noqa: F401 -- defines autoshard::check_band

__all__ = ["Op", "OP_KEY", "UNBOUND", "canonical", "op_of", "permutation", "register_canonical", "value_of",
           "is_tensor_node", "as_size", "hint_of", "size_key", "shape_of", "numel"]

OP_KEY = "autoshard_op"
"""Where the normalize pass stores each node's canonical op (``node.meta[OP_KEY]``)."""


@dataclass
class Op:
    """A node as a canonical operation."""

    name: str
    """Canonical name: ``"pointwise"``, ``"view"``, ``"permute"``, ``"linear"``, ``"reduce"``, ..."""
    args: dict[str, Any] = field(default_factory=dict)
    """Arguments by canonical name; graph values are ``fx.Node``, the rest constants."""

    def __getitem__(self, key: str) -> Any:
        return self.args[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.args.get(key, default)


# ----------------------------------------------------------------------------- node facts


def value_of(node: Any) -> Any:
    """The example value dynamo recorded for ``node`` (a FakeTensor, a tuple, a SymInt...), or ``node`` itself
    when it is a constant."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def is_tensor_node(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(value_of(node), torch.Tensor)


def shape_of(node: Any) -> tuple:
    return tuple(as_size(s) for s in value_of(node).shape)


def numel(shape):
    n = 1
    for s in shape:
        n *= as_size(s)
    return n


# ----------------------------------------------------------------------------- registry

_FUNCTIONS: dict[Any, tuple[str, Callable]] = {}
_METHODS: dict[str, tuple[str, Callable]] = {}


def register_canonical(name: str, functions=(), methods=()):
    """Decorator: the binder of canonical op ``name`` for these torch functions and Tensor method names."""
    def deco(binder):
        for f in functions:
            _FUNCTIONS[f] = (name, binder)
        for m in methods:
            _METHODS[m] = (name, binder)
        return binder

    return deco


def _shape_args(shape):
    """``view(2, 3)`` and ``view((2, 3))`` alike."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        return list(shape[0])
    return list(shape)


# --- shape-only ops: the output is the same elements in the same order, only the shape changes
@register_canonical("view", functions=[torch.reshape, torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze],
           methods=["view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"])
def _bind_view(input, *args, **kwargs):
    return {"input": input}


@register_canonical("permute", functions=[torch.permute, torch.transpose, torch.swapaxes, torch.movedim, torch.t],
           methods=["permute", "transpose", "swapaxes", "movedim", "t"])
def _bind_permute(input, *args, **kwargs):
    return {"input": input}


@register_canonical("expand", functions=[torch.broadcast_to], methods=["expand", "expand_as", "broadcast_to"])
def _bind_expand(input, *args, **kwargs):
    return {"input": input}


@register_canonical("complex_view", functions=[torch.view_as_complex, torch.view_as_real])
def _bind_complex_view(input):
    """``view_as_complex`` drops a last dim of 2, ``view_as_real`` adds one; the other dims map one to one."""
    return {"input": input}


@register_canonical("identity", functions=[torch.clone], methods=["contiguous", "clone", "detach", "requires_grad_",
                                                          "cpu", "cuda"])
def _bind_identity(input, *args, **kwargs):
    return {"input": input}


@register_canonical("to", methods=["to", "float", "double", "half", "bfloat16", "int", "long", "bool", "type", "type_as"])
def _bind_to(input, *args, **kwargs):
    return {"input": input}


# --- indexing and splitting

@register_canonical("getitem", functions=[operator.getitem])
def _bind_getitem(input, index):
    return {"input": input, "index": index}


@register_canonical("narrow", functions=[torch.narrow], methods=["narrow"])
def _bind_narrow(input, dim, start, length):
    return {"input": input, "dim": dim, "start": start, "length": length}


@register_canonical("select", functions=[torch.select], methods=["select"])
def _bind_select(input, dim, index):
    return {"input": input, "dim": dim, "index": index}


@register_canonical("split", functions=[torch.split, torch.chunk, torch.unbind, torch.tensor_split],
           methods=["split", "chunk", "unbind", "tensor_split", "split_with_sizes"])
def _bind_split(input, *args, dim=None, **kwargs):
    return {"input": input, "dim": dim, "args": args}


@register_canonical("repeat_interleave", functions=[torch.repeat_interleave], methods=["repeat_interleave"])
def _bind_repeat_interleave(input, repeats=None, dim=None, *, output_size=None):
    return {"input": input, "repeats": repeats, "dim": dim}


@register_canonical("repeat", methods=["repeat"])
def _bind_repeat(input, *sizes):
    return {"input": input, "sizes": tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list))
            else sizes}


@register_canonical("cat", functions=[torch.cat, torch.concat, torch.concatenate])
def _bind_cat(tensors, dim=0, axis=None, out=None):
    return {"tensors": list(tensors), "dim": dim if axis is None else axis}


@register_canonical("stack", functions=[torch.stack])
def _bind_stack(tensors, dim=0, out=None):
    return {"tensors": list(tensors), "dim": dim}


@register_canonical("pad", functions=[F.pad, torch._C._nn.pad])
def _bind_pad(input, pad, mode="constant", value=None):
    return {"input": input, "pad": list(pad), "mode": mode, "value": 0.0 if value is None else value}


@register_canonical("gather", functions=[torch.gather], methods=["gather"])
def _bind_gather(input, dim, index, *, sparse_grad=False, out=None):
    return {"input": input, "dim": dim, "index": index}


@register_canonical("scatter", functions=[torch.scatter, torch.scatter_add, torch.scatter_reduce],
                    methods=["scatter", "scatter_add", "scatter_reduce"])
def _bind_scatter(input, dim, index, src=None, reduce=None, *, value=None, include_self=True, out=None):
    return {"input": input, "dim": dim, "index": index, "src": src}


@register_canonical("index_select", functions=[torch.index_select], methods=["index_select"])
def _bind_index_select(input, dim, index, *, out=None):
    return {"input": input, "dim": dim, "index": index}


# --- matrix products
@register_canonical("linear", functions=[F.linear, torch._C._nn.linear])
def _bind_linear(input, weight, bias=None):
    return {"input": input, "weight": weight, "bias": bias}


@register_canonical("matmul", functions=[torch.matmul, torch.bmm, torch.mm, operator.matmul], methods=["matmul", "bmm", "mm", "__matmul__"])
def _bind_matmul(input, other, *, out=None):
    return {"a": input, "b": other}


@register_canonical("einsum", functions=[torch.einsum])
def _bind_einsum(equation, *operands):
    """A two-operand einsum (``einsum(eq, a, b)`` or ``einsum(eq, [a, b])``); other counts are not this op."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if len(operands) != 2 or not isinstance(equation, str):
        raise TypeError(f"einsum of {len(operands)} operands: the product rule takes two")
    return {"equation": equation, "a": operands[0], "b": operands[1]}


@register_canonical("outer", functions=[torch.outer, torch.ger], methods=["outer", "ger"])
def _bind_outer(input, vec2, *, out=None):
    return {"a": input, "b": vec2}


@register_canonical("addmm", functions=[torch.addmm, torch.baddbmm], methods=["addmm", "baddbmm"])
def _bind_addmm(input, mat1, mat2, *, beta=1, alpha=1, out=None):
    return {"bias": input, "a": mat1, "b": mat2, "beta": beta, "alpha": alpha}


# --- embeddings, norms, softmax
@register_canonical("embedding", functions=[F.embedding])
def _bind_embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
                    sparse=False):
    return {"input": input, "weight": weight, "max_norm": max_norm}


@register_canonical("embedding", functions=[torch.embedding])
def _bind_aten_embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return {"input": indices, "weight": weight, "max_norm": None}


@register_canonical("layer_norm", functions=[F.layer_norm, torch.layer_norm])
def _bind_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, *args):
    return {"input": input, "normalized_shape": list(normalized_shape), "weight": weight, "bias": bias}


@register_canonical("rms_norm", functions=[F.rms_norm] + ([torch.rms_norm] if hasattr(torch, "rms_norm") else []))
def _bind_rms_norm(input, normalized_shape, weight=None, eps=None):
    return {"input": input, "normalized_shape": list(normalized_shape), "weight": weight}


@register_canonical("group_norm", functions=[F.group_norm, torch.group_norm])
def _bind_group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, *args):
    return {"input": input, "weight": weight, "bias": bias}


@register_canonical("batch_norm", functions=[F.batch_norm, torch.batch_norm])
def _bind_batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                     eps=1e-5, *args):
    return {"input": input, "running_mean": running_mean, "running_var": running_var, "weight": weight,
            "bias": bias, "training": training, "momentum": momentum, "eps": eps}


@register_canonical("softmax", functions=[F.softmax, torch.softmax, F.log_softmax, torch.log_softmax, torch._softmax,
                                 torch._log_softmax], methods=["softmax", "log_softmax"])
def _bind_softmax(input, dim=None, _stacklevel=3, dtype=None, **kwargs):
    return {"input": input, "dim": dim, "dtype": dtype}


# --- reductions and scans
_REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "prod", "all", "any", "logsumexp", "var", "std",
               "norm", "argmax", "argmin", "count_nonzero", "nansum", "nanmean")


def _bind_reduce_named(kind):
    def bind(input, dim=None, *args, keepdim=False, dtype=None, **kwargs):
        if kind in ("max", "min") and isinstance(dim, fx.Node):  # torch.max(a, b): elementwise
            return Op("pointwise", {"fn": "maximum" if kind == "max" else "minimum"})
        if args and isinstance(args[0], bool):
            keepdim = args[0]
        if kind == "norm":  # norm(input, p, dim, keepdim)
            p, dim = dim, (args[0] if args else kwargs.get("dim"))
            if len(args) > 1:
                keepdim = args[1]
            return {"input": input, "kind": kind, "dim": dim, "keepdim": keepdim, "p": p}
        if kind in ("var", "std") and "correction" in kwargs:
            return {"input": input, "kind": kind, "dim": dim, "keepdim": keepdim, "correction": kwargs["correction"]}
        if kind in ("var", "std") and "unbiased" in kwargs:
            return {"input": input, "kind": kind, "dim": dim, "keepdim": keepdim, "correction": int(kwargs["unbiased"])}
        return {"input": input, "kind": kind, "dim": dim, "keepdim": keepdim}

    return bind


for _kind in _REDUCTIONS:
    register_canonical("reduce", functions=[getattr(torch, _kind)], methods=[_kind])(_bind_reduce_named(_kind))


@register_canonical("along_dim", functions=[torch.topk], methods=["topk"])
def _bind_topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):
    return {"input": input, "dim": dim}


@register_canonical("along_dim", functions=[torch.sort, torch.argsort, torch.cummax, torch.cummin],
                    methods=["sort", "argsort", "cummax", "cummin"])
def _bind_sort(input, dim=-1, *args, **kwargs):
    return {"input": input, "dim": dim if isinstance(dim, int) else -1}


@register_canonical("cumsum", functions=[torch.cumsum], methods=["cumsum"])
def _bind_cumsum(input, dim, *, dtype=None, out=None):
    return {"input": input, "dim": dim, "dtype": dtype}


@register_canonical("diff", functions=[torch.diff], methods=["diff"])
def _bind_diff(input, n=1, dim=-1, prepend=None, append=None):
    return {"input": input, "n": n, "dim": dim, "prepend": prepend, "append": append}


# --- factories (no tensor inputs, or only for dtype/device/shape)
_FACTORIES = ["zeros", "ones", "full", "empty", "rand", "randn", "randint", "tensor", "zeros_like",
              "ones_like", "full_like", "empty_like", "rand_like", "randn_like", "randint_like", "linspace",
              "scalar_tensor", "as_tensor"]


@register_canonical("factory", functions=[getattr(torch, f) for f in _FACTORIES],
           methods=["new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"])
def _bind_factory(*args, **kwargs):
    return {"args": args, "kwargs": kwargs}


_ARANGE_BOUNDS = ("start", "end", "step")


@register_canonical("factory", functions=[torch.arange])
def _bind_arange(*args, **kwargs):
    """``arange(end)``, ``arange(start, end[, step])``, any bound by keyword: ``start``, ``end`` and ``step``
    (defaults 0 and 1) next to the factory's ``args`` / ``kwargs``."""
    names = ("end",) if len(args) == 1 and "end" not in kwargs else _ARANGE_BOUNDS
    bounds = {"start": 0, "step": 1, **dict(zip(names, args))}
    bounds.update((k, v) for k, v in kwargs.items() if k in _ARANGE_BOUNDS)
    return {"args": args, "kwargs": kwargs, **bounds}


# --- convolution
@register_canonical("conv", functions=[F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d])
def _bind_conv(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return {"input": input, "weight": weight, "bias": bias, "stride": stride, "padding": padding,
            "dilation": dilation, "groups": groups}


@register_canonical("conv", functions=[torch.ops.autoshard.grid_conv.default])
def _bind_grid_conv(input, weight, bias, height, width, padding, dilation, groups):
    """A 2-d convolution over tokens that are a ``height x width`` grid (:mod:`~autoshard.runtime.grid_conv`)."""
    return {"input": input, "weight": weight, "bias": bias, "stride": 1, "padding": padding, "dilation": dilation,
            "groups": groups, "grid": (height, width)}


# --- losses
@register_canonical("cross_entropy", functions=[F.cross_entropy, F.nll_loss])
def _bind_cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                        reduction="mean", label_smoothing=0.0):
    if size_average is not None or reduce is not None:
        reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
    return {"input": input, "target": target, "weight": weight, "ignore_index": ignore_index,
            "reduction": reduction, "label_smoothing": label_smoothing}


def _bind_elementwise_loss(loss: Callable) -> Callable:
    """The binder of one elementwise loss, by its own signature: ``input``, ``target``, ``reduction`` (the
    legacy ``size_average`` / ``reduce`` folded in) and ``options``, every other argument the call gave by
    name (``beta``, ``delta``, ``weight``, ``pos_weight``)."""
    signature = inspect.signature(loss)

    def bind(*args, **kwargs):
        options = dict(signature.bind(*args, **kwargs).arguments)
        size_average, reduce = options.pop("size_average", None), options.pop("reduce", None)
        reduction = options.pop("reduction", "mean")
        if size_average is not None or reduce is not None:
            reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
        return {"input": options.pop("input"), "target": options.pop("target"), "reduction": reduction,
                "options": options}

    return bind


for _loss in (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy_with_logits,
              F.binary_cross_entropy):
    register_canonical("elementwise_loss", functions=[_loss])(_bind_elementwise_loss(_loss))


# --- attention and randomness
@register_canonical("attention", functions=[F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention])
def _bind_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return {"q": query, "k": key, "v": value, "attn_mask": attn_mask, "dropout_p": dropout_p,
            "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}


@register_canonical("dropout", functions=[F.dropout, torch.dropout, F.dropout1d, F.dropout2d, F.alpha_dropout])
def _bind_dropout(input, p=0.5, training=True, inplace=False):
    return {"input": input, "p": p, "training": training, "inplace": inplace}


# --- autoshard's own markers (autoshard/annotations.py)
def _marker_targets(name: str) -> list:
    packet = getattr(torch.ops.autoshard, name)
    return [packet, packet.default]


@register_canonical("mark_sequence", functions=_marker_targets("mark_sequence"))
def _bind_mark_sequence(x, dim):
    return {"input": x, "dim": dim}


@register_canonical("whole", functions=_marker_targets("whole"))
def _bind_whole(x):
    return {"input": x}


@register_canonical("token_local_enter", functions=_marker_targets("token_local_enter"))
@register_canonical("token_local_exit", functions=_marker_targets("token_local_exit"))
def _bind_token_local(x):
    return {"input": x}


@register_canonical("attention", functions=_marker_targets("marked_attention"))
def _bind_marked_attention(q, k, v, attn_mask, causal, scale):
    return {"q": q, "k": k, "v": v, "attn_mask": attn_mask, "dropout_p": 0.0, "is_causal": causal, "scale": scale,
            "enable_gqa": True}


@register_canonical("recurrence", functions=[torch.ops.autoshard.gated_delta_rule,
                                             torch.ops.autoshard.gated_delta_rule.default])
def _bind_gated_delta_rule(q, k, v, g, beta, initial_state, implementation, chunk_size, use_qk_l2norm,
                           cu_seqlens=None):
    return {"kind": "gated_delta_rule", "sequence": [q, k, v, g, beta], "others": [], "initial_state": initial_state,
            "config": [implementation, chunk_size, use_qk_l2norm], "packed": cu_seqlens}


@register_canonical("recurrence", functions=[torch.ops.autoshard.ssd_chunk_scan,
                                             torch.ops.autoshard.ssd_chunk_scan.default])
def _bind_ssd_chunk_scan(x, dt, B, C, A, D, dt_bias, initial_state, implementation, chunk_size, dt_softplus, dt_min,
                         dt_max, seq_idx=None, cu_seqlens=None):
    return {"kind": "ssd_chunk_scan", "sequence": [x, dt, B, C], "others": [A, D, dt_bias],
            "initial_state": initial_state, "config": [implementation, chunk_size, dt_softplus, dt_min, dt_max],
            "packed": seq_idx if seq_idx is not None else cu_seqlens}


@register_canonical("recurrence", functions=[torch.ops.autoshard.selective_scan,
                                             torch.ops.autoshard.selective_scan.default])
def _bind_selective_scan(x, dt, B, C, z, A, D, delta_bias, implementation, delta_softplus):
    return {"kind": "selective_scan", "sequence": [x, dt, B, C, z], "others": [A, D, delta_bias],
            "initial_state": None, "config": [implementation, delta_softplus], "packed": None}


# --- nodes that carry no tensor computation (a guard on a buffer read as a mask among them)
_NOOPS = {torch._C._log_api_usage_once, torch._C._set_grad_enabled, torch.autograd.function.FunctionCtx,
          builtins.isinstance, torch._C._get_tracing_state, torch.ops.autoshard.check_band.default,
          torch.ops.autoshard.check_runs.default}


# ----------------------------------------------------------------------------- pointwise recognition

_OPERATOR_ATEN = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
                  operator.floordiv: "floor_divide", operator.mod: "remainder", operator.pow: "pow",
                  operator.neg: "neg", operator.pos: "positive", operator.abs: "abs", operator.invert: "bitwise_not",
                  operator.and_: "bitwise_and", operator.or_: "bitwise_or", operator.xor: "bitwise_xor",
                  operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le", operator.gt: "gt",
                  operator.ge: "ge", operator.iadd: "add", operator.isub: "sub", operator.imul: "mul",
                  operator.itruediv: "div"}
_EXTRA_POINTWISE = {"floor_divide", "positive", "polar", "complex"}
"""Elementwise ops ATen does not tag pointwise (``polar`` and ``complex`` build complex values: RoPE's
``freqs_cis``)."""


@functools.lru_cache(maxsize=None)
def _aten_pointwise(name: str) -> bool:
    name = name.rstrip("_") if not name.startswith("__") else name.strip("_")
    if name in _EXTRA_POINTWISE:
        return True
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return False
    return any(torch.Tag.pointwise in getattr(packet, ov).tags for ov in packet.overloads())


def _target_name(node: fx.Node) -> str | None:
    if node.op == "call_method":
        return node.target
    if node.target in _OPERATOR_ATEN:
        return _OPERATOR_ATEN[node.target]
    return getattr(node.target, "__name__", None)


# ----------------------------------------------------------------------------- entry point


def canonical(node: fx.Node) -> Op | None:
    """The canonical op of a ``call_function`` / ``call_method`` node; None for nodes that compute nothing
    (logging calls, grad-mode switches) and for ops outside the vocabulary."""
    if node.op not in ("call_function", "call_method"):
        return None
    if node.op == "call_function" and node.target in _NOOPS:
        return Op("noop")
    if node.op == "call_function" and node.target is operator.getitem and not is_tensor_node(node.args[0]):
        return Op("tuple_get", {"input": node.args[0], "index": node.args[1]})
    entry = _METHODS.get(node.target) if node.op == "call_method" else _FUNCTIONS.get(node.target)
    if entry is not None:
        name, binder = entry
        try:
            args = binder(*node.args, **node.kwargs)
        except TypeError as exc:  # a spelling of the op its binder does not take: no op, and why
            node.meta[UNBOUND] = f"{name}: {exc}"
            return None
        return args if isinstance(args, Op) else Op(name, args)
    name = _target_name(node)
    if name is not None and _aten_pointwise(name):
        return Op("pointwise", {"fn": name})
    return None


def permutation(node: fx.Node, ndim: int | None = None) -> list[int]:
    """Output dim i is input dim perm[i]: found by running the op on a meta tensor of distinct sizes (``ndim``: the
    input's dims, where its node carries no example value)."""
    src = node.args[0]
    ndim = len(shape_of(src)) if ndim is None else ndim
    probe = torch.empty(tuple(range(2, 2 + ndim)), device="meta")
    args = (probe,) + tuple(node.args[1:])
    out = getattr(probe, node.target)(*args[1:], **node.kwargs) if node.op == "call_method" else node.target(*args, **node.kwargs)
    return [s - 2 for s in out.shape]


UNBOUND = "autoshard_unbound"
"""``node.meta`` key of a call whose op is known but whose arguments its binder does not take: why (the rewrite then
reports it as unbound, not as an op without a rule)."""


def op_of(node: Any) -> Op | None:
    """The canonical op the normalize pass recorded for ``node`` (computed on demand for new nodes)."""
    if not isinstance(node, fx.Node):
        return None
    if OP_KEY not in node.meta:
        node.meta[OP_KEY] = canonical(node)
    return node.meta[OP_KEY]
