"""Diffusion transformers: one denoising step's latency and peak memory per rank, one process vs autoshard vs
diffusers' own context parallelism, same outputs checked.

A Wan-shaped and a Flux-shaped transformer from diffusers (real block structure, reduced width: 4 heads of 32, 2
blocks; float32) at real token counts (``--tokens``: video or image patches; Flux adds 64 text tokens), a
sampling step (forward under ``torch.no_grad``, the timestep a value). Columns, per rank:

* ``one process``: the model on the whole sequence;
* ``autoshard``: ``torch.compile(transformer, backend=autoshard.backend())`` on P ranks, inputs and outputs whole
  (as a pipeline passes them), the split inferred;
* ``diffusers ulysses`` / ``ring``: ``transformer.enable_parallelism(config=ContextParallelConfig(...))``, the
  hand-written ``_cp_plan`` of the model; where it does not run the row says why (diffusers 0.42 places each rank
  on ``rank % torch.accelerator.device_count()``: it needs an accelerator, so on a CPU-only machine it stops there).

Every distributed output is checked against the one-process output (max abs difference, float32). Seconds are
the fastest of ``--repeat`` steps after a warm-up step (compilation excluded); memory is the peak resident bytes
above the start of the step (``autoshard.testing.memory``), in workers started with a low mmap threshold so that
freed tensors leave the resident set. On 2 shared CPU cores the P ranks share the cores: compare the columns,
not the absolute seconds.

    python benchmarks/dit.py                      # Wan 3 x 32 x 32 = 3072 tokens and Flux 48 x 64 = 3072, P=2
    python benchmarks/dit.py --model wan --tokens 8192 --world 2 4
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.memory import LOW_MMAP_THRESHOLD_ENV, peak_memory

from _common import print_table

HEADS, HEAD_DIM, TEXT = 4, 32, 64


def _grid(tokens: int, model: str) -> tuple[int, int, int]:
    """(frames, height, width) in patches: Wan 3 frames, Flux 1; height x width as square as divides."""
    frames = 3 if model == "wan" else 1
    per_frame = tokens // frames
    height = max(h for h in range(1, int(per_frame ** 0.5) + 1) if per_frame % h == 0)
    return frames, height, per_frame // height


def _build(model: str, tokens: int):
    """(transformer, forward kwargs) with seeded random weights and inputs."""
    import diffusers

    g = torch.Generator().manual_seed(0)
    frames, height, width = _grid(tokens, model)
    torch.manual_seed(0)
    if model == "wan":  # patch (1, 2, 2): latents of 2h x 2w per frame
        net = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
                                              in_channels=16, out_channels=16, text_dim=64, freq_dim=64,
                                              ffn_dim=4 * HEADS * HEAD_DIM, num_layers=2, rope_max_seq_len=1024)
        kwargs = dict(hidden_states=torch.randn(1, 16, frames, 2 * height, 2 * width, generator=g),
                      timestep=torch.tensor([500]), encoder_hidden_states=torch.randn(1, TEXT, 64, generator=g))
    else:
        net = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                               attention_head_dim=HEAD_DIM, num_attention_heads=HEADS,
                                               joint_attention_dim=64, pooled_projection_dim=64,
                                               axes_dims_rope=(8, 12, 12))
        ids = torch.stack([torch.zeros(tokens), torch.arange(tokens) // width, torch.arange(tokens) % width], -1)
        kwargs = dict(hidden_states=torch.randn(1, tokens, 64, generator=g),
                      encoder_hidden_states=torch.randn(1, TEXT, 64, generator=g),
                      pooled_projections=torch.randn(1, 64, generator=g), timestep=torch.tensor([0.5]),
                      img_ids=ids, txt_ids=torch.zeros(TEXT, 3))
    return net.eval(), dict(kwargs, return_dict=False)


def _prepared(model: str, tokens: int, mode: str):
    """A function running one denoising step of ``mode`` on this rank, and one naming how its attention ran."""
    net, kwargs = _build(model, tokens)
    ran = lambda: mode  # noqa: E731
    if mode == "autoshard":
        backend = autoshard.backend(outputs="gathered")
        net = torch.compile(net, backend=backend)
        ran = lambda: ", ".join(sorted({a["strategy"] for g in backend.compiled for a in g.report.attention}))  # noqa
    elif mode in ("ulysses", "ring"):
        from diffusers import ContextParallelConfig

        net.enable_parallelism(config=ContextParallelConfig(**{f"{mode}_degree": dist.get_world_size()}))
    return (lambda: net(**kwargs)[0]), ran


def _step(model: str, tokens: int, mode: str, repeat: int) -> dict:
    """One rank's fastest step (seconds), peak extra resident bytes and output."""
    try:
        step, ran = _prepared(model, tokens, mode)
        with torch.no_grad():
            step()  # warm-up (compiles)
            best, peak, out = float("inf"), 0, None
            for _ in range(repeat):
                if dist.is_initialized():
                    dist.barrier()
                with peak_memory() as mem:
                    start = time.perf_counter()
                    out = step()
                    best = min(best, time.perf_counter() - start)
                peak = max(peak, mem.peak_bytes)
        return {"seconds": best, "peak": peak, "out": out, "attention": ran()}
    except Exception as exc:  # a peer that does not run here: say why
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["wan", "flux", "both"], default="both")
    parser.add_argument("--tokens", type=int, nargs="+", default=[3072])
    parser.add_argument("--world", type=int, nargs="+", default=[2])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    models = ["wan", "flux"] if args.model == "both" else [args.model]
    for model in models:
        rows = []
        for tokens in args.tokens:
            (whole,) = run_on_ranks(_step, 1, model, tokens, "one", args.repeat, timeout=3600,
                                    env=LOW_MMAP_THRESHOLD_ENV)
            rows.append([tokens, 1, "one process", f"{whole['seconds']:.3f}", "1.00",
                         f"{whole['peak'] / 2**20:.0f}", "1.00", "-"])
            for world in args.world:
                for mode in ("autoshard", "ulysses", "ring"):
                    results = run_on_ranks(_step, world, model, tokens, mode, args.repeat, timeout=3600,
                                           env=LOW_MMAP_THRESHOLD_ENV)
                    if "error" in results[0]:
                        rows.append([tokens, world, mode, "-", "-", "-", "-", results[0]["error"]])
                        continue
                    seconds = max(r["seconds"] for r in results)
                    peak = max(r["peak"] for r in results)
                    diff = max((r["out"] - whole["out"]).abs().max().item() for r in results)
                    rows.append([tokens, world, f"{mode} ({results[0]['attention']})", f"{seconds:.3f}",
                                 f"{seconds / whole['seconds']:.2f}",
                                 f"{peak / 2**20:.0f}", f"{peak / whole['peak']:.2f}", f"{diff:.1e}"])
        print_table(f"{model}: one denoising step (forward, no grad), per rank: slowest rank's fastest of "
                    f"{args.repeat}, peak extra resident MiB", ["tokens", "P", "run", "seconds", "x one",
                                                                 "peak MiB", "x one", "max |out - one|"], rows)


if __name__ == "__main__":
    main()
