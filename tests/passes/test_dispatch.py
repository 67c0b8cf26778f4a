"""Expert dispatch regions (:mod:`autoshard.passes.dispatch`): a sort whose rows are grouped and put back by the
inverse permutation is token-local; a sort whose order survives, a capacity limit, a sorted value used outside, or
rows mixed with rows of the unsorted order are not (they keep today's gather)."""

import operator

import torch

from autoshard.passes.dispatch import dispatch_regions
from autoshard.testing.graphs import dynamo_graph

TOKENS, HIDDEN, EXPERTS, TOP_K = 6, 4, 3, 2


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    router = torch.randn(HIDDEN, EXPERTS, generator=g)
    weights = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=g)
    return x, router, weights


def _route(x, router):
    scores, index = torch.topk((x @ router).softmax(-1), TOP_K, dim=-1)
    return scores.reshape(-1), index.reshape(-1)


def _grouped(rows, weights, keys):
    """Each row times its expert's weight, as a grouped product computes it (rows grouped by their key)."""
    return (rows.unsqueeze(-1) * weights[keys]).sum(1)


def dispatch(x, router, weights):
    """Sort the slots by expert, compute the groups, put the rows back: token-local."""
    scores, ids = _route(x, router)
    ids_sorted, perm = torch.sort(ids)
    counts = torch.histc(ids_sorted.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
    offsets = torch.cumsum(counts, dim=0)
    rows = x[perm // TOP_K]
    out = _grouped(rows, weights, ids_sorted) * scores[perm].unsqueeze(-1) + 0 * offsets[-1]
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0))
    return out[inverse].view(TOKENS, TOP_K, HIDDEN).sum(1)


def sorted_order_returned(x, router, weights):
    """The rows stay in the sorted order: every row's place depends on every key."""
    _, ids = _route(x, router)
    _, perm = torch.sort(ids)
    return x[perm // TOP_K]


def capacity_limited(x, router, weights):
    """A slot past its expert's capacity is dropped: a cumulative sum over the rows decides it."""
    scores, ids = _route(x, router)
    ids_sorted, perm = torch.sort(ids)
    rank_in_expert = torch.cumsum(torch.ones_like(ids_sorted), 0)
    out = _grouped(x[perm // TOP_K], weights, ids_sorted) * (rank_in_expert <= 4).unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0))
    return out[inverse]


def sorted_keys_leak(x, router, weights):
    """Rows put back, but the sorted keys returned too: their order is the whole sequence's, not each rank's."""
    scores, ids = _route(x, router)
    ids_sorted, perm = torch.sort(ids)
    rows = x[perm // TOP_K] * scores[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0))
    return rows[inverse], ids_sorted


def mixed_orders(x, router, weights):
    """Sorted rows times the weights in the unsorted order: the pairing depends on every key."""
    scores, ids = _route(x, router)
    ids_sorted, perm = torch.sort(ids)
    out = _grouped(x[perm // TOP_K], weights, ids_sorted) * scores.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0))
    return out[inverse]


def _region(fn):
    return dispatch_regions(dynamo_graph(fn, *_inputs()))


def test_a_dispatch_restored_by_its_inverse_is_token_local():
    region = _region(dispatch)
    for target in (torch.sort, torch.histc, torch.cumsum, torch.empty_like, torch.arange, operator.floordiv):
        assert any(n.target is target for n in region), target
    gathers = [n for n in region if n.target is operator.getitem and isinstance(n.args[1], torch.fx.Node)]
    assert len(gathers) == 4, gathers  # the rows, the weights, the expert's weights by key, the inverse


def test_sorted_order_capacity_leaks_and_mixed_orders_are_not():
    for fn in (sorted_order_returned, capacity_limited, sorted_keys_leak, mixed_orders):
        assert _region(fn) == set(), fn.__name__
