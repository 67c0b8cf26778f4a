"""A dynamic-shape graph's calls: each served by a length class or by a graph compiled for its sizes.

dynamo hands the backend a graph of symbolic sizes after a second sequence length (at once with inputs
``autoshard.shard_inputs`` split: it marks their dim dynamic). :class:`PerSizes` is what the backend returns for
it: on a call, the first length class every rank admits runs it (:meth:`~autoshard.compiler.AutoshardBackend.
compile_class` compiled it); else a new class is compiled, or where a class is not supported, a graph for the
call's sizes (:meth:`~autoshard.compiler.AutoshardBackend.compile_for_sizes`); the ``SIZES_CACHED`` sets of sizes
used most recently keep the graph that served them. Every rank makes the same decision on every call: with split
inputs the ranks' local lengths differ, so on every call they all-gather their local lengths and a digest of their
other sizes (a few bytes, counted as ``"metadata"``), key the cache on all ranks' lengths and pass the graph the
global length where dynamo passes the rank's own; a rank whose shard is not the one the layout gives it, or whose
other sizes differ, makes every rank raise.

Values an earlier graph hands on: a ``DeferredTensor`` input's recipe is inlined into the graph once, as dynamo
traced its inner tensors (of symbolic sizes), and each call is flattened to the recipe's inputs alike, so the
classes see plain inputs; a ``SplitTensor`` input's local length, which dynamo lifts as an input of its own where a
checkpointed region passes every size it holds, is replaced by the carrier's global length in every call (it differs
per rank by design, and no node reads it).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from .boundary import traced_deferred_inputs, unwrap_inputs
from .passes.deferred import DeferredOutput
from .passes.ops import value_of
from .passes.pipeline import input_name
from .passes.specialize import GenericGraph, size_key, symbol_of, symbolic_dims
from .placements import Shard
from .records import Cause
from .runtime.collectives import gather_facts
from .runtime.deferred import DeferredTensor
from .runtime.layouts import SequenceLayout
from .runtime.split_tensor import SplitTensor
from .runtime.symbolic import evaluate, is_symbolic

__all__ = ["SIZES_CACHED", "CLASS_TRIES", "PerSizes", "NO_SHARDED_INPUT", "short_shard", "on_every_rank",
           "placing_per_call", "split_dims_of"]

SIZES_CACHED = 8
"""How many sets of sizes of one dynamic-shape graph keep their compiled graph (least recently used first out)."""
CLASS_TRIES = 2
"""How many times a dynamic graph tries to compile a length class before it compiles once per set of sizes only
(a try that fails costs a compile)."""


class PerSizes:
    """What the backend returns for a dynamic-shape graph: each call runs the length class it is in, else compiles
    one (or a graph for its sizes where no class is supported); the ``SIZES_CACHED`` sets of sizes used most
    recently keep the graph that served them (see the module docstring)."""

    def __init__(self, backend: Any, gm: fx.GraphModule, example_inputs: list):
        """``backend``: the :class:`~autoshard.compiler.AutoshardBackend` that compiles for it (not imported here:
        the compiler imports this module). Values an earlier graph left uncomputed (``DeferredTensor``) are
        inlined first, and each call flattened alike: their recipes' inputs are inputs like any other (dynamo
        guards the recipes themselves)."""
        self.cause = backend._cause
        """Why dynamo handed the backend this graph: the cause of its first compilation, at its first call (after
        dynamo may have handed over other graphs, with their own causes)."""
        self.flatten = any(isinstance(x, DeferredTensor) for x in example_inputs)
        gm, example_inputs = traced_deferred_inputs(gm, example_inputs)
        self.backend, self.gm = backend, gm
        self.cache: OrderedDict[tuple, Callable] = OrderedDict()
        self.classes: list[tuple[GenericGraph, Callable]] = []
        """The length classes compiled (:meth:`AutoshardBackend.compile_class`), each with its rank graph: a call
        one admits compiles nothing."""
        self.class_failures = 0
        self.no_class: str | None = None
        """Why no length class is tried any more (:data:`CLASS_TRIES` failed), or None."""
        self.compiled_keys: set[tuple] = set()
        """Every key compiled so far (evicted ones too): a key compiled again was dropped from the cache."""
        self.names = [input_name(n) or n.name for n in gm.graph.nodes if n.op == "placeholder"]
        """The inputs' names in the user's code (what a cause names)."""
        self.last_args: tuple | None = None
        """The shapes and dtypes (:func:`size_key`) of the latest call, what a new one is compared with."""
        self.split_dims = split_dims_of(gm, example_inputs) if backend.config.inputs == "sharded" else []
        if backend.config.inputs == "sharded" and not self.split_dims:
            raise ValueError(NO_SHARDED_INPUT)
        self.pg = backend._sequence_group()
        self.symbols = [symbol_of(p) for p in gm.graph.nodes if p.op == "placeholder"]
        """Each input's symbol, where it is a size (dynamo passes symbolic sizes as ints), else None."""
        split = {sym for _, _, sym in self.split_dims}
        self.length_args = {i for i, symbol in enumerate(self.symbols) if symbol in split}
        """Inputs that are a split length themselves: a call passes the global length there."""
        self.local_lengths = _local_lengths(gm, example_inputs, self.symbols)
        """Inputs that are the local length of a carrier another graph handed on split (a checkpointed region
        lifts every size its inputs hold): input -> the carrier's (input, dim). Different on every rank by design,
        and read by no node (the carrier's global size stands for it), so a call passes the global length there:
        the same on every rank, for the checks that the ranks' inputs and graphs agree."""
        dims = symbolic_dims(gm)
        for i, symbol in enumerate(self.symbols):  # a size input named as the input dim it is the size of
            j, d = next(((j, d) for j, d, sym in dims if sym == symbol), (None, None))
            if j is not None:
                self.names[i] = f"{self.names[j]} dim {d}" + (" (global)" if i in self.length_args else "")

    def __call__(self, *args):
        if self.flatten:
            args = unwrap_inputs(args, flatten=True, split=())[0]
        if self.local_lengths:
            args = tuple(args[self.local_lengths[i][0]].size(self.local_lengths[i][1]) if i in self.local_lengths
                         else a for i, a in enumerate(args))
        lengths = self._split_lengths(args) if self.split_dims else None
        key = (size_key(args), lengths)
        fn = self.cache.get(key)
        totals = None
        if lengths is not None:  # the graph takes the global lengths where dynamo passes this rank's own
            if fn is None:
                self._check_layout(lengths)
            totals = {sym: sum(column) for (_, _, sym), column in zip(self.split_dims, zip(*lengths))}
            args = tuple(totals[symbol] if i in self.length_args else a
                         for i, (a, symbol) in enumerate(zip(args, self.symbols)))
        if fn is None and self.classes:
            fn = self._class_of(args)
        if fn is None:
            self.backend._cause = self._cause_of(key) if self.last_args is not None else self.cause
            self.compiled_keys.add(key)
            found = self.no_class or self.backend.compile_class(self.gm, list(args), self.names, self.split_dims,
                                                                totals)
            if isinstance(found, tuple):
                self.classes.append(found)
                fn = found[1]
            else:
                self._no_class(found)
                fn = self.backend.compile_for_sizes(self.gm, list(args), self.split_dims, totals)
        if key not in self.cache:
            self.cache[key] = fn
            if len(self.cache) > SIZES_CACHED:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(key)
        self.last_args = key[0]
        return fn(*args)

    def _no_class(self, why: str) -> None:
        """A length class was not compiled, for ``why``: the compilation for these sizes says so in its cause (what
        :func:`explain` prints); after a second failure no class is tried again (each try costs a compile)."""
        self.class_failures += 1
        if self.class_failures >= CLASS_TRIES:
            self.no_class = why
        if why:
            cause = self.backend._cause
            self.backend._cause = dataclasses.replace(cause, detail="; ".join(
                filter(None, [cause.detail, f"no length class: {' '.join(why.split())[:160]}"])))

    def _class_of(self, args) -> Callable | None:
        """The rank graph of the first length class every rank admits a call with ``args`` to, or None. Each rank's
        compile records its own guards (its layout pieces differ), so the ranks agree (a few bytes, once per new
        set of sizes: a repeated one is cached)."""
        first = next((i for i, (generic, _) in enumerate(self.classes) if generic.admits(args)), -1)
        if self.pg.size() > 1 and len({row[0] for row in gather_facts([first], self.pg)}) > 1:
            return None
        return self.classes[first][1] if first >= 0 else None

    def _cause_of(self, key: tuple) -> Cause:
        """Why sizes ``key`` are compiled, against the latest call's: compiled before and dropped from the cache,
        or what changed -- a dtype, a leading dim of a multi-dim input alone (the batch), else the sequence."""
        if key in self.compiled_keys:
            return Cause("sizes dropped from the cache", f"more than SIZES_CACHED={SIZES_CACHED} sets of sizes in use")
        changed, dtypes = [], []
        for i, (new, old) in enumerate(zip(key[0], self.last_args)):
            if isinstance(new, tuple) and isinstance(old, tuple):
                (shape, dtype), (old_shape, old_dtype) = new, old
                if dtype != old_dtype:
                    dtypes.append(f"{self.names[i]}: {old_dtype} -> {dtype}")
                changed += [(i, d, len(shape)) for d, (a, b) in enumerate(zip(shape, old_shape)) if a != b]
        if dtypes:
            return Cause("new dtype", ", ".join(dtypes))
        detail = ", ".join(f"{self.names[i]} dim {d}: {self.last_args[i][0][d]} -> {key[0][i][0][d]}"
                           for i, d, _ in changed[:3])
        if changed and all(d == 0 and ndim > 1 for _, d, ndim in changed):
            return Cause("new batch size", detail)
        return Cause("new sequence length", detail or "a length passed as an int")

    def _split_lengths(self, args) -> tuple[tuple[int, ...], ...]:
        """Every rank's local lengths of the split dims (``[rank][dim]``), all-gathered with a digest of each
        rank's other sizes; raises on every rank alike when the ranks' other sizes differ."""
        others = [[list(a.shape), a.dtype] if isinstance(a, torch.Tensor) else None if i in self.length_args else a
                  for i, a in enumerate(args)]
        for i, d, _ in self.split_dims:
            others[i][0][d] = None
        digest = int.from_bytes(hashlib.sha256(repr(others).encode()).digest()[:7], "big")
        rows = gather_facts([args[i].size(d) for i, d, _ in self.split_dims] + [digest], self.pg)
        if len({row[-1] for row in rows}) > 1:
            raise RuntimeError("autoshard: with inputs='sharded' every rank must pass inputs of the same shapes apart "
                               "from the split sequence dim; the ranks' other sizes differ")
        return tuple(tuple(row[:-1]) for row in rows)

    def _check_layout(self, lengths: tuple[tuple[int, ...], ...]) -> None:
        """Raise (on every rank alike: ``lengths`` is all-gathered) unless every split input arrives as the
        layout splits it. Checked once per set of lengths, when it is compiled."""
        kind = self.backend.sharded_layout
        for k, (i, d, _) in enumerate(self.split_dims):
            column = tuple(row[k] for row in lengths)
            expected = SequenceLayout.of(kind, sum(column), self.pg.size()).local_lengths
            if column != expected:
                raise RuntimeError(
                    f"autoshard: input {i} arrives split along dim {d} into local lengths {list(column)} over the "
                    f"ranks, but the {kind} layout of {sum(column)} positions gives {list(expected)}; split inputs "
                    f"with autoshard.shard_inputs(..., layout={kind!r})")


