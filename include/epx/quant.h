// Number formats on the host: bf16 and fp8 e4m3 conversion, and per-token fp8 quantization with one
// scale per 128 channels (fp32 scales, or UE8M0 power-of-two scales stored as a uint8 exponent).
// Used by the host backend, the tests and the benchmarks; the CUDA kernels implement the same rules.
#pragma once

#include <cstdint>

#include "epx/tensor.h"

namespace epx {

inline constexpr int kFp8BlockSize = 128;    // channels per scale
inline constexpr float kFp8E4M3Max = 448.f;  // largest finite e4m3fn value

// Round-to-nearest-even; NaN stays NaN.
uint16_t float_to_bf16(float value) noexcept;
float bf16_to_float(uint16_t bits) noexcept;

// Round-to-nearest-even with saturation to +-448 (the e4m3fn convention of the quantizers);
// NaN maps to the e4m3fn NaN (0x7f / 0xff).
uint8_t float_to_fp8_e4m3(float value) noexcept;
float fp8_e4m3_to_float(uint8_t bits) noexcept;

// Per block of 128 channels: amax = max(|x|, 1e-4 floor); the stored value is q = fp8(x * scale_inv),
// and x ~= float(q) * scale. Host and device use exactly this arithmetic, so results are bit-exact.
enum class ScaleFormat : uint8_t {
  kFloat32,  // scale = amax / 448, scale_inv = 448 / amax (each one fp32 operation)
  kUE8M0,    // scale = 2^ceil(log2(amax / 448)), stored as the biased exponent (uint8); scale_inv = 1 / scale
};
float ue8m0_to_float(uint8_t exponent) noexcept;
// The smallest power of two >= `scale`, as a biased exponent (saturates to [1, 254]).
uint8_t float_to_ue8m0(float scale) noexcept;

// x: bf16 [T, H] on the CPU, H % 128 == 0. out: fp8 [T, H]. scales: fp32 or uint8 [T, H / 128].
void quantize_fp8_host(const TensorView& x, const TensorView& out, const TensorView& scales, ScaleFormat format);
// fp8 [T, H] + scales -> bf16 [T, H] (or fp32 [T, H]).
void dequantize_fp8_host(const TensorView& x, const TensorView& scales, const TensorView& out);

// The worst relative error per element of a quantize/dequantize round trip, relative to the block's
// amax: half an e4m3 ulp at the top binade (2^-4) for fp32 scales; UE8M0 rounds the scale up by
// at most 2x, so the bound doubles.
inline constexpr float kFp8RoundTripRelError = 1.f / 16.f;

}  // namespace epx
