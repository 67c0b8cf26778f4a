"""Turn attention masks built in the graph back into structured masks; never an S x S tensor.

Models build masks from aranges, broadcast comparisons, gathers of a ``[B, S]`` padding mask, ``&`` and
``where(mask, 0, min)``. This pass evaluates the graph that produces an attention's mask *abstractly*:
every value is a sympy expression of its own index symbols (``d0, d1, ...``), so ``arange(S)`` is
``d0``, ``q_idx[None, None, :, None]`` re-indexes it to ``d2``, ``kv <= q`` is ``d3 <= d2``, and a gather
``mask[batch_idx, kv_idx]`` of a tensor the pass cannot see through is an *uninterpreted function*
``T(d0, d3)`` of the gathered indices. Aligning the mask's last four dims to (batch, head, query, key)
gives one boolean formula in ``b, h, q, k``; its conjuncts are classified:

* only ``q`` and ``k``, linear, or a distance ``|k - q|`` bounded above (a bidirectional sliding window:
  ModernBERT, EmbeddingGemma): bounds on ``k - q`` -> ``causal`` and ``window=(left, right)``;
* no ``q`` (a function of ``b``, ``k``): a key mask, materialized as a ``[B, S]`` tensor;
* ``floor((q + o) / C) == floor((k + o) / C)`` with ``o`` a multiple of ``C`` (positions floor-divided by a
  constant, ``q // C == kv // C``: Llama-4's chunked local attention): ``chunk=C``, block-diagonal, so the
  runtime skips every block whose positions share no chunk;
* ``f(b, q) == f(b, k)``: segment ids ``f`` (packed documents, or chunks shifted by a per-row padding
  offset, ``(q - pad[b]) // C``), materialized as ``[B, S]``;
* ``P(b, k) <= P(b, q)`` for a position tensor ``P`` next to segment ids that are the runs of ``P``
  (``cumsum(diff(P) != 1)``, how transformers detects packed sequences): ``k <= q``, because inside a
  segment positions grow by one per token. When both come from outside the graph (an earlier graph made
  them: FlexAttention's ``mask_mod`` reads them from its closure), the graph cannot see that the segments are
  runs of ``P``: an ``autoshard::check_runs`` node before the attention checks it on every call (segment ids
  that never decrease, positions that grow by one inside a segment) and raises when it does not hold;
* anything else: not structurable -- the attention keeps its dense mask and is computed on gathered
  keys (recorded in the plan), never on a wrong mask.

A buffer (or any tensor attribute of a module that needs no gradient) is module state, not an input: its
values are read when the graph is compiled (a placeholder dynamo lifted from the module, see
:func:`~autoshard.passes.graph.real_value`, or a ``get_attr``). One that holds a band -- one value where ``lo <= k - q <= hi``, another elsewhere, as
nanoGPT's ``tril(ones(N, N))`` -- is that band's formula (a ``Piecewise`` in ``q`` and ``k``, folded
through the comparisons that read it), so ``att.masked_fill(bias[:, :, :T, :T] == 0, -inf)`` is causal.
The values are then guarded: an ``autoshard::check_band`` node before the attention checks on every
call that the buffer is the tensor it was, at the version it was (and verifies its values again when
not; :mod:`autoshard.runtime.sequence_ops`). Buffers on the meta device (a dry-run plan of a model
built on meta) have no values to read: their masks stay dense.

Materialized tensors are plain graph nodes, so inference splits them along the sequence like any
other per-token value.
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

from ..runtime.sequence_ops import Band, constant_band
from .graph import new_node as _new
from .graph import real_value
from .ops import canonical, is_tensor_node, permutation, shape_of, value_of

__all__ = ["StructuredMask", "structure_mask", "structure_mask_mod", "Unstructurable", "empty_rows_of", "MASKING_FILL", "SWAMPING_FILL"]

B, H, Q, K = sympy.symbols("b h q k", integer=True, nonnegative=True)

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


@dataclass
class StructuredMask:
    """A structured attention mask, as the graph builds it (its tensors are graph nodes). The runtime's
    position-only part is :class:`autoshard.runtime.attention.MaskSpec`."""

    causal: bool = False
    window: tuple[int, int] | None = None
    """(left, right) as flash-attn: key j visible to query i iff i - left <= j <= i + right; -1 = unbounded."""
    chunk: int = 0
    """Chunked local attention: key j visible to query i only if i // chunk == j // chunk (0: none)."""
    key_mask: fx.Node | None = None
    """[B, S] bool, True = may be attended."""
    segment_ids: fx.Node | None = None
    """[B, S] int: attend within equal ids only."""
    alibi_slopes: fx.Node | None = None
    """[H] float32: ALiBi, every visible score gets ``slope[h] * (k - q)`` (see :func:`structure_mask`)."""
    position_bias: fx.Node | None = None
    """[H, q_len + k_len - 1]: a relative-position table, every visible score gets ``position_bias[h, k - q + q_len -
    1]`` (T5's learned buckets; see :func:`structure_mask`)."""
    empty_rows: str = "zero"
    """What a query row that sees no key gets: ``"zero"`` (boolean masks, as SDPA), ``"uniform"`` (an
    additive mask filled with ~finfo.min: every score rounds to the fill, so softmax is uniform over all
    keys), ``"scores"`` (a milder fill: softmax over all keys of the unmasked scores, which the rewrite
    computes on gathered keys only when some rank has such a row)."""


def empty_rows_of(fill: float | None) -> str:
    """The ``StructuredMask.empty_rows`` of a mask whose masked scores are set to ``fill``."""
    if fill is None or fill == float("-inf"):
        return "zero"
    return "uniform" if fill <= SWAMPING_FILL else "scores"


# ----------------------------------------------------------------------------- abstract values


