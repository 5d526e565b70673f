"""epx: expert-parallel communication and load balancing for mixture-of-experts models.

The same C++ core as the `epx` library and CLI, for numpy and torch:

* ``Buffer``: normal and low-latency dispatch/combine (host backend on CPU threads, CUDA backend on GPUs);
* ``host_groups(n)`` + ``run_host_ranks``: n ranks as threads of this process (no GPU needed);
* ``cuda_groups(devices)``, ``Group.from_process_group(pg)``: CUDA groups;
* ``gpus_per_node=`` on every group constructor and ``Group.topology``: ranks on several nodes, where the normal
  dispatch/combine route hierarchically (``Buffer(..., normal_routing=...)``, docs/internode.md);
* errors: ``epx.Error`` and one subclass per code (``InvalidArgumentError`` is also a ``ValueError``,
  ``TimeoutError`` also the builtin ``TimeoutError``).

``import epx`` needs no GPU, driver or NCCL; they are loaded on first use.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Sequence

from ._epx import (  # noqa: F401
    CUDA_FLAT_LOW_LATENCY_MAX_RANKS,
    CUDA_FLAT_NORMAL_MAX_RANKS,
    CUDA_LOW_LATENCY_MAX_RANKS,
    CUDA_NORMAL_MAX_RANKS,
    CudaError,
    DType,
    EarlyCopies,
    Error,
    Group,
    InternalError,
    InvalidArgumentError,
    LowLatencyConfig,
    LowLatencyRouting,
    NcclError,
    NodePartials,
    NormalConfig,
    NormalRouting,
    OutOfMemoryError,
    PeerFailureError,
    ScaleFormat,
    ScaleLayout,
    TimeoutError,
    Topology,
    UnsupportedError,
    built_with_cuda,
    cuda_groups,
    host_groups,
    low_latency_buffer_size_hint,
    normal_buffer_size_hint,
    set_log_level,
    version,
)
from ._tensors import bf16, fp8  # noqa: F401
from .distributed import group_from_nccl_comm, group_from_process_group  # noqa: F401
from .buffer import (  # noqa: F401
    Buffer,
    CombineResult,
    DispatchResult,
    Layout,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
)
from . import dp, eplb, tbo  # noqa: F401 - submodules; epx.plot (matplotlib) is imported on demand

__version__ = version()
Group.from_process_group = staticmethod(group_from_process_group)
Group.from_nccl_comm = staticmethod(group_from_nccl_comm)


def run_host_ranks(groups: Sequence[Group], fn: Callable[[int, Group], Any]) -> List[Any]:
    """Runs fn(rank, group) on one thread per group, joins them, and returns the results in rank order.

    The first exception by rank order is re-raised after every thread has finished.
    """
    results: List[Any] = [None] * len(groups)
    errors: List[BaseException] = [None] * len(groups)  # type: ignore[list-item]

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, groups[rank])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[rank] = e

    threads = [threading.Thread(target=body, args=(r,), name=f"epx-rank-{r}") for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results
