"""The op registry (:mod:`autoshard.runtime.op_info`): every ``autoshard::`` op is declared, and the formulas
read their calls' arguments by the names of the op's schema."""

import dataclasses

import pytest
import torch

import autoshard.passes.pipeline  # noqa: F401  (the rules register their traffic)
import autoshard.step_time  # noqa: F401  (the attention's price)
from autoshard.runtime.attention.api import OpConfig, attention_op_shape
from autoshard.runtime.chunked_loss import working_set_bytes
from autoshard.runtime.layouts import SequenceLayout
from autoshard.runtime.op_info import OPS, Work, arguments, declare, lookup, register, working_set


def _autoshard_ops() -> list[str]:
    """Every ``autoshard::`` op that runs: the annotation markers (``CompositeImplicitAutograd``) decompose before
    any graph the compiler emits or any dispatch mode sees them."""
    return sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("autoshard::")
                  and not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"))


def _overload(name: str) -> torch._ops.OpOverload:
    return getattr(torch.ops.autoshard, name.split("::")[1]).default


def test_every_op_is_declared():
    names = _autoshard_ops()
    assert len(names) > 20
    assert [n for n in names if _overload(n) not in OPS] == []


@pytest.mark.parametrize("name", _autoshard_ops())
def test_arguments_named_by_the_schema(name):
    op = _overload(name)
    schema = op._schema.arguments
    values = tuple(object() for _ in schema)
    assert arguments(op, values) == {a.name: v for a, v in zip(schema, values)}
    if schema:  # a keyword argument lands under its name
        last = schema[-1].name
        assert arguments(op, values[:-1], {last: values[-1]})[last] is values[-1]


def test_emitted_functions_named_by_their_signature():
    functions = [target for target in OPS if not isinstance(target, torch._ops.OpOverload)]
    assert functions and all(OPS[f].traffic is not None for f in functions)
    bucket = next(f for f in functions if f.__name__ == "grad_sync_bucket")
    assert arguments(bucket, ("group", 1, 2)) == {"group": "group", "xs": (1, 2)}


def test_declared_once_and_before_formulas():
    with pytest.raises(RuntimeError, match="declared twice"):
        declare(torch.ops.autoshard.attention.default)
    with pytest.raises(KeyError, match="not declared"):
        register("traffic", torch.ops.aten.mm.default)(lambda book, call: None)
    with pytest.raises(ValueError, match="not one of the formulas"):
        register("latency", torch.ops.autoshard.attention.default)
    assert lookup(torch.ops.aten.mm.default) is None
    assert working_set(torch.ops.aten.mm.default, ()) == 0


def _loss_args(grads: bool, dtype=torch.bfloat16):
    h = torch.empty(2, 100, 64, dtype=dtype, device="meta")
    weight = torch.empty(1000, 64, dtype=dtype, device="meta")
    target = torch.empty(2, 100, dtype=torch.long, device="meta")
    return h, weight, None, target, None, -100, 0.0, "mean", 4, torch.float32, grads


def test_chunked_loss_declares_its_work_and_working_set():
    forward, backward = (torch.ops.autoshard.linear_cross_entropy.default,
                         torch.ops.autoshard.linear_cross_entropy_backward.default)
    rows, classes, hidden = 200, 1000, 64
    for grads, products in ((False, 1), (True, 3)):
        a = arguments(forward, _loss_args(grads))
        assert OPS[forward].flops(a) == Work(products * 2 * rows * classes * hidden, torch.bfloat16,
                                             products * 3 * rows * classes * 4)
    assert working_set(forward, _loss_args(True)) == working_set_bytes(rows, classes, 4, torch.bfloat16,
                                                                       torch.float32)
    h, weight, bias, target, class_weight, ignore_index, smoothing, reduction, chunks, _, _ = _loss_args(False)
    grad = torch.empty((), dtype=torch.float16, device="meta")
    lse = torch.empty(rows, dtype=torch.float32, device="meta")
    args = (grad, h, weight, bias, target, class_weight, lse, ignore_index, smoothing, reduction, chunks)
    assert OPS[backward].flops(arguments(backward, args)).flops == 3 * 2 * rows * classes * hidden
    assert working_set(backward, args) == working_set_bytes(rows, classes, 4, torch.bfloat16, torch.float16)


def test_attention_forward_and_backward_read_the_same_shape():
    world, length = 4, 64
    q = torch.empty(1, 8, length // world, 32, dtype=torch.bfloat16, device="meta")
    k = v = torch.empty(1, 2, length // world, 32, dtype=torch.bfloat16, device="meta")
    segment_ids = torch.empty(1, length // world, dtype=torch.int32, device="meta")
    config = OpConfig(strategy="ring", layout=SequenceLayout.contiguous(length, world).encode(), group="g",
                      ring_group="", causal=True, window_left=-1, window_right=-1, chunk=0, scale=0.1, softcap=0.0,
                      dropout_p=0.0, kernels="auto", head_chunks=2)
    terms = (None, segment_ids, None, None, None, None)  # key_mask, segment_ids, the score terms (_TERMS)
    forward = (q, k, v, *terms, *config.args())
    out, lse = torch.empty_like(q), torch.empty(q.shape[:-1], device="meta")
    backward = (out, q, k, v, out, lse, *terms, *config.args())
    shape, read, is_backward = attention_op_shape(arguments(torch.ops.autoshard.attention.default, forward))
    assert read == config and not is_backward
    assert attention_op_shape(arguments(torch.ops.autoshard.attention_backward.default, backward)) == (shape, config,
                                                                                                       True)
    assert (shape.seq, shape.heads, shape.kv_heads, shape.head_dim) == (length, 8, 2, 32)
    assert shape.mask == config.mask and shape.segment_ids_dtype == torch.int32 and not shape.key_mask
    assert [f.name for f in dataclasses.fields(OpConfig)] == [a.name for a in
                                                               torch.ops.autoshard.attention.default._schema.arguments
                                                               ][-len(dataclasses.fields(OpConfig)):]
    assert working_set(torch.ops.autoshard.attention.default, forward) > 0
    assert working_set(torch.ops.autoshard.attention_backward.default, backward) > 0
    assert OPS[torch.ops.autoshard.attention.default].seconds is not None
