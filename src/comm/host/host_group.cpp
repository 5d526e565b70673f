#include "comm/host/host_group.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <map>
#include <thread>

#include "core/check.h"
#include "core/limits.h"

namespace epx::host {

// What a rank's slot holds for its last collective (arrive_seq).
enum class PostState : uint8_t {
  kPublished,  // ptrs[r] is readable until r releases
  kFailed,     // r failed before it could publish (fail()); reason[r] says why
  kWithdrawn,  // r gave up on the call (a wait timed out) and may have freed what it published
};

class HostWorld {
 public:
  HostWorld(int num_ranks, int64_t timeout_ms, int gpus_per_node)
      : num_ranks(num_ranks),
        timeout_ms(timeout_ms),
        gpus_per_node(gpus_per_node),
        arrive_seq(num_ranks, 0),
        release_seq(num_ranks, 0),
        taken_seq(num_ranks, 0),
        ptrs(num_ranks, nullptr),
        state(num_ranks, PostState::kPublished),
        reason(num_ranks) {}

  const int num_ranks;
  const int64_t timeout_ms;  // clamped by create_host_groups, so the deadline cannot overflow
  const int gpus_per_node;   // divides num_ranks (checked by create_host_groups)
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<uint64_t> arrive_seq;   // last collective each rank published
  std::vector<uint64_t> release_seq;  // last collective each rank released (or left without reading)
  std::vector<uint64_t> taken_seq;    // last collective whose pointers each rank took (it reads until release)
  std::vector<const void*> ptrs;      // pointer of each rank's last published collective
  std::vector<PostState> state;       // of each rank's last collective
  std::vector<std::string> reason;    // of each rank's last fail()
  std::map<std::string, std::shared_ptr<void>> objects;  // see HostGroup::world_object

  // Waits until seqs[r] >= seq for every r not skipped. Returns the ranks still behind at the deadline.
  std::vector<int> wait_for(std::unique_lock<std::mutex>& lock, const std::vector<uint64_t>& seqs, uint64_t seq,
                            const std::vector<bool>* skip) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    cv.wait_until(lock, deadline, [&] { return behind(seqs, seq, skip).empty(); });
    return behind(seqs, seq, skip);
  }

  std::vector<int> behind(const std::vector<uint64_t>& seqs, uint64_t seq, const std::vector<bool>* skip) const {
    std::vector<int> missing;
    for (int r = 0; r < num_ranks; ++r) {
      if ((skip == nullptr || !(*skip)[r]) && seqs[r] < seq) missing.push_back(r);
    }
    return missing;
  }

  // `rank` leaves call `seq` early: no peer may read what it published any more, and none need wait
  // for it to release (it reads nothing more). Caller holds the mutex.
  void withdraw(int rank, uint64_t seq) {
    ptrs[rank] = nullptr;
    state[rank] = PostState::kWithdrawn;
    release_seq[rank] = std::max(release_seq[rank], seq);
    cv.notify_all();
  }
};

HostGroup::HostGroup(std::shared_ptr<HostWorld> world, int rank) : world_(std::move(world)), rank_(rank) {}

int HostGroup::num_ranks() const { return world_->num_ranks; }
int64_t HostGroup::timeout_ms() const { return world_->timeout_ms; }
Topology HostGroup::topology() const {
  return Topology{world_->num_ranks / world_->gpus_per_node, world_->gpus_per_node};
}

namespace {

void report(int rank, const char* phase, uint64_t seq, const std::vector<int>& missing, int64_t timeout_ms,
            std::vector<int>* timed_out) {
  if (missing.empty()) return;
  if (timed_out != nullptr) {
    timed_out->insert(timed_out->end(), missing.begin(), missing.end());
    return;
  }
  detail::raise(ErrorCode::kTimeout, "host rank {} waited {} ms in {} of collective #{} for ranks {}", rank, timeout_ms,
                phase, seq, missing);
}

}  // namespace

