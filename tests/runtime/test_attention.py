"""Distributed attention on real ranks against one-process ``F.scaled_dot_product_attention``.

Every strategy x mask x head layout x dtype runs on 2, 3 and 4 ranks (hybrid on the meshes the world
size allows); each rank returns its output shard and the gradients of its q, k, v shards, and the
parent compares them with SDPA over the whole sequence (float64, with the equivalent dense mask)
restricted to the rank's positions; every fifth case caps its scores (``softcap``, Gemma2) and is compared
with the explicitly capped attention instead; another fifth runs its heads in 2 or 4 groups (``head_chunks``: as
many as the key/value heads and, for Ulysses, the ranks allow; with ALiBi and position-bias terms sliced per group); a tenth have attention sinks (gpt-oss), whose gradient is
checked too. Cases are batched: one ``run_on_ranks`` call per world size.
The same runs measure bytes sent per call (forward and backward separately) on every rank against
:func:`~autoshard.runtime.attention.base.bytes_sent_by_rank`, exactly (uneven shards and head splits
included), and that against the sympy formulas of :mod:`autoshard.runtime.attention.formulas`.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from autoshard.runtime.attention import local as local_impl
from autoshard.runtime import SequenceLayout, attention, comm_counter
from autoshard.runtime.attention import attention_flops, hybrid_layout, hybrid_sequence_rank
from autoshard.runtime.attention.base import bytes_sent, bytes_sent_by_rank
from autoshard.runtime.attention.formulas import values
from autoshard.runtime.accounting import all_reduce_bytes
from autoshard.testing import run_on_ranks

MASKS = ["none", "causal", "causal+window", "key_mask", "segments+causal"]
HEADS = [(8, 8), (8, 2), (8, 1)]  # MHA, GQA 8/2, MQA
DTYPES = [torch.float64, torch.float32, torch.bfloat16]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}  # max error / max |reference|


def _strategies(world: int) -> list[tuple[str, str, tuple[int, int] | None]]:
    """(strategy, layout, hybrid mesh) served at ``world`` ranks. A hybrid mesh is its shape
    ``(P_ring, P_ulysses)`` with axes named ("ring", "ulysses"), or ``("ulysses", "ring")``: a 2 x 2 mesh whose
    axes come in the other order, so sequence ranks differ from flattened ranks."""
    out = [("ring", "contiguous", None), ("ring", "zigzag", None), ("ring", "striped", None),
           ("zigzag", "zigzag", None),
           ("allgather", "contiguous", None), ("allgather", "zigzag", None), ("ulysses", "contiguous", None),
           ("ulysses", "zigzag", None)]
    if world == 2:
        out.append(("hybrid", "zigzag", (2, 1)))
    if world == 4:
        out += [("hybrid", "zigzag", (2, 2)), ("hybrid", "contiguous", ("ulysses", "ring"))]
    return out


def _cases(world: int) -> list[dict]:
    cases = []
    combos = itertools.product(_strategies(world), MASKS, HEADS, DTYPES)
    for n, ((strategy, layout, mesh), mask, (h, hkv), dtype) in enumerate(combos):
        cases.append(dict(
            strategy=strategy, layout=layout, mesh=mesh, mask=mask, heads=h, kv_heads=hkv, dtype=dtype,
            batch=2, head_dim=24 if n % 2 else 8,          # 24: not a power of two
            length=(8 * world if n % 3 else 8 * world + 1),  # every third length uneven (at every world size)
            tiled=n % 4 == 1,                              # force the tiled path with small tiles
            softcap=2.0 if n % 5 == 2 else 0.0,            # Gemma2's soft-capped scores, every dtype and mask
            chunk=5 if n % 7 == 3 else 0,                  # chunked local attention (Llama-4) on every strategy
            value_dim=(12 if n % 2 else 20) if n % 6 == 5 else None,  # v's head dim differs (MLA)
            alibi=n % 8 == 6,                              # ALiBi slopes, from global positions
            position_bias=n % 9 == 4,                      # a learned relative-position bias (T5), and its gradient
            sinks=n % 10 == 7,                             # attention sinks (gpt-oss), and their gradient
            head_chunks=(2, 4)[n % 2] if n % 5 == 3 else 1,  # heads run in groups, one at a time (head_chunks)
            seed=n))
    return cases


# ---------------------------------------------------------------------------- inputs and reference


def _inputs(case: dict):
    g = torch.Generator().manual_seed(case["seed"])
    B, S, D, H, Hkv = case["batch"], case["length"], case["head_dim"], case["heads"], case["kv_heads"]
    Dv = case.get("value_dim") or D
    q, k, v, dout = (torch.randn(B, h, S, d, generator=g, dtype=torch.float64).to(case["dtype"])
                     for h, d in ((H, D), (Hkv, D), (Hkv, Dv), (H, Dv)))
    key_mask = segments = None
    if case["mask"] == "key_mask":
        key_mask = torch.rand(B, S, generator=g) > 0.3
        key_mask[:, S // 2] = True  # every row keeps a visible key (fully masked rows: test_attention_local)
    if case["mask"] == "segments+causal":
        segments = torch.cumsum(torch.rand(B, S, generator=g) < 0.15, dim=1)  # packed documents
    return q, k, v, dout, key_mask, segments


def _mask_args(case: dict) -> dict:
    return {"causal": "causal" in case["mask"], "window": (5, 0) if "window" in case["mask"] else None,
            "chunk": case["chunk"], "alibi_slopes": _slopes(case["heads"]) if case.get("alibi") else None}


def _slopes(heads: int) -> torch.Tensor:
    """ALiBi's slopes: 2^(-8 (i + 1) / heads)."""
    return torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)], dtype=torch.float32)


