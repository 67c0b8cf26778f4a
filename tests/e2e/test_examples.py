"""Every runnable example completes with the one command its docstring gives (``python examples/X.py``,
which spawns its own ranks); each checks its results against one process and fails when they differ.
``train.py`` runs four steps of its training loop on 4 ranks, (dp=2, sp=2), each at a new sequence length, with
``--check``: its losses must equal one-process training's, and no length may compile anew. The demo (``llama.py``, what ``./dev demo`` runs) prints no warning."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ALSO_IN_E2E = ("hf_llama.py", "annotations.py", "layouts.py", "reference_models.py", "attention_demo.py",
               "train.py --steps 4 --check --vary-lengths")
EXAMPLES = ["llama.py", *(pytest.param(name, marks=pytest.mark.slow) for name in ALSO_IN_E2E)]
"""The default suite runs the demo; the examples whose code the e2e tests run too (transformers models, annotations,
layouts, the reference models, the runtime attention, FSDP2 training on a (dp, sp) mesh) are marked slow."""


@pytest.mark.parametrize("command", EXAMPLES)
def test_example_runs(command):
    name, *args = command.split()
    result = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"examples/{command} exited {result.returncode}:\n{result.stdout[-4000:]}\n" \
                                   f"{result.stderr[-4000:]}"
    if name == "llama.py":  # the front door (./dev demo) prints no warning
        assert "Warning" not in result.stdout + result.stderr, result.stderr[-4000:]
