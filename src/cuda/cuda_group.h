// Private side of the CUDA groups: what the cuda Buffer needs beyond the public Group interface.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "epx/cuda.h"

namespace epx::cuda {

// State shared by the ranks of one process (create_cuda_groups): a rank that hit a timeout bumps
// reset_generation so that every rank's next collective call resets its buffer's signals first.
struct CudaWorld {
  std::atomic<uint64_t> reset_generation{0};
};

class CudaGroup : public Group {
 public:
  Backend backend() const override { return Backend::kCuda; }
  // True when all ranks are threads of this process (peer memory is plain device pointers).
  virtual bool single_process() const = 0;
  // Shared state of single-process groups; null for NCCL groups.
  virtual CudaWorld* world() const = 0;
};

}  // namespace epx::cuda
