"""Which kernel the blocks of a training step run on the CPU: torch's fused flash kernel, never the tiled path.

The issue-22 profile of a slow step showed the local attention's backward on the tiled torch path (``bmm``,
``exp_``, ``masked_fill_``). This counts, on every rank of a compiled transformers Llama step at P=2 (every strategy
the cost model may pick here, a causal row and a row of packed documents), the blocks
:func:`~autoshard.runtime.attention.local.local_attention` sends to the fused kernel and to the tiled path: every
block, forward and backward, must be fused (packed documents: one fused call per document rectangle).
"""

import pytest
import torch

import autoshard
from autoshard.runtime.attention import local
from autoshard.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

SEQ = 515


def _rank(strategy: str, packed: bool) -> dict:
    counts = {"fused": 0, "tiled": 0}

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            counts[kind] += 1
            return fn(*args, **kwargs)
        return wrapper

    saved = {name: getattr(local, name) for name in ("_fused_forward", "_fused_backward", "_tiled_forward",
                                                     "_tiled_backward")}
    for name, fn in saved.items():
        setattr(local, name, counted("fused" if "fused" in name else "tiled", fn))
    try:
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                       max_position_embeddings=1024)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(1))
        extra = {"position_ids": torch.cat([torch.arange(200), torch.arange(SEQ - 200)])[None]} if packed else {}
        autoshard.compile(model, strategy=strategy)(input_ids=ids, labels=ids, use_cache=False, **extra).loss.backward()
    finally:
        for name, fn in saved.items():
            setattr(local, name, fn)
    return counts


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("strategy", ["allgather", "ulysses", "zigzag"])
def test_every_block_of_a_step_runs_the_fused_kernel(strategy, packed):
    for counts in run_on_ranks(_rank, 2, strategy, packed, timeout=300):
        assert counts["tiled"] == 0 and counts["fused"] > 0, counts
