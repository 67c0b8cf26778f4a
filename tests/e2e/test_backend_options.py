"""Backend options and bad input, on real ranks: grad_sync, sharded inputs/outputs, new lengths,
world size 1, dropout, mismatched ranks, attention that cannot be distributed."""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.testing.models import BertClassifier, BertConfig, LlamaLM
from autoshard.runtime import all_reduce, comm_counter, unshard_sequence
from autoshard.testing import RankFailure, run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process


def _llama_and_batch(seq: int):
    torch.manual_seed(0)
    model = LlamaLM().double()
    return model, copy.deepcopy(model), torch.randint(0, 256, (2, seq)), torch.randint(0, 256, (2, seq))


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


class ScaledAttention(nn.Module):
    """Parameters that reach split work through replicated ops: ``1 + scale`` (Gemma's norm) and a cast."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(16) * 0.1)
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        b, s, _ = x.shape
        h = x * (1.0 + self.scale) * self.qkv.bias.sum().to(torch.float32).to(x.dtype)
        q, k, v = self.qkv(h).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).pow(2).mean()


def _grads_average_to_one_process():
    errors = []
    torch.manual_seed(0)
    for model, inputs in ((_llama_and_batch(11)[0], torch.randint(0, 256, (2, 11))),
                          (ScaledAttention().double(), torch.randn(2, 11, 16, dtype=torch.float64))):
        torch._dynamo.reset()
        ref = copy.deepcopy(model)
        args = (inputs, inputs) if isinstance(model, LlamaLM) else (inputs,)
        out = ref(*args)
        (out[0] if isinstance(out, tuple) else out).backward()
        out = torch.compile(model, backend=autoshard.backend(grad_sync=False))(*args)
        (out[0] if isinstance(out, tuple) else out).backward()
        errors.append(max((all_reduce(g) / dist.get_world_size() - _grads(ref)[n]).abs().max().item()
                          for n, g in _grads(model).items()))
    return errors


def test_grad_sync_false_leaves_gradients_that_average_to_the_gradient():
    """What DDP and FSDP2 compute from them (both average over their group)."""
    for errors in run_on_ranks(_grads_average_to_one_process, 2):
        assert max(errors) < 1e-12, errors


def _sharded_io(layout: str):
    model, ref, ids, labels = _llama_and_batch(13)
    ref_loss, ref_logits = ref(ids, labels)
    (ref_loss + ref_logits.pow(2).mean()).backward()
    compiled = torch.compile(model, backend=autoshard.backend(inputs="sharded", outputs="sharded", layout=layout))
    batch = autoshard.shard_inputs({"input_ids": ids, "labels": labels}, layout=layout)
    loss, logits = compiled(**batch)
    whole = unshard_sequence(logits, 1, layout=layout, length=13)
    (loss + whole.pow(2).mean()).backward()
    grad_err = max((g - _grads(ref)[n]).abs().max().item() for n, g in _grads(model).items())
    return logits.shape[1], (loss - ref_loss).abs().item(), (whole - ref_logits).abs().max().item(), grad_err


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_sharded_inputs_and_outputs(layout):
    results = run_on_ranks(_sharded_io, 2, layout)
    # 13 tokens: contiguous 7 + 6; zigzag's four chunks 4, 3, 3, 3 give rank 0 the first and last (7), rank 1 6
    assert [r[0] for r in results] == [7, 6]
    for _, loss_err, logits_err, grad_err in results:
        assert loss_err < 1e-12 and logits_err < 1e-12 and grad_err < 1e-12


def _sharded_lengths_and_cache():
    """Global lengths whose local shard repeats on rank 0 but not on rank 1 (13 -> 7+6, 14 -> 7+7): each
    call must run the graph of its global length on both ranks; then new batch sizes (dynamo makes the batch
    dim symbolic too, which is not the split one). One length class serves every length of each of dynamo's two
    graphs (its graph of a symbolic length, then of a symbolic batch too): the rank graph computes its layout
    from the global length, which a call passes where dynamo passes the rank's own. The store keeps no key of old
    checks."""
    model, ref, _, _ = _llama_and_batch(13)
    backend = autoshard.backend(inputs="sharded")
    compiled = torch.compile(model, backend=backend)
    errors = []
    for batch, seq in ((2, 13), (2, 14), (2, 12), (2, 13), (2, 14), (3, 13), (4, 14), (3, 12)):
        ids = torch.randint(0, 256, (batch, seq))
        loss = compiled(**autoshard.shard_inputs({"input_ids": ids, "labels": ids}))[0]
        errors.append((loss - ref(ids, ids)[0]).abs().item())
    store = dist.distributed_c10d._get_default_store()
    group = dist.group.WORLD.group_name
    kept = [i for i in range(64) for r in range(2) if store.check([f"autoshard/{group}/{i}/{r}"])]
    return errors, kept, autoshard.explain(backend)


def test_sharded_inputs_of_new_global_lengths_stay_exact():
    results = run_on_ranks(_sharded_lengths_and_cache, 2)
    for errors, kept, explained in results:
        assert max(errors) < 1e-12, errors
        assert len(kept) == 2  # one check's keys, one per rank: the last
        assert explained.startswith("compilations on this rank: 2 (1 new graph, 1 recompiled by dynamo)"), explained
        assert "input_ids dim 1 (global) = labels dim 1 (global) in [4, " in explained, explained


def _mis_split():
    model, _, ids, _ = _llama_and_batch(13)
    compiled = torch.compile(model, backend=autoshard.backend(inputs="sharded"))
    batch = autoshard.shard_inputs({"input_ids": ids, "labels": ids})
    if dist.get_rank() == 1:  # rank 1 loads one position too few: 7 + 5, where a split of 12 is 6 + 6
        batch = {k: v[:, :-1].contiguous() for k, v in batch.items()}
        for v in batch.values():
            torch._dynamo.mark_dynamic(v, 1)
    compiled(**batch)


def test_sharded_inputs_split_unlike_the_layout_fail_on_every_rank():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_mis_split, 2, timeout=120)
    assert str(info.value).count("local lengths [7, 5]") == 2


def _short_shard():
    model, _, _, _ = _llama_and_batch(4)
    compiled = torch.compile(model, backend=autoshard.backend(inputs="sharded"))
    ids = torch.randint(0, 256, (2, 4))
    compiled(**autoshard.shard_inputs({"input_ids": ids, "labels": ids}))  # 2, 1, 1 positions


def test_sharded_inputs_of_fewer_than_two_positions_on_a_rank_fail_saying_why():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_short_shard, 3, timeout=120)
    assert str(info.value).count("every rank must hold at least 2 positions of the sequence") == 2, str(info.value)


def _new_lengths():
    model, ref, _, _ = _llama_and_batch(8)
    backend = autoshard.backend(length_classes=False)  # one compilation per set of sizes (test_length_classes.py)
    compiled = torch.compile(model, backend=backend)
    errors = []
    for seq in (9, 8, 7, 12, 8):  # the second length makes dynamo recompile with symbolic sizes
        ids = torch.randint(0, 256, (2, seq))
        errors.append((compiled(ids, ids)[0] - ref(ids, ids)[0]).abs().item())
    return errors, dict(backend.compilations), autoshard.explain(backend)


def test_new_sequence_lengths_recompile_and_stay_exact():
    """Without length classes each length compiles once, every compilation counted with its cause (a length seen
    before does not)."""
    for errors, compilations, explained in run_on_ranks(_new_lengths, 2):
        assert max(errors) < 1e-12, errors
        assert compilations == {"new graph": 1, "recompiled by dynamo": 1, "new sequence length": 2}, compilations
        assert explained.startswith("compilations on this rank: 4 (1 new graph, 1 recompiled by dynamo, "
                                    "2 new sequence length)"), explained
        assert "new sequence length (input_ids dim 1: 8 -> 7" in explained, explained


def _at_the_recompile_limit():
    import warnings

    torch.manual_seed(0)
    compiled = torch.compile(LlamaLM().double(), backend=autoshard.backend())
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seq in (8, 7, 9):
            ids = torch.randint(0, 256, (2, seq))
            compiled(ids, ids)
    return [str(w.message) for w in caught if "recompile_limit" in str(w.message)]


def test_the_last_compilation_dynamo_allows_a_frame_is_warned():
    """Past dynamo's recompile limit a frame runs uncompiled, whole on every rank: the backend warns when it is handed
    that frame's last graph (once), naming the code and the cause."""
    warned = run_on_ranks(_at_the_recompile_limit, 1)[0]
    assert len(warned) == 1, warned
    assert "compiled the code at" in warned[0] and "2 times" in warned[0], warned[0]
    assert "This time: recompiled by dynamo" in warned[0], warned[0]


