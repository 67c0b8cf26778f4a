"""Packed documents placed by their lengths (:mod:`autoshard.runtime.placement`), on one process: where the documents
go, which layouts a call swaps, and when it keeps the compiled layout. The placed runs (exact against one process,
bytes counted) are in ``tests/e2e/test_packed_documents.py``."""

import torch

from autoshard.runtime import SequenceLayout
from autoshard.runtime.attention.masks import MaskSpec
from autoshard.runtime.layouts import placing
from autoshard.runtime.placement import Documents, Placement, document_layout
from autoshard.testing.data import long_tail


def _ids(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]


def _documents(root: SequenceLayout) -> Documents:
    return Documents(root.kind, root.world_size, MaskSpec.of(True), key_row=2 * 2 * 32, query_row=8 * 32,
                     result_row=8 * 33)


def _whole(layout: SequenceLayout, start: int, end: int) -> bool:
    return any(s <= start and end <= e for s, e, _ in layout.spans)


def test_short_documents_stay_whole_and_long_ones_split_zigzag():
    lengths = [300, 5000, 700, 120, 900, 400, 1000, 2000, 2000, 3964]  # 16384 tokens, one long document
    root = SequenceLayout.zigzag(16384, 4)
    layout = document_layout(root, _ids(lengths))
    assert layout.local_lengths == root.local_lengths
    assert layout.owner(0) == root.owner(0) and layout.owner(16383) == root.owner(16383)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    cut = [n for n, s in zip(lengths, starts) if not _whole(layout, s, s + n)]
    assert 5000 in cut and len(cut) <= len(lengths) // 2, cut  # the long ones, and those the ranks' room cuts
    long = starts[1]
    # a third of the work over two ranks: its 4 chunks, chunks j and 3-j on one rank
    owners = [layout.owner(long + i * 1250) for i in range(4)]
    assert owners[0] == owners[3] != owners[1] == owners[2], owners


def test_a_call_swaps_the_layout_and_every_layout_derived_from_it():
    root = SequenceLayout.zigzag(4096, 2)
    ids = _ids(long_tail(4096, 3))
    placement = Placement.of(_documents(root), ids)
    assert placement is not None and placement.layout != root
    derived = [(-1, 4096), (1, 4096), (-16, 4112), (3, 4093)]  # labels shifted either way, 16 tokens prepended
    with placing(placement.swaps):
        assert SequenceLayout.decode(root.encode()) == placement.layout
        for offset, length in derived:  # recognized from its cuts, swapped for the same derivation
            compiled = root.derive(offset, length)
            placed = SequenceLayout.decode(compiled.encode())
            assert placed == placement.layout.derive(offset, length) != compiled
            assert placed.local_lengths == compiled.local_lengths
        other = SequenceLayout.contiguous(4096, 2)  # not derived from the root: itself
        assert SequenceLayout.decode(other.encode()) == other
    assert SequenceLayout.decode(root.encode()) == root  # outside the call: the compiled layout


def test_the_compiled_layout_is_kept_where_placing_sends_no_less():
    root = SequenceLayout.zigzag(4096, 2)
    aligned = [256] * 16  # every document whole inside a zigzag chunk: nothing moves as compiled
    assert Placement.of(_documents(root), _ids(aligned)) is None
    placed = 0
    for row in range(1, 6):  # the long-tail mix at P = 4: placed where it sends less, and then less
        root = SequenceLayout.zigzag(32768, 4)
        documents, ids = _documents(root), _ids(long_tail(32768, row))
        placement = Placement.of(documents, ids)
        if placement is not None:
            placed += 1
            assert documents.busiest_elements(placement.layout, ids) < documents.busiest_elements(root, ids)
    assert placed >= 4


def test_one_document_over_every_rank_keeps_the_zigzag_layout():
    root = SequenceLayout.zigzag(1000, 4)
    assert document_layout(root, _ids([1000])) == root
    assert document_layout(SequenceLayout.contiguous(1000, 4), _ids([1000])) is None  # first and last rank differ
