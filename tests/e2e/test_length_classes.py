"""A graph whose sequence length varies compiles once per length class, not once per length.

After a second length dynamo hands the backend a graph of symbolic sizes; the backend compiles it with the lengths
symbolic (``BackendConfig.length_classes``): the rank graph computes its sizes, layouts and collective counts at run
time, and every later length the compile's guards admit runs it without compiling. A length outside every class
(below twice the world size, where the zigzag layout cannot cut it, or where the cost model switches strategy)
compiles its own class. Checked here against one process in float64: the loss and every parameter's gradient, at
lengths the world size does not divide, a length below the world size, and lengths on both sides of a class
boundary, with the compilations counted.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.data import packed_row
from autoshard.testing.models import LlamaLM

LENGTHS = (40, 41, 37, 53, 64, 4, 45, 2)
"""The first length compiles dynamo's static graph; the second its dynamic one, a class the next ones join (the world
size divides some, not others; 45 after the short one); 4 (one or two tokens per rank, below the zigzag layout's 2P
chunks at 3 and 4 ranks) and 2 (below the world size at 3 and 4 ranks: a rank holds none) compile classes of their
own: at a few tokens per rank the pieces' sizes decide branches."""


def _train_at_lengths(lengths, classes: bool, inner: str = "eager", sharded: str | None = None,
                      per_block: str | None = None, **options):
    """Train at each of ``lengths`` against one process; ``sharded``: the inputs arrive split in that layout
    (``inputs="sharded"``, ``autoshard.shard_inputs``); ``per_block``: every block compiled alone, the rest run
    eagerly (torchtitan's per-block compile), ``"fsdp"``: and FSDP2 over the ranks per block (as torchtitan
    applies them)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = LlamaLM().double()
    ref = copy.deepcopy(model)
    if sharded:
        options.update(inputs="sharded", layout=sharded)
    backend = autoshard.backend(length_classes=classes, inner=inner, grad_sync=per_block != "fsdp", **options)
    if per_block:
        for block in model.blocks:
            block.compile(backend=backend)
            if per_block == "fsdp":
                fully_shard(block)
        if per_block == "fsdp":
            fully_shard(model)
    compiled = model if per_block else torch.compile(model, backend=backend)
    generator = torch.Generator().manual_seed(1)
    worst = 0.0
    for n in lengths:
        ids = torch.randint(0, 256, (2, n), generator=generator)
        if sharded:
            loss = compiled(**autoshard.shard_inputs({"input_ids": ids, "labels": ids}, layout=sharded))[0]
        else:
            loss = compiled(ids, ids)[0]
        loss.backward()
        expected = ref(ids, ids)[0]
        expected.backward()
        worst = max(worst, (loss - expected).abs().item(),
                    *((getattr(p.grad, "full_tensor", lambda g=p.grad: g)() - q.grad).abs().max().item()
                      for p, q in zip(model.parameters(), ref.parameters())))
        model.zero_grad()
        ref.zero_grad()
    strategies = {a["strategy"] for record in backend.compiled for a in record.report.attention}
    return worst, dict(backend.compilations), strategies, autoshard.explain(backend)


@pytest.mark.parametrize("world, recompute", [(3, "layers"), pytest.param(2, "none", marks=pytest.mark.slow),
                                             pytest.param(4, "none", marks=pytest.mark.slow)])
def test_one_compilation_per_length_class(world, recompute):
    """(At 3 ranks with every layer checkpointed: the sizes the checkpointed bodies read are computed outside and
    handed in.)"""
    for worst, compilations, strategies, explained in run_on_ranks(_train_at_lengths, world, LENGTHS, True,
                                                                   recompute=recompute, timeout=600):
        assert worst < 1e-12, worst
        assert "; serves input_ids dim 1 in [" in explained, explained  # what explain() says of a class
        assert compilations == {"new graph": 1, "recompiled by dynamo": 1, "new sequence length": 2}, compilations
        assert strategies and not strategies & {"whole", "gathered-kv"}, strategies


@pytest.mark.parametrize("world, inner, per_block, compiled", [
    (3, "eager", "compiled", {"new graph": 1, "recompiled by dynamo": 5, "new sequence length": 2}),
    (2, "eager", "fsdp", {"new graph": 1, "recompiled by dynamo": 4, "new sequence length": 1}),
    pytest.param(2, "aot_eager", "compiled", {"new graph": 1, "recompiled by dynamo": 4, "new sequence length": 1},
                 marks=pytest.mark.slow)])
def test_blocks_compiled_alone_hand_on_values_of_any_length(world, inner, per_block, compiled):
    """Every block compiled alone (graph breaks and FSDP2's per-layer graphs cut a model the same way): the first
    block takes whole inputs, the next ones the previous block's output still split (a ``SplitTensor``). What a
    length class returns split is of any length (dynamo guards its layout's kind and world size, not its length,
    and both its global and local lengths are dynamic on every rank), so the blocks that take it compile once per
    class too: 8 lengths, 2 graphs (whole inputs, carried ones) of 4 compilations each at 3 ranks: dynamo's first
    static graph, the class of the long lengths, and the two short ones (4 and 2: a rank holds fewer than 2
    positions, so their carriers keep their length). Under FSDP2 per block (torchtitan's recipe) the same: its
    hooks hand each block a view of the carrier. At 2 ranks 4 is in the long class, 2 is not."""
    for worst, compilations, strategies, explained in run_on_ranks(_train_at_lengths, world, LENGTHS, True, inner,
                                                                   None, per_block, timeout=600):
        assert worst < 1e-12, worst
        assert compilations == compiled, explained
        assert re.search(r"SplitTensor'>\); serves x dim 1 = cos dim 0 = sin dim 0 in \[\d+, ", explained), explained
        assert strategies and not strategies & {"whole", "gathered-kv"}, strategies


def _packed_transformers_llama(lengths, classes=True, fsdp=False):
    """Train transformers' Llama on packed rows of ``lengths``; ``fsdp``: the README's recipe -- transformers'
    checkpointing, FSDP2 on every decoder layer and the root, the whole model compiled (FSDP2's hooks cut it into a
    graph per layer; the rotary tables and the document mask reach them uncomputed). Returns the worst difference
    from one process, the compilation counts after two lengths and at the end, and the strategies."""
    import transformers
    from torch.distributed.fsdp import fully_shard

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).double()
    if fsdp:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = copy.deepcopy(model)
    if fsdp:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    compiled = autoshard.compile(model, length_classes=classes, grad_sync=not fsdp)
    backend = compiled.autoshard_backend
    generator = torch.Generator().manual_seed(2)
    worst, counts = 0.0, []
    for n in lengths:
        batch = packed_row(n, (5, 20), 256, generator)  # documents of 5-20 tokens
        loss = compiled(**batch).loss
        loss.backward()
        expected = ref(**batch).loss
        expected.backward()
        worst = max(worst, (loss - expected).abs().item(),
                    *((getattr(p.grad, "full_tensor", lambda g=p.grad: g)() - q.grad).abs().max().item()
                      for p, q in zip(model.parameters(), ref.parameters())))
        model.zero_grad()
        ref.zero_grad()
        counts.append(dict(backend.compilations))
    return worst, counts[1], counts[-1], {a["strategy"] for r in backend.compiled for a in r.report.attention}


@pytest.mark.slow  # the default tier's Trainer run trains the same on DataCollatorWithFlattening's rows
def test_packed_documents_of_every_length_share_a_compilation():
    """A padding-free fine-tuning loop (transformers Llama, packed rows of a new length every step): one compilation
    for dynamo's first graph and one for the class of the rest, every step exact."""
    lengths = (120, 97, 131, 88, 150, 103)
    for worst, _, compilations, strategies in run_on_ranks(_packed_transformers_llama, 2, lengths, timeout=600):
        assert worst < 1e-5, worst  # a float64 model; transformers computes its loss in float32 (logits.float())
        assert compilations == {"new graph": 1, "recompiled by dynamo": 1}, compilations
        assert strategies and not strategies & {"whole", "gathered-kv"}, strategies


def test_fsdp2_recipe_compiles_nothing_after_the_second_length():
    """The README's recipe (transformers' checkpointing, FSDP2 per decoder layer and root, the model compiled whole)
    on packed rows of a new length every step: FSDP2's hooks cut the model into a graph per layer, and the graph
    before the layers hands them the rotary tables and the document mask uncomputed (``DeferredTensor``). A length
    class leaves them as recipes whose code computes their sizes from what they read (positions, an anchor holding
    the lengths), so the recipe is the same at every length, and the layer graphs take them (and the previous
    layer's output, split) at any length: every graph compiles twice -- dynamo's first static graph and its class
    -- and nothing after the second length; exact at every step. (A carrier's local length, which a checkpointed
    region lifts as an input of its own, differs on every rank: it once failed the ranks' agreement checks.)"""
    lengths = (120, 97, 131, 88, 150, 103)
    for worst, after_two_lengths, at_end, strategies in run_on_ranks(_packed_transformers_llama, 2, lengths, True,
                                                                     True, timeout=600):
        assert worst < 1e-5, worst
        assert at_end == after_two_lengths, (after_two_lengths, at_end)  # compilation counts, not times
        assert set(at_end) == {"new graph", "recompiled by dynamo"}, at_end
        assert strategies and not strategies & {"whole", "gathered-kv"}, strategies


def test_length_classes_with_aot_eager():
    """The inner compiler traces the rank graph with the class's symbolic sizes (its own guards join the class's),
    so one compilation serves the class with ``inner="aot_eager"`` too."""
    for worst, compilations, _, _ in run_on_ranks(_train_at_lengths, 2, (40, 41, 37, 53), True, "aot_eager",
                                                  timeout=600):
        assert worst < 1e-12, worst
        assert compilations == {"new graph": 1, "recompiled by dynamo": 1}, compilations


SHARDED_LENGTHS = (40, 41, 37, 9, 45, 8)
"""Lengths of inputs that arrive split: every rank holds at least 2 positions (at 3 and 4 ranks; a shard of 0 or 1
is an error, dynamo compiles such a size as a constant: ``test_backend_options.py``), 9 and 8 at a few per rank (45
after them back in the first class)."""


@pytest.mark.parametrize("world, layout, inner, classes", [
    (3, "contiguous", "eager", 1),
    pytest.param(3, "contiguous", "aot_eager", 2, marks=pytest.mark.slow),  # its trace's guards: 9 and 8 apart
    pytest.param(4, "zigzag", "eager", 2, marks=pytest.mark.slow),  # 9 and 8: one zigzag chunk per rank or two
    pytest.param(2, "contiguous", "eager", 1, marks=pytest.mark.slow)])
def test_inputs_that_arrive_split_compile_once_per_length_class(world, layout, inner, classes):
    """``inputs="sharded"``: dynamo's graph (dynamic from the first call: ``shard_inputs`` marks the dim) is compiled
    at the global length, symbolic, its inputs arriving as the layout splits it; a call passes the global length
    (its local lengths exchanged, a few bytes, and checked against the layout), so a new length compiles nothing
    unless a class ends (at a few tokens per rank)."""
    for worst, compilations, strategies, explained in run_on_ranks(_train_at_lengths, world, SHARDED_LENGTHS, True,
                                                                   inner, layout, timeout=600):
        assert worst < 1e-12, worst
        assert compilations == {"new graph": 1} | ({"new sequence length": classes - 1} if classes > 1 else {}), \
            explained
        assert "serves input_ids dim 1 (global) in [" in explained, explained
        assert strategies and not strategies & {"whole", "gathered-kv"}, strategies


@pytest.mark.slow
@pytest.mark.parametrize("inner, tolerance, sharded", [("aot_eager", 1e-12, None), ("inductor", 1e-7, None),
                                                      ("eager", 1e-12, "contiguous")])
def test_length_classes_with_an_inner_compiler_and_a_memory_budget(inner, tolerance, sharded):
    """With a memory budget (what a GPU sets by default) the memory policy decides at the call's length and the class
    ends there: 41 serves 37, 53 compiles the class that serves 50. Inductor's float64 code reassociates: 4e-9 off,
    the same at one compilation per length. Inputs that arrive split: the policy decides at the global length (the
    first call compiles the class that ends at 40, as dynamo's first graph is already dynamic)."""
    for worst, compilations, _, explained in run_on_ranks(_train_at_lengths, 2, (40, 41, 37, 53, 50), True, inner,
                                                          sharded, memory_budget=4 << 30, timeout=900):
        assert worst < tolerance, worst
        expected = ({"new graph": 1, "new sequence length": 2} if sharded
                    else {"new graph": 1, "recompiled by dynamo": 1, "new sequence length": 1})
        assert compilations == expected, compilations
        assert re.search(r"serves input_ids dim 1( \(global\))? in \[\d+, 41\]", explained), explained
        assert "memory policy" in explained, explained


def _generate_prompts(lengths):
    import warnings

    from test_decode import _generate, _model

    model, backend = _model(), autoshard.backend()
    model.forward = torch.compile(model.forward, backend=backend)
    tokens, compiled = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in lengths:
            tokens.append(_generate(model, n).sequences)
            compiled.append(len(backend.compiled))
    gathered = [str(w.message) for w in caught if "outside compiled code" in str(w.message)]
    return tokens, compiled, dict(backend.compilations), gathered


def test_generate_prefills_new_prompt_lengths_without_compiling():
    """``generate()`` on prompts of ten lengths (transformers Llama, the KV cache split along the sequence): the
    second prompt compiles the prefill's length class and the decode step for any prompt (its cache carriers' rule
    is read per call, not guarded), the next eight compile nothing (dynamo's recompile limit, which would run the
    model uncompiled, is never near), nothing is gathered outside compiled code, the tokens are one process's."""
    from test_decode import _generate, _model

    lengths = (29, 31, 40, 23, 52, 61, 35, 44, 70, 33)
    model = _model()
    expected = [_generate(model, n).sequences for n in lengths]
    for tokens, compiled, compilations, gathered in run_on_ranks(_generate_prompts, 2, lengths, timeout=600):
        assert all(torch.equal(a, b) for a, b in zip(tokens, expected))
        assert compiled[2:] == [compiled[1]] * (len(lengths) - 2), compiled
        assert compiled[1] <= 5 and "new sequence length" not in compilations, (compiled, compilations)
        assert not gathered, gathered[0]


def test_inputs_that_arrive_split_without_length_classes_compile_per_length():
    """``length_classes=False``: each set of global lengths compiles its own graph (the per-size path a class falls
    back to), exact."""
    for worst, compilations, _, _ in run_on_ranks(_train_at_lengths, 2, (40, 41, 37), False, "eager", "contiguous",
                                                  timeout=600):
        assert worst < 1e-12, worst
        assert compilations == {"new graph": 1, "new sequence length": 2}, compilations
