"""Triton kernels used by the runtime (one module per op, Liger-style: kernels, launchers, autograd Function).

- ``autoshard.kernels.attention``: attention forward / backward for one (query block, key block) pair at
  global offsets, returning the natural-log LSE, plus the LSE merge that combines ring steps.

This package imports nothing at import time, so ``import autoshard`` never requires Triton; import the
submodule where the kernels are needed (``from autoshard.kernels.attention import ...``).
"""

__all__: list[str] = []  # the kernels live in submodules, imported where needed
