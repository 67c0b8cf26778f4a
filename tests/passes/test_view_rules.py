"""Shape ops' dim maps (``SHAPE_OPS`` of :mod:`autoshard.passes.rules.views`) against torch, as a property.

Hypothesis draws a shape with one dim that stands for the sequence, filled with its positions (``arange``), and a
chain of shape ops as models write them: reshapes to any shape of the same size, flatten and unflatten, squeeze
and unsqueeze, permute / transpose / movedim, expand, repeat_interleave, repeat. Each op is a real FX node, canonicalized
and looked up in the table as the compiler does. After every op:

* the output factorization the dim map gives multiplies out to the output's shape;
* the link rule's edge and the rewrite's source lookup name the same output element for the sequence;
* that element holds the positions in torch's result: viewing its dim as its factors, the sequence factor's
  axis is ``arange``;
* only a reshape that cuts the sequence factor may lose it (every other op keeps its positions whole).
"""

import math

import hypothesis.strategies as st
import torch
import torch.fx as fx
from hypothesis import given, settings

from autoshard.passes.infer import LinkContext
from autoshard.passes.ops import canonical
from autoshard.passes.rules.dim_maps import output_factors, pieces, source_of
from autoshard.passes.rules.views import SHAPE_OPS, link_shape_op


def _primes(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


@st.composite
def _reshape(draw, shape):
    """Any shape of the same size: its primes dealt out to dims, size-1 dims among them."""
    primes = draw(st.permutations(_primes(math.prod(shape))))
    ndim = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, len(primes)), min_size=ndim - 1, max_size=ndim - 1)))
    bounds = [0, *cuts, len(primes)]
    return "reshape", tuple(math.prod(primes[a:b]) for a, b in zip(bounds, bounds[1:])), {}


@st.composite
def _step(draw, shape, factors):
    """One shape op applicable to a value of ``shape`` (factorized as ``factors``): (method, args, kwargs)."""
    ndim = len(shape)
    dim = st.integers(0, ndim - 1)
    choices = [_reshape(shape),
               st.tuples(st.just("unsqueeze"), st.tuples(st.integers(-ndim - 1, ndim)), st.just({})),
               st.tuples(st.just("permute"), st.permutations(range(ndim)).map(tuple), st.just({})),
               st.tuples(st.just("transpose"), st.tuples(dim, dim), st.just({})),
               st.tuples(st.just("movedim"), st.tuples(dim, dim), st.just({})),
               st.tuples(st.just("repeat_interleave"), st.tuples(st.integers(1, 3)),
                         st.fixed_dictionaries({"dim": dim})),
               st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim + 1).map(  # leading new dims too
                   lambda sizes: ("repeat", tuple(sizes), {}))]
    if ndim > 1:
        choices.append(dim.flatmap(lambda start: st.tuples(
            st.just("flatten"), st.tuples(st.just(start), st.integers(start, ndim - 1)), st.just({}))))
    merged = [d for d in range(ndim) if len(factors[d]) > 1]
    if merged:
        choices.append(st.sampled_from(merged).map(lambda d: ("unflatten", (d, tuple(factors[d])), {})))
    if 1 in shape and any(s != 1 for s in shape):
        choices.append(st.just(("squeeze", (), {})))
        choices.append(st.integers(2, 3).map(
            lambda k: ("expand", tuple(k if s == 1 else s for s in shape), {})))
    choices.append(st.integers(2, 3).map(lambda k: ("expand", (k, *shape), {})))
    return draw(st.one_of(*choices))


def _tracked_by_source(dim_map, in_factors, elem):
    """The output (dim, factor) whose source is the input element ``elem`` (the rewrite's lookup)."""
    for d, spec in enumerate(dim_map):
        for f in range(len(pieces(spec, in_factors))):
            if source_of(dim_map, in_factors, d, f) == elem:
                return d, f
    return None


def _tracked_by_edge(ctx, src, node, elem):
    """The output (dim, factor) the link rule joined to the input element ``elem``."""
    for a, b, delta, _ in ctx.edge_list:
        for mine, theirs in ((a, b), (b, a)):
            if mine == (src, *elem) and theirs[0] is node:
                assert delta == 0
                return theirs[1:]
    return None


def _holds_positions(y: torch.Tensor, factors, elem, length: int) -> bool:
    dim, factor = elem
    z = y.reshape(list(y.shape[:dim]) + list(factors[dim]) + list(y.shape[dim + 1:]))
    axis = dim + factor
    return bool((z == torch.arange(length).view([length if i == axis else 1 for i in range(z.dim())])).all())


@st.composite
def _tagged(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    seq = draw(st.sampled_from([d for d in range(len(shape)) if shape[d] > 1] or [None]))
    return shape, seq


@settings(max_examples=150, deadline=None)
@given(st.data(), _tagged())
def test_dim_maps_follow_the_sequence_as_torch_does(data, tagged):
    shape, seq = tagged
    length = shape[seq] if seq is not None else 1
    y = torch.arange(length).view([length if d == seq else 1 for d in range(len(shape))]).expand(shape).clone()
    graph = fx.Graph()
    src = graph.placeholder("x")
    src.meta["example_value"] = y
    ctx = LinkContext()
    elem = (seq, 0) if seq is not None else None
    for _ in range(data.draw(st.integers(1, 5))):
        in_factors = ctx.factorization(src)
        method, args, kwargs = data.draw(_step(tuple(y.shape), in_factors))
        out = getattr(y, method)(*args, **kwargs)
        node = graph.call_method(method, (src, *args), kwargs)
        node.meta["example_value"] = out
        op = canonical(node)
        dim_map = SHAPE_OPS[op.name].dim_map(node, op, ctx.factorization)
        link_shape_op(ctx, node, op)
        factors = output_factors(dim_map, in_factors)
        assert ctx.factorization(node) == factors
        assert [math.prod(fs) for fs in factors] == list(out.shape), (method, args, factors)
        if elem is not None:
            followed = _tracked_by_source(dim_map, in_factors, elem)
            assert followed == _tracked_by_edge(ctx, src, node, elem), (method, args, dim_map)
            assert followed is not None or method == "reshape", (method, args, dim_map)
            if followed is not None:
                assert factors[followed[0]][followed[1]] == length
                assert _holds_positions(out, factors, followed, length), (method, args, dim_map, followed)
            elem = followed
        y, src = out, node
