"""Step-time prediction (``autoshard.plan(..., hardware=...)``, :mod:`autoshard.step_time`, :mod:`autoshard.hardware`):
the model's internal consistency -- monotone in the sequence, the counted bytes priced exactly, the parts summing to
the whole -- and the profiles' bad input. No test asserts a measured time (``benchmarks/step_time.py`` compares the
prediction with measurements)."""

import dataclasses
import json
import textwrap

import pytest
import torch

import autoshard
from autoshard.__main__ import main
from autoshard.hardware import PROFILES, load_profile, save_profile

transformers = pytest.importorskip("transformers")


def _model():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=1 << 16,
                                   attn_implementation="sdpa")
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg).train()


def _plan(length: int, world: int = 4, **options):
    ids = torch.zeros(1, length, dtype=torch.long, device="meta")
    return autoshard.plan(_model(), kwargs=dict(input_ids=ids, labels=ids), world_size=world, **options)


def test_step_time_grows_with_the_sequence_and_prices_the_counted_bytes_exactly():
    plans = {length: _plan(length, hardware="h100") for length in (1024, 2048, 4096)}
    seconds = [plans[length].step_seconds for length in sorted(plans)]
    assert seconds == sorted(seconds) and len(set(seconds)) == 3

    plan, h100 = plans[4096], PROFILES["h100"]
    t = plan.step_time
    assert t.hardware == "h100"
    assert t.seconds == pytest.approx(t.forward_s + t.backward_s + t.optimizer_s)
    assert t.seconds == pytest.approx(sum(row.seconds for row in t.layers))
    assert t.tokens_per_second == pytest.approx(4096 / 4 / t.seconds)
    assert [row.layer.rsplit(".", 1)[-1] for row in t.layers] == ["0", "1", "rest"]
    # the collectives outside attention: (P - 1) latencies and their bytes over the link, all of them exposed
    attention = {a.node for a in plan.attention}
    others = sum(h100.collective_seconds(c.bytes_per_rank, 4) for c in plan.collectives if c.node not in attention)
    assert others > 0 and t.layers[-1].comm_s == pytest.approx(others)
    # each layer's attention: its strategy's price for the call (forward and backward together)
    chosen = next(c for c in plan.attention[0].costs if c["strategy"] == plan.attention[0].strategy)
    assert t.layers[0].attention_s == pytest.approx(chosen["compute_s"])
    assert t.layers[0].comm_s == pytest.approx(chosen["comm_s"])
    assert t.layers[0].exposed_s == pytest.approx(chosen["total_s"] - chosen["compute_s"])

    assert autoshard.Plan.from_json(plan.to_json()) == plan
    assert f"step time {t.describe()}" in str(plan)


def test_the_profile_prices_the_step_and_chooses_the_strategy():
    slow_links = dataclasses.replace(PROFILES["h100"], name="slow links", intra_node_bandwidth=1e9)
    fast, slow = _plan(4096, hardware="h100"), _plan(4096, hardware=slow_links)
    assert slow.step_time.hardware == "slow links" and slow.step_seconds > fast.step_seconds
    assert fast.step_seconds > _plan(4096, hardware="b200").step_seconds
    # the reason of the choice names the times the same profile predicts
    assert slow.attention[0].reason.startswith(slow.attention[0].strategy)
    assert "ms per call" in slow.attention[0].reason
    # FSDP2 over 4 ranks and an optimizer add their traffic and their pass over the states
    sharded = _plan(4096, hardware="h100", dp_shard=4, optimizer="adamw", grad_sync=False)
    assert sharded.step_time.optimizer_s > 0
    assert sharded.step_time.comm_s > fast.step_time.comm_s - fast.step_time.layers[-1].comm_s


