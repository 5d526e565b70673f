// The plan of a normal dispatch's routing (DispatchPlan), kept in its handle: what every later call on the handle
// (a cached dispatch, combine) needs of the receive counts, computed once. Private to the CUDA backend.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ep/cuda/copy_engine_host.h"
#include "ep/cuda/normal_kernels.h"
#include "epx/buffer.h"

namespace epx::cuda {

// The data path of one normal call. Every rank chooses alike: the inputs come from notify (the global largest
// transfer, the smallest ring area) and from arguments that must match on every rank.
enum class NormalPath {
  kSmRing,      // SM sender and receiver blocks per channel, through the peers' rings
  kCopyEngine,  // copy engines into one staging slot per peer (docs/normal-kernels.md, "copy engines")
};

struct DispatchPlan {
  // Fixed by the fresh dispatch.
  int64_t num_tokens = 0;
  RecvMetaLayout meta{};  // recv_meta's layout (this rank as receiver)

  // Known once the host read recv_meta (learn_counts): always without num_worst_tokens, else not until a cached
  // dispatch without it. Until then every call takes the SM rings.
  std::vector<int32_t> meta_host;           // recv_meta on the host; empty when unknown
  std::vector<int32_t> expert_counts_host;  // [E_local]; empty when unknown
  int64_t num_recv = -1;                    // -1: unknown on the host (worst-token mode)
  // Copy-engine path: the largest transfer between two ranks (rows) and the bytes of each staging slot (the
  // smallest ring area cut into R - 1 slots; 0: NormalConfig::copy_engines off, or one rank).
  int64_t max_pair_rows = 0;
  int64_t slot_capacity_bytes = 0;
  // Copy-engine dispatch, per destination: rows sent; whole x (every token) or SM-packed rows, which start at
  // pack_offset in the packing stage of num_packed_rows; chunks per destination.
  RowCounts send_rows{};
  RowCounts pack_offset{};
  unsigned pack_mask = 0;   // bit per destination whose rows are packed
  unsigned early_mask = 0;  // bit per destination whose whole-x copy the fresh dispatch started before notify
  int64_t num_packed_rows = 0;
  int dispatch_chunks = 1;
  // Copy-engine combine, per source: the rows this rank received from it go back, contiguous from combine_base
  // (its rank prefix) in combine's x; chunks per source.
  RowCounts combine_rows{};
  RowCounts combine_base{};
  int combine_chunks = 1;

  bool counts_known() const { return !meta_host.empty(); }

  // Takes the counts from recv_meta as read to the host (meta.size() ints).
  void learn_counts(const int32_t* recv_meta, const NormalConfig& config, int rank) {
    const int R = meta.num_ranks, C = meta.num_channels;
    meta_host.assign(recv_meta, recv_meta + meta.size());
    expert_counts_host.assign(recv_meta + meta.expert_count(0), recv_meta + meta.expert_count(meta.num_local_experts));
    num_recv = recv_meta[meta.num_recv()];
    max_pair_rows = recv_meta[meta.max_pair_rows()];
    slot_capacity_bytes = 0;
    if (config.copy_engines) slot_capacity_bytes = cuda::slot_capacity_bytes(recv_meta[meta.min_ring_kib()], R);
    pack_mask = 0;
    num_packed_rows = 0;
    int64_t max_combine_rows = 0;
    for (int d = 0; d < R; ++d) {
      send_rows.v[d] = recv_meta[meta.send_count(d)];
      pack_offset.v[d] = 0;
      const bool whole = ((early_mask >> d) & 1u) != 0 || whole_copy(send_rows.v[d], num_tokens, config.whole_copies);
      if (d != rank && !whole) {
        pack_mask |= 1u << d;
        pack_offset.v[d] = num_packed_rows;
        num_packed_rows += send_rows.v[d];
      }
      combine_rows.v[d] = d == rank ? 0 : recv_meta[meta.chan_start(d, C)] - recv_meta[meta.chan_start(d, 0)];
      combine_base.v[d] = recv_meta[meta.rank_prefix(d)];
      max_combine_rows = std::max(max_combine_rows, combine_rows.v[d]);
    }
    dispatch_chunks = copy_chunks(max_pair_rows, config.max_copy_chunks);
    combine_chunks = copy_chunks(max_combine_rows, config.max_copy_chunks);
  }

  // The staging slot's bytes for a largest transfer of pair_bytes between two ranks, or 0 when it does not fit
  // (or the counts are unknown, or the copy engines are off): then the call takes the SM rings.
  int64_t copy_slot_bytes(int64_t pair_bytes) const {
    if (slot_capacity_bytes == 0 || !counts_known()) return 0;
    return pair_bytes <= slot_capacity_bytes ? slot_capacity_bytes : 0;
  }

  // Sources whose whole-x copy into this rank's staging started before notify (bits; 0 while the counts are unknown).
  unsigned early_sources() const {
    return counts_known() ? static_cast<unsigned>(meta_host[meta.early_sources()]) : 0u;
  }
};

}  // namespace epx::cuda
