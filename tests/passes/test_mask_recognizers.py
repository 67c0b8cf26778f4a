"""The mask pass's recognizers (:mod:`autoshard.passes.masks.recognizers`) one term at a time, and what they make.

A term is a formula the interpreter gives in ``b, h, q, k``, a tensor read at indices being an uninterpreted
function (``T(b, k)``): each recognizer of the table is checked on the terms it knows, the table's order on terms two
of them could read, the conjunction of several terms on the :class:`~autoshard.runtime.attention.masks.MaskSpec`
it makes (``(-1, -1)``: no window), the terms that are no structure on the reason they give. Then
:func:`~autoshard.passes.masks.structure_mask` on the graphs dynamo traces from a few masks models build (the
packed documents and padding of ``tests/runtime/test_documents.py``, the fills of
``tests/e2e/test_mask_boundaries.py``): its spec and its data, the tensors inserted before the attention. No plan,
no process: sympy and one small trace each.
"""

import pytest
import sympy
import torch
import torch.nn.functional as F

from autoshard.passes import masks
from autoshard.passes.masks import recognizers
from autoshard.passes.masks.interpret import B, H, K, Q
from autoshard.passes.masks.recognizers import MaskChange, recognize, recognizer
from autoshard.passes.ops import canonical, shape_of, value_of
from autoshard.runtime.attention.masks import MaskSpec

KEEP, DOCUMENTS = sympy.Function("T_keep"), sympy.Function("T_documents")
"""A ``[B, S]`` key mask and a ``[B, S]`` tensor of document ids, read at indices."""
CHUNK_TERM = sympy.Eq(sympy.floor(Q / 4), sympy.floor(K / 4))


def _spec(*terms) -> MaskSpec:
    found = MaskChange()
    for term in terms:
        found = found & recognize(term)
    return found.mask_spec()


def test_the_table_is_tried_in_order():
    assert [match.__name__ for match in recognizers.RECOGNIZERS] == [
        "always", "never", "per_head", "pinned_key", "band", "chunks", "key_mask", "segments", "over_queries", "positions"]


@pytest.mark.parametrize("term, change", [
    (sympy.true, MaskChange()),
    (sympy.Le(K, Q), MaskChange(hi=0)),
    (sympy.Gt(K, Q - 3), MaskChange(lo=-2)),
    (sympy.Le(sympy.Abs(Q - K), 3), MaskChange(lo=-3, hi=3)),  # ModernBERT's bidirectional window
    (CHUNK_TERM, MaskChange(chunk=4)),
    (sympy.Eq(sympy.floor((Q + 8) / 4), sympy.floor((K + 8) / 4)), MaskChange(chunk=4)),  # the same chunks
    (sympy.Ne(KEEP(B, K), 0), MaskChange(key_terms=(sympy.Ne(KEEP(B, K), 0),))),
    (sympy.Eq(DOCUMENTS(B, Q), DOCUMENTS(B, K)), MaskChange(segments=(DOCUMENTS(B, Q),))),
    (sympy.Eq(DOCUMENTS(B, K), DOCUMENTS(B, Q)), MaskChange(segments=(DOCUMENTS(B, Q),))),
    (sympy.Le(DOCUMENTS(B, K), DOCUMENTS(B, Q)), MaskChange(position_terms=(sympy.Le(DOCUMENTS(B, K),
                                                                                     DOCUMENTS(B, Q)),))),
    (sympy.Or(sympy.Lt(K, 1), sympy.And(sympy.Ne(KEEP(B, K), 0), sympy.Ne(KEEP(B, Q), 0))),  # HunyuanVideo's refiner
     MaskChange(key_terms=(sympy.Or(sympy.Lt(K, 1), sympy.Ne(KEEP(B, K), 0)),), pinned=((0, sympy.Ne(KEEP(B, Q), 0)),))),
], ids=["true", "causal", "window", "distance", "chunk", "shifted_chunk", "key_mask", "segments", "segments_flipped",
        "positions", "pinned_key"])
