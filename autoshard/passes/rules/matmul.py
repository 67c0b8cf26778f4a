"""Matrix products: linear, matmul/bmm/mm, addmm/baddbmm, each one einsum equation.

``PRODUCTS`` holds one line per op: its equation over the operands (``linear`` is ``"...k,nk->...n"``, the
matmul family ``"...mk,...kn->...mn"`` with matmul's vector cases, ``einsum`` its own of two operands), which
operands are *weights*, and its bias.
One link and one rewrite read every line (DTensor's ``_mm_like_strategy("mk,kn->mn")`` is the model):

* a letter of the output is the same positions in every operand that has it (a ``...`` dim where its size is
  the output's: matmul broadcasts), and a contracted letter links the operands that share it. A weight's own
  letters are no positions (a linear layer's output features); a weight bias is not linked, another bias is
  broadcast into the output;
* output split on a letter: the operands that have it are taken split the same way, the others whole. So a
  sequence split on rows (tokens through a linear layer, GPT-2's ``Conv1D`` addmm over merged batch*sequence
  rows) stays split and the weight is used whole (its gradient is this rank's share, summed by ``grad_sync``);
  when the other operand carries a split of its own (its rows are another sequence dim), it is gathered;
* output whole and a contracted letter split in every operand but the weights (token mixing, ``probs @ v`` of
  an attention that was not captured): the operands are taken split (a weight sliced alike) and the product is
  a partial sum; a bias is added once, after the all-reduce, in the product's dtype (under autocast the lower
  precision, as one device's linear / addmm casts it);
* otherwise the product runs whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from ...placements import REPLICATE, Partial, Shard
from ..comms import REASON
from ..ops import Op, shape_of
from .registry import register
from .pointwise import link_broadcast, want_broadcast

__all__: list[str] = []  # the rules register themselves on import; nothing here is called from outside


@dataclass(frozen=True)
class Product:
    """A product op: its equation and how it runs."""

    equation: str | Callable[..., str]
    """Einsum equation over ``operands`` (``...``: broadcast batch dims), or a function of the op and the operands'
    ranks giving it."""
    operands: tuple[str, ...]
    """The op's arguments the equation multiplies, in its order."""
    emit: Callable[..., fx.Node]
    """``(rw, node, op, operands, *bias)``: the product of new-graph operands, plus the bias when one is given."""
    weights: frozenset[str] = frozenset()
    """Operands (and a bias) whose own letters are no positions."""
    bias: str | None = None
    """The argument added to the product (None: no bias)."""
    always: bool = False
    """The rule rewrites every node (:class:`~autoshard.passes.rules.registry.Rule`): it emits the op under another
    name."""


def _matmul_equation(op: Op, a_ndim: int, b_ndim: int) -> str:
    """``torch.matmul``'s equation: a vector operand has no row (column) letter, batch dims broadcast."""
    a = "...mk" if a_ndim >= 2 else "k"
    b = "...kn" if b_ndim >= 2 else "k"
    return f"{a},{b}->...{'m' if a_ndim >= 2 else ''}{'n' if b_ndim >= 2 else ''}"


def _einsum_equation(op: Op, a_ndim: int, b_ndim: int) -> str:
    """``torch.einsum``'s own equation, spaces dropped and an implicit output written out (the letters used once,
    in alphabetical order, after ``...`` when an operand has it)."""
    equation = op["equation"].replace(" ", "")
    if "->" in equation:
        return equation
    letters = equation.replace("...", "").replace(",", "")
    once = sorted(c for c in set(letters) if letters.count(c) == 1)
    return f"{equation}->{'...' if '...' in equation else ''}{''.join(once)}"


def _emit_linear(rw, node, op, operands, *bias):
    return rw.call(torch.nn.functional.linear, *operands, *bias)


def _emit_matmul(rw, node, op, operands, *bias):
    return rw.call(torch.matmul, *operands)


def _emit_einsum(rw, node, op, operands, *bias):
    return rw.call(torch.einsum, op["equation"], *operands)


def _emit_addmm(rw, node, op, operands, *bias):
    """The op itself with its bias; the bare product (``torch.matmul``) without."""
    if not bias:
        return rw.call(torch.matmul, *operands)
    return rw.reemit(node, (*bias, *operands), rw.value(node.kwargs))


PRODUCTS: dict[str, Product] = {
    "linear": Product("...k,nk->...n", ("input", "weight"), _emit_linear, frozenset({"weight", "bias"}), "bias",
                      always=True),  # emits F.linear, unnamed
    "matmul": Product(_matmul_equation, ("a", "b"), _emit_matmul, always=True),  # emits torch.matmul, unnamed
    "addmm": Product(_matmul_equation, ("a", "b"), _emit_addmm, bias="bias"),
    "einsum": Product(_einsum_equation, ("a", "b"), _emit_einsum),
}


@dataclass(eq=False)
class _Term:
    """One operand of a product node: its node, the letter of each of its dims, whether it is a weight."""

    node: fx.Node
    letters: list[str]
    weight: bool


def _dim_letters(term: str, ndim: int) -> list[str]:
    """The letter of each dim of an operand of ``ndim`` dims spelled ``term``; the dims ``...`` stands for are named
    by their place from the right, as broadcasting aligns them."""
    if "..." not in term:
        return list(term)
    head, tail = term.split("...")
    batch = ndim - len(head) - len(tail)
    return list(head) + [f"...{batch - i}" for i in range(batch)] + list(tail)


