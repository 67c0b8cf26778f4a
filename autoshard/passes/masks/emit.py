"""Graph emission of the mask pass: the parts of a structured mask that are tensors, built as graph nodes.

What the recognizers (:mod:`.recognizers`) leave as formulas is computed in the graph, before the attention, never
as an ``S x S`` value:

* a key mask and segment ids, formulas of ``b`` and one position, on the ``[B, S]`` grid (:func:`materialize`: an
  ``arange`` per symbol, the tensors the formula reads indexed where they are read, the formula's operators);
* ALiBi's slopes ``A(h)``, on the ``[H]`` grid (:func:`materialize_slopes`);
* a relative-position table ``E(q, k, h)`` looked up at indices computed elementwise from ``k - q`` (T5's learned
  buckets): the index computation again, on the vector of every distance ``-(q_len - 1) .. k_len - 1``, and the
  table looked up there, a ``[H, q_len + k_len - 1]`` value that carries the table's gradient (:func:`tabulate`);
* the guards of what the mask relies on (:func:`emit_guards`): the values of a buffer read as a band, the runs of
  positions made by an earlier graph.

The nodes are plain graph nodes: inference splits them along the sequence like any other per-token value.
"""

from __future__ import annotations

import functools
import operator

import sympy
import torch
import torch.fx as fx
from sympy.core.function import AppliedUndef

from ...runtime.sequence_ops import Band
from ..graph import new_node
from ..ops import canonical, is_tensor_node, shape_of, value_of
from .interpret import B, H, Q, Evaluator, Unstructurable, broadcast_to, dim_symbol

__all__ = ["emit_guards", "materialize", "materialize_slopes", "tabulate"]


def tabulate(graph: fx.Graph, table, leaves: dict[str, fx.Node], q_len: int, k_len: int) -> fx.Node:
    """The ``[H, q_len + k_len - 1]`` values of the lookup ``table`` (``E(q, k, h)``) at every distance ``k - q``
    (see :func:`~autoshard.passes.masks.structure_mask`), as graph nodes."""
    lookup = leaves[str(table.func)]
    op = canonical(lookup)
    index = op["input"]
    first, second = dim_symbol(0), dim_symbol(1)
    distance = second - first if table.args[0] == Q else first - second  # k - q in the index's own dims
    roots, chain = {}, []
    evaluator = Evaluator()

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
    vector = new_node(graph, torch.arange, (-(q_len - 1), k_len), {"device": device})
    values: dict[fx.Node, fx.Node] = {}
    for root, shift in roots.items():
        shifted = new_node(graph, operator.add, (vector, shift)) if shift else vector
        values[root] = new_node(graph, torch.Tensor.to, (shifted, value_of(root).dtype))
    for node in sorted(chain, key=list(graph.nodes).index):
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: values.get(n, n))
        values[node] = new_node(graph, node.target, args, kwargs, op=node.op)
    args, kwargs = fx.node.map_arg((lookup.args, lookup.kwargs), lambda n: values[index] if n is index else n)
    rows = new_node(graph, lookup.target, args, kwargs, op=lookup.op)  # [q_len + k_len - 1, H]
    return new_node(graph, torch.Tensor.t, (rows,))


def _distance_shift(evaluator: Evaluator, node: fx.Node, distance, shape) -> int | None:
    """``c`` when ``node`` (broadcast to the index's ``shape``) is ``k - q + c``, else None."""
    try:
        rest = sympy.expand(sympy.sympify(broadcast_to(evaluator(node), tuple(shape)).expr) - distance)
    except (Unstructurable, TypeError):  # not an integer expression the evaluator reads
        return None
    return int(rest) if rest.is_Integer else None


def materialize_slopes(graph: fx.Graph, slope, heads: int, leaves: dict[str, fx.Node]) -> fx.Node:
    """The ``[heads]`` float32 slopes ``slope(h)`` as graph nodes."""
    grid = materialize(graph, slope, H, 1, heads, leaves, None)
    if not isinstance(grid, fx.Node) or value_of(grid).dtype != torch.float32:
        grid = new_node(graph, torch.Tensor.to, (_as_node(graph, grid), torch.float32))
    return new_node(graph, torch.Tensor.reshape, (grid, (heads,)))


