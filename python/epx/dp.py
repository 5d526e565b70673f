"""epx.dp: DP attention (the contract: include/epx/dp.h).

Attention runs data-parallel (each DP rank has its own batch), the MoE expert-parallel over the same ranks.
Between the two, hidden states are gathered into one global batch (``dp_gather``) and scattered back
(``dp_scatter``); every step the DP ranks agree on a batch-metadata record (``BatchMetadataSync``).

Rank arithmetic (world = tp)::

    attention rank = (attn_dp_rank * attn_cp + attn_cp_rank) * attn_tp + attn_tp_rank
    MoE rank       = (moe_dp_rank * moe_ep + moe_ep_rank) * moe_tp + moe_tp_rank

The collectives run over a Group of all ``world_size`` ranks and are called by every rank with the same
plan; only each DP rank's leader (attn_tp_rank 0, attn_cp_rank 0) contributes data. Tensors: bf16 or
float32, contiguous, numpy or torch (CUDA tensors on the cuda backend); the GIL is released while a
collective waits.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np

from . import _epx
from ._epx.dp import (  # noqa: F401
    BATCH_METADATA_FIELDS,
    BatchMetadata,
    BatchMetadataSync,
    BatchSyncResult,
    CpStrategy,
    DpGatherPlan,
    DpGatherSource,
    DpPaddingMode,
    DpScatterKind,
    ForwardMode,
    GlobalBatchInfo,
    InterleaveQueries,
    InterleaveSplit,
    ParallelGroupKind,
    ParallelLayout,
    ParallelSizes,
    RankCoords,
    ZigzagSplit,
    interleave_gathered_rows,
    interleave_local_rows,
    parse_cp_strategy,
    reduce_batch_metadata,
    zigzag_gathered_rows,
    zigzag_local_rows,
)
from ._args import enum_arg, int_list
from ._tensors import cuda_stream_of, is_torch, to_arg

_native = _epx.dp

__all__ = [
    "BATCH_METADATA_FIELDS", "BatchMetadata", "BatchMetadataSync", "BatchSyncResult", "CpStrategy", "DpGatherPlan",
    "DpGatherSource", "DpPaddingMode", "DpScatterKind", "ForwardMode", "GlobalBatchInfo", "InterleaveQueries",
    "InterleaveSplit", "ParallelGroupKind", "ParallelLayout", "ParallelSizes", "RankCoords", "ZigzagSplit",
    "can_cp_split", "can_interleave_split", "can_zigzag_split", "choose_padding_mode", "cp_gathered_rows",
    "cp_local_rows", "dp_gather", "dp_scatter", "interleave_gathered_rows", "interleave_local_queries",
    "interleave_local_rows", "parse_cp_strategy", "plan_cp_split", "plan_dp_gather", "plan_interleave_split",
    "plan_zigzag_split", "reduce_batch_metadata", "zigzag_gathered_rows", "zigzag_local_rows",
]


def choose_padding_mode(num_tokens_per_dp_rank: Sequence[int], is_extend_in_batch: bool = False,
                        in_cuda_graph: bool = False, symmetric_a2a: bool = False) -> DpPaddingMode:
    """The padding mode of one step from the per-DP-rank token counts (first match wins):

    symmetric_a2a -> MAX_LEN; in_cuda_graph -> MAX_LEN; extend with more than one DP rank -> SUM_LEN;
    MAX_LEN iff ``2 * sum >= max * num_dp_ranks``; else SUM_LEN.
    """
    return _native.choose_padding_mode(int_list(num_tokens_per_dp_rank, "num_tokens_per_dp_rank"), is_extend_in_batch,
                                       in_cuda_graph, symmetric_a2a)


def plan_dp_gather(num_tokens_per_dp_rank: Sequence[int], mode: Union[DpPaddingMode, str] = "MAX_LEN",
                   attn_tp_size: int = 1) -> DpGatherPlan:
    """Where every DP rank's tokens sit in the global buffer [plan.buffer_len, hidden].

    MAX_LEN: ``slot_len`` = max count rounded up to ``attn_tp_size``, ``offsets[d] = d * slot_len``.
    SUM_LEN: offsets are the exclusive prefix sums and ``buffer_len`` the sum.
    """
    return _native.plan_dp_gather(int_list(num_tokens_per_dp_rank, "num_tokens_per_dp_rank"),
                                  enum_arg(DpPaddingMode, mode, "mode"), attn_tp_size)


def can_zigzag_split(extend_seq_lens: Sequence[int], cp_size: int, mode: Union[ForwardMode, str],
                     num_tokens: Optional[int] = None) -> bool:
    """Whether SGLang splits the batch over the attention-CP ranks (``ZigzagCPStrategy.can_apply``): cp_size > 1,
    EXTEND or MIXED, ``num_tokens`` (default: the sum) >= 2 * cp_size and every extend length >= 2 * cp_size."""
    lens = int_list(extend_seq_lens, "extend_seq_lens")
    return _native.can_zigzag_split(lens, cp_size, enum_arg(ForwardMode, mode, "mode"),
                                    sum(lens) if num_tokens is None else num_tokens)


def plan_zigzag_split(extend_seq_lens: Sequence[int], cp_size: int, num_tokens: int = -1) -> ZigzagSplit:
    """SGLang's zigzag split: every sequence cut into ``2 * cp_size`` blocks (length ``q * 2cp + r``: the first
    ``r`` blocks get ``q + 1`` rows), CP rank c holds blocks c and ``2 * cp_size - 1 - c`` of every sequence;
    ``num_tokens`` past the sum (padding) joins the last sequence. See ``zigzag_local_rows`` /
    ``zigzag_gathered_rows`` for the index maps."""
    return _native.plan_zigzag_split(int_list(extend_seq_lens, "extend_seq_lens"), cp_size, num_tokens)


def can_interleave_split(cp_size: int, mode: Union[ForwardMode, str], num_tokens: int) -> bool:
    """Whether SGLang shards the batch round-robin (``InterleaveCPStrategy.can_apply``): cp_size > 1, EXTEND or
    MIXED and ``num_tokens >= cp_size``; the sequence lengths do not matter."""
    return _native.can_interleave_split(cp_size, enum_arg(ForwardMode, mode, "mode"), num_tokens)


def plan_interleave_split(extend_seq_lens: Sequence[int], cp_size: int, num_tokens: int = -1) -> InterleaveSplit:
    """SGLang's interleave split: batch row i goes to CP rank ``i % cp_size`` as its local row ``i // cp_size``,
    across sequence boundaries; ``num_tokens`` past the sum (padding) is dealt out the same way but belongs to no
    sequence. See ``interleave_local_rows`` / ``interleave_gathered_rows`` / ``interleave_local_queries``."""
    return _native.plan_interleave_split(int_list(extend_seq_lens, "extend_seq_lens"), cp_size, num_tokens)


def interleave_local_queries(split: InterleaveSplit, cp_rank: int,
                             prefix_lens: Optional[Sequence[int]] = None) -> InterleaveQueries:
    """The sequence (``seq_idx``) and causal KV length (``kv_lens``) of each of CP rank ``cp_rank``'s real rows
    (SGLang's ``query_request_indices`` / ``query_cache_lengths``); ``prefix_lens`` ``[num_seqs]`` (default 0)."""
    prefix = [] if prefix_lens is None else int_list(prefix_lens, "prefix_lens")
    return _native.interleave_local_queries(split, cp_rank, prefix)


def can_cp_split(strategy: Union[CpStrategy, str], extend_seq_lens: Sequence[int], cp_size: int,
                 mode: Union[ForwardMode, str], num_tokens: Optional[int] = None) -> bool:
    """SGLang's ``can_apply`` of the chosen strategy (``"zigzag"`` or ``"interleave"``); ``num_tokens`` defaults
    to the sum of ``extend_seq_lens``."""
    lens = int_list(extend_seq_lens, "extend_seq_lens")
    return _native.can_cp_split(enum_arg(CpStrategy, strategy, "strategy"), lens, cp_size,
                                enum_arg(ForwardMode, mode, "mode"), sum(lens) if num_tokens is None else num_tokens)


def plan_cp_split(strategy: Union[CpStrategy, str], extend_seq_lens: Sequence[int], cp_size: int,
                  num_tokens: int = -1) -> Union[ZigzagSplit, InterleaveSplit]:
    """``plan_zigzag_split`` or ``plan_interleave_split``. Either result's ``num_tokens`` are the
    ``cp_shard_counts`` for ``dp_gather`` / ``dp_scatter``; ``cp_local_rows`` / ``cp_gathered_rows`` map its rows."""
    if enum_arg(CpStrategy, strategy, "strategy") == CpStrategy.zigzag:
        return plan_zigzag_split(extend_seq_lens, cp_size, num_tokens)
    return plan_interleave_split(extend_seq_lens, cp_size, num_tokens)


def cp_local_rows(split: Union[ZigzagSplit, InterleaveSplit], cp_rank: int) -> list:
    """``zigzag_local_rows`` or ``interleave_local_rows``, by the type of ``split``."""
    if isinstance(split, ZigzagSplit):
        return zigzag_local_rows(split, cp_rank)
    return interleave_local_rows(split, cp_rank)


def cp_gathered_rows(split: Union[ZigzagSplit, InterleaveSplit]) -> list:
    """``zigzag_gathered_rows`` or ``interleave_gathered_rows``, by the type of ``split``: batch row i of DP rank d
    is global row ``plan.offsets[d] + cp_gathered_rows(split)[i]`` after ``dp_gather`` with the split's shards."""
    if isinstance(split, ZigzagSplit):
        return zigzag_gathered_rows(split)
    return interleave_gathered_rows(split)


def _empty_like(t: Any, rows: int) -> Any:
    shape = (rows,) + tuple(t.shape[1:])
    if is_torch(t):
        import torch

        return torch.empty(shape, dtype=t.dtype, device=t.device)
    # NOTE: numpy gives a zero-row array strides (0, 0), which TensorView::is_contiguous rejects; a zero-row
    # slice of a one-row array keeps row-major strides.
    return np.empty((max(rows, 1),) + shape[1:], dtype=np.asarray(t).dtype)[:rows]


def _shards_arg(cp_shard_counts: Any) -> Any:
    """cp_shard_counts as a list of ints, or as passed when it is none (the native call rejects it, naming it)."""
    if cp_shard_counts is None:
        return []
    try:
        return int_list(cp_shard_counts, "cp_shard_counts")
    except Exception:
        return cp_shard_counts


def dp_gather(group: _epx.Group, layout: ParallelLayout, plan: DpGatherPlan, local: Any, out: Any = None,
              stream: Any = None, partial_sums: bool = False, cp_shard_counts: Optional[Sequence[int]] = None) -> Any:
    """Collective: the global batch [plan.buffer_len, hidden] on every rank.

    Row block ``[offsets[d], offsets[d] + num_tokens[d])`` holds the first ``num_tokens[d]`` rows of DP rank
    d's leader's ``local``; every other row is zero. ``partial_sums=True`` (either padding mode; SGLang's
    ``dp_gather_partial``): every attention-TP rank's ``local`` is a partial sum and the block holds their sum
    (the TP reduction and the gather in one collective). ``local`` may have more rows than this rank's count
    (only the first count are read). ``out`` (allocated like ``local`` when None) is written and returned.

    Attention CP (``attn_cp_size > 1``): without ``cp_shard_counts`` CP rank 0's rows are gathered (the CP ranks
    hold the same batch); with them (``[attn_cp_size]``, this DP rank's, e.g. ``plan_cp_split(...).num_tokens``)
    each CP rank's first ``cp_shard_counts[c]`` rows land back to back in CP rank order at the DP rank's offset.
    """
    # NOTE: nothing here raises before the native call: it converts every argument itself and, when one is rejected,
    # still takes part in the collective (docs/reliability.md), so the ranks stay in step.
    try:
        if out is None:
            out = _empty_like(local, plan.buffer_len)
    except Exception:  # local or plan is rejected by the native call, naming it
        out = None
    shards = _shards_arg(cp_shard_counts)
    try:
        source = DpGatherSource.partial_sums if partial_sums else DpGatherSource.leader
    except Exception:  # no truth value: the native call rejects it, naming source, and still takes part
        source = partial_sums
    _native.dp_gather(group, layout, plan, to_arg(local), to_arg(out), cuda_stream_of(stream, local, out), source,
                      shards)
    return out


def dp_scatter(group: _epx.Group, layout: ParallelLayout, plan: DpGatherPlan, global_buffer: Any, out: Any = None,
               kind: Union[DpScatterKind, str] = "slice", stream: Any = None,
               cp_shard_counts: Optional[Sequence[int]] = None) -> Any:
    """Collective: this DP rank's rows of the global batch, [num_tokens[my DP rank], hidden].

    ``kind="slice"``: every rank holds the same ``global_buffer``; ``"reduce_scatter"``: each holds a partial
    one and the rows are summed over ranks (fp32, rank order, rounded once). ``out`` (allocated like
    ``global_buffer`` when None; may have more rows, which are zeroed) is written and returned.
    ``kind="slice"`` with ``cp_shard_counts`` (as for ``dp_gather``) returns only this CP rank's shard
    ``[cp_shard_counts[attn_cp_rank], hidden]``.
    """
    # NOTE: as in dp_gather, nothing raises before the native call but a kind that names no kind: with it this rank
    # cannot tell whether its peers' call has a collective (kSlice has none), so it joins none.
    kind = enum_arg(DpScatterKind, kind, "kind")
    shards = _shards_arg(cp_shard_counts)
    if out is None:
        try:
            coords = layout.coords(group.rank)
            rows = plan.num_tokens[coords.attn_dp_rank]
            if isinstance(shards, list) and len(shards) == layout.attn_cp_size and shards:
                rows = max(shards[coords.attn_cp_rank], 0)
            out = _empty_like(global_buffer, rows)
        except Exception:  # the native call rejects the argument, naming it
            out = None
    _native.dp_scatter(group, layout, plan, to_arg(global_buffer), to_arg(out), kind,
                       cuda_stream_of(stream, global_buffer, out), shards)
    return out


def sync_batch_metadata(sync: BatchMetadataSync, local: Optional[BatchMetadata],
                        inactive_ranks: Optional[Sequence[int]] = None) -> BatchSyncResult:
    """``sync.sync(local, inactive_ranks)``: the per-step collective (None for a rank with no batch).

    ``inactive_ranks``: group ranks that are dead or absent this step (the same list on every calling rank, host
    backend only): they are not waited for, and each DP rank whose leader is listed counts as SGLang's fallback
    record ``BatchMetadata.idle()``.
    """
    return sync.sync(local, inactive_ranks)
