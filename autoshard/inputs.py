"""Inputs that arrive already split: ``autoshard.shard_inputs``.

With ``backend(..., inputs="sharded")`` every rank passes only its part of the sequence, so a data
loader can load only that part:

    batch = autoshard.shard_inputs({"input_ids": ids, "labels": labels}, layout="contiguous")
    loss, logits = model(**batch)

``shard_inputs`` keeps this rank's positions of every tensor that carries the sequence (size
``seq_len`` along ``dim``) and marks that dim dynamic for dynamo (``torch._dynamo.mark_dynamic``), so
the model is traced with a symbolic length. The backend then rebuilds the *global* graph (the local
lengths of all ranks sum to the global one) and compiles it exactly as for whole inputs, except that
these inputs start split. Anything the model derives from them -- positions, masks, shifted labels --
is made right from the global view, the same as with whole inputs.

Use the same ``layout`` as the backend (``"contiguous"``, the default for sharded inputs, or
``"zigzag"``). Models whose code needs the whole length before attention (a full positional table
added by broadcasting, as in ViT) cannot be traced on shards; pass those inputs whole.
"""

from __future__ import annotations

from typing import Any

import torch

from .runtime.groups import GroupLike, resolve_group
from .runtime.sequence import shard_sequence

__all__ = ["shard_inputs"]


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def shard_inputs(inputs: Any, *, seq_len: int | None = None, dim: int = 1, group: GroupLike = None,
                 layout: str = "contiguous") -> Any:
    """This rank's part of every tensor in ``inputs`` (a tensor, tuple, list or dict) whose size along
    ``dim`` is the sequence length ``seq_len`` (default: the size along ``dim`` of the first tensor with
    more than ``dim`` dims); other values pass through unchanged."""
    pg = resolve_group(group)
    if seq_len is None:
        candidates = [t for t in _tensors(inputs) if t.dim() > dim]
        if not candidates:
            raise ValueError(f"shard_inputs: no tensor with a dim {dim} to take the sequence length from")
        seq_len = candidates[0].size(dim)

    def shard(x):
        if isinstance(x, torch.Tensor) and x.dim() > dim and x.size(dim) == seq_len:
            local = shard_sequence(x, dim, group=pg, layout=layout)
            torch._dynamo.mark_dynamic(local, dim)
            return local
        return x

    return torch.utils._pytree.tree_map(shard, inputs)
