"""The check that ranks passed the same inputs, on every call of a graph compiled with ``inputs="replicated"``.

With replicated inputs every rank of a sequence group must pass the same full batch: each computes its own
share of the one batch. A rank fed another batch (a ``DistributedSampler`` or a per-rank data loader over the
sequence group) would mix its shard of one batch with the other ranks' shards of others into a loss that is
nobody's, with no error. The first call of a graph compares whole digests of the inputs in the rendezvous store
(:mod:`autoshard.compiler`); every call, the first included, runs this check before the graph computes anything:

* each tensor input that is data (not a parameter, not a value an earlier graph handed on split or uncomputed:
  :func:`replicated_inputs` picks them when the graph is compiled) gives two integers computed where it lives,
  on its own device: the sum of its 32-bit words (16-bit or bytes for narrower dtypes; every word up to
  ``WHOLE_WORDS``, an even stride of them past that) and a weighted sum of an even stride of at most
  ``SAMPLED_WORDS`` words, with fixed pseudo-random weights, so that the same values in another order differ too;
  a Python scalar input gives its own hash;
* one all-gather of those integers (``16`` bytes per input per rank, the accountant's ``"metadata"``; plans count
  them, :attr:`autoshard.Plan.input_checks`), compared on the host: one synchronization per call;
* when any rank's integers differ from another's, every rank raises the same error, naming the inputs that
  differ and the ranks grouped by what they passed.

Two batches that differ get the same integers only by chance (both sums would have to collide, exactly). The
check is cheap next to a step -- a read of the inputs and a few bytes -- and ``check_inputs=False`` turns it off.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import torch

from .accounting import all_gather_bytes
from .collectives import gather_table
from .deferred import DeferredTensor
from .groups import metadata_device, resolve_group
from .split_tensor import SplitTensor

__all__ = ["WHOLE_WORDS", "SAMPLED_WORDS", "BYTES_PER_INPUT", "replicated_inputs", "checking_inputs",
           "check_bytes"]

WHOLE_WORDS = 1 << 24
"""Inputs of at most this many words are summed whole; larger ones (a static KV cache) by an even stride."""
SAMPLED_WORDS = 1 << 16
"""Words of each input the order-sensitive weighted sum reads (an even stride)."""
BYTES_PER_INPUT = 16
"""What each checked input adds to a rank's row of the all-gather: two int64."""
_MAX_WEIGHT = 1 << 12
"""Weights lie in ``[1, _MAX_WEIGHT)``: a sum of ``SAMPLED_WORDS`` 32-bit words times a weight fits in int64."""
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def replicated_inputs(example_inputs: Sequence) -> list[int]:
    """Positions of the inputs the check reads: tensors that are data the caller passed whole -- not parameters
    (compared once, at the first call), not :class:`~autoshard.SplitTensor` or
    :class:`~autoshard.runtime.deferred.DeferredTensor` (handed on by an earlier graph, a different shard on every
    rank) -- and Python scalars."""
    return [i for i, x in enumerate(example_inputs)
            if isinstance(x, (int, float, bool))
            or (isinstance(x, torch.Tensor) and not isinstance(x, (torch.nn.Parameter, SplitTensor, DeferredTensor)))]


def check_bytes(inputs: int, world: int) -> int:
    """Bytes a rank sends checking ``inputs`` inputs on ``world`` ranks (the all-gather's convention)."""
    return all_gather_bytes(BYTES_PER_INPUT * inputs, world) if inputs else 0


def _weights(device: torch.device, n: int) -> torch.Tensor:
    weights = _WEIGHTS.get(device)
    if weights is None:
        drawn = torch.randint(1, _MAX_WEIGHT, (SAMPLED_WORDS,), generator=torch.Generator().manual_seed(0))
        weights = _WEIGHTS[device] = drawn.to(device)
    return weights[:n]


def _words(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bits as a flat tensor of its widest integer words (32-bit for 4- and 8-byte elements)."""
    flat = x.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    size = flat.element_size()
    return flat.view(torch.int32 if size >= 4 else torch.int16 if size == 2 else torch.uint8)


def _terms(x) -> torch.Tensor:
    """The two int64 of one input (on its device for a tensor)."""
    if not isinstance(x, torch.Tensor):
        digest = int.from_bytes(hashlib.sha256(repr(x).encode()).digest()[:7], "big")
        return torch.tensor([digest, 0], dtype=torch.int64)
    words = _words(x)
    n = words.numel()
    whole = words if n <= WHOLE_WORDS else words[::-(-n // WHOLE_WORDS)]
    sample = words[::-(-n // SAMPLED_WORDS)] if n else words
    weighted = (sample.long() * _weights(words.device, sample.numel())).sum()
    return torch.stack([whole.sum(dtype=torch.int64), weighted])


def checking_inputs(fn: Callable, positions: list[int], names: list[str], group_name: str, graph: int) -> Callable:
    """``fn`` (a compiled graph) that first checks that every rank of the group passed the same values at
    ``positions`` (named ``names``) -- see the module docstring; ``graph`` numbers the graph in the error."""
    def run(*args):
        pg = resolve_group(group_name)
        device = metadata_device(pg)
        mine = torch.cat([_terms(args[i]).to(device) for i in positions]).unsqueeze(0)
        rows = gather_table(mine, pg).tolist()
        if any(row != rows[0] for row in rows):
            _raise(rows, names, graph)
        return fn(*args)
    return run


def _raise(rows: list[list[int]], names: list[str], graph: int) -> None:
    differ = [name for k, name in enumerate(names) if len({tuple(row[2 * k: 2 * k + 2]) for row in rows}) > 1]
    groups: dict[tuple, list[int]] = {}
    for rank, row in enumerate(rows):
        groups.setdefault(tuple(row), []).append(rank)
    raise RuntimeError(
        f"autoshard: the ranks of the sequence group passed different inputs to compiled graph #{graph} "
        f"({', '.join(differ)}; ranks grouped by what they passed: {sorted(groups.values())}). With "
        "inputs='replicated' every rank of a sequence group passes the same full batch and computes its share of it: "
        "give its ranks the same batches (a DistributedSampler or data loader sharded over the data-parallel ranks "
        "only, not over the sequence group), or split the batch with autoshard.shard_inputs and inputs='sharded'. "
        f"(This check all-gathers {BYTES_PER_INPUT} bytes per input on every call; "
        "autoshard.backend(check_inputs=False) turns it off.)")