std::vector<const void*> HostGroup::exchange(const void* mine, const std::vector<bool>* skip,
                                             std::vector<int>* timed_out) {
  const uint64_t seq = ++seq_;
  HostWorld& w = *world_;
  std::unique_lock lock(w.mutex);
  w.ptrs[rank_] = mine;
  w.state[rank_] = PostState::kPublished;
  w.arrive_seq[rank_] = seq;
  w.cv.notify_all();
  const auto missing = w.wait_for(lock, w.arrive_seq, seq, skip);
  std::vector<const void*> result(w.num_ranks, nullptr);
  std::vector<int> failed, withdrawn;  // peers that failed, or left call `seq` before this rank came
  for (int r = 0; r < w.num_ranks; ++r) {
    if ((skip != nullptr && (*skip)[r]) || w.arrive_seq[r] < seq) continue;
    if (w.arrive_seq[r] > seq || w.state[r] == PostState::kWithdrawn) {
      withdrawn.push_back(r);
    } else if (w.state[r] == PostState::kFailed) {
      failed.push_back(r);
    } else {
      result[r] = w.ptrs[r];
    }
  }
  if (!failed.empty()) {
    // NOTE: every participant sees the flag before it reads anything, so nobody reads in this call.
    // Wait until all have seen it (they release right after), so no slot is reused before then.
    std::string why;
    for (int r : failed) why += fmt::format("{}rank {}: {}", why.empty() ? "" : "; ", r, w.reason[r]);
    w.release_seq[rank_] = seq;
    w.cv.notify_all();
    w.wait_for(lock, w.release_seq, seq, skip);
    w.withdraw(rank_, seq);
    lock.unlock();
    detail::raise(ErrorCode::kPeerFailure, "host rank {}: collective #{} failed on ranks {} ({})", rank_, seq, failed,
                  why);
  }
  if (timed_out == nullptr && (!missing.empty() || !withdrawn.empty())) {
    w.withdraw(rank_, seq);
    lock.unlock();
    report(rank_, "exchange", seq, missing, w.timeout_ms, nullptr);
    detail::raise(ErrorCode::kPeerFailure,
                  "host rank {} arrived at collective #{} after ranks {} had given up on it (their wait timed out)",
                  rank_, seq, withdrawn);
  }
  w.taken_seq[rank_] = seq;
  lock.unlock();
  if (timed_out != nullptr) timed_out->insert(timed_out->end(), withdrawn.begin(), withdrawn.end());
  report(rank_, "exchange", seq, missing, w.timeout_ms, timed_out);
  return result;
}

void HostGroup::release(const std::vector<bool>* skip, std::vector<int>* timed_out) {
  const uint64_t seq = seq_;
  HostWorld& w = *world_;
  std::unique_lock lock(w.mutex);
  w.release_seq[rank_] = seq;
  w.cv.notify_all();
  auto missing = w.wait_for(lock, w.release_seq, seq, skip);
  if (!missing.empty()) {
    // NOTE: a peer that took the pointers of this call and has not released is still reading them:
    // returning would free memory under it. It does no waits between exchange and release (every
    // caller releases right after reading, also when it throws), so this wait ends.
    const auto reading = [&] {
      for (int r : w.behind(w.release_seq, seq, skip)) {
        if (w.taken_seq[r] == seq) return true;
      }
      return false;
    };
    w.cv.wait(lock, [&] { return !reading(); });
    missing = w.behind(w.release_seq, seq, skip);
    if (!missing.empty()) w.withdraw(rank_, seq);
  }
  lock.unlock();
  report(rank_, "release", seq, missing, w.timeout_ms, timed_out);
}

void HostGroup::fail(const std::string& reason, const std::vector<bool>* skip) noexcept {
  const uint64_t seq = ++seq_;
  HostWorld& w = *world_;
  std::unique_lock lock(w.mutex);
  w.ptrs[rank_] = nullptr;
  w.state[rank_] = PostState::kFailed;
  try {
    w.reason[rank_] = reason;
  } catch (...) {
    w.reason[rank_].clear();  // out of memory: peers still learn that this rank failed
  }
  w.arrive_seq[rank_] = seq;
  w.release_seq[rank_] = seq;  // reads nothing
  w.cv.notify_all();
  // Peers release once they have seen the flag; keep the slot until then (or the timeout).
  w.wait_for(lock, w.release_seq, seq, skip);
}

