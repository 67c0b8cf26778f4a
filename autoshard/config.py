"""Options of the backend, in one keyword-only dataclass validated when the backend is built."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Union

import torch

from .runtime.attention import STRATEGIES

__all__ = ["BackendConfig", "STRATEGY_CHOICES", "LAYOUT_CHOICES", "resolve_config", "dynamo_settings",
           "trace_checkpointed_layers"]

STRATEGY_CHOICES = ("auto", *STRATEGIES)
"""What the ``strategy`` option takes: ``"auto"`` or a registered strategy's name."""
LAYOUT_CHOICES = ("auto", "contiguous", "zigzag")
"""What the ``layout`` option takes."""


@dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """What ``autoshard.backend(group, config, **overrides)`` and ``autoshard.plan`` take besides the group: pass
    one as ``config=``, or its fields as keywords (set on top of ``config`` when both are given)."""

    strategy: str = "auto"
    """Distributed attention algorithm for every attention: ``"ring"``, ``"zigzag"`` (ring over the
    zigzag layout), ``"allgather"`` (all-gather K/V), ``"ulysses"`` (all-to-all over heads),
    ``"hybrid"`` (ulysses inside, ring across; needs a 2-D mesh), or ``"auto"`` (chosen per attention
    by the cost model; reasons are in the plan)."""

    layout: str = "auto"
    """How the sequence is split: ``"contiguous"``, ``"zigzag"`` (balances causal attention), or
    ``"auto"`` (the layout the chosen strategy runs best on: zigzag for the zigzag ring, and for a causal
    attention under the all-gather or the hybrid; contiguous for the contiguous ring and Ulysses).
    Inputs split by ``autoshard.shard_inputs`` arrive contiguous under ``"auto"``."""

    seq_dims: Mapping[Union[str, int], int] | None = None
    """The sequence dim of inputs whose sequence dim inference cannot find, by input name (the
    argument name of ``forward``) or position: ``{"input_ids": 1}``. Usually unnecessary: the sequence
    is found from the attention calls."""

    inputs: str = "replicated"
    """``"replicated"``: every rank passes the same full inputs. ``"sharded"``: inputs that carry the
    sequence arrive already split by ``autoshard.shard_inputs`` (a data loader loads only its part)."""

    check_inputs: bool = True
    """With ``inputs="replicated"``: every call of a compiled graph first checks that the ranks passed the same
    inputs (a digest of each, one all-gather of 16 bytes per input, :mod:`autoshard.runtime.input_check`), so a
    rank fed another batch raises on every rank instead of returning a loss mixed from several batches. False
    skips it (one small collective and one host synchronization per graph call fewer)."""

    outputs: str = "split"
    """What becomes of outputs split along the sequence (scalars and other reductions are always reduced):
    ``"gathered"``: all-gathered, every rank gets plain whole tensors. ``"split"``: they come back as
    :class:`autoshard.SplitTensor` -- the global shape, this rank's shard inside: a graph compiled by the same
    backend (after a graph break, the next block, the loss) takes it still split; other code gathers it on
    each use (``.full_tensor()`` once for a whole copy). ``"sharded"``: this rank's plain local shards."""

    grad_sync: bool = True
    """Sum parameter gradients over the group, so every rank holds the one-process gradients. With
    False, nothing is summed: each rank holds P times its share, so the ranks' gradients *average* to the
    one-process gradient -- what DDP and FSDP2 (both average) make of them when they reduce over the
    sequence group, or over the flattened (dp, sp) ranks. (With True, DDP/FSDP on top is still correct,
    only one all-reduce more.)"""

    inner: Union[str, Callable] = "auto"
    """The compiler the rewritten graph is handed to: ``"eager"``, ``"aot_eager"``, ``"inductor"``, any
    torch.compile backend callable, or ``"auto"``: inductor for graphs on CUDA (the fused kernels a GPU
    user compiles for, around the distributed attention's own), eager elsewhere, with ``offload`` (its
    host copies must run, not be traced) and with ``head_chunks`` > 1 (the projections' head groups are a Python
    autograd function, :mod:`autoshard.runtime.head_groups`; with another compiler the groups stay inside the
    attention op)."""

    length_classes: bool = True
    """Compile a graph whose sequence length varies (dynamo's dynamic graph, after a second length) once for a
    whole class of lengths: its sizes stay symbolic through the passes and the rank graph computes them at run
    time; a length outside every compiled class (the cost model switches strategy there, or a few tokens per
    rank) compiles its class. Applies with whole inputs and the inner compilers ``eager``, ``aot_eager`` and
    ``inductor`` (they compile the class's graph with symbolic sizes), in a graph that takes no values from another
    graph; with a memory budget (the default on CUDA) a class ends at the length it was compiled for. Elsewhere,
    and with False, a dynamic graph compiles once per set of sizes (``explain()`` says why)."""

    kernels: str = "auto"
    """Local attention implementation: ``"triton"``, ``"torch"``, or ``"auto"`` (Triton on CUDA)."""

    dry_run: bool = False
    """Build the plan and log it on rank 0 (the ``"autoshard"`` logger, level INFO: e.g.
    ``logging.basicConfig(level=logging.INFO)``), then run the model unsharded."""

    topology: Any = None
    """The hardware profile the cost model chooses strategies with (:class:`~autoshard.hardware.HardwareProfile`:
    ranks per node, FLOP/s, bandwidths, latencies; ``autoshard.hardware("a100")`` or a calibrated file gives one);
    None = the default (H100 nodes: 8 GPUs on NVLink, InfiniBand between nodes)."""

    memory_budget: int | None = None
    """Per-rank memory budget in bytes. It drives the memory policy (:mod:`autoshard.policy`): of the levers
    the user left unset, it takes the cheapest that makes the planned per-rank peak fit (the ladder, cheapest
    first: as configured, ``chunk_mlp``, ``tile_tokens``, then each with ``recompute="layers"``, then each
    with ``offload`` too; the host bytes within ``host_budget``) -- and a budget nothing fits raises
    :class:`autoshard.policy.MemoryBudgetError` on every rank, naming the smallest feasible budget. The
    choice is in the compile report and the plan. The cost model also drops attention strategies whose
    buffers exceed it. None: on CUDA the device's memory (when nothing fits, a warning and the smallest
    option); on CPU no policy."""

    host_budget: int | None = None
    """Per-rank host memory budget in bytes for ``offload`` (the checkpointed layers' inputs kept in pinned host
    memory): the memory policy takes offload only where the planned host bytes fit it. None: the host's
    physical memory divided among the node's ranks (``LOCAL_WORLD_SIZE``) when the backend decides, no limit
    when a plan does."""

    chunk_loss: int | None = 1024
    """Tokens per chunk of the chunked LM head + loss, or None to leave the head and its loss as they are. A
    ``linear -> [.float()] -> [view/reshape, slices of the tokens] -> cross_entropy`` whose logits have no other
    use becomes ``autoshard::linear_cross_entropy`` (:mod:`autoshard.runtime.chunked_loss`): forward and
    backward run over this rank's tokens a chunk at a time and never hold the ``[tokens, vocab]`` logits,
    their softmax or their gradient whole. When the loss wants gradients, each chunk's gradients of the hidden
    state and of the head's weight are made in forward right after its loss (three products of the head in all,
    the fewest there are), and a weight-sized gradient is held until backward. On by default: at long context
    the logits are the largest values of a step (16k tokens x 128k vocab in float32 is 8 GiB). The default 1024
    keeps a chunk's float32 logits at 125 MiB for a 32k vocabulary and 500 MiB for 128k, while a chunk's matmul
    (1024 x hidden x vocab) stays large enough to run at full speed. Every rank runs the same number of chunks,
    derived from the largest rank's share of the tokens."""

    lazy_logits: bool = True
    """Return an LM head's logits that the graph only returns (the model called with ``labels=``: the loss is
    chunked, the logits are returned beside it) as :class:`~autoshard.runtime.lazy_linear.LazyLinear`: computed
    when first read, from the hidden state the graph keeps (``[tokens, hidden]`` instead of ``[tokens, vocab]``,
    one product of the head fewer when nobody reads them). Reading them after the head's weight changed (an
    optimizer step computes pending logits first; FSDP2 resharding after backward, a manual in-place update do
    not) raises. False: the graph computes them as the model does (:mod:`autoshard.passes.lazy`)."""

    chunk_mlp: int | None = None
    """Tokens per chunk of the token-local MLP blocks (``linear -> activation [* linear] -> linear``: SwiGLU, GELU
    MLPs, found from the graph), or None to leave them as they are. Each chunk of this rank's tokens runs the
    block under activation checkpointing, so its ``[tokens, intermediate]`` values are alive one chunk at a time in
    forward and again in backward (one more forward of the block: the price). Off by default; the memory
    policy (``memory_budget``) turns it on when the budget needs it (1024 tokens, or a sixteenth of the rank's
    tokens when that is more). Every rank runs the same number of chunks,
    derived from the largest rank's share of the tokens."""

    tile_tokens: int | None = None
    """Tokens per tile of the token-local regions of the graph (norms, projections, residual adds, the MLP: every
    op whose row ``i`` reads row ``i`` only, found from the graph, :mod:`autoshard.passes.tile`), or None to leave
    them whole. Each tile of this rank's tokens runs a region under activation checkpointing, so a layer's
    ``[tokens, hidden]`` temporaries (a norm's float32 upcast and its backward's) are alive one tile at a time
    (one more forward of those ops: the price). Subsumes ``chunk_mlp`` for the MLPs it tiles. Off by default;
    the memory policy may turn it on. Every rank runs the same number of tiles."""

    head_chunks: int = 1
    """Head groups every distributed attention runs one at a time (:mod:`autoshard.runtime.attention.head_chunks`:
    UPipe's idea, for every strategy): its gathered or head-split copies, accumulators and gradients exist for one
    group's heads at a time -- at long context they are the largest values of a layer (Ulysses holds the whole
    sequence of its heads). Groups follow the key/value heads (a GQA group stays together); fewer when the heads
    do not allow as many (Ulysses needs a query head per rank in every group; dropout runs whole). Costs more, smaller
    collectives (Ulysses sends a key/value head to every rank whose group reads it). With the eager inner compiler
    the q/k/v and output projections run in the same groups as the attention (:mod:`autoshard.passes.heads`): the
    query, the output and their gradients, outside the op, exist for one group at a time too (the output
    projection becomes a sum of partial products, and the groups then divide the key/value heads evenly).
    The memory policy may set it."""

    recompute: str = "none"
    """Activation recomputation the compiler adds: ``"none"``, or ``"layers"``: every transformer layer (the
    nodes of one ``ModuleList`` entry, from the graph's module stacks) runs under activation checkpointing, so
    backward keeps only the layers' inputs and reruns each layer, its collectives included. Layers the model
    already checkpoints stay as they are. ``memory_budget`` may turn it on."""

    offload: bool = False
    """Keep the inputs of checkpointed regions (``recompute="layers"``, or the model's own checkpoints) in host
    memory from forward until backward reaches them (:mod:`autoshard.runtime.offload`): with every layer
    recomputed they are what a rank still holds, ``layers x tokens x hidden``. Each costs one copy to the host
    and one back, on a copy stream of their own (CUDA) so that they overlap compute. Runs with the ``"eager"`` inner
    compiler only. ``memory_budget`` may turn it on."""

    offload_prefetch: bool = True
    """With ``offload``: prefetch in backward -- the first use of a region's inputs also starts bringing back the
    inputs of the region backward reaches next, so that copy runs during this region's recomputation and
    backward. Costs one more region's inputs on the device (a layer's input); False: each region's inputs come back
    when backward first uses them, the compute stream waiting for the copy. The memory policy may turn it off."""

    offload_spared: int = 0
    """With ``offload``: how many checkpointed regions' inputs the host does not keep, counted from the last
    region back (the memory policy sets it when the host budget is short; :mod:`autoshard.runtime.offload`). The
    last region keeps its inputs on the device: backward starts with them, so the device holds them no longer at
    its peak than offload would. Each further one is every other region from the end: its input, the output of the
    region before it, is not kept at all -- backward computes it again from that region's inputs (one more forward
    of that region, without autograd)."""

    def inner_for(self, device_type: str) -> Union[str, Callable]:
        """The inner compiler for a graph whose inputs are on ``device_type``: ``inner``, with ``"auto"``
        resolved."""
        if self.inner != "auto":
            return self.inner
        return "inductor" if device_type == "cuda" and not self.offload and self.head_chunks == 1 else "eager"

    def __post_init__(self):
        def check(name, value, allowed):
            if value not in allowed:
                raise ValueError(f"autoshard.backend: {name}={value!r} is not one of {allowed}")

        check("strategy", self.strategy, STRATEGY_CHOICES)
        check("layout", self.layout, LAYOUT_CHOICES)
        check("inputs", self.inputs, ("replicated", "sharded"))
        check("outputs", self.outputs, ("split", "gathered", "sharded"))
        check("kernels", self.kernels, ("auto", "torch", "triton"))
        if not callable(self.inner):
            check("inner", self.inner, ("auto", "eager", "aot_eager", "inductor"))
        if self.strategy == "zigzag" and self.layout == "contiguous":
            raise ValueError("autoshard.backend: strategy='zigzag' is the ring over the zigzag layout; "
                             "use layout='zigzag' (or 'auto'), or strategy='ring' for the contiguous layout")
        if self.seq_dims is not None:
            for key, dim in self.seq_dims.items():
                if not isinstance(key, (str, int)) or not isinstance(dim, int):
                    raise ValueError(f"autoshard.backend: seq_dims maps input names or positions to ints, got {key!r}: {dim!r}")
        for budget in ("memory_budget", "host_budget"):
            if getattr(self, budget) is not None and getattr(self, budget) <= 0:
                raise ValueError(f"autoshard.backend: {budget} must be a positive number of bytes")
        check("recompute", self.recompute, ("none", "layers"))
        check("lazy_logits", self.lazy_logits, (True, False))
        check("check_inputs", self.check_inputs, (True, False))
        if self.offload and self.inner not in ("eager", "auto"):
            raise ValueError("autoshard.backend: offload=True runs with inner='eager' only (a tracing compiler would "
                             f"trace the host copies instead of running them), got inner={self.inner!r}")
        if isinstance(self.offload_spared, bool) or not isinstance(self.offload_spared, int) or self.offload_spared < 0:
            raise ValueError(f"autoshard.backend: offload_spared is an int >= 0, got {self.offload_spared!r}")
        if isinstance(self.head_chunks, bool) or not isinstance(self.head_chunks, int) or self.head_chunks < 1:
            raise ValueError(f"autoshard.backend: head_chunks is a positive int, got {self.head_chunks!r}")
        for lever in ("chunk_mlp", "tile_tokens"):
            value = getattr(self, lever)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"autoshard.backend: {lever} is a positive number of tokens or None, got {value!r}")
        if self.chunk_loss is not None and (isinstance(self.chunk_loss, bool) or not isinstance(self.chunk_loss, int)
                                            or self.chunk_loss <= 0):
            raise ValueError("autoshard.backend: chunk_loss is a positive number of tokens or None, "
                             f"got {self.chunk_loss!r}")