def test_offload_copies_are_priced_prefetched_or_exposed():
    """The cost model's price of offload's host copies (predicted seconds from the h100 profile, not a measurement):
    prefetched, both ways behind the step's compute up to it; without prefetch each copy back exposed in full,
    after what of the copies out forward's compute did not hide."""
    times = {prefetch: _plan(4096, world=2, recompute="layers", offload=True, offload_prefetch=prefetch,
                             hardware="h100") for prefetch in (True, False)}
    host = times[False].memory_per_rank.host_offloaded
    assert host > 0 and times[True].memory_per_rank.host_offloaded == host
    one_way = host / PROFILES["h100"].host_bandwidth
    rest = {prefetch: plan.step_time.layers[-1] for prefetch, plan in times.items()}
    # the rest row's other collectives are all exposed: what is hidden of its communication is the copies'
    copies = {prefetch: row.exposed_s - row.comm_s + 2 * one_way for prefetch, row in rest.items()}
    compute = sum(row.compute_s for row in times[True].step_time.layers)
    assert copies[True] == pytest.approx(max(0.0, 2 * one_way - compute))
    assert copies[False] == pytest.approx(one_way + max(0.0, one_way - times[False].step_time.forward_s))


def test_ranks_sharing_cores_compute_slower():
    cpu = dataclasses.replace(PROFILES["h100"], concurrent_ranks=2, ranks_per_node=8)
    assert (cpu.slowdown(1), cpu.slowdown(2), cpu.slowdown(4), cpu.slowdown(16)) == (1, 1, 2, 4)
    assert PROFILES["h100"].slowdown(8) == 1


_CPU = dataclasses.replace(PROFILES["h100"], name="cpu x2 thread(s)", threads=2, concurrent_ranks=4, ranks_per_node=4)
"""A CPU profile measured with 2 threads per rank on 8 cores (its rates the h100's: only their ratios matter)."""


def test_a_cpu_profile_scales_to_the_threads_per_rank(monkeypatch):
    """The model of :meth:`HardwareProfile.with_threads`: FLOP/s in proportion to the threads (up to the cores), memory
    bandwidth as the square root, the overheads unchanged, the cores shared out again; GPU profiles unchanged."""
    one = _CPU.with_threads(1)
    assert (one.threads, one.concurrent_ranks, one.ranks_per_node) == (1, 8, 8)
    assert one.name == "cpu x2 thread(s), at 1 thread(s) per rank"
    for name in ("matmul_flops", "matmul_flops_fp32", "attention_flops", "attention_flops_fp32"):
        assert getattr(one, name) == pytest.approx(getattr(_CPU, name) / 2)
    for name in ("memory_bandwidth", "host_bandwidth"):
        assert getattr(one, name) == pytest.approx(getattr(_CPU, name) / 2**0.5)
    assert (one.op_overhead, one.step_overhead, one.attention_pair_flops) == (
        _CPU.op_overhead, _CPU.step_overhead, _CPU.attention_pair_flops)
    many = _CPU.with_threads(16)  # threads beyond the 8 cores add nothing
    assert many.matmul_flops == pytest.approx(_CPU.matmul_flops * 4) and many.concurrent_ranks == 1
    assert _CPU.with_threads(2) is _CPU and PROFILES["h100"].with_threads(1) is PROFILES["h100"]
    with pytest.raises(ValueError, match="positive, got 0"):
        _CPU.with_threads(0)
    # the default is torchrun's: OMP_NUM_THREADS when set, else one thread per rank of several, else the profile's
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _CPU.with_threads(world=2) == one and _CPU.with_threads(world=1) is _CPU
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert _CPU.with_threads(world=2).threads == 4
    monkeypatch.delenv("OMP_NUM_THREADS")
    # the plan prices the run's threads: one thread per rank, slower than the two the profile measured
    plans = {threads: _plan(2048, world=2, hardware=_CPU, threads=threads) for threads in (None, 1, 2)}
    assert plans[None].step_seconds == plans[1].step_seconds > plans[2].step_seconds
    assert plans[1].step_time.hardware == one.name and plans[2].step_time.hardware == _CPU.name