@dataclass(frozen=True)
class _Abs:
    expr: object  # sympy expression (bool-valued for masks, numeric otherwise)
    shape: tuple[int, ...]
    fill: float | None = None  # a float (additive) mask: ``bias`` where expr holds, ``fill`` elsewhere
    bias: object = 0  # with ``fill``: the numeric expression added where the mask holds (ALiBi's position bias)


def _sym(d: int) -> sympy.Symbol:
    return sympy.Symbol(f"d{d}", integer=True, nonnegative=True)


def _reindex(v: _Abs, mapping: dict[int, object], shape: tuple[int, ...]) -> _Abs:
    if not mapping:
        return _Abs(v.expr, shape, v.fill, v.bias)
    subs = {_sym(d): e for d, e in mapping.items()}
    return _Abs(sympy.sympify(v.expr).xreplace(subs), shape, v.fill, sympy.sympify(v.bias).xreplace(subs))


def _broadcast_to(v: _Abs, shape: tuple[int, ...]) -> _Abs:
    lead = len(shape) - len(v.shape)
    mapping = {}
    for d, s in enumerate(v.shape):
        mapping[d] = sympy.Integer(0) if (s == 1 and shape[lead + d] != 1) else _sym(lead + d)
    return _reindex(v, mapping, shape)


def _leaf(node: fx.Node) -> _Abs:
    shape = shape_of(node)
    fn = sympy.Function(f"T_{node.name}")
    args = [sympy.Integer(0) if s == 1 else _sym(d) for d, s in enumerate(shape)]
    expr = fn(*args) if args else fn(sympy.Integer(0))
    if value_of(node).dtype == torch.bool:
        expr = sympy.Ne(expr, 0)
    return _Abs(expr, shape)


class _Evaluator:
    """Abstract interpretation of the subgraph producing a mask (see the module docstring)."""

    def __init__(self):
        self.cache: dict[fx.Node, _Abs] = {}
        self.leaves: dict[str, fx.Node] = {}
        self.bands: dict[fx.Node, Band] = {}
        """Buffers read as bands (each needs a guard)."""

    def __call__(self, node) -> _Abs:
        if not isinstance(node, fx.Node):
            return _Abs(sympy.sympify(bool(node) if isinstance(node, bool) else node), ())
        if node not in self.cache:
            self.cache[node] = _settle(self._eval(node))
        return self.cache[node]

    def bind(self, node: fx.Node, value: _Abs) -> None:
        """Evaluate ``node`` as ``value`` (the arguments of a FlexAttention ``mask_mod``)."""
        self.cache[node] = value

    def leaf(self, node: fx.Node) -> _Abs:
        self.leaves[f"T_{node.name}"] = node
        return _leaf(node)

    def _eval(self, node: fx.Node) -> _Abs:
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
            return _Abs(sympy.sympify(op["start"]) + sympy.sympify(op["step"]) * _sym(0), shape)
        fills = {"new_ones": 1, "ones": 1, "ones_like": 1, "new_zeros": 0, "zeros": 0, "zeros_like": 0}
        if name == "factory" and (target in fills or "full" in target):
            fill = fills.get(target, node.kwargs.get("fill_value", node.args[-1] if node.args else None))
            if isinstance(fill, (bool, int, float)):
                if value_of(node).dtype == torch.bool:
                    return _Abs(sympy.true if fill else sympy.false, shape)
                return _Abs(sympy.sympify(fill), shape)
        if name in ("identity", "to"):
            src = self(op["input"])
            if value_of(node).dtype == torch.bool and value_of(op["input"]).dtype != torch.bool:
                return _Abs(sympy.Ne(src.expr, 0), shape)
            return src
        if name == "view" and _only_unit_dims_change(shape_of(op["input"]), shape):
            return _unit_reshape(self(op["input"]), shape)
        if name == "expand":
            return _broadcast_to(self(op["input"]), shape)
        if name == "permute":
            perm = permutation(node)
            return _reindex(self(op["input"]), {p: _sym(d) for d, p in enumerate(perm)}, shape)
        if name == "getitem":
            return self._index(node, op, shape)
        if target in ("triu", "tril") and len(shape) >= 2:
            return self._triangle(node, target, shape)
        if name == "pointwise":
            return self._pointwise(node, name_fn, shape)
        return self.leaf(node)

    def _pointwise(self, node, fn, shape) -> _Abs:
        tensor_args = [a for a in node.args if isinstance(a, fx.Node)]
        vals = [_broadcast_to(self(a), shape) if isinstance(a, fx.Node) else self(a) for a in node.args]
        numeric = [_numeric(a, v) for a, v in zip(node.args, vals)]
        if fn == "where":
            cond, a, b = vals
            if numeric[1] and _very_negative(b.expr):
                return _Abs(cond.expr, shape, fill=float(b.expr), bias=a.expr)
            if numeric[2] and _very_negative(a.expr):
                return _Abs(sympy.Not(cond.expr), shape, fill=float(a.expr), bias=b.expr)
            return self.leaf(node)
        if fn == "masked_fill" and len(vals) == 3 and _very_negative(vals[2].expr):
            x, hide = vals[0], sympy.Not(vals[1].expr)
            if x.fill is not None:
                return _Abs(sympy.And(x.expr, hide), shape, fill=min(x.fill, float(vals[2].expr)), bias=x.bias)
            return _Abs(hide, shape, fill=float(vals[2].expr), bias=x.expr) if numeric[0] else self.leaf(node)
        binary = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
                  "le": sympy.Le, "lt": sympy.Lt, "ge": sympy.Ge, "gt": sympy.Gt, "eq": sympy.Eq, "ne": sympy.Ne,
                  "bitwise_and": sympy.And, "logical_and": sympy.And, "bitwise_or": sympy.Or, "logical_or": sympy.Or}
        floor_division = fn == "floor_divide" or (fn == "div" and node.kwargs.get("rounding_mode") == "floor")
        if floor_division and len(vals) == 2 and sympy.sympify(vals[1].expr).is_Integer and vals[1].expr != 0:
            return _Abs(sympy.floor(vals[0].expr / vals[1].expr), shape)
        if (fn == "div" and len(vals) == 2 and node.kwargs.get("rounding_mode") is None
                and vals[0].fill is None and vals[1].fill is None):  # a score over a soft-cap (score_mod)
            return _Abs(vals[0].expr / vals[1].expr, shape)
        if fn in binary and len(vals) == 2:
            a, b = vals
            if fn == "mul" and value_of(node).dtype == torch.bool:
                return _Abs(sympy.And(a.expr, b.expr), shape)
            if fn in ("add", "sub") and (a.fill is not None or b.fill is not None):
                if a.fill is not None and b.fill is not None and fn == "add":
                    return _Abs(sympy.And(a.expr, b.expr), shape, fill=a.fill + b.fill, bias=a.bias + b.bias)
                if a.fill is not None and numeric[1]:  # a mask plus (minus) a position bias
                    return _Abs(a.expr, shape, fill=a.fill, bias=binary[fn](a.bias, b.expr))
                if b.fill is not None and numeric[0] and fn == "add":
                    return _Abs(b.expr, shape, fill=b.fill, bias=b.bias + a.expr)
                return self.leaf(node)
            return _Abs(binary[fn](a.expr, b.expr), shape)
        if fn in ("bitwise_not", "logical_not") and len(tensor_args) == 1:
            return _Abs(sympy.Not(vals[0].expr), shape)
        unary = {"neg": operator.neg, "abs": sympy.Abs, "tanh": sympy.tanh}
        if fn in unary and len(vals) == 1:
            return _Abs(unary[fn](vals[0].expr), shape)
        return self.leaf(node)

    def _triangle(self, node, which: str, shape) -> _Abs:
        """``triu`` / ``tril`` of a constant: a bool band, or an additive mask of a very negative fill."""
        src = self(node.args[0])
        diagonal = node.args[1] if len(node.args) > 1 else node.kwargs.get("diagonal", 0)
        n = len(shape)
        offset = _sym(n - 1) - _sym(n - 2)
        band = sympy.Ge(offset, diagonal) if which == "triu" else sympy.Le(offset, diagonal)
        if src.expr is sympy.true:
            return _Abs(band, shape)
        if _very_negative(src.expr):
            return _Abs(sympy.Not(band), shape, fill=float(src.expr))
        return self.leaf(node)

    def _index(self, node, op, shape) -> _Abs:
        index = op["index"] if isinstance(op["index"], tuple) else (op["index"],)
        src = op["input"]
        src_shape = shape_of(src)
        if all(isinstance(i, fx.Node) for i in index) and len(index) == len(src_shape):
            idx_vals = [_broadcast_to(self(i), shape) for i in index]
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
                    mapping[d] = _sym(od)
                    d, od = d + 1, od + 1
            elif isinstance(it, slice) and it == slice(None, None, None):
                mapping[d] = _sym(od)
                d, od = d + 1, od + 1
            elif isinstance(it, slice) and it.step in (None, 1) and (it.start or 0) >= 0:
                mapping[d] = _sym(od) + (it.start or 0)
                d, od = d + 1, od + 1
            else:
                return self.leaf(node)
        while d < len(src_shape):
            mapping[d] = _sym(od)
            d, od = d + 1, od + 1
        return _reindex(self(src), mapping, shape)


