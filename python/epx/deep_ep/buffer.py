"""``deep_ep.Buffer`` (DeepEP's classic V1 API) over ``epx.Buffer``.

Streams, as DeepEP defines them. Each Buffer owns a communication stream (``get_comm_stream()``). A normal
call with ``async_finish``, ``previous_event`` or ``allocate_on_comm_stream`` runs there: the comm stream
first waits for ``previous_event`` (else for the current stream), epx enqueues on it, and then either the
call returns an EventOverlap recorded on the comm stream (``async_finish``) or the current stream waits
for the comm stream. A call with none of the three runs on the current stream directly: the caller sees
the same ordering without the two cross-stream waits. epx allocates outputs on the stream it runs on, so
outputs made on the comm stream are ``record_stream``-ed on the current stream (and, with async_finish,
inputs on the comm stream), which keeps the caching allocator from handing their memory to another
stream early; nothing is recorded while a CUDA graph is being captured (DeepEP's rule as well: keep the
EventOverlap, whose ``extra_tensors`` hold the tensors, until you have waited on it).

Low-latency calls run on the current stream, or on the comm stream (after it waited for the current one)
with ``async_finish``; with ``return_recv_hook`` the send half runs now and the hook runs the receive half
on the same stream.
"""

from __future__ import annotations

import contextlib
import inspect
import socket
import warnings
from typing import Any, Callable, List, Optional, Tuple, Union

import torch

import epx
from epx import _epx

from .config import (MAX_NVL_PEERS, MIN_BUFFER_SMS, Config, low_latency_config, low_latency_routing,
                     normal_buffer_bytes)
from .events import EventHandle, EventOverlap, torch_event_of
from .handles import (InternodeHandle, LowLatencyHandle, NormalHandle, native_dispatch_handle,
                      native_low_latency_handle)


def _accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _tensors(*items: Any):
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (tuple, list)):
            yield from _tensors(*item)


