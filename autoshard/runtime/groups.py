"""Process groups as the runtime sees them.

Every public runtime function takes ``group=``: a ``ProcessGroup``, a 1-D ``DeviceMesh`` (its only
axis), a group name, or ``None`` for the default group. Custom ops cannot carry a ProcessGroup object
through the dispatcher, so they carry the group's *name* (a string, as torch's functional collectives
do) and resolve it back here.

A compiled graph communicates over the groups of :class:`SequenceGroups`: the sequence group, and for the hybrid
strategy the two axis groups of a 2-D ``(ring, ulysses)`` mesh, found by the one mesh parser
:func:`hybrid_mesh_axes` (the compiler and ``runtime.attention`` both read meshes through it).

The few private torch APIs the runtime needs (the default store, a mesh's flattened group, a group by name) are
reached through :func:`private_torch_api`, which names the torch version and what to do instead when a torch
release has moved them.

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
arguments and by the compiled graphs dynamo keeps (each holds its backend, and a backend its groups), so every
group and its threads end while Python still runs.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import sys
import types
import warnings
from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["GroupLike", "resolve_group", "group_name", "global_rank", "metadata_device", "PlanGroup",
           "plan_group_name", "SequenceGroups", "HYBRID_AXES", "hybrid_mesh_axes", "check_sequence_mesh",
           "sequence_group", "sequence_groups", "default_store", "private_torch_api"]

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
        return private_torch_api(dist.distributed_c10d, "_resolve_process_group",
                                 "pass the ProcessGroup itself, not its name, or use a torch release that has "
                                 "it")(group)
    if isinstance(group, (dist.ProcessGroup, PlanGroup)):
        return group
    raise TypeError(f"autoshard: group must be a ProcessGroup, a DeviceMesh, a group name or None, not {type(group)}")


def private_torch_api(owner: Any, name: str, instead: str) -> Any:
    """``owner.name``, a private torch API the runtime relies on; raises a RuntimeError naming the torch version
    and what to do ``instead`` when this torch release does not have it."""
    found = getattr(owner, name, None)
    if found is None:
        where = getattr(owner, "__name__", type(owner).__name__)
        raise RuntimeError(f"autoshard: torch {torch.__version__} has no {where}.{name}, a private API autoshard "
                           f"needs here; {instead}")
    return found


def default_store() -> dist.Store:
    """The default group's rendezvous store, where the ranks meet outside collectives (the compiler's same-graph
    check, a SplitTensor's gather outside compiled code)."""
    return private_torch_api(dist.distributed_c10d, "_get_default_store",
                             "no public API gives the default group's store: use a torch release that has it")()


HYBRID_AXES = ("ring", "ulysses")
"""Mesh axis names of the hybrid strategy's 2-D mesh, in the order the compiler needs them."""


def hybrid_mesh_axes(mesh: DeviceMesh) -> tuple[int, int]:
    """``(ring_axis, ulysses_axis)`` of a 2-D mesh: the axes named ``"ring"`` / ``"ulysses"``; with one name only
    the other axis is the other one; unnamed: ``(0, 1)``. Raises ValueError for a mesh that is not 2-D or whose
    names give no distinct axes."""
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
        raise ValueError(f"autoshard: the hybrid strategy needs a 2-D DeviceMesh, got {type(mesh).__name__}"
                         + (f" with {mesh.ndim} axes" if isinstance(mesh, DeviceMesh) else ""))
    names = tuple(mesh.mesh_dim_names or ())
    ulysses = names.index("ulysses") if "ulysses" in names else 1
    ring = names.index("ring") if "ring" in names else 1 - ulysses
    if ring == ulysses:
        raise ValueError(f"autoshard: the mesh axes {names} name no distinct ring and ulysses axes")
    return ring, ulysses


def check_sequence_mesh(mesh: DeviceMesh) -> None:
    """Raise unless ``mesh`` is a mesh the compiler can split a sequence over: 1-D (its one axis is the sequence
    group), or 2-D with axes named :data:`HYBRID_AXES` in that order (the sequence is laid out over the flattened
    mesh, whose rank order is the sequence order only with the ring axis first; see :func:`sequence_group`). A
    (dp, sp) mesh handed over whole would otherwise be flattened into one sequence group, and the data-parallel
    ranks would split one sequence among them."""
    if mesh.ndim == 1:
        return
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 2 and set(names) == set(HYBRID_AXES):
        if hybrid_mesh_axes(mesh) != (0, 1):
            raise ValueError("autoshard: order the hybrid mesh as (ring, ulysses): "
                             "init_device_mesh(device, (P_ring, P_ulysses), mesh_dim_names=('ring', 'ulysses'))")
        return
    shown = names or f"{mesh.ndim} unnamed axes"
    sequence = next((n for n in names if n in ("sp", "cp", "seq", "context", "sequence")), None)
    pick = f"mesh[{sequence!r}]" if sequence else "mesh['<sequence axis>']"
    raise ValueError(
        f"autoshard: a {mesh.ndim}-D mesh with axes {shown} is not a sequence mesh; pass the 1-D sub-mesh of the "
        f"sequence axis, autoshard.backend({pick}) (the other axes belong to DDP/FSDP), or, for the hybrid "
        f"strategy, a 2-D mesh named ('ring', 'ulysses')")


