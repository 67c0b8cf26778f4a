"""The recognizers of the mask pass: what each conjunct of a mask formula says about the mask.

The interpreter (:mod:`.interpret`) turns an attention's mask into one boolean formula in ``b, h, q, k``; its
conjuncts (*terms*) are matched against :data:`RECOGNIZERS`, in order, and the first recognizer that knows a term
says what it changes (a :class:`MaskChange`) or raises :class:`~.interpret.Unstructurable`:

``always``         ``True``: nothing;
``never``          ``False``: every key hidden (raises);
``per_head``       a term in ``h`` (raises: the structured kinds are the same for every head);
``pinned_key``     ``k == c | X``: key ``c`` visible to every row; ``X``'s conjuncts without ``q`` are key masks with key
                   ``c`` joined, those without ``k`` say which rows see key ``c`` alone;
``band``           only ``q`` and ``k``, linear, or a distance ``|k - q|`` bounded above (a bidirectional sliding
                   window: ModernBERT, EmbeddingGemma): bounds on ``k - q``, which become ``causal`` and ``window``;
``chunks``         ``floor((q + o) / C) == floor((k + o) / C)`` with ``o`` a multiple of ``C`` (``q // C == kv // C``:
                   Llama-4's chunked local attention): ``chunk=C``;
``key_mask``       no ``q`` (a function of ``b``, ``k``): a key mask;
``segments``       ``f(b, q) == f(b, k)``: segment ids ``f`` (packed documents, or chunks shifted by a per-row padding
                   offset, ``(q - pad[b]) // C``);
``over_queries``   no ``k``: rows that see no key (raises);
``positions``      another comparison: ``P(b, k) <= P(b, q)`` of a position tensor ``P``, resolved once every term is
                   read (:func:`resolve_positions`), since it holds as ``k <= q`` only next to segment ids that are the
                   runs of ``P`` (``cumsum(diff(P) != 1)``, how transformers detects packed sequences; inside a segment
                   positions grow by one per token). When both come from outside the graph (an earlier graph made
                   them) the runs cannot be seen, and the comparison holds under a guard (``autoshard::check_runs``,
                   inserted by the emission).

A term no recognizer knows is not a conjunction of comparisons: the mask stays dense. The changes combine
(:meth:`MaskChange.__and__`: bounds intersect, chunk sizes must agree) and :meth:`MaskChange.mask_spec` turns the
bounds into the :class:`~autoshard.runtime.attention.masks.MaskSpec` the kernels and the cost model read; key terms
and segments are left for the emission to materialize. A recognizer is a function ``match(term) -> MaskChange |
None`` registered with :func:`recognizer`: a new kind of mask is one more entry.

The bias (what a float mask or a ``score_mod`` adds to visible scores) is read apart, by :func:`relative_table`
(a learned relative-position table), :func:`alibi_slope` and :func:`score_terms` (a soft-cap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sympy
import torch.fx as fx
from sympy.core.function import AppliedUndef

from ...runtime.attention.masks import MaskSpec
from ..ops import canonical, is_tensor_node, shape_of, value_of
from .interpret import H, K, Q, SCORE, Unstructurable

__all__ = ["MaskChange", "RECOGNIZERS", "recognizer", "recognize", "pinned_position", "resolve_positions",
           "relative_table", "alibi_slope", "score_terms"]


@dataclass(frozen=True)
class MaskChange:
    """What terms of a mask formula say about the mask: one term's (a recognizer's answer), or the conjunction of
    several (``a & b``). The bounds stay bounds on ``k - q`` until every term is read (:meth:`mask_spec`): a term
    alone may leave the diagonal out (``k > q``), which no :class:`~autoshard.runtime.attention.masks.MaskSpec`
    holds, and only the conjunction says what the mask then is (no key at all, or a band without the diagonal)."""

    lo: object = -sympy.oo
    """The least ``k - q`` of a visible key (``-oo``: no bound)."""
    hi: object = sympy.oo
    """The greatest ``k - q`` of a visible key (``oo``: no bound)."""
    chunk: int = 0
    """Chunked local attention: the chunk size (0: none)."""
    key_terms: tuple = ()
    """Terms without ``q`` (of ``b`` and ``k``): the key mask, their conjunction."""
    segments: tuple = ()
    """``f`` of every term ``f(b, q) == f(b, k)``: segment ids."""
    position_terms: tuple = ()
    """Comparisons of a position tensor at the key and at the query (:func:`resolve_positions`)."""
    pinned: tuple = ()
    """``(c, f)`` of every term ``k == c | f(b, q)``: rows where ``f`` is false see key ``c`` alone."""

    def __and__(self, other: MaskChange) -> MaskChange:
        """Both changes: the bounds intersected, the chunk sizes the same (else :class:`Unstructurable`)."""
        if other.chunk and self.chunk not in (0, other.chunk):
            raise Unstructurable(f"two chunk sizes, {self.chunk} and {other.chunk}")
        return MaskChange(max(self.lo, other.lo), min(self.hi, other.hi), other.chunk or self.chunk,
                          self.key_terms + other.key_terms, self.segments + other.segments,
                          self.position_terms + other.position_terms, self.pinned + other.pinned)

    def mask_spec(self) -> MaskSpec:
        """The position mask: the bounds on ``k - q`` as ``causal`` and ``window`` (they must let the diagonal
        through), and the chunks."""
        if self.lo > self.hi:
            raise Unstructurable("the mask hides every key")
        if self.lo > 0 or self.hi < 0:
            raise Unstructurable("a band that excludes the diagonal")
        return MaskSpec.of_band(None if self.lo == -sympy.oo else int(-self.lo),
                                None if self.hi == sympy.oo else int(self.hi), self.chunk)


RECOGNIZERS: list[Callable[[sympy.Basic], MaskChange | None]] = []
"""The recognizers, in the order they are tried (see the module docstring)."""


def recognizer(match: Callable[[sympy.Basic], MaskChange | None]) -> Callable[[sympy.Basic], MaskChange | None]:
    """Register ``match(term)`` (a :class:`MaskChange`, or None when it does not know the term) after the others."""
    RECOGNIZERS.append(match)
    return match


def recognize(term) -> MaskChange:
    """What the first recognizer that knows ``term`` says it changes."""
    for match in RECOGNIZERS:
        change = match(term)
        if change is not None:
            return change
    raise Unstructurable(f"a mask term {term} that is not a conjunction of comparisons")


# ----------------------------------------------------------------------------- the table, in order


@recognizer
def always(term) -> MaskChange | None:
    """``True``: hides nothing."""
    return MaskChange() if term is sympy.true else None


@recognizer
def never(term) -> MaskChange | None:
    """``False``: hides every key."""
    if term is sympy.false:
        raise Unstructurable("the mask hides every key")
    return None


@recognizer
def per_head(term) -> MaskChange | None:
    """A term in ``h``: not a structured kind."""
    if H in term.free_symbols:
        raise Unstructurable("a mask that differs per head")
    return None


@recognizer
def pinned_key(term) -> MaskChange | None:
    """``k == c | X``, one key always visible (HunyuanVideo's token refiner: ``m[q] & m[k]`` with ``mask[..., 0] =
    True``, so a padding query attends to key 0 alone): each conjunct of ``X`` without ``q`` joins the pinned key
    into a key mask, each without ``k`` says which rows see key ``c`` alone (:attr:`MaskChange.pinned`)."""
    if not isinstance(term, sympy.Or):
        return None
    pins = [(d, c) for d in term.args for c in [pinned_position(d)] if c is not None]
    if not pins:
        return None
    pin, c = pins[0]
    rest = sympy.Or(*(d for d in term.args if d is not pin))
    found = MaskChange()
    for part in sympy.And.make_args(rest):
        if Q not in part.free_symbols:
            found = found & MaskChange(key_terms=(sympy.Or(pin, part),))
        elif K not in part.free_symbols:
            found = found & MaskChange(pinned=((c, part),))
        else:
            raise Unstructurable(f"a mask term {term} that pins key {c} beside a term of the query and the key")
    return found


def pinned_position(term) -> int | None:
    """``c`` when ``term`` holds for key ``c`` alone (``k == c``, ``k < 1``, ``k <= 0``), else None."""
    if term.free_symbols != {K}:
        return None
    if isinstance(term, sympy.Eq) and K in (term.lhs, term.rhs):
        other = term.rhs if term.lhs == K else term.lhs
        return int(other) if other.is_Integer else None
    if isinstance(term, sympy.StrictLessThan) and term.lhs == K and term.rhs == 1:
        return 0
    if isinstance(term, sympy.LessThan) and term.lhs == K and term.rhs == 0:
        return 0
    return None


@recognizer
def band(term) -> MaskChange | None:
    """Bounds on ``k - q`` (no tensor read)."""
    bounds = _k_minus_q_bounds(term) if not _leaf_calls(term) else None
    return MaskChange(lo=bounds[0], hi=bounds[1]) if bounds is not None else None


@recognizer
def chunks(term) -> MaskChange | None:
    """``q // C == k // C`` (no tensor read)."""
    chunk = _chunk_size(term) if not _leaf_calls(term) else None
    return MaskChange(chunk=chunk) if chunk is not None else None


