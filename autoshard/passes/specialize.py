"""Specialize a dynamic-shape graph to the sizes of one call.

After a model sees two sequence lengths, dynamo recompiles it with symbolic sizes: lengths arrive as
``SymInt`` placeholders and sizes inside the graph are expressions of them. The compiler's rules work
on concrete sizes (each rank's local sizes differ anyway), so a dynamic graph is compiled once per
distinct set of sizes it is called with: the graph is copied, its example values are recomputed on
fake tensors of the concrete sizes, and every size-valued node is folded into its integer (a test of
sizes, as ``s0 == 1``, into its bool, as dynamo folds it in a static graph). Dynamo keeps one dynamic
graph (no recompile limit is hit); this pass caches one static graph per length.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .graph import eliminate_dead_code, keep_real_values
from .ops import value_of
from .regions import REGIONS, inline_regions

__all__ = ["is_dynamic", "specialize", "size_key", "symbolic_dims", "symbol_of"]


def _symbolic(v) -> bool:
    if isinstance(v, torch.SymInt):
        return True
    if isinstance(v, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in v.shape)
    return False


def is_dynamic(gm: fx.GraphModule) -> bool:
    """True when the graph has symbolic sizes."""
    return any(_symbolic(value_of(n)) for n in gm.graph.nodes if n.op == "placeholder")


def size_key(args) -> tuple:
    """What a specialization depends on: the integer inputs and every tensor's shape and dtype."""
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


def symbolic_dims(gm: fx.GraphModule) -> list[tuple[int, int, object]]:
    """(placeholder index, dim, sympy symbol) of every tensor input dim whose size is a plain symbol."""
    out = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        v = value_of(node)
        if isinstance(v, torch.Tensor):
            for d, size in enumerate(v.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    out.append((i, d, size.node.expr))
    return out


def symbol_of(node: fx.Node):
    """The sympy symbol of a SymInt placeholder, or None."""
    v = value_of(node)
    return v.node.expr if isinstance(v, torch.SymInt) else None


def specialize(gm: fx.GraphModule, args: list, shapes: dict[int, tuple] | None = None) -> fx.GraphModule:
    """A static copy of ``gm`` for the concrete ``args`` (tensors and ints, in placeholder order);
    ``shapes`` overrides the shape of some tensor args (by index) -- the global shapes of split inputs."""
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, copies)
    graph.output(out)
    static = fx.GraphModule(gm, graph)
    static.meta[REGIONS] = list(gm.meta.get(REGIONS, []))
    inline_regions(static)  # checkpointed bodies: their example values are recomputed with the rest
    keep_real_values(static, args)  # buffers read as masks
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    for i, shape in (shapes or {}).items():
        with mode:
            fake_args[i] = torch.empty(shape, dtype=args[i].dtype, device=args[i].device)
    FakeTensorProp(static, mode).propagate(*fake_args)
    for node in static.graph.nodes:  # the inlined bodies' nodes too
        val, before = node.meta.get("val"), value_of(node)
        if isinstance(val, torch.Tensor) and isinstance(before, torch.Tensor) and before.requires_grad:
            val.requires_grad_(True)  # fake propagation detaches; rules read who needs gradients
        node.meta["example_value"] = val
    for node in list(static.graph.nodes):
        val = node.meta.get("val")
        if isinstance(val, (int, torch.SymInt, torch.SymBool)) and node.op != "output":  # a size or a test of one
            node.replace_all_uses_with(bool(val) if isinstance(val, (bool, torch.SymBool)) else int(val))  # noqa
    eliminate_dead_code(static.graph)
    static.recompile()
    return static
