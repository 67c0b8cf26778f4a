"""Triton kernels used by the runtime (one module per kernel, Liger-style: kernel, launcher, autograd Function).

- ``autoshard.kernels.attention``: attention forward / backward for one (query block, key block) pair at
  global offsets, returning the natural-log LSE (and the autograd Function of single-block attention); its parts:
  ``attention_problem`` (validation and the kernels' arguments), ``attention_tiles`` (the ``@triton.jit`` helpers
  the kernels share), ``attention_forward`` and ``attention_backward`` (the kernels and their launchers);
- ``autoshard.kernels.merge``: the LSE merge that combines ring steps;
- ``autoshard.kernels.autotune``: the attention kernels' autotuning policy (candidates and pruning);
- ``autoshard.kernels.common``: what the kernels share (interpreter flag, device check, tile loads, block sizes).

This package imports nothing at import time, so ``import autoshard`` never requires Triton; import the
submodule where the kernels are needed (``from autoshard.kernels.attention import ...``).
"""

__all__: list[str] = []  # the kernels live in submodules, imported where needed
