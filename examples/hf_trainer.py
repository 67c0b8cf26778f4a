"""Sequence parallelism in transformers' Trainer (and TRL's SFTTrainer): one argument, ``sp_size``.

    python examples/hf_trainer.py --check                  # launches 4 CPU ranks with torchrun: (dp=2, sp=2)
    torchrun --nproc-per-node 4 examples/hf_trainer.py     # the same, launched by hand
    python examples/hf_trainer.py --sft --check            # TRL's SFTTrainer with packing=True
    python examples/hf_trainer.py --data flatten --check   # Trainer + DataCollatorWithFlattening (padding-free)

What a user writes (``--sft``: ``sequence_parallel(SFTTrainer)`` and an ``SFTConfig``)::

    from autoshard.integrations.transformers import SequenceParallelTrainer
    trainer = SequenceParallelTrainer(model=model, args=TrainingArguments(...), train_dataset=data, sp_size=2)
    trainer.train()

It trains a small transformers Llama (float64, so the comparison is exact to rounding) for three steps of two
micro-batches each on three kinds of data: rows of fixed length, rows packed with documents (``position_ids``
restarting at each), and documents of 8 to 40 tokens that ``DataCollatorWithFlattening`` packs into one row per
micro-batch (``--data flatten``: only these) -- every micro-batch a new length, which the backend serves from one length
class instead of a compilation per length (each kind's compilations are printed). The ranks of each sp group read the same batches and split every sequence; the Trainer wraps
the model in DDP over all four ranks. A checkpoint is saved at step 2 and a second trainer resumes from it.

With ``--check`` the launcher then trains the same model with the plain ``Trainer`` (``SFTTrainer``) on one process,
on the same global batches, and fails unless every logged loss (float32: transformers computes it from float32
logits; ``--loss-tolerance``) and every final parameter (``--tolerance``) equal it, the resumed run ends where the uninterrupted one did, and every attention ran distributed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SEQ, ROWS, VOCAB = 67, 24, 256
"""Tokens per row (neither 2 nor 4 divides it), rows in the dataset, vocabulary."""


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="ranks torchrun starts")
    p.add_argument("--sp", type=int, default=2, help="ranks per sequence-parallel group (dp = nproc / sp)")
    p.add_argument("--sft", action="store_true", help="TRL's SFTTrainer with packing=True instead of Trainer")
    p.add_argument("--data", default="fixed,packed,flatten",
                   help="the kinds of data the Trainer trains on, comma-separated: fixed (rows of one length), packed "
                        "(rows packed with documents), flatten (DataCollatorWithFlattening on documents of varying "
                        "lengths)")
    p.add_argument("--check", action="store_true", help="compare with one-process training afterwards")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest relative parameter difference (--check); default 1e-8, with --sft 1e-6 (TRL casts the "
                        "hidden states to float32 for its LM head)")
    p.add_argument("--loss-tolerance", type=float, default=1e-6,
                   help="largest relative loss difference (--check): transformers computes the loss in float32")
    p.add_argument("--out", default=None, help="where the ranks write checkpoints and results")
    args = p.parse_args(argv)
    if args.tolerance is None:
        args.tolerance = 1e-6 if args.sft else 1e-8
    return args


def model():
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def dataset(kind: str):
    """``fixed``: rows of SEQ tokens; ``packed``: rows of SEQ tokens holding two documents each (positions restart);
    ``sft`` and ``flatten``: documents of 8 to 40 tokens that SFTTrainer or the flattening collator packs."""
    gen = torch.Generator().manual_seed(5)
    if kind in ("sft", "flatten"):
        import datasets

        return datasets.Dataset.from_list([{"input_ids": torch.randint(3, VOCAB, (int(n),), generator=gen).tolist()}
                                           for n in torch.randint(8, 40, (4 * ROWS,), generator=gen)])
    rows = []
    for _ in range(ROWS):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=gen)
        row = {"input_ids": ids, "labels": ids.clone()}
        if kind == "packed":
            cut = int(torch.randint(5, SEQ - 5, (1,), generator=gen))
            row["position_ids"] = torch.cat([torch.arange(cut), torch.arange(SEQ - cut)])
            row["labels"][cut] = -100  # a document's first token is not a target of the one before
        rows.append(row)
    return rows


def tokenizer():
    """A word-level tokenizer with pad and eos (SFTTrainer asks for one; the data is token ids already)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
                                   pad_token="[PAD]", eos_token="[EOS]")


def trainer(kind: str, out: str, batch: int, sp: int | None, **extra):
    """A Trainer (SFTTrainer for ``sft``) of three steps of two micro-batches of ``batch`` rows; with ``sp``, the
    sequence-parallel one."""
    common = {**dict(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=2, max_steps=3,
                     learning_rate=1e-3, logging_steps=1, use_cpu=True, report_to=[], seed=0, disable_tqdm=True,
                     save_strategy="steps", save_steps=2, **({"ddp_backend": "gloo"} if sp else {})), **extra}
    if kind == "sft":
        from trl import SFTConfig, SFTTrainer

        cls, args, more = SFTTrainer, SFTConfig(packing=True, max_length=64, **common), {"processing_class": tokenizer()}
    else:
        from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

        cls, args, more = Trainer, TrainingArguments(**common), {}
        if kind == "flatten":
            more = {"data_collator": DataCollatorWithFlattening()}
    if sp:
        from autoshard.integrations.transformers import sequence_parallel

        cls, more = sequence_parallel(cls), {**more, "sp_size": sp}
    return cls(model=model(), args=args, train_dataset=dataset(kind), **more)


