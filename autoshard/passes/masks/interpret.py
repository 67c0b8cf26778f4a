"""The abstract interpreter of the mask pass: the subgraph that computes a mask, evaluated as formulas.

Every value is an :class:`Abstract`: a sympy expression of its own index symbols (``d0, d1, ...``:
:func:`dim_symbol`), so ``arange(S)`` is ``d0``, ``q_idx[None, None, :, None]`` re-indexes it to ``d2``, ``kv <= q``
is ``d3 <= d2``, and a gather ``mask[batch_idx, kv_idx]`` of a tensor the interpreter cannot see through is an
*uninterpreted function* ``T(d0, d3)`` of the gathered indices (a *leaf*: :attr:`Evaluator.leaves` maps its name
back to the node). A float mask is a boolean formula with a ``fill`` (what hidden scores get) and a ``bias`` (what
visible ones get added: ALiBi's ``slope * (k - q)``); ``where(mask, 0, min)``, ``masked_fill(-inf)``, sums of
masks and ``triu`` / ``tril`` of a very negative constant are read as such (:data:`MASKING_FILL`).

A module buffer that holds a band (one value where ``lo <= k - q <= hi``, another elsewhere, nanoGPT's ``tril``) is
that band's ``Piecewise`` formula, folded through the comparisons that read it (:func:`_settle`);
:attr:`Evaluator.bands` records it, for the guard the emission inserts. FlexAttention's ``mask_mod`` /
``score_mod`` graphs are evaluated with their index arguments bound to the symbols ``b, h, q, k``
(:func:`evaluate_mod`). What the interpreter cannot read is a leaf, never an error: the recognizers
(:mod:`.recognizers`) decide whether the formula is a mask they know.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from sympy.core.function import AppliedUndef
from torch._subclasses.fake_tensor import FakeTensor

from ...runtime.sequence_ops import Band, constant_band
from ..graph import real_value
from ..ops import canonical, is_tensor_node, permutation, shape_of, value_of

__all__ = ["Abstract", "Evaluator", "Unstructurable", "broadcast_to", "dim_symbol", "empty_rows_of", "evaluate_mod",
           "B", "H", "Q", "K", "SCORE", "MASKING_FILL", "SWAMPING_FILL"]

B, H, Q, K = sympy.symbols("b h q k", integer=True, nonnegative=True)
"""The dims of an attention's mask: batch, head, query, key."""

MASKING_FILL = -1e4
"""A score set to (or added) at most this much masks the score out: ``-inf``, ``finfo.min`` and the ``-10000.0`` of
older models all do (softmax gives it ``exp(-1e4)`` = 0 next to any visible score). A milder value is not read as a
mask."""
SWAMPING_FILL = -1e30
"""An additive fill at most this much swamps every score it is added to: the sum rounds to the fill, so a query row
that sees no key gets uniform attention over all keys (``empty_rows="uniform"``); a fill between this and
:data:`MASKING_FILL` leaves such a row the softmax of its unmasked scores (``"scores"``), and ``-inf`` gives 0
(``"zero"``, as SDPA)."""


class Unstructurable(Exception):
    """The mask is not a combination of the structured kinds."""


def empty_rows_of(fill: float | None) -> str:
    """The :attr:`MaskData.empty_rows <autoshard.passes.masks.MaskData.empty_rows>` of a mask whose masked scores
    are set to ``fill``."""
    if fill is None or fill == float("-inf"):
        return "zero"
    return "uniform" if fill <= SWAMPING_FILL else "scores"


# ----------------------------------------------------------------------------- abstract values


@dataclass(frozen=True)
class Abstract:
    """The abstract value of a tensor: a formula of its own index symbols (:func:`dim_symbol`)."""

    expr: object
    """A sympy expression: bool-valued for masks, numeric otherwise."""
    shape: tuple[int, ...]
    """The tensor's shape."""
    fill: float | None = None
    """A float (additive) mask: :attr:`bias` where :attr:`expr` holds, ``fill`` elsewhere; None: not one."""
    bias: object = 0
    """With :attr:`fill`: the numeric expression added where the mask holds (ALiBi's position bias)."""


def dim_symbol(d: int) -> sympy.Symbol:
    """The index symbol of a tensor's dim ``d`` (``d0, d1, ...``)."""
    return sympy.Symbol(f"d{d}", integer=True, nonnegative=True)


