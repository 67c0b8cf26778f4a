"""Host side of the Triton attention kernels: the inputs of one (query block, key block) pair validated into a
:class:`_Problem` (:func:`_prepare`) with its masks normalized for the kernels, and the arguments that the
launchers (:mod:`.attention_forward`, :mod:`.attention_backward`) pass to every kernel (:func:`_kernel_args`).

Normalization. Causal and window masks are one *band* ``i_pos - L <= j_pos <= i_pos + R``, with ``R = min(right,
0)`` under causal (:func:`_band`): a bound no pair of the block can violate is dropped and a block the band hides
entirely is skipped, so a ring step whose keys all lie in the past runs the unmasked specialization. A chunk mask
is dropped when the whole block lies in one chunk, and a block whose queries and keys share no chunk is skipped
(:func:`_chunks`). key_mask becomes uint8 and segment ids one integer dtype; :func:`_sorted_rows` flags, on the
device and without a sync, the batch rows whose ids are sorted (packed documents), whose tile ranges the kernels
narrow to the rows' documents.

Specialization. Both head dims (each padded to a power of two >= 16; any head dim up to 256 works, columns past
it are masked), the band and chunk flags, key_mask / segment presence, soft-capping, ALiBi, dropout and the input
dtype are compile-time constants. Offsets, band widths, sequence lengths and the dropout's head offset and
threshold are runtime values excluded from Triton's integer specialization, so ring steps reuse one compiled
kernel. Block sizes / warps / stages are autotuned per (head dims, bucketed sequence lengths, mask kind, dtype),
pruned to configurations whose shared memory and register estimates fit the device (:mod:`.autotune`).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Optional

import torch

from .autotune import seq_bucket
from .common import INTERPRET, aligned_rows, padded_dim, triton_available

__all__ = ["MAX_HEAD_DIM", "_SUPPORTED_DTYPES", "_Problem", "_prepare", "_kernel_args", "_strides"]

MAX_HEAD_DIM = 256
_MAX_POSITION = 1 << 30  # positions and band widths stay far from int32 overflow inside the kernels
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class _Problem:
    """Validated inputs of one (query block, key block) pair, with the masks normalized for the kernels."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_mask: Optional[torch.Tensor]  # uint8 [B, Sk], contiguous
    seg_q: Optional[torch.Tensor]  # int [B, Sq], contiguous
    seg_k: Optional[torch.Tensor]  # int [B, Sk], contiguous
    q_offset: int
    k_offset: int
    left: int  # band: i_pos - left <= j_pos (when has_left)
    right: int  # band: j_pos <= i_pos + right (when has_right)
    has_left: bool
    has_right: bool
    chunk: int  # chunked local attention: j_pos // chunk == i_pos // chunk (when has_chunk)
    has_chunk: bool
    hidden: bool  # the band or the chunks hide every pair of the block: nothing to compute
    scale: float
    softcap: float  # scaled scores s become softcap * tanh(s / softcap); 0: no capping
    alibi: Optional[torch.Tensor] = None  # float32 [H], contiguous: ALiBi slope per query head
    dropout_p: float = 0.0  # probability of dropping an attention probability; 0: no dropout
    dropout_seed: Optional[torch.Tensor] = None  # 0-d int64 on q's device (when dropout_p > 0)
    dropout_head_offset: int = 0  # global index of q's first head in the dropout hash

    @property
    def shape(self):
        batch, heads, sq, head_dim = self.q.shape
        return batch, heads, self.k.shape[1], sq, self.k.shape[2], head_dim

    @property
    def out_shape(self):
        """Shape of out / dout: [B, H, Sq, Dv], v's head dim."""
        return (*self.q.shape[:3], self.v.shape[3])


def _check_int(name: str, value) -> int:
    value = operator.index(value)  # TypeError for anything that is not an integer
    if abs(value) >= _MAX_POSITION:
        raise ValueError(f"{name}={value} is out of the supported range (|{name}| < 2**30)")
    return value


def _band(causal, window, q_offset: int, sq: int, k_offset: int, sk: int):
    """(left, right, has_left, has_right, hidden) of the band i_pos - left <= j_pos <= i_pos + right
    for this block: a bound no pair of the block can violate is dropped (no masking work for it), and
    hidden is True when the band excludes every pair."""
    left = right = -1
    if window is not None:
        if len(window) != 2:
            raise ValueError(f"window must be a (left, right) pair, got {window!r}")
        left, right = (_check_int("window", w) for w in window)
        if left < -1 or right < -1:
            raise ValueError(f"window bounds must be >= 0, or -1 for unbounded; got {window!r}")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    max_ahead = (k_offset + sk - 1) - q_offset  # largest j_pos - i_pos in the block
    max_behind = (q_offset + sq - 1) - k_offset  # largest i_pos - j_pos
    has_right = 0 <= right < max_ahead
    has_left = 0 <= left < max_behind
    hidden = (right >= 0 and -max_behind > right) or (left >= 0 and -max_ahead > left)
    return max(left, 0), max(right, 0), has_left, has_right, hidden


