"""transformers' Trainer and TRL's SFTTrainer with sequence parallelism (``autoshard.integrations.transformers``).

The runs are ``examples/hf_trainer.py --check``: torchrun starts 2 CPU ranks as one sequence-parallel group (4 as
(dp=2, sp=2) in the slow tier, SFTTrainer's too), each trains a float64
transformers Llama for three steps of two micro-batches (DDP over all ranks, checkpoint at step 2, a second trainer
resumes from it), and the launcher then trains the same model with the plain trainer on one process on the same
global batches. Asserted there (the example exits non-zero otherwise): every logged loss equal to one process's
(float32 -- transformers computes the loss from float32 logits: 1e-6 relative), every final parameter (as
``save_model`` wrote it, loaded by ``from_pretrained``: 1e-8 relative; SFTTrainer 1e-6, since plain DDP SFTTrainer
itself differs from one process by 2.3e-7 in float64), the resumed run ending where the uninterrupted one did, every
attention distributed, no fallback, no compilation per sequence length. Data:
``DataCollatorWithFlattening``'s rows of varying lengths (documents restarting ``position_ids``); in the slow tier also
rows of a fixed length, rows of one length packed with documents, and SFTTrainer's own ``packing=True`` (padding-free,
rows of varying lengths).

Bad input fails before the first step on every rank, with the fix: an sp size that does not divide the world, and
a data loader accelerate does not shard with a batch sampler.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autoshard.testing import RankFailure, run_on_ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]


def _example(*flags: str) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--check", *flags], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    kinds = 1 if "--sft" in flags else len(flags[flags.index("--data") + 1].split(",")) if "--data" in flags else 3
    assert result.stdout.count("], 0 fallback(s)") == kinds, result.stdout[-4000:]


def test_trainer_matches_one_process_on_flattened_rows():
    # one sequence-parallel group of both ranks; padding-free rows, each micro-batch a new length (rows of one
    # length, which every other e2e test trains on, go through the Trainer in the slow tier's run)
    _example("--nproc", "2", "--data", "flatten")


@pytest.mark.slow
def test_trainer_on_data_parallel_groups_matches_one_process():
    _example()  # 4 ranks: 2 data-parallel groups of 2 sequence-parallel ranks; rows packed with documents too


@pytest.mark.slow
def test_sft_trainer_with_packing_matches_one_process():
    pytest.importorskip("trl")
    _example("--sft")


def _bad_trainer(case: str) -> str:
    rank = str(dist.get_rank())
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_WORLD_SIZE=str(dist.get_world_size()))
    sys.path.insert(0, str(ROOT / "examples"))
    import hf_trainer

    from autoshard.integrations.transformers import SequenceParallelTrainer

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(hf_trainer.dataset("fixed"))

    args = transformers.TrainingArguments(output_dir=f"/tmp/autoshard_bad_{case}", use_cpu=True, ddp_backend="gloo",
                                          report_to=[], max_steps=1, per_device_train_batch_size=1)
    try:
        trainer = SequenceParallelTrainer(model=hf_trainer.model(), args=args, sp_size=3 if case == "sp_size" else 2,
                                          train_dataset=Stream() if case == "iterable" else hf_trainer.dataset("fixed"))
        trainer.get_train_dataloader()
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("case", ["sp_size", "iterable"])
def test_bad_configuration_fails_on_every_rank_before_the_first_step(case):
    try:
        messages = run_on_ranks(_bad_trainer, 2, case, timeout=120)
    except RankFailure as failure:
        pytest.fail(str(failure))
    expected = "must be a positive divisor of the world size 2" if case == "sp_size" else "cannot shard it"
    assert all(expected in m for m in messages), messages
