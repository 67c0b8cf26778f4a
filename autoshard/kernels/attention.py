"""Triton attention of one (query block, key block) pair at global offsets, with natural-log LSE: the public
functions (the contract with :mod:`autoshard.runtime.attention.local`) and the autograd Function of single-block
attention.

One kernel family serves every ring step: the caller passes the GLOBAL position of the first query row
(``q_offset``) and of the first key column (``k_offset``), and every mask is evaluated from positions
inside the kernels, never materialized (the contract of :func:`autoshard.runtime.attention.local.local_attention`):

- causal ``j_pos <= i_pos``; window ``(left, right)``: ``i_pos - left <= j_pos <= i_pos + right``
  (``-1`` = unbounded);
- chunked local attention ``chunk=C`` (Llama-4): ``i_pos // C == j_pos // C``;
- ``key_mask`` ``[B, Sk]`` (True = may be attended) and ``segment_ids`` ``(seg_q [B, Sq], seg_k [B, Sk])``.

Soft-capping (``softcap > 0``, Gemma2): the scaled scores ``s`` become ``softcap * tanh(s / softcap)``
before the mask.

ALiBi (``alibi_slopes`` float32 [H], one slope per QUERY head; Bloom, MPT, Falcon): every score gets
``slope[h] * (j_pos - i_pos)`` from GLOBAL positions, added after the cap and before the mask, so ring steps
need nothing but their offsets; lse includes the bias, and the slopes get no gradient.

Dropout (``dropout_p > 0`` with ``dropout_seed``, a 0-d int64 tensor on q's device read in the kernels, and
``dropout_head_offset``): the probabilities are dropped by the counter-based hash of
:mod:`autoshard.runtime.attention.dropout` (seed, ``b * 2**16 + dropout_head_offset + h``, ``q_offset + i``,
``k_offset + j``), the same mask bit for bit as the torch path's ``AttentionDropout.keep``. The row normalization
and lse are of the probabilities before dropout: ``out = sum_j p_ij z_ij v_j`` with ``z`` 0 or ``1 / (1 - p)``.

Shapes: q [B, H, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] with H % Hkv == 0 (GQA / MQA). The value head
dim Dv may differ from the query / key head dim D (MLA, e.g. DeepSeek-V3's D = 192, Dv = 128): out, dout and
dv are [.., Dv], dq and dk [.., D]. Outputs of the contract functions are float32; ``TritonAttentionFunction``
(single-block use) writes out and the gradients in the input dtype.

The implementation, one module per part:

- :mod:`.attention_problem`: validation, the masks normalized for the kernels, the kernels' arguments and
  specialization;
- :mod:`.attention_tiles`: the ``@triton.jit`` helpers the kernels share (which tiles to visit, the tile mask, the
  cap, the bias, the dropout hash, the dots);
- :mod:`.attention_forward`: the forward kernel and its launcher;
- :mod:`.attention_backward`: the backward kernels (delta, dk/dv, dq) and their launcher;
- :mod:`.autotune`: the autotuning policy; :mod:`.common`: the tile loads and block sizes of every kernel;
  :mod:`.merge`: the LSE merge that combines ring steps.
"""

from __future__ import annotations

import torch

from .attention_backward import _backward
from .attention_forward import _forward
from .attention_problem import _SUPPORTED_DTYPES, MAX_HEAD_DIM, _prepare  # the dtypes: for the runtime's backend

__all__ = [
    "MAX_HEAD_DIM",
    "TritonAttentionFunction",
    "triton_attention",
    "triton_attention_backward",
    "triton_attention_forward",
]


def triton_attention_forward(q, k, v, *, q_offset=0, k_offset=0, causal=False, window=None, chunk=0, key_mask=None,
                             segment_ids=None, scale=None, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                             dropout_seed=None, dropout_head_offset=0):
    """Attention of one query block over one key block at global offsets.

    q [B, H, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (fp16 / bf16 / fp32, H % Hkv == 0; Dv may differ
    from D, as in MLA). Returns (out float32 [B, H, Sq, Dv], lse float32 [B, H, Sq], natural log); rows with
    no visible key get out 0, lse -inf. The default scale is 1 / sqrt(D).
    softcap > 0 caps the scaled scores s to softcap * tanh(s / softcap) before the mask; chunk > 0 keeps
    only the pairs with i_pos // chunk == j_pos // chunk.
    alibi_slopes (float32 [H] on q's device, one slope per QUERY head) adds the ALiBi bias
    slope[h] * (j_pos - i_pos) from global positions to the (capped) scores before the mask; lse includes it.
    dropout_p > 0 drops the probabilities by the hashed mask of :mod:`autoshard.runtime.attention.dropout`
    (``dropout_seed``: the call's 0-d int64 seed on q's device, read in the kernels; ``dropout_head_offset``: the
    global index of q's first head) and scales the kept ones by 1 / (1 - dropout_p); lse is of the
    probabilities before dropout.
    """
    p = _prepare(q, k, v, q_offset=q_offset, k_offset=k_offset, causal=causal, window=window, chunk=chunk,
                 key_mask=key_mask, segment_ids=segment_ids, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
                 dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_head_offset=dropout_head_offset)
    return _forward(p, torch.float32)