def test_a_term_is_read_by_its_recognizer(term, change):
    assert recognize(term) == change


@pytest.mark.parametrize("term, reason", [
    (sympy.false, "the mask hides every key"),
    (sympy.Le(K, Q + H), "a mask that differs per head"),
    (sympy.Gt(Q, 3), "a mask over queries (rows with no visible key)"),
    (sympy.Or(sympy.Le(K, Q), sympy.Eq(KEEP(B, K), 0)), "that is not a conjunction of comparisons"),
    (sympy.Or(sympy.Eq(K, 2), sympy.Le(K, Q)), "pins key 2 beside a term of the query and the key"),
], ids=["false", "per_head", "over_queries", "disjunction", "pinned_beside_a_band"])
def test_a_term_that_is_no_structure_says_why(term, reason):
    with pytest.raises(masks.Unstructurable, match=reason.replace("(", r"\(").replace(")", r"\)")):
        recognize(term)


def test_the_first_recognizer_that_knows_a_term_reads_it():
    """``k <= q`` has no ``q``-free side and no tensor: the band reads it, not the later position comparison;
    ``T(b, k)`` has no ``q``: a key mask, though ``positions`` would take any comparison."""
    assert recognize(sympy.Le(K, Q)) == MaskChange(hi=0)
    assert recognize(sympy.Le(KEEP(B, K), 1)).key_terms == (sympy.Le(KEEP(B, K), 1),)


@pytest.mark.parametrize("terms, spec", [
    ((), MaskSpec()),
    ((sympy.Le(K, Q),), MaskSpec(causal=True)),
    ((sympy.Le(K, Q), sympy.Gt(K, Q - 3)), MaskSpec(causal=True, window=(2, 0))),  # Mistral's sliding window
    ((sympy.Le(sympy.Abs(Q - K), 3),), MaskSpec(window=(3, 3))),
    ((sympy.Le(K, Q + 2),), MaskSpec(window=(-1, 2))),
    ((sympy.Ge(K, Q - 3),), MaskSpec(window=(3, -1))),
    ((CHUNK_TERM, sympy.Le(K, Q)), MaskSpec(causal=True, chunk=4)),  # Llama-4's chunked local attention
    ((sympy.Le(K, Q), CHUNK_TERM, sympy.Eq(DOCUMENTS(B, Q), DOCUMENTS(B, K))), MaskSpec(causal=True, chunk=4)),
], ids=["none", "causal", "causal_window", "bidirectional", "right", "left", "chunked", "chunked_documents"])
def test_terms_make_one_mask_spec(terms, spec):
    assert _spec(*terms) == spec


@pytest.mark.parametrize("terms, reason", [
    ((CHUNK_TERM, sympy.Eq(sympy.floor(Q / 8), sympy.floor(K / 8))), "two chunk sizes, 4 and 8"),
    ((sympy.Lt(K, Q),), "a band that excludes the diagonal"),
    ((sympy.Le(K, Q - 5), sympy.Ge(K, Q + 2)), "the mask hides every key"),
], ids=["two_chunks", "no_diagonal", "empty_band"])
def test_terms_that_make_no_mask_say_why(terms, reason):
    with pytest.raises(masks.Unstructurable, match=reason):
        _spec(*terms)


def test_a_recognizer_registered_reads_what_none_before_it_knows(monkeypatch):
    monkeypatch.setattr(recognizers, "RECOGNIZERS", list(recognizers.RECOGNIZERS))
    disjunction = sympy.Or(sympy.Le(K, Q), sympy.Eq(KEEP(B, K), 0))

    @recognizer
    def anything(term):
        return MaskChange(hi=0)

    assert recognize(disjunction) == MaskChange(hi=0)
    assert recognize(sympy.Le(K, Q + 2)) == MaskChange(hi=2)  # the table before it still reads first


