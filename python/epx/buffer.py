"""epx.Buffer: expert-parallel dispatch and combine for numpy and torch (the contract: include/epx/buffer.h).

Every call is collective: each rank of the group makes the same sequence of calls (an idle rank passes
zero tokens). A call that rejects one of its arguments (a wrong type: TypeError; a wrong dtype, shape or
range: epx.InvalidArgumentError; both name it) still takes part in the collective, like any invalid input
(docs/reliability.md), so the ranks stay in step: nothing here raises before the native call, which
converts every argument itself. Inputs are torch tensors, numpy arrays or anything with ``__dlpack__``;
outputs are torch tensors when an input is a torch tensor, numpy arrays otherwise. ``stream`` defaults to
torch's current stream for CUDA tensors. The GIL is released while a call waits, so rank threads run in
parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Union

from . import _epx
from ._args import enum_arg
from ._tensors import Allocations, Outputs, any_torch, cuda_stream_of, is_torch, to_arg, to_bf16_arg


@dataclass
class Layout:
    """Routing layout of one batch (see get_dispatch_layout)."""

    num_tokens_per_rank: Any  # int32 [num_ranks]
    num_tokens_per_expert: Any  # int32 [num_experts]
    is_token_in_rank: Any  # bool [T, num_ranks]
    # int32 [num_nodes]: tokens with an expert on a rank of each node of group.topology (DeepEP's
    # num_tokens_per_rdma_rank). The host backend always fills it; the cuda backend when the buffer routes
    # hierarchically, else None. Optional in dispatch's layout.
    num_tokens_per_node: Any = None


@dataclass
class DispatchResult:
    """Rows ordered by source rank, then source token index (include/epx/buffer.h: DispatchResult)."""

    recv_x: Any  # [N, H], the dtype of x
    recv_x_scales: Any  # [N, H / 128] with fp8 x, else None
    recv_topk_idx: Any  # [N, K] local expert id or -1; None in cached mode
    recv_topk_weights: Any  # [N, K] float32; None when not given / cached mode
    recv_src_idx: Any  # int32 [N]
    num_recv_tokens_per_expert: List[int]  # per local expert, rounded to expert_alignment; [] in worst-token mode
    recv_expert_counts: Any  # int32 [num_local_experts] on the device
    rank_prefix_matrix: Any  # int32 [R, R] on the device: [i][j] = tokens that ranks 0..i send to rank j
    handle: _epx.DispatchHandle


@dataclass
class CombineResult:
    x: Any  # [T, H] bf16
    topk_weights: Any  # [T, K] float32 when given, else None


@dataclass
class LowLatencyDispatchResult:
    """Outputs live in the buffer (valid until the second-next low-latency call of the same kind)."""

    recv_x: Any  # [E_local, R * M, H] bf16, or fp8 with use_fp8
    recv_x_scales: Any  # [E_local, R * M, H / 128] float32 or uint8 (UE8M0); only with use_fp8
    recv_count: Any  # int32 [E_local]
    recv_src_info: Any  # int32 [E_local, R * M]
    recv_layout_range: Any  # int64 [E_local, R]: (begin << 32) | count
    handle: _epx.LowLatencyHandle
    recv_hook: Optional[Callable[[], None]]  # set iff return_recv_hook


@dataclass
class LowLatencyCombineResult:
    x: Any  # [T, H] bf16
    recv_hook: Optional[Callable[[], None]]


class Buffer:
    """One rank's expert-parallel communication buffer.

    group: an epx.Group (epx.host_groups, epx.cuda_groups, epx.Group.from_process_group ...).
    num_normal_bytes / num_low_latency_bytes: peer memory for the two paths (0 normal: a default size;
    0 low-latency: none, and low_latency_* raise). num_sms: SMs the normal kernels may use (cuda).
    normal / low_latency: epx.NormalConfig / epx.LowLatencyConfig, the kernels' tuning (cuda; None: the
    defaults). normal_routing: "auto" (hierarchical when group.topology has more than one node, or on the cuda backend
    above 8 ranks, the flat routing's cap), "flat" or
    "hierarchical" (or an epx.NormalRouting); see docs/internode.md. low_latency_routing: the same choice for
    low_latency_dispatch/combine (or an epx.LowLatencyRouting): "hierarchical" sends a token over the network once
    per destination node and reduces the combine inside each node first (both backends; on the cuda backend with
    ranks as threads of one process such calls cannot be captured in a CUDA graph). node_partials: "fp32" (default) or
    "bf16" (or an epx.NodePartials), how both hierarchical combines carry a node's partial sum over the network leg:
    bf16 rounds each node's partial first and halves those bytes (include/epx/buffer.h). On the cuda backend the byte
    counts, num_sms, both routings and the configs must be the same on every rank: creation checks that collectively
    and raises on every rank, naming the field, when they differ.
    """

    def __init__(self, group: _epx.Group, num_normal_bytes: int = 0, num_low_latency_bytes: int = 0,
                 num_sms: int = 24, normal: Optional[_epx.NormalConfig] = None,
                 low_latency: Optional[_epx.LowLatencyConfig] = None,
                 normal_routing: Union[str, _epx.NormalRouting] = "auto",
                 low_latency_routing: Union[str, _epx.LowLatencyRouting] = "auto",
                 node_partials: Union[str, _epx.NodePartials] = "fp32"):
        routing = enum_arg(_epx.NormalRouting, normal_routing, "normal_routing")
        ll_routing = enum_arg(_epx.LowLatencyRouting, low_latency_routing, "low_latency_routing")
        partials = enum_arg(_epx.NodePartials, node_partials, "node_partials")
        self._allocations = Allocations()
        self._native = _epx.Buffer.create(group, num_normal_bytes=num_normal_bytes,
                                          num_low_latency_bytes=num_low_latency_bytes, num_sms=num_sms,
                                          allocator=self._allocations,
                                          normal=normal if normal is not None else _epx.NormalConfig(),
                                          low_latency=low_latency if low_latency is not None
                                          else _epx.LowLatencyConfig(), normal_routing=routing,
                                          low_latency_routing=ll_routing, node_partials=partials)
        self.group = group
        self.normal_routing = routing
        self.low_latency_routing = ll_routing
        self.node_partials = partials

    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def num_ranks(self) -> int:
        return self._native.num_ranks

    @property
    def resolved_normal_routing(self) -> _epx.NormalRouting:
        """normal_routing with "auto" resolved: flat or hierarchical, the routing normal calls take."""
        return self._native.normal_routing

    @property
    def resolved_low_latency_routing(self) -> _epx.LowLatencyRouting:
        """low_latency_routing with "auto" resolved: flat or hierarchical, the routing low-latency calls take."""
        return self._native.low_latency_routing

    def _call(self, method: Callable, inputs: tuple, **kwargs):
        """Runs a native call with torch allocations when an input is a torch tensor."""
        use_torch = any_torch(*inputs)
        if not use_torch:
            return method(**kwargs), Outputs(False)
        cuda = any(is_torch(t) and t.is_cuda for t in inputs)
        with self._allocations.torch(cuda, kwargs.get("stream")) as scope:
            out = method(**kwargs)
            return out, Outputs(True, scope.made)

    @property
    def topology(self) -> _epx.Topology:
        """The group's placement of ranks on nodes (group.topology)."""
        return self.group.topology

    def get_dispatch_layout(self, topk_idx: Any, num_experts: int, stream: Any = None) -> Layout:
        """Per-rank, per-node and per-expert token counts and is_token_in_rank of topk_idx [T, K] (not collective)."""
        out, conv = self._call(self._native.get_dispatch_layout, (topk_idx,), topk_idx=to_arg(topk_idx),
                               num_experts=num_experts, stream=cuda_stream_of(stream, topk_idx))
        return Layout(*(conv(o) for o in out))

    def dispatch(self, x: Any, topk_idx: Any = None, topk_weights: Any = None, *, num_experts: int = 0,
                 x_scales: Any = None, layout: Optional[Layout] = None,
                 handle: Optional[_epx.DispatchHandle] = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, num_sms: int = 0, stream: Any = None) -> DispatchResult:
        """Normal dispatch: sends each token of x [T, H] to the ranks of its experts.

        x: bf16, or fp8 e4m3 with x_scales [T, H / 128] (float32 or uint8 UE8M0). Cached mode: pass the
        handle of an earlier dispatch instead of topk_idx/topk_weights/layout. num_worst_tokens > 0 fixes
        the output rows (no host sync on the cuda backend). num_sms: SMs for this call (0: the buffer's;
        at most the buffer's). x_scales may have any strides; int32 [T, H / 512] is packed UE8M0.
        """
        native_layout = layout  # not a Layout: the native call rejects it, naming layout
        if isinstance(layout, Layout):
            native_layout = tuple(to_arg(t) for t in (layout.num_tokens_per_rank, layout.num_tokens_per_expert,
                                                      layout.is_token_in_rank, layout.num_tokens_per_node))
        out, conv = self._call(self._native.dispatch, (x, topk_idx), x=to_arg(x), x_scales=to_arg(x_scales),
                               topk_idx=to_arg(topk_idx), topk_weights=to_arg(topk_weights),
                               num_experts=num_experts, layout=native_layout, handle=handle,
                               expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                               num_sms=num_sms, stream=cuda_stream_of(stream, x))
        return DispatchResult(
            recv_x=conv(out["recv_x"]), recv_x_scales=conv(out["recv_x_scales"]),
            recv_topk_idx=conv(out["recv_topk_idx"]), recv_topk_weights=conv(out["recv_topk_weights"]),
            recv_src_idx=conv(out["recv_src_idx"]), num_recv_tokens_per_expert=list(out["num_recv_tokens_per_expert"]),
            recv_expert_counts=conv(out["recv_expert_counts"]),
            rank_prefix_matrix=conv(out["rank_prefix_matrix"]), handle=out["handle"])

    def combine(self, x: Any, handle: _epx.DispatchHandle, topk_weights: Any = None, *, bias_0: Any = None,
                bias_1: Any = None, num_sms: int = 0, stream: Any = None, order_topk_idx: Any = None) -> CombineResult:
        """Normal combine: out[t] = bf16(sum of the rows of t over the ranks it went to + biases), fp32 sums.

        order_topk_idx: the dispatch's topk_idx, to add in DeepEP V2's order (the biases first, then each rank's row
        by the last top-k slot whose expert is on it; flat routing only; include/epx/buffer.h CombineArgs)."""
        out, conv = self._call(self._native.combine, (x,), x=to_bf16_arg(x), topk_weights=to_arg(topk_weights),
                               bias_0=to_bf16_arg(bias_0), bias_1=to_bf16_arg(bias_1), handle=handle, num_sms=num_sms,
                               stream=cuda_stream_of(stream, x), order_topk_idx=to_arg(order_topk_idx))
        return CombineResult(x=conv(out["x"]), topk_weights=conv(out["topk_weights"]))

    def low_latency_dispatch(self, x: Any, topk_idx: Any, max_tokens_per_rank: int, num_experts: int, *,
                             use_fp8: bool = False, use_ue8m0: bool = False, round_scale: bool = False,
                             column_major_scales: bool = False, return_recv_hook: bool = False,
                             cumulative_recv_counts: Any = None, wait_recv_cost_ns: Any = None,
                             stream: Any = None) -> LowLatencyDispatchResult:
        """Low-latency dispatch: fixed shapes, no host sync on the cuda backend (CUDA-graph capturable).

        wait_recv_cost_ns: optional int64 [num_ranks]; entry s grows by the nanoseconds the receive waited for
        source rank s (DeepEP's dispatch_wait_recv_cost_stats; include/epx/buffer.h). cumulative_recv_counts:
        optional int32 [E_local], incremented by the pairs received per local expert.

        fp8 scales (use_fp8): fp32 [E_local, R * M, H / 128] (amax / 448), powers of two with round_scale, or
        uint8 UE8M0 exponents with use_ue8m0. column_major_scales: DeepGEMM's layout, written by the receive
        kernel: the same shape as a view of [E_local, S, R * M] memory (strides (S * R * M, 1, R * M)); with
        use_ue8m0, S = H / 512 int32 words of four exponents (H % 512 == 0).
        """
        try:
            fmt = _epx.ScaleFormat.ue8m0 if use_ue8m0 else _epx.ScaleFormat.float32
        except Exception:  # no truth value (e.g. an array): the native call rejects it below and still takes part
            fmt = use_ue8m0
        try:
            layout = _epx.ScaleLayout.column_major if column_major_scales else _epx.ScaleLayout.row_major
        except Exception:  # as use_ue8m0
            layout = column_major_scales
        try:
            out = self._native.low_latency_dispatch(
                x=to_arg(x), topk_idx=to_arg(topk_idx), max_tokens_per_rank=max_tokens_per_rank,
                num_experts=num_experts, use_fp8=use_fp8, scale_format=fmt, round_scale=round_scale,
                scale_layout=layout, return_recv_hook=return_recv_hook,
                cumulative_recv_counts=to_arg(cumulative_recv_counts), wait_recv_cost_ns=to_arg(wait_recv_cost_ns),
                stream=cuda_stream_of(stream, x))
        except TypeError as e:
            for name, value, native, passed in (("use_ue8m0", use_ue8m0, "scale_format:", fmt),
                                                ("column_major_scales", column_major_scales, "scale_layout:", layout)):
                if passed is value and str(e).startswith(native):  # name the argument the caller passed
                    t = type(value)
                    raise TypeError(f"{name}: expected a bool, got {t.__module__}.{t.__qualname__}") from None
            raise
        conv = Outputs(any_torch(x, topk_idx))  # buffer-owned memory: nothing is allocated
        scales = conv(out["recv_x_scales"])
        if layout is _epx.ScaleLayout.column_major and scales is not None:
            scales = scales.transpose(1, 2) if is_torch(scales) else scales.swapaxes(1, 2)
        return LowLatencyDispatchResult(
            recv_x=conv(out["recv_x"]), recv_x_scales=scales, recv_count=conv(out["recv_count"]),
            recv_src_info=conv(out["recv_src_info"]), recv_layout_range=conv(out["recv_layout_range"]),
            handle=out["handle"], recv_hook=out["recv_hook"])

    def low_latency_combine(self, x: Any, topk_idx: Any, topk_weights: Any, handle: _epx.LowLatencyHandle, *,
                            return_recv_hook: bool = False, out: Any = None, wait_recv_cost_ns: Any = None,
                            stream: Any = None) -> LowLatencyCombineResult:
        """Low-latency combine: out[t] = bf16(sum_k w[t,k] * x[expert][slot of (t,k)]), fp32 accumulation
        (LowLatencyConfig.expert_side_reduction: per expert rank first). wait_recv_cost_ns: optional int64
        [num_ranks], entry q grows by the nanoseconds the receive waited for expert rank q."""
        res, conv = self._call(self._native.low_latency_combine, (x, topk_idx), x=to_bf16_arg(x),
                               topk_idx=to_arg(topk_idx), topk_weights=to_arg(topk_weights), handle=handle,
                               return_recv_hook=return_recv_hook, out=to_arg(out),
                               wait_recv_cost_ns=to_arg(wait_recv_cost_ns), stream=cuda_stream_of(stream, x))
        result = conv(res["x"])
        if out is not None:
            result = out
        return LowLatencyCombineResult(x=result, recv_hook=res["recv_hook"])

    def mask_rank(self, rank: int) -> None:
        """Low-latency path: skip `rank` (local to this rank's buffer; becomes symmetric after one call)."""
        self._native.mask_rank(rank)

    def unmask_rank(self, rank: int) -> None:
        """Low-latency path: stop skipping `rank` (local to this rank's buffer)."""
        self._native.unmask_rank(rank)

    def clear_rank_mask(self) -> None:
        self._native.clear_rank_mask()

    def rank_mask(self) -> List[bool]:
        """[num_ranks], True = masked."""
        return list(self._native.rank_mask())

    def clean_low_latency_buffer(self) -> None:
        """Collective: zero the low-latency buffer (signals, sequence numbers, mask) and forget its shapes."""
        self._native.clean_low_latency_buffer()
