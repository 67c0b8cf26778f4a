"""The ``functionalize`` pass: in-place writes into fresh tensors become out-of-place ops with the same values;
writes another tensor could observe stay in place."""

import operator

import pytest
import torch

from autoshard.passes.functionalize import functionalize
from autoshard.passes.normalize import canonicalize
from autoshard.testing.graphs import dynamo_graph


def _graph(fn, *inputs):
    """Dynamo's graph of ``fn`` (with example values), as the backend receives it."""
    gm = dynamo_graph(fn, *inputs)
    canonicalize(gm)
    return gm


def _assemble(a, b):  # MLA's keys
    k = a.new_empty(*a.shape[:-1], a.size(-1) + b.size(-1))
    k[..., :a.size(-1)] = a
    k[..., a.size(-1):].copy_(b)
    return k * 2


def _rows(x):  # ints, a step-1 slice, a scalar, None in the index
    y = torch.zeros_like(x)
    y[0, 1:3] = x[0, 1:3] + 1
    y[:, None, -1] = 5.0
    return y.sum(1)


def _interleave(x):  # Wan's rotary embedding: strided writes into empty_like, the odd one ending before the dim
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * 2 - x2
    out[..., 1::2] = x1 + x2 * 3
    y = torch.zeros(3, 7)
    y[1, 1:6:2] = 4.0
    y[:, 3::10] = 5.0
    return out * 2, y


def _through_data(x):  # CogVideoX's positions: a write through .data, which autograd does not see
    joint = x.new_zeros(1, 7, x.shape[-1], requires_grad=False)
    joint.data[:, 3:].copy_(x * 2)
    return joint + x.sum()


def _scatters(x, idx):  # out-of-place twins
    gate = torch.zeros_like(x).scatter_(-1, idx, 1.0)
    acc = torch.zeros(x.shape[0], 3, dtype=x.dtype).index_add_(1, torch.tensor([0, 2]), x[:, :2])
    return gate, acc, gate.masked_fill_(gate > 0, 2.0)  # elementwise in place: stays


CASES = {
    "assemble": (_assemble, lambda: (torch.randn(2, 5, 3), torch.randn(2, 5, 2)), 2),
    "rows": (_rows, lambda: (torch.randn(3, 4, 2),), 2),
    "interleave": (_interleave, lambda: (torch.randn(2, 5, 6),), 4),
    "through_data": (_through_data, lambda: (torch.randn(4, 3),), 1),
    "scatters": (_scatters, lambda: (torch.randn(4, 6), torch.randint(0, 6, (4, 2))), 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_writes_become_out_of_place_with_the_same_values(name):
    fn, inputs, rewritten = CASES[name]
    args = inputs()
    gm = _graph(fn, *args)
    counts = functionalize(gm)
    gm.graph.lint()
    gm.recompile()
    assert counts == {"functionalized": rewritten, "kept_in_place": 0}
    left = [n.target for n in gm.graph.nodes if n.target in (operator.setitem, "copy_", "scatter_", "index_add_",
                                                             torch._C._autograd._get_data_attr)]
    assert left == [], gm.code
    expected, got = fn(*args), gm(*args)
    for e, g in zip(expected if isinstance(expected, tuple) else (expected,), got):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def _write_into_input(x):
    x[:, 0] = 1.0
    return x * 2


def _alias_read_after(x):
    y = x * 1
    view = y[:, :2]
    y[:, 0] = 0.0
    return view + 1  # sees the write


def _write_into_view(x):
    y = x * 1
    part = y[:, 1:]
    part[:, 0] = 3.0  # changes y
    return y


@pytest.mark.parametrize("fn", [_write_into_input, _alias_read_after, _write_into_view])
def test_observable_writes_stay_in_place(fn):
    x = torch.randn(3, 4)
    gm = _graph(fn, x.clone())
    counts = functionalize(gm)
    assert counts == {"functionalized": 0, "kept_in_place": 1}
    gm.recompile()
    (got,) = gm(x.clone())
    torch.testing.assert_close(got, fn(x.clone()), rtol=0, atol=0)
