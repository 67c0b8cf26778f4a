"""Linear recurrences: the gated delta rule, Mamba2's chunked scan and Mamba (1)'s selective scan
(``autoshard::gated_delta_rule``, ``autoshard::ssd_chunk_scan``, ``autoshard::selective_scan``, recorded by
:mod:`autoshard.recognized`), one canonical op ``recurrence``.

A recurrence's sequence inputs (the delta rule's query, key, value, decay and beta; the scans' ``x``, ``dt``, ``B``,
``C`` and the selective scan's gate ``z``) carry one sequence on dim 1, the same positions as its output (its first
result); its other inputs (the scans' ``A``, ``D``, ``dt_bias``) and its second result, the final state, have
none. Link: those dims are one family.
Rewrite: with the sequence split, every sequence input is taken in the output's layout, the others whole, and the call
becomes :func:`~autoshard.runtime.recurrence.split_recurrence` -- each rank runs its pieces, one all-gather of every
piece's state (independent of the length) passes the state along, and the final state is the whole sequence's on
every rank (booked in the byte book); an initial state (a cache's, when a prompt is continued) is taken whole and
starts the first piece. Not split, it runs whole; so does a call over packed documents (a kernel's ``cu_seqlens`` or
``seq_idx``), recorded as a fallback.
"""

from __future__ import annotations

from ...placements import REPLICATE
from ...runtime.accounting import reduce_scatter_bytes
from ...runtime.attention.formulas import P
from ...runtime.recurrence import RECURRENCES, pieces_per_rank, split_recurrence, state_passing_bytes
from ..comms import Comm, declares
from ..ops import op_of, value_of
from .pointwise import TUPLE_LINKS, run_whole
from .registry import register

__all__ = ["STATE_PASSING"]  # the rules register themselves on import

STATE_PASSING = "recurrent state passing"
"""The reason the byte book gives a recurrence's state passing (what :func:`autoshard.explain` counts)."""


def link_recurrence(ctx, node, op):
    first, *rest = op["sequence"]
    ctx.seed_weakly((first, 1, 0))  # a model of recurrences alone (Mamba) is split too
    for x in rest:
        if x is not None:  # the selective scan's gate is optional
            ctx.link_dims(x, 1, first, 1)


def _link_output(ctx, producer, op, index, node):
    if index == 0:
        values = op["sequence"][RECURRENCES[op["kind"]].values]
        ctx.set_factorization(node, [list(f) for f in ctx.factorization(values)])
        ctx.link_dims(node, 1, values, 1)


def rewrite_recurrence(rw, node, op):
    out = rw.out_shard(op["sequence"][0])
    if out is None or out.dim != 1 or out.factors:
        run_whole(rw, node, "" if out is None else "the recurrence's sequence is a merged dim")
        return
    if op["packed"] is not None:
        run_whole(rw, node, "a recurrence over packed documents (cu_seqlens, seq_idx): state passing does not restart "
                            "the state at their boundaries yet")
        return
    sequence = [rw.input(x, out) if x is not None else None for x in op["sequence"]]
    others = [rw.input(x, REPLICATE, partial_grad=True) if x is not None else None
              for x in op["others"] + [op["initial_state"]]]
    new = rw.call(split_recurrence, op["kind"], sequence, others[:-1], others[-1], list(op["config"]),
                  out.layout.encode(), rw.rank, rw.groups.sequence)
    rw.done(node, new, (out, REPLICATE))


register("recurrence", link=link_recurrence, rewrite=rewrite_recurrence)
TUPLE_LINKS["recurrence"] = _link_output


@declares(split_recurrence)
def _state_passing(book, call) -> None:
    """The all-gather of every piece's widened state (forward) and the reduce-scatter of their gradients (backward):
    ``(P - 1)`` times a rank's states, however long the sequence."""
    op = op_of(call.value)  # the original call: (output, final state)
    recurrence, state = RECURRENCES[op["kind"]], value_of(call.value)[1]
    sequence = [value_of(x) if x is not None else None for x in op["sequence"]]
    row = state_passing_bytes(recurrence.summary_shape(sequence), pieces_per_rank(call.layout()), state.element_size())
    book.all_gather_rows(call.value.name, row, "forward", STATE_PASSING, (P - 1) * row)
    if call.needs_grad:
        book.comms.append(Comm("reduce_scatter", call.value.name, "backward",
                               [reduce_scatter_bytes(row, book.world)] * book.world, (P - 1) * row,
                               reason=STATE_PASSING))