def _world_of_one():
    r = compare_with_one_process(LlamaLM, lambda: (torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 9))),
                                 dtype=torch.float64)
    return r.max_error(), [a["strategy"] for a in r.attention], r.fallbacks


def test_world_size_one_just_works():
    # one rank compiles as many do (what its plan shows): its attention runs autoshard's, with the structured mask
    error, strategies, fallbacks = run_on_ranks(_world_of_one, 1)[0]
    assert error < 1e-12 and strategies and not fallbacks


class _DropoutOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return F.dropout(autoshard.mark_sequence(x, 1), 0.5, self.training) + 0 * self.proj(x)


def _dropout_masks():
    torch.manual_seed(0)
    out = torch.compile(_DropoutOnly().train(), backend=autoshard.backend())(torch.ones(1, 64, 4))
    first, second = out[0, :32] != 0, out[0, 32:] != 0
    # and a model with dropout trains: the loss goes down over a few steps
    torch.manual_seed(0)
    model = BertClassifier(BertConfig(dropout=0.1)).train()
    compiled = torch.compile(model, backend=autoshard.backend())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ids, mask, labels = torch.randint(0, 256, (4, 16)), torch.ones(4, 16, dtype=torch.long), torch.tensor([0, 1, 2, 0])
    losses = []
    for _ in range(8):
        loss, _ = compiled(ids, mask, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return bool((first == second).all()), losses


def test_dropout_draws_different_masks_per_rank_and_trains():
    for same_pattern, losses in run_on_ranks(_dropout_masks, 2):
        assert not same_pattern  # rank 0's and rank 1's halves were not dropped alike
        assert losses[-1] < losses[0]


def _different_shapes():
    seq = 8 if dist.get_rank() == 0 else 9
    model, _, ids, _ = _llama_and_batch(seq)
    torch.compile(model, backend=autoshard.backend())(ids)


def test_ranks_with_different_shapes_fail_on_every_rank():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_different_shapes, 2, timeout=120)
    text = str(info.value)
    assert "rank(s) [0, 1]" in text and text.count("ranks reached different graphs or input shapes") == 2