def _reindex(v: Abstract, mapping: dict[int, object], shape: tuple[int, ...]) -> Abstract:
    if not mapping:
        return Abstract(v.expr, shape, v.fill, v.bias)
    subs = {dim_symbol(d): e for d, e in mapping.items()}
    return Abstract(sympy.sympify(v.expr).xreplace(subs), shape, v.fill, sympy.sympify(v.bias).xreplace(subs))


def broadcast_to(v: Abstract, shape: tuple[int, ...]) -> Abstract:
    """``v`` broadcast to ``shape`` (size-1 dims that grow are read at index 0)."""
    lead = len(shape) - len(v.shape)
    mapping = {}
    for d, s in enumerate(v.shape):
        mapping[d] = sympy.Integer(0) if (s == 1 and shape[lead + d] != 1) else dim_symbol(lead + d)
    return _reindex(v, mapping, shape)


def _leaf(node: fx.Node) -> Abstract:
    shape = shape_of(node)
    fn = sympy.Function(f"T_{node.name}")
    args = [sympy.Integer(0) if s == 1 else dim_symbol(d) for d, s in enumerate(shape)]
    expr = fn(*args) if args else fn(sympy.Integer(0))
    if value_of(node).dtype == torch.bool:
        expr = sympy.Ne(expr, 0)
    return Abstract(expr, shape)


