"""Packed documents on real ranks: exact against one process, and only the documents' own pairs computed.

Every strategy (ring, zigzag ring, all-gather on both layouts with its dispatch of queries by work, Ulysses, the
2-D hybrid at 4 ranks) x document patterns: documents shorter than a rank's share, one document spanning every
rank, documents with padding (a key mask), documents under a sliding window, documents each whole on one rank of the
contiguous layout, and, at 4 ranks, a row whose documents fall so unevenly that the all-gather moves queries. Each rank returns its output shard, the gradients of its
q, k, v shards and the attention FLOPs it counted; the parent compares them with dense float64 attention over the
whole sequence (the documents as a dense mask) and asserts that the FLOPs summed over ranks are exactly those of
the pairs the position mask and the documents let through (the FLOP counter counts what is computed: rectangles of
documents, never the pairs between them; a key mask skips no work), and that the all-gather strategy sends exactly
the key rows the documents make visible (none for documents whole on their rank). Lengths the world size does not divide; one launch per world size.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from autoshard.runtime import SequenceLayout, attention, comm_counter
from autoshard.runtime.layouts import split_sizes
from autoshard.runtime.attention import attention_flops
from autoshard.runtime.attention.dispatch import balance
from autoshard.runtime.attention.masks import MaskSpec
from autoshard.runtime.attention.visible_keys import key_fetch
from autoshard.testing import run_on_ranks

TOLERANCE = 1e-10
"""float64: max error over max |reference|."""
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
PATTERNS = {
    "short": lambda s, w: [1, 2, 3, 4, 5] * s,  # every document shorter than a rank's share
    "spanning": lambda s, w: [2, s - 5, 3],  # one document on every rank
    "padding": lambda s, w: [7, 11] * s,  # documents, and a key mask (left padding, holes)
    "window": lambda s, w: [s // 3, s // 2, s],  # documents under a sliding window
    "uneven": lambda s, w: [s - 6 * w] + [1] * (6 * w),  # one long document, then crumbs: the dispatch moves queries
    "aligned": lambda s, w: [n for share in split_sizes(s, w) for n in (share // 2, share - share // 2)],  # whole on
    # their rank of the contiguous layout: no key moves
}


def _strategies(world: int) -> list[tuple[str, str]]:
    out = [("ring", "contiguous"), ("zigzag", "zigzag"), ("allgather", "contiguous"), ("allgather", "zigzag"),
           ("ulysses", "contiguous")]
    return out + ([("hybrid", "zigzag")] if world == 4 else [])


def _cases(world: int) -> list[dict]:
    length = 64 * world + 3 if world == 4 else 16 * world + 1
    return [dict(strategy=s, layout=lay, pattern=p, length=length, seed=n, world=world)
            for n, ((s, lay), p) in enumerate((sl, p) for sl in _strategies(world) for p in PATTERNS
                                               if p != "uneven" or world == 4)]


def _segments(case: dict) -> torch.Tensor:
    S = case["length"]
    lengths, total = [], 0
    for n in PATTERNS[case["pattern"]](S, case["world"]):
        n = min(n, S - total)
        if n <= 0:
            break
        lengths.append(n)
        total += n
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    if case["pattern"] == "aligned":
        return torch.stack([ids, ids + 100])  # batch 2, the same documents
    return torch.stack([ids, ids.flip(0).neg()])  # batch 2: the second row's documents fall elsewhere


def _inputs(case: dict):
    g = torch.Generator().manual_seed(case["seed"])
    S = case["length"]
    q, k, v, dout = (torch.randn(2, h, S, HEAD_DIM, generator=g, dtype=torch.float64)
                     for h in (HEADS, KV_HEADS, KV_HEADS, HEADS))
    key_mask = None
    if case["pattern"] == "padding":
        key_mask = torch.rand(2, S, generator=g) > 0.2
        key_mask[:, 0] = True
        key_mask[0, :5] = False
    return q, k, v, dout, key_mask, _segments(case)


def _spec(case: dict) -> MaskSpec:
    return MaskSpec.of(True, (9, 0) if case["pattern"] == "window" else None)


def _visible(case: dict, key_mask, segments) -> torch.Tensor:
    """[B, 1, S, S] dense visibility."""
    S, spec = case["length"], _spec(case)
    mask = spec.visible(0, S, 0, S)[None, None] & (segments[:, None, :, None] == segments[:, None, None, :])
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :]
    return mask


def _reference(case: dict):
    q, k, v, dout, key_mask, segments = _inputs(case)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = _visible(case, key_mask, segments)
    group = HEADS // KV_HEADS
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(HEAD_DIM)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    out = probs @ v.repeat_interleave(group, 1)
    out.backward(dout)
    pairs = int(_visible(case, None, segments).sum()) * HEADS  # pairs x query heads (a key mask skips no work)
    flops = pairs * (4 * HEAD_DIM + 10 * HEAD_DIM)  # forward 2D + 2Dv, backward 6D + 4Dv per pair and head
    return out.detach(), q.grad, k.grad, v.grad, flops


def _run_case(case: dict, mesh) -> dict:
    q, k, v, dout, key_mask, segments = _inputs(case)
    world, rank = dist.get_world_size(), dist.get_rank()
    if case["strategy"] == "hybrid":
        from autoshard.runtime.attention import hybrid_layout, hybrid_sequence_rank

        layout, seq_rank, group = hybrid_layout(mesh, case["length"], "zigzag"), hybrid_sequence_rank(mesh), mesh
    else:
        layout, seq_rank, group = SequenceLayout.of(case["layout"], case["length"], world), rank, None
    pos = layout.positions(seq_rank)
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    spec = _spec(case)
    with attention_flops() as flops, comm_counter() as comm:
        out = attention(ql, kl, vl, group=group, strategy=case["strategy"], layout=case["layout"],
                        key_mask=None if key_mask is None else key_mask[:, pos], segment_ids=segments[:, pos],
                        seq_len=case["length"], causal=spec.causal, window=spec.window_arg)
        out.backward(dout[:, :, pos])
    return dict(pos=pos, out=out.detach(), dq=ql.grad, dk=kl.grad, dv=vl.grad, flops=flops.total,
                dispatch=comm.dispatch_bytes_sent, key_fetch=comm.key_fetch_bytes_sent,
                gathered=comm.calls["all_gather"].bytes_sent if "all_gather" in comm.calls else 0)


def _run(cases: list[dict]) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses")) if dist.get_world_size() == 4 else None
    return [_run_case(case, mesh) for case in cases]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"P{w}")
def runs(request):
    world = request.param
    cases = _cases(world)
    return world, cases, run_on_ranks(_run, world, cases, timeout=600)


def test_packed_documents_exact_and_only_documents_computed(runs):
    world, cases, results = runs
    for n, case in enumerate(cases):
        out, dq, dk, dv, flops = _reference(case)
        for rank in range(world):
            r = results[rank][n]
            for name, got, want in (("out", r["out"], out), ("dq", r["dq"], dq), ("dk", r["dk"], dk),
                                    ("dv", r["dv"], dv)):
                want = want[:, :, r["pos"]]
                error = ((got - want).abs().max() / want.abs().max()).item()
                assert error < TOLERANCE, (case, rank, name, error)
        assert sum(results[rank][n]["flops"] for rank in range(world)) == flops, case


def test_the_dispatch_moves_queries_only_when_the_documents_fall_unevenly(runs):
    """The all-gather's dispatch is computed identically on every rank from the gathered ids: it sends nothing
    when the layout is already balanced and moves queries (bytes counted as ``"dispatch"``) when it is not."""
    world, cases, results = runs
    for n, case in enumerate(cases):
        if case["strategy"] != "allgather":
            continue
        layout = SequenceLayout.of(case["layout"], case["length"], world)
        moves = balance(layout, _segments(case), _spec(case)).moves
        sent = [results[rank][n]["dispatch"] for rank in range(world)]
        assert (sum(sent) > 0) == moves, (case, sent)
    if world == 4:
        assert any(balance(SequenceLayout.of(c["layout"], c["length"], 4), _segments(c), _spec(c)).moves
                   for c in cases if c["pattern"] == "uneven")


def test_the_all_gather_fetches_only_the_keys_its_queries_see(runs):
    """With packed documents the all-gather strategy fetches, per rank, only the key rows visible to the queries it
    computes (:mod:`~autoshard.runtime.attention.visible_keys`): the bytes counted are exactly those rows' K and V
    (forward, again in the backward) and their dK, dV back (float64); documents that sit whole on their ranks send
    no key, and only the segment ids (and a key mask) are all-gathered."""
    world, cases, results = runs
    row = 2 * KV_HEADS * HEAD_DIM * 8  # bytes of one key row of the batch: 2 rows x kv heads x head dim, float64
    key_bytes_total = 0
    for n, case in enumerate(cases):
        if case["strategy"] != "allgather":
            continue
        layout, ids, spec = SequenceLayout.of(case["layout"], case["length"], world), _segments(case), _spec(case)
        fetch = key_fetch(layout, ids, spec, balance(layout, ids, spec))
        for rank in range(world):
            key_bytes = results[rank][n]["key_fetch"]
            if not fetch.worth_it:
                assert key_bytes == 0, (case, rank, key_bytes)
                continue
            rows_out = sum(fetch.sent_sizes(rank)) - fetch.sent_sizes(rank)[rank]
            rows_received = sum(fetch.received_sizes(rank)) - fetch.received_sizes(rank)[rank]
            assert key_bytes == row * (2 * 2 * rows_out + 2 * rows_received), (case, rank, key_bytes, rows_out,
                                                                                rows_received)
            ids_bytes = 2 * layout.max_local_length * 8 * (world - 1) * 2  # int64 ids (padded), forward and backward
            assert results[rank][n]["gathered"] <= ids_bytes * (2 if case["pattern"] == "padding" else 1), case
            key_bytes_total += key_bytes
        if case["pattern"] == "aligned" and case["layout"] == "contiguous":
            assert fetch.worth_it and fetch.rows == (0,) * world, fetch.rows
            assert all(results[rank][n]["key_fetch"] == 0 for rank in range(world)), case
    assert key_bytes_total > 0
