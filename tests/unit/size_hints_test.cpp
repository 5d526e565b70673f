// Peer-memory size hints (include/epx/buffer.h): growth with the arguments and bad input.
#include <gtest/gtest.h>

#include <algorithm>

#include "core/limits.h"
#include "ep/normal_region.h"
#include "epx/buffer.h"
#include "epx/error.h"

namespace epx {
namespace {

// The copy-engine path (src/ep/cuda/normal_plan.h, DispatchPlan::copy_slot_bytes) takes the region past the 1 MiB signal
// area, rounds it down to KiB, splits it into one 256-byte aligned slot per peer, and needs the fields of T rows
// in a slot, each field 256-byte aligned (stage_fields, copy_engine_host.h): bf16 data, fp32 scales, top-16 int64 ids, fp32 weights,
// int32 source index.
TEST(SizeHints, NormalHintCoversCopyEngineStaging) {
  for (int ranks : {1, 2, 4, 8}) {
    for (int64_t hidden : {2048, 7168}) {
      const int64_t rings = normal_buffer_size_hint(hidden, ranks, 24);
      auto up256 = [](int64_t v) { return (v + 255) / 256 * 256; };
      int64_t previous = rings;
      for (int64_t tokens : {1, 128, 4096, 16384}) {
        const int64_t hint = normal_buffer_size_hint(hidden, ranks, 24, tokens);
        EXPECT_GE(hint, previous) << "grows with the token count";
        EXPECT_GE(hint, rings) << "never below the SM path's rings";
        if (ranks > 1) {
          const int64_t ring_bytes = (hint - (int64_t{1} << 20)) >> 10 << 10;
          const int64_t slot = ring_bytes / (ranks - 1) / 256 * 256;
          const int64_t fields = up256(tokens * hidden * 2) + up256(tokens * hidden / 128 * 4) +
                                 up256(tokens * 8 * 16) + up256(tokens * 4 * 16) + up256(tokens * 4);
          EXPECT_GE(slot, fields) << ranks << " ranks, hidden " << hidden << ", " << tokens << " tokens";
        }
        previous = hint;
      }
    }
  }
  EXPECT_GT(normal_buffer_size_hint(7168, 2, 64), normal_buffer_size_hint(7168, 2, 8)) << "rings per channel";
}

TEST(SizeHints, BadInputNamesTheArgument) {
  auto message = [](auto fn) {
    try {
      fn();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([] { normal_buffer_size_hint(0, 2, 24); }).find("hidden"), std::string::npos);
  EXPECT_NE(message([] { normal_buffer_size_hint(7168, 0, 24); }).find("num_ranks"), std::string::npos);
  EXPECT_NE(message([] { normal_buffer_size_hint(7168, 2, 0); }).find("num_sms"), std::string::npos);
  EXPECT_NE(message([] { normal_buffer_size_hint(7168, 2, 24, -1); }).find("max_tokens_per_rank"), std::string::npos);
  EXPECT_NE(message([] { low_latency_buffer_size_hint(0, 7168, 2, 256); }).find("max_tokens_per_rank"),
            std::string::npos);
  EXPECT_NE(message([] { low_latency_buffer_size_hint(128, 7168, 3, 256); }).find("num_experts"), std::string::npos);
}

// The cuda buffer lays its region out with NormalRegionLayout; the hint must give every (source, channel) ring
// at least kNormalHintRingRows rows of the largest row (bf16 data, top-16 ids and weights, source index), and
// the signals must fit their area at the largest rank and channel counts.
TEST(SizeHints, NormalHintGivesEveryRingItsRows) {
  EXPECT_NO_THROW(cuda::NormalRegionLayout::make(kNormalMaxRanks, kNormalMaxChannels, kNormalSignalBytes + 1));
  const auto big = cuda::NormalRegionLayout::make(kNormalMaxRanks, kNormalMaxChannels, kNormalSignalBytes + 1);
  EXPECT_LE(big.signals_used, kNormalSignalBytes);
  EXPECT_EQ(big.off_ring, kNormalSignalBytes);
  for (int ranks : {1, 2, 4, 8}) {
    for (int sms : {2, 8, 24, 64, 128}) {
      for (int64_t hidden : {16, 2048, 7168, 16384}) {
        const int channels = std::min(std::max(sms / 2, 1), kNormalMaxChannels);
        const int64_t bytes = (normal_buffer_size_hint(hidden, ranks, sms) + 4095) / 4096 * 4096;
        const auto l = cuda::NormalRegionLayout::make(ranks, channels, bytes);
        const int64_t row = (hidden * 2 + 8 * kNormalMaxTopk + 4 + 15) / 16 * 16;
        EXPECT_GE(l.ring_slab_bytes / row, kNormalHintRingRows)
            << ranks << " ranks, " << sms << " SMs, hidden " << hidden;
        EXPECT_EQ(l.ring_slab_bytes % 16, 0);
        EXPECT_LE(l.ring_slab_bytes * ranks * channels, l.ring_bytes);
      }
    }
  }
}

}  // namespace
}  // namespace epx