def _position_bias(case: dict) -> torch.Tensor | None:
    """The case's relative-position bias ``[H, 2S - 1]`` (float32), or None."""
    if not case.get("position_bias"):
        return None
    g = torch.Generator().manual_seed(case["seed"] + 1)
    return torch.randn(case["heads"], 2 * case["length"] - 1, generator=g)


def _sinks(case: dict) -> torch.Tensor | None:
    """The case's attention sinks ``[H]`` (float32, around the scores' size), or None."""
    if not case.get("sinks"):
        return None
    return torch.randn(case["heads"], generator=torch.Generator().manual_seed(case["seed"] + 2))


def _dense_mask(case: dict, key_mask, segments) -> torch.Tensor:
    """[B, 1, S, S] bool: which key each query sees, straight from the definitions of the case's mask."""
    S = case["length"]
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    mask = torch.ones(case["batch"], 1, S, S, dtype=torch.bool)
    if "causal" in case["mask"]:
        mask &= j <= i
    if "window" in case["mask"]:
        mask &= j >= i - 5
    if case["chunk"]:
        mask &= i // case["chunk"] == j // case["chunk"]
    if key_mask is not None:
        mask &= key_mask[:, None, None, :]
    if segments is not None:
        mask &= segments[:, None, :, None] == segments[:, None, None, :]
    return mask


