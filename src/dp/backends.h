// Backend entry points behind dp_gather / dp_scatter and the batch-metadata sync (private).
//
// The public calls validate their arguments, then dispatch on group.backend(): the host backend here,
// the CUDA backend (NCCL all-gather / all-reduce / reduce-scatter, plus a slice copy) in
// src/dp/cuda/gather.cpp. Declarations only: this header needs no CUDA toolkit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "epx/dp.h"

namespace epx::detail {
// Elements per row of a validated gather/scatter tensor: hidden for [rows, hidden], 1 for [rows].
inline int64_t dp_row_elems(const TensorView& t) { return t.ndim == 2 ? t.shape[1] : 1; }
// (first row, rows) of CP rank cp_rank's shard in its DP rank's slot: the shards lie back to back in CP rank
// order from the slot's offset (SGLang's _cp_shard_rows). Validated counts.
inline std::pair<int64_t, int64_t> dp_cp_shard_rows(std::span<const int64_t> cp_shard_counts, int cp_rank,
                                                    int64_t dp_offset) {
  int64_t first = dp_offset;
  for (int c = 0; c < cp_rank; ++c) first += cp_shard_counts[c];
  return {first, cp_shard_counts[cp_rank]};
}
}  // namespace epx::detail

namespace epx::host {
// Defined in src/dp/host/gather.cpp. Arguments already validated on this rank.
void dp_gather_host(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& local,
                    const TensorView& global, DpGatherSource source, std::span<const int64_t> cp_shard_counts);
void dp_scatter_host(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& global,
                     const TensorView& local, DpScatterKind kind, std::span<const int64_t> cp_shard_counts);
// This rank's gather / reduce-scatter failed before its collective: takes part with an error flag
// (HostGroup::fail), so every peer raises kPeerFailure naming this rank and `reason`.
void dp_fail_host(Group& group, const std::string& reason) noexcept;
}  // namespace epx::host

// Defined in src/dp/cuda/gather.cpp (CUDA builds only; call under #ifdef EPX_WITH_CUDA). Arguments
// already validated on this rank. Enqueued on `stream`; the first call on a group creates its DP
// communicator (collective, see dp/cuda/comm.h).
// An undefined `local` (and empty cp_shard_counts): this rank's call was rejected but layout, plan, global and
// source / kind are valid, so it makes the same NCCL calls as its peers (dp_gather_fail, dp_scatter_fail):
// gather contributes zero rows; kReduceScatter sends its rows of `global` and receives into scratch memory.
namespace epx::cuda {
void dp_gather_cuda(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& local,
                    const TensorView& global, Stream stream, DpGatherSource source,
                    std::span<const int64_t> cp_shard_counts);
void dp_scatter_cuda(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& global,
                     const TensorView& local, DpScatterKind kind, Stream stream,
                     std::span<const int64_t> cp_shard_counts);
// The batch-metadata all-gather: `bytes` from host `send` on every rank into host `recv`
// [num_ranks * bytes], through one ncclAllGather and one device-to-host copy; blocks until done,
// bounded by the group's timeout (kTimeout).
void dp_all_gather_records_cuda(Group& group, const void* send, void* recv, size_t bytes);
// This rank failed a DP collective it could not join: marks the group's DP communicator failed on this rank (made
// failed if it does not exist yet), so this rank's later DP calls raise kPeerFailure instead of pairing with the
// call its peers still wait in. Never throws.
void dp_abandon_cuda(Group& group, const std::string& reason) noexcept;
// The rejected calls of this rank that joined their peers' collective (dp_gather_fail, dp_scatter_fail with
// kReduceScatter): their peers' outputs lack this rank's rows. note_ counts one; take_ returns the count and restarts
// it: the next batch-metadata sync carries it to every peer, which raises kPeerFailure (src/dp/metadata.cpp). Never
// throw; 0 without a DP communicator.
void dp_note_joined_failure_cuda(Group& group) noexcept;
int64_t dp_take_joined_failures_cuda(Group& group) noexcept;
}  // namespace epx::cuda
