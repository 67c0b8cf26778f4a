"""The annotation markers of ``autoshard/annotations.py``.

``mark_sequence`` seeds a family at the marked dim; ``token_local_enter`` / ``_exit`` pass values through
(the region between them is handled by the linker and the rewriter); ``whole`` gathers its input.
"""

from __future__ import annotations

from ...placements import REPLICATE
from .registry import register
from .pointwise import link_nothing, link_same, rewrite_same

__all__: list[str] = []  # the rules register themselves on import; nothing here is called from outside


def link_mark_sequence(ctx, node, op):
    link_same(ctx, node, op)
    ctx.seed((op["input"], op["dim"], 0))


register("mark_sequence", link=link_mark_sequence, rewrite=rewrite_same)
register("token_local_enter", "token_local_exit", link=link_same, rewrite=rewrite_same)


def rewrite_whole(rw, node, op):
    rw.done(node, rw.reemit(node, (rw.input(op["input"], REPLICATE, reason="autoshard.whole"),)), REPLICATE)


register("whole", link=link_nothing, rewrite=rewrite_whole)
