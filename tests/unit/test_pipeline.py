"""The pass pipeline: passes run in the listed order, each counted, and AUTOSHARD_DUMP writes what each
produced (planned on a fake world: no process group)."""

import torch

import autoshard
from autoshard.testing.models import HandwrittenLM, LlamaLM
from autoshard.passes.pipeline import PASSES


def _dumped(tmp_path, monkeypatch, model, inputs):
    """The dumps of the last compile: pass name -> text (the files are numbered in pass order)."""
    monkeypatch.setenv("AUTOSHARD_DUMP", str(tmp_path))
    torch._dynamo.reset()
    autoshard.plan(model, inputs, world_size=2, strategy="ring")
    (folder,) = sorted(tmp_path.iterdir())[-1:]
    names = [p.name for p in sorted(folder.iterdir())]
    assert names == [f"{i:02d}-{name}.txt" for i, (name, _, _) in enumerate(PASSES)]
    return {name.split("-", 1)[1].removesuffix(".txt"): (folder / name).read_text() for name in names}


def test_every_pass_runs_in_order_counts_and_dumps(tmp_path, monkeypatch):
    ids = torch.randint(0, 256, (1, 12))
    files = _dumped(tmp_path, monkeypatch, LlamaLM(), (ids, ids))
    capture = files["capture"]
    assert capture.startswith("# capture: {'attention': 2, 'dense_masks': 0, 'missed': 0,")
    assert "captured_attention" in capture
    assert files["inline"].startswith("# inline: {'checkpointed': 0, 'nodes_added': 0}")
    assert files["functionalize"].startswith("# functionalize: {'functionalized': 0, 'kept_in_place': 0}")
    assert files["recompute"].startswith("# recompute: {'recomputed_layers': 0,")
    assert files["families"].count("family ") == 1
    assert files["strategy"].count(": ring (") == 2
    assert "autoshard.attention" in files["rewrite"] and "captured_attention" not in files["rewrite"]
    assert files["tile"].startswith("# tile: {'tiled_regions': 0, 'untiled_regions': 0, 'tiles': 0, 'chunked_mlps': 0, "
                                    "'unchunked_mlps': 2, 'mlp_chunks': 0}")
    assert files["outline"].startswith("# outline: {'outlined': 0, 'offloaded': 0}")


def test_handwritten_attention_is_captured_and_counted(tmp_path, monkeypatch):
    ids = torch.randint(0, 256, (1, 12))
    files = _dumped(tmp_path, monkeypatch, HandwrittenLM(), (ids,))
    assert files["capture"].startswith("# capture: {'attention': 2,")
