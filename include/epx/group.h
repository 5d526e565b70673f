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
};

// Creates the groups of `num_ranks` thread ranks (1 <= num_ranks <= 1024). Hand groups[r] to the
// thread that plays rank r.
std::vector<std::shared_ptr<Group>> create_host_groups(int num_ranks, const HostGroupOptions& options = {});

// Runs fn(rank, group) on one thread per group, joins them all and rethrows the first exception
// (by rank order). Convenient for tests, benchmarks and the CLI.
void run_host_ranks(const std::vector<std::shared_ptr<Group>>& groups,
                    const std::function<void(int rank, Group& group)>& fn);

}  // namespace epx
