"""Packed documents through a compiled transformers Llama (issue 23): work proportional to the documents, balanced.

One row of 4096 tokens packed with a dozen documents of log-normal lengths (tens to about a thousand tokens,
``position_ids`` restarting at each), ``autoshard.compile`` with the default strategy choice, 4 ranks, one training
step. Asserts: loss and every gradient equal one process's (float64); the attention FLOPs every rank counted
(:func:`~autoshard.runtime.attention.flops.attention_flops`, forward and backward) sum to exactly the documents' own
causal work (before: the work of one causal sequence of 4096, 9.67x theirs); and max/mean over ranks <= 1.10 (the
zigzag layout would leave the rank holding the long documents' tails with ~1.4x the mean; the documents placed by
their lengths, :mod:`~autoshard.runtime.placement`, leave 1.19 before the dispatch). ``explain()`` reports the
work per rank, and the plan of the same batch predicts every rank's work exactly.

Then a two-layer Llama trained on a new packing every step (:func:`test_each_batch_fetches_only_its_documents_keys`,
3 ranks; 2 and 4 in the slow tier): exact, one compilation, and the bytes the all-gather strategy sends fetching the
visible keys exactly those of the rows the documents make visible, over the layout the run chose for the batch (the
documents placed by their lengths, :mod:`~autoshard.runtime.placement`, where that sends less). The placement is
also checked through one backward of two placements, across graph breaks (a graph running under the placement, one
taking it realigned), and over rows of a new length every step.
"""

import pytest
import torch

import autoshard
from autoshard.runtime import SequenceLayout, comm_counter
from autoshard.runtime.attention import attention_flops
from autoshard.runtime.attention.dispatch import balance
from autoshard.runtime.attention.masks import MaskSpec
from autoshard.runtime.attention.visible_keys import key_fetch, last_fetch
from autoshard.runtime.layouts import split_sizes
from autoshard.runtime.placement import Documents, Placement, last_placement
from autoshard.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

SEQ = 4096
HEADS, HEAD_DIM = 4, 16
TOLERANCE = 1e-6
"""Relative, float64 model: transformers computes its loss from ``logits.float()``."""


def _lengths() -> list[int]:
    gen = torch.Generator().manual_seed(3)
    out = []
    while sum(out) < SEQ:
        out.append(int(torch.empty(1).log_normal_(5.5, 0.8, generator=gen).clamp(20, 1000)))
    out[-1] -= sum(out) - SEQ
    return out


def _model():
    cfg = transformers.LlamaConfig(hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=HEADS, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=SEQ)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double().train()


def _inputs() -> dict:
    ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in _lengths()])[None]
    return dict(input_ids=ids, labels=ids.clone(), position_ids=positions, use_cache=False)


def _rank() -> dict:
    model = _model()
    compiled = autoshard.compile(model)
    with attention_flops() as flops:
        loss, grads = _loss_and_grads(model, _inputs(), compiled)
    attention = [a for r in compiled.autoshard_backend.compiled for a in r.report.attention]
    return dict(loss=loss, grads=grads, flops=flops.total, strategies=[a["strategy"] for a in attention],
                explain=autoshard.explain(compiled))


