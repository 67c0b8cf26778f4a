"""Attention between two local tensors made of *pieces* of the global sequence.

Every strategy ends up holding queries and keys whose positions are a few runs of the global
sequence: a rank's shard (one run for ``contiguous``, two for ``zigzag``), a ring neighbour's shard, the
concatenation of every rank's shard after an all-gather or all-to-all. A :class:`Piece` names one run
(where it sits in the local tensor, where it starts globally); :func:`attend` computes every visible
(query piece, key piece) pair through :func:`~.local.local_attention` at the pieces' global offsets and
merges the results into running ``(out, lse)`` accumulators; pairs the mask hides are skipped before any
call. :func:`attend_backward` is its gradient. Both take *head segments* so a rank can hold query heads
of several GQA groups in proportions a single ``H // Hkv`` mapping cannot describe (Ulysses' uneven
head split): each segment is a uniform GQA block of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..layouts import SequenceLayout
from .call import Scoring
from .local import empty_result, local_attention, local_attention_backward
from .masks import Visibility
from .merge import merge_attention_

__all__ = ["Piece", "HeadSegment", "pieces", "attend", "attend_backward", "empty_result"]


@dataclass(frozen=True)
class Piece:
    """A run of consecutive global positions held consecutively in a local tensor."""

    local: int
    """Index of its first position in the local tensor (along the sequence dim)."""
    start: int
    """Global position of its first element."""
    length: int
    """Number of positions."""

    @property
    def rows(self) -> slice:
        return slice(self.local, self.local + self.length)


@dataclass(frozen=True)
class HeadSegment:
    """Query heads ``[q_lo, q_hi)`` that read kv heads ``[kv_lo, kv_hi)`` as a uniform GQA block."""

    q_lo: int
    q_hi: int
    kv_lo: int
    kv_hi: int

    @property
    def q(self) -> slice:
        return slice(self.q_lo, self.q_hi)

    @property
    def kv(self) -> slice:
        return slice(self.kv_lo, self.kv_hi)

    @staticmethod
    def all(heads: int, kv_heads: int) -> tuple["HeadSegment", ...]:
        """The usual case: every query head, every kv head."""
        return (HeadSegment(0, heads, 0, kv_heads),)


def pieces(layout: SequenceLayout, ranks: Sequence[int]) -> tuple[Piece, ...]:
    """The pieces of a local tensor that concatenates the shards of ``ranks`` (in that order) of ``layout``.
    Runs that are adjacent both locally and globally are joined."""
    out: list[Piece] = []
    local = 0
    for rank in ranks:
        for start, end in layout.local_intervals(rank):
            last = out[-1] if out else None
            if last is not None and last.start + last.length == start:
                out[-1] = Piece(last.local, last.start, last.length + end - start)
            else:
                out.append(Piece(local, start, end - start))
            local += end - start
    return tuple(out)


def _mask_args(q_piece: Piece, k_piece: Piece, key_mask, seg_q, seg_k) -> dict:
    return {
        "key_mask": None if key_mask is None else key_mask[:, k_piece.rows],
        "segment_ids": None if seg_q is None else (seg_q[:, q_piece.rows], seg_k[:, k_piece.rows]),
    }


def _computed_pairs(q_pieces, k_pieces, scoring: Scoring):
    """The (query piece, key piece) pairs to compute: those the position mask does not hide. Without a position mask
    or positional terms, positions do not matter: pieces adjacent in the local tensor are one (one call per run of
    local rows instead of one per piece pair)."""
    spec = scoring.spec
    if not spec.is_positional and not scoring.terms.positional:
        for qp in _local_runs(q_pieces):
            for kp in _local_runs(k_pieces):
                yield qp, kp
        return
    for qp in q_pieces:
        for kp in k_pieces:
            if spec.classify(qp.start, qp.length, kp.start, kp.length) is not Visibility.HIDDEN:
                yield qp, kp


def _local_runs(parts: Sequence[Piece]) -> list[Piece]:
    """The pieces with those adjacent in the local tensor joined (their global starts become meaningless: only for
    position-free masks)."""
    out: list[Piece] = []
    for p in parts:
        if out and out[-1].local + out[-1].length == p.local:
            out[-1] = Piece(out[-1].local, 0, out[-1].length + p.length)
        else:
            out.append(Piece(p.local, 0, p.length))
    return out


def attend(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           q_pieces: Sequence[Piece], k_pieces: Sequence[Piece], *, heads: Sequence[HeadSegment],
           key_mask: torch.Tensor | None, seg_q: torch.Tensor | None, seg_k: torch.Tensor | None,
           scoring: Scoring) -> None:
    """Merge the attention of ``q`` (``q_pieces``) to ``k``/``v`` (``k_pieces``) into ``out``/``lse`` in place.

    ``key_mask``/``seg_k`` are per key of ``k``; ``seg_q`` per query of ``q``. ``scoring``: the call's mask, scale,
    soft cap, score terms (for ``q``'s heads, :mod:`.terms`) and kernels; a soft cap (0: none) caps every block's
    scores alike: it is elementwise, so the LSE merge of the blocks is unchanged.
    """
    for qp, kp in _computed_pairs(q_pieces, k_pieces, scoring):
        masks = _mask_args(qp, kp, key_mask, seg_q, seg_k)
        for hs in heads:
            block_out, block_lse = local_attention(
                q[:, hs.q, qp.rows], k[:, hs.kv, kp.rows], v[:, hs.kv, kp.rows], q_offset=qp.start,
                k_offset=kp.start, **scoring.heads(hs.q_lo, hs.q_hi).local_kwargs(), **masks)
            merge_attention_(out[:, hs.q, qp.rows], lse[:, hs.q, qp.rows], block_out, block_lse,
                             kernels=scoring.kernels)


def attend_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dout: torch.Tensor, q: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                    q_pieces: Sequence[Piece], k_pieces: Sequence[Piece], *, heads: Sequence[HeadSegment],
                    key_mask: torch.Tensor | None, seg_q: torch.Tensor | None, seg_k: torch.Tensor | None,
                    scoring: Scoring) -> None:
    """Add the gradients of :func:`attend`'s blocks into ``dq`` (per query) and ``dk``/``dv`` (per key).

    ``out``/``lse`` are the rows' final values, ``delta = rowsum(dout * out)``.
    """
    for qp, kp in _computed_pairs(q_pieces, k_pieces, scoring):
        masks = _mask_args(qp, kp, key_mask, seg_q, seg_k)
        for hs in heads:
            rows, keys = (slice(None), hs.q, qp.rows), (slice(None), hs.kv, kp.rows)
            head_scoring = scoring.heads(hs.q_lo, hs.q_hi)
            gq, gk, gv = local_attention_backward(
                dout[rows], q[rows], k[keys], v[keys], out[rows], lse[rows], delta=delta[rows], q_offset=qp.start,
                k_offset=kp.start, position_bias_grad=head_scoring.terms.position_bias_grad,
                **head_scoring.local_kwargs(), **masks)
            dq[rows] += gq
            dk[keys] += gk
            dv[keys] += gv
