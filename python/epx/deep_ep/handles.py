"""The handles DeepEP code holds: tuples with DeepEP's element meanings where epx has them, carrying the
epx handle that combine / cached dispatch need.

* ``NormalHandle``: DeepEP's intranode 6-tuple. [0] rank_prefix_matrix (int32 [R, R], entry [i][j] =
  tokens ranks 0..i send to rank j); [3] recv_src_idx (int32 [N]); [4] is_token_in_rank (bool [T, R]);
  [1], [2] (channel prefix matrices) and [5] (send_head) are None: epx has no per-channel state.
* ``InternodeHandle``: DeepEP's internode 10-tuple, returned when the buffer spans more than one node. [0]
  is_token_in_rank (bool [T, R], as passed to dispatch); [6] recv_gbl_rank_prefix_sum (int32 [R], entry s =
  tokens ranks 0..s send to this rank: column ``rank`` of the rank prefix matrix); [7] recv_src_meta, which in
  epx is recv_src_idx (int32 [N]; DeepEP's is a packed per-row byte record, so only ``.size(0)`` = rows
  received means the same); the per-channel matrices [1], [2], [3], [5], the per-node receive prefix [4] and
  the send heads [8], [9] are None (epx keeps its routes in the epx handle). ``.rank_prefix_matrix``: the full
  int32 [R, R] matrix.
* ``LowLatencyHandle``: DeepEP's 5-tuple (recv_src_info int32 [E_local, R * M], recv_layout_range int64
  [E_local, R] = (begin << 32) | count, max tokens per rank M, hidden, num_experts), same meanings.

Code that rebuilds the tuple (``tuple(handle)``, slicing and re-packing) loses the attribute; the epx
handle is then found again from the tuple's recv_src_idx / recv_src_info tensor (a weak map).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Tuple

import torch

from epx import _epx

# id(tensor) -> (weak reference to the tensor, epx handle); an entry goes when its tensor dies. (Not a
# WeakKeyDictionary: its lookups compare keys with ==, which for tensors is elementwise.)
_NORMAL_BY_TENSOR: Dict[int, Tuple[Any, Any]] = {}
_LOW_LATENCY_BY_TENSOR: Dict[int, Tuple[Any, Any]] = {}


def _remember(table: Dict[int, Tuple[Any, Any]], tensor: Any, native: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        return
    key = id(tensor)
    table[key] = (weakref.ref(tensor), native)
    weakref.finalize(tensor, table.pop, key, None)


def _recall(table: Dict[int, Tuple[Any, Any]], tensor: Any) -> Any:
    entry = table.get(id(tensor))
    if entry is None or entry[0]() is not tensor:
        return None
    return entry[1]


class NormalHandle(tuple):
    """(rank_prefix_matrix, None, None, recv_src_idx, is_token_in_rank, None); ``.epx_handle``: epx's."""

    def __new__(cls, rank_prefix_matrix: Any, recv_src_idx: Any, is_token_in_rank: Any, epx_handle: Any):
        self = super().__new__(cls, (rank_prefix_matrix, None, None, recv_src_idx, is_token_in_rank, None))
        self.epx_handle = epx_handle
        _remember(_NORMAL_BY_TENSOR, recv_src_idx, epx_handle)
        return self


class InternodeHandle(tuple):
    """(is_token_in_rank, None, None, None, None, None, recv_gbl_rank_prefix_sum, recv_src_idx, None, None);
    ``.epx_handle``: epx's; ``.rank_prefix_matrix``: int32 [R, R]."""

    def __new__(cls, is_token_in_rank: Any, recv_gbl_rank_prefix_sum: Any, recv_src_idx: Any,
                rank_prefix_matrix: Any, epx_handle: Any):
        self = super().__new__(cls, (is_token_in_rank, None, None, None, None, None, recv_gbl_rank_prefix_sum,
                                     recv_src_idx, None, None))
        self.epx_handle = epx_handle
        self.rank_prefix_matrix = rank_prefix_matrix
        _remember(_NORMAL_BY_TENSOR, recv_src_idx, epx_handle)
        return self


class LowLatencyHandle(tuple):
    """(recv_src_info, recv_layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts); ``.epx_handle``."""

    def __new__(cls, recv_src_info: Any, recv_layout_range: Any, max_tokens_per_rank: int, hidden: int,
                num_experts: int, epx_handle: Any):
        self = super().__new__(cls, (recv_src_info, recv_layout_range, max_tokens_per_rank, hidden, num_experts))
        self.epx_handle = epx_handle
        _remember(_LOW_LATENCY_BY_TENSOR, recv_src_info, epx_handle)
        return self


# Where each tuple keeps the tensor its epx handle is remembered by, by tuple length: the intranode 6-tuple and
# the low-latency 5-tuple ([3] recv_src_idx, [0] recv_src_info), the internode 10-tuple ([7] recv_src_meta).
_KEY_INDEX_BY_LENGTH = {6: 3, 5: 0, 10: 7}


def _lookup(handle: Any, native_type: type, table: Dict[int, Tuple[Any, Any]], what: str):
    if isinstance(handle, native_type):
        return handle
    native = getattr(handle, "epx_handle", None)
    if native is not None:
        return native
    key_index = _KEY_INDEX_BY_LENGTH.get(len(handle), -1) if isinstance(handle, (tuple, list)) else -1
    if key_index >= 0 and isinstance(handle[key_index], torch.Tensor):
        native = _recall(table, handle[key_index])
        if native is not None:
            return native
    raise ValueError(f"handle: expected the handle returned by epx.deep_ep.Buffer.{what} (or epx's own), got "
                     f"{type(handle).__name__}")


def native_dispatch_handle(handle: Any):
    return _lookup(handle, _epx.DispatchHandle, _NORMAL_BY_TENSOR, "dispatch")


def native_low_latency_handle(handle: Any):
    return _lookup(handle, _epx.LowLatencyHandle, _LOW_LATENCY_BY_TENSOR, "low_latency_dispatch")
