"""autoshard: sequence (context) parallelism as a torch.compile backend.

    model = torch.compile(model, backend=autoshard.backend(mesh))
    model = autoshard.compile(model, mesh)      # the same, with the dynamo settings a traced model needs

Every rank passes the same full inputs and gets the same outputs and gradients as one device; the
compiler finds the sequence dims from the attention calls, splits activations along them, replaces
attention with distributed attention and makes positions, masks, reductions, shifts and losses exact
under the split. See README.md for the tour.
"""

from . import launch, runtime
from .compiler import AutoshardBackend, backend, compile, explain
from .config import BackendConfig
from .calibration import calibrate
from .hardware import HardwareProfile, hardware
from .annotations import attention_function, mark_sequence, token_local, whole
from .inputs import shard_inputs
from .planner import DecodePlan, Plan, plan, plan_decode
from .runtime.split_tensor import SplitTensor

__all__ = ["backend", "compile", "explain", "AutoshardBackend", "BackendConfig", "plan", "Plan", "plan_decode", "DecodePlan", "HardwareProfile", "hardware", "calibrate", "shard_inputs", "mark_sequence",
           "whole", "token_local", "attention_function", "runtime", "launch", "SplitTensor"]
__version__ = "0.1.0"
