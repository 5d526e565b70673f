// Private side of the CUDA groups: what the cuda Buffer needs beyond the public Group interface.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "epx/cuda.h"

namespace epx::cuda {

// State shared by the ranks of one buffer's group: a rank that hit a timeout bumps reset_generation so that
// every rank's next collective call resets its buffer's signals first. One object in the process for
// create_cuda_groups (ranks as threads); in POSIX shared memory for one process per GPU (map_shared_world).
// NOTE: only lock-free atomics, so the object works the same when several processes map it.
struct CudaWorld {
  std::atomic<uint64_t> reset_generation{0};
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "CudaWorld must work across processes");

class CudaGroup : public Group {
 public:
  Backend backend() const override { return Backend::kCuda; }
  // True when all ranks are threads of this process (peer memory is plain device pointers).
  virtual bool single_process() const = 0;
  // Shared state of single-process groups; null for NCCL groups (see map_shared_world).
  virtual CudaWorld* world() const = 0;
};

// Collective over `group` (two all-gathers): a CudaWorld in POSIX shared memory that every rank's process maps,
// for groups of one process per GPU on one host. Rank 0 creates it and unlinks its name once every rank mapped
// it, so nothing is left behind. Null on every rank alike when any rank cannot map it (ranks on different hosts,
// no /dev/shm); the buffer then cannot reset after a timeout and says so.
std::shared_ptr<CudaWorld> map_shared_world(Group& group);

}  // namespace epx::cuda
