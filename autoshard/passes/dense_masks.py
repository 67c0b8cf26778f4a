"""Masks that arrive dense: a graph whose attention mask is an input built by code autoshard does not compile.

Compiled block by block, with the model's own forward eager around the blocks, a layer graph takes the mask
transformers builds before the layers as a plain ``[B, 1, S, S]`` input (a mask built in a graph compiled by the
same backend arrives as its recipe instead, :mod:`.deferred`). Taken as it is, the attention would run on gathered
keys with this rank's rows of it. Its values are known only when the graph runs, and they are usually one of the
masks the mask pass structures (causal, packed documents, left padding, a sliding window), so the graph is compiled
in variants and each call picks one:

* :func:`dense_mask_inputs` finds the inputs that are such masks: ``[B|1, 1, S, S]``, bool or floating, needing
  no gradient, not module state, read by an attention (a ``softmax`` or ``scaled_dot_product_attention``
  downstream, or a higher-order op that may hold one);
* :func:`dense_mask_runner` reads each one's structure on every call (:func:`~autoshard.runtime.dense_masks.
  read_structure`: once per mask object, each rank checking its share of the rows, every rank agreeing) and calls
  the variant compiled with the masks that hold a structure handed in as that structure's recipe (a
  :class:`~autoshard.runtime.deferred.DeferredTensor`, inlined and read by the mask pass as any mask built in the
  graph: the attention distributed, no ``S x S`` value); a mask that holds none stays the dense input of the
  variant, run on gathered keys and warned, exact.

Variants are compiled on first use, with that call's inputs, and kept: one per combination of structure kinds
(documents or not, padding or not, the window, the fill), so a new packing, padding or mask object of the same
kind runs the graph already compiled. The verdict is the same on every rank, so every rank compiles and runs the
same variant.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from ..runtime.dense_masks import read_structure
from .graph import is_module_state
from .masks import MASKING_FILL
from .ops import canonical

__all__ = ["dense_mask_inputs", "dense_mask_runner"]

_READERS = ("attention", "softmax")
"""Canonical ops that read a mask: an input reaching one may be an attention's mask."""


def dense_mask_inputs(gm: fx.GraphModule, example_inputs: list) -> tuple[int, ...]:
    """Positions of the inputs of ``gm`` that are attention masks built outside compiled code (see the module
    docstring), given the graph's example inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(i for i, (node, x) in enumerate(zip(placeholders, example_inputs))
                 if _shaped_like_mask(x) and not is_module_state(node) and _reaches_attention(node))


def _shaped_like_mask(x) -> bool:
    """A plain tensor ``[B|1, 1, S, S]`` (S > 1), bool or floating, that needs no gradient."""
    return (type(x) is torch.Tensor and not x.requires_grad and x.dim() == 4 and x.size(1) == 1
            and x.size(-1) == x.size(-2) > 1 and (x.dtype == torch.bool or x.is_floating_point()))


def _reaches_attention(node: fx.Node) -> bool:
    """Whether ``node``'s value flows into an op that reads a mask (:data:`_READERS`) or a higher-order op."""
    seen, todo = {node}, [node]
    while todo:
        user = todo.pop()
        if isinstance(user.target, torch._ops.HigherOrderOperator):
            return True
        op = canonical(user)
        if op is not None and op.name in _READERS:
            return True
        reached = [u for u in user.users if u not in seen]
        seen.update(reached)
        todo.extend(reached)
    return False


def dense_mask_runner(gm: fx.GraphModule, masks: tuple[int, ...], compile: Callable[[fx.GraphModule, list], Callable],
                      pg: dist.ProcessGroup) -> Callable:
    """Run ``gm`` (whose inputs at ``masks`` are dense masks) as the module docstring says: ``compile(graph,
    inputs)`` compiles a copy of ``gm`` for inputs in which the masks that hold a structure are that structure's
    recipe."""
    compiled: dict[tuple, Callable] = {}

    def run(*args):
        carriers = {i: _carrier(args[i], pg) for i in masks}
        args = [carriers[i] if carriers.get(i) is not None else a for i, a in enumerate(args)]
        key = tuple(None if c is None else c.recipe for c in carriers.values())
        if key not in compiled:
            compiled[key] = compile(copy.deepcopy(gm), args)
        return compiled[key](*args)

    return run


def _carrier(mask: torch.Tensor, pg: dist.ProcessGroup):
    """``mask`` as the recipe of its structure, or None when it holds none the mask pass distributes (a float mask
    whose hidden entries do not mask: :data:`~.masks.MASKING_FILL`)."""
    structure = read_structure(mask, pg)
    if structure is None or (structure.fill is not None and structure.fill > MASKING_FILL):
        return None
    return structure.carrier
