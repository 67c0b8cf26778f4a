"""The plan's memory per rank: the predicted peak against the peak measured on 2 ranks, and the arithmetic of the
planning options (``dp_shard``, ``optimizer``).

Measured: the peak resident set of each rank's process during the second forward + backward of the compiled
model (``autoshard.testing.memory.peak_memory``; workers with ``MALLOC_MMAP_THRESHOLD_=65536``), plus the
parameters, resident before it. Bytes, never time, so the comparison does not depend on the machine's load. The
model is a transformers Llama from its config returning its loss, on P=2: with a vocabulary of 32000 at S=2048
(the LM head and loss dominate, as they do at long context) the whole loss, the same with gradient checkpointing,
and the chunked loss; with a vocabulary of 1024 at S=4096, checkpointed layers and the chunked loss, whose peak is a
layer recomputed in backward -- and the same, hidden 512, tiled, with Ulysses attention whole or in 2 head groups:
the peak is then the attention's backward (whole; in 2 groups a collective's at this length), whose head-split
copies the plan counts (``Strategy.working_set``; at S=8192 both peaks are the attention's: 256.3 / 240.3 MiB
predicted, 265.5 / 249.4 measured); hidden 512 at S=8192 with the all-gather, 2 head groups with their projections,
recomputed layers and tiles, at 2 and 4 ranks: 218.2 / 180.1 MiB predicted, 233.7 / 188.5 measured. In the slow tier
also a mixture-of-experts model (Qwen3-MoE: 135.2 MiB predicted,
134.9 measured) and a hybrid of Gated DeltaNet and attention layers with experts (Qwen3-Next: 192.6 / 191.5 MiB).
"""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.planner import Plan
from autoshard.testing import run_on_ranks
from autoshard.testing.memory import LOW_MMAP_THRESHOLD_ENV, peak_memory

transformers = pytest.importorskip("transformers")

WORLD = 2
TOLERANCE = 0.15
"""Measured 0.0% to 4% from the peaks (the simulated step frees what the run frees, when it frees it); 15% is the
issue's target and leaves room for allocator and library versions."""

CASES = {"checkpointed layers": ("llama", 1024, 256, 4096, True, {}),
         "ulysses": ("llama", 1024, 512, 4096, True, {"strategy": "ulysses", "tile_tokens": 256}),
         "ulysses head groups": ("llama", 1024, 512, 4096, True, {"strategy": "ulysses", "tile_tokens": 256,
                                                                   "head_chunks": 2}),
         "whole loss": ("llama", 32000, 128, 2048, False, {"chunk_loss": None}),
         "checkpointed": ("llama", 32000, 128, 2048, True, {"chunk_loss": None}),
         "experts": ("qwen3_moe", 1024, 256, 2048, False, {}),
         "linear attention and experts": ("qwen3_next", 1024, 256, 2048, False, {}),
         "chunked": ("llama", 32000, 128, 2048, False, {}),
         "projections in head groups": ("llama", 1024, 512, 8192, False,
                                        {"strategy": "allgather", "tile_tokens": 512, "head_chunks": 2,
                                         "recompute": "layers"}),
         "projections in head groups at 4": ("llama", 1024, 512, 8192, False,
                                             {"strategy": "allgather", "tile_tokens": 512, "head_chunks": 2,
                                              "recompute": "layers", "world": 4})}
"""Name -> (model, vocabulary, hidden size, S, gradient checkpointing, backend options), measured in this order in the
same two processes. The models: transformers' Llama, Qwen3-MoE (8 experts, 2 per token, each rank dispatching its
own tokens) and Qwen3-Next (three Gated DeltaNet layers split by state passing, one attention layer, the same
experts). The small case comes first: measured after the large-vocabulary ones it read 46 MiB against 84 MiB
alone -- the resident set did not rise by what the step allocated; most likely the processes still held memory
the earlier cases had freed (not verified further) -- while the large cases, here and in ``benchmarks/plan.py``,
read the same in any order."""
SLOW = ("checkpointed layers", "ulysses", "ulysses head groups", "whole loss", "checkpointed", "experts",
        "linear attention and experts", "projections in head groups", "projections in head groups at 4")
