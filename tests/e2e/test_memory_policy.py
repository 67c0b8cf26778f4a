"""``memory_budget``: the memory policy picks the cheapest levers whose plan fits, at 2 ranks against one process.

* The policy alone, with a stand-in estimator: the ladder cheapest first (as configured, chunked MLPs, tiles, tiles
  with head groups, the four with recomputed layers, then with prefetching offload too, then offload without
  prefetch), levers the user set never changed, offload only with the eager inner compiler, the first that fits
  taken -- without planning the options an option that does not fit dominates (the strongest planned first, then
  those just below it), and offload only within the host budget; nothing
  fits: the error names the smallest feasible budget, or (the CUDA default) a warning and the smallest option.
* The backend at 2 ranks on autoshard's Llama (float64, length 61): each option's planned peak from
  ``autoshard.plan`` (rank 0's view, which every rank's policy uses); with the budget of recomputed layers,
  the backend chooses the first option in the policy's order planned within it (not the model as
  configured), the compile report says so, and loss and gradients equal one process within 1e-9; a budget
  below all of them raises ``MemoryBudgetError`` on every rank, naming the smallest planned peak in bytes (within
  ``DOMINANCE_MARGIN`` of the smallest of the options planned here).
"""

import functools
import re

import pytest
import torch

import autoshard
from autoshard.config import BackendConfig
from autoshard.testing.models import LlamaConfig, LlamaLM
from autoshard.policy import (CHUNK_TOKENS, DOMINANCE_MARGIN, HEAD_CHUNKS, MemoryBudgetError, _options,
                              choose_memory_policy, host_budget)
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

CONFIG = dict(vocab_size=64, hidden=32, layers=3, heads=4, kv_heads=2, intermediate=64)
LEVERS = ("chunk_mlp", "tile_tokens", "head_chunks", "recompute", "offload")
T, G = CHUNK_TOKENS, HEAD_CHUNKS
AHEAD = "prefetch"
"""The offload entry of a key for prefetching offload (True: offload without prefetch)."""


def _key(levers) -> tuple:
    """(chunk_mlp, tile_tokens, head_chunks, recompute, offload: False, AHEAD or True) of a config or an option."""
    get = levers.get if isinstance(levers, dict) else functools.partial(getattr, levers)
    offload = get("offload") and (AHEAD if get("offload_prefetch") else True)
    return (*(get(k) for k in LEVERS[:4]), offload)


def _stand_in(costs: dict, asked: list | None = None):
    """An estimator: (bytes, host bytes) by :func:`_key` (head groups not listed: 5 below the same without;
    prefetching offload: 3 above the same without prefetch; offload's host bytes: what it takes off the device,
    the same levers' bytes without offload less its own); ``asked`` collects the options it was asked for."""
    def cost_of(key):
        unbuffered = (*key[:4], True) if key[4] == AHEAD else key
        return costs.get(unbuffered, costs.get((*key[:2], 1, *unbuffered[3:]), 0) - 5) + (3 if key[4] == AHEAD else 0)

    def estimate(config):
        key = _key(config)
        if asked is not None:
            asked.append(key)
        return cost_of(key), cost_of((*key[:4], False)) - cost_of((*key[:4], True)) if key[4] else 0
    return estimate


COSTS = {(None, None, 1, "none", False): 100, (T, None, 1, "none", False): 80, (None, T, 1, "none", False): 75,
         (None, T, G, "none", False): 70,
         (None, None, 1, "layers", False): 60, (T, None, 1, "layers", False): 50, (None, T, 1, "layers", False): 45,
         (None, T, G, "layers", False): 40,
         (None, None, 1, "layers", True): 30, (T, None, 1, "layers", True): 20, (None, T, 1, "layers", True): 15,
         (None, T, G, "layers", True): 10}
STRONGEST = (None, T, G, "layers", True)
LADDER = [k for k in COSTS if not k[4]] + [(*k[:4], AHEAD) for k in COSTS if k[4]] + [k for k in COSTS if k[4]]
"""The policy's order: no offload, prefetching offload, offload without prefetch."""


