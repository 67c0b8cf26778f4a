"""Diffusion transformers: one denoising step's latency and peak memory per rank, one process vs autoshard vs
diffusers' own context parallelism, same outputs checked.

A Wan-shaped and a Flux-shaped transformer from diffusers (real block structure, reduced width: 4 heads of 32, 2
blocks; float32) at real token counts (``--tokens``: video or image patches; Flux adds 64 text tokens), a
sampling step (forward under ``torch.no_grad``, the timestep a value). Columns, per rank:

* ``one process``: the model on the whole sequence;
* ``autoshard``: ``torch.compile(transformer, backend=autoshard.backend())`` on P ranks, inputs and outputs whole
  (as a pipeline passes them), the split inferred;
* ``diffusers ulysses`` / ``ring``: ``transformer.enable_parallelism(config=ContextParallelConfig(...))``, the
  hand-written ``_cp_plan`` of the model, on the same gloo ranks; where it does not run the row says why (it splits
  only sequences that P divides: Wan's 8192 is 3 x 42 x 65 = 8190 patches). In brackets, the attention backend.

diffusers 0.42 does not run its context parallelism on a CPU; two shims let it, neither changing what it computes:

* ``enable_parallelism`` places each rank on ``rank % torch.accelerator.device_count()``
  (``ModelMixin._resolve_parallel_config``), a ZeroDivisionError without an accelerator. The count is 1 for that
  call: the mesh is built on the ``cpu`` device type as before, and the device recorded is read by nothing in
  context parallelism.
* Ring attention merges the chunks by their log-sum-exp. ``native`` (Ulysses' backend here, and the one-process
  run's) refuses to return it; the other backends with context parallelism (flash, sage, cuDNN, NPU) need a GPU or
  an NPU. Ring runs ``_native_flash``, whose ``aten::_scaled_dot_product_flash_attention`` has no CPU kernel: it is
  given torch's CPU flash-attention kernel, ``_scaled_dot_product_flash_attention_for_cpu``, the one
  ``F.scaled_dot_product_attention`` runs for ``native`` on these float32 inputs (same output, bit for bit).
  ``_native_flash`` declares bfloat16/float16, its CUDA kernel's types; diffusers checks that only under
  ``DIFFUSERS_ATTN_CHECKS=1``.

diffusers returns its last all-gather still in flight; the step waits for it, as a pipeline's scheduler would (else the
output a rank sends back is not yet gathered: 2.5 off).

Every distributed output is checked against the one-process output (max abs difference, float32). Seconds are
the fastest of ``--repeat`` steps after a warm-up step (compilation excluded); memory is the peak resident bytes
above the start of the step (``autoshard.testing.memory``), in workers started with a low mmap threshold so that
freed tensors leave the resident set. On 2 shared CPU cores the P ranks share the cores: compare the columns,
not the absolute seconds.

    python benchmarks/dit.py                      # Wan 3 x 32 x 32 = 3072 tokens and Flux 48 x 64 = 3072, P=2
    python benchmarks/dit.py --model wan --tokens 8192 --world 2 4
    python benchmarks/dit.py --model flux --strategies auto ulysses allgather   # autoshard's strategies side by side

Measured (this machine, 2 shared CPU cores, 2026-12-07, torch 2.13 CPU, diffusers 0.42.1, ``python
benchmarks/dit.py --tokens 3072 8192 --world 2 4 --repeat 3``, the machine otherwise idle; the error cells
shortened)::

    wan:
    tokens  P                           run  seconds  x one  peak MiB  x one                            max |out - one|
    ------  -  ----------------------------  -------  -----  --------  -----  -----------------------------------------
      3072  1                   one process    0.255   1.00        19   1.00                                          -
      3072  2  autoshard (allgather, local)    0.173   0.68         9   0.47                                    0.0e+00
      3072  2              ulysses (native)    0.168   0.66        10   0.56                                    0.0e+00
      3072  2          ring (_native_flash)    0.172   0.67        16   0.85                                    7.2e-07
      3072  4    autoshard (local, ulysses)    0.221   0.86         4   0.23                                    0.0e+00
      3072  4              ulysses (native)    0.215   0.84         6   0.35                                    0.0e+00
      3072  4          ring (_native_flash)    0.291   1.14        12   0.65                                    8.3e-07
      8192  1                   one process    1.427   1.00        50   1.00                                          -
      8192  2  autoshard (allgather, local)    0.828   0.58        23   0.46                                    0.0e+00
      8192  2              ulysses (native)    0.846   0.59        28   0.56                                    0.0e+00
      8192  2          ring (_native_flash)    0.867   0.61        41   0.81                                    8.3e-07
      8192  4    autoshard (local, ulysses)    0.935   0.65        11   0.22                                    0.0e+00
      8192  4                       ulysses        -      -         -      -  AssertionError: ...divisible by mesh size
      8192  4                          ring        -      -         -      -  AssertionError: ...divisible by mesh size

    flux:
    tokens  P                    run  seconds  x one  peak MiB  x one  max |out - one|
    ------  -  ---------------------  -------  -----  --------  -----  ---------------
      3072  1            one process    0.262   1.00        24   1.00                -
      3072  2  autoshard (allgather)    0.210   0.80        12   0.50          0.0e+00
      3072  2       ulysses (native)    0.161   0.61        13   0.52          9.5e-07
      3072  2   ring (_native_flash)    0.177   0.68        19   0.80          8.3e-07
      3072  4    autoshard (ulysses)    0.211   0.81         6   0.24          0.0e+00
      3072  4       ulysses (native)    0.194   0.74         6   0.27          9.5e-07
      3072  4   ring (_native_flash)    0.238   0.91        13   0.55          7.2e-07
      8192  1            one process    1.308   1.00        63   1.00                -
      8192  2  autoshard (allgather)    0.850   0.65        30   0.48          0.0e+00
      8192  2       ulysses (native)    0.770   0.59        33   0.53          7.2e-07
      8192  2   ring (_native_flash)    0.778   0.59        49   0.78          7.2e-07
      8192  4    autoshard (ulysses)    0.861   0.66        15   0.24          0.0e+00
      8192  4       ulysses (native)    0.853   0.65        17   0.26          8.3e-07
      8192  4   ring (_native_flash)    0.954   0.73        33   0.53          8.3e-07

Flux at P=2 again, autoshard's all-gather (the cost model's choice) and Ulysses side by side (``--model flux --tokens
3072 8192 --world 2 --strategies auto ulysses --repeat 3``, the machine otherwise idle)::

    tokens  P                    run  seconds  x one  peak MiB  x one  max |out - one|
      3072  1            one process    0.267   1.00        24   1.00                -
      3072  2  autoshard (allgather)    0.160   0.60        12   0.50          0.0e+00
      3072  2    autoshard (ulysses)    0.164   0.61        12   0.51          0.0e+00
      3072  2       ulysses (native)    0.158   0.59        13   0.53          9.5e-07
      3072  2   ring (_native_flash)    0.159   0.59        19   0.81          8.3e-07
      8192  1            one process    1.343   1.00        63   1.00                -
      8192  2  autoshard (allgather)    0.742   0.55        30   0.48          0.0e+00
      8192  2    autoshard (ulysses)    0.745   0.55        32   0.51          0.0e+00
      8192  2       ulysses (native)    0.749   0.56        33   0.53          7.2e-07
      8192  2   ring (_native_flash)    0.953   0.71        49   0.78          7.2e-07

The peak memory is steady from run to run; the seconds are not (other quiet runs moved single cells by up to 45%, as
Flux's P=2 cells between the two tables): at these sizes the three ways take about the same time, and autoshard's
strategy makes no difference on these CPU ranks. Per rank, autoshard holds the least (0.46-0.50 of one
process at P=2, 0.22-0.24 at P=4), diffusers' Ulysses a little more, diffusers' ring the most (0.78-0.85 at P=2,
0.53-0.65 at P=4): it all-gathers every rank's keys and values at once (``rotate_method="allgather"``, the only one
diffusers 0.42 has). Every output matches one process: autoshard's bit for bit, Wan's Ulysses too; Flux's Ulysses
and the rings to under 1e-6 (the order of a sum: Flux's text tokens are split with the image tokens, and the ring
merges its chunks' softmaxes).
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import wait_tensor

import autoshard
from autoshard.testing import run_on_ranks
from autoshard.testing.memory import LOW_MMAP_THRESHOLD_ENV, peak_memory

from _common import print_table

HEADS, HEAD_DIM, TEXT = 4, 32, 64


def _flash_on_cpu(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """``aten::_scaled_dot_product_flash_attention`` on CPU: torch's CPU flash kernel, output and log-sum-exp; the
    variable-length, random-state and debug outputs empty (no dropout, whole sequences)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                                          scale=scale)
    none = query.new_empty(0)
    return out, lse, none, none, query.shape[2], key.shape[2], none, none, none


