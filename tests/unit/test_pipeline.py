"""The pass pipeline: a graph is classified once into the kind that says how it is compiled; passes run in the
listed order, each counted, and AUTOSHARD_DUMP writes what each produced (planned on a fake world: no process
group)."""

import torch
import torch.nn.functional as F

import autoshard
from autoshard.testing.models import HandwrittenLM, LlamaLM
from autoshard.passes.pipeline import PASSES, DynamoGraph, graph_kind
from autoshard.passes.static_cache import StaticPrefill


def _kind(fn, *inputs, dynamic=False, specialized=False, **graph):
    """The kind of dynamo's graph of ``fn`` (with ``graph``: the :class:`DynamoGraph` fields beyond the graph)."""
    kinds = []

    def backend(gm, example_inputs):
        kinds.append(graph_kind(DynamoGraph(gm=gm, example_inputs=example_inputs, **graph), specialized=specialized))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*inputs)
    (kind,) = kinds
    return kind


def _doubled(x):
    return x * 2


def _prefill(start, k, q):  # into a fixed-size cache made on first use (transformers' StaticCache)
    keys = torch.zeros(1, 2, 8, 4)
    keys.index_copy_(2, torch.arange(4) + start, k)
    return F.scaled_dot_product_attention(q, keys[:, :, :4], keys[:, :, :4], is_causal=True), keys


def _masked(q, mask):
    return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_a_graph_is_of_the_first_kind_whose_front_pass_applies():
    x = torch.randn(4, 3)
    kind = _kind(_doubled, x)
    assert (kind.name, kind.found) == ("plain", True)
    assert _kind(_doubled, x, dry_run=True).name == "dry_run"
    assert _kind(_doubled, x, dry_run=True, specialized=True).name == "plain"  # a dynamic graph's copy: no dry run
    assert _kind(_doubled, x, dynamic=True).name == "dynamic"
    prefill = (torch.tensor([0]), torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4))
    with torch.no_grad():
        kind = _kind(_prefill, *prefill)
    assert kind.name == "static_prefill" and isinstance(kind.found, StaticPrefill)
    assert _kind(_prefill, *prefill).name == "plain"  # a training step keeps its buffers
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    kind = _kind(_masked, torch.randn(1, 2, 4, 4), mask)
    assert (kind.name, kind.found) == ("dense_masks", (1,))


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
    assert files["outline"].startswith("# outline: {'outlined': 0, 'offloaded': 0, 'rebuilt': 0}")


def test_handwritten_attention_is_captured_and_counted(tmp_path, monkeypatch):
    ids = torch.randint(0, 256, (1, 12))
    files = _dumped(tmp_path, monkeypatch, HandwrittenLM(), (ids,))
    assert files["capture"].startswith("# capture: {'attention': 2,")