def _chunks(chunk, q_offset: int, sq: int, k_offset: int, sk: int):
    """(chunk, has_chunk, hidden) of a chunk mask for this block: dropped when every query and key lies in one
    chunk, hidden when the queries and the keys share no chunk."""
    chunk = _check_int("chunk", chunk)
    if chunk < 0:
        raise ValueError(f"chunk must be >= 0 (0: no chunks), got {chunk}")
    if not chunk or sq == 0 or sk == 0:
        return max(chunk, 1), False, False
    q_first, q_last = q_offset // chunk, (q_offset + sq - 1) // chunk
    k_first, k_last = k_offset // chunk, (k_offset + sk - 1) // chunk
    hidden = k_first > q_last or k_last < q_first
    return chunk, not (q_first == q_last == k_first == k_last), hidden


def _key_mask(key_mask, batch: int, sk: int, device):
    if key_mask is None:
        return None
    if key_mask.dtype != torch.bool or tuple(key_mask.shape) != (batch, sk):
        raise ValueError(f"key_mask must be a bool tensor [B, Sk] = {(batch, sk)}, got "
                         f"{key_mask.dtype} {tuple(key_mask.shape)}")
    return key_mask.to(device).contiguous().view(torch.uint8)


def _segments(segment_ids, batch: int, sq: int, sk: int, device):
    if segment_ids is None:
        return None, None
    if len(segment_ids) != 2:
        raise ValueError("segment_ids must be a (seg_q, seg_k) pair")
    seg_q, seg_k = segment_ids
    for seg in (seg_q, seg_k):
        if seg.dtype.is_floating_point or seg.dtype.is_complex or seg.dtype == torch.bool:
            raise TypeError(f"segment ids must be integer tensors, got {seg_q.dtype}, {seg_k.dtype}")
    if tuple(seg_q.shape) != (batch, sq) or tuple(seg_k.shape) != (batch, sk):
        raise ValueError(f"segment_ids must be [B, Sq] = {(batch, sq)} and [B, Sk] = {(batch, sk)}, got "
                         f"{tuple(seg_q.shape)} and {tuple(seg_k.shape)}")
    if seg_q.dtype != seg_k.dtype:
        seg_q, seg_k = seg_q.long(), seg_k.long()
    return seg_q.to(device).contiguous(), seg_k.to(device).contiguous()


def _sorted_rows(seg_q: torch.Tensor, seg_k: torch.Tensor) -> torch.Tensor:
    """``[B]`` uint8, 1 where a batch row's query and key ids are both non-decreasing (packed documents): the kernels
    then visit only the tiles of the rows' documents. Computed on the device, without a sync."""
    def rising(seg):
        return (seg[:, 1:] >= seg[:, :-1]).all(1)

    return (rising(seg_q) & rising(seg_k)).to(torch.uint8)


def _alibi_slopes(alibi_slopes, heads: int, device):
    if alibi_slopes is None:
        return None
    if (not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32
            or tuple(alibi_slopes.shape) != (heads,) or alibi_slopes.device != device):
        got = (f"{alibi_slopes.dtype} {tuple(alibi_slopes.shape)} on {alibi_slopes.device}"
               if isinstance(alibi_slopes, torch.Tensor) else type(alibi_slopes).__name__)
        raise ValueError(f"alibi_slopes must be a 1-D float32 tensor [H] = ({heads},) (one slope per query head) "
                         f"on {device}, got {got}")
    return alibi_slopes.detach().contiguous()


def _dropout(dropout_p, dropout_seed, dropout_head_offset, device):
    """(p, seed, head_offset) of the dropout, validated; p 0 turns it off (the seed is then ignored)."""
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1) (0: no dropout), got {dropout_p}")
    if p == 0.0:
        return 0.0, None, 0
    if (not isinstance(dropout_seed, torch.Tensor) or dropout_seed.dtype != torch.int64 or dropout_seed.dim() != 0
            or dropout_seed.device != device):
        got = (f"{dropout_seed.dtype} {tuple(dropout_seed.shape)} on {dropout_seed.device}"
               if isinstance(dropout_seed, torch.Tensor) else type(dropout_seed).__name__)
        raise ValueError(f"dropout_seed must be a 0-d int64 tensor on {device} when dropout_p > 0, got {got}")
    head_offset = _check_int("dropout_head_offset", dropout_head_offset)
    if head_offset < 0:
        raise ValueError(f"dropout_head_offset must be >= 0, got {head_offset}")
    return p, dropout_seed.detach(), head_offset


