"""An unmodified Hugging Face Llama under the one-liner, on 2 CPU ranks, against one process.

    python examples/hf_llama.py                      # spawns 2 ranks (gloo)
    torchrun --nproc-per-node 2 examples/hf_llama.py

A small LlamaForCausalLM with random weights (nothing is downloaded), a left-padded batch, labels.
The compiled model's loss and every parameter gradient equal the plain model's on one process.
Needs ``transformers`` (a test extra: ``pip install -e .[test]``).
"""

import copy

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import autoshard


def main(seq_len: int = 96):
    torch.manual_seed(0)  # every rank builds the same model and batch
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    model = LlamaForCausalLM(config)
    one_process = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, seq_len))
    mask = torch.ones_like(ids)
    mask[0, :10] = 0  # left padding on the first sequence
    labels = ids.masked_fill(mask == 0, -100)

    compiled = torch.compile(model, backend=autoshard.backend())
    loss = compiled(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    loss.backward()
    ref = one_process(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    ref.backward()

    grad_err = max((p.grad - q.grad).abs().max().item() / q.grad.abs().max().item()
                   for p, q in zip(model.parameters(), one_process.parameters()))
    if dist.get_rank() == 0:
        print(f"loss {loss.item():.8f}, one process {ref.item():.8f}, max relative gradient diff {grad_err:.1e}")
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item()) and grad_err < 1e-4


if __name__ == "__main__":
    autoshard.launch.run(main, world_size=2)
