// Backend factories behind Buffer::create (private).
#pragma once

#include <memory>

#include "epx/buffer.h"

namespace epx::host {
// Defined in src/ep/host/host_buffer.cpp.
std::unique_ptr<Buffer> create_host_buffer(std::shared_ptr<Group> group, const BufferOptions& options);
}  // namespace epx::host

namespace epx::cuda {
// Defined in src/ep/cuda/ (CUDA builds only).
std::unique_ptr<Buffer> create_cuda_buffer(std::shared_ptr<Group> group, const BufferOptions& options);
}  // namespace epx::cuda
