#include "ep/call_shape.h"

#include <fmt/format.h>

namespace epx::ep {
namespace {

// [bit, bit + width) of the word.
struct Field {
  int bit, width;
  uint64_t put(uint64_t v) const {
    const uint64_t max = (uint64_t{1} << width) - 1;
    return (v < max ? v : max) << bit;
  }
  uint64_t get(uint64_t word) const { return (word >> bit) & ((uint64_t{1} << width) - 1); }
};

constexpr Field kKind{0, 2},  // kCallKindMask
    kXDtype{2, 4}, kScalesDtype{6, 4}, kTopk{10, 5}, kTopkInt64{15, 1}, kWeights{16, 1}, kFixedRows{17, 1},
    kCaptured{18, 1}, kExperts{19, 14}, kScaleColumns{33, 14}, kHidden{47, 17};

uint64_t clamp(int64_t v) { return v > 0 ? static_cast<uint64_t>(v) : 0; }

}  // namespace

uint64_t encode_call_shape(const NormalCallShape& s) {
  return kKind.put(static_cast<uint64_t>(s.kind)) | kXDtype.put(static_cast<uint64_t>(s.x_dtype) + 1) |
         kScalesDtype.put(s.scales_dtype ? static_cast<uint64_t>(*s.scales_dtype) + 1 : 0) |
         kTopk.put(clamp(s.num_topk)) | kTopkInt64.put(s.topk_int64) | kWeights.put(s.has_weights) |
         kFixedRows.put(s.fixed_rows) | kCaptured.put(s.captured) | kExperts.put(clamp(s.num_experts)) |
         kScaleColumns.put(clamp(s.scale_columns)) | kHidden.put(clamp(s.hidden));
}

std::string describe_call_shape(uint64_t word) {
  auto dtype = [](uint64_t code) {
    return code == 0 ? std::string("?") : std::string(to_string(static_cast<DType>(code - 1)));
  };
  const uint64_t kind = kKind.get(word);
  std::string out = kind == 1 ? "fresh dispatch" : kind == 2 ? "cached dispatch" : kind == 3 ? "combine" : "?";
  out += fmt::format(": x {} [*, {}]", dtype(kXDtype.get(word)), kHidden.get(word));
  if (kScalesDtype.get(word) != 0) {
    out += fmt::format(", x_scales {} [*, {}]", dtype(kScalesDtype.get(word)), kScaleColumns.get(word));
  }
  if (kind == 1) {
    out += fmt::format(", topk_idx {} [*, {}]", kTopkInt64.get(word) != 0 ? "int64" : "int32", kTopk.get(word));
  }
  if (kWeights.get(word) != 0) out += fmt::format(", topk_weights [*, {}]", kTopk.get(word));
  if (kind == 1) out += fmt::format(", {} experts", kExperts.get(word));
  if (kFixedRows.get(word) != 0) out += ", num_worst_tokens > 0";
  if (kCaptured.get(word) != 0) out += ", captured";
  return out;
}

}  // namespace epx::ep
