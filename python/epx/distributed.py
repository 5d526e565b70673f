"""Groups for the one-process-per-GPU model (torchrun, mpirun, Slurm).

``group_from_process_group(pg)`` bootstraps an NCCL communicator over an existing torch process group:
rank 0 draws an NCCL unique id, the group broadcasts it (``torch.distributed.broadcast_object_list``),
and every rank creates its communicator on its current CUDA device. The epx Group owns that
communicator. Also reachable as ``epx.Group.from_process_group``.
"""

from __future__ import annotations

from typing import Any, Optional

from . import _epx


def group_from_process_group(pg: Any = None, timeout_ms: int = 60_000, device: Optional[int] = None,
                             gpus_per_node: int = 0) -> _epx.Group:
    """An epx CUDA group with the ranks of the torch process group `pg` (default: the world group).

    Collective over `pg`. `device`: the CUDA ordinal of this rank (default: torch's current device).
    `gpus_per_node`: ranks per node of the group's topology, numbered node-major (0: one node; else a divisor of
    the group's size, epx.InvalidArgumentError naming gpus_per_node otherwise). See docs/internode.md.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        raise _epx.InvalidArgumentError("pg: torch.distributed is not initialized (call init_process_group first)")
    pg = pg if pg is not None else dist.group.WORLD
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    device = torch.cuda.current_device() if device is None else int(device)
    unique_id = [_epx.nccl_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(unique_id, src=dist.get_global_rank(pg, 0), group=pg)
    return _epx.cuda_group_from_nccl_id(unique_id[0], rank, size, device, timeout_ms, gpus_per_node)


def group_from_nccl_comm(comm: int, timeout_ms: int = 60_000, gpus_per_node: int = 0) -> _epx.Group:
    """A group over an existing NCCL communicator (its ncclComm_t as an int); the communicator must outlive it.

    `gpus_per_node`: as group_from_process_group."""
    return _epx.cuda_group_from_nccl_comm(comm, timeout_ms, gpus_per_node)