def _only_unit_dims_change(a, b) -> bool:
    return [s for s in a if s != 1] == [s for s in b if s != 1]


def _unit_reshape(v: _Abs, shape) -> _Abs:
    src_dims = [d for d, s in enumerate(v.shape) if s != 1]
    dst_dims = [d for d, s in enumerate(shape) if s != 1]
    mapping = {d: sympy.Integer(0) for d, s in enumerate(v.shape) if s == 1}
    mapping.update({s: _sym(t) for s, t in zip(src_dims, dst_dims)})
    return _reindex(v, mapping, tuple(shape))


def _numeric(arg, v: _Abs) -> bool:
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


def _buffer_name(node: fx.Node) -> str:
    """Where the buffer ``node`` reads lives, for messages: dynamo's source while it is known, else the node."""
    if node.op == "get_attr":
        return node.target
    name = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", node.name)
    return name() if callable(name) else name


def _band_value(band: Band, value: torch.Tensor) -> _Abs:
    """The abstract value of a buffer holding ``band``: its formula in its own last two index symbols."""
    shape = tuple(value.shape)
    n = len(shape)
    offset = _sym(n - 1) - _sym(n - 2)
    cond = sympy.And(*([sympy.Ge(offset, band.lo)] if band.lo > 1 - shape[-2] else []),
                     *([sympy.Le(offset, band.hi)] if band.hi < shape[-1] - 1 else []))
    if value.dtype == torch.bool:
        return _Abs(cond if band.inside else sympy.Not(cond), shape)
    if band.inside == band.outside:
        return _Abs(sympy.sympify(band.inside), shape)
    if value.dtype.is_floating_point and 0.0 in (band.inside, band.outside):  # 0 and very negative: additive
        other = band.outside if band.inside == 0.0 else band.inside
        if other <= MASKING_FILL:
            return _Abs(cond if band.inside == 0.0 else sympy.Not(cond), shape, fill=other)
    return _Abs(sympy.Piecewise((sympy.sympify(band.inside), cond), (sympy.sympify(band.outside), True)), shape)


