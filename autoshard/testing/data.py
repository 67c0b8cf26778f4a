"""Inputs the tests and benchmarks train on."""

from __future__ import annotations

import torch

__all__ = ["packed_row", "long_tail", "positions_of"]


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


def long_tail(length: int, seed: int, *, longest: tuple[int, int] = (8192, 16384)) -> list[int]:
    """Document lengths of one row of ``length`` tokens as long-tailed fine-tuning data packs it: one long document
    (``longest`` tokens, at most a quarter of the row) at a random place among log-normal ones (median about 500
    tokens, 16 to 4096)."""
    gen = torch.Generator().manual_seed(seed)
    long = min(int(torch.randint(longest[0], longest[1] + 1, (1,), generator=gen)), length // 4)
    out: list[int] = []
    while sum(out) < length - long:
        out.append(int(torch.empty(1).log_normal_(6.2, 1.0, generator=gen).clamp(16, 4096)))
    out[-1] -= sum(out) - (length - long)
    out = [n for n in out if n > 0]
    out.insert(int(torch.randint(0, len(out) + 1, (1,), generator=gen)), long)
    return out


def positions_of(lengths: list[int]) -> torch.Tensor:
    """``position_ids`` ``[1, sum(lengths)]`` of documents of ``lengths`` packed in one row (restarting at each)."""
    return torch.cat([torch.arange(n) for n in lengths])[None]
