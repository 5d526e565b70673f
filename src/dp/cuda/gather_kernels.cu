// Kernels of the CUDA DP gather.
#include <algorithm>
#include <cstdint>

#include "core/bf16.h"
#include "dp/cuda/gather_kernels.h"

namespace epx::cuda {

namespace {

__device__ __forceinline__ uint32_t add_zero_bf16x2(uint32_t v) {
  uint32_t out = 0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const auto x = static_cast<uint16_t>((v >> (16 * half)) & 0xffffu);
    out |= static_cast<uint32_t>(detail::bf16_add_zero(x)) << (16 * half);
  }
  return out;
}

__device__ __forceinline__ uint32_t add_zero_f32(uint32_t x) {
  if (x == 0x80000000u) return 0;
  if ((x & 0x7fffffffu) > 0x7f800000u) return x | 0x00400000u;
  return x;
}

// 16 bytes per thread per step; `num_vec` uint4 words.
__global__ void add_zero_copy_vec(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t num_vec,
                                  bool is_bf16) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_vec; i += stride) {
    uint4 v = src[i];
    if (is_bf16) {
      v = {add_zero_bf16x2(v.x), add_zero_bf16x2(v.y), add_zero_bf16x2(v.z), add_zero_bf16x2(v.w)};
    } else {
      v = {add_zero_f32(v.x), add_zero_f32(v.y), add_zero_f32(v.z), add_zero_f32(v.w)};
    }
    dst[i] = v;
  }
}

__global__ void add_zero_copy_scalar(const void* src, void* dst, int64_t num_elems, bool is_bf16) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_elems; i += stride) {
    if (is_bf16) {
      const uint32_t x = static_cast<const uint16_t*>(src)[i];
      static_cast<uint16_t*>(dst)[i] = static_cast<uint16_t>(add_zero_bf16x2(x) & 0xffffu);
    } else {
      static_cast<uint32_t*>(dst)[i] = add_zero_f32(static_cast<const uint32_t*>(src)[i]);
    }
  }
}

}  // namespace

cudaError_t launch_add_zero_copy(const void* src, void* dst, int64_t num_elems, bool is_bf16, cudaStream_t stream) {
  if (num_elems <= 0) return cudaSuccess;
  const int64_t elem_bytes = is_bf16 ? 2 : 4;
  const int64_t bytes = num_elems * elem_bytes;
  constexpr int kThreads = 256;
  constexpr int64_t kMaxBlocks = 1024;
  const bool aligned =
      (reinterpret_cast<uintptr_t>(src) % 16 == 0) && (reinterpret_cast<uintptr_t>(dst) % 16 == 0) && bytes % 16 == 0;
  if (aligned) {
    const int64_t num_vec = bytes / 16;
    const int64_t blocks = std::min<int64_t>((num_vec + kThreads - 1) / kThreads, kMaxBlocks);
    add_zero_copy_vec<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        static_cast<const uint4*>(src), static_cast<uint4*>(dst), num_vec, is_bf16);
  } else {
    const int64_t blocks = std::min<int64_t>((num_elems + kThreads - 1) / kThreads, kMaxBlocks);
    add_zero_copy_scalar<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(src, dst, num_elems, is_bf16);
  }
  return cudaGetLastError();
}

}  // namespace epx::cuda