def _prepare(q, k, v, *, q_offset, k_offset, causal, window, chunk, key_mask, segment_ids, scale,
             softcap, alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_head_offset=0) -> _Problem:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, heads, S, D], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"Triton attention supports float16, bfloat16 and float32 inputs; {name} is {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not triton_available(q.device):
        raise RuntimeError(f"Triton attention kernels cannot run on {q.device}: they need a CUDA device, or "
                           "TRITON_INTERPRET=1 set before autoshard.kernels.attention is imported (CPU)")
    batch, heads, sq, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k must be [B, Hkv, Sk, D] and v [B, Hkv, Sk, Dv] matching q {tuple(q.shape)}, got "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    kv_heads, sk = k.shape[1], k.shape[2]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"the number of query heads ({heads}) must be a multiple of the kv heads ({kv_heads})")
    for name, dim in (("head dim", head_dim), ("v head dim", v.shape[3])):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name} {dim} is not supported by the Triton kernels (1..{MAX_HEAD_DIM}; "
                             f"non-powers of two are padded); use kernels='torch'")
    q_offset = _check_int("q_offset", q_offset)
    k_offset = _check_int("k_offset", k_offset)
    _check_int("q_offset + Sq", q_offset + sq)
    _check_int("k_offset + Sk", k_offset + sk)
    left, right, has_left, has_right, hidden = _band(causal, window, q_offset, sq, k_offset, sk)
    chunk, has_chunk, chunks_hidden = _chunks(chunk, q_offset, sq, k_offset, sk)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not scale > 0.0 or not math.isfinite(scale):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    softcap = float(softcap)
    if not (softcap >= 0.0 and math.isfinite(softcap)):
        raise ValueError(f"softcap must be a finite number >= 0 (0: no capping), got {softcap}")
    seg_q, seg_k = _segments(segment_ids, batch, sq, sk, q.device)
    alibi = _alibi_slopes(alibi_slopes, heads, q.device)
    dropout_p, dropout_seed, dropout_head_offset = _dropout(dropout_p, dropout_seed, dropout_head_offset, q.device)
    return _Problem(q=aligned_rows(q), k=aligned_rows(k), v=aligned_rows(v),
                    key_mask=_key_mask(key_mask, batch, sk, q.device), seg_q=seg_q, seg_k=seg_k,
                    q_offset=q_offset, k_offset=k_offset, left=left, right=right, has_left=has_left,
                    has_right=has_right, chunk=chunk, has_chunk=has_chunk, hidden=hidden or chunks_hidden,
                    scale=scale, softcap=softcap, alibi=alibi, dropout_p=dropout_p, dropout_seed=dropout_seed,
                    dropout_head_offset=dropout_head_offset)


def _kernel_args(p: _Problem):
    """Keyword arguments shared by the forward and both backward kernels."""
    batch, heads, kv_heads, sq, sk, head_dim = p.shape
    v_dim = p.out_shape[3]
    placeholder = p.q  # never dereferenced when the matching HAS_* flag is off
    return dict(
        KeyMask=p.key_mask if p.key_mask is not None else placeholder,
        SegQ=p.seg_q if p.seg_q is not None else placeholder,
        SegK=p.seg_k if p.seg_k is not None else placeholder,
        SegSorted=_sorted_rows(p.seg_q, p.seg_k) if p.seg_q is not None else placeholder,
        Alibi=p.alibi if p.alibi is not None else placeholder,
        Seed=p.dropout_seed if p.dropout_seed is not None else placeholder,
        num_heads=heads, kv_group=heads // kv_heads, Sq=sq, Sk=sk, q_offset=p.q_offset, k_offset=p.k_offset,
        left=p.left, right=p.right, chunk=p.chunk, scale=p.scale, qk_cap=p.softcap / p.scale if p.softcap else 1.0,
        SQ_BUCKET=seq_bucket(sq), SK_BUCKET=seq_bucket(sk),
        drop_head_offset=p.dropout_head_offset, drop_threshold=round(p.dropout_p * 2**24),
        drop_scale=1.0 / (1.0 - p.dropout_p), HEAD_DIM=head_dim, BLOCK_D=padded_dim(head_dim),
        V_DIM=v_dim, BLOCK_DV=padded_dim(v_dim),
        HAS_LEFT=p.has_left, HAS_RIGHT=p.has_right, HAS_CHUNK=p.has_chunk, HAS_KEY_MASK=p.key_mask is not None,
        HAS_SEG=p.seg_q is not None, SOFTCAP=p.softcap > 0.0, HAS_ALIBI=p.alibi is not None,
        HAS_DROPOUT=p.dropout_p > 0.0,
        DOT_PRECISION=_dot_precision(p.q.dtype),
    )


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "ieee"
    return "upcast" if INTERPRET and dtype == torch.bfloat16 else "tf32"


def _strides(prefix: str, x: torch.Tensor):
    return {f"stride_{prefix}b": x.stride(0), f"stride_{prefix}h": x.stride(1), f"stride_{prefix}s": x.stride(2)}
