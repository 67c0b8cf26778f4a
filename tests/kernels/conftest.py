"""Kernel tests run on CUDA when a GPU is present, else on the CPU under Triton's interpreter.

Triton decides between compiling and interpreting when a ``@triton.jit`` function is decorated, i.e.
when the kernel modules (``autoshard.kernels.*``) are first imported, so ``TRITON_INTERPRET=1`` is set here, before
the test modules import it. The tests check that the interpreter really is active on the CPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
