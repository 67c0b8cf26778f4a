"""Every runnable example completes with the one command its docstring gives (``python examples/X.py``,
which spawns its own ranks); each checks its results against one process and fails when they differ."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["llama.py", "annotations.py", "layouts.py", "reference_models.py", "attention_demo.py", "hf_llama.py"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"examples/{name} exited {result.returncode}:\n{result.stdout[-4000:]}\n" \
                                   f"{result.stderr[-4000:]}"