@pytest.mark.parametrize("spec", [MaskSpec(), MaskSpec(causal=True), MaskSpec(causal=True, window=(7, 0), chunk=4),
                                  MaskSpec(window=(3, 3)), MaskSpec(window=(-1, 2)), MaskSpec(window=(5, -1))])
def test_of_band_inverts_lower_and_upper(spec):
    assert MaskSpec.of_band(spec.lower, spec.upper, spec.chunk) == spec


def test_of_band_refuses_a_band_without_the_diagonal():
    with pytest.raises(ValueError, match="without the diagonal"):
        MaskSpec.of_band(None, -1)


# ----------------------------------------------------------------------------- structure_mask on traced graphs

SEQ, BATCH, HEADS = 8, 2, 2


def _structured(build_mask, *extra):
    """``structure_mask`` of the SDPA mask ``build_mask(q, *extra)`` in the graph dynamo traces: (spec, data)."""
    graphs = []

    def attend(q, *extra):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=build_mask(q, *extra))

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend=lambda gm, _: graphs.append(gm) or gm.forward, fullgraph=True)
    compiled(torch.randn(BATCH, HEADS, SEQ, 4), *extra)
    [gm] = graphs
    [node] = [n for n in gm.graph.nodes if getattr(canonical(n), "name", None) == "attention"]
    op = canonical(node)
    return masks.structure_mask(gm.graph, node, op["attn_mask"], bool(op["is_causal"]), SEQ, SEQ, BATCH, HEADS)


def _causal(q):
    pos = torch.arange(q.size(-2))
    return pos[None, :] <= pos[:, None]


def test_packed_documents_are_causal_with_segment_ids():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
    spec, data = _structured(lambda q, d: (d[:, None, :, None] == d[:, None, None, :]) & _causal(q), documents)
    assert spec == MaskSpec(causal=True)
    assert data.key_mask is None and shape_of(data.segment_ids) == (BATCH, SEQ)
    assert (data.alibi_slopes, data.position_bias, data.empty_rows) == (None, None, "zero")


def test_padding_under_a_sliding_window_is_a_key_mask():
    keep = torch.ones(BATCH, SEQ, dtype=torch.long)
    keep[0, :3] = 0

    def mask(q, keep):
        pos = torch.arange(q.size(-2))
        window = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 3)
        return window[None, None] & keep[:, None, None, :].bool()

    spec, data = _structured(mask, keep)
    assert spec == MaskSpec(causal=True, window=(2, 0))
    assert value_of(data.key_mask).dtype == torch.bool and shape_of(data.key_mask) == (BATCH, SEQ)
    assert data.segment_ids is None


@pytest.mark.parametrize("fill, empty_rows", [(float("-inf"), "zero"), (torch.finfo(torch.float32).min, "uniform"),
                                              (-1e4, "scores")])
def test_an_additive_mask_says_what_a_row_without_keys_gets(fill, empty_rows):
    spec, data = _structured(lambda q: torch.where(_causal(q), 0.0, fill))
    assert (spec, data.empty_rows) == (MaskSpec(causal=True), empty_rows)


def test_alibi_slopes_are_materialized_per_head():
    slopes = torch.tensor([0.5, 0.25])

    def mask(q, slopes):
        pos = torch.arange(q.size(-2))
        bias = slopes[:, None, None] * (pos[None, :] - pos[:, None])
        return torch.where(_causal(q), bias, float("-inf"))

    spec, data = _structured(mask, slopes)
    assert spec == MaskSpec(causal=True)
    assert shape_of(data.alibi_slopes) == (HEADS,) and value_of(data.alibi_slopes).dtype == torch.float32


def test_a_mask_over_queries_stays_dense():
    with pytest.raises(masks.Unstructurable, match="a mask over queries"):
        _structured(lambda q: (torch.arange(q.size(-2)) > 3)[:, None].expand(SEQ, SEQ))
