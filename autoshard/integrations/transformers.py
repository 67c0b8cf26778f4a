"""Sequence parallelism in transformers' ``Trainer`` (and TRL's ``SFTTrainer``): one argument, ``sp_size``.

    from autoshard.integrations.transformers import SequenceParallelTrainer
    trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=data, sp_size=2)
    trainer.train()                     # torchrun --nproc-per-node 4 train.py: dp = 2 x sp = 2

    SFTTrainer = sequence_parallel(trl.SFTTrainer)   # any Trainer subclass

The ranks form a ``(dp, sp)`` mesh (``world = dp x sp``, consecutive ranks share an ``sp`` group). What changes:

* **The data.** ``Trainer`` gives every rank its own batches (accelerate shards the batch sampler over all
  ranks). Sequence parallelism needs every rank of an ``sp`` group to see the same batch: the prepared data
  loaders are sharded over the ``dp`` groups instead (``BatchSamplerShard`` over ``dp`` processes, at the rank's
  ``dp`` index). Every rank then feeds the compiled model the whole sequence (``inputs="replicated"``), so
  nothing about batches, collators, packing or ``position_ids`` changes -- why the sampler and not
  ``inputs="sharded"``: sharding the batches would need every collator's outputs to be told apart (what has the
  sequence, what does not), which the compiled graph already knows. A loader accelerate does not shard with a
  batch sampler (an iterable dataset, ``dispatch_batches``) is an error at its creation, on every rank.
* **The model.** It is compiled in place (as ``nn.Module.compile`` does) with autoshard over ``mesh["sp"]`` with
  ``grad_sync=False`` (each rank holds
  ``sp`` times its share of the gradients) and the ``Trainer`` wraps it as it chooses -- DDP, or FSDP through
  accelerate -- over all ranks: their average over the ``dp x sp`` ranks is the gradient of the global batch, and no
  gradient is reduced twice. Anything else that would sum gradients (DeepSpeed) is refused before the first step.
* **The loss.** Unchanged: every rank of an ``sp`` group computes the loss of the whole sequence, so ``Trainer``'s
  ``num_items_in_batch`` (counted over all ranks, each ``sp`` group's tokens ``sp`` times) and its scaling of the
  loss by the number of processes cancel exactly, gradient accumulation included, and the logged loss (a mean
  over all ranks) is the global batch's.

Checkpoints are ``Trainer``'s own: the model object is the user's (compiled in place), so its state dict, what
``save_model`` writes and what resuming loads are the usual ones. ``autoshard.explain(trainer)`` reports how every
graph's attention ran.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import autoshard

__all__ = ["sequence_parallel", "SequenceParallelTrainer"]


class _SequenceParallel:
    """The mixin :func:`sequence_parallel` puts before a ``Trainer`` class."""

    def __init__(self, *args, sp_size: int, autoshard_options: dict[str, Any] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        world = self.args.world_size
        if not isinstance(sp_size, int) or sp_size < 1 or world % sp_size:
            raise ValueError(f"autoshard: sp_size={sp_size!r} must be a positive divisor of the world size {world} "
                             f"(the ranks form a (dp, sp) = ({world} / sp_size, sp_size) mesh)")
        if world > 1 and not dist.is_initialized():
            raise RuntimeError("autoshard: the Trainer did not start torch.distributed; launch with torchrun")
        self.sp_size = sp_size
        self.dp_size = world // sp_size
        self.dp_rank = self.args.process_index // sp_size
        from torch.distributed.device_mesh import init_device_mesh

        device = self.args.device.type
        self.mesh = init_device_mesh(device, (self.dp_size, sp_size), mesh_dim_names=("dp", "sp"))
        options = {"grad_sync": False, **(autoshard_options or {})}
        # Compiled in place, as nn.Module.compile does: the Trainer's model stays the model (its forward's signature
        # picks the dataset's columns, its state dict is what checkpoints save and load, unwrapping finds it).
        call = autoshard.compile(self.model._call_impl, self.mesh["sp"], **options)
        self.model._compiled_call_impl = call
        self.autoshard_backend = call.autoshard_backend  # autoshard.explain(trainer)

    def _get_dataloader(self, *args, **kwargs):
        loader = super()._get_dataloader(*args, **kwargs)
        shard = getattr(loader, "batch_sampler", None)
        if self.dp_size * self.sp_size == 1:
            return loader
        if type(shard).__name__ != "BatchSamplerShard" or shard.split_batches:
            raise ValueError(f"autoshard: sequence parallelism needs the ranks of an sp group to read the same batches; "
                             f"this data loader ({type(loader).__name__} with {type(shard).__name__}) is not sharded "
                             f"by accelerate's BatchSamplerShard over a map-style dataset, so autoshard cannot shard it "
                             f"over the dp groups instead (use a map-style dataset, without dispatch_batches or "
                             f"split_batches)")
        shard.num_processes, shard.process_index = self.dp_size, self.dp_rank
        return loader

    def _wrap_model(self, model, *args, **kwargs):
        if self.is_deepspeed_enabled:
            raise ValueError("autoshard: sequence parallelism composes with DDP or FSDP (which average gradients over "
                             "the ranks), not with DeepSpeed")
        return super()._wrap_model(model, *args, **kwargs)


def sequence_parallel(trainer_cls: type) -> type:
    """``trainer_cls`` (``transformers.Trainer`` or a subclass, such as TRL's ``SFTTrainer``) with sequence
    parallelism: its ``__init__`` takes ``sp_size`` (the ranks of each sequence-parallel group) and
    ``autoshard_options`` (keyword arguments of :func:`autoshard.compile`, e.g. ``{"recompute": "layers"}``)."""
    return type(f"SequenceParallel{trainer_cls.__name__}", (_SequenceParallel, trainer_cls),
                {"__module__": trainer_cls.__module__, "__doc__": sequence_parallel.__doc__})


def __getattr__(name: str):
    if name == "SequenceParallelTrainer":  # built on first use: importing this module does not import transformers
        from transformers import Trainer

        globals()[name] = sequence_parallel(Trainer)
        return globals()[name]
    raise AttributeError(name)