def _reference(case: dict):
    """Dense float64 attention written out here, independent of the library: scores scaled, capped, plus the
    ALiBi and relative-position terms, masked, softmax (rows that see no key: 0) -- with sinks over the scores and
    one sink logit per head, the sink's column then dropped, as gpt-oss computes it -- times v; its gradients by
    autograd."""
    q, k, v, dout, key_mask, segments = _inputs(case)
    leaves = [t.to(torch.float64).requires_grad_() for t in (q, k, v)]
    bias = _position_bias(case)
    bias = bias.double().requires_grad_() if bias is not None else None
    sinks = _sinks(case)
    sinks = sinks.double().requires_grad_() if sinks is not None else None
    q64, k64, v64 = leaves
    group, S = q64.shape[1] // k64.shape[1], case["length"]
    s = q64 @ k64.repeat_interleave(group, 1).transpose(-1, -2) / q64.shape[-1] ** 0.5
    if case.get("softcap"):
        s = case["softcap"] * torch.tanh(s / case["softcap"])
    distance = torch.arange(S)[None, :] - torch.arange(S)[:, None]  # k - q
    if case.get("alibi"):
        s = s + _slopes(case["heads"]).double()[:, None, None] * distance
    if bias is not None:
        s = s + bias[:, distance + S - 1]
    mask = _dense_mask(case, key_mask, segments)
    visible = mask.any(-1, keepdim=True)  # a row with no visible key (key mask x chunk) gives 0, by definition
    if sinks is not None:
        sink = sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s.masked_fill(~mask, float("-inf")), sink], -1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(torch.where(visible, s.masked_fill(~mask, float("-inf")), 0.0), dim=-1) * mask
    out = p @ v64.repeat_interleave(group, 1)
    out.backward(dout.to(torch.float64))
    return ([out.detach()] + [t.grad for t in leaves] + [bias.grad if bias is not None else None]
            + [sinks.grad if sinks is not None else None])


def _layout(case: dict, world: int) -> SequenceLayout:
    """The case's layout; "striped": runs of 3 positions dealt to the ranks in turn (a derived layout)."""
    S = case["length"]
    if case["layout"] == "striped":
        return SequenceLayout.from_intervals(S, [[(c, min(c + 3, S)) for c in range(3 * r, S, 3 * world)]
                                                 for r in range(world)])
    return SequenceLayout.of(case["layout"], S, world)


# ---------------------------------------------------------------------------- rank worker


def _run_case(case: dict, mesh) -> dict:
    q, k, v, dout, key_mask, segments = _inputs(case)
    if mesh is None:
        layout, seq_rank = _layout(case, dist.get_world_size()), dist.get_rank()
    else:  # the helpers a hand-sharding user of the hybrid strategy needs
        layout, seq_rank = hybrid_layout(mesh, case["length"], case["layout"]), hybrid_sequence_rank(mesh)
    given_layout = layout if case["layout"] == "striped" else case["layout"]
    pos = layout.positions(seq_rank)
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    shard = (lambda m: None if m is None else m[:, pos])  # noqa: E731
    group = mesh if mesh is not None else None
    bias = _position_bias(case)
    bias = bias.requires_grad_() if bias is not None else None
    sinks = _sinks(case)
    sinks = sinks.requires_grad_() if sinks is not None else None
    with comm_counter() as fwd:
        out = attention(ql, kl, vl, group=group, strategy=case["strategy"], layout=given_layout,
                        key_mask=shard(key_mask), segment_ids=shard(segments), seq_len=case["length"],
                        softcap=case.get("softcap", 0.0), kernels=case.get("kernels", "auto"), position_bias=bias,
                        sinks=sinks, head_chunks=case.get("head_chunks", 1), **_mask_args(case))
    with comm_counter() as bwd:
        out.backward(dout[:, :, pos])
    sync = sum(all_reduce_bytes(t.numel(), t.element_size(), size)  # their grad_sync
               for t in (bias, sinks) if t is not None for size in _mesh_sizes(case, dist.get_world_size()))
    return dict(out=out.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad, dbias=None if bias is None else bias.grad,
                dsinks=None if sinks is None else sinks.grad,
                fwd_bytes=fwd.payload_bytes_sent, bwd_bytes=bwd.payload_bytes_sent - sync, seq_rank=seq_rank)