def test_profile_files_record_their_threads(tmp_path):
    path = tmp_path / "cpu.json"
    save_profile(_CPU, path)
    assert json.loads(path.read_text())["threads"] == 2 and load_profile(path) == _CPU
    # a file written before profiles recorded them: a CPU's from its name, a GPU's none; else refused with why
    for profile, threads in ((dataclasses.replace(_CPU, name="cpu x2 thread(s), gloo over 4 rank(s)"), 2),
                             (PROFILES["a100"], 0)):
        data = dataclasses.asdict(profile)
        del data["threads"]
        path.write_text(json.dumps(data))
        assert load_profile(path) == dataclasses.replace(profile, threads=threads)
    data["name"], data["concurrent_ranks"] = "my laptop", 2
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="a CPU profile without the threads per rank.*'my laptop' does not say"):
        load_profile(path)


def test_unknown_hardware_and_incomplete_profiles_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown hardware 'tpu'.*a100, b200, h100, h200"):
        _plan(1024, hardware="tpu")
    with pytest.raises(ValueError, match="not both"):
        _plan(1024, hardware="h100", topology=PROFILES["a100"])
    path = tmp_path / "profile.json"
    save_profile(PROFILES["h200"], path)
    assert load_profile(path) == PROFILES["h200"] == autoshard.hardware(path)
    data = json.loads(path.read_text())
    del data["matmul_flops"]
    data["tflops"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="missing field.s. matmul_flops; unknown field.s. tflops"):
        autoshard.hardware(path)


def test_the_command_line_prints_the_step_time(tmp_path, capsys):
    factory = tmp_path / "factory.py"
    factory.write_text(textwrap.dedent("""
        import torch, transformers
        def build(seq_len):
            cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                           attn_implementation="sdpa")
            with torch.device("meta"):
                model = transformers.LlamaForCausalLM(cfg).train()
            ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
            return model, (), dict(input_ids=ids, labels=ids)
    """))
    assert main(["plan", f"{factory}:build", "--world-size", "4", "--seq-len", "2048", "--hardware", "a100"]) == 0
    assert "step time" in capsys.readouterr().out and "on a100" in str(_plan(2048, hardware="a100"))
    save_profile(_CPU, tmp_path / "cpu.json")
    assert main(["plan", f"{factory}:build", "--world-size", "2", "--seq-len", "2048", "--hardware",
                 str(tmp_path / "cpu.json"), "--threads", "1"]) == 0
    assert "on cpu x2 thread(s), at 1 thread(s) per rank" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown hardware 'x100'"):
        main(["plan", f"{factory}:build", "--world-size", "4", "--seq-len", "2048", "--hardware", "x100"])


def test_packed_documents_cost_the_pairs_they_see():
    """Documents of 512 tokens in a 4096-token sequence: the attention priced is the busiest rank's document pairs
    (read from position_ids), not a whole causal sequence's."""
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.zeros(1, 4096, dtype=torch.long)
    packed, whole = (autoshard.plan(model, kwargs=dict(input_ids=ids, labels=ids, position_ids=positions[None],
                                                      use_cache=False),
                                    world_size=4, hardware="h100")
                     for positions in (torch.arange(4096) % 512, torch.arange(4096)))
    assert packed.documents["documents"] == 8 and whole.documents["documents"] == 1
    # 8 x 512^2 / 2 pairs instead of 4096^2 / 2: an eighth, whatever the dispatch's balance
    for p, w in zip(packed.step_time.layers[:2], whole.step_time.layers[:2]):
        assert w.attention_s / 10 < p.attention_s < w.attention_s / 3, (p, w)
    assert packed.step_seconds < whole.step_seconds


def _calibrated():
    import torch.distributed as dist

    profile = autoshard.calibrate(tokens=256)
    return profile, dist.get_rank()


@pytest.mark.slow
def test_calibration_measures_the_machine_and_its_collectives():
    from autoshard.testing import run_on_ranks

    (profile, _), (other, _) = run_on_ranks(_calibrated, 2, timeout=300)
    # what was measured is not asserted (a shared machine's speeds): that every rank got one profile, rank 0's compute
    # and everyone's collectives, complete (a HardwareProfile checks its fields) and writable
    assert profile == other
    assert profile.name.endswith("gloo over 2 rank(s)") and profile.concurrent_ranks >= 1
    assert profile.threads == 1  # the ranks' (run_on_ranks gives each one thread)
    assert profile != dataclasses.replace(PROFILES["h100"], name=profile.name)
