"""Convolutions along the sequence, split with halos, against one process.

* an audio encoder in Whisper's shape: ``conv1d(k=3, padding 1) -> gelu -> conv1d(k=3, stride 2, padding 1)``
  over features ``[B, C, T]``, transposed to ``[B, T', D]``, plus learned positions (an embedding of
  ``arange``), then bidirectional attention layers. ``T = 123``: the strided output (62 positions) is not a
  multiple of the ranks. Both convolutions are split (the input's length is a family of its own, its layout
  chosen independently; each rank fetches the halos its output positions read), the attention is the ring,
  nothing is gathered, no S x S value exists, and every byte moved is booked.
* rule cases: strides 1/2/3 x paddings 0/1/2, and a dilated, grouped, strided one, on an odd length, each
  over the split output of an attention layer (one model, a branch per case; a strided output is a family of
  its own, the stride-2 one feeds attention again): its output and its parameters' gradients exact; contiguous
  layouts at P=2, zigzag ones at P=4 (two windows per rank).
* unsupported: a 2-d convolution over ``[B, 1, S, D]`` (a branch of the same model) mixes the split sequence with
  another dim: it gathers it and says so (a fallback).
* tokens convolved as an image inside a block (a ``5 x 7`` grid of 35 tokens, so a rank's tokens end inside a row):
  Sana's Mix-FFN (``unflatten(1, (H, W)).permute``, 1 x 1, 3 x 3 depth-wise, a chunked gate, 1 x 1, ``flatten``)
  and SegFormer's ``DWConv`` (``transpose(1, 2).view(B, C, H, W)``, a dilated 5 x 3 kernel) between attention
  layers: nothing gathered, each 2-d convolution fetching the rows around a rank's tokens (a halo forward and
  back), the 1 x 1 ones none.

float64, 1e-9 relative. One launch per world size (P=2 and P=4).
"""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.runtime import comm_counter
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

FEATURES, HIDDEN, HEADS, FRAMES = 16, 32, 4, 123
RULE_LENGTH = 37
GRID = (5, 7)
RULE_CASES = [(stride, padding) for stride in (1, 2, 3) for padding in (0, 1, 2)]
GRID_LAYOUT = {2: "contiguous", 4: "zigzag"}
"""The rule cases' layout by world size: at P=4 every rank holds two intervals, so reads two windows."""


class Layer(nn.Module):
    """A pre-norm bidirectional attention block."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, h):
        b, s, d = h.shape
        q, k, v = self.qkv(self.norm(h)).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)
        return h + self.out(o.transpose(1, 2).reshape(b, s, d))


class AudioEncoder(nn.Module):
    """Whisper's encoder front end and two attention layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(FEATURES, HIDDEN, 3, padding=1)
        self.conv2 = nn.Conv1d(HIDDEN, HIDDEN, 3, stride=2, padding=1)
        self.positions = nn.Embedding(64, HIDDEN)
        self.layers = nn.ModuleList(Layer(HIDDEN) for _ in range(2))
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, features):
        h = F.gelu(self.conv1(features))
        h = F.gelu(self.conv2(h)).transpose(1, 2)
        h = h + self.positions(torch.arange(h.shape[1], device=h.device))
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class ConvGrid(nn.Module):
    """Attention, then one convolution per rule case over its output (a split input), each output returned; the
    ``(2, 1)`` branch feeds attention again. A 2-d convolution over ``[B, 1, S, D]`` is not split: it gathers the
    sequence and says so."""

    def __init__(self):
        super().__init__()
        self.first, self.second = Layer(8), Layer(8)
        self.convs = nn.ModuleList(nn.Conv1d(8, 8, 3, stride=s, padding=p) for s, p in RULE_CASES)
        self.dilated = nn.Conv1d(8, 8, 3, stride=2, padding=1, dilation=2, groups=2, bias=False)
        self.conv2d = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x):
        tokens = self.first(x)
        h = tokens.transpose(1, 2)
        outs = [conv(h) for conv in self.convs]
        outs[RULE_CASES.index((2, 1))] = self.second(outs[RULE_CASES.index((2, 1))].transpose(1, 2))
        return (*outs, self.dilated(h), self.conv2d(tokens.unsqueeze(1)))


class MixFFN(nn.Module):
    """Attention, Sana's Mix-FFN, SegFormer's depth-wise convolution, attention: the tokens a ``GRID`` image."""

    def __init__(self):
        super().__init__()
        self.attend_in, self.attend_out = Layer(8), Layer(8)
        self.inverted, self.point = nn.Conv2d(8, 32, 1), nn.Conv2d(16, 8, 1, bias=False)
        self.depth = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.dw = nn.Conv2d(8, 8, (5, 3), padding=(4, 1), dilation=(2, 1), groups=8)

    def forward(self, x):
        h = self.attend_in(x)
        b, _, c = h.shape
        image, gate = self.depth(F.silu(self.inverted(h.unflatten(1, GRID).permute(0, 3, 1, 2)))).chunk(2, dim=1)
        h = h + self.point(image * F.silu(gate)).flatten(2, 3).permute(0, 2, 1)
        h = h + self.dw(h.transpose(1, 2).view(b, c, *GRID)).flatten(2).transpose(1, 2)
        return self.attend_out(h)