std::shared_ptr<void> HostGroup::world_object(const std::string& key,
                                              const std::function<std::shared_ptr<void>()>& make) {
  std::lock_guard lock(world_->mutex);
  auto& slot = world_->objects[key];
  if (slot == nullptr) slot = make();
  return slot;
}

void HostGroup::barrier() {
  exchange(nullptr);
  release();
}

const void* HostGroup::publish_copy(const void* data, size_t bytes) {
  auto& staging = gather_staging_[gather_next_++ % gather_staging_.size()];
  staging.assign(static_cast<const char*>(data), static_cast<const char*>(data) + bytes);
  return staging.data();
}

void HostGroup::all_gather_bytes(const void* send, void* recv, size_t bytes) {
  EPX_CHECK_ARG(bytes == 0 || (send != nullptr && recv != nullptr), "all_gather_bytes: null buffer for {} bytes",
                bytes);
  // NOTE: publish a copy the group owns, not `send`: if this rank times out and returns, a late peer
  // may still read what it published. Copies rotate, so a peer would have to be 4 calls late to see
  // one reused.
  auto& staging = gather_staging_[gather_next_++ % gather_staging_.size()];
  staging.assign(static_cast<const char*>(send), static_cast<const char*>(send) + bytes);
  const auto ptrs = exchange(staging.data());
  for (int r = 0; r < world_->num_ranks; ++r) {
    if (bytes > 0) std::memcpy(static_cast<char*>(recv) + r * bytes, ptrs[r], bytes);
  }
  release();
}

}  // namespace epx::host

namespace epx {

const char* to_string(Backend backend) noexcept { return backend == Backend::kHost ? "host" : "cuda"; }

std::vector<std::shared_ptr<Group>> create_host_groups(int num_ranks, const HostGroupOptions& options) {
  EPX_CHECK_ARG(num_ranks >= 1 && num_ranks <= kMaxHostGroupRanks, "num_ranks must be in [1, {}], got {}",
                kMaxHostGroupRanks, num_ranks);
  EPX_CHECK_ARG(options.timeout_ms >= 1, "timeout_ms must be >= 1, got {}", options.timeout_ms);
  EPX_CHECK_ARG(options.gpus_per_node >= 0 && options.gpus_per_node <= num_ranks,
                "gpus_per_node must be in [0, num_ranks = {}] (0: one node), got {}", num_ranks, options.gpus_per_node);
  EPX_CHECK_ARG(options.gpus_per_node == 0 || num_ranks % options.gpus_per_node == 0,
                "gpus_per_node = {} must divide num_ranks = {}", options.gpus_per_node, num_ranks);
  const int gpus_per_node = options.gpus_per_node == 0 ? num_ranks : options.gpus_per_node;
  // NOTE: "wait forever" (e.g. INT64_MAX) would overflow now() + timeout in nanoseconds.
  const int64_t timeout_ms = std::min(options.timeout_ms, kMaxTimeoutMs);
  auto world = std::make_shared<host::HostWorld>(num_ranks, timeout_ms, gpus_per_node);
  std::vector<std::shared_ptr<Group>> groups;
  for (int r = 0; r < num_ranks; ++r) groups.push_back(std::make_shared<host::HostGroup>(world, r));
  return groups;
}

void run_host_ranks(const std::vector<std::shared_ptr<Group>>& groups,
                    const std::function<void(int rank, Group& group)>& fn) {
  std::vector<std::exception_ptr> errors(groups.size());
  std::vector<std::thread> threads;
  try {
    threads.reserve(groups.size());
    for (size_t r = 0; r < groups.size(); ++r) {
      threads.emplace_back([&, r] {
        try {
          fn(static_cast<int>(r), *groups[r]);
        } catch (...) {
          errors[r] = std::current_exception();
        }
      });
    }
  } catch (const std::exception& e) {
    // NOTE: joinable threads must not be destroyed (std::terminate). The started ranks' collectives
    // time out waiting for the others, so the joins end.
    for (auto& t : threads) t.join();
    detail::raise(ErrorCode::kOutOfMemory, "run_host_ranks: could create only {} of {} rank threads: {}",
                  threads.size(), groups.size(), e.what());
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace epx