class _Launch:
    """Where one call runs: `stream` (None on the host backend), the caller's `compute` stream, and
    whether `stream` is the buffer's comm stream."""

    __slots__ = ("stream", "compute", "on_comm")

    def __init__(self, stream: Any, compute: Any, on_comm: bool) -> None:
        self.stream, self.compute, self.on_comm = stream, compute, on_comm

    def scope(self):
        """Makes torch ops issued inside run on this call's stream."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()


class Buffer:
    """DeepEP's communication buffer, served by an ``epx.Buffer`` of this rank.

    group: a torch ProcessGroup (one process per GPU; its ranks' current CUDA devices), or an ``epx.Group``
    (e.g. ``epx.host_groups(n, gpus_per_node=g)[r]`` for the host backend). num_nvl_bytes: peer memory of the
    normal path (0: epx's default size). num_rdma_bytes: with low_latency_mode, the low-latency memory
    (see get_low_latency_rdma_size_hint); otherwise unused (epx's internode normal path allocates its network
    buffers per call). num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric: accepted and
    ignored (epx always uses NVLink within a node). enable_shrink: the rank mask is always there; a rank that does not
    come to a low-latency call within the timeout is masked either way, and without enable_shrink (DeepEP traps the
    GPU there) the round's combine also raises epx.TimeoutError naming it once enqueued (cuda: that round's or the
    next round's; LowLatencyConfig.raise_on_timeout), so its missing contribution is never silent.

    Nodes (DeepEP's RDMA ranks): an epx.Group brings its topology (``group.topology``); a ProcessGroup's ranks
    are placed by host name: one host is one node, else every host must hold the same number of consecutive
    ranks, which is gpus_per_node (DeepEP's fixed 8 GPUs per node, NUM_MAX_NVL_PEERS, is the usual case).
    ``epx_gpus_per_node`` overrides that. With more than one node, get_dispatch_layout returns
    num_tokens_per_rdma_rank, dispatch returns DeepEP's internode handle, and dispatch/combine run epx's
    hierarchical path (docs/internode.md).

    epx-only keywords: epx_num_sms, the most SMs a call may use (default max(24, Buffer.num_sms); a
    Config asking for more is clamped, with a warning); epx_timeout_ms, the group's timeout for peer
    waits; epx_column_major_scales (default True), whether low-latency fp8 scales come in DeepEP's
    column-major layout or row-major (both written by the receive kernel, no copy); epx_gpus_per_node, the
    ranks per node of a ProcessGroup (0 or None: from the host names; ignored for an epx.Group);
    epx_low_latency, an epx.LowLatencyConfig for the low-latency kernels (None: epx's defaults), e.g. with
    expert_side_reduction = True (one partial row per token and expert rank; another summation order than
    DeepEP's, docs/low-latency.md); epx_node_partials (default "bf16", as DeepEP's internode combine, whose RDMA leg
    carries bf16 rows), how the combine across nodes carries a node's partial sum (epx.Buffer's node_partials;
    "fp32" keeps a single rounding); epx_low_latency_routing (default None: DeepEP's flat routing on one node and on
    the host backend, epx's hierarchical routing across nodes on the cuda backend, whose peer memory maps GPUs of one
    host only; "flat", "hierarchical" or "auto" force one, see docs/deepep-migration.md). The same on every rank.
    """

    #: SMs of the normal kernels when no Config is given (DeepEP's class attribute; see set_num_sms).
    num_sms: int = 20

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm: Any = None, *, epx_num_sms: Optional[int] = None,
                 epx_timeout_ms: int = 60_000, epx_column_major_scales: bool = True,
                 epx_gpus_per_node: Optional[int] = None,
                 epx_low_latency: Optional[_epx.LowLatencyConfig] = None,
                 epx_node_partials: str = "bf16", epx_low_latency_routing: Optional[str] = None) -> None:
        if group is None:
            if comm is not None:
                raise NotImplementedError("epx.deep_ep: an mpi4py communicator (comm=) is not supported; "
                                          "pass a torch ProcessGroup as group")
            raise ValueError("group: a torch ProcessGroup (or an epx.Group) is required")
        if num_nvl_bytes < 0 or num_rdma_bytes < 0:
            raise ValueError(f"num_nvl_bytes and num_rdma_bytes must be >= 0, got {num_nvl_bytes}, {num_rdma_bytes}")

        if isinstance(group, _epx.Group):
            epx_group = group
            self.rank, self.group_size = group.rank, group.num_ranks
            self._cuda = str(group.device).startswith("cuda")
            self._device = torch.device(str(group.device))  # "cuda:N" or "cpu"
        else:
            self.rank, self.group_size = group.rank(), group.size()
            gpus_per_node = int(epx_gpus_per_node) if epx_gpus_per_node else self._gpus_per_node_of(group)
            self._cuda = True
            self._device = torch.device("cuda", torch.cuda.current_device())
            epx_group = self._group_from_process_group(group, epx_timeout_ms, gpus_per_node)
        self.group = group
        self.epx_group = epx_group
        topology = getattr(epx_group, "topology", None)
        #: DeepEP's RDMA ranks (nodes) and NVLink ranks (ranks per node) of this buffer.
        self.num_rdma_ranks = topology.num_nodes if topology is not None else 1
        self.num_nvl_ranks = topology.gpus_per_node if topology is not None else self.group_size
        self.rdma_rank, self.nvl_rank = self.rank // self.num_nvl_ranks, self.rank % self.num_nvl_ranks
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink

        self._max_sms = int(epx_num_sms) if epx_num_sms else max(MIN_BUFFER_SMS, Buffer.num_sms)
        normal_bytes = normal_buffer_bytes(num_nvl_bytes, self._cuda, self.group_size, self._max_sms)
        self._low_latency_bytes = num_rdma_bytes if low_latency_mode else 0
        # NOTE: DeepEP's low-latency kernels send every (token, expert) pair straight to its rank, across nodes too,
        # and its combine adds the pairs in top-k order: epx's flat low-latency routing, which the shim keeps wherever
        # epx can run it (one node; any topology on the host backend). Across nodes the cuda backend needs the
        # hierarchical one (docs/internode.md, "Low-latency across nodes"): its flat calls reach one host's GPUs.
        self.runtime: Optional[epx.Buffer] = epx.Buffer(epx_group, num_normal_bytes=normal_bytes,
                                                        num_low_latency_bytes=self._low_latency_bytes,
                                                        num_sms=self._max_sms,
                                                        low_latency=low_latency_config(epx_low_latency,
                                                                                       enable_shrink),
                                                        low_latency_routing=low_latency_routing(
                                                            epx_low_latency_routing, self._cuda),
                                                        node_partials=epx_node_partials)
        self._native = self.runtime._native
        self._call_num_sms = _accepts(self.runtime.dispatch, "num_sms") and _accepts(self.runtime.combine, "num_sms")
        self._column_major_scales = epx_column_major_scales
        self._comm_stream = torch.cuda.Stream(device=self._device) if self._cuda else None
        # zero_copy combine inputs: two tensors used in turn, one per low-latency combine (as DeepEP's two buffer
        # halves), so that filling the next one cannot race the previous combine still reading its own (async_finish).
        self._combine_staging: List[Optional[torch.Tensor]] = [None, None]
        self._num_ll_combines = 0
        self._warned_sms = False

    # ---- set-up helpers ------------------------------------------------------------------------------

    @staticmethod
    def _gpus_per_node_of(group: Any) -> int:
        """Ranks per node from the ranks' host names: 0 (one node) when they share one host, else the ranks per
        host, which must be the same on every host and consecutive (node-major, as DeepEP numbers them)."""
        import torch.distributed as dist

        hosts: List[Any] = [None] * group.size()
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        return gpus_per_node_from_hosts(hosts)

    @staticmethod
    def _group_from_process_group(group: Any, timeout_ms: int, gpus_per_node: int):
        from epx.distributed import group_from_process_group

        return group_from_process_group(group, timeout_ms=timeout_ms, gpus_per_node=gpus_per_node)

    def is_internode(self) -> bool:
        """True when the buffer spans more than one node (DeepEP: more than one RDMA rank)."""
        return self.num_rdma_ranks > 1

    def get_num_rdma_ranks(self) -> int:
        """Nodes of the group (DeepEP's runtime.get_num_rdma_ranks())."""
        return self.num_rdma_ranks

    def get_rdma_rank(self) -> int:
        """This rank's node (DeepEP's runtime.get_rdma_rank())."""
        return self.rdma_rank

    def _alive(self) -> epx.Buffer:
        if self.runtime is None:
            raise RuntimeError("this deep_ep.Buffer was destroyed")
        return self.runtime

    def destroy(self) -> None:
        """Releases the epx buffer (after this rank's device work finished). Needs explicitly_destroy=True."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs a Buffer made with explicitly_destroy=True")
        if self.runtime is None:
            return
        if self._cuda:
            torch.cuda.synchronize(self._device)
        self.runtime = None
        self._native = None
        self._combine_staging = [None, None]

    # ---- static helpers ------------------------------------------------------------------------------

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: fp8 (e4m3 data, fp32 or UE8M0 scales) is available on every epx backend."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the SMs of the normal kernels when no Config is given (an even number, as DeepEP requires)."""
        if new_num_sms <= 0 or new_num_sms % 2 != 0:
            raise ValueError(f"the SM count must be a positive even number, got {new_num_sms}")
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def capture() -> EventOverlap:
        """An EventOverlap recorded on the current stream now (for previous_event)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of low-latency memory (num_rdma_bytes with low_latency_mode) for these limits."""
        return int(epx.low_latency_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts))

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Config(Buffer.num_sms): epx tunes its own chunking; only the SM count matters."""
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Config(Buffer.num_sms), as get_dispatch_config."""
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        return Config(Buffer.num_sms)

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The stream that async_finish / previous_event / allocate_on_comm_stream calls run on."""
        if self._comm_stream is None:
            raise RuntimeError("a host-backend buffer has no CUDA stream")
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        raise NotImplementedError("epx.deep_ep: get_local_buffer_tensor has no epx equivalent (epx does not expose "
                                  "its peer memory as a raw tensor)")

    # ---- streams ---------------------------------------------------------------------------------------

    def _begin(self, previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool) -> _Launch:
        if not self._cuda:
            return _Launch(None, None, False)
        compute = torch.cuda.current_stream(self._device)
        if not (async_finish or previous_event is not None or allocate_on_comm_stream):
            return _Launch(compute, compute, False)
        comm = self._comm_stream
        event = torch_event_of(previous_event)
        if event is not None:
            comm.wait_event(event)
        else:
            comm.wait_stream(compute)
        return _Launch(comm, compute, True)

    def _finish(self, launch: _Launch, async_finish: bool, inputs: Tuple[Any, ...] = (),
                outputs: Tuple[Any, ...] = (), keep: Optional[Tuple[Any, ...]] = None) -> EventOverlap:
        if not launch.on_comm:  # ran on the current stream (or on the host backend: already complete)
            return EventOverlap(EventHandle.completed()) if async_finish else EventOverlap()
        if not torch.cuda.is_current_stream_capturing():
            if async_finish:
                for t in _tensors(*inputs):
                    if t.is_cuda:
                        t.record_stream(launch.stream)
            for t in _tensors(*outputs):
                if t.is_cuda:
                    t.record_stream(launch.compute)
        if async_finish:
            return EventOverlap(EventHandle(launch.stream), keep)
        launch.compute.wait_stream(launch.stream)
        return EventOverlap()

    def _sms(self, config: Optional[Config]) -> dict:
        if not self._call_num_sms:
            return {}
        n = config.num_sms if config is not None else Buffer.num_sms
        if n <= 0:
            return {}
        if n > self._max_sms:
            if not self._warned_sms:
                warnings.warn(f"epx.deep_ep: Config.num_sms={n} is more than this Buffer's {self._max_sms} "
                              "(epx_num_sms); using that", stacklevel=3)
                self._warned_sms = True
            n = self._max_sms
        return {"num_sms": int(n)}

    # ---- small collectives over the epx group (host-side, for the rare paths that need them) ---------

    def _all_gather_int32(self, t: torch.Tensor) -> torch.Tensor:
        """[n] int32 on this rank -> [R, n] int32 (CPU), via the epx group (a host sync on t's stream)."""
        host = t.to(device="cpu", dtype=torch.int32).contiguous()
        parts = self.epx_group.all_gather_bytes(host.numpy().tobytes())
        return torch.stack([torch.frombuffer(bytearray(p), dtype=torch.int32) for p in parts])

    # ---- normal path -------------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Any = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [num_rdma_ranks] or None on one node,
        num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R], EventOverlap). Not collective.
        num_tokens_per_rdma_rank[n]: tokens with an expert on a rank of node n (what crosses the network to n)."""
        runtime = self._alive()
        launch = self._begin(previous_event, async_finish, allocate_on_comm_stream)
        layout = runtime.get_dispatch_layout(topk_idx, num_experts, stream=launch.stream)
        per_node = getattr(layout, "num_tokens_per_node", None) if self.is_internode() else None
        if self.is_internode() and per_node is None:
            raise RuntimeError("epx.deep_ep: this epx build does not report num_tokens_per_node; the internode "
                               "layout needs it")
        outs = (layout.num_tokens_per_rank, per_node, layout.num_tokens_per_expert, layout.is_token_in_rank)
        event = self._finish(launch, async_finish, (topk_idx,), outs, keep=(topk_idx,) + outs)
        return layout.num_tokens_per_rank, per_node, layout.num_tokens_per_expert, layout.is_token_in_rank, event

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Any = None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Normal dispatch, intranode or (more than one node) internode over epx's hierarchical path. x: bf16
        [T, H], or (fp8 [T, H], scales) with fp32 [T, H/128] scales in any strides or packed int32 UE8M0 [T, H/512].
        num_tokens_per_rdma_rank: optional (the layout's); epx checks it against topk_idx when given.

        Returns (recv_x or (recv_x, recv_scales), recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, EventOverlap); rows ordered by source rank, then token.
        Cached mode (handle given): (recv_x, None, None, None, None, event). Worst-token mode: exactly
        num_worst_tokens rows, recv_topk_idx -1 past the received ones, an empty list, no host sync.
        """
        runtime = self._alive()
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        sms = self._sms(config)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("cached dispatch (handle given) takes no topk_idx / topk_weights")
            native = native_dispatch_handle(handle)
            launch = self._begin(previous_event, async_finish, allocate_on_comm_stream)
            res = runtime.dispatch(x, x_scales=x_scales, handle=native, num_worst_tokens=num_worst_tokens,
                                   stream=launch.stream, **sms)
            outs = (res.recv_x, res.recv_x_scales)
            # keep: the native handle too (its device tensors live on the fresh dispatch's stream and must outlive this
            # call on the comm stream, also when the caller drops the handle before waiting).
            event = self._finish(launch, async_finish, (x, x_scales), outs, keep=(x, x_scales) + outs + (native,))
            recv = (res.recv_x, res.recv_x_scales) if x_scales is not None else res.recv_x
            return recv, None, None, None, None, event

        if num_tokens_per_expert is None:
            raise ValueError("dispatch without a handle needs num_tokens_per_expert (from get_dispatch_layout)")
        num_experts = int(num_tokens_per_expert.numel())
        rank_routing = topk_idx is None
        if rank_routing:
            if is_token_in_rank is None:
                raise ValueError("dispatch without topk_idx needs is_token_in_rank (from get_dispatch_layout)")
            if topk_weights is not None:
                raise ValueError("topk_weights needs topk_idx")
        launch = self._begin(previous_event, async_finish, allocate_on_comm_stream)
        expert_counts: Optional[List[int]] = None
        with launch.scope():
            if rank_routing:
                # epx routes by top-k indices: one column per rank, the rank's first expert where
                # is_token_in_rank, else -1, sends each token to exactly the ranks DeepEP would.
                num_local = num_experts // self.group_size
                routing = (torch.arange(self.group_size, dtype=torch.int32, device=is_token_in_rank.device)
                           * num_local).repeat(is_token_in_rank.shape[0], 1)
                routing.masked_fill_(~is_token_in_rank.bool(), -1)
                layout = None
                if num_worst_tokens <= 0:  # DeepEP's per-local-expert counts come from num_tokens_per_expert
                    total = self._all_gather_int32(num_tokens_per_expert).sum(dim=0)
                    mine = total[self.rank * num_local:(self.rank + 1) * num_local].tolist()
                    a = max(1, int(expert_alignment))
                    expert_counts = [(c + a - 1) // a * a for c in mine]
            else:
                routing = topk_idx
                layout = None
                if num_tokens_per_rank is not None and is_token_in_rank is not None:  # epx wants int32 / bool
                    per_node = (num_tokens_per_rdma_rank.to(torch.int32)
                                if num_tokens_per_rdma_rank is not None and self.is_internode() else None)
                    layout = epx.Layout(num_tokens_per_rank.to(torch.int32), num_tokens_per_expert.to(torch.int32),
                                        is_token_in_rank.to(torch.bool), per_node)
            res = runtime.dispatch(x, routing, topk_weights, num_experts=num_experts, x_scales=x_scales, layout=layout,
                                   expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                                   stream=launch.stream, **sms)
            rank_prefix_matrix = getattr(res, "rank_prefix_matrix", None)
            if rank_prefix_matrix is None:  # an epx build without DispatchResult.rank_prefix_matrix
                sent = (is_token_in_rank if is_token_in_rank is not None else
                        runtime.get_dispatch_layout(routing, num_experts, stream=launch.stream).is_token_in_rank)
                counts = self._all_gather_int32(sent.sum(dim=0))
                rank_prefix_matrix = counts.cumsum(dim=0).to(device=x.device, dtype=torch.int32)
            # NOTE: on the call's stream, which wrote the matrix (the comm stream with async_finish).
            recv_prefix = rank_prefix_matrix[:, self.rank].contiguous() if self.is_internode() else None
        if rank_routing:
            recv_topk_idx, recv_topk_weights = None, None
            num_recv_list = [] if num_worst_tokens > 0 else expert_counts
        else:
            recv_topk_idx, recv_topk_weights = res.recv_topk_idx, res.recv_topk_weights
            num_recv_list = list(res.num_recv_tokens_per_expert)
        if self.is_internode():
            new_handle = InternodeHandle(is_token_in_rank, recv_prefix, res.recv_src_idx, rank_prefix_matrix,
                                         res.handle)
        else:
            new_handle = NormalHandle(rank_prefix_matrix, res.recv_src_idx, is_token_in_rank, res.handle)
        outs = (res.recv_x, res.recv_x_scales, recv_topk_idx, recv_topk_weights, res.recv_src_idx, rank_prefix_matrix,
                recv_prefix)
        ins = (x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank,
               num_tokens_per_expert, is_token_in_rank)
        event = self._finish(launch, async_finish, ins, outs, keep=ins + outs)
        recv = (res.recv_x, res.recv_x_scales) if x_scales is not None else res.recv_x
        return recv, recv_topk_idx, recv_topk_weights, num_recv_list, new_handle, event

    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None, previous_event: Any = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Normal combine: out[t] = sum of the rows of t over the ranks it went to (+ bias), in fp32, as bf16.

        Returns (combined_x [T, H] bf16, combined_topk_weights or None, EventOverlap)."""
        runtime = self._alive()
        if bias is None:
            bias_0 = bias_1 = None
        elif isinstance(bias, torch.Tensor):
            bias_0, bias_1 = bias, None
        elif isinstance(bias, (tuple, list)) and len(bias) == 2:
            bias_0, bias_1 = bias
        else:
            raise ValueError("bias: expected None, a tensor or a pair of tensors")
        native = native_dispatch_handle(handle)
        sms = self._sms(config)
        launch = self._begin(previous_event, async_finish, allocate_on_comm_stream)
        res = runtime.combine(x, native, topk_weights, bias_0=bias_0, bias_1=bias_1, stream=launch.stream, **sms)
        ins = (x, topk_weights, bias_0, bias_1)
        outs = (res.x, res.topk_weights)
        event = self._finish(launch, async_finish, ins, outs, keep=ins + outs + (native,))  # native: as in dispatch
        return res.x, res.topk_weights, event

    def _require_internode(self, what: str) -> None:
        if not self.is_internode():
            raise RuntimeError(f"epx.deep_ep: {what} needs a buffer spanning more than one node (this one has "
                               f"{self.group_size} ranks on one node); call {what.split('_')[1]}()")

    def internode_dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                           handle: Optional[Tuple] = None, num_tokens_per_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                           is_token_in_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_expert: Optional[torch.Tensor] = None,
                           topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                           expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                           previous_event: Any = None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False):
        """DeepEP's internode dispatch (dispatch() calls it on more than one node): the same as dispatch()."""
        self._require_internode("internode_dispatch")
        return self.dispatch(x, handle, num_tokens_per_rank=num_tokens_per_rank,
                             num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                             num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
                             topk_weights=topk_weights, expert_alignment=expert_alignment,
                             num_worst_tokens=num_worst_tokens, config=config, previous_event=previous_event,
                             async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)

    def internode_combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                          bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                          config: Optional[Config] = None, previous_event: Any = None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False):
        """DeepEP's internode combine (combine() calls it on more than one node): the same as combine()."""
        self._require_internode("internode_combine")
        return self.combine(x, handle, topk_weights, bias=bias, config=config, previous_event=previous_event,
                            async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)

    # ---- low-latency path ----------------------------------------------------------------------------

    def _require_low_latency(self) -> None:
        if not self.low_latency_mode or self._low_latency_bytes <= 0:
            raise RuntimeError("low-latency calls need a Buffer made with low_latency_mode=True and num_rdma_bytes = "
                               "Buffer.get_low_latency_rdma_size_hint(...)")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int = 0, hidden: int = 0,
                                 num_experts: int = 0) -> None:
        """Collective in epx (every rank calls it). Zeroes the low-latency state; the arguments are not needed
        (epx forgets the shapes and takes new ones on the next dispatch). The rank mask survives, as in DeepEP."""
        runtime = self._alive()
        masked = [r for r, m in enumerate(runtime.rank_mask()) if m] if self._low_latency_bytes > 0 else []
        runtime.clean_low_latency_buffer()
        for r in masked:
            runtime.mask_rank(r)

    def _ll_launch(self, async_finish: bool) -> _Launch:
        if not self._cuda:
            return _Launch(None, None, False)
        compute = torch.cuda.current_stream(self._device)
        if not async_finish:
            return _Launch(compute, compute, False)
        self._comm_stream.wait_stream(compute)
        return _Launch(self._comm_stream, compute, True)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Low-latency dispatch into fixed-shape, buffer-owned outputs (valid until the second-next
        low-latency dispatch). Expert e's rows [0, recv_count[e]) are its received tokens, ordered by source
        rank, then source token.

        dispatch_wait_recv_cost_stats: int64 [num_ranks], entry s grows by the receive's wait for rank s, in
        nanoseconds (DeepEP counts clock cycles; compare entries, not units; the flat routing, which this shim uses).

        Returns (recv_x or (recv_x fp8, scales), recv_count int32 [E_local], handle, EventOverlap, hook).
        """
        runtime = self._alive()
        self._require_low_latency()
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0 needs round_scale=True")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set")
        if use_fp8 and use_ue8m0 and not self._column_major_scales and int(x.shape[-1]) % 512 != 0:
            # NOTE: checked before the call: raising after it would leave this rank one collective call behind.
            raise ValueError(f"use_ue8m0 packs four scales per int32: hidden must be a multiple of 512, got "
                             f"{int(x.shape[-1])}")
        launch = self._ll_launch(async_finish)
        res = runtime.low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                           use_fp8=use_fp8, use_ue8m0=use_ue8m0, round_scale=round_scale,
                                           column_major_scales=self._column_major_scales,
                                           return_recv_hook=return_recv_hook,
                                           cumulative_recv_counts=cumulative_local_expert_recv_stats,
                                           wait_recv_cost_ns=dispatch_wait_recv_cost_stats, stream=launch.stream)
        # The receive kernel writes the scales in DeepEP's format and layout: fp32 (powers of two with
        # round_scale), or with use_ue8m0 int32 words of four exponents [E, R * M, H / 512]; column-major (the
        # transpose of [E, S, R * M] memory) unless epx_column_major_scales=False.
        scales = res.recv_x_scales
        if use_fp8 and use_ue8m0 and not self._column_major_scales:
            scales = scales.view(torch.int32)  # uint8 exponents [E, R * M, H / 128] as words
        hook = res.recv_hook if return_recv_hook else None
        handle = LowLatencyHandle(res.recv_src_info, res.recv_layout_range, num_max_dispatch_tokens_per_rank,
                                  int(x.shape[1]), num_experts, res.handle)
        recv = (res.recv_x, scales) if use_fp8 else res.recv_x
        ins = (x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats)
        keep = ins + (res.recv_x, scales, res.recv_count, res.recv_src_info, res.recv_layout_range)
        event = self._finish(launch, async_finish, ins, (), keep=keep)
        return recv, res.recv_count, handle, event, hook

    def get_next_low_latency_combine_buffer(self, handle: Any) -> torch.Tensor:
        """A bf16 [E_local, R * M, H] tensor to write expert outputs into; the next low_latency_combine with
        zero_copy=True reads it instead of x. epx has no combine slot to expose: these are two tensors the shim
        keeps and hands out in turn, one per combine (allocated on first use, reused while the shape holds), so
        zero_copy saves no copy in epx, and the one for the next combine is never the one the previous combine
        (async_finish) may still read."""
        self._alive()
        max_tokens, hidden, num_experts = int(handle[2]), int(handle[3]), int(handle[4])
        shape = (num_experts // self.group_size, self.group_size * max_tokens, hidden)
        slot = self._num_ll_combines % 2
        staging = self._combine_staging[slot]
        if staging is None or tuple(staging.shape) != shape:
            staging = self._combine_staging[slot] = torch.empty(shape, dtype=torch.bfloat16, device=self._device)
        return staging

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Any,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """Low-latency combine: out[t] = sum_k w[t, k] * (expert output of (t, k)), fp32 accumulation, bf16.

        Returns (combined_x [T, H] bf16 (`out` when given), EventOverlap, hook)."""
        runtime = self._alive()
        self._require_low_latency()
        if use_logfmt:
            raise NotImplementedError("epx.deep_ep: use_logfmt (LogFMT-compressed combine) is not implemented; "
                                      "epx combines in bf16")
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook cannot both be set")
        native = native_low_latency_handle(handle)
        if zero_copy:
            x = self._combine_staging[self._num_ll_combines % 2]
            if x is None:
                raise ValueError("zero_copy=True: call get_next_low_latency_combine_buffer(handle) and fill it first")
        launch = self._ll_launch(async_finish)
        res = runtime.low_latency_combine(x, topk_idx, topk_weights, native, return_recv_hook=return_recv_hook,
                                          out=out, wait_recv_cost_ns=combine_wait_recv_cost_stats,
                                          stream=launch.stream)
        self._num_ll_combines += 1  # the next get_next_low_latency_combine_buffer hands out the other tensor
        ins = (x, topk_idx, topk_weights, out, combine_wait_recv_cost_stats)
        event = self._finish(launch, async_finish, ins, (res.x,) if out is None else (),
                             keep=ins + (res.x, handle[0], handle[1]))
        return res.x, event, res.recv_hook

    # ---- rank mask -------------------------------------------------------------------------------------

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """mask=True: skip `rank_to_mask` in low-latency calls (epx mask_rank); False: stop skipping it."""
        runtime = self._alive()
        if mask:
            runtime.mask_rank(rank_to_mask)
            return
        unmask = getattr(runtime, "unmask_rank", None) or getattr(self._native, "unmask_rank", None)
        if unmask is not None:
            unmask(rank_to_mask)
            return
        if not 0 <= rank_to_mask < self.group_size:  # no unmask_rank in this epx build: clear, re-mask the others
            raise ValueError(f"rank_to_mask must be in [0, {self.group_size}), got {rank_to_mask}")
        others = [r for r, m in enumerate(runtime.rank_mask()) if m and r != rank_to_mask]
        runtime.clear_rank_mask()
        for r in others:
            runtime.mask_rank(r)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Writes 1 for each masked rank, 0 otherwise, into mask_status ([R] int, any device)."""
        bits = self._alive().rank_mask()
        mask_status.copy_(torch.tensor([1 if b else 0 for b in bits], dtype=mask_status.dtype, device="cpu"))

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank (epx clear_rank_mask)."""
        self._alive().clear_rank_mask()


def gpus_per_node_from_hosts(hosts: List[Any]) -> int:
    """Ranks per node from each rank's host name (index = rank): 0 when all share one host, else the ranks per host.

    Every host must hold the same number of consecutive ranks (rank = node * gpus_per_node + local_rank, DeepEP's
    numbering with NUM_MAX_NVL_PEERS = 8 ranks per node); anything else raises ValueError naming the hosts."""
    num_ranks = len(hosts)
    distinct = list(dict.fromkeys(hosts))  # in rank order
    if len(distinct) <= 1:
        return 0
    if num_ranks % len(distinct) != 0:
        raise ValueError(f"group: {num_ranks} ranks on {len(distinct)} hosts; every host must hold the same number "
                         "of ranks (pass epx_gpus_per_node to override)")
    per_node = num_ranks // len(distinct)
    for rank, host in enumerate(hosts):
        if host != distinct[rank // per_node]:
            raise ValueError(f"group: rank {rank} is on host {host!r}, but ranks are numbered node-major with "
                             f"{per_node} per host, so it belongs with {distinct[rank // per_node]!r} (pass "
                             "epx_gpus_per_node to override)")
    if per_node > MAX_NVL_PEERS:
        warnings.warn(f"epx.deep_ep: {per_node} ranks per host, more than DeepEP's {MAX_NVL_PEERS} NVLink peers",
                      stacklevel=3)
    return per_node


__all__ = ["Buffer"]
