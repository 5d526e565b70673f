// Kernels of the CUDA DP gather (private; CUDA builds only).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace epx::cuda {

// dst[i] = 0 + src[i] in the element type (bf16 when is_bf16, else fp32), on the bits: -0 becomes +0
// and a NaN gets its quiet bit, exactly as the host backend's SUM_LEN rows. Returns the launch status.
cudaError_t launch_add_zero_copy(const void* src, void* dst, int64_t num_elems, bool is_bf16, cudaStream_t stream);

}  // namespace epx::cuda