@pytest.mark.parametrize("budget, chosen", [(100, (None, None, 1, "none", False)), (90, (T, None, 1, "none", False)),
                                            (55, (T, None, 1, "layers", False)), (42, (None, T, G, "layers", False)),
                                            (33, (None, None, 1, "layers", AHEAD)),
                                            (25, (T, None, 1, "layers", AHEAD)), (13, (None, T, G, "layers", AHEAD)),
                                            (10, STRONGEST)])
def test_cheapest_option_that_fits(budget, chosen):
    asked = []
    estimate = _stand_in(COSTS, asked)
    config, policy = choose_memory_policy(BackendConfig(), estimate, budget=budget)
    assert _key(config) == chosen
    assert policy.chosen is not None and policy.chosen.estimate <= budget
    assert asked[0] == STRONGEST and len(asked) == len(set(asked)), asked  # the strongest first, each planned once
    ladder = [_key(o) for o in policy.options]
    assert ladder == LADDER, ladder  # every option shown, in the ladder's order
    assert all(o.estimate is None or (o.estimate, o.host) == estimate(o) for o in policy.options)
    assert "memory policy" in policy.describe()


def test_options_a_failure_dominates_are_not_planned():
    asked = []
    config, policy = choose_memory_policy(BackendConfig(), _stand_in(COSTS, asked), budget=10)
    # the strongest and those just below it (no head groups; offload prefetched), whose failures rule out the rest
    assert set(asked) == {STRONGEST, (None, T, 1, "layers", True), (None, T, G, "layers", AHEAD)}, asked
    assert sum(o.estimate is None for o in policy.options) == len(LADDER) - 3
    assert "ruled out" in policy.describe()


def test_offload_only_within_the_host_budget():
    config, policy = choose_memory_policy(BackendConfig(), _stand_in(COSTS), budget=45, host_budget=29)
    assert (config.tile_tokens, config.head_chunks, config.recompute, config.offload) == (T, 1, "layers", False)
    # the options without offload hold at least offload's host bytes (30 B, over 25 B): never planned; the
    # smallest option planned is named with the host bytes it needs
    with pytest.raises(MemoryBudgetError, match=r"and 29 B of host memory per rank.*smallest feasible budget is 10 "
                                                r"bytes .*offload \(no prefetch\) \(30 B in host memory\)"):
        choose_memory_policy(BackendConfig(), _stand_in(COSTS), budget=25, host_budget=29)


def test_host_budget_is_the_ranks_share_of_the_host(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    whole = host_budget()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert whole > 0 and host_budget() == whole // 4


def test_levers_the_user_set_stay():
    config, policy = choose_memory_policy(BackendConfig(recompute="layers"), _stand_in(COSTS), budget=40)
    assert config.recompute == "layers" and (config.tile_tokens, config.head_chunks, config.offload) == (T, G, False)
    assert all(o.recompute == "layers" for o in policy.options)
    config, policy = choose_memory_policy(BackendConfig(chunk_mlp=T), _stand_in(COSTS), budget=25)
    assert _key(config) == (T, None, 1, "layers", AHEAD)
    config, policy = choose_memory_policy(BackendConfig(chunk_mlp=T, offload_prefetch=False), _stand_in(COSTS),
                                          budget=25)
    assert _key(config) == (T, None, 1, "layers", True)
    assert {_key(o)[4] for o in policy.options} == {False, True}, policy.options  # never prefetched
    config, policy = choose_memory_policy(BackendConfig(head_chunks=2), _stand_in(COSTS), budget=100)
    assert config.head_chunks == 2 and all(o.head_chunks == 2 for o in policy.options)
    config, policy = choose_memory_policy(BackendConfig(inner="aot_eager"), _stand_in(COSTS), budget=50)
    assert not any(o.offload for o in policy.options)


def test_nothing_fits():
    with pytest.raises(MemoryBudgetError, match=r"smallest feasible budget is 10 bytes"):
        choose_memory_policy(BackendConfig(), _stand_in(COSTS), budget=5)
    with pytest.warns(UserWarning, match="smallest feasible budget is 10 bytes"):
        config, policy = choose_memory_policy(BackendConfig(), _stand_in(COSTS), budget=5, strict=False)
    assert policy.chosen is None and _key(config) == STRONGEST


def _model():
    return LlamaLM(LlamaConfig(**CONFIG))


def _inputs():
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 61))
    return ids, ids


