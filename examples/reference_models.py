"""Any reference model under the one-liner, with any strategy, checked against one process.

    python examples/reference_models.py --model vit --strategy zigzag --seq-len 65 --ranks 2
    torchrun --nproc-per-node 4 examples/reference_models.py --model bert --strategy ulysses

Models (autoshard/testing/models): llama (RoPE, GQA, tied head, shifted labels), bert (padding mask,
masked mean pooling), vit (conv patches, CLS token, full positional parameter), handwritten
(attention written as matmul / masked_fill / softmax / matmul). Prints what the compiler did and
the largest relative difference of outputs and gradients from the plain model on one process.
"""

import argparse

import torch
import torch.distributed as dist

import autoshard
from autoshard.testing.models import BertClassifier, HandwrittenLM, LlamaLM, ViTClassifier, ViTConfig
from autoshard.testing.equivalence import compare_with_one_process


def model_and_inputs(name: str, seq_len: int):
    """(model factory, inputs factory) of reference model ``name`` at about ``seq_len`` tokens."""
    tokens = lambda: torch.randint(0, 256, (2, seq_len))  # noqa: E731
    if name == "llama":
        return LlamaLM, lambda: (tokens(), tokens())
    if name == "handwritten":
        return HandwrittenLM, lambda: (tokens(), tokens())
    if name == "bert":
        def inputs():
            mask = torch.ones(2, seq_len, dtype=torch.long)
            mask[1, seq_len // 2:] = 0  # right padding
            return tokens(), mask, torch.tensor([0, 2])
        return BertClassifier, inputs
    side = 8 * max(1, round((seq_len - 1) ** 0.5))  # (side / 8)^2 patches + the CLS token
    return (lambda: ViTClassifier(ViTConfig(image=side))), lambda: (torch.randn(2, 3, side, side), torch.tensor([1, 3]))


def main(args):
    make_model, make_inputs = model_and_inputs(args.model, args.seq_len)
    result = compare_with_one_process(make_model, make_inputs, dtype=torch.float64, strategy=args.strategy)
    if dist.get_rank() == 0:
        for decision in result.attention:
            print("attention:", decision)
        print("communication:", result.transitions or "none outside attention")
        print(result.summary())
    assert result.max_error() < 1e-9 and not result.fallbacks, result.summary()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["llama", "bert", "vit", "handwritten"], default="llama")
    parser.add_argument("--strategy", choices=["auto", "ring", "zigzag", "allgather", "ulysses"], default="auto")
    parser.add_argument("--seq-len", type=int, default=65)
    parser.add_argument("--ranks", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    args = parser.parse_args()
    autoshard.launch.run(main, args.ranks, args)
