// Forward modes (names, SGLang's is_extend) and the per-step EP protocol choice (SGLang's
// DeepEPMode.resolve: auto -> normal when an extend batch is in the step, else low-latency).
#include <gtest/gtest.h>

#include "epx/forward_mode.h"

namespace epx {
namespace {

constexpr ForwardMode kAllModes[] = {ForwardMode::kIdle,    ForwardMode::kExtend,       ForwardMode::kDecode,
                                     ForwardMode::kMixed,   ForwardMode::kTargetVerify, ForwardMode::kDraftExtend,
                                     ForwardMode::kPrebuilt};

TEST(ForwardMode, NamesAndWireValues) {
  EXPECT_STREQ(to_string(ForwardMode::kPrebuilt), "PREBUILT");
  EXPECT_STREQ(to_string(ForwardMode::kMixed), "MIXED");
  // The record's wire values: PREBUILT is appended, the others keep their numbers.
  EXPECT_EQ(static_cast<int>(ForwardMode::kIdle), 0);
  EXPECT_EQ(static_cast<int>(ForwardMode::kDraftExtend), 5);
  EXPECT_EQ(static_cast<int>(ForwardMode::kPrebuilt), 6);
}

TEST(ForwardMode, IsExtendAsSglang) {
  // forward_batch_info.py ForwardMode.is_extend(): EXTEND, MIXED, DRAFT_EXTEND, TARGET_VERIFY.
  for (ForwardMode m : kAllModes) {
    const bool expected = m == ForwardMode::kExtend || m == ForwardMode::kMixed || m == ForwardMode::kDraftExtend ||
                          m == ForwardMode::kTargetVerify;
    EXPECT_EQ(is_extend(m), expected) << to_string(m);
  }
}

TEST(DeepEPMode, ResolvePerStep) {
  EXPECT_STREQ(to_string(DeepEPMode::kNormal), "normal");
  EXPECT_STREQ(to_string(DeepEPMode::kLowLatency), "low_latency");
  EXPECT_STREQ(to_string(DeepEPMode::kAuto), "auto");
  // Fixed modes resolve to themselves whatever the step.
  for (bool extend : {false, true}) {
    EXPECT_EQ(resolve_deepep_mode(DeepEPMode::kNormal, extend), DeepEPMode::kNormal);
    EXPECT_EQ(resolve_deepep_mode(DeepEPMode::kLowLatency, extend), DeepEPMode::kLowLatency);
  }
  for (ForwardMode m : kAllModes) {
    EXPECT_EQ(resolve_deepep_mode(DeepEPMode::kNormal, m), DeepEPMode::kNormal);
    EXPECT_EQ(resolve_deepep_mode(DeepEPMode::kLowLatency, m), DeepEPMode::kLowLatency);
  }
  // auto: by the step's (agreed) is_extend_in_batch.
  EXPECT_EQ(resolve_deepep_mode(DeepEPMode::kAuto, true), DeepEPMode::kNormal);
  EXPECT_EQ(resolve_deepep_mode(DeepEPMode::kAuto, false), DeepEPMode::kLowLatency);
  // auto by forward mode: prefill-like steps normal, decode-like steps low-latency.
  EXPECT_EQ(resolve_deepep_mode(DeepEPMode::kAuto, ForwardMode::kExtend), DeepEPMode::kNormal);
  EXPECT_EQ(resolve_deepep_mode(DeepEPMode::kAuto, ForwardMode::kMixed), DeepEPMode::kNormal);
  EXPECT_EQ(resolve_deepep_mode(DeepEPMode::kAuto, ForwardMode::kTargetVerify), DeepEPMode::kNormal);
  EXPECT_EQ(resolve_deepep_mode(DeepEPMode::kAuto, ForwardMode::kDraftExtend), DeepEPMode::kNormal);
  EXPECT_EQ(resolve_deepep_mode(DeepEPMode::kAuto, ForwardMode::kDecode), DeepEPMode::kLowLatency);
  EXPECT_EQ(resolve_deepep_mode(DeepEPMode::kAuto, ForwardMode::kPrebuilt), DeepEPMode::kLowLatency);
  EXPECT_EQ(resolve_deepep_mode(DeepEPMode::kAuto, ForwardMode::kIdle), DeepEPMode::kLowLatency);
}

}  // namespace
}  // namespace epx
