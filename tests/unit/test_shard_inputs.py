"""``autoshard.shard_inputs``: the inputs it splits are the ones named (or every tensor), and a named input
without the sequence is an error -- a size that happens to match is never taken for a sequence."""

import pytest
import torch

import autoshard
from autoshard.runtime import shard_sequence
from autoshard.testing import run_on_ranks


def _batch():
    torch.manual_seed(0)
    return {"input_ids": torch.randint(0, 9, (2, 6)), "labels": torch.randint(0, 9, (2, 6)),
            "pixel_values": torch.randn(2, 6, 5), "num_items": 12}


def _split(names):
    batch = _batch()
    got = autoshard.shard_inputs(batch, names)
    expect = {k: (shard_sequence(batch[k], 1) if k in (names or ("input_ids", "labels", "pixel_values")) else batch[k])
              for k in batch}
    as_tuple = autoshard.shard_inputs((batch["input_ids"], batch["pixel_values"]), [0])
    return ({k: (torch.equal(got[k], expect[k]) if isinstance(got[k], torch.Tensor) else got[k] == expect[k])
             for k in batch}, torch.equal(as_tuple[0], expect["input_ids"]), as_tuple[1] is batch["pixel_values"])


def _both():
    return {names: _split(list(names) if names else None) for names in ((), ("input_ids", "labels"))}


def test_only_the_named_inputs_are_split():
    for results in run_on_ranks(_both, 2):
        for names, (same, tuple_split, tuple_kept) in results.items():
            assert all(same.values()), (names, same)
            assert tuple_split and tuple_kept


def test_inputs_without_the_sequence_are_refused_before_any_communication():
    batch = _batch()
    with pytest.raises(KeyError, match="no input named 'mask'"):
        autoshard.shard_inputs(batch, ["input_ids", "mask"])
    batch["pixel_values"] = torch.randn(2, 3, 5)  # every tensor, but this one has no sequence along dim 1
    with pytest.raises(ValueError, match="'pixel_values' is \\(2, 3, 5\\)"):
        autoshard.shard_inputs(batch)
    with pytest.raises(ValueError, match="'num_items' is int"):
        autoshard.shard_inputs(batch, ["input_ids", "num_items"])
