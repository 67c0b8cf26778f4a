"""The public surface: ``backend`` and ``plan`` take a ``BackendConfig`` and/or keyword options, ``plan`` takes a
lone tensor as its positional argument, and the package logs (``logging.getLogger("autoshard")``) instead of
printing."""

import ast
import dataclasses
import logging
import re
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard import BackendConfig
from autoshard.testing.models import LlamaLM
from autoshard.testing.models.llama import LlamaConfig
from autoshard.testing import fake_world

TINY = LlamaConfig(vocab_size=64, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each plan compiles the model with a new capturing backend; dynamo's recompile limit (8 per frame) would
    otherwise leave later plans of the same model empty."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model_and_ids(batch: int = 2, seq: int = 8):
    torch.manual_seed(0)
    return LlamaLM(TINY), torch.randint(0, TINY.vocab_size, (batch, seq))


# ----------------------------------------------------------------------------- backend(config=..., **overrides)


def test_backend_takes_a_config_with_overrides_on_top():
    config = BackendConfig(strategy="ring", outputs="gathered", chunk_loss=None)
    b = autoshard.backend(config=config, layout="zigzag", strategy="allgather")
    assert b.config == dataclasses.replace(config, layout="zigzag", strategy="allgather")
    assert config.strategy == "ring" and config.layout == "auto"  # the caller's config is left as it was
    assert autoshard.backend(None, config).config == config  # positional, no overrides
    assert autoshard.backend(config=config).config == config


def test_backend_keywords_alone_still_work():
    assert autoshard.backend(strategy="ulysses", grad_sync=False).config == BackendConfig(strategy="ulysses",
                                                                                          grad_sync=False)
    assert autoshard.backend().config == BackendConfig()


def test_backend_rejects_unknown_options_and_wrong_configs():
    with pytest.raises(TypeError, match="unknown option.*'strategie'.*strategy"):
        autoshard.backend(config=BackendConfig(), strategie="ring")
    with pytest.raises(TypeError, match="unknown option.*'strategie'"):
        autoshard.backend(strategie="ring")
    with pytest.raises(TypeError, match="config must be an autoshard.BackendConfig"):
        autoshard.backend(config={"strategy": "ring"})
    with pytest.raises(TypeError, match="pass the BackendConfig as config="):
        autoshard.backend(BackendConfig())


def test_backend_overrides_are_validated():
    with pytest.raises(ValueError, match="strategy='bogus'"):
        autoshard.backend(config=BackendConfig(), strategy="bogus")
    with pytest.raises(ValueError, match="zigzag"):  # valid alone, not together
        autoshard.backend(config=BackendConfig(layout="contiguous"), strategy="zigzag")
    with pytest.raises(ValueError, match="hybrid"):  # the group checks still apply to a config's options
        autoshard.backend(config=BackendConfig(strategy="hybrid"))


# ----------------------------------------------------------------------------- plan(config=..., **overrides)


def test_plan_takes_a_config_as_backend_does():
    model, ids = _model_and_ids()
    by_keywords = autoshard.plan(model, (ids, ids), world_size=2, strategy="ring", outputs="gathered")
    by_config = autoshard.plan(model, (ids, ids), world_size=2, config=BackendConfig(strategy="ring", outputs="gathered"))
    mixed = autoshard.plan(model, (ids, ids), world_size=2, config=BackendConfig(strategy="ulysses"),
                           strategy="ring", outputs="gathered")
    assert [a.strategy for a in by_keywords.attention] == ["ring"]
    assert by_config.to_json() == by_keywords.to_json() == mixed.to_json()
    with pytest.raises(TypeError, match="autoshard.plan: unknown option.*'strategie'"):
        autoshard.plan(model, (ids, ids), world_size=2, config=BackendConfig(), strategie="ring")
    with pytest.raises(TypeError, match="autoshard.plan: config must be"):
        autoshard.plan(model, (ids, ids), world_size=2, config="ring")


# ----------------------------------------------------------------------------- plan(model, tensor)


def test_plan_takes_a_lone_tensor_as_one_argument():
    model, ids = _model_and_ids(batch=2)  # tuple(ids) would be two arguments of batch 1
    lone = autoshard.plan(model, ids, world_size=2)
    assert lone.to_json() == autoshard.plan(model, (ids,), world_size=2).to_json()
    assert lone.attention and lone.attention[0].shape["B"] == 2 and lone.symbols["S"] == 8
    with_kwargs = autoshard.plan(model, ids, {"labels": ids}, world_size=2)
    assert with_kwargs.to_json() == autoshard.plan(model, (ids,), {"labels": ids}, world_size=2).to_json()
    assert autoshard.plan(model, [ids, ids], world_size=2).to_json() == autoshard.plan(
        model, (ids, ids), world_size=2).to_json()  # any sequence of arguments still works


# ----------------------------------------------------------------------------- logging, not printing


def test_no_print_calls_in_the_package_outside_the_command_line():
    root = Path(autoshard.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        if path.name == "__main__.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == []


def test_dry_run_logs_the_plan_to_the_autoshard_logger(caplog, capsys):
    model, ids = _model_and_ids()
    expected = model(ids, ids)
    with fake_world(2), caplog.at_level(logging.INFO, logger="autoshard"):
        out = torch.compile(model, backend=autoshard.backend(dry_run=True))(ids, ids)
    assert torch.equal(out[0], expected[0])  # run unsharded
    plans = [r for r in caplog.records if r.name == "autoshard" and r.getMessage().startswith("autoshard plan: 2 ranks")]
    assert plans and all(r.levelno == logging.INFO for r in plans)
    assert "autoshard plan" not in capsys.readouterr().out


def test_many_plans_of_one_model_all_capture_it():
    """Each plan compiles the model with its own capturing backend; dynamo's recompile limit (8 per frame) must not
    turn the ninth plan into an empty one."""
    model, ids = _model_and_ids()
    plans = [autoshard.plan(model, ids, world_size=2) for _ in range(10)]
    assert all(p.attention and p.to_json() == plans[0].to_json() for p in plans)


def test_placements_are_not_public_names():
    """``Shard`` / ``Replicate`` / ``Partial`` are the compiler's internal placements (DTensor's names, another
    constructor): they live in ``autoshard.placements``, not at the top level where they would read as DTensor's."""
    assert not {"Shard", "Replicate", "Partial"} & set(dir(autoshard))
    assert set(autoshard.__all__) <= set(dir(autoshard))


# ----------------------------------------------------------------------------- groups, meshes, private torch APIs


def test_one_mesh_parser_for_the_compiler_and_the_runtime():
    """The compiler and ``runtime.attention`` read a 2-D mesh's axes alike (by name, else ring first); the compiler
    also needs the ring axis first, since it lays the sequence out over the flattened mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.runtime.attention import hybrid_axes, hybrid_sequence_rank
    from autoshard.runtime.groups import check_sequence_mesh, hybrid_mesh_axes, sequence_groups

    with fake_world(4, rank=1):
        ordered = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
        swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ulysses", "ring"))
        unnamed = init_device_mesh("cpu", (2, 2))
        assert hybrid_mesh_axes(ordered) == hybrid_axes(ordered) == (0, 1)
        assert hybrid_mesh_axes(swapped) == hybrid_axes(swapped) == (1, 0)
        assert hybrid_mesh_axes(unnamed) == hybrid_axes(unnamed) == (0, 1)
        assert hybrid_sequence_rank(ordered) == 1 and hybrid_sequence_rank(swapped) == 2
        check_sequence_mesh(ordered)
        with pytest.raises(ValueError, match=r"order the hybrid mesh as \(ring, ulysses\)"):
            check_sequence_mesh(swapped)
        with pytest.raises(ValueError, match="unnamed"):
            check_sequence_mesh(unnamed)
        groups = sequence_groups(ordered)
        assert (groups.rank, groups.world, groups.heads_axis_size) == (1, 4, 2)
        assert groups.heads == ordered.get_group(1).group_name and groups.ring == ordered.get_group(0).group_name
        plain = sequence_groups(None)
        assert (plain.rank, plain.world, plain.sequence, plain.ring, plain.heads_axis_size) == \
            (1, 4, torch.distributed.group.WORLD.group_name, "", None)


def test_planned_hybrid_groups_name_the_mesh_the_plan_chose():
    from autoshard.runtime.groups import SequenceGroups, resolve_group

    groups = SequenceGroups.planned(5, 8).planned_hybrid(2)
    assert groups.heads_axis_size == 2
    ring, heads = resolve_group(groups.ring), resolve_group(groups.heads)
    assert (ring.rank(), ring.size(), heads.rank(), heads.size()) == (2, 4, 1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        groups.rank = 0


def test_a_missing_private_torch_api_is_a_clear_error(monkeypatch):
    from autoshard.runtime import groups

    monkeypatch.delattr(torch.distributed.distributed_c10d, "_get_default_store")
    with pytest.raises(RuntimeError, match=rf"torch {re.escape(torch.__version__)} has no .*_get_default_store"):
        groups.default_store()
