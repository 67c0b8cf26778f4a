"""``BackendConfig``'s resolved defaults: the inner compiler ``"auto"`` picks per device."""

import pytest

from autoshard import BackendConfig


def test_auto_inner_compiler_is_inductor_on_cuda_and_eager_elsewhere():
    config = BackendConfig()
    assert config.inner == "auto"
    assert config.inner_for("cuda") == "inductor" and config.inner_for("cpu") == "eager"
    assert BackendConfig(offload=True).inner_for("cuda") == "eager"  # host copies must run, not be traced
    assert BackendConfig(inner="aot_eager").inner_for("cuda") == "aot_eager"


def test_offload_refuses_a_tracing_inner_compiler():
    with pytest.raises(ValueError, match="offload=True runs with inner='eager' only"):
        BackendConfig(offload=True, inner="inductor")