class _DenseMaskAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x, bias):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # a bias the mask pass cannot structure
        return self.out(a.transpose(1, 2).reshape(b, s, 8))


def _dense_mask():
    r = compare_with_one_process(_DenseMaskAttention, lambda: (torch.randn(2, 9, 8), torch.randn(9, 9)),
                                 dtype=torch.float64)
    return r.max_error(), r.attention, r.fallbacks


def test_attention_that_cannot_be_distributed_is_exact_and_reported():
    for err, attention, fallbacks in run_on_ranks(_dense_mask, 2):
        assert err < 1e-9
        assert attention[0]["strategy"] == "gathered-kv" and "mask" in attention[0]["reason"]
        assert fallbacks  # the gathered keys and values are listed


def test_invalid_options_fail_when_the_backend_is_built():
    with pytest.raises(ValueError, match="layout='zigzag'"):
        autoshard.backend(strategy="zigzag", layout="contiguous")
    with pytest.raises(ValueError, match="2-D DeviceMesh"):
        autoshard.backend(strategy="hybrid")
    with pytest.raises(ValueError, match="not one of"):
        autoshard.backend(outputs="scattered")
    with pytest.raises(TypeError):
        autoshard.backend(unknown_option=True)
    with pytest.raises(IndexError, match="dim 3 does not exist"):
        autoshard.mark_sequence(torch.zeros(2, 3), 3)


