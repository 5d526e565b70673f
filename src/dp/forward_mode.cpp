// Forward modes and the per-step choice of the EP dispatch protocol (SGLang's DeepEPMode.resolve).
#include "epx/forward_mode.h"

namespace epx {

const char* to_string(ForwardMode mode) noexcept {
  switch (mode) {
    case ForwardMode::kIdle:
      return "IDLE";
    case ForwardMode::kExtend:
      return "EXTEND";
    case ForwardMode::kDecode:
      return "DECODE";
    case ForwardMode::kMixed:
      return "MIXED";
    case ForwardMode::kTargetVerify:
      return "TARGET_VERIFY";
    case ForwardMode::kDraftExtend:
      return "DRAFT_EXTEND";
    case ForwardMode::kPrebuilt:
      return "PREBUILT";
  }
  return "unknown";
}

bool is_extend(ForwardMode mode) noexcept {
  switch (mode) {
    case ForwardMode::kExtend:
    case ForwardMode::kMixed:
    case ForwardMode::kTargetVerify:
    case ForwardMode::kDraftExtend:
      return true;
    case ForwardMode::kIdle:
    case ForwardMode::kDecode:
    case ForwardMode::kPrebuilt:
      return false;
  }
  return false;
}

const char* to_string(DeepEPMode mode) noexcept {
  switch (mode) {
    case DeepEPMode::kNormal:
      return "normal";
    case DeepEPMode::kLowLatency:
      return "low_latency";
    case DeepEPMode::kAuto:
      return "auto";
  }
  return "unknown";
}

DeepEPMode resolve_deepep_mode(DeepEPMode mode, bool is_extend_in_batch) noexcept {
  if (mode != DeepEPMode::kAuto) return mode;
  return is_extend_in_batch ? DeepEPMode::kNormal : DeepEPMode::kLowLatency;
}

DeepEPMode resolve_deepep_mode(DeepEPMode mode, ForwardMode step_mode) noexcept {
  return resolve_deepep_mode(mode, is_extend(step_mode));
}

}  // namespace epx
