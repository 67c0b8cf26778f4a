"""Linear recurrences: the gated delta rule (``autoshard::gated_delta_rule``, recorded by :mod:`autoshard.recognized`).

The recurrence's inputs -- query, key and value ``[B, S, H, D]``, decay ``g`` and ``beta`` ``[B, S, H]`` -- carry one
sequence on dim 1, the same positions as its output (its first result); its second result, the final state, has none.
Link: those dims are one family. Rewrite: with the sequence split, every input is taken in the output's layout and the
call becomes :func:`~autoshard.runtime.recurrence.split_gated_delta_rule` -- each rank runs its pieces, one
all-gather of every piece's state (independent of the length) passes the state along, and the final state is the
whole sequence's on every rank (booked in the byte book). Not split, it runs whole. An initial state (a cache's,
when a prompt is continued) is not passed along yet: such a call runs whole, recorded as a fallback.
"""

from __future__ import annotations

from ...placements import REPLICATE
from ...runtime.recurrence import split_gated_delta_rule, state_passing_bytes
from ...runtime.accounting import reduce_scatter_bytes
from ...runtime.attention.formulas import P
from ..comms import Comm, declares
from ..ops import value_of
from .pointwise import TUPLE_LINKS, run_whole
from .registry import register

__all__: list[str] = []  # the rules register themselves on import; nothing here is called from outside

_SEQUENCE_INPUTS = ("q", "k", "v", "g", "beta")


def link_recurrence(ctx, node, op):
    for name in _SEQUENCE_INPUTS[1:]:
        ctx.link_dims(op[name], 1, op["q"], 1)


def _link_output(ctx, producer, op, index, node):
    if index == 0:
        ctx.set_factorization(node, [list(f) for f in ctx.factorization(op["v"])])
        ctx.link_dims(node, 1, op["v"], 1)


def rewrite_recurrence(rw, node, op):
    out = rw.out_shard(op["q"])
    if out is None or out.dim != 1 or out.factors:
        run_whole(rw, node, "" if out is None else "the recurrence's sequence is a merged dim")
        return
    if op["initial_state"] is not None:
        run_whole(rw, node, "a recurrence from an initial state")
        return
    inputs = [rw.input(op[name], out) for name in _SEQUENCE_INPUTS]
    new = rw.call(split_gated_delta_rule, *inputs, op["implementation"], op["chunk_size"], op["use_qk_l2norm"],
                  out.layout.encode(), rw.rank, rw.groups.sequence)
    rw.done(node, new, (out, REPLICATE))


register("gated_delta_rule", link=link_recurrence, rewrite=rewrite_recurrence)
TUPLE_LINKS["gated_delta_rule"] = _link_output


@declares(split_gated_delta_rule)
def _state_passing(book, call) -> None:
    """The all-gather of every piece's ``[E | M]`` state (forward) and the reduce-scatter of their gradients
    (backward): ``(P - 1)`` times a rank's states, however long the sequence."""
    state = value_of(call.value)[1]  # the original call's (out, final state); the state is [B, H, Dk, Dv]
    batch, heads, key_dim, value_dim = state.shape
    layout = call.layout()
    pieces = max(len(layout.local_intervals(r)) for r in range(layout.world_size))
    row = state_passing_bytes(batch, heads, key_dim, value_dim, pieces, state.element_size())
    book.all_gather_rows(call.value.name, row, "forward", "recurrent state passing", (P - 1) * row)
    if call.needs_grad:
        book.comms.append(Comm("reduce_scatter", call.value.name, "backward",
                               [reduce_scatter_bytes(row, book.world)] * book.world, (P - 1) * row,
                               reason="recurrent state passing"))