def triton_attention_backward(dout, q, k, v, out, lse, *, delta=None, q_offset=0, k_offset=0, causal=False,
                              window=None, chunk=0, key_mask=None, segment_ids=None, scale=None, softcap=0.0,
                              alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_head_offset=0):
    """Gradients (dq [B, H, Sq, D], dk [B, Hkv, Sk, D], dv [B, Hkv, Sk, Dv]), float32, of one key block's
    share of attention; dout and out are [B, H, Sq, Dv].

    out / lse are the FINAL values over all key blocks (so ring steps can sum the results); delta =
    rowsum(dout * out) float32 [B, H, Sq] is computed from out when None. Rows with lse -inf contribute
    nothing. alibi_slopes must be those of the forward; the bias is a constant (no gradient for the slopes).
    dropout_p / dropout_seed / dropout_head_offset must be those of the forward: the same mask is recomputed.
    """
    p = _prepare(q, k, v, q_offset=q_offset, k_offset=k_offset, causal=causal, window=window, chunk=chunk,
                 key_mask=key_mask, segment_ids=segment_ids, scale=scale, softcap=softcap, alibi_slopes=alibi_slopes,
                 dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_head_offset=dropout_head_offset)
    return _backward(p, dout, out, lse, delta, torch.float32)


class TritonAttentionFunction(torch.autograd.Function):
    """Differentiable single-block attention: ``apply(q, k, v, q_offset, k_offset, causal, window, key_mask,
    segment_ids, scale, softcap, chunk, alibi_slopes=None, dropout_p=0.0, dropout_seed=None,
    dropout_head_offset=0)`` returns out in q's dtype; gradients are written in the input dtypes (none for the
    ALiBi slopes or the dropout seed). The backward recomputes the forward's dropout mask from the seed."""

    @staticmethod
    def forward(ctx, q, k, v, q_offset, k_offset, causal, window, key_mask, segment_ids, scale, softcap, chunk,
                alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_head_offset=0):
        p = _prepare(q, k, v, q_offset=q_offset, k_offset=k_offset, causal=causal, window=window, chunk=chunk,
                     key_mask=key_mask, segment_ids=segment_ids, scale=scale, softcap=softcap,
                     alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                     dropout_head_offset=dropout_head_offset)
        out, lse = _forward(p, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, key_mask,
                              *(segment_ids if segment_ids is not None else (None, None)), p.alibi, p.dropout_seed)
        ctx.mask_args = dict(q_offset=q_offset, k_offset=k_offset, causal=causal, window=window, chunk=chunk,
                             scale=scale, softcap=softcap, dropout_p=p.dropout_p,
                             dropout_head_offset=p.dropout_head_offset)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, key_mask, seg_q, seg_k, alibi, seed = ctx.saved_tensors
        p = _prepare(q, k, v, key_mask=key_mask, segment_ids=None if seg_q is None else (seg_q, seg_k),
                     alibi_slopes=alibi, dropout_seed=seed, **ctx.mask_args)
        dq, dk, dv = _backward(p, dout, out, lse, None, q.dtype)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None, None


def triton_attention(q, k, v, *, q_offset=0, k_offset=0, causal=False, window=None, chunk=0, key_mask=None,
                     segment_ids=None, scale=None, softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None,
                     dropout_head_offset=0):
    """Differentiable attention through the Triton kernels; out in q's dtype (see TritonAttentionFunction)."""
    return TritonAttentionFunction.apply(q, k, v, q_offset, k_offset, causal, window, key_mask, segment_ids, scale,
                                         softcap, chunk, alibi_slopes, dropout_p, dropout_seed, dropout_head_offset)
