"""Merging partial attention results through their log-sum-exp, in fp32.

Two partial results over disjoint key sets of the same query rows, ``(out_a, lse_a)`` and
``(out_b, lse_b)`` (``out`` normalized over its own keys, ``lse`` the *natural* log of the row's sum of
``exp(s)`` over its scores ``s = scale * q.k``, soft-capped or not), combine exactly as::

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Both weights are ``<= 1``, so the update never overflows. A side whose ``lse`` is ``-inf`` (no visible
key) contributes nothing; when both are ``-inf`` the row stays ``out = 0, lse = -inf``. Arithmetic is
fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch

from .backend import triton_merge, use_triton

__all__ = ["merge_attention", "merge_attention_"]


def _weights(lse_a: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lse = torch.logaddexp(lse_a, lse_b)
    finite = lse.masked_fill(lse == float("-inf"), 0.0)  # both sides empty: weights exp(-inf) = 0
    return lse, torch.exp(lse_a - finite).unsqueeze(-1), torch.exp(lse_b - finite).unsqueeze(-1)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, *,
                    kernels: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The merged ``(out, lse)`` of two partial results (new tensors; see the module docstring)."""
    if use_triton(kernels, out_a):
        return triton_merge(out_a, lse_a, out_b, lse_b)
    lse, wa, wb = _weights(lse_a, lse_b)
    return out_a * wa + out_b * wb, lse


def merge_attention_(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, *,
                     kernels: str = "auto") -> None:
    """Merge ``(out_b, lse_b)`` into the running ``(out, lse)`` in place (they may be views)."""
    if use_triton(kernels, out):
        merged_out, merged_lse = merge_attention(out, lse, out_b, lse_b, kernels="triton")
        out.copy_(merged_out)
        lse.copy_(merged_lse)
        return
    merged, wa, wb = _weights(lse, lse_b)
    out.mul_(wa).add_(out_b * wb)
    lse.copy_(merged)