def _run_cases(cases: list[dict]) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {}
    results = []
    for case in cases:
        mesh = None
        if case["mesh"] is not None:
            if case["mesh"] not in meshes:
                shape, names = ((2, 2), case["mesh"]) if isinstance(case["mesh"][0], str) else (case["mesh"],
                                                                                               ("ring", "ulysses"))
                meshes[case["mesh"]] = init_device_mesh("cpu", shape, mesh_dim_names=names)
            mesh = meshes[case["mesh"]]
        saved = local_impl.TILE_Q, local_impl.TILE_K, local_impl.FUSED_BLOCKS
        if case["tiled"]:
            local_impl.TILE_Q, local_impl.TILE_K, local_impl.FUSED_BLOCKS = 8, 16, False
        try:
            results.append(_run_case(case, mesh))
        finally:
            local_impl.TILE_Q, local_impl.TILE_K, local_impl.FUSED_BLOCKS = saved
    return results


@pytest.fixture(scope="module", params=[2, *(pytest.param(world, marks=pytest.mark.slow) for world in (3, 4))])
def runs(request):
    world = request.param
    cases = _cases(world)
    return world, cases, run_on_ranks(_run_cases, world, cases, timeout=240)


def _relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.to(torch.float64) - ref).abs().max() / ref.abs().max()).item()


def _check_against_sdpa(world: int, cases: list[dict], results: list[list[dict]]) -> None:
    failures = []
    for n, case in enumerate(cases):
        reference = _reference(case)
        layout = _layout(case, world)
        for rank in range(world):
            got = results[rank][n]
            pos = layout.positions(got["seq_rank"])
            for name, ref in zip(("out", "dq", "dk", "dv"), reference):
                assert got[name].dtype == case["dtype"]
                err = _relative_error(got[name], ref[:, :, pos])
                if not err <= TOLERANCE[case["dtype"]]:
                    failures.append(f"{case} rank {rank} {name}: relative error {err:.2e}")
            for name, ref in (("dbias", reference[4]), ("dsinks", reference[5])):
                if ref is None:  # the bias's and the sinks' gradients, summed over the ranks: whole on every rank
                    continue
                err = _relative_error(got[name], ref)
                if not err <= max(TOLERANCE[case["dtype"]], 1e-5):  # they and their gradients are float32
                    failures.append(f"{case} rank {rank} {name}: relative error {err:.2e}")
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} failures)"


def test_matches_one_process_sdpa(runs):
    _check_against_sdpa(*runs)


@pytest.mark.parametrize("wanted", [
    {("zigzag", "zigzag", "causal"), ("ulysses", "contiguous", "segments+causal"), ("hybrid", "zigzag", "causal")},
    pytest.param({("ring", "contiguous", "causal+window"), ("allgather", "contiguous", "key_mask")},
                 marks=pytest.mark.slow)], ids=["default", "more"])
def test_triton_kernels_plug_into_the_strategies(wanted):
    """The strategies with ``kernels="triton"`` (the Triton interpreter on CPU): the zigzag ring, Ulysses and the 2-D
    hybrid in the default suite, the contiguous ring and all-gather in the slow tier; the causal cases with
    soft-capped scores, the sliding-window case chunked too, the key-mask and segment cases with a value head dim (12)
    other than the query/key head dim (MLA), the causal ones with ALiBi, the causal and key-mask ones with attention
    sinks (the kernels' backward on the output and log-sum-exp the sinks corrected)."""
    pytest.importorskip("triton")
    pytest.importorskip("autoshard.kernels.attention")
    cases = [dict(case, kernels="triton", dtype=torch.float32, tiled=False, length=20, head_dim=16,
                  softcap=2.0 if case["mask"] == "causal" else 0.0, chunk=6 if case["mask"] == "causal+window" else 0,
                  value_dim=12 if case["mask"] in ("key_mask", "segments+causal") else None,
                  alibi=case["mask"] in ("causal", "segments+causal"), sinks=case["mask"] in ("causal", "key_mask"))
             for case in _cases(2) if case["dtype"] == torch.float64 and (case["heads"], case["kv_heads"]) == (8, 2)
             and (case["strategy"], case["layout"], case["mask"]) in wanted]
    assert len(cases) == len(wanted)
    _check_against_sdpa(2, cases, run_on_ranks(_run_cases, 2, cases, env={"TRITON_INTERPRET": "1"}, timeout=240))


