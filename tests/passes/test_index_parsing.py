"""Index parsing (``parse_index`` of :mod:`autoshard.passes.rules.views`) against torch, as a property.

Hypothesis draws a shape whose dim 1 stands for the sequence and an index for it in every form a model writes:
slices with any start, stop and step (negative, past the end, empty), ints (negative too), ``None``, ``...`` and
constant int lists. The parsed items, turned back into an index, must select what torch selects; every input dim
has exactly one item, in order; slice bounds are clamped to the dim and lists made nonnegative.
"""

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from autoshard.passes.rules.views import IndexList, IndexNew, IndexSelect, IndexSlice, parse_index


def _item(size: int):
    """One index item for a dim of ``size``."""
    bound = st.integers(-2 * size - 1, 2 * size + 1)
    return st.one_of(
        st.builds(slice, st.none() | bound, st.none() | bound, st.none() | st.integers(1, size + 1)),
        st.integers(-size, size - 1),
        st.lists(st.integers(-size, size - 1), min_size=1, max_size=3),
    )


@st.composite
def shapes_and_indices(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=2, max_size=4)))
    consumed = draw(st.integers(1, len(shape)))
    ellipsis = draw(st.none() | st.integers(0, consumed)) if consumed < len(shape) else None
    sizes = shape[:consumed] if ellipsis is None else shape[:ellipsis] + shape[len(shape) - consumed + ellipsis:]
    items = [draw(_item(size)) for size in sizes]
    if sum(isinstance(it, list) for it in items) > 1:  # one list: two would broadcast against each other
        items = [slice(None) if isinstance(it, list) else it for it in items[:-1]] + items[-1:]
    if ellipsis is not None:  # "..." stands for the dims no item consumes
        items.insert(ellipsis, Ellipsis)
    for _ in range(draw(st.integers(0, 2))):
        items.insert(draw(st.integers(0, len(items))), None)
    return shape, tuple(items)


def _rebuilt(items) -> tuple:
    """The torch index the parsed items stand for."""
    out = []
    for item in items:
        if isinstance(item, IndexNew):
            out.append(None)
        elif isinstance(item, IndexSlice):
            out.append(slice(item.start, item.stop, item.step))
        elif isinstance(item, IndexSelect):
            out.append(item.at)
        else:
            assert isinstance(item, IndexList), item
            out.append(list(item.indices))
    return tuple(out)


@settings(max_examples=100, deadline=None, database=None)
@given(shapes_and_indices())
def test_parsed_index_selects_what_torch_selects(case):
    shape, index = case
    x = torch.arange(torch.Size(shape).numel()).view(shape)
    items = parse_index(shape, index)
    consuming = [it for it in items if not isinstance(it, IndexNew)]
    assert [it.dim for it in consuming] == list(range(len(shape))), items  # one item per input dim, in order
    for it in consuming:
        size = shape[it.dim]
        if isinstance(it, IndexSlice):
            assert 0 <= it.start <= it.stop <= size and it.step >= 1, (it, size)
        elif isinstance(it, IndexSelect):
            assert 0 <= it.at < size, (it, size)
        elif isinstance(it, IndexList):
            assert all(0 <= i < size for i in it.indices), (it, size)
    assert sum(isinstance(it, IndexNew) for it in items) == sum(it is None for it in index)
    assert torch.equal(x[_rebuilt(items)], x[index]), (index, items)
