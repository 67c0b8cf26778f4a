"""Process groups as the runtime sees them.

Every public runtime function takes ``group=``: a ``ProcessGroup``, a 1-D ``DeviceMesh`` (its only
axis), a group name, or ``None`` for the default group. Custom ops cannot carry a ProcessGroup object
through the dispatcher, so they carry the group's *name* (a string, as torch's functional collectives
do) and resolve it back here.

Groups end before the interpreter does. Just after a collective returned, a gloo group's worker thread may
still hold the last reference to its tensors (the runtime's collectives run on temporaries whose Python
objects are gone by then); releasing them takes the GIL. While Python shuts down, a thread that asks for the
GIL is ended by ``pthread_exit``, whose forced unwind through a C++ destructor calls ``std::terminate``: the
process aborts ("terminate called without an active exception") after the job finished.
``destroy_process_group`` joins those threads, but only when it drops the last reference to the group, and
torch keeps another one once the first custom op call imports ``torch._dynamo`` after the group exists:
``torch.distributed.nn.functional`` (which dynamo imports) binds ``group.WORLD`` as a default argument of
its functions at import. So, when the process exits (an ``atexit`` hook, which runs before the interpreter
shuts down), :func:`_release_groups` destroys the groups a job left initialized (with a warning: call
``destroy_process_group`` at the end of the job) and drops the group references held in those default
arguments, so every group and its threads end while Python still runs.
"""

from __future__ import annotations

import atexit
import sys
import types
import warnings
from typing import Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["GroupLike", "resolve_group", "group_name", "global_rank", "metadata_device", "PlanGroup",
           "plan_group_name"]

_PLAN_PREFIX = "autoshard-plan/"


class PlanGroup:
    """A stand-in group for planning: it has a rank and a size, and nothing communicates through it. Fake
    (meta) implementations of the runtime's ops only need those, so a plan can run the per-rank graph on
    meta tensors without a process group."""

    def __init__(self, rank: int, world: int):
        self._rank, self._world = rank, world
        self.group_name = plan_group_name(rank, world)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world


def plan_group_name(rank: int, world: int) -> str:
    """The name of the plan group of ``rank`` out of ``world`` (see :class:`PlanGroup`)."""
    return f"{_PLAN_PREFIX}{rank}/{world}"

GroupLike = Union[None, str, dist.ProcessGroup, DeviceMesh]


def resolve_group(group: GroupLike) -> dist.ProcessGroup:
    """The ProcessGroup that ``group`` denotes; raises a clear error when there is none."""
    if group is None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "autoshard: no process group. Call torch.distributed.init_process_group(...) first, "
                "or pass group= (a ProcessGroup or a DeviceMesh)."
            )
        return dist.group.WORLD
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"autoshard: a {group.ndim}-D DeviceMesh names several groups; pass the 1-D sub-mesh of the "
                f"sequence axis (mesh['sp']) or, for the hybrid strategy, the 2-D mesh to runtime.attention"
            )
        return group.get_group()
    if isinstance(group, str):
        if group.startswith(_PLAN_PREFIX):
            rank, world = group[len(_PLAN_PREFIX):].split("/")
            return PlanGroup(int(rank), int(world))
        return dist.distributed_c10d._resolve_process_group(group)
    if isinstance(group, (dist.ProcessGroup, PlanGroup)):
        return group
    raise TypeError(f"autoshard: group must be a ProcessGroup, a DeviceMesh, a group name or None, not {type(group)}")


def group_name(group: GroupLike) -> str:
    """The registered name of the group (what custom ops carry)."""
    return resolve_group(group).group_name


def global_rank(group: GroupLike, rank: int) -> int:
    """The default-group rank of the group's ``rank`` (what point-to-point calls take)."""
    return dist.get_global_rank(resolve_group(group), rank)


def metadata_device(group: GroupLike) -> torch.device:
    """Where the small integer tensors the ranks exchange over ``group`` (lengths, flags) live: the CPU when
    the group's backend takes CPU tensors (gloo, or a ``cpu:gloo,cuda:nccl`` group), else the current device
    of the backend's accelerator (NCCL takes CUDA tensors only)."""
    backend = str(dist.get_backend(resolve_group(group))).lower()
    devices = dist.Backend.backend_capability.get(backend, ["cpu"])
    if "cpu" in devices:
        return torch.device("cpu")
    kind = devices[0]
    return torch.device(kind, torch.get_device_module(kind).current_device())


def _release_groups() -> None:
    """At exit: destroy the process groups a job left initialized, then drop the references to destroyed groups
    that ``torch.distributed.nn.functional`` holds in default arguments, so every gloo group is destroyed (its
    threads joined) before the interpreter shuts down (see the module docstring)."""
    if not dist.is_available():
        return
    forgotten = dist.is_initialized()
    if forgotten:
        dist.destroy_process_group()
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is not None:
        for fn in vars(functional).values():
            defaults = fn.__defaults__ if isinstance(fn, types.FunctionType) else None
            if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
                fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)
    if forgotten:
        warnings.warn("autoshard: the process exited with torch.distributed still initialized; its process groups "
                      "were destroyed at exit. Call torch.distributed.destroy_process_group() at the end of the job.",
                      RuntimeWarning, stacklevel=1)


atexit.register(_release_groups)
