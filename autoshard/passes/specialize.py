"""A dynamic-shape graph for the passes: generalized to a class of lengths, or specialized to one call's sizes.

After a model sees two sequence lengths, dynamo recompiles it with symbolic sizes: lengths arrive as ``SymInt``
placeholders and sizes inside the graph are expressions of them. Both functions copy the graph, recompute its
example values on fake tensors and fold every size-valued node into its value (a test of sizes, as ``s0 == 1``,
into its bool, as dynamo folds it in a static graph):

- :func:`generalize` keeps the lengths symbolic: each of dynamo's symbolic input dims becomes a fresh symbol of one
  ``ShapeEnv``, hinted with the call's size. The passes then work on ``SymInt`` sizes (:mod:`autoshard.runtime.
  symbolic`): arithmetic stays an expression, and every comparison that decides something records a guard. After
  the pipeline, :func:`materialize_sizes` turns the sizes written into the rank graph into nodes that compute them
  from its inputs, and the guards are the length class: :meth:`GenericGraph.admits` tells whether a later call is
  in it. A guard is always sound -- the worst case is a class of one length. Inputs that arrive split
  (``inputs="sharded"``) are made at their global shape, their length read from the int input dynamo passes it in
  (each rank's own length there; the call passes the global one): the rank graph's local sizes are expressions of it.
  Values another graph hands on split (``SplitTensor`` carriers) are made at their global shape too, their length
  dynamo's symbol (a call passes the carrier, whose sizes are the global ones).
- :func:`specialize` folds every size into its integer, for one set of sizes (the fallback where a graph of
  symbolic lengths is not supported: values handed between graphs, another inner compiler; and what the memory policy
  plans at the call's sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..runtime.split_tensor import SplitTensor
from .graph import eliminate_dead_code, keep_real_values
from .ops import as_size, hint_of, value_of
from .regions import REGIONS, inline_regions

__all__ = ["is_dynamic", "specialize", "size_key", "symbolic_dims", "symbol_of", "GenericGraph", "generalize",
           "materialize_sizes", "symints_in", "hinted"]


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


def _copy(gm: fx.GraphModule, args: list) -> fx.GraphModule:
    """A copy of ``gm`` with its checkpointed bodies inlined (their example values are recomputed with the rest)
    and the buffers read as masks kept real."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = fx.GraphModule(gm, graph)
    copy.meta[REGIONS] = list(gm.meta.get(REGIONS, []))
    inline_regions(copy)
    keep_real_values(copy, args)
    return copy


def _propagate(gm: fx.GraphModule, mode: FakeTensorMode, fake_args: list) -> None:
    """Recompute every node's example value from ``fake_args`` and fold every size-valued node into its value
    (an ``int``, or a ``SymInt`` of a symbolic length; a shape into its tuple of them; a test of sizes into its
    bool)."""
    with enable_python_dispatcher():  # without it, ``F.pad`` reads a symbolic size through ``aten.size`` as an int
        FakeTensorProp(gm, mode).propagate(*fake_args)
    for node in gm.graph.nodes:  # the inlined bodies' nodes too
        val, before = node.meta.get("val"), value_of(node)
        if isinstance(val, torch.Tensor) and isinstance(before, torch.Tensor) and before.requires_grad:
            val.requires_grad_(True)  # fake propagation detaches; rules read who needs gradients
        node.meta["example_value"] = val
    for node in list(gm.graph.nodes):
        val = node.meta.get("val")
        if isinstance(val, (int, torch.SymInt, torch.SymBool)) and node.op != "output":
            node.replace_all_uses_with(bool(val) if isinstance(val, (bool, torch.SymBool)) else as_size(val))  # noqa
        elif node.op == "call_method" and node.target == "size" and isinstance(val, (tuple, list)):
            node.replace_all_uses_with(tuple(as_size(v) for v in val))  # noqa -- x.shape kept whole (z.shape)
    eliminate_dead_code(gm.graph)
    gm.recompile()


def specialize(gm: fx.GraphModule, args: list, shapes: dict[int, tuple] | None = None) -> fx.GraphModule:
    """A static copy of ``gm`` for the concrete ``args`` (tensors and ints, in placeholder order);
    ``shapes`` overrides the shape of some tensor args (by index) -- the global shapes of split inputs."""
    static = _copy(gm, args)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    for i, shape in (shapes or {}).items():
        with mode:
            fake_args[i] = torch.empty(shape, dtype=args[i].dtype, device=args[i].device)
    _propagate(static, mode, fake_args)
    return static


