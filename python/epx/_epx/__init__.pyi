"""
epx native module: the C++ API of epx. Use the `epx` package, which wraps it for numpy and torch.
"""

from collections.abc import Sequence
import enum

from epx import (
    CudaError as CudaError,
    Error as Error,
    InternalError as InternalError,
    InvalidArgumentError as InvalidArgumentError,
    NcclError as NcclError,
    OutOfMemoryError as OutOfMemoryError,
    PeerFailureError as PeerFailureError,
    TimeoutError as TimeoutError,
    UnsupportedError as UnsupportedError
)
from epx._epx import dp as dp, eplb as eplb, tbo as tbo
from epx.distributed import (
    group_from_nccl_comm as from_nccl_comm,
    group_from_process_group as from_process_group
)


class DType(enum.Enum):
    """
    Element types epx moves (bf16 travels as uint16 and fp8 as uint8 across DLPack).
    """

    bfloat16 = 0

    float8_e4m3 = 1

    float32 = 2

    int32 = 3

    int64 = 4

    bool = 5

    uint8 = 6

class ScaleFormat(enum.Enum):
    """fp8 scales: float32, or UE8M0 power-of-two exponents (uint8)."""

    float32 = 0

    ue8m0 = 1

class ScaleLayout(enum.Enum):
    """
    Low-latency fp8 scale layout: row_major [E, R * M, S], or column_major [E, S, R * M] (DeepGEMM's; S = H / 512 int32 words of four exponents with UE8M0).
    """

    row_major = 0

    column_major = 1

def version() -> str:
    """The epx version, e.g. '0.1.0'."""

def built_with_cuda() -> bool:
    """True when this build contains the CUDA backend."""

def set_log_level(level: str) -> None:
    """Sets the library's log level (also EPX_LOG_LEVEL)."""

class Topology:
    """
    Where a group's ranks sit: num_nodes nodes of gpus_per_node ranks each, numbered node-major (rank = node * gpus_per_node + local_rank). See include/epx/group.h.
    """

    def __init__(self) -> None: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def gpus_per_node(self) -> int: ...

    @property
    def num_ranks(self) -> int: ...

    def node_of(self, rank: int) -> int:
        """The node of `rank` (rank // gpus_per_node)."""

    def local_rank_of(self, rank: int) -> int:
        """The index of `rank` inside its node (rank % gpus_per_node)."""

    def rank_of(self, node: int, local_rank: int) -> int:
        """node * gpus_per_node + local_rank."""

    def __eq__(self, arg: Topology, /) -> bool: ...

    def __repr__(self) -> str: ...

