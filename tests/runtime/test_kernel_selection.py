"""Which implementation ``kernels=`` selects for a block, decided without a GPU: ``"auto"`` takes the
Triton kernels only on CUDA and only for what they serve (float16/bfloat16/float32, head dim 1..256)."""

import pytest
import torch

from autoshard.runtime.attention.backend import choose_triton, use_triton

pytest.importorskip("triton")


@pytest.mark.parametrize("dtype,head_dim,expected", [
    (torch.float32, 64, True), (torch.bfloat16, 256, True), (torch.float16, 1, True),
    (torch.float64, 64, False),    # the kernels reject float64: the torch path serves it
    (torch.float32, 257, False),   # beyond MAX_HEAD_DIM
    (torch.float32, 512, False),
])
def test_auto_on_cuda_falls_back_where_the_kernels_cannot_serve(dtype, head_dim, expected):
    assert choose_triton("auto", "cuda", dtype, head_dim) is expected


def test_auto_off_cuda_and_forced_choices():
    x = torch.zeros(1, 2, 3, 64)
    assert not use_triton("auto", x) and not use_triton("torch", x)
    assert use_triton("triton", x)                                   # strict: the kernels raise their own error
    assert choose_triton("triton", "cuda", torch.float64, 512)       # never silently downgraded
    assert not choose_triton("torch", "cuda", torch.float32, 64)
    with pytest.raises(ValueError, match="kernels must be one of"):
        choose_triton("cuda", "cuda", torch.float32, 64)