@dataclass
class GenericGraph:
    """A copy of a dynamic graph whose example values keep the sequence lengths symbolic: what the pipeline compiles
    once for a whole length class (see the module docstring)."""

    gm: fx.GraphModule
    """The copy; its sizes are ``SymInt`` expressions of the symbols of :attr:`dims`, hinted with the first call's
    values."""
    shape_env: ShapeEnv
    """Where compiling it records its guards."""
    mode: FakeTensorMode
    """The fake mode of its example values."""
    dims: list[tuple[int, int, sympy.Symbol]]
    """(input index, dim, symbol) of every symbolic input dim."""
    sizes: list[tuple[int, sympy.Symbol]]
    """(input index, symbol) of the int inputs that are a length no tensor input has."""
    source: fx.GraphModule
    """Dynamo's graph it copies (what a decision taken at the call's own sizes specializes: the memory policy)."""
    fake_args: list
    """The inputs it was compiled with: fake tensors (of symbolic sizes where ``dims`` says), ``SymInt`` lengths;
    what the inner compiler traces the rank graph with, so its code serves the class too (its guards join these)."""
    split_inputs: list[int]
    """The inputs that arrive split (``inputs="sharded"``), at their global shape in :attr:`fake_args`; not in
    :attr:`dims`: their symbols are read from the int inputs that pass their lengths, which a call passes global
    (:meth:`values`, :meth:`admits`), the local lengths checked against the layout apart."""
    carried_inputs: list[int]
    """The inputs that arrive as a ``SplitTensor`` from another graph, at their global shape in :attr:`fake_args` (a
    call passes the carrier: its sizes are the global ones, in :attr:`dims`)."""
    rank_args: list | None = None
    """What the rank graph is called with, as fake values, where that differs from :attr:`fake_args` (the split
    inputs' local shards, of sizes computed from the global lengths); what the inner compiler traces it with."""
    _check: tuple[int, str | None] | None = None

    def values(self, args) -> dict[sympy.Symbol, int]:
        """Every symbol's value in a call with ``args``."""
        return {sym: args[i].size(d) for i, d, sym in self.dims} | {sym: int(args[i]) for i, sym in self.sizes}

    def admits(self, args) -> bool:
        """Whether a call with ``args`` is in the length class: every guard compiling it recorded holds (checked by
        the ``ShapeEnv``'s guard code, built once per set of guards)."""
        env = self.shape_env
        if self._check is None or self._check[0] != len(env.guards):
            self._check = (len(env.guards), env.produce_guards_expression(  # a symbol a guard made constant
                [self.fake_args[i] for i in self._inputs], ignore_static=False))  # is checked as a static size
        code = self._check[1]
        return code is None or env.evaluate_guards_expression(code, [args[i] for i in self._inputs])

    def at_hints(self, args) -> tuple[list, dict[int, tuple]]:
        """(``args`` with every symbolic int at the call's value, the split inputs' global shapes there): what
        :func:`specialize` takes to fold a call's sizes (for a decision taken at them)."""
        ints = [hint_of(f) if isinstance(f, torch.SymInt) else a for a, f in zip(args, self.fake_args)]
        return ints, {i: tuple(hint_of(s) for s in self.fake_args[i].shape)
                      for i in self.split_inputs + self.carried_inputs}

    def bound_above(self) -> None:
        """Limit the class to lengths up to the call's: a decision taken at the call's sizes that stays right for
        shorter ones (a memory policy: memory grows with the length) records this guard."""
        for size in [self.fake_args[i].shape[d] for i, d, _ in self.dims] + [self.fake_args[i] for i, _ in self.sizes]:
            if not size <= hint_of(size):  # records the guard; it holds at the hint
                raise AssertionError("unreachable")

    def describe(self, names: list[str]) -> str:
        """The class as a sentence: each length's range, the sizes a guard made equal named together, and how many
        other guards there are (the layout pieces' sizes, residues), e.g. ``input_ids dim 1 = position_ids dim 1 in
        [6, 32616] (+ 30 more guards)``; ``names``: the inputs' names."""
        env = self.shape_env
        lengths: dict = {}  # the symbol a guard replaced each by -> the sizes it stands for
        for name, sym in [(f"{names[i]} dim {d}", sym) for i, d, sym in self.dims] + [(names[i], sym)
                                                                                     for i, sym in self.sizes]:
            lengths.setdefault(env.replace(sym), []).append(name)
        parts = []
        for sym, named in lengths.items():
            if not sym.free_symbols:
                parts.append(f"{' = '.join(named)} = {sym}")
                continue
            bound = env.bound_sympy(sym)
            high = int(bound.upper) if bound.upper.is_Integer else "..."
            parts.append(f"{' = '.join(named)} in [{max(2, int(bound.lower))}, {high}]")
        other = sum(1 for guard in env.guards if not _bounds_or_names(guard.expr))
        return ", ".join(parts) + (f" (+ {other} more guards)" if other else "")

    @property
    def _inputs(self) -> list[int]:
        """The inputs with a symbolic dim and the symbolic ints (the guards are on their sizes)."""
        return sorted({i for i, _, _ in self.dims} | {i for i, _ in self.sizes})


