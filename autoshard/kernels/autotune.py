"""The autotuning policy of the attention kernels (:mod:`.attention_forward`, :mod:`.attention_backward`): candidate
configurations in order of preference, and pruning them to what fits the device, the dtype, the head dims and the
mask kind.

The kernels take ``configs(kernel)`` as their candidates, ``TUNING_KEY`` as the autotuner's key and ``pruner(kernel)``
as its early pruning hook; ``RUNTIME_INTS`` are the integer arguments they never specialize on. Under
``TRITON_INTERPRET=1`` a single 16x16 configuration is used. ``AUTOSHARD_TRITON_AUTOTUNE=0`` keeps only the first
fitting configuration (no benchmarking; used by the GPU test run).
"""

from __future__ import annotations

import os

import torch
import triton

from .common import INTERPRET

__all__ = ["AUTOTUNE", "CANDIDATES", "FP32_CANDIDATES", "REGISTER_BUDGET", "MIN_ROWS_PER_WARP", "TUNING_KEY",
           "RUNTIME_INTS", "configs", "shape", "resources", "max_shared_memory", "fitting_configs", "pruner",
           "seq_bucket"]

AUTOTUNE = os.environ.get("AUTOSHARD_TRITON_AUTOTUNE", "1").lower() not in ("0", "false", "off", "no")

# (BLOCK_M = query rows per tile, BLOCK_N = key rows per tile, num_warps, num_stages) for fp16 / bf16
# inputs, best guess first (the only one tried when AUTOSHARD_TRITON_AUTOTUNE=0). Each was compiled for
# sm_90 with Triton's ptxas at head dims 64 / 96 / 128 with and without masks: the pruning below keeps,
# per head dim and mask kind, the ones that compiled without register spills.
CANDIDATES = {
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3),
            (64, 64, 4, 3), (64, 32, 4, 2)],
    # dq: like the forward (query tile resident, key tiles streamed).
    "dq": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2)],
    # dk/dv: key tile resident (BLOCK_N rows), query tiles streamed.
    "dkdv": [(32, 128, 8, 3), (64, 128, 8, 3), (32, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3), (32, 64, 4, 2)],
}
# fp32 inputs use exact ("ieee") FMA dots, not tensor cores: only small tiles compile without spills
# (checked up to head dim 128). A correctness path, several times slower than bf16.
FP32_CANDIDATES = [(16, 16, 4, 2)]
# Live fp32 values per thread that the accumulators and score tiles may take: the estimate at which
# the sm_90 compiles above stop spilling (of 255 registers, the rest hold operands and addresses).
REGISTER_BUDGET = 160
# Rows of the resident tile per warp: a Hopper warpgroup (4 warps) issues wgmma on 64 rows, so fewer
# rows per warp would make warpgroups duplicate work.
MIN_ROWS_PER_WARP = 16


def configs(kernel: str):
    if INTERPRET:  # one small configuration: the interpreter runs every program in Python
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n, w, s in CANDIDATES[kernel] + FP32_CANDIDATES]


def shape(config) -> tuple:
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def resources(kernel: str, block_m: int, block_n: int, block_d: int, block_dv: int, stages: int, itemsize: int,
               masked: bool):
    """(shared memory bytes, live fp32 values) of one program, estimated; calibrated on sm_90 compiles with
    block_dv == block_d (q / k / dq / dk tiles have block_d columns, v / out / dout / dv tiles block_dv)."""
    if kernel == "fwd":  # q resident; k, v streamed; acc [M, Dv]; scores [M, N] (+ key_mask / segment masks)
        return (itemsize * (block_d * block_m + (block_d + block_dv) * stages * block_n),
                block_m * (block_dv + block_n * (2.5 if masked else 1.0)))
    if kernel == "dq":  # q, do resident; k, v streamed; dq [M, D]; scores and dp [M, N]
        return itemsize * (block_d + block_dv) * (block_m + stages * block_n), block_m * (block_d + 2 * block_n)
    # dkdv: k, v resident; q, do streamed; dk [N, D], dv [N, Dv]; scores and dp [N, M]
    return itemsize * (block_d + block_dv) * (block_n + stages * block_m), block_n * (block_d + block_dv + 2 * block_m)


def max_shared_memory(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def fitting_configs(kernel: str, configs, args, smem_limit: int):
    """The candidates for the input dtype that fit: shared memory within the device's limit, register
    estimate within budget, every warp with rows of the resident tile, tiles no larger than the
    (bucketed) sequence lengths; the smallest tiles when none fits the estimates."""
    if args["Q"].element_size() == 4:
        return [c for c in configs if shape(c) in FP32_CANDIDATES]
    configs = [c for c in configs if shape(c) in CANDIDATES[kernel]]
    block_d, block_dv, itemsize = args["BLOCK_D"], args["BLOCK_DV"], args["Q"].element_size()
    # per-key loads and compares (or the dropout hash) in every tile
    masked = args["HAS_KEY_MASK"] or args["HAS_SEG"] or args.get("HAS_DROPOUT", False)
    fitting = []
    for config in configs:
        m, n, warps, stages = shape(config)
        smem, live = resources(kernel, m, n, block_d, block_dv, stages, itemsize, masked)
        resident_rows = n if kernel == "dkdv" else m
        if smem <= smem_limit and live <= REGISTER_BUDGET * 32 * warps and resident_rows >= MIN_ROWS_PER_WARP * warps:
            fitting.append(config)
    if not fitting:
        return [min(configs, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], c.num_stages))]
    short = [c for c in fitting if c.kwargs["BLOCK_M"] <= args["SQ_BUCKET"] and c.kwargs["BLOCK_N"] <= args["SK_BUCKET"]]
    return short or fitting


def pruner(kernel: str):
    """Autotuner hook: the fitting configurations, or only the first when AUTOSHARD_TRITON_AUTOTUNE=0."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        fitting = fitting_configs(kernel, configs, args, max_shared_memory(args["Q"].device))
        return fitting if AUTOTUNE else fitting[:1]

    return prune


def seq_bucket(n: int) -> int:
    """Autotuning key for a sequence length: next power of two, at least 16, at most 2**17."""
    return min(max(triton.next_power_of_2(max(n, 1)), 16), 1 << 17)


TUNING_KEY = ["BLOCK_D", "BLOCK_DV", "SQ_BUCKET", "SK_BUCKET", "HAS_LEFT", "HAS_RIGHT", "HAS_CHUNK", "HAS_KEY_MASK",
               "HAS_SEG", "SOFTCAP", "HAS_ALIBI", "HAS_DROPOUT"]
# Runtime integers that change between calls (ring steps, uneven shards): never specialize on them.
RUNTIME_INTS = ["Sq", "Sk", "q_offset", "k_offset", "left", "right", "chunk", "SQ_BUCKET", "SK_BUCKET",
                 "drop_head_offset", "drop_threshold"]
