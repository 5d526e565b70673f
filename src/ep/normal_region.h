// Memory layout of the normal path's peer-visible region (plain C++: the size hint and its tests use it in
// host-only builds too). The signal area comes first, then the rings (or, on the copy-engine path, one staging
// slot per peer). Every rank computes the same layout from (num_ranks, num_channels, region bytes), which
// Buffer::create checks agree on every rank. See normal_kernels.h for the protocol.
#pragma once

#include <cstdint>

#include "core/limits.h"

namespace epx::cuda {

// v rounded up to a multiple of a (a > 0; v + a - 1 must not overflow: the layouts' inputs are checked first).
inline int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Notify slot: [0] the source's largest staging need (rows) to one remote destination, [1, C + 2)
// channel prefixes, [C + 2, C + 2 + E_local) expert counts, then the source's ring area in KiB, its
// token count if it sends whole x to this destination (0: packed rows), [C + 4 + E_local, + R) the
// tokens it sends to every rank (for the rank prefix matrix), and 1 if its whole-x copy to this destination
// started before notify (EarlyCopies), else 0.
inline constexpr int kNotifyInts = 5 + kNormalMaxChannels + kNormalMaxLocalExperts + kNormalMaxRanks;

// Words per (parity, source) in the handle-id area: the dispatch id, the shape word, the epoch.
inline constexpr int kCallWords = 3;

// Byte offsets inside a rank's region (identical on every rank). Signals are uint64.
struct NormalRegionLayout {
  int64_t off_epoch = 0;         // uint64: this rank's operation counter (local only)
  int64_t off_tail = 0;          // uint64 [R src][C]: rows the source wrote into my ring
  int64_t off_head = 0;          // uint64 [R dst][C]: rows the destination consumed from its ring
  int64_t off_done = 0;          // uint64 [R dst][C]: last epoch the destination finished reading its ring
  int64_t off_notify_flag = 0;   // uint64 [2][R src]
  int64_t off_notify = 0;        // int32 [2][R src][kNotifyInts]
  int64_t off_copy_counter = 0;  // uint32: finished blocks of the copy-engine receive kernel (local only)
  int64_t off_ce_tail = 0;       // uint64 [R src]: rows the source's copy engine delivered, tagged
  int64_t off_abort = 0;         // uint64: 1 + the rank that left the current call before it started, else 0
  // uint64 [2][R src][kCallWords]: the dispatch id of the source's operation, its shape word (ep/call_shape.h) and
  // its epoch, by epoch parity
  int64_t off_handle_id = 0;
  int64_t signals_used = 0;      // bytes the signals above take, <= kNormalSignalBytes
  int64_t off_ring = 0;          // = kNormalSignalBytes: rings [R src][C] of ring_slab_bytes each
  int64_t ring_bytes = 0;        // region bytes past the signal area
  int64_t ring_slab_bytes = 0;   // one (source, channel) ring's fixed share, a multiple of 16

  // num_ranks in [1, kNormalMaxRanks], num_channels in [1, kNormalMaxChannels], region_bytes >
  // kNormalSignalBytes (the constructor checks these with the user's names first); throws kInternal if the
  // signals outgrow their area (a limits.h change without this layout).
  static NormalRegionLayout make(int num_ranks, int num_channels, int64_t region_bytes);
};

}  // namespace epx::cuda
