"""``deep_ep.ElasticBuffer`` and ``deep_ep.EPHandle``: the expert-parallel part of DeepEP's V2 API, over epx.

One ``ElasticBuffer`` keeps a V1 ``deep_ep.Buffer`` (epx.deep_ep.buffer) for its group, streams and SM budget, and
turns epx's normal dispatch/combine into V2's outputs: the handle's prefix sums and source metadata, the expanded
layout (one row per received (token, local expert) pair, grouped by expert, each expert padded to
``expert_alignment``), dispatch without a CPU sync (outputs at the worst-case size), column-major TMA-aligned
scales, the cumulative per-expert receive counter, and combine of expanded rows. What differs from DeepEP, and
what is not here (Engram, pipeline send/recv, AGRS), is listed in docs/deepep-migration.md ("DeepEP V2").

Stream rules as V1's (docs in buffer.py): ``async_with_compute_stream`` is V1's ``async_finish``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple, Union

import torch

import epx

from .buffer import Buffer, _Launch
from .config import Config, HINT_MAX_TOKENS_PER_RANK, MIN_BUFFER_SMS
from .events import EventHandle, torch_event_of

#: DeepEP V2 aligns buffer sizes to 2 MiB (``get_elastic_buffer_alignment()``); the size hint does too.
BUFFER_ALIGNMENT = 2 << 20
#: Rows of TMA-aligned column-major scales are padded to a multiple of this (16 bytes of fp32).
SF_ROW_ALIGNMENT = 4


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _not_in_epx(what: str) -> NotImplementedError:
    return NotImplementedError(f"epx.deep_ep.ElasticBuffer: {what} is not implemented by epx (only DeepEP V2's "
                               "expert-parallel dispatch/combine is; docs/deepep-migration.md, 'DeepEP V2')")


def _unsupported(what: str):
    """A stand-in for a DeepEP V2 method epx does not implement: raises NotImplementedError naming the feature."""

    def method(*args: Any, **kwargs: Any) -> Any:
        raise _not_in_epx(what)

    return method


def _check_count(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class EPHandle:
    """What ``ElasticBuffer.dispatch`` returns for combine and cached dispatch (DeepEP V2's attributes).

    recv_src_metadata: int32 [rows, 2 + K]: [:, 0] src_rank * num_max_tokens_per_rank + the token's index there;
    [:, 1] src_rank * K + the first top-k slot whose expert is on this rank; [:, 2:] in expand mode the row of
    each top-k slot in the expanded outputs (-1: not on this rank), else -1. Rows past the received ones (dispatch
    without CPU sync) are -1 throughout. dst_buffer_slot_idx: int32 [T, R], the row each of this rank's tokens
    lands in at each rank (-1: not sent there). token_metadata_at_forward and channel_linked_list are None (DeepEP's
    hybrid-mode internals; epx keeps its routes in ``epx_handle``).
    """

    def __init__(self, *, do_expand: bool, num_experts: int, expert_alignment: int, num_max_tokens_per_rank: int,
                 num_sms: int, topk_idx: torch.Tensor, num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: List[int], psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
                 psum_num_recv_tokens_per_expert: torch.Tensor,
                 num_unaligned_recv_tokens_per_expert: Optional[torch.Tensor], recv_src_metadata: torch.Tensor,
                 dst_buffer_slot_idx: torch.Tensor, epx_handle: Any, recv_topk_idx: torch.Tensor,
                 worst_rows: int) -> None:
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        #: epx's dispatch handle (combine and cached dispatch use it).
        self.epx_handle = epx_handle
        # [rows, K] local expert or -1: what a cached dispatch returns as recv_topk_idx, and the mask of combine's
        # weights. worst_rows: the rows of a dispatch without CPU sync (0: exact).
        self._recv_topk_idx = recv_topk_idx
        self._worst_rows = worst_rows
        self._slots = recv_src_metadata[:, 2:] if do_expand else None


class ElasticBuffer:
    """DeepEP V2's ``ElasticBuffer`` for expert-parallel dispatch/combine, served by epx.

    group: a torch ProcessGroup or an ``epx.Group`` (e.g. ``epx.host_groups(n, gpus_per_node=g)[r]``). num_bytes: the
    normal path's peer memory (None: sized from num_max_tokens_per_rank and hidden, as DeepEP does; epx falls back to
    its SM path for a call that does not fit). num_cpu_bytes must be 0 (CPU segments serve Engram, not in epx).
    deterministic: accepted; epx's outputs are always in (source rank, token) order, the same on every run.
    allow_hybrid_mode: accepted; across nodes epx always routes hierarchically (DeepEP's hybrid mode), the only routing
    whose peer memory stays inside a host. allow_multiple_reduction=False: an expand-mode combine raises (epx sums a
    token's expanded rows on the expert's rank, one more bf16 rounding, which that setting forbids); the default True
    is DeepEP's. prefer_overlap_with_compute, sl_idx, num_allocated_qps: accepted, no effect (no RDMA queue pairs in
    epx). num_gpu_timeout_secs: epx's timeout for peer waits; num_cpu_timeout_secs: accepted (epx has one timeout).

    epx-only keywords: epx_num_sms (the most SMs a call may use; default 24), epx_gpus_per_node (ranks per node of a
    ProcessGroup; default from the host names), epx_node_partials ("bf16" or "fp32", the combine's node partials).
    """

    def __init__(self, group: Any, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300, num_gpu_timeout_secs: int = 100,
                 explicitly_destroy: bool = False, *, epx_num_sms: Optional[int] = None,
                 epx_gpus_per_node: Optional[int] = None, epx_node_partials: str = "bf16") -> None:
        num_cpu_bytes = _check_count("num_cpu_bytes", num_cpu_bytes)
        num_max_tokens_per_rank = _check_count("num_max_tokens_per_rank", num_max_tokens_per_rank)
        hidden = _check_count("hidden", hidden)
        _check_count("num_topk", num_topk)
        num_allocated_qps = _check_count("num_allocated_qps", num_allocated_qps)
        _check_count("num_cpu_timeout_secs", num_cpu_timeout_secs, 1)
        num_gpu_timeout_secs = _check_count("num_gpu_timeout_secs", num_gpu_timeout_secs, 1)
        if num_cpu_bytes:
            raise _not_in_epx(f"num_cpu_bytes={num_cpu_bytes} (host-memory segments for Engram); pass 0")
        if num_bytes is not None:
            num_bytes = _check_count("num_bytes", num_bytes)
        num_ranks = group.num_ranks if isinstance(group, epx._epx.Group) else group.size()
        max_sms = int(epx_num_sms) if epx_num_sms else MIN_BUFFER_SMS
        if num_bytes is None and hidden:
            num_bytes = _align(int(epx.normal_buffer_size_hint(hidden, num_ranks, max_sms,
                                                               num_max_tokens_per_rank or HINT_MAX_TOKENS_PER_RANK)),
                               BUFFER_ALIGNMENT)
        self._v1: Optional[Buffer] = Buffer(group, num_nvl_bytes=num_bytes or 0, explicitly_destroy=True,
                                            epx_num_sms=max_sms, epx_timeout_ms=num_gpu_timeout_secs * 1000,
                                            epx_gpus_per_node=epx_gpus_per_node, epx_node_partials=epx_node_partials)
        self.group = group
        self.rank_idx, self.num_ranks = self._v1.rank, self._v1.group_size
        self.num_bytes = num_bytes or 0
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.use_fp8_dispatch = use_fp8_dispatch
        self.deterministic = deterministic
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.num_allocated_qps = num_allocated_qps or (65 if allow_hybrid_mode else 17)
        self.explicitly_destroy = explicitly_destroy
        #: DeepEP's scale-out ranks (nodes) and scale-up ranks (ranks per node); epx's topology.
        self.num_scaleout_ranks, self.num_scaleup_ranks = self._v1.num_rdma_ranks, self._v1.num_nvl_ranks
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = self.num_scaleout_ranks, self.num_scaleup_ranks
        self.runtime: Optional[Buffer] = self._v1
        # Combine sums in DeepEP V2's order wherever epx routes flat (epx.Buffer's order_topk_idx; the hierarchical
        # routing refuses it): one node, and on the cuda backend up to its flat rank cap.
        self._deepep_order = self._v1.runtime.resolved_normal_routing == epx.NormalRouting.flat

    # ---- life cycle, sizes, topology -----------------------------------------------------------------

    def _alive(self) -> Buffer:
        if self._v1 is None:
            raise RuntimeError("this deep_ep.ElasticBuffer was destroyed")
        return self._v1

    def destroy(self) -> None:
        """Releases the buffer after this rank's device work finished. Needs explicitly_destroy=True."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs an ElasticBuffer made with explicitly_destroy=True")
        if self._v1 is not None:
            self._v1.destroy()
        self._v1 = self.runtime = None

    @staticmethod
    def get_buffer_size_hint(group: Any, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0,
                             use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes of epx normal-path memory for these limits (2 MiB aligned), what ElasticBuffer(num_bytes=) takes."""
        _check_count("num_max_tokens_per_rank", num_max_tokens_per_rank, 1)
        _check_count("hidden", hidden, 1)
        _check_count("num_topk", num_topk)
        num_ranks = group.num_ranks if isinstance(group, epx._epx.Group) else group.size()
        return _align(int(epx.normal_buffer_size_hint(hidden, num_ranks, MIN_BUFFER_SMS, num_max_tokens_per_rank)),
                      BUFFER_ALIGNMENT)

    get_engram_storage_size_hint = staticmethod(_unsupported("Engram"))
    get_pp_buffer_size_hint = staticmethod(_unsupported("pipeline-parallel send/recv"))
    get_agrs_num_max_session_bytes = staticmethod(_unsupported("all-gather reduce-scatter (AGRS)"))
    get_agrs_buffer_size_hint = staticmethod(_unsupported("all-gather reduce-scatter (AGRS)"))

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """(nodes, ranks per node) of the group's topology."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """(scale-out ranks, scale-up ranks): the same as the physical sizes in epx."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """epx's SM budget for a call (epx_num_sms): epx sizes its copy-engine path and rings by it, not by a model
        of the bandwidths, so the bandwidth arguments are checked and unused."""
        _check_count("num_experts", num_experts, 1)
        _check_count("num_topk", num_topk, 1)
        return self._alive()._max_sms

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """DeepEP's queue-pair count (no meaning in epx): min(num_sms, num_allocated_qps)."""
        return max(1, min(_check_count("num_sms", num_sms, 1), self.num_allocated_qps))

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """A host barrier of the group after this rank's device work finished (stronger than DeepEP's stream-ordered
        one, and not capturable in a CUDA graph)."""
        v1 = self._alive()
        if v1._cuda:
            torch.cuda.synchronize(v1._device)
        v1.epx_group.barrier()

    @staticmethod
    def capture() -> EventHandle:
        """An EventHandle recorded on the current stream now (for previous_event)."""
        return EventHandle()

    def get_comm_stream(self) -> torch.cuda.Stream:
        return self._alive().get_comm_stream()

    engram_write = engram_fetch = _unsupported("Engram")
    pp_set_config = pp_send = pp_recv = _unsupported("pipeline-parallel send/recv")
    create_agrs_session = destroy_agrs_session = agrs_new_session = _unsupported("all-gather reduce-scatter (AGRS)")
    agrs_set_config = agrs_get_inplace_tensor = _unsupported("all-gather reduce-scatter (AGRS)")
    all_gather = _unsupported("all_gather (AGRS)")

    # ---- streams -------------------------------------------------------------------------------------

    def _begin(self, v1: Buffer, previous_event: Any, previous_event_before_epilogue: Any,
               async_with_compute_stream: bool, allocate_on_comm_stream: bool) -> _Launch:
        if previous_event is not None and not allocate_on_comm_stream:
            raise ValueError("previous_event needs allocate_on_comm_stream=True (DeepEP's rule)")
        launch = v1._begin(previous_event, async_with_compute_stream, allocate_on_comm_stream)
        # NOTE: epx has no separate epilogue kernel, so the epilogue's event is waited for before the whole call.
        event = torch_event_of(previous_event_before_epilogue)
        if event is not None and launch.stream is not None:
            launch.stream.wait_event(event)
        return launch

    def _sms(self, v1: Buffer, num_sms: int) -> dict:
        num_sms = _check_count("num_sms", num_sms)
        return v1._sms(Config(num_sms)) if num_sms else {}

    # ---- dispatch ------------------------------------------------------------------------------------

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: Any = None, previous_event_before_epilogue: Any = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """DeepEP V2's dispatch. Returns (recv_x or (recv_x, recv_sf), recv_topk_idx, recv_topk_weights, handle,
        EventOverlap).

        Rows in (source rank, token) order. recv_topk_idx: local expert or -1 (None in expand mode);
        recv_topk_weights: [rows, K] with 0 where the expert is not on this rank (DeepEP V2 keeps the source's weight
        there), or [expanded rows] in expand mode. Without CPU sync (do_cpu_sync=False; always with a handle) the
        outputs have the worst-case rows (R * num_max_tokens_per_rank; expanded: DeepEP's bound) and rows past the
        received ones hold -1 indices. A cached dispatch with topk_weights runs epx's fresh dispatch on the handle's
        topk_idx (epx's cached dispatch carries no weights), with the handle's row count and no host sync.
        """
        v1 = self._alive()
        runtime = v1._alive()
        x, sf = x if isinstance(x, tuple) else (x, None)
        if do_zero_padding and not do_expand:
            raise ValueError("do_zero_padding needs do_expand=True")
        _check_count("num_qps", num_qps)
        if handle is not None:
            if not isinstance(handle, EPHandle):
                raise TypeError(f"handle must be an EPHandle from ElasticBuffer.dispatch, got {type(handle).__name__}")
            if topk_idx is not None:
                raise ValueError("cached dispatch (handle given) takes no topk_idx: the handle's is reused")
            if do_cpu_sync:
                raise ValueError("do_cpu_sync=True: a cached dispatch (handle given) cannot synchronize with the CPU")
            if do_expand and not handle.do_expand:
                raise ValueError("do_expand=True needs a handle from an expand-mode dispatch (this one's slots are not "
                                 "computed); the other way round, an expand handle also gives the plain rows")
            for name, given, held in (("num_experts", num_experts, handle.num_experts),
                                      ("expert_alignment", expert_alignment, handle.expert_alignment),
                                      ("num_max_tokens_per_rank", num_max_tokens_per_rank,
                                       handle.num_max_tokens_per_rank)):
                if given is not None and given != held:
                    raise ValueError(f"{name}={given} differs from the handle's {held}")
            if x.shape[0] != handle.topk_idx.shape[0]:
                raise ValueError(f"x has {x.shape[0]} tokens, the handle's dispatch had {handle.topk_idx.shape[0]}")
            topk_idx, num_experts = handle.topk_idx, handle.num_experts
            expert_alignment, max_tokens = handle.expert_alignment, handle.num_max_tokens_per_rank
            do_cpu_sync = False
        else:
            if topk_idx is None:
                raise ValueError("topk_idx is required without a handle")
            if num_experts is None:
                raise ValueError("num_experts is required without a handle")
            num_experts = _check_count("num_experts", num_experts, 1)
            if num_experts % self.num_ranks:
                raise ValueError(f"num_experts={num_experts} must be a multiple of the ranks ({self.num_ranks})")
            expert_alignment = _check_count("expert_alignment", 1 if expert_alignment is None else expert_alignment, 1)
            max_tokens = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
            max_tokens = _check_count("num_max_tokens_per_rank", max_tokens)
            if max_tokens < max(1, x.shape[0]):
                raise ValueError(f"num_max_tokens_per_rank={max_tokens} must be >= this rank's tokens ({x.shape[0]}) "
                                 "and >= 1, the same on every rank (ElasticBuffer(...) or dispatch())")
            do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        num_local = num_experts // self.num_ranks
        stats = cumulative_local_expert_recv_stats
        if stats is not None and (tuple(stats.shape) != (num_local,) or stats.dtype != torch.int32):
            raise ValueError(f"cumulative_local_expert_recv_stats must be int32 [{num_local}], got "
                             f"{stats.dtype} {list(stats.shape)}")
        sms = self._sms(v1, num_sms)
        launch = self._begin(v1, previous_event, previous_event_before_epilogue, async_with_compute_stream,
                             allocate_on_comm_stream)
        with launch.scope():
            if handle is not None and topk_weights is None:
                res = runtime.dispatch(x, x_scales=sf, handle=handle.epx_handle, num_worst_tokens=handle._worst_rows,
                                       stream=launch.stream, **sms)
                recv_topk_idx, recv_topk_weights = handle._recv_topk_idx, None
            else:
                rows = handle.recv_src_metadata.shape[0] if handle is not None else (
                    0 if do_cpu_sync else max_tokens * self.num_ranks)
                res = runtime.dispatch(x, topk_idx, topk_weights, num_experts=num_experts, x_scales=sf,
                                       expert_alignment=expert_alignment, num_worst_tokens=rows,
                                       stream=launch.stream, **sms)
                recv_topk_idx, recv_topk_weights = res.recv_topk_idx, res.recv_topk_weights
            if handle is None:
                handle = self._new_handle(res, topk_idx, recv_topk_idx, do_handle_copy, do_cpu_sync, do_expand,
                                          num_experts, expert_alignment, max_tokens,
                                          sms.get("num_sms", v1._max_sms))
            if cumulative_local_expert_recv_stats is not None:
                counts = handle.num_unaligned_recv_tokens_per_expert
                if counts is None:
                    counts = self._expert_counts(recv_topk_idx, num_local)[0]
                cumulative_local_expert_recv_stats.add_(counts)
            recv_x, recv_sf = res.recv_x, res.recv_x_scales
            if do_expand:
                recv_x, recv_sf, recv_topk_weights = self._expand(handle, recv_x, recv_sf, recv_topk_weights,
                                                                  do_zero_padding)
                recv_topk_idx = None
            if recv_sf is not None and use_tma_aligned_col_major_sf:
                column_major = torch.empty_strided(tuple(recv_sf.shape),
                                                   (1, _align(recv_sf.shape[0], SF_ROW_ALIGNMENT)),
                                                   dtype=recv_sf.dtype, device=recv_sf.device)
                recv_sf = column_major.copy_(recv_sf)
        # Every tensor the handle holds too (made on this call's stream, read later on others).
        outs = (recv_x, recv_sf, recv_topk_idx, recv_topk_weights, handle.recv_src_metadata,
                handle.psum_num_recv_tokens_per_expert, handle.psum_num_recv_tokens_per_scaleup_rank,
                handle.num_unaligned_recv_tokens_per_expert, handle.dst_buffer_slot_idx, handle.topk_idx,
                handle._recv_topk_idx)
        ins = (x, sf, topk_idx, topk_weights, cumulative_local_expert_recv_stats)
        event = v1._finish(launch, async_with_compute_stream, ins, outs, keep=ins + outs + (handle.epx_handle,))
        recv = (recv_x, recv_sf) if recv_sf is not None else recv_x
        return recv, recv_topk_idx, recv_topk_weights, handle, event

    @staticmethod
    def _expert_counts(recv_topk_idx: torch.Tensor, num_local: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(int32 [num_local] received pairs per local expert, int64 [rows, K] expert or num_local where none), with
        no host sync."""
        experts = torch.where(recv_topk_idx >= 0, recv_topk_idx, num_local).long()
        counts = torch.zeros(num_local + 1, dtype=torch.int32, device=recv_topk_idx.device)
        counts.scatter_add_(0, experts.reshape(-1), torch.ones_like(experts, dtype=torch.int32).reshape(-1))
        return counts[:num_local], experts

    def _new_handle(self, res: Any, topk_idx: torch.Tensor, recv_topk_idx: torch.Tensor, do_handle_copy: bool,
                    do_cpu_sync: bool, do_expand: bool, num_experts: int, alignment: int, max_tokens: int,
                    num_sms: int) -> EPHandle:
        """The handle of a fresh dispatch, from epx's result: torch ops on the call's stream, no host sync."""
        device = recv_topk_idx.device
        R, G, me = self.num_ranks, self.num_scaleup_ranks, self.rank_idx
        num_local = num_experts // R
        rows, K = recv_topk_idx.shape
        # Per source rank: its rows here (inclusive prefix over sources = column `me` of the prefix matrix).
        prefix = res.rank_prefix_matrix[:, me].contiguous()
        per_source = torch.diff(prefix, prepend=prefix.new_zeros(1))
        psum_scaleup = per_source.view(R // G, G).sum(dim=0).cumsum(dim=0).to(torch.int32)

        row_ids = torch.arange(rows, dtype=torch.int32, device=device)
        src_rank = torch.searchsorted(prefix, row_ids, right=True)
        received = row_ids < prefix[-1]
        local = recv_topk_idx >= 0
        metadata = torch.full((rows, 2 + K), -1, dtype=torch.int32, device=device)
        metadata[:, 0] = torch.where(received, src_rank * max_tokens + res.recv_src_idx, -1).to(torch.int32)
        metadata[:, 1] = torch.where(received, src_rank * K + local.to(torch.int32).argmax(dim=1), -1).to(torch.int32)

        counts, experts = self._expert_counts(recv_topk_idx, num_local)
        aligned = (counts + alignment - 1) // alignment * alignment
        starts = torch.cumsum(aligned, dim=0) - aligned
        expanded_rows = 0
        if do_expand:
            psum_expert = (starts + counts).to(torch.int32)
            # Each (row, k) pair's row in the expanded outputs: expert-major, then the pairs' (row, k) order.
            flat = experts.reshape(-1)
            n = flat.numel()
            order = torch.argsort(flat * n + torch.arange(n, device=device))
            rank_in_sort = torch.empty_like(order)
            rank_in_sort[order] = torch.arange(n, device=device)
            unaligned_starts = torch.cumsum(counts, dim=0) - counts
            pad = torch.zeros(1, dtype=starts.dtype, device=device)
            slot = (torch.cat([starts, pad])[flat] + rank_in_sort - torch.cat([unaligned_starts, pad])[flat].long())
            metadata[:, 2:] = torch.where(local, slot.view(rows, K), -1).to(torch.int32)
            if do_cpu_sync:
                expanded_rows = sum(res.num_recv_tokens_per_expert)
            else:
                expanded_rows = _align(R * max_tokens * min(K, num_local) + (alignment - 1) * num_local, alignment)
        else:
            psum_expert = torch.cumsum(aligned, dim=0).to(torch.int32)

        # Where each of this rank's tokens lands at each rank: rows from ranks before this one, then its own order.
        owner = torch.where(topk_idx >= 0, topk_idx // num_local, R).long()
        in_rank = torch.zeros(topk_idx.shape[0], R + 1, dtype=torch.int32, device=device)
        in_rank.scatter_(1, owner, 1)
        in_rank = in_rank[:, :R]
        before = res.rank_prefix_matrix[me - 1] if me > 0 else torch.zeros(R, dtype=torch.int32, device=device)
        dst_slot = torch.where(in_rank > 0, torch.cumsum(in_rank, dim=0) - 1 + before, -1).to(torch.int32)

        return EPHandle(do_expand=do_expand, num_experts=num_experts, expert_alignment=alignment,
                        num_max_tokens_per_rank=max_tokens, num_sms=num_sms,
                        topk_idx=topk_idx.clone() if do_handle_copy else topk_idx,
                        num_recv_tokens=rows, num_expanded_tokens=expanded_rows,
                        num_recv_tokens_per_expert_list=list(res.num_recv_tokens_per_expert) if do_cpu_sync else [],
                        psum_num_recv_tokens_per_scaleup_rank=psum_scaleup,
                        psum_num_recv_tokens_per_expert=psum_expert,
                        num_unaligned_recv_tokens_per_expert=counts if do_expand else None,
                        recv_src_metadata=metadata, dst_buffer_slot_idx=dst_slot, epx_handle=res.handle,
                        recv_topk_idx=recv_topk_idx, worst_rows=0 if do_cpu_sync else rows)

    @staticmethod
    def _expand(handle: EPHandle, recv_x: torch.Tensor, recv_sf: Optional[torch.Tensor],
                recv_weights: Optional[torch.Tensor], zero_padding: bool):
        """Received rows -> one row per (row, local expert) pair at the handle's slots. One spare row at the end takes
        the pairs that are not on this rank (index_copy_ needs no host sync that way) and is cut off."""
        slots = handle._slots
        n = handle.num_expanded_tokens
        dest = torch.where(slots >= 0, slots, n).long()

        def scatter(rows: torch.Tensor, per_k: bool) -> torch.Tensor:
            # NOTE: fp8 rows move as bytes (index_copy_ has no fp8 kernels); zero bytes are fp8 zeros.
            dtype = rows.dtype
            if rows.element_size() == 1:
                rows = rows.view(torch.uint8)
            make = torch.zeros if zero_padding else torch.empty
            out = make((n + 1,) + tuple(rows.shape[1 + per_k:]), dtype=rows.dtype, device=rows.device)
            for k in range(slots.shape[1]):
                out.index_copy_(0, dest[:, k], rows[:, k] if per_k else rows)
            return out[:n].view(dtype)

        expanded_sf = scatter(recv_sf, False).contiguous() if recv_sf is not None else None
        expanded_weights = scatter(recv_weights, True) if recv_weights is not None else None
        return scatter(recv_x, False), expanded_sf, expanded_weights

    # ---- combine -------------------------------------------------------------------------------------

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None, num_sms: int = 0,
                num_qps: int = 0, previous_event: Any = None, previous_event_before_epilogue: Any = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """DeepEP V2's combine: out[t] = the sum over ranks of the rows of t (+ bias), in fp32, rounded once to bf16.
        Returns (combined_x [T, H] bf16, combined_topk_weights [T, K] or None, EventOverlap).

        x: one row per dispatched row, or in expand mode one row per expanded row; each rank first sums a token's
        expanded rows in top-k order in fp32 and rounds to bf16 (DeepEP's reduction within a rank), then epx combines.
        topk_weights: [rows, K] (entries of experts on other ranks are ignored) or, in expand mode, [expanded rows];
        combined_topk_weights[t, k] is the weight from the rank of expert topk_idx[t, k] (0 for -1). Summation order:
        DeepEP's (0 + the biases, then each rank's row by the last top-k slot whose expert is on it, one rounding;
        epx.Buffer.combine's order_topk_idx) where epx routes flat; across nodes epx's hierarchical order (node
        partials), equal to DeepEP's hybrid result up to fp32 reassociation.
        """
        v1 = self._alive()
        runtime = v1._alive()
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must be an EPHandle from ElasticBuffer.dispatch, got {type(handle).__name__}")
        if bias is None or isinstance(bias, torch.Tensor):
            bias_0, bias_1 = bias, None
        elif isinstance(bias, (tuple, list)) and len(bias) == 2:
            bias_0, bias_1 = bias
        else:
            raise ValueError("bias: expected None, a tensor or a pair of tensors")
        _check_count("num_qps", num_qps)
        sms = self._sms(v1, num_sms or handle.num_sms)
        rows, K = handle._recv_topk_idx.shape
        if handle.do_expand:
            if not self.allow_multiple_reduction:
                raise NotImplementedError("epx.deep_ep.ElasticBuffer: an expand-mode combine sums a token's rows on "
                                          "the expert's rank first (one more bf16 rounding), which "
                                          "allow_multiple_reduction=False forbids; use the non-expand layout")
            if x.dim() != 2 or x.shape[0] != handle.num_expanded_tokens:
                raise ValueError(f"x must have the {handle.num_expanded_tokens} expanded rows of the handle's "
                                 f"dispatch, got shape {list(x.shape)}")
            if topk_weights is not None and tuple(topk_weights.shape) != (handle.num_expanded_tokens,):
                raise ValueError(f"topk_weights in expand mode must be [{handle.num_expanded_tokens}], got "
                                 f"{list(topk_weights.shape)}")
        launch = self._begin(v1, previous_event, previous_event_before_epilogue, async_with_compute_stream,
                             allocate_on_comm_stream)
        with launch.scope():
            local = handle._recv_topk_idx >= 0
            if handle.do_expand:
                slots = handle._slots.long().clamp(min=0)
                acc = torch.zeros((rows, x.shape[1]), dtype=torch.float32, device=x.device)
                for k in range(K):
                    acc += torch.where(local[:, k:k + 1], x.index_select(0, slots[:, k]).float(), 0.0)
                rows_x = acc.to(torch.bfloat16)
                weights = None
                if topk_weights is not None:
                    weights = torch.where(local, topk_weights.float()[slots], 0.0)
            else:
                rows_x = x
                weights = torch.where(local, topk_weights, 0.0) if topk_weights is not None else None
            order = {"order_topk_idx": handle.topk_idx} if self._deepep_order else {}
            res = runtime.combine(rows_x, handle.epx_handle, weights, bias_0=bias_0, bias_1=bias_1,
                                  stream=launch.stream, **order, **sms)
        ins = (x, topk_weights, bias_0, bias_1, rows_x, weights)
        outs = (res.x, res.topk_weights)
        event = v1._finish(launch, async_with_compute_stream, ins, outs, keep=ins + outs + (handle.epx_handle,))
        return res.x, res.topk_weights, event
