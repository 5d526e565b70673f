#include "epx/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/bf16.h"
#include "core/check.h"

namespace epx {

uint16_t float_to_bf16(float value) noexcept { return detail::float_to_bf16(value); }

float bf16_to_float(uint16_t bits) noexcept { return detail::bf16_to_float(bits); }

uint8_t float_to_fp8_e4m3(float value) noexcept {
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  if (std::isnan(value)) return sign | 0x7f;
  const float a = std::fabs(value);
  if (a >= kFp8E4M3Max) return sign | 0x7e;
  if (a < 0x1p-6f) {  // subnormal: multiples of 2^-9
    const auto q = static_cast<uint8_t>(std::nearbyint(a * 0x1p9f));
    return sign | q;  // q == 8 is the smallest normal, encoded the same way
  }
  int e = 0;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int exponent = e - 1;               // a = (2m) * 2^exponent, 2m in [1, 2)
  auto q = static_cast<int>(std::nearbyint((2.f * m - 1.f) * 8.f));
  if (q == 8) {
    q = 0;
    ++exponent;
  }
  const int bits = ((exponent + 7) << 3) | q;
  return sign | static_cast<uint8_t>(std::min(bits, 0x7e));
}

float fp8_e4m3_to_float(uint8_t bits) noexcept {
  const float sign = (bits & 0x80) ? -1.f : 1.f;
  const int exponent = (bits >> 3) & 0xf;
  const int mantissa = bits & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::nanf("");
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
  return sign * std::ldexp(1.f + static_cast<float>(mantissa) / 8.f, exponent - 7);
}

float ue8m0_to_float(uint8_t exponent) noexcept { return std::ldexp(1.f, static_cast<int>(exponent) - 127); }

uint8_t float_to_ue8m0(float scale) noexcept {
  int e = 0;
  const float m = std::frexp(scale, &e);   // scale = m * 2^e, m in [0.5, 1)
  int exponent = (m == 0.5f) ? e - 1 : e;  // ceil(log2(scale))
  return static_cast<uint8_t>(std::clamp(exponent + 127, 1, 254));
}

namespace {

void check_quant_shapes(const TensorView& x8, const TensorView& scales, const char* x_name) {
  const int64_t num_tokens = x8.shape[0];
  const int64_t hidden = x8.shape[1];
  EPX_CHECK_ARG(hidden % kFp8BlockSize == 0, "{} hidden size must be a multiple of {}, got {}", x_name, kFp8BlockSize,
                hidden);
  check_tensor(scales, "scales", {DType::kFloat32, DType::kUInt8}, {num_tokens, hidden / kFp8BlockSize});
  check_device(scales, "scales", Device::cpu());
}

}  // namespace

void quantize_fp8_host(const TensorView& x, const TensorView& out, const TensorView& scales, ScaleFormat format) {
  check_tensor(x, "x", DType::kBFloat16, {-1, -1});
  check_device(x, "x", Device::cpu());
  check_tensor(out, "out", DType::kFloat8E4M3, {x.shape[0], x.shape[1]});
  check_device(out, "out", Device::cpu());
  check_quant_shapes(x, scales, "x");
  EPX_CHECK_ARG((format == ScaleFormat::kUE8M0) == (scales.dtype == DType::kUInt8),
                "scales must be uint8 for UE8M0 and fp32 for fp32 scales, got {}", scales.describe());
  const int64_t hidden = x.shape[1];
  const auto* src = x.data_as<const uint16_t>();
  auto* dst = out.data_as<uint8_t>();
  for (int64_t t = 0; t < x.shape[0]; ++t) {
    for (int64_t b = 0; b < hidden / kFp8BlockSize; ++b) {
      const int64_t base = t * hidden + b * kFp8BlockSize;
      float amax = 1e-4f;
      for (int i = 0; i < kFp8BlockSize; ++i) amax = std::max(amax, std::fabs(bf16_to_float(src[base + i])));
      float scale_inv = 0.f;
      const int64_t s = t * (hidden / kFp8BlockSize) + b;
      if (format == ScaleFormat::kFloat32) {
        scales.data_as<float>()[s] = amax / kFp8E4M3Max;
        scale_inv = kFp8E4M3Max / amax;
      } else {
        const uint8_t e = float_to_ue8m0(amax / kFp8E4M3Max);
        scales.data_as<uint8_t>()[s] = e;
        scale_inv = 1.f / ue8m0_to_float(e);
      }
      for (int i = 0; i < kFp8BlockSize; ++i)
        dst[base + i] = float_to_fp8_e4m3(bf16_to_float(src[base + i]) * scale_inv);
    }
  }
}

void dequantize_fp8_host(const TensorView& x, const TensorView& scales, const TensorView& out) {
  check_tensor(x, "x", DType::kFloat8E4M3, {-1, -1});
  check_device(x, "x", Device::cpu());
  check_tensor(out, "out", {DType::kBFloat16, DType::kFloat32}, {x.shape[0], x.shape[1]});
  check_device(out, "out", Device::cpu());
  check_quant_shapes(x, scales, "x");
  const int64_t hidden = x.shape[1];
  const int64_t num_blocks = hidden / kFp8BlockSize;
  for (int64_t t = 0; t < x.shape[0]; ++t) {
    for (int64_t c = 0; c < hidden; ++c) {
      const int64_t s = t * num_blocks + c / kFp8BlockSize;
      const float scale = scales.dtype == DType::kFloat32 ? scales.data_as<const float>()[s]
                                                          : ue8m0_to_float(scales.data_as<const uint8_t>()[s]);
      const float v = fp8_e4m3_to_float(x.data_as<const uint8_t>()[t * hidden + c]) * scale;
      if (out.dtype == DType::kFloat32) {
        out.data_as<float>()[t * hidden + c] = v;
      } else {
        out.data_as<uint16_t>()[t * hidden + c] = float_to_bf16(v);
      }
    }
  }
}

}  // namespace epx