def emit_guards(graph: fx.Graph, bands: dict[fx.Node, Band], runs: list[tuple[fx.Node, fx.Node]]) -> None:
    """The checks of what the mask relies on: ``autoshard::check_band`` of every buffer read as a band (its values
    read when compiled), ``autoshard::check_runs`` of every (segment ids, positions) pair whose runs the graph
    cannot see (:func:`~.recognizers.resolve_positions`)."""
    for buffer, band in bands.items():
        new_node(graph, torch.ops.autoshard.check_band.default,
                 (buffer, band.inside, band.outside, band.lo, band.hi, _buffer_name(buffer)))
    for seg, pos in runs:
        new_node(graph, torch.ops.autoshard.check_runs.default, (seg, pos, f"{seg.name}, {pos.name}"))


def _buffer_name(node: fx.Node) -> str:
    """Where the buffer ``node`` reads lives, for messages: dynamo's source while it is known, else the node."""
    if node.op == "get_attr":
        return node.target
    name = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", node.name)
    return name() if callable(name) else name


# ----------------------------------------------------------------------------- materialization


def materialize(graph: fx.Graph, expr, pos_sym, batch: int, length: int, leaves: dict[str, fx.Node], dtype):
    """Graph nodes computing ``expr`` (a function of b and ``pos_sym``) on the [batch, length] grid."""
    emitter = _Emitter(graph, pos_sym, batch, length, leaves)
    out = emitter.emit(expr)
    if not isinstance(out, fx.Node) or shape_of(out) != (batch, length):
        out = new_node(graph, torch.Tensor.expand, (_as_node(graph, out), batch, length))
    if dtype is not None and value_of(out).dtype != dtype:
        out = new_node(graph, torch.Tensor.to, (out, dtype))
    return out


def _as_node(graph, value):
    if isinstance(value, fx.Node):
        return value
    return new_node(graph, torch.tensor, (value,))


_COMPARISONS = {sympy.Eq: operator.eq, sympy.Ne: operator.ne, sympy.Le: operator.le, sympy.Lt: operator.lt,
                sympy.Ge: operator.ge, sympy.Gt: operator.gt}
"""A formula's comparisons, as the Python operators that build them."""
_FOLDS = {sympy.And: operator.and_, sympy.Or: operator.or_, sympy.Add: operator.add, sympy.Mul: operator.mul}
"""A formula's n-ary operators, as the binary Python operators folded over their arguments."""


class _Emitter:
    """Graph nodes computing formulas of ``b`` and one position symbol on a ``[batch, length]`` grid (each formula
    once)."""

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
        ar = new_node(self.graph, torch.arange, (n,), {"device": self.device})
        return new_node(self.graph, torch.Tensor.view, (ar, (n, 1) if which is B else (1, n)))

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
            return new_node(self.graph, operator.getitem, (node, index))
        if type(expr) in _COMPARISONS:
            return new_node(self.graph, _COMPARISONS[type(expr)], (self.emit(expr.lhs), self.emit(expr.rhs)))
        if type(expr) in _FOLDS:
            fn = _FOLDS[type(expr)]
            return functools.reduce(lambda a, b: new_node(self.graph, fn, (a, b)), [self.emit(a) for a in expr.args])
        if isinstance(expr, sympy.Not):
            return new_node(self.graph, operator.invert, (self.emit(expr.args[0]),))
        if isinstance(expr, sympy.floor):  # floor(n / d) of an integer expression n and a constant d
            numerator, denominator = sympy.fraction(sympy.together(expr.args[0]))
            if denominator.is_Integer:
                return new_node(self.graph, operator.floordiv, (self.emit(sympy.expand(numerator)), int(denominator)))
        raise Unstructurable(f"cannot build {expr}")


def _identity_args(node: fx.Node, pos_sym) -> list:
    """The argument list under which a [B, S] (or [1, S]) leaf is read at (b, position) unchanged."""
    shape = shape_of(node)
    if len(shape) != 2:
        return []
    return [sympy.Integer(0) if shape[0] == 1 else B, pos_sym]
