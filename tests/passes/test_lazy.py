"""The ``lazy`` pass (:mod:`autoshard.passes.lazy`) on small captured graphs: a returned vocabulary head is handed
back as its input and where its weight and bias are, the same graph computing everything else; a head the graph
reads, a small projection, a weight that is no input stay; a returned KV cache is found."""

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from autoshard.passes.lazy import LAZY_RATIO, LazyOutput, kv_cache_outputs, lazy_outputs
from autoshard.testing.graphs import dynamo_graph

TOKENS, HIDDEN = 5, 4
VOCAB = LAZY_RATIO * HIDDEN


def _captured(fn, *inputs) -> fx.GraphModule:
    """Dynamo's graph of ``fn``, as the backend receives it (the functions below read their arguments in order: they
    are the graph's inputs in that order)."""
    return dynamo_graph(fn, *inputs)


def _linears(gm: fx.GraphModule) -> int:
    return sum(n.target is torch._C._nn.linear for n in gm.graph.nodes)


def heads(x, weight, bias, projection):
    h = x * 2
    return h.sum(), F.linear(h, weight, bias), F.linear(h, projection), F.linear(h, weight)


def _inputs():
    return (torch.randn(TOKENS, HIDDEN), torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB),
            torch.randn(HIDDEN, HIDDEN))


def test_returned_vocabulary_heads_are_handed_back_as_their_input():
    inputs = _inputs()
    gm = _captured(heads, *inputs)
    lazy = lazy_outputs(gm)
    assert lazy == {1: LazyOutput(weight=1, bias=2, dtype=torch.float32),
                    3: LazyOutput(weight=1, bias=None, dtype=torch.float32)}
    assert _linears(gm) == 1  # the projection (its output no larger than its input) stays
    gm.recompile()
    loss, with_bias, projected, without_bias = gm(*inputs)
    want = heads(*inputs)
    torch.testing.assert_close(loss, want[0])
    torch.testing.assert_close(projected, want[2])
    torch.testing.assert_close(with_bias, inputs[0] * 2)  # h, from which the backend makes the lazy logits
    torch.testing.assert_close(without_bias, inputs[0] * 2)


def read_by_the_graph(x, weight):
    logits = F.linear(x, weight)
    return logits, logits.sum()


def weight_computed(x, weight):
    return x.sum(), F.linear(x, weight * 2)


@pytest.mark.parametrize("fn", [read_by_the_graph, weight_computed])
def test_a_head_the_graph_reads_or_whose_weight_is_no_input_stays(fn):
    gm = _captured(fn, torch.randn(TOKENS, HIDDEN), torch.randn(VOCAB, HIDDEN))
    assert lazy_outputs(gm) == {}
    assert _linears(gm) == 1


def cached(q, k, v):
    keys, values = k * 2, v.transpose(1, 2)
    return F.scaled_dot_product_attention(q, keys, values), keys * 2, keys, values, values.sum()


def test_the_returned_keys_and_values_of_an_attention_are_a_kv_cache():
    q, k = torch.randn(2, 1, 2, TOKENS, HIDDEN)
    v = torch.randn(1, TOKENS, 2, HIDDEN)
    assert kv_cache_outputs(_captured(cached, q, k, v)) == [2, 3]
    assert kv_cache_outputs(_captured(heads, *_inputs())) == []
