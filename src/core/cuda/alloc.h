// Device allocation for the default allocator (defined in src/core/cuda/alloc.cpp, CUDA builds only).
#pragma once

#include <memory>

#include "epx/tensor.h"

namespace epx::detail {

// cudaMallocAsync on `stream` (stream-ordered, so it can be captured in a CUDA graph); freed with
// cudaFreeAsync on the same stream. Throws kOutOfMemory / kCudaError.
std::shared_ptr<void> cuda_allocate(size_t bytes, Device device, Stream stream);

}  // namespace epx::detail