NO_SHARDED_INPUT = (
    "autoshard: inputs='sharded' expects the inputs that carry the sequence to come from autoshard.shard_inputs(...), "
    "which marks their sequence dim dynamic; this graph has no such input. inputs='sharded' serves a model dynamo "
    "compiles as one graph; a graph after a graph break or FSDP2's per-layer cut is not supported with it yet. Pass "
    "whole inputs with inputs='replicated' (the default).")


def short_shard(example_inputs: list) -> str:
    """Why a graph with inputs ``autoshard.shard_inputs`` split is static: a shard of fewer than 2 positions (dynamo
    compiles a size of 0 or 1 as a constant even where it was marked dynamic, so this rank's graph would not be the
    others'); empty otherwise."""
    for i, x in enumerate(example_inputs):
        for d in sorted(getattr(x, "_dynamo_dynamic_indices", ())) if isinstance(x, torch.Tensor) else ():
            if x.dim() > d and x.size(d) < 2:
                return (f"autoshard: with inputs='sharded' every rank must hold at least 2 positions of the sequence: "
                        f"this rank's shard (input {i}) has {x.size(d)} along dim {d}, and dynamo compiles a size of 0 "
                        f"or 1 as a constant, so this rank's graph would not be the other ranks'. Pass sequences of at "
                        f"least 2 positions per rank, or whole inputs (inputs='replicated', which serves any length)")
    return ""


