"""A mask built outside compiled code, read back into its structure at run time.

Compiled block by block (``layer.compile(backend=...)`` on every decoder layer, the model's own forward eager, as
torchtitan-style trainers do), a model builds its attention mask where autoshard never sees the code: transformers'
``[B, 1, S, S]`` mask of packed documents (positions restarting per document), of left padding, of a sliding
window, reaches every layer graph as a dense input. Its values are only known at run time, so its structure is
read there, once per mask object, from the values themselves:

* what it may be: ``k <= q``, within one document, to keys that are not padding, within a window of ``W``
  positions (:func:`mask_rows`; every part optional but the causal one), visible where a bool mask is True or a
  float mask is 0, hidden elsewhere (one fill value: ``finfo.min``, ``-inf``);
* the ``O(S)`` data it would be made of, read from ``O(S)`` of its entries: a key is padding when its own
  query does not see it (the diagonal), and a document starts at a key its query's previous visible key is hidden
  from (a gap a window hides cuts the document there, which changes no entry);
* this rank's rows of it checked against what that data makes (its share of the ``O(S^2)`` entries, split among
  the ranks by rows), the window read from rows that stop short of their document; the ranks then exchange
  their verdict, window, fill and a digest of the data (one small all-gather counted as ``"metadata"``), and all
  of them take the structure only when every rank's rows hold and they read the same: a verdict differing across
  ranks never sends ranks down different collective paths.

The layer is handed ``position_ids`` too, but a graph has only the inputs it reads (dynamo drops the others, and
transformers' decoder layers do not read them), so the mask is read from itself; that is also what one process
computes with, and it is checked exactly.

The verdict is kept per mask object (its identity and version: an in-place change reads it again), so the layers
that take the same mask read it once. What it reads is a :class:`DenseMaskStructure`, whose :meth:`carrier
<DenseMaskStructure.carrier>` is the mask as a :class:`~autoshard.runtime.deferred.DeferredTensor`: a recipe made of
:func:`mask_rows` (the same function the rows are checked with, traced) and the ``O(S)`` data, which a graph
compiled by the backend reads as causal, segment ids, key mask and window (:mod:`autoshard.passes.dense_masks`
hands it to the layer graphs in the dense mask's place). This runs between graphs, not in one: it decides which
compiled graph runs, as the backend's choice of a graph per set of sizes does.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx

from .collectives import gather_facts
from .deferred import DeferredTensor, Recipe, defer

__all__ = ["DenseMaskStructure", "mask_rows", "read_structure", "READS_KEPT"]

READS_KEPT = 8
"""How many mask objects keep their verdict (least recently used first out): a step uses one or two masks."""
_READS: OrderedDict[tuple, tuple[weakref.ref, "DenseMaskStructure | None"]] = OrderedDict()
"""(id, version, group name) of a mask -> (the mask, what was read of it)."""


def mask_rows(positions, documents, keys, *, rows: slice, window: int, batch: int):
    """Rows ``rows`` of the ``[batch, 1, S, S]`` bool mask (True: visible) of a structure: query ``q`` sees key
    ``k <= q`` of its own document (``documents``, ``[batch, S]``, or None: one document) that is not padding
    (``keys``, ``[batch, S]`` bool, or None: none), at most ``window - 1`` positions back (0: no window).
    ``positions`` is ``arange(S)``. Written once for tensors and FX proxies: the check computes it,
    :meth:`DenseMaskStructure.recipe` traces it."""
    q, k = positions[rows, None], positions[None, :]
    keep = k <= q
    if window:
        keep = keep & (k > q - window)
    keep = keep[None, None]
    if documents is not None:
        keep = keep & (documents[:, None, rows, None] == documents[:, None, None, :])
    if keys is not None:
        keep = keep & keys[:, None, None, :]
    return keep.expand(batch, 1, -1, -1)


@dataclass(frozen=True, eq=False)
class DenseMaskStructure:
    """The structure a dense ``[B, 1, S, S]`` mask was found to be (see the module docstring)."""

    documents: torch.Tensor | None
    """``[B, S]`` int64, the document of every position (0, 1, ...), or None: one document."""
    keys: torch.Tensor | None
    """``[B, S]`` bool, False at padding keys, or None: no padding."""
    window: int
    """Keys at most ``window - 1`` positions before the query (0: no window)."""
    fill: float | None
    """What hidden entries hold (a float mask; visible ones hold 0), or None: a bool mask."""
    shape: tuple[int, ...]
    """The mask's shape, ``[B|1, 1, S, S]``."""
    dtype: torch.dtype
    """The mask's dtype."""
    device: torch.device
    """The mask's device."""

    def recipe(self) -> Recipe:
        """:func:`mask_rows` of every row, traced into an FX graph of the structure's inputs (``documents``,
        ``keys``: those it has; an anchor when it has none)."""
        return _recipe(self.shape, self.dtype, self.device, self.documents is not None, self.keys is not None,
                       self.window, self.fill)

    @functools.cached_property
    def carrier(self) -> DeferredTensor:
        """The mask as the recipe of this structure and its ``O(S)`` data (made once)."""
        return defer(self.recipe(), [t for t in (self.documents, self.keys) if t is not None]
                     or [torch.empty(0, device=self.device)])  # the anchor: the carrier needs an inner tensor