"""Cases measured in a launch of their own and marked slow (the default suite measures one: the chunked loss; the
plan of checkpointed layers is checked without a run below)."""


class _LossOnly(nn.Module):
    """``LlamaForCausalLM`` up to its loss, returning the loss alone (its logits can be chunked away)."""

    def __init__(self, llama):
        super().__init__()
        self.llama = llama

    def forward(self, ids, labels):
        logits = self.llama.lm_head(self.llama.model(input_ids=ids, use_cache=False).last_hidden_state)
        return self.llama.loss_function(logits, labels, self.llama.config.vocab_size)


def _model(kind: str, vocab: int, hidden: int, seq: int, checkpointed: bool) -> nn.Module:
    sizes = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq, attn_implementation="sdpa")
    experts = dict(num_experts=8, num_experts_per_tok=2, head_dim=hidden // 4, moe_intermediate_size=hidden)
    if kind == "qwen3_moe":
        cfg, cls = transformers.Qwen3MoeConfig(**experts, **sizes), transformers.Qwen3MoeForCausalLM
    elif kind == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(
            **experts, shared_expert_intermediate_size=hidden, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=hidden // 4, linear_value_head_dim=hidden // 4,
            layer_types=["linear_attention"] * 3 + ["full_attention"], **sizes)
        cls = transformers.Qwen3NextForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**sizes), transformers.LlamaForCausalLM
    torch.manual_seed(0)
    llama = cls(cfg).float()
    if checkpointed:
        llama.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True  # transformers >= 5.25
    return _LossOnly(llama).train()


def _measured(names: list[str]) -> dict[str, int]:
    """This rank's peak bytes of each named case's step, in order."""
    out = {}
    for name in names:
        kind, vocab, hidden, seq, checkpointed, options = CASES[name]
        options = {k: v for k, v in options.items() if k != "world"}
        torch._dynamo.reset()
        model = _model(kind, vocab, hidden, seq, checkpointed)
        ids = torch.randint(0, vocab, (1, seq))
        compiled = torch.compile(model, backend=autoshard.backend(**options), dynamic=False)
        compiled(ids, ids).backward()  # compile, warm up
        model.zero_grad(set_to_none=True)
        with peak_memory() as measured:
            compiled(ids, ids).backward()
        out[name] = measured.peak_bytes + sum(p.untyped_storage().nbytes() for p in model.parameters())
    return out


def _world(name: str) -> int:
    return CASES[name][5].get("world", WORLD)


@functools.cache
def _measured_peaks(slow: bool, world: int) -> list[dict[str, int]]:
    """Every rank's peak bytes by case of one tier (:data:`SLOW` or the others) on ``world`` ranks: one launch."""
    names = [name for name in CASES if (name in SLOW) == slow and _world(name) == world]
    return run_on_ranks(_measured, world, names, timeout=600, env=LOW_MMAP_THRESHOLD_ENV)


def _measured_peak(name: str) -> int:
    """The largest rank's peak bytes of a case."""
    return max(r[name] for r in _measured_peaks(name in SLOW, _world(name)))


@functools.cache
def _planned(name: str):
    """The plan's memory per rank of a case, the model on the meta device."""
    kind, vocab, hidden, seq, checkpointed, options = CASES[name]
    options = {k: v for k, v in options.items() if k != "world"}
    torch._dynamo.reset()
    with torch.device("meta"):
        model = _model(kind, vocab, hidden, seq, checkpointed)
        ids = torch.randint(0, vocab, (1, seq))
    return autoshard.plan(model, (ids, ids), world_size=_world(name), **options).memory_per_rank


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else []) for name in CASES])
def test_predicted_peak_is_the_measured_peak(name):
    memory, measured = _planned(name), _measured_peak(name)
    assert abs(memory.total / measured - 1) <= TOLERANCE, \
        f"{name}: predicted {memory.total / 2**20:.1f} MiB ({memory}), measured {measured / 2**20:.1f} MiB"
    if name == "ulysses":  # the attention's own copies are the peak (in 2 groups it is elsewhere at this length)
        assert "attention_backward" in memory.peak_at, memory.peak_at


