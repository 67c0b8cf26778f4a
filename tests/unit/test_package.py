"""The installed package: entry point, public names."""

import importlib.metadata

import autoshard


def test_backend_name_resolves_through_entry_point():
    from torch._dynamo.backends.registry import lookup_backend

    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert "autoshard" in {ep.name for ep in eps}
    assert lookup_backend("autoshard") is not None


def test_public_runtime_names():
    for name in autoshard.runtime.__all__:
        assert hasattr(autoshard.runtime, name), name