@functools.lru_cache(maxsize=64)  # one per kind of structure, not one per mask object (one per step)
def _recipe(shape, dtype, device, documents: bool, keys: bool, window: int, fill: float | None) -> Recipe:
    graph = fx.Graph()
    tracer = fx.proxy.GraphAppendingTracer(graph)
    inputs = {name: fx.Proxy(graph.placeholder(name), tracer) for name, used in (("documents", documents),
                                                                                 ("keys", keys)) if used}
    if not inputs:
        graph.placeholder("anchor")  # the carrier needs an inner tensor: an empty one stands in
    positions = fx.Proxy(graph.call_function(torch.arange, (shape[-1],), {"device": device}), tracer)
    out = mask_rows(positions, inputs.get("documents"), inputs.get("keys"), rows=slice(None), window=window,
                    batch=shape[0])
    if fill is not None:  # as transformers turns a bool mask into a float one
        out = torch.where(out, positions.new_zeros((), dtype=dtype), fill)
    graph.output(out.node)
    return Recipe(fx.GraphModule(torch.nn.Module(), graph), shape, dtype, device)


def read_structure(mask: torch.Tensor, pg: dist.ProcessGroup) -> DenseMaskStructure | None:
    """The structure of ``mask`` (``[B, 1, S, S]``, the same on every rank of ``pg``) that every rank of ``pg``
    agreed on, or None when it is not one (see the module docstring); read once per mask object."""
    key = (id(mask), mask._version, pg.group_name)
    held = _READS.get(key)
    if held is not None and held[0]() is mask:
        _READS.move_to_end(key)
        return held[1]
    structure = _read(mask, pg)
    _READS[key] = (weakref.ref(mask), structure)
    if len(_READS) > READS_KEPT:
        _READS.popitem(last=False)
    return structure


def _read(mask: torch.Tensor, pg: dist.ProcessGroup) -> DenseMaskStructure | None:
    entries, floating = mask[:, 0], mask.is_floating_point()
    documents, keys = _data(entries, floating)
    facts = gather_facts(_facts(entries, floating, documents, keys, pg.rank(), pg.size()), pg)
    windows = {window for _, window, *_ in facts if window}
    fills = {code for *_, hides, code, _ in facts if hides}
    window = max(windows, default=0)
    if not (all(f[0] for f in facts) and len({f[-1] for f in facts}) == 1 and len(windows) <= 1
            and len(fills) == floating and all(f[2] <= window for f in facts if window and not f[1])):
        return None
    fill = struct.unpack("<d", struct.pack("<q", fills.pop()))[0] if floating else None
    return DenseMaskStructure(documents, keys, window, fill, tuple(mask.shape), mask.dtype, mask.device)


def _data(entries: torch.Tensor, floating: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The documents and padding keys ``entries`` (``[B, S, S]``) would be made of, from ``O(S)`` of them (see the
    module docstring), each None when trivial (one document, no padding)."""
    batch, length = entries.size(0), entries.size(-1)
    positions = torch.arange(length, device=entries.device)
    keys = _visible(entries.diagonal(dim1=-2, dim2=-1), floating)
    last = torch.where(keys, positions, -1).cummax(-1).values  # the last key at or before each position
    before = torch.cat([last.new_full((batch, 1), -1), last[:, :-1]], 1)
    linked = _visible(entries.gather(-1, before.clamp_min(0)[..., None])[..., 0], floating)
    documents = (keys & (before >= 0) & ~linked).cumsum(-1)
    return documents if bool(documents[:, -1].any()) else None, None if bool(keys.all()) else keys


def _facts(entries: torch.Tensor, floating: bool, documents, keys, rank: int, world: int) -> list[int]:
    """What this rank reads of its share of the rows of ``entries``: whether they hold the structure, the window
    they show (0: none), the farthest any of them reaches back, whether they hide an entry and the fill they hide
    it with, a digest of the structure's data."""
    batch, length = entries.size(0), entries.size(-1)
    positions = torch.arange(length, device=entries.device)
    rows = slice(length * rank // world, length * (rank + 1) // world)
    own = entries[:, rows]
    visible = _visible(own, floating)
    structure = functools.partial(mask_rows, positions, documents, keys, rows=rows, batch=batch)
    seen = visible.any(-1)
    first = visible.to(torch.uint8).argmax(-1)  # the first key each row sees
    reach = structure(window=0)[:, 0].to(torch.uint8).argmax(-1)  # the first key of its document
    span = positions[rows] - first + 1
    stopped = seen & (first > reach)  # rows a window stops short of their document
    window = int(span[stopped].max()) if bool(stopped.any()) else 0
    holds = torch.equal(visible, structure(window=window)[:, 0])
    fill = own.amin() if floating and own.numel() else own.new_zeros((), dtype=torch.float64)
    if floating:  # every hidden entry holds the same value
        holds = holds and bool((visible | (own == fill)).all())
    digest = hashlib.sha256(repr((batch, length)).encode())
    for t in (documents, keys):
        digest.update(b"-" if t is None else t.to(torch.int64).cpu().contiguous().numpy().tobytes())
    return [int(holds), window, int(span[seen].max()) if bool(seen.any()) else 0, int(bool(fill != 0)),
            _code(float(fill)), int.from_bytes(digest.digest()[:7], "big")]


def _visible(entries: torch.Tensor, floating: bool) -> torch.Tensor:
    """Where a bool mask is True, or a float mask 0."""
    return entries == 0 if floating else entries


def _code(x: float) -> int:
    """A float's bits as an int64 (exchanged exactly)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]
