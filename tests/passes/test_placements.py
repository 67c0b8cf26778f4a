"""Placements through dry-run plans: which values are split along the sequence, on which dim, and what is
gathered, one tiny op each on a value split along dim 1 (``h = linear(mark_sequence(x, 1))``, ``[B, S, D]``).

The plan names every value with its placement: ``S(d)`` split along dim ``d``, ``S(d:i/n)`` split along factor
``i`` of ``n`` merged into dim ``d`` (a family: ``[B*S, D]`` keeps the split of ``S`` inside the merged dim),
``P(sum)`` a partial sum every rank adds its part of, ``R`` whole on every rank. A value the rules cannot keep
split is gathered, and the plan lists the gather as a fallback with its reason.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard

WORLD, BATCH, SEQ, DIM, HEADS = 2, 2, 16, 8, 2


def flattened(h):
    b, s, d = h.shape
    return h.reshape(b * s, d)


def split_heads(h):
    b, s, d = h.shape
    return h.view(b, s, HEADS, d // HEADS).transpose(1, 2)


def tail(h):
    return h[:, 3:]


def every_other(h):
    return h[:, ::2]


def mean_over_sequence(h):
    return h.mean(1)


def last_position(h):
    return h[:, -1]


def softmax_over_sequence(h):
    return F.softmax(h, dim=1)


def token_local(h):
    return F.gelu(h) * torch.sigmoid(h.sum(-1, keepdim=True))


def rolled(h):
    return torch.cat([h[:, 1:], h[:, :1]], 1)


def cumulative(h):
    return h.cumsum(1)


def positions_added(h):
    """Positions from an arange over the sequence: split where they are made (each rank its own positions)."""
    return h + torch.arange(h.size(1), dtype=h.dtype)[None, :, None]


OPS = {  # name: (op, its output's placement, what the plan reports gathered)
    "flattened": (flattened, "S(0:1/2)", []),
    "split_heads": (split_heads, "S(2)", []),
    "tail": (tail, "S(1)", []),
    "mean_over_sequence": (mean_over_sequence, "P(sum)", []),
    "last_position": (last_position, "P(sum)", []),
    "softmax_over_sequence": (softmax_over_sequence, "S(1)", []),
    "token_local": (token_local, "S(1)", []),
    "rolled": (rolled, "S(1)", []),
    "cumulative": (cumulative, "S(1)", []),
    "positions_added": (positions_added, "S(1)", []),
    "every_other": (every_other, "R", ["indexing a split dim with a step, a tensor, a list or a merged dim"]),
}


class Op(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op, self.proj = op, nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.op(self.proj(autoshard.mark_sequence(x, 1)))


@pytest.mark.parametrize("name", list(OPS))
def test_placement_of_an_op_on_a_split_value(name):
    op, placement, gathered = OPS[name]
    torch._dynamo.reset()
    plan = autoshard.plan(Op(op), (torch.randn(BATCH, SEQ, DIM),), world_size=WORLD)
    assert plan.placements["g0.linear"] == "S(1)", plan.placements
    output = list(plan.placements.values())[-1]  # values in graph order: the op's output last
    assert output == placement, plan.placements
    assert sorted({f.reason for f in plan.fallbacks}) == gathered, plan.fallbacks