def test_packed_llama_work_is_the_documents_and_balanced():
    results = run_on_ranks(_rank, 4, timeout=600)
    loss, grads = _loss_and_grads(_model(), _inputs())
    for r in results:
        assert abs(r["loss"] - loss) <= TOLERANCE * abs(loss), (r["loss"], loss)
        for name, grad in grads.items():
            error = ((r["grads"][name] - grad).abs().max() / grad.abs().max()).item()
            assert error <= TOLERANCE, (name, error)
    assert results[0]["strategies"] == ["allgather"], results[0]["strategies"]
    lengths = _lengths()
    documents = sum(n * (n + 1) // 2 for n in lengths) * HEADS * 14 * HEAD_DIM  # forward 4D + backward 10D per pair
    work = [r["flops"] for r in results]
    assert sum(work) == documents, (sum(work), documents, SEQ * (SEQ + 1) // 2 * HEADS * 14 * HEAD_DIM)
    assert max(work) / (sum(work) / len(work)) <= 1.10, work
    assert "attention work per rank" in results[0]["explain"], results[0]["explain"]
    plan = autoshard.plan(_model(), kwargs=_inputs(), world_size=4)  # the plan knows each rank's work, exactly
    assert [w * HEADS * 14 * HEAD_DIM for w in plan.documents["work"]] == work, (plan.documents, work)
    assert plan.documents["placed"] and "packed documents (" in str(plan)  # placed by length, as the run did


# ---------------------------------------------------------------------------- visible keys, a new batch each step

ROW = 385
"""Tokens of a row in the batches below (no world size divides it)."""
LAYERS, KV_HEADS = 2, 2


def _batch(kind: str, world: int) -> list[int]:
    """Document lengths of one row of ``ROW`` tokens."""
    if kind == "aligned":  # short documents, each whole inside one chunk of the zigzag layout: no key moves
        return [n for chunk in split_sizes(ROW, 2 * world) for n in (chunk // 2, chunk - chunk // 2)]
    if kind.startswith("long-tail"):  # "long-tail", "long-tail <seed>" or "long-tail <seed> <length>"
        given = [int(n) for n in kind.split()[1:]]
        seed, row = (given + [world, ROW][len(given):])[:2]
        gen = torch.Generator().manual_seed(seed)
        out = [row * 190 // ROW]  # about half the row: one long document
        while sum(out) < row:
            out.append(int(torch.empty(1).log_normal_(2.5, 0.8, generator=gen).clamp(2, 60)))
        out[-1] -= sum(out) - row
        return out
    return {"long": [150, ROW - 150], "spanning": [ROW], "padding": [100, 120, ROW - 220]}[kind]


BATCHES = ("aligned", "long-tail", "long", "spanning")


def _batch_inputs(kind: str, world: int) -> dict:
    row = sum(_batch(kind, world))
    ids = torch.randint(0, 256, (1, row), generator=torch.Generator().manual_seed(len(kind)))
    positions = torch.cat([torch.arange(n) for n in _batch(kind, world)])[None]
    inputs = dict(input_ids=ids, labels=ids.clone(), position_ids=positions, use_cache=False)
    if kind == "padding":  # documents, then padding the attention mask hides and the loss ignores
        inputs["labels"][:, -20:] = -100
        inputs["attention_mask"] = torch.ones_like(ids)
        inputs["attention_mask"][:, -20:] = 0
    return inputs


def _small_llama():
    cfg = transformers.LlamaConfig(hidden_size=HEADS * HEAD_DIM, intermediate_size=64, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=256,
                                   max_position_embeddings=ROW)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double().train()


def _loss_and_grads(model, inputs: dict, run=None) -> tuple[torch.Tensor, dict]:
    loss = (model if run is None else run)(**inputs).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_exact(got: dict, loss: torch.Tensor, grads: dict, *what) -> None:
    """A rank's loss and every gradient equal one process's (``what``: what the failure names)."""
    assert abs(got["loss"] - loss) <= TOLERANCE * abs(loss), (*what, got["loss"], loss)
    for name, grad in grads.items():
        error = ((got["grads"][name] - grad).abs().max() / grad.abs().max()).item()
        assert error <= TOLERANCE, (*what, name, error)


def _rank_batches(world: int, kinds: tuple[str, ...]) -> dict:
    model = _small_llama()
    compiled = autoshard.compile(model)
    out = {}
    for kind in kinds:
        with comm_counter() as comm:
            loss, grads = _loss_and_grads(model, _batch_inputs(kind, world), compiled)
        out[kind] = dict(loss=loss, grads=grads, key_fetch=comm.key_fetch_bytes_sent,
                         gathered=comm.calls["all_gather"].bytes_sent if "all_gather" in comm.calls else 0,
                         compilations=sum(compiled.autoshard_backend.compilations.values()),
                         explain=autoshard.explain(compiled))
    attention = [a for r in compiled.autoshard_backend.compiled for a in r.report.attention]
    out["attention"] = [(a["strategy"], a["layout"]) for a in attention]
    return out


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3, pytest.param(4, marks=pytest.mark.slow)])
def test_each_batch_fetches_only_its_documents_keys(world):
    """A compiled Llama trained on a new packing every step: loss and gradients equal one process's (float64) for
    short documents each whole on a rank, a long-tail mix, long documents, one document over every rank and
    documents with padding; the four packings of one shape compile once; the bytes fetching keys are exactly those
    of the rows the documents make visible (:func:`~autoshard.runtime.attention.visible_keys.key_fetch`): none for
    the short documents, none (all-gathered instead) for the document over every rank."""
    kinds = BATCHES + ("padding",)
    results = run_on_ranks(_rank_batches, world, world, kinds, timeout=600)
    assert all(s == ("allgather", "zigzag") for s in results[0]["attention"][:LAYERS]), results[0]["attention"]
    root, spec = SequenceLayout.zigzag(ROW, world), MaskSpec.of(True)
    documents = Documents("zigzag", world, spec, key_row=KV_HEADS * 2 * HEAD_DIM, query_row=HEADS * HEAD_DIM,
                          result_row=HEADS * (HEAD_DIM + 1))
    row = KV_HEADS * HEAD_DIM * 8  # bytes of one key row (batch 1, float64)
    for kind in kinds:
        loss, grads = _loss_and_grads(_small_llama(), _batch_inputs(kind, world))
        ids = torch.repeat_interleave(torch.arange(len(_batch(kind, world))), torch.tensor(_batch(kind, world)))[None]
        placement = Placement.of(documents, ids)
        layout = root if placement is None else placement.layout
        fetch = key_fetch(layout, ids, spec, balance(layout, ids, spec))
        for rank, result in enumerate(results):
            got = result[kind]
            _assert_exact(got, loss, grads, kind, rank)
            if kind == "padding":
                continue
            to_others, from_others = fetch.sent_sizes(rank), fetch.received_sizes(rank)
            rows_sent, rows_received = sum(to_others) - to_others[rank], sum(from_others) - from_others[rank]
            expected = LAYERS * row * (2 * 2 * rows_sent + 2 * rows_received) if fetch.worth_it else 0
            assert got["key_fetch"] == expected, (kind, rank, got["key_fetch"], expected)
        if kind == "aligned":
            assert fetch.rows == (0,) * world and all(r[kind]["key_fetch"] == 0 for r in results)
            kv_gather = LAYERS * 2 * (world - 1) * layout.max_local_length * row  # one all-gather of K and V
            assert all(r[kind]["gathered"] < kv_gather / 4 for r in results), [r[kind]["gathered"] for r in results]
        if kind == "spanning":
            assert not fetch.worth_it
        if kind == "long-tail":
            assert fetch.worth_it and max(fetch.rows) > 0, fetch.rows
            assert (placement is not None) == (world < 4)  # placed by length where that sends less (P = 2, 3)
            assert "documents placed by length" in results[0][kind]["explain"] or world == 4
    assert [results[0][k]["compilations"] for k in BATCHES] == [1] * len(BATCHES), results[0]
    assert "key rows fetched per rank" in results[0]["long-tail"]["explain"]


def _two_packings(world: int) -> dict:
    model = _small_llama()
    compiled = autoshard.compile(model)
    packing_a, packing_b = (_batch_inputs(f"long-tail {seed}", world) for seed in (2, 3))
    loss = compiled(**packing_a).loss + compiled(**packing_b).loss  # two placements, one backward
    loss.backward()
    compilations = sum(compiled.autoshard_backend.compilations.values())
    with torch.no_grad():  # dynamo compiles the graph without gradient anew
        out = compiled(**packing_b)
    return dict(loss=loss.detach(), evaluated=out.loss, logits=out.logits.full_tensor(), grads={n: p.grad.clone() for n, p in model.named_parameters()},
                compilations=compilations)


def test_two_placements_in_one_backward():
    """Two packings placed differently, their losses summed and differentiated once (autograd runs the second
    call's gradients, then the first's: each reads its own placement), then one evaluated without gradient: loss,
    logits (gathered from their placed shards, in the caller's order) and every gradient equal one process's
    (float64), one compilation for both packings."""
    world = 3
    documents = Documents("zigzag", world, MaskSpec.of(True), key_row=KV_HEADS * 2 * HEAD_DIM, query_row=HEADS * HEAD_DIM,
                          result_row=HEADS * (HEAD_DIM + 1))
    placements = []
    for seed in (2, 3):
        lengths = _batch(f"long-tail {seed}", world)
        placements.append(Placement.of(documents, torch.repeat_interleave(torch.arange(len(lengths)),
                                                                          torch.tensor(lengths))[None]))
    assert None not in placements and placements[0].layout != placements[1].layout
    results = run_on_ranks(_two_packings, world, world, timeout=600)
    model = _small_llama()
    loss = sum(model(**_batch_inputs(f"long-tail {seed}", world)).loss for seed in (2, 3))
    loss.backward()
    with torch.no_grad():
        out = model(**_batch_inputs("long-tail 3", world))
    for rank, got in enumerate(results):
        assert abs(got["loss"] - loss.detach()) <= TOLERANCE * abs(loss.detach()), (rank, got["loss"], loss)
        assert abs(got["evaluated"] - out.loss) <= TOLERANCE * abs(out.loss), (rank, got["evaluated"], out.loss)
        assert torch.allclose(got["logits"], out.logits, rtol=TOLERANCE, atol=TOLERANCE)  # in the caller's order
        for name, p in model.named_parameters():
            error = ((got["grads"][name] - p.grad).abs().max() / p.grad.abs().max()).item()
            assert error <= TOLERANCE, (rank, name, error)
        assert got["compilations"] == 1


def _broken_llama():
    """The small Llama with a graph break before its second layer (the layer graph takes the hidden states split, and
    the positions' rotary tables and the documents uncomputed) and another before its final norm, followed by a
    causal depthwise convolution over the sequence (its halo exchange reads the layout as compiled)."""
    model = _small_llama()
    layer, norm = model.model.layers[1], model.model.norm
    norm.conv = torch.nn.Conv1d(HEADS * HEAD_DIM, HEADS * HEAD_DIM, 3, padding=2, groups=HEADS * HEAD_DIM).double()
    layer_forward, norm_forward = layer.forward, norm.forward

    def broken_layer(hidden_states, *args, **kwargs):
        torch._dynamo.graph_break()
        return layer_forward(hidden_states, *args, **kwargs)

    def broken_norm(hidden_states):
        torch._dynamo.graph_break()
        return norm_forward(hidden_states + norm.conv(hidden_states.transpose(1, 2))[..., :-2].transpose(1, 2))

    layer.forward, norm.forward = broken_layer, broken_norm
    return model


def _broken(world: int) -> dict:
    model = _broken_llama()
    compiled = autoshard.compile(model)
    loss = compiled(**_batch_inputs("long-tail 3", world)).loss
    layer_1_placed = last_fetch().layout == last_placement().layout  # the latest attention: layer 1's
    loss.backward()
    return dict(loss=loss.detach(), grads={n: p.grad.clone() for n, p in model.named_parameters()},
                graphs=len(compiled.autoshard_backend.compiled), explain=autoshard.explain(compiled),
                layer_1_placed=layer_1_placed)


def test_a_placement_crosses_graph_breaks():
    """Graph breaks between the layers and before the final norm: the first layer's graph places the documents, its
    split outputs carry the placement, the second layer's graph runs under it (every op there reads any layout), and
    the norm's graph, whose convolution's halo reads the layout as compiled, takes them realigned. Loss and
    gradients equal one process's."""
    world = 3
    results = run_on_ranks(_broken, world, world, timeout=600)
    loss, grads = _loss_and_grads(_broken_llama(), _batch_inputs("long-tail 3", world))
    for rank, got in enumerate(results):
        assert got["graphs"] >= 3 and "documents placed by length" in got["explain"], got["explain"]
        assert got["layer_1_placed"]
        _assert_exact(got, loss, grads, rank)


def _lengths_run(world: int, kinds: list[str]) -> dict:
    model = _small_llama()
    compiled = autoshard.compile(model)
    out = {}
    for kind in kinds:
        loss, grads = _loss_and_grads(model, _batch_inputs(kind, world), compiled)
        out[kind] = dict(loss=loss, grads=grads, explain=autoshard.explain(compiled))
    out["compilations"] = dict(compiled.autoshard_backend.compilations)
    return out


def test_placement_serves_every_length():
    """Packed rows of a new length every step (a padding-free run): from the second length the graph serves every
    length (a length class), and each call places its documents over the layout of its own length (its labels'
    shifted layout, symbolic in the graph, swapped alike). Loss and gradients equal one process's; two compilations
    in all."""
    world, kinds = 3, ["long-tail 3 385", "long-tail 2 412", "long-tail 3 470"]
    results = run_on_ranks(_lengths_run, world, world, kinds, timeout=600)
    for kind in kinds:
        loss, grads = _loss_and_grads(_small_llama(), _batch_inputs(kind, world))
        for rank, result in enumerate(results):
            _assert_exact(result[kind], loss, grads, kind, rank)
    placed = [k for k in kinds[1:] if "documents placed by length" in results[0][k]["explain"]]
    assert len(placed) == 2, [results[0][k]["explain"] for k in kinds]
    assert sum(results[0]["compilations"].values()) == 2, results[0]["compilations"]


def _grouped_run(world: int) -> dict:
    from autoshard.runtime.placement import last_placement
    model = _small_llama()
    compiled = autoshard.compile(model, head_chunks=2, strategy="allgather")
    loss, grads = _loss_and_grads(model, _batch_inputs("long-tail 2", world), compiled)
    heads = [r.report.passes["heads"].counts for r in compiled.autoshard_backend.compiled]
    return dict(loss=loss, grads=grads, heads=heads, placed=last_placement() is not None)


def test_documents_are_placed_with_attention_in_head_groups():
    """Attention with its projections in head groups (``head_chunks=2``, the all-gather) runs under the documents'
    placement as the whole op does (the grouped call's attention reads its layout as intervals): placed, every
    attention grouped, loss and gradients equal one process's."""
    world = 3
    results = run_on_ranks(_grouped_run, world, world, timeout=600)
    loss, grads = _loss_and_grads(_small_llama(), _batch_inputs("long-tail 2", world))
    for rank, result in enumerate(results):
        _assert_exact(result, loss, grads, rank)
        assert result["placed"] and result["heads"] == [{"grouped_attentions": LAYERS, "head_groups": 2 * LAYERS,
                                                          "ungrouped_attentions": 0}], result
