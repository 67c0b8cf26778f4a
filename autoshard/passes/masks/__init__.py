"""Turn attention masks built in the graph back into structured masks; never an S x S tensor.

Models build masks from aranges, broadcast comparisons, gathers of a ``[B, S]`` padding mask, ``&`` and
``where(mask, 0, min)``. This pass evaluates the graph that produces an attention's mask *abstractly*:
every value is a sympy expression of its own index symbols (``d0, d1, ...``), so ``arange(S)`` is
``d0``, ``q_idx[None, None, :, None]`` re-indexes it to ``d2``, ``kv <= q`` is ``d3 <= d2``, and a gather
``mask[batch_idx, kv_idx]`` of a tensor the pass cannot see through is an *uninterpreted function*
``T(d0, d3)`` of the gathered indices. Aligning the mask's last four dims to (batch, head, query, key)
gives one boolean formula in ``b, h, q, k`` (:mod:`.interpret`), and for a float mask the bias it adds to the
scores. Its conjuncts are read by a table of recognizers (:mod:`.recognizers`): bounds on ``k - q`` (causal, a
sliding window, a bidirectional one), chunks (``q // C == kv // C``: Llama-4's chunked local attention), a key mask,
segment ids (packed documents), positions compared inside runs of themselves; the bias as ALiBi's slopes or a
relative-position table. Anything else is not structurable: the attention keeps its dense mask and is computed on
gathered keys (recorded in the plan), never on a wrong mask. The tensors the mask is made of are emitted as graph
nodes before the attention (:mod:`.emit`).

A buffer (or any tensor attribute of a module that needs no gradient) is module state, not an input: its values are
read when the graph is compiled (a placeholder dynamo lifted from the module, see
:func:`~autoshard.passes.graph.real_value`, or a ``get_attr``). One that holds a band -- one value where
``lo <= k - q <= hi``, another elsewhere, as nanoGPT's ``tril(ones(N, N))`` -- is that band's formula (a
``Piecewise`` in ``q`` and ``k``, folded through the comparisons that read it), so
``att.masked_fill(bias[:, :, :T, :T] == 0, -inf)`` is causal. The values are then guarded: an
``autoshard::check_band`` node before the attention checks on every call that the buffer is the tensor it was, at
the version it was (and verifies its values again when not; :mod:`autoshard.runtime.sequence_ops`). Buffers on the
meta device (a dry-run plan of a model built on meta) have no values to read: their masks stay dense.

Materialized tensors are plain graph nodes, so inference splits them along the sequence like any other per-token
value. What the pass finds is one :class:`~autoshard.runtime.attention.masks.MaskSpec` (``causal``, ``window``,
``chunk``: the position mask the kernels and the cost model read, ``(-1, -1)`` for no window) and a
:class:`MaskData` (the tensors, as graph nodes, and what a row that sees no key gets).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from ...runtime.attention.masks import MaskSpec
from ..ops import value_of
from .emit import emit_guards, materialize, materialize_slopes, tabulate
from .interpret import (B, H, K, MASKING_FILL, Q, SCORE, SWAMPING_FILL, Abstract, Evaluator, Unstructurable,
                        broadcast_to, dim_symbol, empty_rows_of, evaluate_mod)
from .recognizers import (MaskChange, alibi_slope, pinned_position, recognize, relative_table, resolve_positions,
                          score_terms)

__all__ = ["MaskData", "structure_mask", "structure_mask_mod", "Unstructurable", "empty_rows_of", "MASKING_FILL",
           "SWAMPING_FILL"]


@dataclass(frozen=True)
class MaskData:
    """What a structured mask holds beside its position mask (:class:`~autoshard.runtime.attention.masks.MaskSpec`):
    its tensors, graph nodes inserted before the attention, and what a row that sees no key gets."""

    key_mask: fx.Node | None = None
    """[B, S] bool, True = may be attended."""
    segment_ids: fx.Node | None = None
    """[B, S] int: attend within equal ids only."""
    alibi_slopes: fx.Node | None = None
    """[H] float32: ALiBi, every visible score gets ``slope[h] * (k - q)`` (see :func:`structure_mask`)."""
    position_bias: fx.Node | None = None
    """[H, q_len + k_len - 1]: a relative-position table, every visible score gets ``position_bias[h, k - q + q_len -
    1]`` (T5's learned buckets; see :func:`structure_mask`)."""
    query_mask: fx.Node | None = None
    """[B, S_q] bool: rows where it is False see key :attr:`pinned_key` alone, so their output is that key's value
    (the attention runs on the other rows' mask, and a ``where`` after it takes the value)."""
    pinned_key: int = 0
    """With :attr:`query_mask`: the key every row sees."""
    empty_rows: str = "zero"
    """What a query row that sees no key gets: ``"zero"`` (boolean masks, as SDPA), ``"uniform"`` (an
    additive mask filled with ~finfo.min: every score rounds to the fill, so softmax is uniform over all
    keys), ``"scores"`` (a milder fill: softmax over all keys of the unmasked scores, which the rewrite
    computes on gathered keys only when some rank has such a row)."""


def structure_mask(graph: fx.Graph, attention: fx.Node, attn_mask, is_causal: bool, q_len: int, k_len: int,
                   batch: int, heads: int) -> tuple[MaskSpec, MaskData]:
    """The structured form of ``attn_mask`` (and ``is_causal``) for the attention ``attention``: its position mask
    and its data (materialized key masks / segment ids / ALiBi slopes are inserted before ``attention``). Raises
    :class:`Unstructurable`.

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
    evaluator = Evaluator()
    bias, empty_rows = sympy.Integer(0), "zero"
    if attn_mask is not None:
        v = evaluator(attn_mask)
        if value_of(attn_mask).dtype != torch.bool and v.fill is None:  # a bias alone
            v = Abstract(sympy.true, v.shape, bias=v.expr)
        empty_rows = empty_rows_of(v.fill)
        full = broadcast_to(v, (1,) * max(0, 4 - len(v.shape)) + v.shape)
        n = len(full.shape)
        names = {n - 1: K, n - 2: Q, n - 3: H, n - 4: B}
        renamed = {dim_symbol(d): names.get(d, sympy.Integer(0)) for d in range(n)}
        expr = sympy.sympify(full.expr).xreplace(renamed)
        if full.shape[-2] not in (1, q_len) or full.shape[-1] not in (1, k_len):
            raise Unstructurable("mask shape does not match the attention")
        bias = sympy.sympify(full.bias).xreplace(renamed)
        expr = sympy.simplify_logic(expr) if expr.has(sympy.Or) else expr
        atoms += list(expr.args) if isinstance(expr, sympy.And) else [expr]
    return _structure(graph, attention, evaluator, atoms, bias, empty_rows, q_len, k_len, batch, heads)


def structure_mask_mod(graph: fx.Graph, attention: fx.Node, mask_mod: fx.GraphModule | None, mask_buffers,
                       score_mod: fx.GraphModule | None, score_buffers, q_len: int, k_len: int, batch: int,
                       heads: int) -> tuple[MaskSpec, MaskData, float]:
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` and ``score_mod(score, b, h, q_idx, kv_idx)`` (their
    traced graphs; the tensors they read from outside, ``*_buffers``, are nodes of ``graph``) as a structured mask
    (its position mask and its data) and a soft-cap: the two graphs are evaluated abstractly with the index
    arguments bound to the symbols ``b, h, q, k`` and ``score`` to a symbol of its own, so ``kv_idx <= q_idx`` is
    causal, ``doc[q_idx] == doc[kv_idx]`` segments of ``doc``, and what ``score_mod`` adds to ``score`` a bias
    (ALiBi's ``slope[h] * (kv_idx - q_idx)``); ``cap * tanh(score / cap)`` is a soft-cap. Rows that see no key get
    0, as FlexAttention gives them. Raises :class:`Unstructurable`."""
    evaluator = Evaluator()
    atoms = []
    if mask_mod is not None:
        expr = evaluate_mod(evaluator, graph, mask_mod, (B, H, Q, K), mask_buffers)
        expr = sympy.simplify_logic(expr) if isinstance(expr, sympy.Basic) and expr.has(sympy.Or) else expr
        atoms = list(expr.args) if isinstance(expr, sympy.And) else [expr]
    bias, softcap = sympy.Integer(0), 0.0
    if score_mod is not None:
        bias, softcap = score_terms(evaluate_mod(evaluator, graph, score_mod, (SCORE, B, H, Q, K), score_buffers))
    return *_structure(graph, attention, evaluator, atoms, bias, "zero", q_len, k_len, batch, heads), softcap


def _structure(graph: fx.Graph, attention: fx.Node, evaluator: Evaluator, terms: list, bias, empty_rows: str,
               q_len: int, k_len: int, batch: int, heads: int) -> tuple[MaskSpec, MaskData]:
    """The structured mask of the conjuncts ``terms`` (formulas in ``b, h, q, k``, read by the recognizers) and the
    additive ``bias`` (see :func:`structure_mask`); materialized tensors are inserted before ``attention``."""
    leaves = evaluator.leaves
    position_bias = alibi_slopes = key_mask = segment_ids = None
    bias, table = relative_table(bias, leaves)
    if table is not None:
        with graph.inserting_before(attention):
            position_bias = tabulate(graph, table, leaves, q_len, k_len)
    slope = alibi_slope(bias, leaves)
    if slope is not None:
        if empty_rows == "scores":
            raise Unstructurable("ALiBi with a mild fill (rows that see no key attend by their scores)")
        with graph.inserting_before(attention):
            alibi_slopes = materialize_slopes(graph, slope, heads, leaves)

    found = MaskChange()
    for term in terms:
        found = found & recognize(term)
    found, runs = resolve_positions(found, leaves)
    spec = found.mask_spec()
    pinned = _pinned(found, k_len)

    with graph.inserting_before(attention):
        if found.key_terms:
            key_mask = materialize(graph, sympy.And(*found.key_terms), K, batch, k_len, leaves, torch.bool)
        if len(found.segments) > 1:
            raise Unstructurable("several segment-id tensors")
        if found.segments:
            segment_ids = materialize(graph, found.segments[0], Q, batch, q_len, leaves, None)
        query_mask = (materialize(graph, sympy.And(*pinned[1]), Q, batch, q_len, leaves, torch.bool)
                      if pinned is not None else None)
        emit_guards(graph, evaluator.bands, runs)  # the mask relies on the values read: guard them
    return spec, MaskData(key_mask=key_mask, segment_ids=segment_ids, alibi_slopes=alibi_slopes,
                          position_bias=position_bias, query_mask=query_mask,
                          pinned_key=pinned[0] if pinned is not None else 0, empty_rows=empty_rows)


def _pinned(found: MaskChange, k_len: int) -> tuple[int, list] | None:
    """``(c, row terms)`` of a mask whose rows where the terms fail see key ``c`` alone; None without such terms.
    Their output is key ``c``'s value only when nothing else hides key ``c`` from them: every other term is a key
    mask joined with the pinned key, there are no bounds, chunks or segments; and key ``c`` exists (key 0 at any
    length, another one below a static key length)."""
    if not found.pinned:
        return None
    keys = {c for c, _ in found.pinned}
    plain = MaskChange(key_terms=found.key_terms, pinned=found.pinned)
    if any(c != 0 and not (isinstance(k_len, int) and c < k_len) for c in keys):
        raise Unstructurable(f"rows that see key {keys} alone, of {k_len} keys")
    if len(keys) != 1 or found != plain or not all(
            isinstance(t, sympy.Or) and any(pinned_position(d) in keys for d in t.args) for t in found.key_terms):
        raise Unstructurable("rows that see one key alone, beside other terms that may hide it")
    return keys.pop(), [term for _, term in found.pinned]