def _mesh_sizes(case: dict, world: int) -> tuple[int, int]:
    """(P_ring, P_ulysses) of a case."""
    if case["mesh"] is not None:
        return (2, 2) if isinstance(case["mesh"][0], str) else case["mesh"]
    return (1, world) if case["strategy"] == "ulysses" else (world, 1)


def _size_args(case: dict) -> dict:
    """The case's sizes and masks, as the byte functions take them."""
    return dict(B=case["batch"], H=case["heads"], Hkv=case["kv_heads"], D=case["head_dim"], Dv=case.get("value_dim"),
                dtype=case["dtype"],
                key_mask=case["mask"] == "key_mask",
                segment_ids_dtype=torch.int64 if case["mask"] == "segments+causal" else None)


def _formula_bytes(case: dict, world: int, direction: str) -> int | None:
    """The formula's bytes, or None where the formula is not exact (heads Ulysses splits unevenly)."""
    P_r, P_u = _mesh_sizes(case, world)
    H, Hkv = case["heads"], case["kv_heads"]
    if H % P_u or not (Hkv % P_u == 0 or P_u % Hkv == 0):
        return None
    sizes = dict(B=case["batch"], S=case["length"], H=H, Hkv=Hkv, D=case["head_dim"], Dv=case.get("value_dim") or 0)
    sizes.update(dict(P_r=P_r, P_u=P_u) if case["mesh"] else dict(P=world))
    args = _size_args(case)
    subs = values(dtype=args["dtype"], key_mask=args["key_mask"], segment_ids_dtype=args["segment_ids_dtype"], **sizes)
    expr = bytes_sent(case["strategy"], direction).subs(subs)
    assert expr.is_Rational, expr
    return expr


def _exact_bytes(case: dict, world: int, direction: str) -> list[int]:
    """:func:`bytes_sent_by_rank` of a case, per sequence rank."""
    lengths = _layout(case, world).local_lengths
    return bytes_sent_by_rank(case["strategy"], direction, lengths, P_u=_mesh_sizes(case, world)[1], **_size_args(case))


def test_bytes_sent_equal_the_exact_bytes_and_the_formulas(runs):
    """Every rank sends exactly :func:`bytes_sent_by_rank`; where the sympy formula is exact (even shards, even
    head splits) that is the formula on every rank, with uneven shards its mean over ranks."""
    world, cases, results = runs
    checked = uneven = 0
    for n, case in enumerate(cases):
        if case["head_chunks"] > 1:  # a collective per head group (masks travel with each): the formulas count one
            continue
        if case["strategy"] == "allgather" and case["mask"] == "segments+causal":
            continue  # packed documents: the keys are fetched by visibility (test_documents counts those bytes)
        for direction in ("forward", "backward"):
            column = "fwd_bytes" if direction == "forward" else "bwd_bytes"
            measured = [0] * world
            for rank in range(world):
                measured[results[rank][n]["seq_rank"]] = results[rank][n][column]
            exact = _exact_bytes(case, world, direction)
            assert measured == exact, (case, direction, measured, exact)
            layout = _layout(case, world)
            uneven += not layout.is_even
            expected = _formula_bytes(case, world, direction)
            if expected is None:
                continue
            if layout.is_even:  # every rank sends exactly the formula
                assert exact == [expected] * world, (case, direction, exact, expected)
            elif case["strategy"] == "hybrid" and case["mask"] in ("key_mask", "segments+causal"):
                # a Ulysses group pads its mask all-gather to its own largest shard, at most ceiling(S / P)
                assert sum(exact) <= expected * world, (case, direction, exact, expected)
            else:  # uneven shards: the formula is the mean over ranks
                assert sum(exact) == expected * world, (case, direction, exact, expected)
            checked += 1
    whole = sum(case["head_chunks"] == 1 for case in cases)
    assert uneven >= whole // 2  # every third case of every strategy, forward and backward
    assert checked >= whole  # ulysses at 3 ranks (8 heads) is the only case without an exact formula