class Evaluator:
    """Abstract interpretation of the subgraph producing a mask (see the module docstring)."""

    def __init__(self):
        self.cache: dict[fx.Node, Abstract] = {}
        self.leaves: dict[str, fx.Node] = {}
        self.bands: dict[fx.Node, Band] = {}
        """Buffers read as bands (each needs a guard)."""

    def __call__(self, node) -> Abstract:
        if not isinstance(node, fx.Node):
            return Abstract(sympy.sympify(bool(node) if isinstance(node, bool) else node), ())
        if node not in self.cache:
            self.cache[node] = _settle(self._eval(node))
        return self.cache[node]

    def bind(self, node: fx.Node, value: Abstract) -> None:
        """Evaluate ``node`` as ``value`` (the arguments of a FlexAttention ``mask_mod``)."""
        self.cache[node] = value

    def leaf(self, node: fx.Node) -> Abstract:
        self.leaves[f"T_{node.name}"] = node
        return _leaf(node)

    def _eval(self, node: fx.Node) -> Abstract:
        value = _buffer_value(node)
        band = constant_band(value) if value is not None else None
        if band is not None:
            self.bands[node] = band
            return _band_value(band, value)
        if not is_tensor_node(node):
            raise Unstructurable(f"non-tensor {node.format_node()}")
        shape = shape_of(node)
        op = canonical(node)
        name = op.name if op is not None else None
        name_fn = op.get("fn") if op is not None else None
        target = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if name == "factory" and target == "arange":
            return Abstract(sympy.sympify(op["start"]) + sympy.sympify(op["step"]) * dim_symbol(0), shape)
        fills = {"new_ones": 1, "ones": 1, "ones_like": 1, "new_zeros": 0, "zeros": 0, "zeros_like": 0}
        if name == "factory" and (target in fills or "full" in target):
            fill = fills.get(target, node.kwargs.get("fill_value", node.args[-1] if node.args else None))
            if isinstance(fill, (bool, int, float)):
                if value_of(node).dtype == torch.bool:
                    return Abstract(sympy.true if fill else sympy.false, shape)
                return Abstract(sympy.sympify(fill), shape)
        if name in ("identity", "to"):
            src = self(op["input"])
            if value_of(node).dtype == torch.bool and value_of(op["input"]).dtype != torch.bool:
                return Abstract(sympy.Ne(src.expr, 0), shape)
            return src
        if name == "view" and _only_unit_dims_change(shape_of(op["input"]), shape):
            return _unit_reshape(self(op["input"]), shape)
        if name == "expand":
            return broadcast_to(self(op["input"]), shape)
        if name == "permute":
            perm = permutation(node)
            return _reindex(self(op["input"]), {p: dim_symbol(d) for d, p in enumerate(perm)}, shape)
        if name == "getitem":
            return self._index(node, op, shape)
        if name == "cat" and all(isinstance(t, fx.Node) for t in op["tensors"]):
            return self._cat(node, op["tensors"], op["dim"] % len(shape), shape)
        if name in ("repeat", "repeat_interleave"):
            return self._repeat(node, op, shape)
        if target in ("triu", "tril") and len(shape) >= 2:
            return self._triangle(node, target, shape)
        if name == "pointwise":
            return self._pointwise(node, name_fn, shape)
        return self.leaf(node)

    def _pointwise(self, node, fn, shape) -> Abstract:
        tensor_args = [a for a in node.args if isinstance(a, fx.Node)]
        vals = [broadcast_to(self(a), shape) if isinstance(a, fx.Node) else self(a) for a in node.args]
        numeric = [_numeric(a, v) for a, v in zip(node.args, vals)]
        if fn == "where":
            cond, a, b = vals
            if numeric[1] and _very_negative(b.expr):
                return Abstract(cond.expr, shape, fill=float(b.expr), bias=a.expr)
            if numeric[2] and _very_negative(a.expr):
                return Abstract(sympy.Not(cond.expr), shape, fill=float(a.expr), bias=b.expr)
            return self.leaf(node)
        if fn == "masked_fill" and len(vals) == 3 and _very_negative(vals[2].expr):
            x, hide = vals[0], sympy.Not(vals[1].expr)
            if x.fill is not None:
                return Abstract(sympy.And(x.expr, hide), shape, fill=min(x.fill, float(vals[2].expr)), bias=x.bias)
            return Abstract(hide, shape, fill=float(vals[2].expr), bias=x.expr) if numeric[0] else self.leaf(node)
        binary = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
                  "le": sympy.Le, "lt": sympy.Lt, "ge": sympy.Ge, "gt": sympy.Gt, "eq": sympy.Eq, "ne": sympy.Ne,
                  "bitwise_and": sympy.And, "logical_and": sympy.And, "bitwise_or": sympy.Or, "logical_or": sympy.Or}
        floor_division = fn == "floor_divide" or (fn == "div" and node.kwargs.get("rounding_mode") == "floor")
        if floor_division and len(vals) == 2 and sympy.sympify(vals[1].expr).is_Integer and vals[1].expr != 0:
            return Abstract(sympy.floor(vals[0].expr / vals[1].expr), shape)
        if (fn == "div" and len(vals) == 2 and node.kwargs.get("rounding_mode") is None
                and vals[0].fill is None and vals[1].fill is None):  # a score over a soft-cap (score_mod)
            return Abstract(vals[0].expr / vals[1].expr, shape)
        if fn in binary and len(vals) == 2:
            a, b = vals
            if fn == "mul" and value_of(node).dtype == torch.bool:
                return Abstract(sympy.And(a.expr, b.expr), shape)
            if fn in ("add", "sub") and (a.fill is not None or b.fill is not None):
                if a.fill is not None and b.fill is not None and fn == "add":
                    return Abstract(sympy.And(a.expr, b.expr), shape, fill=a.fill + b.fill, bias=a.bias + b.bias)
                if a.fill is not None and numeric[1]:  # a mask plus (minus) a position bias
                    return Abstract(a.expr, shape, fill=a.fill, bias=binary[fn](a.bias, b.expr))
                if b.fill is not None and numeric[0] and fn == "add":
                    return Abstract(b.expr, shape, fill=b.fill, bias=b.bias + a.expr)
                return self.leaf(node)
            return Abstract(binary[fn](a.expr, b.expr), shape)
        if fn in ("bitwise_not", "logical_not") and len(tensor_args) == 1:
            return Abstract(sympy.Not(vals[0].expr), shape)
        unary = {"neg": operator.neg, "abs": sympy.Abs, "tanh": sympy.tanh}
        if fn in unary and len(vals) == 1:
            return Abstract(unary[fn](vals[0].expr), shape)
        return self.leaf(node)

    def _cat(self, node: fx.Node, tensors: list[fx.Node], dim: int, shape) -> Abstract:
        """A boolean concatenation along ``dim``: each part where the index falls in its range (HunyuanVideo's
        ``mask[:, :, :, 0] = True``, functionalized: ``cat([full(True), mask[..., 1:]], -1)``). Each part reads
        the tensors it is made of at the concatenation's own index, so that they can be read over its whole range
        (a leaf read shifted, as a part cut from one tensor and placed at another offset, is a leaf itself)."""
        parts, start, index = [], 0, dim_symbol(dim)
        for t in tensors:
            v, size = self(t), shape_of(t)[dim]
            if v.fill is not None or value_of(t).dtype != torch.bool:
                return self.leaf(node)
            part = _reindex(broadcast_to(v, shape[:dim] + (size,) + shape[dim + 1:]), {dim: index - start}, shape)
            if not self._reads_whole(part.expr, index, shape[dim]):
                return self.leaf(node)
            inside = [index >= start] if start else []
            inside += [index < start + size] if start + size != shape[dim] else []
            parts.append(sympy.And(*inside, part.expr))
            start += size
        return Abstract(sympy.Or(*parts), shape)

    def _reads_whole(self, expr, index, length) -> bool:
        """Whether every leaf ``expr`` reads along ``index`` is read at ``index`` itself, on a dim of ``length``."""
        for call in sympy.sympify(expr).atoms(AppliedUndef):
            leaf = shape_of(self.leaves[str(call.func)])
            for arg, size in zip(call.args, leaf):
                if index in arg.free_symbols and (arg != index or size != length):
                    return False
        return True

    def _repeat(self, node, op, shape) -> Abstract:
        """``repeat`` reads each dim modulo its size, ``repeat_interleave`` by an int floor-divides its dim."""
        src = self(op["input"])
        if op.name == "repeat":
            sizes = shape_of(op["input"])
            lead = len(shape) - len(sizes)
            mapping = {d: sympy.Integer(0) if size == 1 else dim_symbol(lead + d) if shape[lead + d] == size
                       else sympy.Mod(dim_symbol(lead + d), size) for d, size in enumerate(sizes)}
            return _reindex(src, mapping, shape)
        repeats, dim = op["repeats"], op["dim"]
        if not isinstance(repeats, int) or dim is None:
            return self.leaf(node)
        dim %= len(shape)
        mapping = {d: dim_symbol(d) for d in range(len(shape))}
        mapping[dim] = sympy.floor(dim_symbol(dim) / repeats)
        return _reindex(src, mapping, shape)

    def _triangle(self, node, which: str, shape) -> Abstract:
        """``triu`` / ``tril`` of a constant: a bool band, or an additive mask of a very negative fill."""
        src = self(node.args[0])
        diagonal = node.args[1] if len(node.args) > 1 else node.kwargs.get("diagonal", 0)
        n = len(shape)
        offset = dim_symbol(n - 1) - dim_symbol(n - 2)
        band = sympy.Ge(offset, diagonal) if which == "triu" else sympy.Le(offset, diagonal)
        if src.expr is sympy.true:
            return Abstract(band, shape)
        if _very_negative(src.expr):
            return Abstract(sympy.Not(band), shape, fill=float(src.expr))
        return self.leaf(node)

    def _index(self, node, op, shape) -> Abstract:
        index = op["index"] if isinstance(op["index"], tuple) else (op["index"],)
        src = op["input"]
        src_shape = shape_of(src)
        if all(isinstance(i, fx.Node) for i in index) and len(index) == len(src_shape):
            idx_vals = [broadcast_to(self(i), shape) for i in index]
            base = self(src)
            return _reindex(base, {d: v.expr for d, v in enumerate(idx_vals)}, shape)
        # basic indexing with None / full slices / Ellipsis only: a re-indexing
        mapping, od, d = {}, 0, 0
        consuming = sum(1 for i in index if i is not None and i is not Ellipsis)
        for it in index:
            if it is None:
                od += 1
            elif it is Ellipsis:
                for _ in range(len(src_shape) - consuming):
                    mapping[d] = dim_symbol(od)
                    d, od = d + 1, od + 1
            elif isinstance(it, slice) and it == slice(None, None, None):
                mapping[d] = dim_symbol(od)
                d, od = d + 1, od + 1
            elif isinstance(it, slice) and it.step in (None, 1) and (it.start or 0) >= 0:
                mapping[d] = dim_symbol(od) + (it.start or 0)
                d, od = d + 1, od + 1
            else:
                return self.leaf(node)
        while d < len(src_shape):
            mapping[d] = dim_symbol(od)
            d, od = d + 1, od + 1
        return _reindex(self(src), mapping, shape)


