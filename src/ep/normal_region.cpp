#include "ep/normal_region.h"

#include "core/check.h"

namespace epx::cuda {

NormalRegionLayout NormalRegionLayout::make(int num_ranks, int num_channels, int64_t region_bytes) {
  EPX_CHECK(ErrorCode::kInternal,
            num_ranks >= 1 && num_ranks <= kNormalMaxRanks && num_channels >= 1 && num_channels <= kNormalMaxChannels &&
                region_bytes > kNormalSignalBytes,
            "normal region layout of {} ranks, {} channels, {} bytes is outside the checked bounds", num_ranks,
            num_channels, region_bytes);
  NormalRegionLayout l;
  int64_t off = 0;
  auto take = [&](int64_t n) {
    const int64_t o = off;
    off = align_up(off + n, 128);
    return o;
  };
  const int64_t rc = int64_t{num_ranks} * num_channels;
  l.off_epoch = take(8);
  l.off_tail = take(8 * rc);
  l.off_head = take(8 * rc);
  l.off_done = take(8 * rc);
  l.off_notify_flag = take(8 * 2 * int64_t{num_ranks});
  l.off_notify = take(4 * 2 * int64_t{num_ranks} * kNotifyInts);
  l.off_copy_counter = take(8);
  l.off_ce_tail = take(8 * int64_t{num_ranks});
  l.off_abort = take(8);
  l.off_handle_id = take(8 * 2 * int64_t{num_ranks} * kCallWords);
  l.signals_used = off;
  EPX_CHECK(ErrorCode::kInternal, off <= kNormalSignalBytes, "the normal signal area needs {} bytes, has {}", off,
            kNormalSignalBytes);
  l.off_ring = kNormalSignalBytes;
  l.ring_bytes = region_bytes - kNormalSignalBytes;
  l.ring_slab_bytes = l.ring_bytes / rc / 16 * 16;
  return l;
}

}  // namespace epx::cuda
