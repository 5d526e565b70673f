// A Group is one rank's membership in a set of ranks that run expert parallelism together.
//
// Backends:
//   host: ranks are threads of one process sharing memory (create_host_groups). Every rank's thread
//         must make the same sequence of collective calls.
//   cuda: one rank per GPU, bootstrapped from an existing NCCL communicator (see cuda.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "epx/tensor.h"

namespace epx {

enum class Backend : uint8_t { kHost, kCuda };
const char* to_string(Backend backend) noexcept;

// The longest wait budget a group keeps: 100 years, in milliseconds. Larger timeouts (INT64_MAX meaning
// "wait forever") are clamped to it when a group is created, so that deadlines (now + timeout) and the
// conversions to nanoseconds or clock cycles cannot overflow.
inline constexpr int64_t kMaxTimeoutMs = int64_t{100} * 365 * 24 * 3600 * 1000;  // 3'153'600'000'000

// Where a group's ranks sit: num_nodes machines of gpus_per_node ranks each, numbered node-major, so rank =
// node * gpus_per_node + local_rank. Ranks of one node reach each other over NVLink (the host backend: shared
// memory); ranks of different nodes only over the network. The hierarchical normal path (docs/internode.md)
// routes by it; everything else sees one flat set of num_ranks() ranks.
struct Topology {
  int num_nodes = 1;
  int gpus_per_node = 1;

  int num_ranks() const { return num_nodes * gpus_per_node; }
  int node_of(int rank) const { return rank / gpus_per_node; }
  int local_rank_of(int rank) const { return rank % gpus_per_node; }
  int rank_of(int node, int local_rank) const { return node * gpus_per_node + local_rank; }
};

class Group {
 public:
  virtual ~Group() = default;
  virtual int rank() const = 0;
  virtual int num_ranks() const = 0;
  virtual Backend backend() const = 0;
  // Where this rank's tensors live: the CPU for host groups, cuda:i for CUDA groups.
  virtual Device device() const = 0;
  // Budget for every wait on a peer, in milliseconds.
  virtual int64_t timeout_ms() const = 0;
  // The ranks' placement on nodes; topology().num_ranks() == num_ranks(). Default: one node holding every rank
  // (host groups take it from HostGroupOptions::gpus_per_node, cuda groups from CudaGroupOptions::gpus_per_node).
  virtual Topology topology() const { return Topology{1, num_ranks()}; }

  // Blocks until every rank arrived. Throws Error(kTimeout) naming the ranks that did not arrive.
  virtual void barrier() = 0;
  // Every rank contributes `bytes` from `send` (host memory); `recv` (host memory, num_ranks * bytes)
  // receives them in rank order. Blocks like barrier(); throws kTimeout likewise.
  virtual void all_gather_bytes(const void* send, void* recv, size_t bytes) = 0;
};

struct HostGroupOptions {
  // Budget for every wait on a peer (>= 1). Values above 100 years (e.g. INT64_MAX for "wait forever")
  // are clamped to 100 years; Group::timeout_ms() returns the clamped value.
  int64_t timeout_ms = 60'000;
  // Ranks per node of the group's Topology: 0 puts every rank on one node; else in [1, num_ranks] and a divisor
  // of num_ranks (num_nodes = num_ranks / gpus_per_node). The threads still share memory: the node boundary
  // only decides which path the normal dispatch/combine take (BufferOptions::normal_routing).
  int gpus_per_node = 0;
};

// Creates the groups of `num_ranks` thread ranks (1 <= num_ranks <= 1024). Hand groups[r] to the
// thread that plays rank r. Throws kInvalidArgument naming the argument and the bound.
std::vector<std::shared_ptr<Group>> create_host_groups(int num_ranks, const HostGroupOptions& options = {});

// Runs fn(rank, group) on one thread per group, joins them all and rethrows the first exception
// (by rank order). Convenient for tests, benchmarks and the CLI.
void run_host_ranks(const std::vector<std::shared_ptr<Group>>& groups,
                    const std::function<void(int rank, Group& group)>& fn);

}  // namespace epx