def losses(t) -> list[float]:
    return [h["loss"] for h in t.state.log_history if "loss" in h]


def ranks(args) -> None:
    """One torchrun rank: train each kind, save, resume from step 2, write the results (rank 0)."""
    import autoshard

    root = args.out or os.path.join(tempfile.gettempdir(), "autoshard_hf_trainer")
    results = {}
    for kind in _kinds(args):
        out = os.path.join(root, kind)
        t = trainer(kind, out, _ROWS_PER_MICRO_BATCH[kind], args.sp)
        t.train()
        t.save_model(os.path.join(out, "final"))
        report = autoshard.explain(t)
        resumed = trainer(kind, out, _ROWS_PER_MICRO_BATCH[kind], args.sp)
        resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
        gap = max(((a - b).abs().max() / b.abs().max()).item()
                  for a, b in zip(resumed.model.parameters(), t.model.parameters()))
        attention = [a["strategy"] for r in t.autoshard_backend.compiled for a in r.report.attention]
        fallbacks = [str(f) for r in t.autoshard_backend.compiled for f in r.report.fallbacks]
        results[kind] = {"losses": losses(t), "resumed_gap": gap, "attention": attention, "fallbacks": fallbacks,
                         "compilations": dict(t.autoshard_backend.compilations)}
        if t.args.process_index == 0:
            print(f"[{kind}] losses {losses(t)}\n{report}", flush=True)
    if torch.distributed.get_rank() == 0:
        Path(root, "results.json").write_text(json.dumps(results))
    del t, resumed  # the trainers hold the process group: let destroy_process_group join its threads now
    torch._dynamo.reset()  # and so do the compiled graphs dynamo keeps (their backend holds its groups)
    gc.collect()
    torch.distributed.destroy_process_group()


_ROWS_PER_MICRO_BATCH = {"fixed": 1, "packed": 1, "sft": 1, "flatten": 3}
"""Rows (documents, for ``flatten``) a rank's micro-batch holds; the one-process run takes dp times as many."""


def _kinds(args) -> list[str]:
    kinds = args.data.split(",")
    unknown = set(kinds) - {"fixed", "packed", "flatten"}
    if unknown:
        raise SystemExit(f"--data: unknown kind(s) {sorted(unknown)}; expected fixed, packed, flatten")
    return ["sft"] if args.sft else kinds


def launch(args) -> int:
    """Start the ranks with torchrun; with ``--check``, compare with one process."""
    out = args.out or tempfile.mkdtemp(prefix="autoshard_trainer_")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               __file__, f"--sp={args.sp}", f"--out={out}", f"--data={args.data}"] + (["--sft"] if args.sft else [])
    code = subprocess.run(command).returncode
    if code or not args.check:
        return code
    from transformers import LlamaForCausalLM

    results = json.loads(Path(out, "results.json").read_text())
    failures = []
    for kind, got in results.items():
        reference = trainer(kind, tempfile.mkdtemp(), _ROWS_PER_MICRO_BATCH[kind] * (args.nproc // args.sp), None,
                            save_strategy="no")
        reference.train()
        saved = LlamaForCausalLM.from_pretrained(os.path.join(out, kind, "final"), torch_dtype=torch.float64)
        weights = dict(reference.model.named_parameters())
        worst = max(((p - weights[n]).abs().max() / weights[n].abs().max()).item() for n, p in saved.named_parameters())
        loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], losses(reference)))
        print(f"[{kind}] sp {got['losses']}\n[{kind}] one process {losses(reference)}\n[{kind}] loss difference "
              f"{loss:.1e}, parameters {worst:.1e}, resumed vs uninterrupted {got['resumed_gap']:.1e}, attention "
              f"{sorted(set(got['attention']))}, {len(got['fallbacks'])} fallback(s)\n[{kind}] compilations on rank 0 "
              f"{got['compilations']}")
        if (len(got["losses"]) != len(losses(reference)) or loss > args.loss_tolerance
                or max(worst, got["resumed_gap"]) > args.tolerance):
            failures.append(f"{kind}: differs from one process")
        if not got["attention"] or got["fallbacks"] or any(s in ("gathered-kv", "whole") for s in got["attention"]):
            failures.append(f"{kind}: attention not distributed: {got['attention']} {got['fallbacks']}")
        if "new sequence length" in got["compilations"]:
            failures.append(f"{kind}: a compilation per sequence length: {got['compilations']}")
    for failure in failures:
        print("FAILED", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    arguments = parse()
    if "LOCAL_RANK" in os.environ:  # started by torchrun
        ranks(arguments)
    else:
        sys.exit(launch(arguments))