def _only_unit_dims_change(a, b) -> bool:
    return [s for s in a if s != 1] == [s for s in b if s != 1]


def _unit_reshape(v: Abstract, shape) -> Abstract:
    src_dims = [d for d, s in enumerate(v.shape) if s != 1]
    dst_dims = [d for d, s in enumerate(shape) if s != 1]
    mapping = {d: sympy.Integer(0) for d, s in enumerate(v.shape) if s == 1}
    mapping.update({s: dim_symbol(t) for s, t in zip(src_dims, dst_dims)})
    return _reindex(v, mapping, tuple(shape))


def _numeric(arg, v: Abstract) -> bool:
    """Whether ``arg`` (abstract value ``v``) is a number: a float tensor that is no additive mask, or a Python
    number."""
    if v.fill is not None:
        return False
    if isinstance(arg, fx.Node):
        return is_tensor_node(arg) and value_of(arg).dtype.is_floating_point
    return isinstance(arg, (int, float)) and not isinstance(arg, bool)


def _very_negative(expr) -> bool:
    try:
        return float(expr) <= MASKING_FILL
    except (TypeError, ValueError):
        return False


def _buffer_value(node: fx.Node) -> torch.Tensor | None:
    """The value of the module buffer ``node`` reads (see the module docstring), or None: not module state, a
    tensor that needs gradients (a parameter), or one without values (fake, meta)."""
    if node.op == "get_attr":
        value = functools.reduce(getattr, node.target.split("."), node.graph.owning_module)
    else:
        value = real_value(node)
    if (not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor) or value.is_meta
            or value.requires_grad):
        return None
    return value


