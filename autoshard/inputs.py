"""Inputs that arrive already split: ``autoshard.shard_inputs``.

With ``backend(..., inputs="sharded")`` every rank passes only its part of the sequence, so a data
loader can load only that part:

    batch = autoshard.shard_inputs({"input_ids": ids, "labels": labels}, layout="contiguous")
    loss, logits = model(**batch)

``shard_inputs`` keeps this rank's positions of the inputs that carry the sequence -- every tensor, or
the ones ``names`` says (``shard_inputs(batch, ["input_ids", "labels"])``: a batch that also holds, say,
``pixel_values`` whose dim 1 happens to have the sequence's size) -- and marks that dim dynamic for dynamo (``torch._dynamo.mark_dynamic``), so
the model is traced with a symbolic length. The backend then rebuilds the *global* graph (the local
lengths of all ranks sum to the global one) and compiles it exactly as for whole inputs, except that
these inputs start split. Anything the model derives from them -- positions, masks, shifted labels --
is made right from the global view, the same as with whole inputs.

Use the same ``layout`` as the backend (``"contiguous"``, the default for sharded inputs, or
``"zigzag"``). Models whose code needs the whole length before attention (a full positional table
added by broadcasting, as in ViT) cannot be traced on shards; pass those inputs whole.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .runtime.groups import GroupLike, resolve_group
from .runtime.sequence import shard_sequence

__all__ = ["shard_inputs"]


def _entries(inputs: Any) -> list[tuple[Any, Any]]:
    """(name, value) of the top level of ``inputs``: keys of a dict, positions of a tuple or list, ``None`` for a
    lone tensor."""
    if isinstance(inputs, dict):
        return list(inputs.items())
    if isinstance(inputs, (tuple, list)):
        return list(enumerate(inputs))
    return [(None, inputs)]


def shard_inputs(inputs: Any, names: Sequence[Any] | None = None, *, seq_len: int | None = None, dim: int = 1,
                 group: GroupLike = None, layout: str = "contiguous") -> Any:
    """This rank's part of the sequence inputs in ``inputs`` (a tensor, or a dict, tuple or list of them).

    ``names``: which entries carry the sequence -- dict keys, or positions of a tuple or list; they are split
    along ``dim`` and everything else passes through unchanged. ``None``: every tensor entry carries it
    (``{"input_ids": ..., "labels": ...}``). A named entry that is not a tensor with the sequence length along
    ``dim`` is an error, never skipped: a size that only happens to match is not taken for a sequence, and one
    that does not match is not passed on whole. ``seq_len``: the sequence length (default: the first named
    tensor's size along ``dim``)."""
    entries = dict(_entries(inputs))
    if names is None:
        names = [name for name, value in entries.items() if isinstance(value, torch.Tensor)]
    missing = [name for name in names if name not in entries]
    if missing:
        raise KeyError(f"shard_inputs: no input named {', '.join(map(repr, missing))}; the inputs are "
                       f"{', '.join(map(repr, entries))}")
    if not names:
        raise ValueError("shard_inputs: no tensor to split")
    if seq_len is None:
        first = entries[names[0]]
        seq_len = first.size(dim) if isinstance(first, torch.Tensor) and first.dim() > dim else None
    wrong = {name: tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
             for name, v in ((n, entries[n]) for n in names)
             if not (isinstance(v, torch.Tensor) and v.dim() > dim and v.size(dim) == seq_len)}
    if wrong:
        raise ValueError(f"shard_inputs: the inputs to split must carry the sequence (length {seq_len}) along dim "
                         f"{dim}; {', '.join(f'{name!r} is {what}' for name, what in wrong.items())}. Pass names= "
                         f"with only the inputs that carry the sequence")
    pg = resolve_group(group)

    def shard(x: torch.Tensor) -> torch.Tensor:
        local = shard_sequence(x, dim, group=pg, layout=layout)
        torch._dynamo.mark_dynamic(local, dim)
        return local

    split = {name: shard(entries[name]) for name in names}
    if isinstance(inputs, dict):
        return {name: split.get(name, value) for name, value in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(split.get(i, value) for i, value in enumerate(inputs))
    return split[None]