def resolve_config(config: BackendConfig | None, overrides: dict, caller: str = "autoshard.backend") -> BackendConfig:
    """``config`` (None: the defaults) with the keyword ``overrides`` (:class:`~autoshard.config.BackendConfig`
    fields) applied on top; raises TypeError on a ``config`` that is not a BackendConfig or an unknown option."""
    if config is not None and not isinstance(config, BackendConfig):
        raise TypeError(f"{caller}: config must be an autoshard.BackendConfig, got {type(config).__name__}")
    names = [f.name for f in dataclasses.fields(BackendConfig)]
    unknown = [name for name in overrides if name not in names]
    if unknown:
        raise TypeError(f"{caller}: unknown option(s) {', '.join(map(repr, unknown))}; the options are the fields "
                        f"of autoshard.BackendConfig: {', '.join(names)}")
    if config is None:
        return BackendConfig(**overrides)
    return dataclasses.replace(config, **overrides) if overrides else config


_CHECKPOINTED_SIDE_EFFECTS = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def dynamo_settings():
    """The dynamo settings autoshard traces a model with, as a context manager (plans trace under it): a
    checkpointed function may have side effects (see :func:`trace_checkpointed_layers`)."""
    return torch._dynamo.config.patch(**{_CHECKPOINTED_SIDE_EFFECTS: True})