@pytest.mark.slow
def test_head_groups_lower_the_attention_peak():
    whole, grouped = _planned("ulysses"), _planned("ulysses head groups")
    measured = [_measured_peak(name) for name in ("ulysses", "ulysses head groups")]
    assert grouped.total < whole.total and measured[1] < measured[0], (whole, grouped, measured)


@pytest.mark.slow  # plans of the slow tier's cases
def test_checkpointing_keeps_the_layer_inputs():
    """The checkpoint keeps only the layers' inputs; without the big loss the peak is a layer recomputed in
    backward."""
    assert _planned("checkpointed").saved_activations < _planned("whole loss").saved_activations
    assert _planned("checkpointed layers").peak_at.startswith("g0 backward: aten.")


def test_prefetching_offload_holds_one_more_layer_input():
    """Offload (checkpointed layers): with prefetch, a layer's backward holds the next layer's input too, so the
    peak rises by at most one ``[S/P, hidden]`` (the first layer's backward, with none to bring back, may stay the
    highest; the plan without prefetch says the same: the memory policy weighs both from one plan). Plans of a
    transformers Llama, float32, S=4096 on 2 ranks (what the copies cost: ``tests/plan/test_step_time.py``)."""
    vocab, hidden, seq = 1024, 64, 4096
    with torch.device("meta"):
        model = _model("llama", vocab, hidden, seq, False)
        ids = torch.randint(0, vocab, (1, seq))
    plans = {}
    for prefetch in (True, False):
        torch._dynamo.reset()
        plans[prefetch] = autoshard.plan(model, (ids, ids), world_size=WORLD, recompute="layers", offload=True,
                                         offload_prefetch=prefetch)
    prefetched, on_use = plans[True].memory_per_rank, plans[False].memory_per_rank
    assert prefetched.host_offloaded == on_use.host_offloaded > 0
    assert 0 < prefetched.total - on_use.total <= seq // WORLD * hidden * 4, (prefetched, on_use)
    assert on_use.total_prefetched == prefetched.total_prefetched == prefetched.total  # one simulation gives both
    assert "prefetched: " in str(plans[True]) and "compute waiting" in str(plans[False])


def test_a_short_host_budget_spares_layers_the_host():
    """Offload with recomputed layers (transformers' Llama, 4 layers, float32, S=4096 on 2 ranks, no prefetch): the
    plan keeps each layer's input in host memory (its bytes per layer: ``host_regions``). A host budget one layer
    and a byte short of it makes the policy spare two layers (the last one's input stays on the device, the third's is
    rebuilt from the second's in backward): the host bytes fall by those two inputs, within the budget, and the
    device's peak stays where it was (within one layer input)."""
    vocab, hidden, seq = 1024, 64, 4096
    with torch.device("meta"):
        model = _model("llama", vocab, hidden, seq, False)
        ids = torch.randint(0, vocab, (1, seq))
    levers = dict(world_size=WORLD, recompute="layers", offload=True, offload_prefetch=False)
    torch._dynamo.reset()
    whole = autoshard.plan(model, (ids, ids), **levers).memory_per_rank
    layer = seq // WORLD * hidden * 4
    assert whole.host_regions[1:] == [layer] * 3 and whole.host_regions[0] >= layer, whole.host_regions
    budget = whole.host_offloaded - whole.host_regions[-1] - 1
    torch._dynamo.reset()
    plan = autoshard.plan(model, (ids, ids), memory_budget=4 * whole.total, host_budget=budget, **levers)
    spared = plan.memory_per_rank
    assert "sparing 2 region(s) the host" in " ".join(plan.memory_policy), plan.memory_policy
    assert spared.host_offloaded == whole.host_offloaded - 2 * layer <= budget, spared
    assert abs(spared.total - whole.total) <= layer, (spared, whole)


