"""``DeferredTensor``: a value one compiled graph leaves uncomputed, as the small inputs it is made from.

The second carrier across graph boundaries (the first is :class:`~autoshard.runtime.split_tensor.SplitTensor`).
A model often builds, in one graph, a value that is large but cheap and determined by a few small inputs, and
uses it in the next graphs: transformers builds the ``[B, 1, S, S]`` attention mask once from ``position_ids``
(packed documents), a 2-D ``attention_mask`` (padding), ``cache_position``, before its layers, and FSDP2's
per-layer graphs (or any graph break, or per-block compilation) hand it to every layer graph as an input. Read
there as a tensor it has no structure left: the attention would need it dense, ``S x S`` per rank.

Two carriers were possible. One holds the *classified* structure (causal, window, key mask, segments...), which
the layer graph would have to re-read as a formula, and which cannot say what the classification drops (a row
constant in an ALiBi bias) or what it cannot read in one graph but can in another (a FlexAttention block mask
next to its ``mask_mod``). The other holds the *recipe*: the producing graph's own nodes that compute the value,
and the tensors they read. That is this one: the producing graph does not compute the value; it returns a
``DeferredTensor`` holding a :class:`Recipe` (an FX graph) and its inputs (``position_ids``: ``O(S)`` data).
A graph compiled by the same backend that takes it as an input gets the recipe's nodes inlined in place of the
input (:func:`autoshard.passes.deferred.inline_deferred`), so its passes see the mask exactly as a whole-model
compile would -- built from aranges, comparisons and positions -- and turn it into a structured mask the same
way; the dense nodes then have no user and are removed. A rank never holds the dense value, in no graph.

Anywhere else -- user code between graphs, a graph of another backend -- the value is computed where it is used
(``__torch_dispatch__`` runs the recipe; warned once), so every use sees the one-process value. Metadata reads
(shape, dtype) compute nothing; a cast (FSDP2's mixed precision casts floating inputs) stays deferred (the
cast is one more node of the recipe); in-place changes raise.

Which outputs are deferred (:func:`autoshard.passes.deferred.defer_outputs`): values that need no gradient,
computed by pure, deterministic ops from inputs that need none, whose largest value is many times their inputs
(a mask of ``S x S`` from ``S`` positions; RoPE's ``[S, D]`` cos and sin from ``S`` positions, which each layer
then computes for its own tokens only).

A graph compiled for a length class hands on recipes whose code computes their sizes from what they read
(:mod:`autoshard.passes.deferred`): the same recipe at every length, a carrier of the call's shape
(:meth:`DeferredTensor.mark_any_length` marks its lengths dynamic, so the next graph dynamo traces takes any).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.fx as fx

from .carrier import Carrier, is_fake_or_meta

__all__ = ["Recipe", "DeferredTensor", "defer"]


class Recipe:
    """How a deferred value is computed: ``graph_module(*inputs)`` (see the module docstring). Two recipes are
    equal when their code and constants are (dynamo guards a graph on its deferred inputs' recipes: a new packing
    of the same shapes is the same recipe, so nothing recompiles; the shapes are guarded apart, as the carrier's
    and its inputs' sizes, so a recipe whose code computes its sizes from its inputs -- a length class's --
    serves every length)."""

    def __init__(self, graph_module: fx.GraphModule, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.graph_module = graph_module
        """Placeholders: the inputs, in order; output: the value."""
        self.shape, self.dtype, self.device = tuple(int(s) for s in shape), dtype, torch.device(device)
        """The value's shape where it was made (a carrier of another length has its own), dtype and device."""
        digest = hashlib.sha256(graph_module.code.encode())
        for name, buffer in sorted(graph_module.named_buffers()):
            digest.update(name.encode() + buffer.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        digest.update(repr((self.dtype, self.device)).encode())
        self.key = digest.hexdigest()[:24]
        """A digest of the code, its constants and the value's dtype and device."""

    @property
    def inputs(self) -> int:
        """How many inputs the recipe reads."""
        return sum(1 for n in self.graph_module.graph.nodes if n.op == "placeholder")

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.graph_module(*inputs)

    def cast(self, dtype: torch.dtype | None, device: torch.device | None) -> "Recipe":
        """This recipe followed by ``.to(device, dtype)``."""
        graph = fx.Graph()
        env = {}
        for node in self.graph_module.graph.nodes:
            if node.op == "output":
                value = env[node.args[0]]
                kwargs = {k: v for k, v in (("dtype", dtype), ("device", device)) if v is not None}
                graph.output(graph.call_method("to", (value,), kwargs))
            else:
                env[node] = graph.node_copy(node, lambda n: env[n])
        gm = fx.GraphModule(self.graph_module, graph)
        return Recipe(gm, self.shape, dtype or self.dtype, device or self.device)

    def __eq__(self, other) -> bool:
        return isinstance(other, Recipe) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"Recipe({self.key[:8]}: {self.inputs} input(s) -> {list(self.shape)} {self.dtype})"


def _cast(source: DeferredTensor, **kwargs) -> DeferredTensor:
    """``source.to(dtype, device)`` (FSDP2's mixed precision casts floating inputs): still deferred, the cast one
    more node of the recipe. Any other copy computes the value."""
    if set(kwargs) - {"dtype", "device"}:
        return NotImplemented
    return DeferredTensor(source.recipe.cast(kwargs.get("dtype"), kwargs.get("device")), source.recipe_inputs)


class DeferredTensor(Carrier):
    """A value computed where it is used, from the small inputs it is made from (see the module docstring)."""

    recipe: Recipe
    """How the value is computed."""
    recipe_inputs: tuple[torch.Tensor, ...]
    """What the recipe reads (at least one: a recipe that reads no input reads an empty anchor tensor)."""

    own_ops = {torch.ops.aten._to_copy.default: _cast}
    in_place_error = ("autoshard: {op} changes in place a value a compiled graph left uncomputed (a DeferredTensor, "
                      "such as an attention mask); take a computed copy first (x = x.materialize())")

    @staticmethod
    def __new__(cls, recipe: Recipe, inputs, shape=None):
        out = cls._wrapper(shape if shape is not None else recipe.shape, recipe.dtype, recipe.device)
        out.recipe, out.recipe_inputs = recipe, tuple(inputs)
        for i, value in enumerate(out.recipe_inputs):
            setattr(out, f"input{i}", value)  # dynamo reads the inner tensors as attributes
        return out

    def __tensor_flatten__(self):
        return [f"input{i}" for i in range(len(self.recipe_inputs))], self.recipe

    @staticmethod
    def __tensor_unflatten__(inner, recipe, outer_size, outer_stride):
        return DeferredTensor(recipe, [inner[f"input{i}"] for i in range(len(inner))], outer_size)

    def __repr__(self) -> str:
        return f"DeferredTensor(shape={tuple(self.shape)}, dtype={self.dtype}, {self.recipe!r})"

    def aliased(self) -> DeferredTensor:
        return self  # no gradient ever flows through it

    def mark_any_length(self, dims: Sequence[int], input_dims: Sequence[Sequence[int]]) -> None:
        """Make this carrier one the next graph may take at any length (a length class returns it: its recipe
        computes its sizes from its inputs' shapes): its own ``dims`` and each recipe input's ``input_dims``
        dynamic."""
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(self, d)
        for x, dims_of_x in zip(self.recipe_inputs, input_dims):
            for d in dims_of_x:
                torch._dynamo.maybe_mark_dynamic(x, d)

    def materialize(self) -> torch.Tensor:
        """The value, computed (a plain tensor)."""
        if not any(is_fake_or_meta(x) for x in self.recipe_inputs):
            self.warn_once(
                f"autoshard: a value a compiled graph left uncomputed (a {list(self.shape)} {self.dtype} tensor "
                "such as an attention mask: an autoshard.runtime.deferred.DeferredTensor) is used outside code "
                "autoshard compiles, so it is computed whole for that use, and again for every later use. A "
                "graph compiled by the same backend computes only what it needs of it (a mask as its structure)")
        return self.recipe(*self.recipe_inputs)


def defer(recipe: Recipe, inputs: list[torch.Tensor], shape: tuple[int, ...] | None = None) -> DeferredTensor:
    """The deferred value of ``recipe`` on ``inputs`` (copies: the value must not change when the caller later
    changes its inputs in place), of ``shape`` (None: the recipe's)."""
    return DeferredTensor(recipe, [x.detach().clone() for x in inputs], shape)
