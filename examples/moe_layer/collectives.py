"""Per-step DP collectives for the rank threads: epx.dp where it can run, an in-process stand-in where it cannot.

epx's CUDA DP path (gather/scatter, batch-metadata sync) runs on an NCCL communicator of its own, and two ranks on
one GPU cannot share one (docs/dp-attention.md). With `--devices 0,0` the ranks are threads of this process, so
the stand-in moves the same rows through Python (publish, barrier, copy, barrier) with the same semantics and the
same plan (epx.dp.plan_dp_gather), and says so once. Everything else (host backend, one GPU per rank) uses epx.
"""

from __future__ import annotations

import struct
import threading
from typing import Any, List, Sequence

import torch

import epx
from epx import dp


class Exchange:
    """A rendezvous of the rank threads of this process (shared by all ranks)."""

    def __init__(self, num_ranks: int, timeout_s: float = 120.0):
        self.num_ranks = num_ranks
        # NOTE: bounded, so a rank that died leaves its peers a BrokenBarrierError instead of a hang.
        self.barrier = threading.Barrier(num_ranks, timeout=timeout_s)
        self.slots: List[Any] = [None] * num_ranks

    def all_gather(self, rank: int, value: Any) -> List[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites its slot before every rank has read it
        return out


_FIELDS = ("num_tokens", "num_tokens_for_logprob", "can_run_decode_graph", "is_extend_in_batch", "can_run_tbo",
           "forward_mode", "can_run_prefill_graph", "prefill_graph_max_prefix_len", "can_run_draft_graph",
           "is_health_check", "attention_pairs")


class DpComm:
    """One rank's DP attention collectives: metadata sync, gather, scatter (reduce-scatter)."""

    def __init__(self, group: epx.Group, exchange: Exchange, use_epx: bool):
        self.group, self.exchange, self.use_epx = group, exchange, use_epx
        self.rank, self.num_ranks = group.rank, group.num_ranks
        self.layout = dp.ParallelLayout.pure_dp(self.num_ranks)  # attn_dp = moe_ep = world
        self.sync_ = dp.BatchMetadataSync(group, self.layout) if use_epx else None

    def sync(self, record: dp.BatchMetadata) -> dp.GlobalBatchInfo:
        """The step's agreed batch info (one all-gather of the 11-field records)."""
        if self.sync_ is not None:
            return dp.sync_batch_metadata(self.sync_, record).global_info
        fields = [int(getattr(record, f).value) if f == "forward_mode" else int(getattr(record, f)) for f in _FIELDS]
        gathered = self.exchange.all_gather(self.rank, struct.pack("<11q", *fields))
        records = []
        for blob in gathered:
            values = dict(zip(_FIELDS, struct.unpack("<11q", blob)))
            values["forward_mode"] = dp.ForwardMode(values["forward_mode"])
            for f in ("can_run_decode_graph", "is_extend_in_batch", "can_run_tbo", "can_run_prefill_graph",
                      "can_run_draft_graph", "is_health_check"):
                values[f] = bool(values[f])
            records.append(dp.BatchMetadata(**values))
        return dp.reduce_batch_metadata(records)

    def gather(self, plan: dp.DpGatherPlan, local: torch.Tensor) -> torch.Tensor:
        """[plan.buffer_len, H]: every DP rank's rows at its offset, zeros elsewhere (MAX_LEN padding)."""
        if self.use_epx:
            return dp.dp_gather(self.group, self.layout, plan, local)
        _sync(local)
        parts = self.exchange.all_gather(self.rank, local)
        out = local.new_zeros((plan.buffer_len,) + tuple(local.shape[1:]))
        for d, part in enumerate(parts):
            n, off = plan.num_tokens[d], plan.offsets[d]
            out[off:off + n] = part[:n].to(out.device)
        _sync(out)
        self.exchange.barrier.wait()  # the peers' locals may be freed only after every copy finished
        return out

    def reduce_scatter(self, plan: dp.DpGatherPlan, partial: torch.Tensor) -> torch.Tensor:
        """This DP rank's rows of the sum over ranks of `partial` [buffer_len, H] (fp32 sums, rank order)."""
        if self.use_epx:
            return dp.dp_scatter(self.group, self.layout, plan, partial, kind="reduce_scatter")
        _sync(partial)
        parts = self.exchange.all_gather(self.rank, partial)
        n, off = plan.num_tokens[self.rank], plan.offsets[self.rank]
        acc = torch.zeros((n,) + tuple(partial.shape[1:]), dtype=torch.float32, device=partial.device)
        for part in parts:  # rank order, as epx's host backend sums
            acc += part[off:off + n].to(partial.device).float()
        out = acc.to(partial.dtype)
        _sync(out)
        self.exchange.barrier.wait()
        return out


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


def plan_step(counts: Sequence[int], is_extend: bool, in_cuda_graph: bool = False) -> dp.DpGatherPlan:
    """The padding mode chosen for this step's counts (epx's rule), and its plan."""
    mode = dp.choose_padding_mode(list(counts), is_extend_in_batch=is_extend, in_cuda_graph=in_cuda_graph)
    return dp.plan_dp_gather(list(counts), mode)


def record(num_tokens: int, mode: dp.ForwardMode, can_run_graph: bool = True,
           can_run_tbo: bool = True) -> dp.BatchMetadata:
    return dp.BatchMetadata(num_tokens=num_tokens, num_tokens_for_logprob=num_tokens, forward_mode=mode,
                            is_extend_in_batch=mode == dp.ForwardMode.EXTEND, can_run_decode_graph=can_run_graph,
                            can_run_tbo=can_run_tbo)