def _settle(v: _Abs) -> _Abs:
    """``v`` with its ``Piecewise`` (a band buffer's) folded out: comparisons of it become boolean formulas, an
    expression of values 0 and very negative an additive mask."""
    if not isinstance(v.expr, sympy.Basic) or not v.expr.has(sympy.Piecewise):
        return v
    folded = sympy.piecewise_fold(v.expr)
    if not isinstance(folded, sympy.Piecewise):
        return _Abs(folded, v.shape, v.fill, v.bias)
    pieces = folded.args
    if all(value in (sympy.true, sympy.false) for value, _ in pieces):
        terms, before = [], sympy.false
        for value, cond in pieces:
            terms.append(sympy.And(value, cond, sympy.Not(before)))
            before = sympy.Or(before, cond)
        return _Abs(sympy.Or(*terms), v.shape, v.fill, v.bias)
    if len(pieces) == 2 and v.fill is None and pieces[1][1] is sympy.true:
        (a, cond), (b, _) = pieces
        if a == 0 and _very_negative(b):
            return _Abs(cond, v.shape, fill=float(b))
        if b == 0 and _very_negative(a):
            return _Abs(sympy.Not(cond), v.shape, fill=float(a))
    return _Abs(folded, v.shape, v.fill, v.bias)


# ----------------------------------------------------------------------------- classification


def _leaf_calls(expr) -> set:
    return set(sympy.sympify(expr).atoms(AppliedUndef))


_FLIPPED = {sympy.Le: sympy.Ge, sympy.Lt: sympy.Gt, sympy.Ge: sympy.Le, sympy.Gt: sympy.Lt}


def _k_minus_q_bounds(atom):
    """(lo, hi) that a q/k atom puts on k - q, or None: a linear comparison, or a bound on a distance
    ``|k - q|`` (a bidirectional sliding window)."""
    if not isinstance(atom, sympy.core.relational.Relational) or isinstance(atom, (sympy.Eq, sympy.Ne)):
        return None
    diff = sympy.expand(atom.lhs - atom.rhs)
    if diff.has(sympy.Abs):
        return _distance_bounds(diff, type(atom))
    return _linear_bounds(diff, type(atom))


def _distance_bounds(diff, op):
    """``a * |x| + c OP 0``: an upper bound ``|x| <= m`` is ``x <= m`` and ``-x <= m``, bounds on both sides;
    a lower bound on a distance is two intervals, not a band (None)."""
    distances = diff.atoms(sympy.Abs)
    if len(distances) != 1:
        return None
    (distance,) = distances
    a = diff.coeff(distance)
    const = sympy.expand(diff - a * distance)
    if not (a.is_number and const.is_number) or a == 0:
        return None
    op = _FLIPPED[op] if a < 0 else op
    if op not in (sympy.Le, sympy.Lt):
        return None
    x, m = distance.args[0], -const / a
    sides = [_linear_bounds(sympy.expand(sign * x - m), op) for sign in (1, -1)]
    if None in sides:
        return None
    return max(sides[0][0], sides[1][0]), min(sides[0][1], sides[1][1])


def _linear_bounds(diff, op):
    """(lo, hi) that ``diff OP 0`` puts on k - q when ``diff`` is linear in k - q, or None."""
    poly = sympy.Poly(diff, K, Q)
    if poly.total_degree() != 1:
        return None
    a, c_q = poly.coeff_monomial(K), poly.coeff_monomial(Q)
    const = diff.subs({K: 0, Q: 0})
    if a == 0 or c_q != -a or not const.is_number:
        return None
    # a*(k - q) + const  OP  0
    bound = -const / a
    if a < 0:
        op = _FLIPPED[op]
    if op is sympy.Le:
        return (-sympy.oo, sympy.floor(bound))
    if op is sympy.Lt:
        return (-sympy.oo, sympy.ceiling(bound) - 1)
    if op is sympy.Ge:
        return (sympy.ceiling(bound), sympy.oo)
    return (sympy.floor(bound) + 1, sympy.oo)


def _chunk_size(atom) -> int | None:
    """``C`` when ``atom`` is ``floor((q + o) / C) == floor((k + o) / C)`` with the same constant ``C`` and an
    offset ``o`` that is a multiple of ``C`` (the same chunks as ``o = 0``; sympy moves ``o / C`` out of the
    floor), else None."""
    if not isinstance(atom, sympy.Eq):
        return None
    terms = sympy.Add.make_args(sympy.expand(atom.lhs - atom.rhs))
    floors = [t for t in terms if t.has(sympy.floor)]
    if len(floors) != 2 or sum(t for t in terms if not t.has(sympy.floor)) != 0:
        return None
    sizes = {}
    for term in floors:
        sign, floor = term.as_coeff_Mul()
        if sign not in (1, -1) or not isinstance(floor, sympy.floor):
            return None
        arg = sympy.expand(floor.args[0])
        syms = arg.free_symbols
        if len(syms) != 1 or not syms <= {Q, K}:
            return None
        (sym,) = syms
        inverse, offset = arg.coeff(sym), arg.subs(sym, 0)  # arg = sym / C + o / C
        if not (inverse.is_Rational and inverse > 0 and inverse.p == 1 and offset.is_integer):
            return None
        sizes[sym] = (int(inverse.q), sign)
    if set(sizes) != {Q, K} or sizes[Q][0] != sizes[K][0] or sizes[Q][1] == sizes[K][1] or sizes[Q][0] < 2:
        return None
    return sizes[Q][0]


def _is_run_segments(seg: fx.Node, pos: fx.Node) -> bool:
    """``seg`` is ``cumsum(diff(P) != 1)`` along the last dim, ``P`` being ``pos`` (or what ``pos`` expands)."""
    op = canonical(seg)
    if op is None or op.name != "cumsum":
        return False
    ne = op["input"]
    ne_op = canonical(ne)
    if ne_op is None or ne_op.get("fn") != "ne" or ne.args[1] != 1:
        return False
    diff = ne.args[0]
    diff_op = canonical(diff)
    if diff_op is None or diff_op.name != "diff" or diff_op["n"] != 1:
        return False
    return _same_values(diff_op["input"], pos)


