"""Raw collectives on real ranks against the same linear map computed in one process.

Convention under test: the objective is the sum over ranks of ``(output_r * weight_r).sum()``, so
each collective's backward must be its exact adjoint. Gradients are checked in float64.
"""

import pytest
import torch
import torch.distributed as dist

from autoshard.runtime import all_gather, all_reduce, all_to_all, comm_counter, reduce_scatter
from autoshard.testing import run_on_ranks

WORLD_SIZES = [2, 3, 4]


def _rand(seed: int, *shape, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def _tied(seed: int, *shape):
    """Values from {0, 1}: an elementwise maximum over ranks then has ties across ranks, often several."""
    return _rand(seed, *shape).gt(0).to(torch.float64)


def _on_rank(collective: str, shapes: list[tuple], out_shapes: list[tuple], make=_rand, **kw):
    """Run collective ``op`` on this rank's input (drawn by ``make``); return (output, input grad, bytes sent,
    bytes received)."""
    rank = dist.get_rank()
    x = make(rank, *shapes[rank]).requires_grad_()
    fn = {"all_gather": all_gather, "reduce_scatter": reduce_scatter, "all_reduce": all_reduce,
          "all_to_all": all_to_all}[collective]
    with comm_counter() as cc:
        y = fn(x, **kw)
        w = _rand(1000 + rank, *out_shapes[rank])
        (y * w).sum().backward()
    return y.detach(), x.grad, cc.bytes_sent, cc.bytes_received


def _reference(shapes, out_shapes, linear_map, make=_rand):
    xs = [make(r, *s).requires_grad_() for r, s in enumerate(shapes)]
    ys = linear_map(xs)
    sum((y * _rand(1000 + r, *out_shapes[r])).sum() for r, y in enumerate(ys)).backward()
    return [y.detach() for y in ys], [x.grad for x in xs]


def _check(results, ref_out, ref_grad):
    for rank, (y, g, _, _) in enumerate(results):
        torch.testing.assert_close(y, ref_out[rank], rtol=1e-12, atol=1e-12, msg=f"rank {rank} output")
        torch.testing.assert_close(g, ref_grad[rank], rtol=1e-12, atol=1e-12, msg=f"rank {rank} grad")


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("uneven", [False, True])
def test_all_gather(world, uneven):
    sizes = [3 + (r % 2 if uneven else 0) for r in range(world)]
    shapes = [(2, n, 5) for n in sizes]
    total = sum(sizes)
    out_shape = [(2, total, 5) for r in range(world)]
    res = run_on_ranks(_on_rank, world, "all_gather", shapes, out_shape, dim=1, sizes=sizes)
    ref_out, ref_grad = _reference(shapes, out_shape, lambda xs: [torch.cat(xs, 1)] * world)
    _check(res, ref_out, ref_grad)
    padded = 2 * max(sizes) * 5 * 8
    for rank, (_, _, sent, received) in enumerate(res):
        # forward all-gather + backward reduce-scatter, both of max-shard-sized chunks
        assert sent == received == 2 * (world - 1) * padded


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_reduce_scatter(world):
    n = 2 * world + 1  # uneven chunks
    shapes = [(n, 3)] * world
    chunks = torch.tensor_split(torch.arange(n), world)
    out_shape = [(len(chunks[r]), 3) for r in range(world)]
    res = run_on_ranks(_on_rank, world, "reduce_scatter", shapes, out_shape, dim=0)

    def linear(xs):
        total = sum(xs)
        return [total[c] for c in chunks]

    _check(res, *_reference(shapes, out_shape, linear))


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("op,make", [("sum", _rand), ("max", _rand), ("max", _tied)], ids=["sum", "max", "max-ties"])
def test_all_reduce(world, op, make):
    """max's gradient is one process's torch.amax gradient: all of it to a unique maximum, split evenly among
    ranks that tie (the tie count rides along in the backward all-reduce, doubling its size)."""
    shapes = [(4, 3)] * world
    out_shape = [(4, 3) for r in range(world)]
    res = run_on_ranks(_on_rank, world, "all_reduce", shapes, out_shape, make=make, op=op)
    reducer = (lambda xs: sum(xs)) if op == "sum" else (lambda xs: torch.stack(xs).amax(0))
    _check(res, *_reference(shapes, out_shape, lambda xs: [reducer(xs)] * world, make=make))
    backward_numel = 12 if op == "sum" else 24
    expected = sum(2 * (world - 1) * -(-n // world) * 8 for n in (12, backward_numel))
    for _, _, sent, _ in res:
        assert sent == expected  # forward + backward all-reduce


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_all_to_all_uneven(world):
    heads = 2 * world + 1  # split dim not divisible by P
    seq = [2 + r for r in range(world)]  # uneven shards along the concatenated dim
    shapes = [(2, heads, seq[r], 4) for r in range(world)]
    cuts = [len(c) for c in torch.tensor_split(torch.arange(heads), world)]
    out_shape = [(2, cuts[r], sum(seq), 4) for r in range(world)]
    res = run_on_ranks(_on_rank, world, "all_to_all", shapes, out_shape, split_dim=1, cat_dim=2,
                       split_sizes=cuts, cat_sizes=seq)

    def linear(xs):
        full = torch.cat(xs, 2)
        return list(torch.split(full, cuts, 1))

    _check(res, *_reference(shapes, out_shape, linear))


def _compiled_all_gather():
    x = torch.arange(4.0) + dist.get_rank()
    fn = torch.compile(lambda t: all_gather(t * 2, 0) + 1, backend="aot_eager", fullgraph=True)
    return fn(x)


def test_collectives_trace_under_torch_compile():
    res = run_on_ranks(_compiled_all_gather, 2)
    expected = torch.cat([torch.arange(4.0) * 2, (torch.arange(4.0) + 1) * 2]) + 1
    for out in res:
        torch.testing.assert_close(out, expected)


def test_metadata_lives_where_the_backend_takes_it():
    """Small exchanges (lengths, flags) use CPU tensors under gloo and the current CUDA device under NCCL, which
    takes no CPU tensors."""
    from unittest import mock

    from autoshard.runtime.groups import metadata_device

    group = object()
    with mock.patch("autoshard.runtime.groups.resolve_group", return_value=group):
        for backend, device in (("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu")):
            with mock.patch.object(dist, "get_backend", return_value=backend):
                assert metadata_device(None) == torch.device(device)
        with mock.patch.object(dist, "get_backend", return_value="nccl"), \
                mock.patch.object(torch, "get_device_module", return_value=mock.Mock(current_device=lambda: 3)):
            assert metadata_device(None) == torch.device("cuda", 3)
