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

import pytest
import torch

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.models import LlamaLM

LENGTHS = (40, 41, 37, 53, 64, 4, 45)
"""The first length compiles dynamo's static graph; the second its dynamic one, a class the next ones join (the world
size divides some, not others; 45 after the short one); 4 (one or two tokens per rank, below the zigzag layout's 2P
chunks at 3 and 4 ranks) compiles a class of its own: at a few tokens per rank the pieces' sizes decide branches."""


def _train_at_lengths(lengths, classes: bool):
    torch.manual_seed(0)
    model = LlamaLM().double()
    ref = copy.deepcopy(model)
    backend = autoshard.backend(length_classes=classes)
    compiled = torch.compile(model, backend=backend)
    generator = torch.Generator().manual_seed(1)
    worst = 0.0
    for n in lengths:
        ids = torch.randint(0, 256, (2, n), generator=generator)
        loss = compiled(ids, ids)[0]
        loss.backward()
        expected = ref(ids, ids)[0]
        expected.backward()
        worst = max(worst, (loss - expected).abs().item(),
                    *((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
        model.zero_grad()
        ref.zero_grad()
    strategies = {a["strategy"] for record in backend.compiled for a in record.report.attention}
    return worst, dict(backend.compilations), strategies


@pytest.mark.parametrize("world", [3, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_one_compilation_per_length_class(world):
    for worst, compilations, strategies in run_on_ranks(_train_at_lengths, world, LENGTHS, True, timeout=600):
        assert worst < 1e-12, worst
        assert compilations == {"new graph": 1, "recompiled by dynamo": 1, "new sequence length": 1}, compilations
        assert strategies and not strategies & {"whole", "gathered-kv"}, strategies
