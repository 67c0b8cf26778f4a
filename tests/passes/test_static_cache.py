"""The static-cache pass (:mod:`autoshard.passes.static_cache`) on small prefills into a fixed-size KV cache, one
process: what it rewrites (the buffers gone, the attention over the prompt's keys and values, the masks' columns
past the prompt dropped or rebuilt from their structure), that the rewritten graphs compute the same outputs, what
its runner refuses, and the graphs it leaves alone."""

import pytest
import torch
import torch.nn.functional as F

from autoshard.passes.static_cache import static_prefill, static_prefill_runner
from autoshard.testing.graphs import dynamo_graph

BATCH, HEADS, KV_HEADS, PROMPT, CAPACITY, HEAD_DIM = 2, 4, 2, 6, 10, 8
SEQ_DIM = 2


def _captured(fn, *inputs):
    """Dynamo's graph of ``fn`` (with example values), as the backend receives it (the functions below read their
    arguments in order: they are the graph's inputs in that order)."""
    return dynamo_graph(fn, *inputs)


def _buffers(start, k, v):
    """transformers' ``StaticLayer``: the buffers made on first use, the prompt written at ``cache_position``."""
    keys = torch.zeros(BATCH, KV_HEADS, CAPACITY, HEAD_DIM)
    values = torch.zeros(BATCH, KV_HEADS, CAPACITY, HEAD_DIM)
    positions = torch.arange(PROMPT) + start
    keys.index_copy_(SEQ_DIM, positions, k)
    values.index_copy_(SEQ_DIM, positions, v)
    return keys, values


def _repeat_kv(x):
    """transformers' ``repeat_kv``: each KV head for ``HEADS // KV_HEADS`` query heads."""
    batch, kv_heads, length, dim = x.shape
    return x[:, :, None].expand(batch, kv_heads, HEADS // KV_HEADS, length, dim).reshape(batch, HEADS, length, dim)


def masked_prefill(start, k, v, q, mask):
    keys, values = _buffers(start, k, v)
    out = F.scaled_dot_product_attention(q, _repeat_kv(keys), _repeat_kv(values), attn_mask=mask)
    return out, keys, values


def causal_prefill(start, k, v, q):  # the columns a causal attention reads without a mask (batch size 1)
    keys, values = _buffers(start, k, v)
    out = F.scaled_dot_product_attention(q, keys[:, :, :PROMPT], values[:, :, :PROMPT], is_causal=True,
                                         enable_gqa=True)
    return out, keys, values


def _inputs(start=0):
    q = torch.randn(BATCH, HEADS, PROMPT, HEAD_DIM)
    k, v = torch.randn(2, BATCH, KV_HEADS, PROMPT, HEAD_DIM)
    return torch.tensor([start]), k, v, q


def _causal_mask(padding=0):
    """``[B, 1, S, C]`` bool: causal over the prompt, the columns past it hidden, the last batch row left-padded."""
    mask = torch.zeros(BATCH, 1, PROMPT, CAPACITY, dtype=torch.bool)
    mask[..., :PROMPT] = torch.ones(PROMPT, PROMPT, dtype=torch.bool).tril()
    mask[-1, ..., :padding] = False
    return mask


def _graph_ops(gm):
    return {getattr(n.target, "__name__", n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")}


def _placeholders(gm):
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _assert_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_a_masked_prefill_attends_over_the_prompt_and_its_runner_gives_back_the_buffers():
    inputs = (*_inputs(), _causal_mask(padding=2))
    gm = _captured(masked_prefill, *inputs)
    want = masked_prefill(*inputs)
    prefill = static_prefill(gm)
    assert prefill is not None
    assert prefill.buffers == {1: (SEQ_DIM, CAPACITY), 2: (SEQ_DIM, CAPACITY)}
    assert prefill.starts == {0} and prefill.masks == {4: PROMPT}
    for graph in (prefill.gm, prefill.structured):
        assert not {"zeros", "index_copy_", "expand"} & _graph_ops(graph)  # no buffer, no repetition: GQA by sdpa
    dense = prefill.gm(*inputs)
    _assert_close(dense, (want[0], inputs[1], inputs[2]))  # the prompt's keys and values in the buffers' place
    # the structured variant takes, after the graph's inputs, the keys every row may see: one [B, S] per mask
    (extra,) = _placeholders(prefill.structured)[len(inputs):]
    assert tuple(extra.meta["example_value"].shape) == (BATCH, PROMPT)
    built = []
    run = static_prefill_runner(prefill, prefill.structured.forward, lambda: built.append(1) or prefill.gm.forward,
                                rank=0, group_name="unused")
    _assert_close(run(*inputs), want)  # whole buffers (the outputs are not split), zeros past the prompt
    assert not built  # the mask is causal over the prompt's keys: the dense variant is never compiled
    hiding = inputs[4].clone()
    hiding[0, 0, 3, 1] = False  # hides a key a causal mask shows: no structure, the dense variant runs
    _assert_close(run(*inputs[:4], hiding), masked_prefill(*inputs[:4], hiding))
    assert built == [1]


def test_a_causal_prefill_reads_the_prompt_columns_of_the_buffers():
    inputs = _inputs()
    prefill = static_prefill(_captured(causal_prefill, *inputs))
    assert prefill is not None
    assert prefill.buffers == {1: (SEQ_DIM, CAPACITY), 2: (SEQ_DIM, CAPACITY)}
    assert prefill.starts == {0} and prefill.masks == {}
    assert len(_placeholders(prefill.structured)) == len(inputs)  # no mask to rebuild
    run = static_prefill_runner(prefill, prefill.structured.forward, lambda: prefill.gm.forward, rank=0,
                                group_name="unused")
    _assert_close(run(*inputs), causal_prefill(*inputs))


def test_the_runner_refuses_a_cache_that_holds_positions_and_a_mask_that_reads_past_the_prompt():
    inputs = (*_inputs(), _causal_mask())
    prefill = static_prefill(_captured(masked_prefill, *inputs))
    run = static_prefill_runner(prefill, prefill.structured.forward, lambda: prefill.gm.forward, rank=0,
                                group_name="unused")
    with pytest.raises(ValueError, match="already holds 2 positions"):
        run(*_inputs(start=2), inputs[4])
    past = inputs[4].clone()
    past[..., PROMPT] = True
    with pytest.raises(ValueError, match="past the prompt"):
        run(*inputs[:4], past)


def read_elsewhere(start, k, v, q):
    keys, values = _buffers(start, k, v)
    out = F.scaled_dot_product_attention(q, keys[:, :, :PROMPT], values[:, :, :PROMPT], is_causal=True,
                                         enable_gqa=True)
    return out, keys.sum(), values


def written_from_zero(start, k, v, q):
    keys, values = _buffers(0, k, v)
    out = F.scaled_dot_product_attention(q, keys[:, :, :PROMPT], values[:, :, :PROMPT], is_causal=True,
                                         enable_gqa=True)
    return out + start, keys, values


def shorter_slice(start, k, v, q):
    keys, values = _buffers(start, k, v)
    out = F.scaled_dot_product_attention(q, keys[:, :, :PROMPT - 1], values[:, :, :PROMPT - 1], enable_gqa=True)
    return out, keys, values


@pytest.mark.parametrize("fn", [read_elsewhere, written_from_zero, shorter_slice])
def test_a_buffer_read_otherwise_or_written_at_positions_that_are_no_input_stays_whole(fn):
    assert static_prefill(_captured(fn, *_inputs())) is None