def _is_hybrid_mesh(group: GroupLike) -> bool:
    return isinstance(group, DeviceMesh) and group.ndim == 2


def sequence_group(group: GroupLike) -> dist.ProcessGroup:
    """The group a compiled graph splits its sequence over: the group ``group`` denotes, or for a 2-D
    ``(ring, ulysses)`` mesh (checked by :func:`check_sequence_mesh`) the flattened mesh, in which the rank at
    ``(ring i, ulysses j)`` is ``i * P_ulysses + j``: its rank order is the sequence order."""
    if not _is_hybrid_mesh(group):
        return resolve_group(group)
    check_sequence_mesh(group)
    flatten = private_torch_api(group, "_flatten", "pass a 1-D sequence mesh or a ProcessGroup and a strategy "
                                "other than 'hybrid', or use a torch release that has it")
    return flatten().get_group()


@dataclass(frozen=True, kw_only=True)
class SequenceGroups:
    """The groups one rank's compiled graph communicates over, by name (custom ops carry names)."""

    rank: int
    """This rank's place in the sequence group (which shard of the sequence it holds)."""
    world: int
    """Ranks in the sequence group: the sequence is split into this many shards."""
    sequence: str
    """Name of the sequence group (every rank holding a shard, in sequence order)."""
    ring: str = ""
    """Hybrid: name of this rank's ring-axis group (the ranks holding the same heads after the all-to-all);
    empty otherwise."""
    heads: str = ""
    """Hybrid: name of this rank's Ulysses-axis group (the ranks one all-to-all moves to head-split); empty
    otherwise."""
    heads_axis_size: int | None = None
    """Hybrid: ranks on the Ulysses axis; None without a 2-D mesh (a plan may still choose the hybrid, see
    :meth:`planned_hybrid`)."""

    @classmethod
    def planned(cls, rank: int, world: int) -> SequenceGroups:
        """The groups of ``rank`` of a dry run over ``world`` ranks (:class:`PlanGroup` names: nothing
        communicates)."""
        return cls(rank=rank, world=world, sequence=plan_group_name(rank, world))

    def planned_hybrid(self, heads_axis_size: int) -> SequenceGroups:
        """These groups with the plan groups of a ``(world / heads_axis_size, heads_axis_size)`` hybrid mesh
        ordered (ring, ulysses), for a dry run that chose the hybrid without a mesh."""
        ring_size = self.world // heads_axis_size
        return dataclasses.replace(self, ring=plan_group_name(self.rank // heads_axis_size, ring_size),
                                   heads=plan_group_name(self.rank % heads_axis_size, heads_axis_size),
                                   heads_axis_size=heads_axis_size)


def sequence_groups(group: GroupLike) -> SequenceGroups:
    """The :class:`SequenceGroups` of ``group`` (a ProcessGroup, a group name, a 1-D mesh, None for the default
    group, or a 2-D ``(ring, ulysses)`` mesh for the hybrid strategy) seen from this rank."""
    pg = sequence_group(group)
    if not _is_hybrid_mesh(group):
        return SequenceGroups(rank=pg.rank(), world=pg.size(), sequence=pg.group_name)
    ring, ulysses = hybrid_mesh_axes(group)
    return SequenceGroups(rank=pg.rank(), world=pg.size(), sequence=pg.group_name,
                          ring=group.get_group(ring).group_name, heads=group.get_group(ulysses).group_name,
                          heads_axis_size=group.size(ulysses))


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
    that dynamo's cache of compiled graphs (their backends) and ``torch.distributed.nn.functional``'s default
    arguments hold, so every gloo group is destroyed (its threads joined) before the interpreter shuts down (see
    the module docstring)."""
    if not dist.is_available():
        return
    forgotten = dist.is_initialized()
    if forgotten:
        dist.destroy_process_group()
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:  # its cache keeps every compiled graph's backend, and a backend its groups
        dynamo.reset()
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is not None:
        for fn in vars(functional).values():
            defaults = fn.__defaults__ if isinstance(fn, types.FunctionType) else None
            if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
                fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)
    gc.collect()  # the groups no reference holds any more end now, their threads joined while Python runs
    if forgotten:
        warnings.warn("autoshard: the process exited with torch.distributed still initialized; its process groups "
                      "were destroyed at exit. Call torch.distributed.destroy_process_group() at the end of the job.",
                      RuntimeWarning, stacklevel=1)


atexit.register(_release_groups)