class _Tiny(nn.Module):
    """Parameters by FSDP2 unit: the root (``embed`` 64 x 16, ``head`` 64 x 16: 2048 floats) and two blocks
    (``layers.i``: 16 x 16 + 16 = 272 floats each)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 64, bias=False)

    def forward(self, ids, labels):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _tiny_plan(**options) -> Plan:
    torch._dynamo.reset()
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (1, 32))
    return autoshard.plan(_Tiny(), (ids, ids), world_size=2, chunk_loss=None, **options)


@pytest.mark.filterwarnings("ignore:autoshard. nothing in this graph is split")
def test_fsdp_and_optimizer_terms_are_the_arithmetic():
    alone = _tiny_plan().memory_per_rank
    assert alone.parameters == (2048 + 2 * 272) * 4
    assert (alone.optimizer_states, alone.gathered_parameters, alone.unsharded_gradients) == (0, 0, 0)

    # 4 shards: dim 0 cut in 4 (embed and head 16 x 16 each, a block's weight 4 x 16 and bias 4)
    sharded = _tiny_plan(dp_shard=4, optimizer="adamw")
    memory = sharded.memory_per_rank
    shard_floats = 2 * 16 * 16 + 2 * (4 * 16 + 4)
    assert memory.parameters == shard_floats * 4
    assert memory.optimizer_states == shard_floats * 8  # two float32 moments; float32 parameters need no master
    assert memory.gathered_parameters == (2048 + 272) * 4  # the root and one block, unsharded
    assert memory.unsharded_gradients == min(alone.gradients, 2048 * 4)
    assert memory.gradients == alone.gradients * shard_floats // (2048 + 2 * 272)
    # what the graph holds does not change
    assert (memory.saved_activations, memory.outputs, memory.transient) == \
        (alone.saved_activations, alone.outputs, alone.transient)
    assert memory.total == (memory.parameters + memory.gradients + memory.optimizer_states
                            + memory.gathered_parameters + memory.unsharded_gradients + memory.saved_activations
                            + memory.outputs + memory.transient)
    assert "optimizer states 5.06 KiB" in str(sharded) and "FSDP gathered parameters 9.06 KiB" in str(sharded)
    assert Plan.from_json(sharded.to_json()).memory_per_rank == memory

    # 3 shards pad dim 0 to a multiple of 3: 64 -> 22 rows, 16 -> 6 rows
    assert _tiny_plan(dp_shard=3).memory_per_rank.parameters == (2 * 22 * 16 + 2 * (6 * 16 + 6)) * 4


@pytest.mark.filterwarnings("ignore:autoshard. nothing in this graph is split")
def test_adamw_keeps_a_float32_master_copy_of_16_bit_parameters():
    torch._dynamo.reset()
    ids = torch.randint(0, 64, (1, 32))
    memory = autoshard.plan(_Tiny().bfloat16(), (ids, ids), world_size=2, chunk_loss=None, dp_shard=2,
                            optimizer="adamw").memory_per_rank
    shard_floats = 2 * 32 * 16 + 2 * (8 * 16 + 8)
    assert memory.parameters == shard_floats * 2
    assert memory.optimizer_states == shard_floats * (4 + 4 + 4)


def test_planning_options_are_checked():
    ids = torch.randint(0, 64, (1, 32))
    with pytest.raises(ValueError, match="dp_shard must be a positive int"):
        autoshard.plan(_Tiny(), (ids, ids), world_size=2, dp_shard=0)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        autoshard.plan(_Tiny(), (ids, ids), world_size=2, optimizer="sgd")
