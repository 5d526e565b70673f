// bf16 <-> fp32, written once for the host reference and the CUDA kernels (host C++ and nvcc alike).
//
// Two rounding paths exist, and they differ only for NaN inputs:
// - float_to_bf16 (host and device): round to nearest even; a NaN stays NaN with its sign and the top of its
//   payload, quiet bit set ((bits >> 16) | 0x40). The public epx::float_to_bf16, the host backend, the DP
//   reduce and the normal combine kernel use it, so the host reference and the GPU agree bit for bit.
// - cvt_float2_to_bf16x2 (device only, the low-latency combine): the hardware's cvt.rn.bf16x2.f32, one
//   instruction for two values. The same rounding for every non-NaN input; a NaN becomes the canonical NaN
//   0x7fff (sign and payload dropped).
// bf16 -> fp32 is exact for every non-NaN value on both paths (the shift keeps a NaN's bits as well).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#define EPX_BF16_FN __host__ __device__ __forceinline__
#else
#define EPX_BF16_FN inline
#endif

namespace epx::detail {

// The bits of `from` as a `To` of the same size (std::bit_cast, which C++17 device code lacks); compilers turn
// the copy into a register move.
template <typename To, typename From>
EPX_BF16_FN To bits_as(From from) {
  static_assert(sizeof(To) == sizeof(From), "bits_as: sizes differ");
  To to;
  memcpy(&to, &from, sizeof(to));
  return to;
}

EPX_BF16_FN float bf16_to_float(uint16_t bits) { return bits_as<float>(static_cast<uint32_t>(bits) << 16); }

// Round to nearest even; NaN stays NaN (sign and top payload bits kept, quiet bit set).
EPX_BF16_FN uint16_t float_to_bf16(float value) {
  const uint32_t u = bits_as<uint32_t>(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// value rounded to the nearest bf16 (as float_to_bf16), as an fp32 again.
EPX_BF16_FN float round_to_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }

// Two bf16 packed in 32 bits: element 0 in the low half (the memory order of a bf16 pair).
EPX_BF16_FN float bf16x2_lo(uint32_t pair) { return bits_as<float>(pair << 16); }
EPX_BF16_FN float bf16x2_hi(uint32_t pair) { return bits_as<float>(pair & 0xffff0000u); }
EPX_BF16_FN uint32_t float2_to_bf16x2(float lo, float hi) {
  return static_cast<uint32_t>(float_to_bf16(lo)) | (static_cast<uint32_t>(float_to_bf16(hi)) << 16);
}

// 0 + x in bf16 (what an all-reduce computes where the other ranks contribute zeros): -0 becomes +0 and a
// signalling NaN is quieted; every other value is unchanged.
EPX_BF16_FN uint16_t bf16_add_zero(uint16_t bits) {
  if (bits == 0x8000u) return 0;
  if ((bits & 0x7fffu) > 0x7f80u) return static_cast<uint16_t>(bits | 0x0040u);
  return bits;
}

#if defined(__CUDACC__)
// The hardware conversions (cvt.f32.bf16, cvt.rn.bf16x2.f32): see the top of this file for how the second
// differs from float2_to_bf16x2 on NaN.
__device__ __forceinline__ float2 cvt_bf16x2_to_float2(uint32_t pair) {
  return __bfloat1622float2(bits_as<__nv_bfloat162>(pair));
}
__device__ __forceinline__ uint32_t cvt_float2_to_bf16x2(float lo, float hi) {
  return bits_as<uint32_t>(__floats2bfloat162_rn(lo, hi));
}
#endif

}  // namespace epx::detail

#undef EPX_BF16_FN