def test_exact_bytes_are_the_formulas_on_even_splits():
    """Where the sympy formulas are exact, :func:`bytes_sent_by_rank` gives them on every rank (no ranks needed)."""
    meshes = [(1, 2), (2, 1), (1, 3), (3, 1), (1, 4), (4, 1), (2, 2), (2, 4), (4, 2), (1, 8)]
    heads = [(8, 8), (8, 2), (8, 1), (16, 4), (12, 3)]
    masks = [(False, None), (True, torch.int64), (False, torch.int32)]
    checked = 0
    for strategy, (P_r, P_u), (H, Hkv), dtype, (key_mask, seg) in itertools.product(
            ["ring", "zigzag", "allgather", "ulysses", "hybrid"], meshes, heads, DTYPES, masks):
        if strategy != "hybrid" and min(P_r, P_u) > 1:
            continue
        world = P_r * P_u
        heads_axis = P_u if strategy == "hybrid" else world if strategy == "ulysses" else 1
        if H % heads_axis or not (Hkv % heads_axis == 0 or heads_axis % Hkv == 0):
            continue
        S, shape = 6 * world, dict(B=2, H=H, Hkv=Hkv, D=8)
        sizes = dict(S=S, **shape, **(dict(P_r=P_r, P_u=P_u) if strategy == "hybrid" else dict(P=world)))
        for direction in ("forward", "backward"):
            formula = bytes_sent(strategy, direction).subs(values(dtype=dtype, key_mask=key_mask,
                                                                   segment_ids_dtype=seg, **sizes))
            exact = bytes_sent_by_rank(strategy, direction, [S // world] * world, dtype=dtype, key_mask=key_mask,
                                       segment_ids_dtype=seg, P_u=P_u if strategy == "hybrid" else None, **shape)
            assert exact == [formula] * world, (strategy, P_r, P_u, H, Hkv, dtype, key_mask, seg, direction)
            checked += 1
    assert checked > 1000


# ---------------------------------------------------------------------------- causal balance


def _causal_flops(runs: list[tuple[str, str, int]]) -> list[int]:
    """Forward attention FLOPs this rank counts for each causal (layout, strategy, length) run."""
    counts = []
    for layout, strategy, length in runs:
        q = torch.randn(1, 2, length, 8)
        lay = SequenceLayout.of(layout, length, dist.get_world_size())
        local = q[:, :, lay.positions(dist.get_rank())]
        with attention_flops() as flops:
            attention(local, local, local, strategy=strategy, layout=layout, causal=True, seq_len=length)
        counts.append(flops.forward)
    return counts


def test_zigzag_balances_causal_work():
    world, lengths = 4, (64, 203)  # 203: uneven chunks
    runs = [(layout, strategy, n) for n in lengths
            for layout, strategy in (("zigzag", "zigzag"), ("contiguous", "ring"))]
    per_rank = run_on_ranks(_causal_flops, world, runs)
    report = []
    for n, (layout, strategy, length) in enumerate(runs):
        counts = [per_rank[rank][n] for rank in range(world)]
        assert sum(counts) == 4 * 8 * 2 * length * (length + 1) // 2  # every visible pair once: 4 * D * heads
        ratio = max(counts) / (sum(counts) / world)
        report.append(f"{strategy} ({layout}) S={length}: {counts} max/mean {ratio:.3f}")
        if strategy == "zigzag":
            assert ratio <= 1.05, report[-1]
        else:  # what zigzag fixes: the last rank of a contiguous ring does ~7/4 of the mean
            assert ratio > 1.5, report[-1]
    print("\ncausal attention FLOPs per rank at P=4:\n  " + "\n  ".join(report))


# ---------------------------------------------------------------------------- bad input


def _bad_inputs() -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.runtime.attention import api

    api._agreed.clear()  # earlier tests in this worker may have confirmed the signature of "one rank wrong"
    rank = dist.get_rank()
    q = torch.randn(1, 4, 8, 16)
    kv = torch.randn(1, 2, 8, 16)
    ok = dict(seq_len=16)
    calls = {
        "dtype": lambda: attention(q, kv.double(), kv, **ok),
        "shape": lambda: attention(q, kv[:, :, :7], kv[:, :, :7], **ok),
        "device": lambda: attention(q, kv.to("meta"), kv, **ok),
        "heads": lambda: attention(q, kv[:, :1].expand(1, 3, 8, 16), kv[:, :1].expand(1, 3, 8, 16), **ok),
        "not a shard": lambda: attention(q, kv, kv, seq_len=10),
        "layout cannot serve": lambda: attention(q[:, :, :1], kv[:, :, :1], kv[:, :, :1], layout="zigzag", seq_len=2),
        "layout for 4 ranks": lambda: attention(q, kv, kv, layout=SequenceLayout.contiguous(32, 4)),
        "zigzag needs zigzag": lambda: attention(q, kv, kv, strategy="zigzag", **ok),
        "ulysses heads": lambda: attention(q[:, :1], kv[:, :1], kv[:, :1], strategy="ulysses", **ok),
        "hybrid needs a mesh": lambda: attention(q, kv, kv, strategy="hybrid", **ok),
        "2-D mesh": lambda: attention(q, kv, kv, group=init_device_mesh("cpu", (1, 2)), **ok),
        "key_mask shape": lambda: attention(q, kv, kv, key_mask=torch.ones(1, 16, dtype=torch.bool), **ok),
        "key_mask dtype": lambda: attention(q, kv, kv, key_mask=torch.ones(1, 8), **ok),
        "segment dtype": lambda: attention(q, kv, kv, segment_ids=torch.ones(1, 8), **ok),
        "window": lambda: attention(q, kv, kv, window=(-2, 0), **ok),
        "dropout": lambda: attention(q, kv, kv, dropout_p=0.1, **ok),
        "softcap": lambda: attention(q, kv, kv, softcap=-1.0, **ok),
        "head_chunks": lambda: attention(q, kv, kv, head_chunks=0, **ok),
        "ranks disagree on softcap": lambda: attention(q, kv, kv, softcap=float(rank), **ok),
        "strategy": lambda: attention(q, kv, kv, strategy="striped", **ok),
        "ranks disagree": lambda: attention(q[:, : 4 - 2 * rank], kv, kv, **ok),
        "one rank wrong": lambda: attention(q, kv if rank == 0 else kv[:, :, :7], kv, **ok),
        "length from shards": lambda: attention(q[:, :, : 8 - 3 * rank], kv[:, :, : 8 - 3 * rank],
                                                kv[:, :, : 8 - 3 * rank]),
    }
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = "no error"
        except ValueError as err:
            messages[name] = str(err)
    # the group still works after every failure
    good = attention(q, kv, kv, **ok)
    messages["after"] = "finite" if torch.isfinite(good).all() else "nan"
    return messages


EXPECTED_ERRORS = {
    "dtype": ["share one floating dtype"],
    "shape": ["k must be [B, Hkv, S_local, D] and v [B, Hkv, S_local, Dv] matching q"],
    "device": ["on one device"],
    "heads": ["multiple of the 3 kv heads"],
    "not a shard": ["holds 8 positions, but the contiguous layout of 10 positions on 2 ranks gives it 5"],
    "layout cannot serve": ["has only 2 positions"],
    "layout for 4 ranks": ["the layout places the sequence on 4 ranks but the group has 2"],
    "zigzag needs zigzag": ["strategy 'zigzag' needs the zigzag layout", "layout='zigzag'"],
    "ulysses heads": ["needs at least one head per rank (H >= P)", "strategy 'ring' or 'zigzag'"],
    "hybrid needs a mesh": ["needs group= a 2-D DeviceMesh"],
    "2-D mesh": ["2-D DeviceMesh is for strategy 'hybrid'"],
    "key_mask shape": ["key_mask must be this rank's shard, a [B, S_local] = [1, 8] bool tensor"],
    "key_mask dtype": ["key_mask must be this rank's shard"],
    "segment dtype": ["segment_ids must be this rank's shard, a [B, S_local] = [1, 8] integer tensor"],
    "window": ["window sides must be >= 0, or -1 for unbounded"],
    "dropout": ["dropout is not part of distributed attention"],
    "softcap": ["softcap must be a finite number >= 0 (0: no capping), got -1.0"],
    "head_chunks": ["head_chunks must be a positive int (1: all heads at once), got 0"],
    "ranks disagree on softcap": ["the ranks disagree on softcap"],
    "strategy": ["unknown strategy 'striped'"],
    "ranks disagree": ["the ranks disagree on H (per sequence rank: [4, 2])"],
    "length from shards": ["the shards hold [8, 5] positions per sequence rank, but the contiguous layout of their "
                           "13 positions gives [7, 6]"],
}


def test_bad_input_raises_a_clear_error_on_every_rank():
    results = run_on_ranks(_bad_inputs, 2)
    for rank, messages in enumerate(results):
        for name, fragments in EXPECTED_ERRORS.items():
            for fragment in fragments:
                assert fragment in messages[name], (rank, name, messages[name])
        assert messages["after"] == "finite"
    # a shape error on rank 1 only: rank 1 names it, rank 0 learns that rank 1 failed
    assert "k must be [B, Hkv, S_local, D] and v" in results[1]["one rank wrong"]
    assert "sequence rank(s) [1] rejected their inputs" in results[0]["one rank wrong"]


# ---------------------------------------------------------------------------- tracing


def _compiled_attention():
    rank = dist.get_rank()
    layout = SequenceLayout.zigzag(16, 2)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(2, h, 16, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
    q, k, v = (t[:, :, layout.positions(rank)].clone().requires_grad_() for t in full)
    group = dist.group.WORLD.group_name

    def fn(q, k, v):
        out, lse = torch.ops.autoshard.attention(q, k, v, None, None, None, None, None, None, "zigzag",
                                                 layout.encode(), group, "", True, -1, -1, 0, 8 ** -0.5, 0.0, 0.0,
                                                 "torch", 1)
        return out.sum() + lse.sum().detach()

    torch.library.opcheck(torch.ops.autoshard.attention.default,
                          (q, k, v, None, None, None, None, None, None, "zigzag", layout.encode(), group, "", True, -1,
                           -1, 4, 8 ** -0.5, 2.0, 0.0, "torch", 2))  # its 2 key/value heads in 2 groups
    # ALiBi slopes, a relative-position bias, attention sinks, dropout, a value head dim (6) other than the query/key
    # head dim (8), laid out as q is
    v_narrow = v.detach()[..., :6].clone().requires_grad_()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    torch.library.opcheck(torch.ops.autoshard.attention.default,
                          (q.transpose(1, 2).contiguous().transpose(1, 2), k, v_narrow, None, None, slopes,
                           torch.randn(4, 31, requires_grad=True), torch.randn(4, requires_grad=True), torch.tensor(7),
                           "zigzag", layout.encode(), group, "", True, -1, -1, 0, 8 ** -0.5, 0.0, 0.1, "torch", 1))
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    compiled(q, k, v).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward()
    return [torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v))]


def test_op_traces_under_torch_compile():
    for equal in run_on_ranks(_compiled_attention, 2, timeout=120):
        assert equal == [True, True, True]