def _bounds_or_names(expr) -> bool:
    """Whether a guard bounds one symbol by a constant or makes two symbols equal (what :meth:`GenericGraph.describe`
    says in words)."""
    if not isinstance(expr, sympy.Rel):
        return False
    sides = (expr.lhs, expr.rhs)
    return all(side.is_Symbol or side.is_Integer for side in sides) and any(side.is_Symbol for side in sides)


def generalize(gm: fx.GraphModule, args: list, split: dict | None = None) -> GenericGraph:
    """A copy of ``gm`` (dynamo's dynamic graph) for ``args`` whose dims that are symbolic in ``gm`` stay symbolic:
    each a fresh symbol of one ``ShapeEnv``, hinted with its size in ``args`` (an int input that is such a size is
    the same symbol). ``split``: dynamo's symbol -> global length, for the lengths of inputs that arrive split
    (``inputs="sharded"``): every input with such a dim is made at its global shape, the symbol hinted with the
    global length and read from the int input that passes it (each rank's own local length in ``args``; a call then
    passes the global one, see :attr:`GenericGraph.split_inputs`)."""
    split = split or {}
    generic = _copy(gm, args)
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    placeholders = [n for n in generic.graph.nodes if n.op == "placeholder"]
    fake_args, symbols, dims, sizes, split_inputs, carried = list(args), {}, [], [], [], []
    for i, (node, arg) in enumerate(zip(placeholders, args)):
        value = value_of(node)
        if isinstance(arg, SplitTensor):  # a carrier: its global value, placed split by the compile
            carried.append(i)
            shape = []
            for d, (before, size) in enumerate(zip(value.shape, arg.shape)):
                if isinstance(before, torch.SymInt):
                    if size < 2:  # 0 and 1 specialize
                        raise NotImplementedError(f"input {i}'s symbolic sizes {tuple(arg.shape)}")
                    if before.node.expr not in symbols:
                        symbols[before.node.expr] = env.create_symintnode(env.create_symbol(
                            size, ConstantSource(f"input{i}_{d}"), dynamic_dim=DimDynamic.DYNAMIC), hint=size)
                    dims.append((i, d, symbols[before.node.expr].node.expr))
                shape.append(symbols[before.node.expr] if isinstance(before, torch.SymInt) else size)
            with mode:
                fake_args[i] = torch.empty(shape, dtype=arg.dtype, device=arg.device).requires_grad_(arg.requires_grad)
        elif isinstance(arg, torch.Tensor):
            if any(isinstance(s, torch.SymInt) and (not s.node.expr.is_Symbol or a < 2)
                   for s, a in zip(value.shape, arg.shape)):  # 0 and 1 specialize; an expression has no symbol
                raise NotImplementedError(f"input {i}'s symbolic sizes {tuple(arg.shape)}")
            if any(isinstance(s, torch.SymInt) and s.node.expr in split for s in value.shape):
                split_inputs.append(i)  # made at its global shape below, once the global lengths have symbols
                continue
            dynamic = [DimDynamic.DYNAMIC if isinstance(s, torch.SymInt) else DimDynamic.STATIC for s in value.shape]
            fake_args[i] = mode.from_tensor(arg, source=ConstantSource(f"input{i}"),
                                            symbolic_context=StatelessSymbolicContext(dynamic_sizes=dynamic))
            for d, (before, after) in enumerate(zip(value.shape, fake_args[i].shape)):
                if dynamic[d] is DimDynamic.DYNAMIC:
                    symbols.setdefault(before.node.expr, after)
                    dims.append((i, d, after.node.expr))
    for i, (node, arg) in enumerate(zip(placeholders, args)):
        symbol = symbol_of(node)
        if symbol is not None and symbol not in symbols:  # a size passed alone (a graph after a break): its own
            arg = split.get(symbol, arg)
            if arg < 2:
                raise NotImplementedError(f"the size {node.name} = {arg}")
            symbols[symbol] = env.create_symintnode(env.create_symbol(arg, ConstantSource(f"input{i}")), hint=arg)
            sizes.append((i, symbols[symbol].node.expr))
        if symbol is not None:
            fake_args[i] = symbols[symbol]
    for i in split_inputs:
        value = value_of(placeholders[i])
        if any(isinstance(s, torch.SymInt) and s.node.expr not in symbols for s in value.shape):
            raise NotImplementedError(f"input {i} arrives split and its length is no input of the graph")
        with mode:
            fake_args[i] = torch.empty([symbols[s.node.expr] if isinstance(s, torch.SymInt) else s
                                        for s in value.shape], dtype=args[i].dtype, device=args[i].device)
    _propagate(generic, mode, fake_args)
    return GenericGraph(generic, env, mode, dims, sizes, gm, fake_args, split_inputs, carried)


