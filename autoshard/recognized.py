"""Recognized calls: functions of third-party models that dynamo records as one autoshard op.

Some sequence mixers are written as Python that no graph pass could read back: transformers' gated delta rule (the
linear attention of Qwen3-Next, Qwen3.5, OLMo-Hybrid) is a loop over chunks of 64 positions that dynamo unrolls, one
step per chunk, its count fixed by the length; Mamba2's chunked scan (Falcon-H1, Bamba) reshapes the sequence into
chunks and mixes them with a chunk-by-chunk decay matrix; Mamba (1)'s selective scan (Mamba, Falcon-Mamba, Jamba,
Zamba) loops over every position. Such a function is recognized *before* tracing instead: the backend registers, for
every loaded module that defines one, a stand-in with dynamo (``torch._dynamo.substitute_in_graph``) that records one
``autoshard::gated_delta_rule``, ``autoshard::ssd_chunk_scan`` or ``autoshard::selective_scan`` call
(:mod:`autoshard.runtime.recurrence`) whose implementation is the model's own function. Outside compilation nothing
changes: the function stays the module's and runs as it is; under compilation the op runs it, so a graph that is not
split computes what the model computes.

:data:`RECOGNIZED` lists what is recognized: a function name and the op's stand-in. Every module in ``sys.modules``
whose name starts with ``transformers.models.`` and that defines the name is served, whatever the model (the
transformers models that share the function share its name). The backend registers them when it is made and again
before it compiles a graph (:func:`recognize_loaded`); a model module imported after the graph was traced runs
its function unrolled, which :func:`warn_if_traced_through` says.
"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from .runtime.recurrence import register_implementation
from .runtime.warn import warn

__all__ = ["RECOGNIZED", "Recognized", "recognize_loaded", "warn_if_traced_through"]


@dataclass(frozen=True, kw_only=True)
class Recognized:
    """A function recognized by name in the modules of a package."""

    package: str
    """The modules searched: those whose name starts with this (``transformers.models.``)."""
    name: str
    """The function's name in those modules."""
    stand_in: Callable[[str], Callable]
    """``implementation name -> the function dynamo traces instead``, which calls the op with that implementation."""


def _gated_delta_rule_stand_in(implementation: str) -> Callable:
    def gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        out, state = torch.ops.autoshard.gated_delta_rule(query, key, value, g, beta, initial_state, implementation,
                                                          chunk_size, use_qk_l2norm_in_kernel, cu_seqlens)
        return out, (state if output_final_state else None)

    return gated_delta_rule


def _ssd_chunk_scan_stand_in(implementation: str) -> Callable:
    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                          dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None,
                          seq_idx=None, cu_seqlens=None, **kwargs):
        if z is not None:  # transformers' torch form takes no gate (its models gate after the scan)
            raise ValueError("autoshard: Mamba2's scan with a gate z is not recognized; gate its output instead")
        out, state = torch.ops.autoshard.ssd_chunk_scan(hidden_states, dt, B, C, A, D, dt_bias, initial_states,
                                                        implementation, chunk_size, dt_softplus, float(dt_limit[0]),
                                                        float(dt_limit[1]), seq_idx, cu_seqlens)
        return (out, state) if return_final_states else out

    return mamba2_chunk_scan


def _selective_scan_stand_in(implementation: str) -> Callable:
    def mamba_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                             return_last_state=False, **kwargs):
        # transformers' layout has the sequence last ([B, D, S], [B, N, S]); the op's has it on dim 1
        out, state = torch.ops.autoshard.selective_scan(
            hidden_states.transpose(1, 2), dt.transpose(1, 2), B.transpose(1, 2), C.transpose(1, 2),
            z.transpose(1, 2) if z is not None else None, A, D, delta_bias, implementation, delta_softplus)
        return (out.transpose(1, 2), state) if return_last_state else out.transpose(1, 2)

    return mamba_selective_scan


RECOGNIZED = (
    Recognized(package="transformers.models.", name="torch_chunk_gated_delta_rule",
               stand_in=_gated_delta_rule_stand_in),
    Recognized(package="transformers.models.", name="mamba2_chunk_scan", stand_in=_ssd_chunk_scan_stand_in),
    Recognized(package="transformers.models.", name="mamba_selective_scan", stand_in=_selective_scan_stand_in),
)
"""What is recognized (see the module docstring)."""

_FRAME = re.compile(r'File "([^"]+)", line \d+, in (\w+)')
"""A frame of a node's stack trace: (file, function)."""

_REGISTERED: dict[int, str] = {}
"""id of every function registered -> its implementation name (``module.function``)."""


def _defined(obj, name: str) -> Callable | None:
    """The outermost plain function named ``name`` that ``obj`` runs: ``obj`` itself, or what it wraps --
    ``functools.wraps`` chains (``__wrapped__``), closures, and the forward of a module standing for a function
    (transformers' hub-kernel wrappers make a module-level function an ``nn.Module`` whose forward calls it). The
    outermost: transformers' ``use_kernel_func_from_hub_with_fallback`` wraps the torch form in a function of its name
    that calls a kernel (fla, mamba-ssm) where one is installed and runs on the inputs' device, so the op runs
    whichever the model would."""
    todo, seen = [obj], set()
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.nn.Module):
            todo.append(type(item).forward)
        elif inspect.isfunction(item):
            if item.__name__ == name:
                return item
            todo += [getattr(item, "__wrapped__", None)] + [cell.cell_contents for cell in item.__closure__ or ()
                                                             if _filled(cell)]
    return None


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a closure variable not assigned yet
        return False
    return True


def recognize_loaded() -> None:
    """Register a stand-in with dynamo for every recognized function of the modules loaded now (once each)."""
    for recognized in RECOGNIZED:
        for module_name, module in list(sys.modules.items()):
            if not module_name.startswith(recognized.package) or not hasattr(module, recognized.name):
                continue
            fn = _defined(getattr(module, recognized.name), recognized.name)
            if fn is None or id(fn) in _REGISTERED:
                continue
            implementation = f"{module_name}.{recognized.name}"
            register_implementation(implementation, fn)
            torch._dynamo.substitute_in_graph(fn, skip_signature_check=True)(recognized.stand_in(implementation))
            _REGISTERED[id(fn)] = implementation


def warn_if_traced_through(gm: fx.GraphModule) -> None:
    """Warn when ``gm`` was traced through a recognized function (its module was imported after the backend
    looked, so dynamo unrolled it and it runs whole), and register the stand-ins for the graphs traced from now on."""
    names = {r.name for r in RECOGNIZED}
    unrolled = sorted({name for node in gm.graph.nodes
                       for path, name in _FRAME.findall(node.meta.get("stack_trace") or "")
                       if name in names and path != __file__})  # a stand-in shares its function's name
    if unrolled:
        recognize_loaded()
        warn(f"autoshard: this graph was traced through {', '.join(unrolled)} before autoshard recognized it (its "
             f"model module was imported after autoshard.backend() was made): it runs whole on every rank. Make the "
             f"backend after loading the model, or call torch._dynamo.reset() and run again")