class Group:
    """
    One rank's membership in a set of ranks that run expert parallelism together.
    Collective calls must be made by every rank of the group in the same order.
    """

    @property
    def rank(self) -> int: ...

    @property
    def num_ranks(self) -> int: ...

    @property
    def backend(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def timeout_ms(self) -> int: ...

    @property
    def topology(self) -> Topology:
        """
        The ranks' placement on nodes (epx.Topology); one node holding every rank unless the group was made with gpus_per_node.
        """

    def barrier(self) -> None:
        """
        Blocks until every rank arrived; raises epx.TimeoutError naming the ranks that did not.
        """

    def all_gather_bytes(self, data: bytes) -> list:
        """
        Every rank contributes the same number of bytes; returns them in rank order.
        """

    def __repr__(self) -> str: ...

def host_groups(num_ranks: int, timeout_ms: int = 60000, gpus_per_node: int = 0) -> list[Group]:
    """
    The groups of `num_ranks` thread ranks of the host backend; hand groups[r] to the thread of rank r.
    gpus_per_node: ranks per node of the groups' topology (0: one node; else a divisor of num_ranks). The threads still share memory; with more than one node the normal dispatch/combine route hierarchically.
    """

def cuda_groups(devices: Sequence[int], timeout_ms: int = 60000, gpus_per_node: int = 0) -> list[Group]:
    """
    One CUDA group per entry of `devices` (one process, one thread per rank). gpus_per_node: as host_groups.
    """

def cuda_group_from_nccl_comm(comm: int, timeout_ms: int = 60000, gpus_per_node: int = 0) -> Group:
    """
    A group over an existing NCCL communicator (its ncclComm_t as an int); the communicator must outlive it. gpus_per_node: ranks per node (0: one node; else a divisor of the communicator's size).
    """

def nccl_unique_id() -> bytes:
    """NCCL's unique id as bytes (loads NCCL on first use)."""

def cuda_group_from_nccl_id(unique_id: bytes, rank: int, num_ranks: int, device: int, timeout_ms: int = 60000, gpus_per_node: int = 0) -> Group:
    """
    A group that creates and owns an NCCL communicator from a unique id shared by all ranks (collective). gpus_per_node: as host_groups.
    """

class DispatchHandle:
    """
    Opaque record of one normal dispatch: pass it to combine, or to dispatch (cached mode).
    """

    @property
    def num_tokens(self) -> int:
        """T of the dispatching rank."""

    @property
    def num_recv_tokens(self) -> int:
        """Rows received; -1 in worst-token mode on the cuda backend."""

    @property
    def rank_prefix_matrix(self) -> object:
        """
        (array, DType): int32 [R, R], [i][j] = tokens that ranks 0..i send to rank j (DeepEP's meaning).
        """

class LowLatencyHandle:
    """Opaque record of one low-latency dispatch (for its combine)."""

#: The cuda backend's rank caps (include/epx/buffer.h): normal path flat / hierarchical routing, then low-latency.
CUDA_FLAT_NORMAL_MAX_RANKS: int
CUDA_NORMAL_MAX_RANKS: int
CUDA_FLAT_LOW_LATENCY_MAX_RANKS: int
CUDA_LOW_LATENCY_MAX_RANKS: int

def low_latency_buffer_size_hint(max_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """
    Bytes of peer memory the low-latency path needs for two buffer sets with these limits.
    """

def normal_buffer_size_hint(hidden: int, num_ranks: int, num_sms: int, max_tokens_per_rank: int = 0) -> int:
    """
    Bytes of peer memory the normal path needs (copy-engine path up to max_tokens_per_rank when > 0).
    """

class NormalConfig:
    """
    Tuning of the cuda backend's normal kernels (BufferOptions::normal in include/epx/buffer.h); the same on every rank except stage_timeline and early_copies.
    """

    def __init__(self) -> None: ...

    @property
    def copy_engines(self) -> bool: ...

    @copy_engines.setter
    def copy_engines(self, arg: bool, /) -> None: ...

    @property
    def whole_copies(self) -> bool: ...

    @whole_copies.setter
    def whole_copies(self, arg: bool, /) -> None: ...

    @property
    def stream_signals(self) -> bool: ...

    @stream_signals.setter
    def stream_signals(self, arg: bool, /) -> None: ...

    @property
    def max_copy_chunks(self) -> int: ...

    @max_copy_chunks.setter
    def max_copy_chunks(self, arg: int, /) -> None: ...

    @property
    def stage_timeline(self) -> bool: ...

    @stage_timeline.setter
    def stage_timeline(self, arg: bool, /) -> None: ...

    @property
    def early_copies(self) -> EarlyCopies: ...

    @early_copies.setter
    def early_copies(self, arg: EarlyCopies, /) -> None: ...

class LowLatencyConfig:
    """
    Tuning of the cuda backend's low-latency kernels (BufferOptions::low_latency); the same on every rank.
    """

    def __init__(self) -> None: ...

    @property
    def combine_send_parts(self) -> int: ...

    @combine_send_parts.setter
    def combine_send_parts(self, arg: int, /) -> None: ...

    @property
    def token_rows_min_tokens(self) -> int: ...

    @token_rows_min_tokens.setter
    def token_rows_min_tokens(self, arg: int, /) -> None: ...

    @property
    def programmatic_launch(self) -> bool: ...

    @programmatic_launch.setter
    def programmatic_launch(self, arg: bool, /) -> None: ...

    @property
    def expert_side_reduction(self) -> bool: ...

    @expert_side_reduction.setter
    def expert_side_reduction(self, arg: bool, /) -> None: ...

class EarlyCopies(enum.Enum):
    """
    When a fresh two-rank dispatch starts copying its whole x to the peer (NormalConfig.early_copies, docs/normal-kernels.md): auto (before notify when x fits the staging and the peer is expected to need >= 15/16 of the tokens), always (whenever x fits), never (after notify). Results are the same in every mode.
    """

    auto = 0

    always = 1

    never = 2

class NormalRouting(enum.Enum):
    """
    Which way normal dispatch/combine move tokens (BufferOptions::normal_routing, docs/internode.md): auto (hierarchical when the group's topology has more than one node), flat, or hierarchical. The same on every rank.
    """

    auto = 0

    flat = 1

    hierarchical = 2

class LowLatencyRouting(enum.Enum):
    """
    Which way low-latency dispatch/combine move (token, expert) pairs (BufferOptions::low_latency_routing, docs/internode.md): auto (hierarchical when the group's topology has more than one node), flat, or hierarchical (both backends). The same on every rank.
    """

    auto = 0

    flat = 1

    hierarchical = 2

class NodePartials(enum.Enum):
    """
    How the hierarchical routings' combine carries a node's partial sum over the network leg (BufferOptions::node_partials, docs/internode.md): fp32 (the default; one rounding) or bf16 (each node's partial rounded first: half the bytes, DeepEP's internode choice). The same on every rank.
    """

    fp32 = 0

    bf16 = 1

class Buffer:
    """
    One rank's expert-parallel communication buffer (see include/epx/buffer.h).
    """

    @staticmethod
    def create(group: Group, num_normal_bytes: int = 0, num_low_latency_bytes: int = 0, num_sms: int = 24, allocator: object | None = None, normal: NormalConfig = ..., low_latency: LowLatencyConfig = ..., normal_routing: NormalRouting = NormalRouting.auto, low_latency_routing: LowLatencyRouting = LowLatencyRouting.auto, node_partials: NodePartials = NodePartials.fp32) -> Buffer: ...

    @property
    def rank(self) -> int: ...

    @property
    def num_ranks(self) -> int: ...

    def get_dispatch_layout(self, topk_idx: object, num_experts: int, stream: object | None = None) -> tuple:
        """
        (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, num_tokens_per_node); the last is None where the backend leaves it undefined (cuda, flat routing).
        """

    def dispatch(self, x: object, x_scales: object | None = None, topk_idx: object | None = None, topk_weights: object | None = None, num_experts: int = 0, layout: object | None = None, handle: DispatchHandle | None = None, expert_alignment: int = 1, num_worst_tokens: int = 0, num_sms: int = 0, stream: object | None = None) -> dict: ...

    def combine(self, x: object, topk_weights: object | None = None, bias_0: object | None = None, bias_1: object | None = None, handle: DispatchHandle | None = None, num_sms: int = 0, stream: object | None = None, order_topk_idx: object | None = None) -> dict: ...

    def low_latency_dispatch(self, x: object, topk_idx: object, max_tokens_per_rank: int, num_experts: int, use_fp8: bool = False, scale_format: ScaleFormat = ScaleFormat.float32, round_scale: bool = False, scale_layout: ScaleLayout = ScaleLayout.row_major, return_recv_hook: bool = False, cumulative_recv_counts: object | None = None, wait_recv_cost_ns: object | None = None, stream: object | None = None) -> dict: ...

    def low_latency_combine(self, x: object, topk_idx: object, topk_weights: object, handle: LowLatencyHandle, return_recv_hook: bool = False, out: object | None = None, wait_recv_cost_ns: object | None = None, stream: object | None = None) -> dict: ...

    def mask_rank(self, rank: int) -> None: ...

    def unmask_rank(self, rank: int) -> None: ...

    def clear_rank_mask(self) -> None: ...

    def rank_mask(self) -> list[bool]: ...

    def clean_low_latency_buffer(self) -> None: ...
