"""The fp32 LSE merge of two partial attention results over disjoint key sets of the same query rows: kernel
and launcher (:func:`triton_merge`), the Triton path of :func:`autoshard.runtime.attention.merge.merge_attention`.

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

One program per (row tile, head, batch), rows of ``row_block`` and the head dim padded to ``block_d``. A row
whose two sides both have ``lse = -inf`` (no visible key) gives ``out = 0, lse = -inf``. The merge is not
differentiated (the distributed attention's backward uses the final ``out`` / ``lse``), so there is no autograd
Function; if one were wanted, with ``w_a = exp(lse_a - lse)``: ``d out_a = w_a * d out``, ``d lse_a = w_a *
(rowsum(d out * (out_a - out)) + d lse)`` and the same for ``b``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import aligned_empty, aligned_rows, check_like, load_tile, padded_dim, row_block, store_tile, triton_available

__all__ = ["triton_merge"]


@triton.jit
def _merge_kernel(OutA, LseA, OutB, LseB, Out, Lse,
                  stride_ab, stride_ah, stride_as, stride_bb, stride_bh, stride_bs, stride_ob, stride_oh, stride_os,
                  num_heads, S, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """lse = logaddexp(lse_a, lse_b); out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse), in fp32."""
    h = tl.program_id(1)
    b = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < S
    stats = (b * num_heads + h).to(tl.int64) * S + rows
    lse_a = tl.load(LseA + stats, mask=row_ok, other=float("-inf"))
    lse_b = tl.load(LseB + stats, mask=row_ok, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    empty = m == float("-inf")
    m_ref = tl.where(empty, 0.0, m)
    w_a = tl.exp(lse_a - m_ref)  # 0 for a side with lse -inf
    w_b = tl.exp(lse_b - m_ref)
    total = tl.where(empty, 1.0, w_a + w_b)  # in [1, 2] where anything is visible
    lse = tl.where(empty, float("-inf"), m_ref + tl.log(total))
    w_a = w_a / total
    w_b = w_b / total
    out_a = load_tile(OutA + b.to(tl.int64) * stride_ab + h.to(tl.int64) * stride_ah
                      + rows[:, None].to(tl.int64) * stride_as + cols[None, :], rows, S, cols, HEAD_DIM, BLOCK_D, True)
    out_b = load_tile(OutB + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
                      + rows[:, None].to(tl.int64) * stride_bs + cols[None, :], rows, S, cols, HEAD_DIM, BLOCK_D, True)
    out = out_a.to(tl.float32) * w_a[:, None] + out_b.to(tl.float32) * w_b[:, None]
    store_tile(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
               + rows[:, None].to(tl.int64) * stride_os + cols[None, :], out, rows, S, cols, HEAD_DIM)
    tl.store(Lse + stats, lse, mask=row_ok)


def triton_merge(out_a, lse_a, out_b, lse_b):
    """Merge two partial results of the same query rows over disjoint key sets, in float32:
    lse = logaddexp(lse_a, lse_b), out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)."""
    if out_a.dim() != 4 or out_a.shape != out_b.shape:
        raise ValueError(f"out_a and out_b must be [B, H, S, D] of one shape, got {tuple(out_a.shape)}, "
                         f"{tuple(out_b.shape)}")
    batch, heads, seq, head_dim = out_a.shape
    check_like("out_b", out_b, out_a.shape, out_a.device)
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_like(name, x, (batch, heads, seq), out_a.device)
    if not triton_available(out_a.device):
        raise RuntimeError(f"Triton merge cannot run on {out_a.device}: it needs a CUDA device, or "
                           "TRITON_INTERPRET=1 set before autoshard.kernels.merge is imported (CPU)")
    out = aligned_empty(out_a.shape, torch.float32, out_a.device)
    lse = torch.empty((batch, heads, seq), dtype=torch.float32, device=out_a.device)
    if out.numel() == 0:
        return out.contiguous(), lse.fill_(float("-inf"))
    out_a, out_b = aligned_rows(out_a), aligned_rows(out_b)
    block_d = padded_dim(head_dim)
    block_m = row_block(block_d)
    _merge_kernel[(triton.cdiv(seq, block_m), heads, batch)](
        out_a, lse_a.float().contiguous(), out_b, lse_b.float().contiguous(), out, lse,
        out_a.stride(0), out_a.stride(1), out_a.stride(2), out_b.stride(0), out_b.stride(1), out_b.stride(2),
        out.stride(0), out.stride(1), out.stride(2), heads, seq, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m,
    )
    return out.contiguous(), lse
