"""The cost model picks what the issue asks for on synthetic hardware profiles, and says why."""

import pytest
import torch

from autoshard.config import STRATEGY_CHOICES
from autoshard.cost import NEAR_TIE, attention_costs, choose_strategy
from autoshard.hardware import HardwareProfile
from autoshard.runtime.attention import STRATEGIES, MaskSpec
from autoshard.runtime.attention.base import AttentionShape
from autoshard.strategy import LONGEST, deciding, length_class
from autoshard.config import BackendConfig


def _shape(seq, heads, kv_heads, head_dim, dtype, causal):
    return AttentionShape(batch=1, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                          mask=MaskSpec(causal=causal))


def _pick(world, heads, causal, hardware=HardwareProfile(), seq=1 << 16, kv_heads=8, hybrid_possible=True,
          budget=None):
    shape = _shape(seq, heads, kv_heads, 128, torch.bfloat16, causal)
    return choose_strategy(attention_costs(shape, world, hardware, hybrid_possible=hybrid_possible,
                                           memory_budget=budget))


def test_ulysses_when_heads_suffice_and_bandwidth_is_high():
    for causal in (True, False):
        best, why = _pick(8, 32, causal)
        assert best.strategy == "ulysses", why
        assert "heads" in why and "zigzag" in why  # the alternatives are named with their cost


def test_ring_when_ranks_exceed_heads_zigzag_if_causal():
    best, why = _pick(16, 8, True, HardwareProfile(ranks_per_node=16))
    assert best.strategy == "zigzag" and "ulysses impossible" in why, why
    best, why = _pick(16, 8, False, HardwareProfile(ranks_per_node=16))
    assert best.strategy == "ring", why


def test_hybrid_when_the_group_spans_nodes():
    best, why = _pick(64, 32, True, seq=1 << 20)
    assert best.strategy == "hybrid" and best.mesh == (8, 8), why
    # without a 2-D mesh the hybrid is not possible and a ring takes over
    best, why = _pick(64, 32, True, seq=1 << 20, hybrid_possible=False)
    assert best.strategy == "zigzag" and "2-D device mesh" in why, why


def test_memory_budget_rules_out_gathering_kv():
    costs = attention_costs(_shape(1 << 22, 8, 8, 128, torch.bfloat16, True), 16, HardwareProfile(),
                            memory_budget=4 * 2**30)
    allgather = next(c for c in costs if c.strategy == "allgather")
    assert not allgather.feasible and "budget" in allgather.why_not


def test_with_head_groups_a_near_tie_goes_to_the_leaner_strategy():
    """Llama-8B's causal attention at 8M tokens on 8 ranks in 8 head groups: the fastest (Ulysses) holds a head
    group's whole-sequence copies per rank (a group needs a query head per rank: 4 groups at most); with head
    groups on (``lean``) a strategy within 2% of it that holds less is taken (the ring over the zigzag layout or the
    all-gather: a key/value head per group), and the reason says why; a clear winner stays the winner."""
    shape = _shape(8 << 20, 32, 8, 128, torch.bfloat16, True)
    costs = attention_costs(shape, 8, HardwareProfile(), head_chunks=8)
    fastest, _ = choose_strategy(costs)
    lean, why = choose_strategy(costs, lean=True)
    # the strategies the cost model prices within NEAR_TIE of the fastest (a model's figures, nothing measured)
    tied = {c.strategy: c.memory_bytes for c in costs if c.feasible and c.total_s <= fastest.total_s * (1 + NEAR_TIE)}
    assert fastest.strategy == "ulysses" and lean.strategy in ("zigzag", "allgather"), (fastest, lean)
    assert lean.strategy in tied and tied[lean.strategy] == min(tied.values()) < fastest.memory_bytes, tied
    assert "holds the least for attention" in why, why
    best, _ = _pick(16, 8, True, HardwareProfile(ranks_per_node=16))
    assert choose_strategy(attention_costs(_shape(1 << 16, 8, 8, 128, torch.bfloat16, True), 16,
                                           HardwareProfile(ranks_per_node=16)), lean=True)[0].strategy == best.strategy


def test_short_sequences_cannot_zigzag():
    costs = attention_costs(_shape(6, 8, 8, 16, torch.float32, True), 4, HardwareProfile())
    assert not next(c for c in costs if c.strategy == "zigzag").feasible


def test_a_length_class_ends_where_the_cost_model_switches_strategy():
    """The range a graph of symbolic lengths is guarded to (and the plan prints): the same choice at both ends, another
    one just outside, named."""
    decide = deciding(_shape(4096, 4, 2, 16, torch.float32, True), 4, HardwareProfile(), BackendConfig(),
                      hybrid_possible=True)
    lengths = length_class(4096, decide)
    choice = lambda n: decide(n)[0].strategy  # noqa: E731
    assert lengths.low < 4096 < lengths.high < LONGEST
    assert choice(lengths.low) == choice(lengths.high) == choice(4096) != choice(lengths.high + 1) == lengths.above
    assert lengths.low == 8 and lengths.below == "allgather on the contiguous layout"  # zigzag needs 2P positions


def test_hardware_profile_rejects_values_the_model_would_divide_by():
    for bad in ({"memory_bandwidth": 0}, {"memory_bytes": 0}, {"inter_node_latency": -1e-6}, {"ranks_per_node": 0}):
        with pytest.raises(ValueError, match="HardwareProfile"):
            HardwareProfile(**bad)


def test_config_strategies_are_the_registered_ones_in_order():
    """``config.STRATEGY_CHOICES`` (the option's choices) lists "auto" and the registry, in the cost model's order."""
    assert STRATEGY_CHOICES == ("auto", *STRATEGIES)


def test_every_registered_strategy_is_priced_ranked_and_explained():
    costs = attention_costs(_shape(1 << 16, 32, 8, 128, torch.bfloat16, True), 64, HardwareProfile())
    assert [c.strategy for c in costs] == list(STRATEGIES)
    assert sorted(s.rank for s in STRATEGIES.values()) == list(range(len(STRATEGIES)))
    assert all(s.reason and s.reason in choose_strategy([c])[1] for s, c in zip(STRATEGIES.values(), costs)
               if c.feasible)
