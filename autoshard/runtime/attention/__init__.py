"""Distributed attention: ring, zigzag ring, all-gather K/V, Ulysses and 2-D hybrid, forward and backward.

    from autoshard.runtime import attention, shard_sequence
    q, k, v = (shard_sequence(t, 2, layout="zigzag") for t in (q_full, k_full, v_full))
    out = attention(q, k, v, strategy="zigzag", layout="zigzag", causal=True, seq_len=q_full.size(2))

Structure (one file per concern; the strategies share everything below them):

* :mod:`.api` -- the public :func:`attention` and the custom ops ``autoshard::attention`` /
  ``autoshard::attention_backward`` (fake implementations, registered autograd) the compiler emits;
* :mod:`.ring`, :mod:`.zigzag`, :mod:`.allgather`, :mod:`.ulysses`, :mod:`.hybrid` -- the strategies,
  each with ``_check``, ``_forward``, ``_backward``, its byte formulas and cost, its registration
  (:class:`.base.Strategy`) and one public function;
* :mod:`.blocks` -- attention between local tensors made of pieces of the global sequence;
* :mod:`.local` -- the one local primitive (:func:`local_attention`), Triton or torch; LSE in base e;
  it applies ``softcap`` (Gemma2's ``softcap * tanh(s / softcap)`` on the scaled scores, before the
  mask), which every strategy passes through unchanged: elementwise on scores, it leaves the merge as is;
* :mod:`.merge` -- the fp32 LSE merge; :mod:`.masks` -- structured masks and block classification;
* :mod:`.formulas` -- bytes sent per rank as sympy expressions (for the planner): the shared symbols,
  and lookups of each strategy's formulas;
* :mod:`.flops` -- attention FLOPs per rank, counted.

Chunked local attention (``chunk=C``: query ``i`` sees key ``j`` only if ``i // C == j // C``, Llama-4's
local layers) is block-diagonal, and every strategy skips its hidden blocks through the one
classification of :class:`.masks.MaskSpec` (a block whose query and key positions share no chunk is
hidden): the ring and the zigzag ring skip each (query piece, key piece) pair of a step that shares no
chunk -- no compute, but the K/V block still travels on, since later ranks may need it; the all-gather,
Ulysses and the hybrid attend their queries to the gathered pieces and skip the pieces outside the
queries' chunks; inside a block :func:`local_attention` skips the tiles outside the chunks and masks
the tiles that straddle a chunk boundary (the Triton kernels narrow each query tile's key range to its
chunks, the same per key tile in the backward).
"""

# registers the strategies, in the order the cost model lists them (that of config.STRATEGY_CHOICES)
from . import ring, zigzag, allgather, ulysses, hybrid  # noqa: F401, I001
from .allgather import allgather_attention
from .api import attention
from .base import STRATEGIES
from .call import AttentionInputError
from .flops import AttentionFlops, attention_flops
from .hybrid import hybrid_attention, hybrid_axes, hybrid_layout, hybrid_sequence_rank
from .local import local_attention, local_attention_backward
from .masks import MaskSpec, Visibility
from .merge import merge_attention
from .ring import ring_attention
from .ulysses import ulysses_attention
from .zigzag import zigzag_attention

__all__ = [
    "attention",
    "ring_attention",
    "zigzag_attention",
    "allgather_attention",
    "ulysses_attention",
    "hybrid_attention",
    "hybrid_axes",
    "hybrid_layout",
    "hybrid_sequence_rank",
    "local_attention",
    "local_attention_backward",
    "merge_attention",
    "MaskSpec",
    "Visibility",
    "attention_flops",
    "AttentionFlops",
    "AttentionInputError",
    "STRATEGIES",
]
