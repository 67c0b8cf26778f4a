"""The pass pipeline: passes run in the listed order, each counted, and AUTOSHARD_DUMP writes what each
produced (planned on a fake world: no process group)."""

import torch

import autoshard
from autoshard.models import HandwrittenLM, LlamaLM
from autoshard.passes.pipeline import PASSES


def _dumped(tmp_path, monkeypatch, model, inputs):
    monkeypatch.setenv("AUTOSHARD_DUMP", str(tmp_path))
    torch._dynamo.reset()
    autoshard.plan(model, inputs, world_size=2, strategy="ring")
    (folder,) = sorted(tmp_path.iterdir())[-1:]
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def test_every_pass_runs_in_order_counts_and_dumps(tmp_path, monkeypatch):
    ids = torch.randint(0, 256, (1, 12))
    files = _dumped(tmp_path, monkeypatch, LlamaLM(), (ids, ids))
    assert list(files) == [f"{i:02d}-{name}.txt" for i, (name, _, _) in enumerate(PASSES)]
    capture = files["03-capture.txt"]
    assert capture.startswith("# capture: {'attention': 2, 'dense_masks': 0, 'missed': 0,")
    assert "captured_attention" in capture
    assert files["00-inline.txt"].startswith("# inline: {'checkpointed': 0, 'nodes_added': 0}")
    assert files["02-functionalize.txt"].startswith("# functionalize: {'functionalized': 0, 'kept_in_place': 0}")
    assert files["07-families.txt"].count("family ") == 1
    assert files["08-strategy.txt"].count(": ring (") == 2
    assert "autoshard.attention" in files["09-rewrite.txt"] and "captured_attention" not in files["09-rewrite.txt"]
    assert files["10-outline.txt"].startswith("# outline: {'outlined': 0}")


def test_handwritten_attention_is_captured_and_counted(tmp_path, monkeypatch):
    ids = torch.randint(0, 256, (1, 12))
    files = _dumped(tmp_path, monkeypatch, HandwrittenLM(), (ids,))
    assert files["03-capture.txt"].startswith("# capture: {'attention': 2,")