@recognizer
def key_mask(term) -> MaskChange | None:
    """No ``q``: a function of the batch row and the key."""
    return MaskChange(key_terms=(term,)) if Q not in term.free_symbols else None


@recognizer
def segments(term) -> MaskChange | None:
    """``f(b, q) == f(b, k)`` (either way round): segment ids ``f``."""
    if not isinstance(term, sympy.Eq):
        return None
    for side, other in ((term.lhs, term.rhs), (term.rhs, term.lhs)):
        if sympy.simplify(side.xreplace({Q: K}) - other) == 0 and K not in side.free_symbols:
            return MaskChange(segments=(side,))
    return None


@recognizer
def over_queries(term) -> MaskChange | None:
    """No ``k``: a mask over queries, whose hidden rows see no key."""
    if K not in term.free_symbols:
        raise Unstructurable("a mask over queries (rows with no visible key)")
    return None


@recognizer
def positions(term) -> MaskChange | None:
    """Another comparison: of a position tensor at the key and at the query (:func:`resolve_positions`)."""
    return MaskChange(position_terms=(term,)) if isinstance(term, sympy.core.relational.Relational) else None


def resolve_positions(found: MaskChange,
                      leaves: dict[str, fx.Node]) -> tuple[MaskChange, list[tuple[fx.Node, fx.Node]]]:
    """``found`` with its position terms read as bounds on ``k - q``: ``P(b, k) OP P(b, q) + c`` inside runs of
    ``P`` is ``k OP q + c``. Also (segment ids, positions) of the pairs made elsewhere, whose runs a guard checks
    where they are used (see the module docstring)."""
    guards = []
    for term in found.position_terms:
        pos, bounds = _position_comparison(term, leaves)
        tables = [leaves[str(s.func)] for s in found.segments if isinstance(s, AppliedUndef)]
        runs = [seg for seg in tables if _is_run_segments(seg, pos)] if pos is not None else []
        if not runs and pos is not None and len(tables) == 1 and _per_position(pos) and _per_position(tables[0]):
            guards.append((tables[0], pos))  # made elsewhere (an earlier graph): checked where it is used
        elif not runs:
            raise Unstructurable(f"a data-dependent comparison {term}")
        found = found & MaskChange(lo=bounds[0], hi=bounds[1])
    return found, guards


# ----------------------------------------------------------------------------- reading terms


def _leaf_calls(expr) -> set:
    """The uninterpreted functions (tensors read at indices) ``expr`` applies."""
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



def score_terms(value) -> tuple[object, float]:
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



def relative_table(bias, leaves: dict[str, fx.Node]):
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



def alibi_slope(bias, leaves: dict[str, fx.Node]):
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