def _summary(r) -> dict:
    return {"error": r.max_error(), "summary": r.summary(), "fallbacks": r.fallbacks, "attention": r.attention,
            "squares": [v for rep in r.compiled_reports for v in rep.square_values],
            "placements": {k: v for rep in r.compiled_reports for k, v in rep.placements.items()}}


def _run(world: int) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    results = {}
    cases = {"encoder": (AudioEncoder, (2, FEATURES, FRAMES), {"strategy": "ring"}),
             "grid": (ConvGrid, (2, RULE_LENGTH, 8), {"layout": GRID_LAYOUT[world]}),
             "mixffn": (MixFFN, (2, GRID[0] * GRID[1], 8), {"layout": GRID_LAYOUT[world]})}
    for name, (model, shape, options) in cases.items():
        torch._dynamo.reset()
        with comm_counter() as sent:  # outputs gathered in the graph: every byte the comparison moves is booked
            r = compare_with_one_process(model, lambda: (torch.randn(shape),), dtype=torch.float64,
                                         outputs="gathered", **options)
        results[name] = _summary(r) | {
            "outputs": r.outputs, "grads": r.grads, "measured": sent.payload_bytes_sent,
            "booked": sum(c.bytes_by_rank[rank] for rep in r.compiled_reports for c in rep.comms),
            "halos": [c.phase for rep in r.compiled_reports for c in rep.comms if c.kind == "halo_exchange"],
            "transitions": r.transitions}
    return results


@functools.cache
def _results(world: int) -> list[dict]:
    return run_on_ranks(_run, world, world, timeout=300)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_audio_encoder_front_end_is_split(world):
    for rank, results in enumerate(_results(world)):
        r = results["encoder"]
        where = f"audio encoder T={FRAMES} P={world} rank {rank}"
        assert r["error"] <= 1e-9, f"{where}: {r['summary']}"
        assert r["fallbacks"] == [], f"{where}: {r['fallbacks']}"
        assert r["squares"] == [], f"{where}: S x S values {r['squares']}"
        assert len(r["attention"]) == 2 and all(a["strategy"] == "ring" for a in r["attention"]), \
            f"{where}: {r['attention']}"
        convs = {n: p for n, p in r["placements"].items() if n.startswith("conv1d")}
        assert len(convs) == 2 and all(p == "S(2)" for p in convs.values()), f"{where}: {r['placements']}"
        assert r["halos"] == ["forward", "backward"], f"{where}: {r['halos']}"  # the strided conv's; the first slices
        assert r["booked"] == r["measured"], f"{where}: booked {r['booked']} bytes, measured {r['measured']}"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", [*RULE_CASES, "dilated"], ids=[*map(str, RULE_CASES), "dilated"])
def test_convolution_over_a_split_sequence(world, case):
    index = len(RULE_CASES) if case == "dilated" else RULE_CASES.index(case)
    module = "dilated" if case == "dilated" else f"convs.{index}"
    for rank, results in enumerate(_results(world)):
        r = results["grid"]
        where = f"conv {case} S={RULE_LENGTH} P={world} rank {rank}"
        errors = [r["outputs"][f"out[{index}]"]] + [e for n, e in r["grads"].items() if n.startswith(module + ".")]
        assert len(errors) > 1 and max(errors) <= 1e-9, f"{where}: {r['summary']}"
        assert len(r["fallbacks"]) == 1 and "2-d convolution" in r["fallbacks"][0], f"{where}: {r['fallbacks']}"
        assert r["booked"] == r["measured"], f"{where}: booked {r['booked']} bytes, measured {r['measured']}"
        convs = [p for n, p in r["placements"].items() if n.startswith("conv1d")]
        assert len(convs) == len(RULE_CASES) + 1 and convs[index] == "S(2)", f"{where}: {r['placements']}"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_unsupported_convolution_is_a_fallback(world):
    for rank, results in enumerate(_results(world)):
        r = results["grid"]
        where = f"conv2d over the split sequence P={world} rank {rank}"
        output = r["outputs"][f"out[{len(RULE_CASES) + 1}]"]
        errors = [output] + [e for n, e in r["grads"].items() if n.startswith("conv2d.")]
        assert len(errors) == 3 and max(errors) <= 1e-9, f"{where}: {r['summary']}"
        assert len(r["fallbacks"]) == 1 and "2-d convolution" in r["fallbacks"][0], f"{where}: {r['fallbacks']}"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tokens_convolved_as_an_image_stay_split(world):
    for rank, results in enumerate(_results(world)):
        r = results["mixffn"]
        where = f"Mix-FFN and DWConv on a {GRID} grid, P={world} ({GRID_LAYOUT[world]}) rank {rank}"
        assert r["error"] <= 1e-9, f"{where}: {r['summary']}"
        assert r["fallbacks"] == [] and r["squares"] == [], f"{where}: {r['fallbacks']} {r['squares']}"
        gathers = [t for t in r["transitions"] if t.startswith("all_gather")]
        assert gathers == ["all_gather add_3 S(1)->R"], f"{where}: {gathers}"  # the output, gathered to compare
        assert sorted(r["halos"]) == ["backward", "backward", "forward", "forward"], f"{where}: {r['halos']}"
        assert r["booked"] == r["measured"], f"{where}: booked {r['booked']} bytes, measured {r['measured']}"