def on_every_rank(ok: bool, pg: dist.ProcessGroup) -> bool:
    """Whether ``ok`` holds on every rank of ``pg`` (one small all-gather, so all ranks take the same path)."""
    return ok if pg.size() == 1 else all(row[0] for row in gather_facts([int(ok)], pg))


def placing_per_call(run: Callable, wrapper: Callable, placements: dict[int, Shard],
                     deferred: dict[int, DeferredOutput], generic: GenericGraph) -> Callable:
    """``run`` (a rank graph of symbolic lengths) wrapped by ``wrapper`` with the outputs it returns split placed,
    and those it leaves uncomputed shaped, for each call's lengths: one wrapper per set of lengths. What leaves of
    the class's length is marked so that the next graph dynamo traces takes it at any length."""
    @functools.lru_cache(maxsize=SIZES_CACHED)
    def wrapped(key: tuple) -> Callable:
        values = dict(key)
        return wrapper(run, split_outputs={i: dataclasses.replace(p, layout=p.layout.evaluated(values),
                                                                  factors=tuple(evaluate(f, values) for f in p.factors))
                                           for i, p in placements.items()},
                       deferred_outputs={i: d.evaluated(values) for i, d in deferred.items()})

    def varying(shape) -> list[int]:
        return [d for d, size in enumerate(shape) if is_symbolic(size)]

    marks = {i: () for i, p in placements.items() if is_symbolic(p.layout.length)}
    marks |= {i: (varying(d.shape), [varying(generic.fake_args[j].shape) for j in d.inputs]
                  + ([list(range(1, 1 + len(d.anchor)))] if d.anchor is not None else []))
              for i, d in deferred.items() if varying(d.shape)}

    def run_placed(*args):
        out = wrapped(tuple(generic.values(args).items()))(*args)
        for i, marked in marks.items():
            out[i].mark_any_length(*marked)
        return out

    return run_placed