def trace_checkpointed_layers() -> None:
    """Set the dynamo setting of :func:`dynamo_settings` for the process (what every autoshard backend does when it
    is made, before dynamo traces anything).

    Why: transformers (5.25 and later, with the ``kernels`` package) keeps bookkeeping in a module-level object
    inside every attention layer, and dynamo refuses a side effect inside a checkpointed function unless
    ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint`` is set: under
    ``model.gradient_checkpointing_enable()`` (or ``activation_checkpointing_enable()``) every layer would break out
    of the graph and run uncompiled, its attention not distributed. Dynamo reads the setting while it traces,
    before any backend sees a graph, and ``torch.compile`` passes a backend no hook to scope it to its own model
    (it drops a backend's ``backend_ctx_ctor``), so it is set for the process. What it changes, for any model: a
    checkpointed region with a side effect, which dynamo would otherwise run uncompiled (replaying the side effect
    when backward recomputes it), is compiled, and the side effect runs once, in forward."""
    if not getattr(torch._dynamo.config, _CHECKPOINTED_SIDE_EFFECTS):
        setattr(torch._dynamo.config, _CHECKPOINTED_SIDE_EFFECTS, True)
        logging.getLogger("autoshard").info("autoshard: set torch._dynamo.config.%s = True (checkpointed layers with "
                                            "side effects compile)", _CHECKPOINTED_SIDE_EFFECTS)