def _terms(product: Product, node: fx.Node, op: Op) -> tuple[list[_Term], list[str]]:
    """The operands of ``node`` with their letters, and the output's letters."""
    nodes = [op[name] for name in product.operands]
    equation = product.equation
    if not isinstance(equation, str):
        equation = equation(op, *(len(shape_of(x)) for x in nodes))
    inputs, output = equation.split("->")
    terms = [_Term(x, _dim_letters(term, len(shape_of(x))), name in product.weights)
             for x, term, name in zip(nodes, inputs.split(","), product.operands)]
    return terms, _dim_letters(output, len(shape_of(node)))


def _sources(terms: list[_Term], letter: str, size: int) -> list[tuple[_Term, int]]:
    """The (operand, dim) that hold the positions of an output dim: its letter, its size, not a weight."""
    return [(t, d) for t in terms if not t.weight
            for d, mine in enumerate(t.letters) if mine == letter and shape_of(t.node)[d] == size]


def _contracted(terms: list[_Term], out_letters: list[str]) -> list[str]:
    """The letters summed over, in order."""
    seen = [letter for t in terms for letter in t.letters if letter not in out_letters]
    return list(dict.fromkeys(seen))


def link_product(ctx, node, op):
    product = PRODUCTS[op.name]
    terms, out_letters = _terms(product, node, op)
    out_shape = shape_of(node)
    sources = [_sources(terms, letter, size) for letter, size in zip(out_letters, out_shape)]
    ctx.set_factorization(node, [list(ctx.factorization(found[0][0].node)[found[0][1]]) if found else [size]
                                 for found, size in zip(sources, out_shape)])
    for d, found in enumerate(sources):
        for t, dd in found:
            ctx.link_dims(node, d, t.node, dd)
    for letter in _contracted(terms, out_letters):
        (first, d0), *others = [(t, t.letters.index(letter)) for t in terms if letter in t.letters]
        for t, d in others:
            if shape_of(first.node)[d0] == shape_of(t.node)[d]:
                ctx.link_dims(first.node, d0, t.node, d)
    bias = op[product.bias] if product.bias else None
    if bias is not None and product.bias not in product.weights:  # broadcast over the output
        link_broadcast(ctx, node, [bias], set_factors=False)


def _reduced(rw, node, partial):
    """The all-reduced sum of ``partial``, this rank's part of ``node``'s product (before its bias)."""
    summed = rw.call(torch.ops.autoshard.reduce_partial.default, partial, "sum", rw.groups.sequence)
    summed.meta[REASON] = "product over the split dim"
    return summed


def _contracted_split(rw, terms: list[_Term], out_letters: list[str]) -> list[Any] | None:
    """The placement of each operand for a partial product: a contracted letter split alike (one layout) in every
    operand but the weights, which are sliced as the first one (an operand without the letter whole); None when
    no contracted letter is split so."""
    for letter in _contracted(terms, out_letters):
        dims = [t.letters.index(letter) if letter in t.letters else None for t in terms]
        shards = [rw.out_shard(t.node) if d is not None and not t.weight else None for t, d in zip(terms, dims)]
        split = [(s, d) for t, s, d in zip(terms, shards, dims) if d is not None and not t.weight]
        if split and all(s is not None and s.dim == d and s.layout == split[0][0].layout for s, d in split):
            return [REPLICATE if d is None else s or split[0][0].moved(d) for s, d in zip(shards, dims)]
    return None


def rewrite_product(rw, node, op):
    product = PRODUCTS[op.name]
    terms, out_letters = _terms(product, node, op)
    out = rw.out_shard(node)
    bias = op[product.bias] if product.bias else None
    split = _contracted_split(rw, terms, out_letters) if out is None else None
    if split is not None:  # the bias must be added once: reduce the product first
        part = product.emit(rw, node, op, [rw.input(t.node, want) for t, want in zip(terms, split)])
        if bias is None:
            rw.done(node, part, Partial())
            return
        summed = _reduced(rw, node, part)
        scaled = rw.call(torch.mul, summed, op["alpha"]) if op.get("alpha", 1) != 1 else summed
        base = rw.in_dtype_of(node, bias, rw.input(bias, REPLICATE))
        base = rw.call(torch.mul, base, op["beta"]) if op.get("beta", 1) != 1 else base
        rw.done(node, rw.call(torch.add, base, scaled), REPLICATE)
        return
    wants = {t: out.moved(d) for t, d in _sources(terms, out_letters[out.dim], shape_of(node)[out.dim])} if out else {}
    operands = [rw.input(t.node, wants.get(t, REPLICATE), partial_grad=out is not None and t not in wants)
                for t in terms]
    rw.done(node, product.emit(rw, node, op, operands, *_bias_input(rw, node, product, bias, out)), out or REPLICATE)


def _bias_input(rw, node, product: Product, bias, out: Shard | None) -> tuple[Any, ...]:
    """The bias argument in the placement the product's output needs (a weight bias whole), or none."""
    if not product.bias:
        return ()
    if bias is None or out is None:
        return (rw.input(bias, REPLICATE) if bias is not None else None,)
    if product.bias in product.weights:
        return (rw.input(bias, REPLICATE, partial_grad=True),)
    want, partial_grad = want_broadcast(rw, node, bias, out)
    return (rw.input(bias, want, partial_grad=partial_grad),)


for _name, _product in PRODUCTS.items():
    register(_name, link=link_product, rewrite=rewrite_product, always=_product.always)
