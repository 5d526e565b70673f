"""DeepEP's ``Config``: per-call tuning of the normal kernels. epx uses ``num_sms`` only (its per-call SM
count); the chunk sizes are DeepEP ring-buffer knobs with no epx equivalent, kept so code that builds
or reads them runs unchanged."""

from __future__ import annotations

import epx

# The size hints assume the copy-engine path should be usable up to this many tokens per rank
# (epx.normal_buffer_size_hint's max_tokens_per_rank); more tokens fall back to the SM path.
HINT_MAX_TOKENS_PER_RANK = 4096
# The fewest SMs a Buffer is sized for (DeepEP's tests and benchmarks use 24).
MIN_BUFFER_SMS = 24
# DeepEP's NVLink domain (NUM_MAX_NVL_PEERS): DeepEP places ranks on nodes of this many GPUs. The shim takes the
# nodes from the epx group or the host names instead, and only warns above it.
MAX_NVL_PEERS = 8


def normal_buffer_bytes(num_nvl_bytes: int, cuda: bool, num_ranks: int, num_sms: int) -> int:
    """The shim's epx num_normal_bytes: DeepEP's num_nvl_bytes when given, else epx's hint for the normal path; 0 on
    the cuda backend above epx.CUDA_NORMAL_MAX_RANKS ranks, where a buffer is low-latency only (a DeepEP buffer that
    asked for no NVLink bytes then gets no normal path, and its normal calls raise UnsupportedError)."""
    if num_nvl_bytes:
        return int(num_nvl_bytes)
    if cuda and num_ranks > epx.CUDA_NORMAL_MAX_RANKS:
        return 0
    return epx.normal_buffer_size_hint(8192, num_ranks, num_sms)


def low_latency_routing(requested: "str | None", cuda: bool) -> str:
    """The shim's epx low_latency_routing. None: DeepEP's flat routing where epx can run it for every topology (the
    host backend), else epx's "auto" (the cuda backend: flat on one node, hierarchical across nodes, whose ranks flat
    calls cannot reach: the cuda backend maps one host's GPUs only). An explicit value is passed through."""
    if requested is not None:
        return requested
    return "auto" if cuda else "flat"


def low_latency_config(requested: "epx.LowLatencyConfig | None", enable_shrink: bool) -> "epx.LowLatencyConfig":
    """The shim's epx.LowLatencyConfig: the caller's epx_low_latency tuning (copied, not changed; None: epx's
    defaults), with raise_on_timeout = not enable_shrink. epx masks a rank that does not come within the timeout either
    way (its tokens then combine as zeros); DeepEP without shrink traps the GPU there, so the shim raises
    epx.TimeoutError instead of returning that silently, and with enable_shrink masks as DeepEP's shrink mode does."""
    config = epx.LowLatencyConfig()
    if requested is not None:
        for name in ("combine_send_parts", "combine_solo_max_rows", "token_rows_min_tokens", "programmatic_launch",
                     "expert_side_reduction"):
            setattr(config, name, getattr(requested, name))
    config.raise_on_timeout = not enable_shrink
    return config


class Config:
    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        values = dict(num_sms=num_sms, num_max_nvl_chunked_send_tokens=num_max_nvl_chunked_send_tokens,
                      num_max_nvl_chunked_recv_tokens=num_max_nvl_chunked_recv_tokens,
                      num_max_rdma_chunked_send_tokens=num_max_rdma_chunked_send_tokens,
                      num_max_rdma_chunked_recv_tokens=num_max_rdma_chunked_recv_tokens)
        for name, value in values.items():
            if int(value) != value or value < (0 if name == "num_sms" else 1):
                raise ValueError(f"Config.{name} must be an integer >= {0 if name == 'num_sms' else 1}, got {value}")
        self.num_sms = int(num_sms)
        self.num_max_nvl_chunked_send_tokens = int(num_max_nvl_chunked_send_tokens)
        self.num_max_nvl_chunked_recv_tokens = int(num_max_nvl_chunked_recv_tokens)
        self.num_max_rdma_chunked_send_tokens = int(num_max_rdma_chunked_send_tokens)
        self.num_max_rdma_chunked_recv_tokens = int(num_max_rdma_chunked_recv_tokens)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of epx normal-path memory for rows of `hidden_bytes` (bf16: hidden * 2) over `num_ranks`."""
        hidden = max(1, (int(hidden_bytes) + 1) // 2)
        return int(epx.normal_buffer_size_hint(hidden, int(num_ranks), max(self.num_sms, MIN_BUFFER_SMS),
                                               HINT_MAX_TOKENS_PER_RANK))

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: epx's normal path keeps no RDMA memory, on one node or several (the internode path allocates its
        network buffers per call, through the buffer's allocator); num_rdma_bytes is only low-latency memory."""
        if int(num_ranks) < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        return 0

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")
