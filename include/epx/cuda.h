// CUDA groups: how ranks of the cuda backend find each other and share peer memory.
//
// Two process models:
//   one process per GPU (production: torchrun, mpirun): create_cuda_group(comm) on an existing NCCL
//     communicator. Group collectives (barrier, all_gather_bytes) run on NCCL; Buffer peer memory is
//     shared through CUDA IPC handles exchanged with all_gather_bytes.
//   one process, one thread per rank (tests, `epx bench`, the CLI): create_cuda_groups(devices). Ranks
//     may share a GPU (4 ranks on 2 GPUs); collectives are host rendezvous, peer memory is plain
//     device pointers with peer access enabled. NCCL is not needed.
// Every rank's buffer needs load/store access to every other rank's GPU: GPUs without peer access
// make Buffer::create throw Error(kUnsupported) naming the pair.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "epx/group.h"

typedef struct ncclComm* ncclComm_t;  // NOLINT: the same typedef as nccl.h

namespace epx {

struct CudaGroupOptions {
  // Budget for every wait on a peer (host collectives and device-side waits), in milliseconds, >= 1. Values
  // above kMaxTimeoutMs (100 years, epx/group.h), e.g. INT64_MAX for "wait forever", are clamped to it when
  // the group is created; Group::timeout_ms() returns the clamped value.
  int64_t timeout_ms = 60'000;
  // Ranks per node of the group's Topology (Group::topology()): 0 puts every rank on one node; else in
  // [1, num_ranks] and a divisor of num_ranks (num_nodes = num_ranks / gpus_per_node), kInvalidArgument naming
  // gpus_per_node and num_ranks otherwise. Ranks are numbered node-major. With more than one node the normal
  // dispatch/combine take the hierarchical path (BufferOptions::normal_routing, docs/internode.md). Ranks of
  // one process (create_cuda_groups) may declare several nodes too: the node boundary then only decides the
  // routing, as for host groups.
  int gpus_per_node = 0;
};

// One group per entry of `devices` (CUDA ordinals, repeats allowed; 1 to 128 entries). Hand groups[r] to
// the thread that plays rank r; that thread's CUDA calls go to devices[r] (epx sets the device itself). A Buffer
// on more than 8 ranks takes the hierarchical normal routing (BufferOptions::normal_routing kAuto, also on one node;
// kFlat is refused there; docs/internode.md), and above 64 ranks has no normal path (low-latency only).
// Throws kInvalidArgument for a bad ordinal or count, kUnsupported when there is no CUDA driver or GPU.
std::vector<std::shared_ptr<Group>> create_cuda_groups(const std::vector<int>& devices,
                                                       const CudaGroupOptions& options = {});

// A group over an existing NCCL communicator (one rank per GPU). The communicator must outlive the
// group and must not be used concurrently with the group's collectives from another thread. The rank's
// device is the communicator's. Throws kNcclError if the communicator cannot be queried, kUnsupported if
// NCCL cannot be loaded (epx loads libnccl.so.2, or $EPX_NCCL_LIBRARY, on first use; see the README).
// After a timeout or an NCCL error in one of the group's NCCL calls the group fails for good: epx never aborts the
// caller's communicator, the caller must (ncclCommAbort), then destroy the group and its buffers. The unique-id form
// below recovers instead.
std::shared_ptr<Group> create_cuda_group(ncclComm_t comm, const CudaGroupOptions& options = {});

// NCCL's unique id (ncclGetUniqueId) as bytes (NCCL_UNIQUE_ID_BYTES of them). Draw it on one rank and hand
// it to every rank over any channel (a torch process group, MPI, a file) for create_cuda_group below.
// Throws kUnsupported if NCCL cannot be loaded, kNcclError if the call fails.
std::vector<uint8_t> nccl_unique_id();

// A group that creates and owns its NCCL communicator: ncclCommInitRank(num_ranks, unique_id, rank) on
// `device`, collective over the num_ranks processes that pass the same id. The communicator is non-blocking, so
// every wait on it is bounded by timeout_ms, and it is destroyed with the group.
// After a failure (a collective that times out, an NCCL error) the call that saw it throws, having revoked the
// communicator (ncclCommRevoke ends the NCCL work in flight; that call's outputs are invalid), and the group's next
// collective call on every rank rebuilds it (ncclCommSplit: the same ranks, a fresh communicator): the group and its
// buffers are usable again. That next call must come on every rank within 2 x timeout_ms of each other; if it does not
// (a rank is gone), or NCCL cannot revoke (older than 2.28.7), the group fails for good: the call throws kTimeout or
// kNcclError and every later collective kPeerFailure. CUDA graphs captured before a rebuild hold the old, freed
// communicator: never replay them, capture them again (docs/reliability.md, "NCCL groups after a failure").
// Throws kInvalidArgument for an id of the wrong size, a rank outside [0, num_ranks) or a
// bad device; kNcclError when NCCL fails; kUnsupported when NCCL or the driver cannot be loaded.
std::shared_ptr<Group> create_cuda_group(const std::vector<uint8_t>& unique_id, int rank, int num_ranks, int device,
                                         const CudaGroupOptions& options = {});

}  // namespace epx
