"""The ``defer`` pass (:mod:`autoshard.passes.deferred`): which outputs a graph leaves uncomputed, and the recipes
that compute them where they are used -- at the graph's own sizes, and, in a graph of symbolic lengths (a length
class), at every length with one recipe."""

import pytest
import torch
import torch.fx as fx

from autoshard.passes.deferred import defer_outputs, inline_deferred
from autoshard.passes.specialize import generalize
from autoshard.runtime.deferred import defer

pytestmark = pytest.mark.filterwarnings(
    "ignore:Raw SymInt value",  # fx, of the sizes a graph of symbolic lengths writes (the compile silences it too)
    "ignore:autoshard. a value a compiled graph left uncomputed")  # computed here on purpose, outside a graph


def _tables(ids, position_ids, weight):
    """What a model builds before its layers: RoPE's table from the length alone, a causal document mask from the
    positions (both cheap and large), and two values that must stay computed: one needing a gradient, one a matmul
    (autocast could run it in another precision where it is used)."""
    n = ids.shape[1]
    freqs = torch.arange(n, dtype=torch.float64)[:, None] * torch.arange(1, 9, dtype=torch.float64)
    cos = torch.cat([freqs, freqs], -1).cos()
    documents = (position_ids == 0).cumsum(-1)
    causal = torch.arange(n)[:, None] >= torch.arange(n)[None, :]
    mask = (documents[:, :, None] == documents[:, None, :]) & causal
    scaled = weight.expand(n, 16) * 2
    product = freqs @ freqs.T
    return cos, mask, scaled, product


def _inputs(n: int):
    ids = torch.randint(0, 100, (1, n), generator=torch.Generator().manual_seed(n))
    positions = torch.cat([torch.arange(k) for k in (n // 3, n - n // 3)])[None]
    return ids, positions, torch.randn(16, dtype=torch.float64, requires_grad=True)


def _graph(n: int, dynamic: bool):
    """dynamo's graph of :func:`_tables` and its example inputs."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    ids, positions, weight = _inputs(n)
    if dynamic:  # the sequence dims, as dynamo makes them once a new length is seen
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.mark_dynamic(positions, 1)
    torch._dynamo.reset()
    torch.compile(_tables, backend=keep)(ids, positions, weight)
    return graphs[-1]


def test_static_graph_defers_the_tables_and_keeps_what_must_be_computed():
    gm, args = _graph(40, dynamic=False)
    deferred = defer_outputs(gm, excluded=set())
    assert sorted(deferred) == [0, 1], deferred  # cos and the mask; not what needs a gradient, not the matmul
    cos, mask, _, _ = _tables(*_inputs(40))
    assert deferred[0].anchor == () and deferred[0].inputs == ()  # reads nothing: an empty anchor stands in
    assert torch.equal(deferred[0].recipe(*deferred[0].reads(args)), cos)
    assert deferred[1].anchor is None and torch.equal(deferred[1].recipe(*deferred[1].reads(args)), mask)
    assert deferred[1].shape == (1, 40, 40)


@pytest.mark.parametrize("n", [37, 64, 9])
def test_a_length_class_recipe_computes_every_length(n):
    """In a graph of symbolic lengths the recipes compute their sizes from what they read: RoPE's table reads its
    length from an anchor, the mask from the positions' shape. One recipe (one key: what dynamo guards) serves a call
    at any length of the class, its carrier shaped for the call."""
    gm, args = _graph(41, dynamic=True)
    generic = generalize(gm, args)
    deferred = defer_outputs(generic.gm, excluded=set())
    assert sorted(deferred) == [0, 1], deferred
    assert len(deferred[0].anchor) == 1 and deferred[0].inputs == ()
    assert "41" not in deferred[0].recipe.graph_module.code and "41" not in deferred[1].recipe.graph_module.code
    call = [n, *_inputs(n)]
    want = _tables(*_inputs(n))
    for i in (0, 1):
        at_call = deferred[i].evaluated(generic.values(call))
        carrier = defer(at_call.recipe, at_call.reads(call), at_call.shape)
        assert tuple(carrier.shape) == tuple(want[i].shape)
        assert torch.equal(carrier.materialize(), want[i])


def test_a_class_recipe_taken_where_sizes_are_static_reads_them_as_constants():
    """A graph compiled for one set of sizes (a class could not be compiled, or dynamo traced it static) that takes
    a class's carrier: the recipe's sizes become constants, as dynamo writes sizes in a static graph."""
    gm, args = _graph(41, dynamic=True)
    cos = defer_outputs(generalize(gm, args).gm, excluded=set())[0]
    graph = fx.Graph()
    table = graph.placeholder("cos")
    table.meta["example_value"] = torch.empty(37, 16, dtype=torch.float64)
    graph.output(graph.call_function(torch.mul, (table, 2)))
    anchor = torch.empty(0, 37)
    taker = inline_deferred(fx.GraphModule(torch.nn.Module(), graph), {0: cos.recipe}, {0: [anchor]})
    assert not any("sym_size" in str(n.target) for n in taker.graph.nodes), taker.code
    assert torch.equal(taker(anchor), 2 * _tables(*_inputs(37))[0])
