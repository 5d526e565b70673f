// Private side of the CUDA groups: what the cuda Buffer needs beyond the public Group interface.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "epx/cuda.h"
#include "epx/error.h"

namespace epx::cuda {

// Ranks a CudaWorld has room for (more than any CUDA group on one host holds).
inline constexpr int kWorldMaxRanks = 64;

// State shared by the ranks of one buffer: a rank that hit a timeout bumps reset_generation so that every
// rank's next collective call resets the buffer's signals first, meeting the others through reset_step
// (docs/reliability.md, "Reset after a timeout"). The meeting goes through this memory, not through the
// group's collectives: a rank that comes to it late must not make the group's NCCL communicator time out
// (which aborts it for good). One object per buffer (share_world): in the process for ranks as threads; in
// POSIX shared memory for one process per GPU (map_shared_world).
// NOTE: only lock-free atomics, so the object works the same when several processes map it.
struct CudaWorld {
  std::atomic<uint64_t> reset_generation{0};
  // Rank r's progress through the reset to generation g: 2g - 1 once no kernel of r runs on the old signals,
  // 2g once r zeroed its own signals. Only rank r writes reset_step[r]; it only grows.
  std::atomic<uint64_t> reset_step[kWorldMaxRanks] = {};
  // The last call a rank left before it started (invalid arguments): (generation << 32) | (call number & 0xffffffff)
  // in that rank's numbering, and the rank. A peer that comes to the same call later raises kPeerFailure at once.
  std::atomic<uint64_t> aborted_call{0};
  std::atomic<int32_t> abort_rank{-1};
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "CudaWorld must work across processes");

class CudaGroup : public Group {
 public:
  Backend backend() const override { return Backend::kCuda; }
  // True when all ranks are threads of this process (peer memory is plain device pointers).
  virtual bool single_process() const = 0;
  // The NCCL communicator of a group of one process per GPU (create_cuda_group), null for ranks as threads, and null
  // while an owned communicator waits for its rebuild or after it failed for good. Not collective; for an NCCL call
  // take collective_comm() instead.
  virtual ncclComm_t nccl_comm() const { return nullptr; }
  // The communicator for an NCCL call that every rank of the group makes at this point of its call sequence (the
  // hierarchical exchange, net_leg.h; the EPLB NCCL transport). Collective when the group's owned communicator was
  // revoked by a failure: it is rebuilt first (see fail()), which waits for every rank for up to twice the group's
  // timeout and throws kTimeout (or kNcclError) when that fails, the group then failed for good. Throws kPeerFailure
  // when the group failed for good earlier. Ranks as threads: null (they have no communicator).
  virtual ncclComm_t collective_comm() { return nullptr; }
  // Owned communicators rebuilt after a failure so far (0 for other groups), and whether one waits for its rebuild.
  virtual int nccl_rebuilds() const { return 0; }
  virtual bool nccl_rebuild_pending() const { return false; }
  // For waits on the group's communicator outside the group (the hierarchical exchange, net_leg.h): handles the
  // failure and throws Error(code) "cuda rank R: <what>; <what happens next>". The outputs of the failed call are
  // invalid on every rank.
  // - A group of one process per GPU that owns its communicator (create_cuda_group(unique_id, ...)) revokes it
  //   (ncclCommRevoke ends its NCCL kernels in flight on every stream, so streams waiting on them drain) and rebuilds
  //   it in its next collective (collective_comm(), all_gather_bytes, barrier), which every rank must reach within
  //   twice the timeout of each other; then the group and its buffers are usable again. Where NCCL cannot revoke
  //   (older than 2.28.7) or the revoke does not quiesce, the communicator is aborted and the group fails for good:
  //   every later collective raises kPeerFailure (docs/reliability.md, "NCCL groups after a failure").
  // - A borrowed communicator (create_cuda_group(comm)) is left to its owner, who must abort it; the group fails for
  //   good.
  // - Ranks as threads have no communicator: this only throws, and the group stays usable.
  [[noreturn]] virtual void fail(ErrorCode code, const std::string& what);
};

// Checks CudaGroupOptions::gpus_per_node against num_ranks (the wording of HostGroupOptions::gpus_per_node) and
// returns the topology it gives.
Topology cuda_group_topology(int num_ranks, int gpus_per_node);

// Collective over `group`: one new CudaWorld that every rank of the group shares (rank 0 makes it and the
// others take a reference when the ranks are threads; map_shared_world otherwise). Null on every rank alike
// when the processes cannot share memory.
std::shared_ptr<CudaWorld> share_world(CudaGroup& group);

// Collective over `group` (two all-gathers): a CudaWorld in POSIX shared memory that every rank's process maps,
// for groups of one process per GPU on one host. Rank 0 creates it and unlinks its name once every rank mapped
// it, so nothing is left behind. Null on every rank alike when any rank cannot map it (ranks on different hosts,
// no /dev/shm); the buffer then cannot reset after a timeout and says so.
std::shared_ptr<CudaWorld> map_shared_world(Group& group);

}  // namespace epx::cuda
