// Lazily created NCCL communicators for DP attention (see src/dp/cuda/comm.h).
#include "dp/cuda/comm.h"

#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "comm/cuda/nccl_loader.h"
#include "core/check.h"
#include "core/cuda/cuda_util.h"
#include "core/timeout.h"
#include "dp/backends.h"

namespace epx::cuda {

namespace {

struct Entry {
  int rank = 0;
  int num_ranks = 0;
  DpComm dp;
};

// NOTE: deliberately leaked: communicators must not be torn down by static destructors, after the
// CUDA runtime may already be gone.
std::mutex& registry_mutex() {
  static auto* m = new std::mutex;
  return *m;
}
std::map<const Group*, std::unique_ptr<Entry>>& registry() {
  static auto* r = new std::map<const Group*, std::unique_ptr<Entry>>;
  return *r;
}

std::unique_ptr<Entry> create_entry(Group& group) {
  auto entry = std::make_unique<Entry>();
  entry->rank = group.rank();
  entry->num_ranks = group.num_ranks();
  DpComm& dp = entry->dp;
  dp.device = group.device().index;
  // NOTE: clamped here too: a Group implemented outside epx may return INT64_MAX ("wait forever").
  dp.timeout_ms = detail::clamp_timeout_ms(group.timeout_ms());
  ncclUniqueId id{};
  if (group.rank() == 0) {
    const ncclResult_t res = nccl().GetUniqueId(&id);
    if (res != ncclSuccess) std::memset(&id, 0, sizeof(id));  // peers see an all-zero id and fail alike
  }
  std::vector<ncclUniqueId> ids(static_cast<size_t>(group.num_ranks()));
  group.all_gather_bytes(&id, ids.data(), sizeof(id));
  static const ncclUniqueId kZero{};
  EPX_CHECK(ErrorCode::kNcclError, std::memcmp(&ids[0], &kZero, sizeof(kZero)) != 0,
            "DP communicator: ncclGetUniqueId failed on rank 0");
  DeviceGuard guard(dp.device);
  // NOTE: a blocking communicator. A nonblocking one would bound this init by a deadline, but NCCL then
  // launches every collective from a helper thread: about 80 us more per call on 2x H200 (measured),
  // over the whole metadata budget. The id exchange above is bounded by the group's timeout, and every
  // rank that passed it calls the init right away.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  ncclResult_t res = nccl().CommInitRankConfig(&dp.comm, group.num_ranks(), ids[0], group.rank(), &config);
  try {
    nccl_wait(dp, res, "ncclCommInitRankConfig (DP communicator)");
  } catch (...) {
    if (dp.comm != nullptr) nccl().CommAbort(dp.comm);
    throw;
  }
  check_cuda(cudaStreamCreateWithFlags(&dp.meta_stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return entry;
}

}  // namespace

void nccl_wait(const DpComm& dp, ncclResult_t result, const char* what) {
  if (result == ncclSuccess) return;
  if (result != ncclInProgress) {
    detail::raise(ErrorCode::kNcclError, "{} failed: {}", what, nccl().GetErrorString(result));
  }
  const auto deadline = detail::deadline_after_ms(dp.timeout_ms);
  while (true) {
    ncclResult_t state = ncclInProgress;
    nccl().CommGetAsyncError(dp.comm, &state);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      detail::raise(ErrorCode::kNcclError, "{} failed: {}", what, nccl().GetErrorString(state));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      detail::raise(ErrorCode::kTimeout, "{}: the peers did not join within {} ms", what, dp.timeout_ms);
    }
    std::this_thread::yield();
  }
}

DpComm& dp_comm(Group& group) {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(&group);
    if (it != registry().end()) {
      const Entry& e = *it->second;
      if (e.rank == group.rank() && e.num_ranks == group.num_ranks() && e.dp.device == group.device().index) {
        EPX_CHECK(ErrorCode::kPeerFailure, e.dp.failed.empty(),
                  "cuda rank {}: the DP communicator of this group failed earlier ({}) and cannot be used again: "
                  "destroy the group and create a new one on every rank",
                  group.rank(), e.dp.failed);
        return it->second->dp;
      }
      // A different group at a recycled address: its communicator belongs to a group that is gone.
      if (it->second->dp.comm != nullptr) nccl().CommAbort(it->second->dp.comm);
      registry().erase(it);
    }
  }
  // NOTE: created outside the lock: every rank thread of this process bootstraps at the same time.
  std::unique_ptr<Entry> entry = create_entry(group);
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& slot = registry()[&group];
  slot = std::move(entry);
  return slot->dp;
}

namespace {
// The group's entry when it is this group's (rank, size, device), else null. Under registry_mutex().
Entry* entry_of(Group& group) {
  auto it = registry().find(&group);
  if (it == registry().end() || it->second == nullptr) return nullptr;
  Entry* e = it->second.get();
  const bool same =
      e->rank == group.rank() && e->num_ranks == group.num_ranks() && e->dp.device == group.device().index;
  return same ? e : nullptr;
}
}  // namespace

void dp_note_joined_failure_cuda(Group& group) noexcept {
  try {
    std::lock_guard<std::mutex> lock(registry_mutex());
    if (Entry* e = entry_of(group)) ++e->dp.joined_failures;
  } catch (...) {
  }
}

int64_t dp_take_joined_failures_cuda(Group& group) noexcept {
  try {
    std::lock_guard<std::mutex> lock(registry_mutex());
    Entry* e = entry_of(group);
    if (e == nullptr) return 0;
    const int64_t n = e->dp.joined_failures;
    e->dp.joined_failures = 0;
    return n;
  } catch (...) {
    return 0;
  }
}

void dp_abandon_cuda(Group& group, const std::string& reason) noexcept {
  try {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto& slot = registry()[&group];
    if (slot == nullptr || slot->rank != group.rank() || slot->num_ranks != group.num_ranks() ||
        slot->dp.device != group.device().index) {
      // NOTE: no communicator yet (or one of a group at a recycled address): an entry without one, failed, so this
      // rank does not bootstrap one with the peers' next call either.
      if (slot != nullptr && slot->dp.comm != nullptr) nccl().CommAbort(slot->dp.comm);
      slot = std::make_unique<Entry>();
      slot->rank = group.rank();
      slot->num_ranks = group.num_ranks();
      slot->dp.device = group.device().index;
    }
    if (slot->dp.failed.empty()) slot->dp.failed = reason;
  } catch (...) {  // out of memory: nothing better to do than leave the registry as it was
  }
}

}  // namespace epx::cuda
