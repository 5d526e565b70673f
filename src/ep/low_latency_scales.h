// The low-latency fp8 scale options of a dispatch (scale_format, round_scale, scale_layout) turned into what
// travels between ranks and what the receiver returns; shared by the host and cuda backends.
#pragma once

#include <cstdint>
#include <vector>

#include "core/limits.h"
#include "epx/buffer.h"

namespace epx::ep {

struct LowLatencyScales {
  bool wire_ue8m0 = false;    // quantized with power-of-two scales; exponent bytes between ranks, else fp32
  bool out_fp32 = true;       // recv_x_scales fp32 (2^(e - 127) from an exponent), else exponents
  bool column_major = false;  // ScaleLayout::kColumnMajor
  int64_t units = 0;          // per row: H / 128 scales, or H / 512 words of four exponents (column-major UE8M0)
  DType dtype = DType::kFloat32;

  static LowLatencyScales of(const LowLatencyDispatchArgs& args, int64_t hidden) {
    LowLatencyScales s;
    s.wire_ue8m0 = args.scale_format == ScaleFormat::kUE8M0 || args.round_scale;
    s.out_fp32 = args.scale_format == ScaleFormat::kFloat32;
    s.column_major = args.scale_layout == ScaleLayout::kColumnMajor;
    const bool words = !s.out_fp32 && s.column_major;
    s.units = hidden / kFp8BlockSize / (words ? 4 : 1);
    s.dtype = s.out_fp32 ? DType::kFloat32 : words ? DType::kInt32 : DType::kUInt8;
    return s;
  }
  // recv_x_scales' shape for E_local experts of `slots` rows each.
  std::vector<int64_t> shape(int64_t num_local_experts, int64_t slots) const {
    return column_major ? std::vector<int64_t>{num_local_experts, units, slots}
                        : std::vector<int64_t>{num_local_experts, slots, units};
  }
};

}  // namespace epx::ep