def _seq_dims_naming_a_missing_input():
    model, _, ids, _ = _llama_and_batch(8)
    torch.compile(model, backend=autoshard.backend(seq_dims={"token_ids": 1}))(ids)


def test_seq_dims_naming_a_missing_input_fails_clearly():
    with pytest.raises(RankFailure, match="seq_dims names input 'token_ids'.*input_ids"):
        run_on_ranks(_seq_dims_naming_a_missing_input, 2, timeout=120)


def _batches_differ_at(step: int | None, check_inputs: bool = True):
    """Calls with the same batch on every rank until ``step`` (None: two calls, never), where each rank passes its
    own: the metadata bytes of the last call that ran."""
    model, _, ids, labels = _llama_and_batch(8)
    compiled = torch.compile(model, backend=autoshard.backend(check_inputs=check_inputs))
    own = torch.randint(0, 256, ids.shape, generator=torch.Generator().manual_seed(dist.get_rank()))
    checked = 0
    for i in range(1, (step or 2) + 1):
        with torch.no_grad(), comm_counter() as counter:
            compiled(own if i == step else ids, labels)
        checked = counter.calls["metadata"].bytes_sent if "metadata" in counter.calls else 0
    return checked


@pytest.mark.parametrize("step", [2, pytest.param(100, marks=pytest.mark.slow)])
def test_ranks_fed_different_batches_fail_on_every_rank_at_any_step(step):
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_batches_differ_at, 2, step, timeout=120)
    text = str(info.value)
    assert text.count("passed different inputs to compiled graph") == 2  # both ranks raise
    assert "L['input_ids']" in text and "L['labels']" not in text.split("ranks grouped")[0]


def test_the_input_check_costs_what_the_plan_says_and_can_be_turned_off():
    sent = run_on_ranks(_batches_differ_at, 2, None)
    model, _, ids, labels = _llama_and_batch(8)
    plan = autoshard.plan(model, (ids, labels), world_size=2)
    assert list(plan.input_checks.values()) == [sent[0]] and sent[0] > 0  # one graph, its inputs' 16 B each
    assert "replicated inputs checked" in str(plan)
    assert not autoshard.plan(model, (ids, labels), world_size=2, check_inputs=False).input_checks
    assert run_on_ranks(_batches_differ_at, 2, 2, False) == [0, 0]  # off: no check, no error


def _warned_where():
    """Where two of autoshard's warnings point: one raised while dynamo calls the backend, one from a split output's
    ``__torch_dispatch__`` under torch's pytree."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        bias = torch.randn(9, 9)
        torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, attn_mask=bias),  # a mask it cannot read:
                      backend=autoshard.backend())(torch.randn(1, 2, 9, 4))  # attention not distributed, warned
        model, _, ids, labels = _llama_and_batch(8)
        _, logits = torch.compile(model, backend=autoshard.backend())(ids, labels)
        logits.sum()  # a split output used outside compiled code: gathered, warned
    return [(str(w.message)[:60], w.filename) for w in caught if str(w.message).startswith("autoshard")]


def test_warnings_name_the_callers_line():
    for warned in run_on_ranks(_warned_where, 2):
        assert len(warned) == 2 and {file for _, file in warned} == {__file__}, warned
