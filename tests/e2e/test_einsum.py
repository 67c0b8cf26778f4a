"""``torch.einsum`` of two operands through the product rule (its letters are the link edges), on 2 ranks against
one process: a projection keeps the tokens split, a product whose second operand carries another split of the
same sequence takes that operand whole, a contraction over the split tokens is a partial sum, and an implicit
output (``"bsd,bsd"``) is written out as einsum would."""

import torch
import torch.nn as nn

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process


class Einsums(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width) / width ** 0.5)

    def forward(self, x):
        x = autoshard.mark_sequence(x, 1)
        h = torch.einsum("bsd,ed->bse", x, self.w)  # rows stay split, the weight whole
        mixed = torch.einsum("bsd, btd -> bst", h, h)  # the keys' split is another: gathered
        y = torch.einsum("bst,btd->bsd", mixed.softmax(-1), h)
        pooled = torch.einsum("bsd,bse->de", [y, x])  # contracted over the split tokens: a partial sum
        return y, pooled, torch.einsum("bsd,bsd", y, x)


def _compare():
    r = compare_with_one_process(Einsums, lambda: (torch.randn(2, 11, 8),), dtype=torch.float64)
    return r.max_error(), r.summary(), r.fallbacks, r.transitions


def test_einsum_products_are_exact_and_planned():
    for err, summary, fallbacks, transitions in run_on_ranks(_compare, 2):
        assert err < 1e-9, summary
        assert fallbacks == [], fallbacks
        assert sum(t.startswith("all_reduce") for t in transitions) >= 2, transitions  # the two partial sums