_CPU_FLASH = torch.library.Library("aten", "IMPL")  # the op had no CPU kernel: no other run calls it
_CPU_FLASH.impl("_scaled_dot_product_flash_attention", _flash_on_cpu, "CPU")


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
    if mode.startswith("autoshard"):  # "autoshard:<strategy>", "auto" being the cost model's choice
        strategy = mode.split(":")[1]
        backend = autoshard.backend(outputs="gathered", **({} if strategy == "auto" else {"strategy": strategy}))
        net = torch.compile(net, backend=backend)
        ran = lambda: ", ".join(sorted({a["strategy"] for g in backend.compiled for a in g.report.attention}))  # noqa
    elif mode in ("ulysses", "ring"):
        from diffusers import ContextParallelConfig

        attention = "_native_flash" if mode == "ring" else "native"  # ring needs each chunk's log-sum-exp
        net.set_attention_backend(attention)
        ran = lambda: attention  # noqa: E731
        with mock.patch.object(torch.accelerator, "device_count", return_value=1):  # rank % 1: the CPU
            net.enable_parallelism(config=ContextParallelConfig(**{f"{mode}_degree": dist.get_world_size()}))
    # diffusers returns its final all-gather still in flight (an AsyncCollectiveTensor): the step waits for it, as the
    # scheduler reading the output would (a no-op on a plain tensor)
    return (lambda: wait_tensor(net(**kwargs)[0])), ran


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
    parser.add_argument("--strategies", nargs="+", default=["auto"],
                        help="autoshard rows: 'auto' (the cost model's choice) and/or strategies to force")
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
                for mode in [f"autoshard:{strategy}" for strategy in args.strategies] + ["ulysses", "ring"]:
                    results = run_on_ranks(_step, world, model, tokens, mode, args.repeat, timeout=3600,
                                           env=LOW_MMAP_THRESHOLD_ENV)
                    if "error" in results[0]:
                        rows.append([tokens, world, mode.split(":")[0], "-", "-", "-", "-", results[0]["error"]])
                        continue
                    seconds = max(r["seconds"] for r in results)
                    peak = max(r["peak"] for r in results)
                    diff = max((r["out"] - whole["out"]).abs().max().item() for r in results)
                    rows.append([tokens, world, f"{mode.split(':')[0]} ({results[0]['attention']})", f"{seconds:.3f}",
                                 f"{seconds / whole['seconds']:.2f}",
                                 f"{peak / 2**20:.0f}", f"{peak / whole['peak']:.2f}", f"{diff:.1e}"])
        print_table(f"{model}: one denoising step (forward, no grad), per rank: slowest rank's fastest of "
                    f"{args.repeat}, peak extra resident MiB", ["tokens", "P", "run", "seconds", "x one",
                                                                 "peak MiB", "x one", "max |out - one|"], rows)


if __name__ == "__main__":
    main()