def _run():
    torch.manual_seed(0)
    plans = {}
    for levers in _options(BackendConfig())[:5]:  # as configured, chunks, tiles, tiles + head groups, layers
        torch._dynamo.reset()
        plans[tuple(levers[k] for k in LEVERS)] = autoshard.plan(_model().double(), _inputs(), world_size=2,
                                                                outputs="gathered", **levers).memory_per_rank.total
    # the budget of "recompute the layers": the policy must take the first option, in its order, planned within it
    budget = plans[(None, None, 1, "layers", False)]
    out = {"plans": plans, "budget": budget, "expected": next(k for k, v in plans.items() if v <= budget)}
    torch._dynamo.reset()
    r = compare_with_one_process(_model, _inputs, dtype=torch.float64, outputs="gathered", memory_budget=budget)
    policy = r.compiled_reports[0].memory_policy
    out.update({"error": r.max_error(), "summary": r.summary(),
                "chosen": policy.chosen and tuple(getattr(policy.chosen, k) for k in LEVERS),
                "recomputed": r.compiled_reports[0].passes["recompute"].counts["recomputed_layers"]})
    torch._dynamo.reset()
    try:
        compiled = torch.compile(_model().double(), backend=autoshard.backend(memory_budget=1000, outputs="gathered"))
        compiled(*_inputs())
        out["refused"] = None
    except Exception as e:  # dynamo wraps the backend's error
        out["refused"] = str(e)
    return out


@functools.cache
def _results():
    return run_on_ranks(_run, 2, timeout=600)


def test_backend_takes_the_first_option_that_fits():
    for rank, r in enumerate(_results()):
        where = f"rank {rank}: plans {r['plans']}, budget {r['budget']}"
        assert r["expected"] != (None, None, 1, "none", False), f"{where}: the model as configured already fits"
        assert r["chosen"] == r["expected"], f"{where}: chose {r['chosen']}"
        assert r["recomputed"] == (CONFIG["layers"] if r["chosen"][3] == "layers" else 0), where
        assert r["error"] <= 1e-9, f"{where}: {r['summary']}"


def test_backend_names_the_smallest_feasible_budget_on_every_rank():
    for rank, r in enumerate(_results()):
        assert r["refused"] is not None and "MemoryBudgetError" in r["refused"], f"rank {rank}: {r['refused']}"
        assert "memory_budget=1,000 bytes" in r["refused"], r["refused"]
        smallest = int(re.search(r"smallest feasible budget is ([\d,]+) bytes", r["refused"]).group(1).replace(",", ""))
        # the strongest option's peak: the options it dominates are within the margin of it, or above
        assert smallest <= min(r["plans"].values()) * (1 + DOMINANCE_MARGIN), (smallest, r["plans"])


def _explained():
    torch._dynamo.reset()
    torch.manual_seed(0)
    before = autoshard.explain()
    compiled = torch.compile(_model().double(), backend="autoshard")
    compiled(*_inputs())[0].backward()
    by_name = autoshard.explain()
    torch._dynamo.reset()
    torch.manual_seed(0)
    be = autoshard.backend(recompute="layers", chunk_mlp=16)
    torch.compile(_model().double(), backend=be)(*_inputs())[0].backward()
    return before, by_name, autoshard.explain(be)


def test_explain_names_what_the_backend_did():
    """``autoshard.explain()``: the reports of ``backend="autoshard"`` by name, or of a given backend."""
    for before, by_name, levers in run_on_ranks(_explained, 2, timeout=300):
        assert before == "autoshard: nothing compiled on this rank yet"
        first, graph = by_name.splitlines()[:2]
        assert first == "compilations on this rank: 1 (1 new graph)", by_name
        assert graph.startswith("graph 0: 3 attention call(s)") and "0 fallback(s)" in graph, by_name
        assert f"{CONFIG['layers']} recomputed regions" in levers and f"{CONFIG['layers']} chunked MLP blocks" in levers, levers