def _local_lengths(gm: fx.GraphModule, example_inputs: list, symbols: list) -> dict[int, tuple[int, int]]:
    """The inputs of ``gm`` that are the local length of a ``SplitTensor`` input split by a layout (``symbols``: each
    input's symbol, where it is a size): input -> (the carrier's input, its split dim). The graph computes on the
    carrier's global value, so no node reads them; a KV cache's carrier is not one of them (its local length is left
    to the checks)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    local = {}
    for i, x in enumerate(example_inputs):
        split = isinstance(x, SplitTensor) and isinstance(x.layout_rule, SequenceLayout)
        size = value_of(placeholders[i]).local.shape[x.seq_dim] if split else None
        if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
            local[size.node.expr] = (i, x.seq_dim)
    return {i: local[symbol] for i, symbol in enumerate(symbols) if symbol in local}


def split_dims_of(gm: fx.GraphModule, example_inputs: list) -> list[tuple[int, int, Any]]:
    """(input, dim, symbol) of the symbolic dims ``autoshard.shard_inputs`` marked: the split sequence. Other
    symbolic dims (a batch size dynamo made dynamic after a change) are sizes like any other."""
    return [(i, d, sym) for i, d, sym in symbolic_dims(gm)
            if d in getattr(example_inputs[i], "_dynamo_dynamic_indices", ())]
