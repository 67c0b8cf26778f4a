"""The runtime: what runs on every rank.

* :mod:`~autoshard.runtime.collectives` -- autograd-aware, traceable collectives (custom ops);
* :mod:`~autoshard.runtime.layouts` / :mod:`~autoshard.runtime.sequence` -- sequence layouts and
  moving tensors between whole and sharded;
* :mod:`~autoshard.runtime.accounting` -- the byte counter every collective reports to.
* :mod:`~autoshard.runtime.attention` -- distributed attention (ring, zigzag, all-gather, Ulysses,
  hybrid) over one local primitive with global offsets; :func:`attention` is its public entry point.
* :mod:`~autoshard.runtime.redistribute` / :mod:`~autoshard.runtime.random` -- the ops the compiler
  inserts (partial sums, gradient syncs, realigns, sharded cumsum and dropout);
  :mod:`~autoshard.runtime.sequence_ops` -- positions chosen by data (``argmax`` along the split sequence,
  rows read there) and the guard on a buffer read as a mask; :mod:`~autoshard.runtime.conv_halo` -- the
  windows (own positions plus halos) a convolution along the split sequence reads.
* :mod:`~autoshard.runtime.carrier` -- the base of the tensor subclasses that carry a value in another form:
  split along the sequence (:mod:`~autoshard.runtime.split_tensor`), left uncomputed
  (:mod:`~autoshard.runtime.deferred`), computed on first read (:mod:`~autoshard.runtime.lazy_linear`);
  :mod:`autoshard.boundary` hands them across graph boundaries.
"""

from .accounting import CommCounter, comm_counter
from .attention import attention
from .collectives import RingCommunicator, all_gather, all_reduce, all_to_all, reduce_scatter
from .groups import resolve_group
from .layouts import SequenceLayout
from .sequence import sequence_positions, shard_sequence, unshard_sequence

__all__ = [
    "attention",
    "comm_counter",
    "CommCounter",
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_to_all",
    "RingCommunicator",
    "resolve_group",
    "SequenceLayout",
    "shard_sequence",
    "unshard_sequence",
    "sequence_positions",
]