def _position_comparison(atom, leaves: dict[str, fx.Node]):
    """``(P, (lo, hi))`` when ``atom`` compares one position tensor ``P`` at the key and at the query,
    ``a * P(b, k) - a * P(b, q) + c OP 0`` (causal ``P(k) <= P(q)``, a window ``P(k) > P(q) - W``), with the bounds
    it puts on ``k - q`` where ``P`` grows by one per token; ``(None, None)`` otherwise."""
    diff = sympy.expand(atom.lhs - atom.rhs)
    calls = sorted(_leaf_calls(diff), key=str)
    if len(calls) != 2 or calls[0].func != calls[1].func:
        return None, None
    at_key = [c for c in calls if c.args and c.args[-1] == K and Q not in c.free_symbols]
    at_query = [c for c in calls if c.args and c.args[-1] == Q and K not in c.free_symbols]
    if len(at_key) != 1 or len(at_query) != 1 or at_key[0].args[:-1] != at_query[0].args[:-1]:
        return None, None
    bounds = _k_minus_q_bounds(type(atom)(diff.xreplace({at_key[0]: K, at_query[0]: Q}), 0))
    return (leaves.get(str(calls[0].func)), bounds) if bounds is not None else (None, None)


def _per_position(node: fx.Node) -> bool:
    """Whether ``node`` holds one value per (batch row, position): ``[B, S]`` or ``[1, S]``."""
    return is_tensor_node(node) and len(shape_of(node)) == 2 and not value_of(node).is_floating_point()


def _same_values(a: fx.Node, b: fx.Node) -> bool:
    """True when ``a`` and ``b`` are the same tensor up to expand / identity / broadcast-only views."""
    def root(n):
        while isinstance(n, fx.Node):
            op = canonical(n)
            if op is None or op.name not in ("expand", "identity", "to"):
                return n
            n = op["input"]
        return n
    return root(a) is root(b)


def structure_mask(graph: fx.Graph, attention: fx.Node, attn_mask, is_causal: bool, q_len: int, k_len: int,
                   batch: int, heads: int) -> StructuredMask:
    """The structured form of ``attn_mask`` (and ``is_causal``) for the attention ``attention``; materialized
    key masks / segment ids / ALiBi slopes are inserted before it. Raises :class:`Unstructurable`.

    A float mask may add a position bias where it holds, a sum of two kinds of terms:

    * ``A(h) * k + C(b, h, q)``: ALiBi. ``C`` is the same for every key of a row, which softmax cancels, so it
      is ``A(h) * (k - q)`` (Bloom adds ``slope * k``, the ALiBi paper ``-slope * (q - k)``), and ``A`` is
      materialized as the ``[H]`` slopes;
    * ``E(q, k, h)``, an embedding table looked up at indices computed elementwise from ``k - q`` alone (T5's
      learned relative-position buckets, ``table[bucket(k - q), h]``): the index computation is emitted again
      on the vector of every distance, ``-(q_len - 1) .. k_len - 1``, and the table looked up there, so the bias
      is a ``[H, q_len + k_len - 1]`` value (``position_bias``) that carries the table's gradient."""
    atoms = []
    if is_causal:
        atoms.append(sympy.Le(K, Q))
    evaluator = _Evaluator()
    bias, empty_rows = sympy.Integer(0), "zero"
    if attn_mask is not None:
        v = evaluator(attn_mask)
        if value_of(attn_mask).dtype != torch.bool and v.fill is None:  # a bias alone
            v = _Abs(sympy.true, v.shape, bias=v.expr)
        empty_rows = empty_rows_of(v.fill)
        full = _broadcast_to(v, (1,) * max(0, 4 - len(v.shape)) + v.shape)
        n = len(full.shape)
        names = {n - 1: K, n - 2: Q, n - 3: H, n - 4: B}
        renamed = {_sym(d): names.get(d, sympy.Integer(0)) for d in range(n)}
        expr = sympy.sympify(full.expr).xreplace(renamed)
        if full.shape[-2] not in (1, q_len) or full.shape[-1] not in (1, k_len):
            raise Unstructurable("mask shape does not match the attention")
        bias = sympy.sympify(full.bias).xreplace(renamed)
        expr = sympy.simplify_logic(expr) if expr.has(sympy.Or) else expr
        atoms += list(expr.args) if isinstance(expr, sympy.And) else [expr]
    return _classify(graph, attention, evaluator, atoms, bias, empty_rows, q_len, k_len, batch, heads)


