"""Kernel tests run on CUDA when a GPU is present, else on the CPU under Triton's interpreter.

Triton decides between compiling and interpreting when a ``@triton.jit`` function is decorated -- its own
standard library's when ``triton.language`` is first imported, which importing ``torch._dynamo`` does (autoshard
makes its default backend, and sets a dynamo setting, when it is imported) -- so ``TRITON_INTERPRET=1`` is set here,
in the suite's first conftest, before any test module is collected. The kernel tests check that the interpreter
really is active on the CPU.

Under ``./dev test``'s two pytest-xdist workers every process of the suite runs one intra-op thread: two workers
with a thread per core each, and the ranks they start, would otherwise oversubscribe the cores (a subprocess test,
the Trainer's, ran at a third of its speed beside another test).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread here and in the processes a test starts
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