def _band_value(band: Band, value: torch.Tensor) -> Abstract:
    """The abstract value of a buffer holding ``band``: its formula in its own last two index symbols."""
    shape = tuple(value.shape)
    n = len(shape)
    offset = dim_symbol(n - 1) - dim_symbol(n - 2)
    cond = sympy.And(*([sympy.Ge(offset, band.lo)] if band.lo > 1 - shape[-2] else []),
                     *([sympy.Le(offset, band.hi)] if band.hi < shape[-1] - 1 else []))
    if value.dtype == torch.bool:
        return Abstract(cond if band.inside else sympy.Not(cond), shape)
    if band.inside == band.outside:
        return Abstract(sympy.sympify(band.inside), shape)
    if value.dtype.is_floating_point and 0.0 in (band.inside, band.outside):  # 0 and very negative: additive
        other = band.outside if band.inside == 0.0 else band.inside
        if other <= MASKING_FILL:
            return Abstract(cond if band.inside == 0.0 else sympy.Not(cond), shape, fill=other)
    return Abstract(sympy.Piecewise((sympy.sympify(band.inside), cond), (sympy.sympify(band.outside), True)), shape)


def _settle(v: Abstract) -> Abstract:
    """``v`` with its ``Piecewise`` (a band buffer's) folded out: comparisons of it become boolean formulas, an
    expression of values 0 and very negative an additive mask."""
    if not isinstance(v.expr, sympy.Basic) or not v.expr.has(sympy.Piecewise):
        return v
    folded = sympy.piecewise_fold(v.expr)
    if not isinstance(folded, sympy.Piecewise):
        return Abstract(folded, v.shape, v.fill, v.bias)
    pieces = folded.args
    if all(value in (sympy.true, sympy.false) for value, _ in pieces):
        terms, before = [], sympy.false
        for value, cond in pieces:
            terms.append(sympy.And(value, cond, sympy.Not(before)))
            before = sympy.Or(before, cond)
        return Abstract(sympy.Or(*terms), v.shape, v.fill, v.bias)
    if len(pieces) == 2 and v.fill is None and pieces[1][1] is sympy.true:
        (a, cond), (b, _) = pieces
        if a == 0 and _very_negative(b):
            return Abstract(cond, v.shape, fill=float(b))
        if b == 0 and _very_negative(a):
            return Abstract(sympy.Not(cond), v.shape, fill=float(a))
    return Abstract(folded, v.shape, v.fill, v.bias)


# ----------------------------------------------------------------------------- FlexAttention's mask_mod / score_mod


SCORE = sympy.Symbol("score", real=True)
"""``score_mod``'s score argument, in :func:`~autoshard.passes.masks.structure_mask_mod`."""


def evaluate_mod(evaluator: Evaluator, graph: fx.Graph, mod: fx.GraphModule, symbols: tuple, buffers) -> object:
    """The value of a FlexAttention ``mask_mod`` / ``score_mod`` graph with its leading arguments bound to
    ``symbols`` and the rest to the abstract values of ``buffers`` (nodes of ``graph``)."""
    placeholders = [n for n in mod.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(symbols) + len(buffers):
        raise Unstructurable(f"a mask_mod / score_mod of {len(placeholders)} arguments")
    for node, symbol in zip(placeholders, symbols):
        evaluator.bind(node, Abstract(symbol, ()))
    for node, outer in zip(placeholders[len(symbols):], buffers):
        evaluator.bind(node, evaluator(outer))
    output = next(n for n in mod.graph.nodes if n.op == "output").args[0]
    value = evaluator(output)
    foreign = [name for name, leaf in evaluator.leaves.items() if leaf.graph is not graph]
    if foreign or value.shape != ():
        raise Unstructurable(f"{mod.__class__.__name__} computes what the mask pass cannot read "
                             f"({', '.join(evaluator.leaves[n].format_node() for n in foreign) or value.shape})")
    return value.expr

