// The NCCL communicator of DP attention on a CUDA group (private; CUDA builds only).
//
// Groups do not expose a communicator (src/comm/cuda/cuda_group.h has no accessor), so the DP code keeps its
// own: created lazily by the first DP collective of a group, on every rank at once, from an
// ncclUniqueId that rank 0 draws and Group::all_gather_bytes hands round (host rendezvous for
// create_cuda_groups, NCCL for create_cuda_group). One process with one thread per GPU works: each
// thread calls ncclCommInitRankConfig for its own rank. The id exchange is bounded by the group's
// timeout; the init itself is blocking (see src/dp/cuda/comm.cpp) and is reached by every rank that got an id.
//
// Lifetime: the communicators live until the process ends; they are keyed by the Group's address and
// checked against its rank, size and device. NOTE: a group destroyed and another created at the same
// address with the same rank, size and device would inherit the old communicator — create DP groups
// once per process (the serving model). With create_cuda_group(comm) this is a second communicator
// next to the caller's; an accessor on CudaGroup would let the DP code use the caller's instead.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "epx/group.h"

namespace epx::cuda {

struct DpComm {
  ncclComm_t comm = nullptr;
  int device = 0;
  int64_t timeout_ms = 0;
  // Batch-metadata sync: a private stream; a mapped pinned host block [num_ranks + 1] records (the
  // gathered records, then this rank's) that NCCL reads and writes directly, so a step costs one
  // collective and no copies; if NCCL refuses host memory (meta_mapped becomes false), a device block of
  // the same layout, allocated then, plus a copy each way.
  cudaStream_t meta_stream = nullptr;
  void* meta_device = nullptr;
  void* meta_host = nullptr;
  size_t meta_record_bytes = 0;
  bool meta_mapped = true;
  // Why the communicator cannot be used again (empty while it can): a batch-metadata all-gather that timed out is
  // still queued on it, owning meta_host, and every later collective of this communicator would queue behind it.
  std::string failed;
  // Rejected calls of this rank that joined their peers' collective since the last metadata sync took the count
  // (dp_note_joined_failure_cuda, dp_take_joined_failures_cuda).
  int64_t joined_failures = 0;
};

// This group's communicator; the first call on a group is collective (every rank must make it).
// Throws kNcclError, kCudaError, kUnsupported when NCCL cannot be loaded (cuda/nccl_loader.h), or
// kTimeout when a peer does not join within the group's timeout; kPeerFailure once DpComm::failed is set.
DpComm& dp_comm(Group& group);

// Raises kNcclError for a failed call. ncclInProgress (only from a nonblocking communicator) is polled
// with ncclCommGetAsyncError until done, bounded by timeout_ms.
void nccl_wait(const DpComm& dp, ncclResult_t result, const char* what);

}  // namespace epx::cuda
