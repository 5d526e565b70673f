#include <cuda_runtime.h>

#include "core/check.h"
#include "core/cuda_alloc.h"

namespace epx::detail {

std::shared_ptr<void> cuda_allocate(size_t bytes, Device device, Stream stream) {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device.index);
  void* p = nullptr;
  const cudaError_t err = cudaMallocAsync(&p, bytes > 0 ? bytes : 1, stream);
  cudaSetDevice(previous);
  if (err != cudaSuccess) {
    cudaGetLastError();
    raise(err == cudaErrorMemoryAllocation ? ErrorCode::kOutOfMemory : ErrorCode::kCudaError,
          "cudaMallocAsync of {} bytes on cuda:{} failed: {}", bytes, device.index, cudaGetErrorString(err));
  }
  return {p, [stream, device](void* q) {
            int prev = 0;
            cudaGetDevice(&prev);
            cudaSetDevice(device.index);
            cudaFreeAsync(q, stream);
            cudaSetDevice(prev);
          }};
}

}  // namespace epx::detail