def materialize_sizes(gm: fx.GraphModule) -> int:
    """Replace every ``SymInt`` a pass wrote into a node's arguments by nodes that compute it at run time from the
    graph's inputs (``Graph.materialize_symints``), so the graph runs for every length of its class; returns how
    many. Runs before checkpointed regions are cut out (they then take the sizes as inputs); raises when a body cut
    out before holds one (its inputs need not carry the symbol)."""
    for name, sub in gm.named_modules():
        if sub is not gm and isinstance(sub, fx.GraphModule) and any(symints_in((n.args, n.kwargs))
                                                                      for n in sub.graph.nodes):
            raise NotImplementedError(f"a symbolic size inside the checkpointed body {name}")
    found = [v for n in gm.graph.nodes for v in symints_in((n.args, n.kwargs))]
    if not found:
        return 0
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        nodes = _materialize(gm.graph, found)
    by_id = {id(v): n for v, n in zip(found, nodes)}

    def swap(value):
        if isinstance(value, torch.SymInt):
            return by_id[id(value)]
        if isinstance(value, tuple):
            return tuple(swap(v) for v in value)
        if isinstance(value, list):
            return [swap(v) for v in value]
        if isinstance(value, slice):
            return slice(swap(value.start), swap(value.stop), swap(value.step))
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return value

    made = set(nodes)
    for node in list(gm.graph.nodes):
        if node not in made:
            node.args, node.kwargs = swap(node.args), swap(node.kwargs)
    gm.recompile()
    return len(found)


def symints_in(value) -> list[torch.SymInt]:
    """Every ``SymInt`` in ``value`` (a node's arguments: nested tuples, lists, slices and dicts), in order."""
    if isinstance(value, torch.SymInt):
        return [value]
    if isinstance(value, slice):
        value = (value.start, value.stop, value.step)
    if isinstance(value, dict):
        value = list(value.values())
    return [v for item in value for v in symints_in(item)] if isinstance(value, (tuple, list)) else []


def hinted(env: ShapeEnv, expr) -> torch.SymInt:
    """A ``SymInt`` of the expression ``expr`` of ``env``'s symbols, hinted with its value in the call compiled."""
    hints = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val  # older torch
    return env.create_symintnode(expr, hint=int(expr.xreplace(hints)))


def _materialize(graph: fx.Graph, values: list) -> list:
    """``Graph.materialize_symints(values)``, with a ``Max`` or ``Min`` built from its materialized arguments:
    torch's own interpreter fails on ``Max(1, (1023 - (-a*b)//2)//1024)`` (a chunk count of a product of two
    symbolic sizes: its fake evaluation hands ``sym_max`` None)."""
    plain = [v for v in values if type(v.node.expr).__name__ not in ("Max", "Min")]
    made = dict(zip(map(id, plain), graph.materialize_symints(plain) if plain else []))
    out = []
    for v in values:
        if id(v) in made:
            out.append(made[id(v)])
            continue
        env, expr = v.node.shape_env, v.node.expr
        args = [_materialize(graph, [hinted(env, a)])[0] if a.free_symbols else int(a) for a in expr.args]
        combine = torch.sym_max if type(expr).__name__ == "Max" else torch.sym_min
        node = args[0]
        for arg in args[1:]:
            node = graph.call_function(combine, (node, arg))
        node.meta["val"] = v
        out.append(node)
    return out

