"""Inputs the tests and benchmarks train on."""

from __future__ import annotations

import torch

__all__ = ["packed_row"]


def packed_row(length: int, documents: tuple[int, int], vocab: int, generator: torch.Generator) -> dict:
    """transformers keyword arguments of one row of ``length`` tokens packed with documents of ``documents`` (lowest,
    highest) tokens, the last cut to fit, ``position_ids`` restarting at each -- what ``DataCollatorWithFlattening``
    makes of a micro-batch -- and the tokens as their own labels."""
    docs = []
    while sum(docs) < length:
        docs.append(int(torch.randint(documents[0], documents[1] + 1, (1,), generator=generator)))
    docs[-1] -= sum(docs) - length
    ids = torch.randint(0, vocab, (1, length), generator=generator)
    positions = torch.cat([torch.arange(n) for n in docs if n > 0])[None]
    return dict(input_ids=ids, labels=ids, position_ids=positions, use_cache=False)