def structure_mask_mod(graph: fx.Graph, attention: fx.Node, mask_mod: fx.GraphModule | None, mask_buffers,
                       score_mod: fx.GraphModule | None, score_buffers, q_len: int, k_len: int, batch: int,
                       heads: int) -> tuple[StructuredMask, float]:
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` and ``score_mod(score, b, h, q_idx, kv_idx)`` (their
    traced graphs; the tensors they read from outside, ``*_buffers``, are nodes of ``graph``) as a structured mask
    and a soft-cap: the two graphs are evaluated abstractly with the index arguments bound to the symbols ``b, h,
    q, k`` and ``score`` to a symbol of its own, so ``kv_idx <= q_idx`` is causal, ``doc[q_idx] == doc[kv_idx]``
    segments of ``doc``, and what ``score_mod`` adds to ``score`` a bias (ALiBi's ``slope[h] * (kv_idx -
    q_idx)``); ``cap * tanh(score / cap)`` is a soft-cap. Rows that see no key get 0, as FlexAttention gives
    them. Raises :class:`Unstructurable`."""
    evaluator = _Evaluator()
    atoms = []
    if mask_mod is not None:
        expr = _evaluate_mod(evaluator, graph, mask_mod, (B, H, Q, K), mask_buffers)
        expr = sympy.simplify_logic(expr) if isinstance(expr, sympy.Basic) and expr.has(sympy.Or) else expr
        atoms = list(expr.args) if isinstance(expr, sympy.And) else [expr]
    bias, softcap = sympy.Integer(0), 0.0
    if score_mod is not None:
        bias, softcap = _score_terms(_evaluate_mod(evaluator, graph, score_mod, (SCORE, B, H, Q, K), score_buffers))
    return _classify(graph, attention, evaluator, atoms, bias, "zero", q_len, k_len, batch, heads), softcap


SCORE = sympy.Symbol("score", real=True)
"""``score_mod``'s score argument, in :func:`structure_mask_mod`."""


def _evaluate_mod(evaluator: "_Evaluator", graph: fx.Graph, mod: fx.GraphModule, symbols: tuple, buffers) -> object:
    """The value of a FlexAttention ``mask_mod`` / ``score_mod`` graph with its leading arguments bound to
    ``symbols`` and the rest to the abstract values of ``buffers`` (nodes of ``graph``)."""
    placeholders = [n for n in mod.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(symbols) + len(buffers):
        raise Unstructurable(f"a mask_mod / score_mod of {len(placeholders)} arguments")
    for node, symbol in zip(placeholders, symbols):
        evaluator.bind(node, _Abs(symbol, ()))
    for node, outer in zip(placeholders[len(symbols):], buffers):
        evaluator.bind(node, evaluator(outer))
    output = next(n for n in mod.graph.nodes if n.op == "output").args[0]
    value = evaluator(output)
    foreign = [name for name, leaf in evaluator.leaves.items() if leaf.graph is not graph]
    if foreign or value.shape != ():
        raise Unstructurable(f"{mod.__class__.__name__} computes what the mask pass cannot read "
                             f"({', '.join(evaluator.leaves[n].format_node() for n in foreign) or value.shape})")
    return value.expr


def _score_terms(value) -> tuple[object, float]:
    """(bias, soft-cap) of a ``score_mod``'s value: ``score + bias`` or ``cap * tanh(score / cap) + bias`` with a
    bias free of the score."""
    terms = sympy.Add.make_args(sympy.expand(value))
    scored = [t for t in terms if t.has(SCORE)]
    bias = sympy.Add(*(t for t in terms if not t.has(SCORE)))
    if scored == [SCORE]:
        return bias, 0.0
    if len(scored) == 1:
        cap, tanh = scored[0].as_coeff_Mul()
        if isinstance(tanh, sympy.tanh) and cap > 0 and sympy.simplify(tanh.args[0] * cap - SCORE) == 0:
            return bias, float(cap)
    raise Unstructurable(f"a score_mod that computes {value}: not the score plus a bias, or a soft-cap of it")


def _classify(graph: fx.Graph, attention: fx.Node, evaluator: "_Evaluator", atoms: list, bias, empty_rows: str,
              q_len: int, k_len: int, batch: int, heads: int) -> StructuredMask:
    """The structured mask of the conjuncts ``atoms`` (formulas in ``b, h, q, k``) and the additive ``bias`` (see
    :func:`structure_mask`); materialized tensors are inserted before ``attention``."""
    spec = StructuredMask(empty_rows=empty_rows)
    bias, table = _relative_table(bias, evaluator.leaves)
    if table is not None:
        with graph.inserting_before(attention):
            spec.position_bias = _tabulate(graph, table, evaluator.leaves, q_len, k_len)
    slopes = _alibi_slopes(bias, evaluator.leaves)
    if slopes is not None:
        if spec.empty_rows == "scores":
            raise Unstructurable("ALiBi with a mild fill (rows that see no key attend by their scores)")
        with graph.inserting_before(attention):
            spec.alibi_slopes = _materialize_slopes(graph, slopes, heads, evaluator.leaves)

    lo, hi = -sympy.oo, sympy.oo
    key_atoms, segments, position_atoms = [], [], []
    for atom in atoms:
        if atom is sympy.true:
            continue
        if atom is sympy.false:
            raise Unstructurable("the mask hides every key")
        syms = atom.free_symbols
        calls = _leaf_calls(atom)
        if H in syms:
            raise Unstructurable("a mask that differs per head")
        bounds = _k_minus_q_bounds(atom) if not calls else None
        chunk = _chunk_size(atom) if not calls else None
        if bounds is not None:
            lo, hi = max(lo, bounds[0]), min(hi, bounds[1])
        elif chunk is not None:
            if spec.chunk not in (0, chunk):
                raise Unstructurable(f"two chunk sizes, {spec.chunk} and {chunk}")
            spec.chunk = chunk
        elif Q not in syms:
            key_atoms.append(atom)
        elif isinstance(atom, sympy.Eq) and sympy.simplify(atom.lhs.xreplace({Q: K}) - atom.rhs) == 0 and K not in atom.lhs.free_symbols:
            segments.append(atom.lhs)
        elif isinstance(atom, sympy.Eq) and sympy.simplify(atom.rhs.xreplace({Q: K}) - atom.lhs) == 0 and K not in atom.rhs.free_symbols:
            segments.append(atom.rhs)
        elif K not in syms:
            raise Unstructurable("a mask over queries (rows with no visible key)")
        elif isinstance(atom, sympy.core.relational.Relational):
            position_atoms.append(atom)
        else:
            raise Unstructurable(f"a mask term {atom} that is not a conjunction of comparisons")

    guards = []
    for atom in position_atoms:  # P(b, k) OP P(b, q) + c inside runs of P: the same as k OP q + c
        pos, bounds = _position_comparison(atom, evaluator.leaves)
        tables = [evaluator.leaves[str(s.func)] for s in segments if isinstance(s, AppliedUndef)]
        runs = [seg for seg in tables if _is_run_segments(seg, pos)] if pos is not None else []
        if not runs and pos is not None and len(tables) == 1 and _per_position(pos) and _per_position(tables[0]):
            guards.append((tables[0], pos))  # made elsewhere (an earlier graph): checked where it is used
        elif not runs:
            raise Unstructurable(f"a data-dependent comparison {atom}")
        lo, hi = max(lo, bounds[0]), min(hi, bounds[1])

    if lo > hi:
        raise Unstructurable("the mask hides every key")
    if lo > 0 or hi < 0:
        raise Unstructurable("a band that excludes the diagonal")
    if hi == 0:
        spec.causal = True
        spec.window = None if lo == -sympy.oo else (int(-lo), 0)
    elif hi != sympy.oo or lo != -sympy.oo:
        spec.window = (-1 if lo == -sympy.oo else int(-lo), -1 if hi == sympy.oo else int(hi))

    with graph.inserting_before(attention):
        if key_atoms:
            spec.key_mask = _materialize(graph, sympy.And(*key_atoms), K, batch, k_len, evaluator.leaves, torch.bool)
        if len(segments) > 1:
            segments = [sympy.Tuple(*segments)]
        if segments:
            if isinstance(segments[0], sympy.Tuple):
                raise Unstructurable("several segment-id tensors")
            spec.segment_ids = _materialize(graph, segments[0], Q, batch, q_len, evaluator.leaves, None)
        for buffer, band in evaluator.bands.items():  # the mask relies on the values read: guard them
            _new(graph, torch.ops.autoshard.check_band.default,
                 (buffer, band.inside, band.outside, band.lo, band.hi, _buffer_name(buffer)))
        for seg, pos in guards:
            _new(graph, torch.ops.autoshard.check_runs.default, (seg, pos, f"{seg.name}, {pos.name}"))
    return spec


def _relative_table(bias, leaves: dict[str, fx.Node]):
    """``(rest, E(...))``: ``bias`` split into the one term that is an embedding lookup ``E(q, k, h)`` (None when
    there is none) and the rest."""
    bias = sympy.expand(bias)
    lookups = [term for term in sympy.Add.make_args(bias) if isinstance(term, AppliedUndef) and K in term.free_symbols
               and canonical(leaves[str(term.func)]) is not None
               and canonical(leaves[str(term.func)]).name == "embedding"]
    if len(lookups) != 1:
        return bias, None
    table = lookups[0]
    if len(table.args) != 3 or table.args[2] != H or set(table.args[:2]) != {Q, K}:
        raise Unstructurable(f"a position table {table} not read at (query, key, head)")
    return bias - table, table


def _tabulate(graph: fx.Graph, table, leaves: dict[str, fx.Node], q_len: int, k_len: int) -> fx.Node:
    """The ``[H, q_len + k_len - 1]`` values of the lookup ``table`` (``E(q, k, h)``) at every distance ``k - q``
    (see :func:`structure_mask`), as graph nodes."""
    lookup = leaves[str(table.func)]
    op = canonical(lookup)
    index = op["input"]
    first, second = _sym(0), _sym(1)
    distance = second - first if table.args[0] == Q else first - second  # k - q in the index's own dims
    roots, chain = {}, []
    evaluator = _Evaluator()

    def visit(node):
        if not isinstance(node, fx.Node) or node in roots or node in chain:
            return
        if is_tensor_node(node) and not value_of(node).dtype.is_floating_point:
            shift = _distance_shift(evaluator, node, distance, shape_of(index))
            if shift is not None:
                roots[node] = shift
                return
        node_op = canonical(node)
        elementwise = node_op is not None and (node_op.name in ("pointwise", "to", "identity") or (
            node_op.name == "factory" and getattr(node.target, "__name__", str(node.target)).endswith("_like")))
        if not elementwise or shape_of(node) not in (shape_of(index), ()):
            raise Unstructurable(f"a position table's indices computed by {node.format_node()}, not elementwise "
                                 f"from k - q")
        for arg in node.all_input_nodes:
            if is_tensor_node(arg) and shape_of(arg) not in ((), (1,)):
                visit(arg)
        chain.append(node)

    visit(index)
    device = value_of(index).device
    vector = _new(graph, torch.arange, (-(q_len - 1), k_len), {"device": device})
    values: dict[fx.Node, fx.Node] = {}
    for root, shift in roots.items():
        shifted = _new(graph, operator.add, (vector, shift)) if shift else vector
        values[root] = _new(graph, torch.Tensor.to, (shifted, value_of(root).dtype))
    for node in sorted(chain, key=list(graph.nodes).index):
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: values.get(n, n))
        values[node] = _new(graph, node.target, args, kwargs, op=node.op)
    args, kwargs = fx.node.map_arg((lookup.args, lookup.kwargs), lambda n: values[index] if n is index else n)
    rows = _new(graph, lookup.target, args, kwargs, op=lookup.op)  # [q_len + k_len - 1, H]
    return _new(graph, torch.Tensor.t, (rows,))


def _distance_shift(evaluator: "_Evaluator", node: fx.Node, distance, shape) -> int | None:
    """``c`` when ``node`` (broadcast to the index's ``shape``) is ``k - q + c``, else None."""
    try:
        rest = sympy.expand(sympy.sympify(_broadcast_to(evaluator(node), tuple(shape)).expr) - distance)
    except (Unstructurable, TypeError):  # not an integer expression the evaluator reads
        return None
    return int(rest) if rest.is_Integer else None


def _alibi_slopes(bias, leaves: dict[str, fx.Node]):
    """``A(h)`` when ``bias`` is ``A(h) * k + C(b, h, q)`` with ``A`` not 0 (see :func:`structure_mask`); None when
    the bias is the same for every key of a row (softmax cancels it). Raises :class:`Unstructurable` otherwise."""
    bias = sympy.expand(bias)
    if K not in bias.free_symbols:
        if any(K in call.free_symbols for call in _leaf_calls(bias)):
            raise Unstructurable("a position bias read from a tensor (a learned relative-position table)")
        return None
    slope = sympy.expand(sympy.diff(bias, K))
    if slope.free_symbols - {H} or slope.has(sympy.Derivative) or K in sympy.expand(bias - slope * K).free_symbols:
        raise Unstructurable(f"a position bias {bias} that is not slope(h) * (k - q)")
    for call in _leaf_calls(slope):
        if getattr(value_of(leaves[str(call.func)]), "requires_grad", False):
            raise Unstructurable("learned ALiBi slopes (the slopes need a gradient)")
    return slope


def _materialize_slopes(graph: fx.Graph, slope, heads: int, leaves: dict[str, fx.Node]) -> fx.Node:
    """The ``[heads]`` float32 slopes ``slope(h)`` as graph nodes."""
    grid = _materialize(graph, slope, H, 1, heads, leaves, None)
    if not isinstance(grid, fx.Node) or value_of(grid).dtype != torch.float32:
        grid = _new(graph, torch.Tensor.to, (_as_node(graph, grid), torch.float32))
    return _new(graph, torch.Tensor.reshape, (grid, (heads,)))


# ----------------------------------------------------------------------------- materialization


def _materialize(graph: fx.Graph, expr, pos_sym, batch: int, length: int, leaves: dict[str, fx.Node], dtype):
    """Graph nodes computing ``expr`` (a function of b and ``pos_sym``) on the [batch, length] grid."""
    emitter = _Emitter(graph, pos_sym, batch, length, leaves)
    out = emitter.emit(expr)
    if not isinstance(out, fx.Node) or shape_of(out) != (batch, length):
        out = _new(graph, torch.Tensor.expand, (_as_node(graph, out), batch, length))
    if dtype is not None and value_of(out).dtype != dtype:
        out = _new(graph, torch.Tensor.to, (out, dtype))
    return out


def _as_node(graph, value):
    if isinstance(value, fx.Node):
        return value
    return _new(graph, torch.tensor, (value,))


class _Emitter:
    def __init__(self, graph, pos_sym, batch, length, leaves):
        self.graph, self.pos_sym, self.batch, self.length, self.leaves = graph, pos_sym, batch, length, leaves
        self.cache = {}
        template = next(iter(leaves.values()), None)
        self.device = value_of(template).device if template is not None else torch.device("cpu")

    def emit(self, expr):
        if expr in self.cache:
            return self.cache[expr]
        out = self._emit(expr)
        self.cache[expr] = out
        return out

    def _grid(self, which):
        n = self.batch if which is B else self.length
        ar = _new(self.graph, torch.arange, (n,), {"device": self.device})
        return _new(self.graph, torch.Tensor.view, (ar, (n, 1) if which is B else (1, n)))

    def _emit(self, expr):
        if expr is sympy.true or expr is True:
            return True
        if expr.is_Number:
            return int(expr) if expr.is_Integer else float(expr)
        if expr is B or expr is self.pos_sym:
            return self._grid(B if expr is B else self.pos_sym)
        if isinstance(expr, AppliedUndef):
            node = self.leaves[str(expr.func)]
            args = expr.args
            if list(args) == _identity_args(node, self.pos_sym):
                return node
            index = tuple(self.emit(a) for a in args)
            index = tuple(_as_node(self.graph, i) if not isinstance(i, (int, fx.Node)) else i for i in index)
            return _new(self.graph, operator.getitem, (node, index))
        binary = {sympy.Eq: operator.eq, sympy.Ne: operator.ne, sympy.Le: operator.le, sympy.Lt: operator.lt,
                  sympy.Ge: operator.ge, sympy.Gt: operator.gt}
        if type(expr) in binary:
            return _new(self.graph, binary[type(expr)], (self.emit(expr.lhs), self.emit(expr.rhs)))
        if isinstance(expr, (sympy.And, sympy.Or)):
            fn = operator.and_ if isinstance(expr, sympy.And) else operator.or_
            return functools.reduce(lambda a, b: _new(self.graph, fn, (a, b)), [self.emit(a) for a in expr.args])
        if isinstance(expr, sympy.Not):
            return _new(self.graph, operator.invert, (self.emit(expr.args[0]),))
        if isinstance(expr, sympy.Add):
            return functools.reduce(lambda a, b: _new(self.graph, operator.add, (a, b)), [self.emit(a) for a in expr.args])
        if isinstance(expr, sympy.Mul):
            return functools.reduce(lambda a, b: _new(self.graph, operator.mul, (a, b)), [self.emit(a) for a in expr.args])
        if isinstance(expr, sympy.floor):  # floor(n / d) of an integer expression n and a constant d
            numerator, denominator = sympy.fraction(sympy.together(expr.args[0]))
            if denominator.is_Integer:
                return _new(self.graph, operator.floordiv, (self.emit(sympy.expand(numerator)), int(denominator)))
        raise Unstructurable(f"cannot build {expr}")


def _identity_args(node: fx.Node, pos_sym) -> list:
    """The argument list under which a [B, S] (or [1, S]) leaf is read at (b, position) unchanged."""
    shape = shape_of(node)
    if len(shape) != 2:
        return []
    return [sympy.Integer(0) if shape[0] == 1 else B, pos_sym]
