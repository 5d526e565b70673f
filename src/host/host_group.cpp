#include "host/host_group.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <map>
#include <thread>

#include "core/check.h"

namespace epx::host {

class HostWorld {
 public:
  HostWorld(int num_ranks, int64_t timeout_ms)
      : num_ranks(num_ranks), timeout_ms(timeout_ms), arrive_seq(num_ranks, 0), release_seq(num_ranks, 0),
        ptrs(num_ranks, nullptr) {}

  const int num_ranks;
  const int64_t timeout_ms;
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<uint64_t> arrive_seq;   // last collective each rank published
  std::vector<uint64_t> release_seq;  // last collective each rank released
  std::vector<const void*> ptrs;      // pointer of each rank's last published collective
  std::map<std::string, std::shared_ptr<void>> objects;  // see HostGroup::world_object

  // Waits until seqs[r] >= seq for every r not skipped. Returns the ranks still behind at the deadline.
  std::vector<int> wait_for(std::unique_lock<std::mutex>& lock, const std::vector<uint64_t>& seqs, uint64_t seq,
                            const std::vector<bool>* skip) {
    auto behind = [&] {
      std::vector<int> missing;
      for (int r = 0; r < num_ranks; ++r) {
        if ((skip == nullptr || !(*skip)[r]) && seqs[r] < seq) missing.push_back(r);
      }
      return missing;
    };
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    cv.wait_until(lock, deadline, [&] { return behind().empty(); });
    return behind();
  }
};

HostGroup::HostGroup(std::shared_ptr<HostWorld> world, int rank) : world_(std::move(world)), rank_(rank) {}

int HostGroup::num_ranks() const { return world_->num_ranks; }
int64_t HostGroup::timeout_ms() const { return world_->timeout_ms; }

namespace {

void report(int rank, const char* phase, uint64_t seq, const std::vector<int>& missing, int64_t timeout_ms,
            std::vector<int>* timed_out) {
  if (missing.empty()) return;
  if (timed_out != nullptr) {
    timed_out->insert(timed_out->end(), missing.begin(), missing.end());
    return;
  }
  detail::raise(ErrorCode::kTimeout, "host rank {} waited {} ms in {} of collective #{} for ranks {}", rank,
                timeout_ms, phase, seq, missing);
}

}  // namespace

std::vector<const void*> HostGroup::exchange(const void* mine, const std::vector<bool>* skip,
                                             std::vector<int>* timed_out) {
  const uint64_t seq = ++seq_;
  std::unique_lock lock(world_->mutex);
  world_->ptrs[rank_] = mine;
  world_->arrive_seq[rank_] = seq;
  world_->cv.notify_all();
  const auto missing = world_->wait_for(lock, world_->arrive_seq, seq, skip);
  std::vector<const void*> result(world_->ptrs);
  for (int r = 0; r < world_->num_ranks; ++r) {
    if ((skip != nullptr && (*skip)[r]) || world_->arrive_seq[r] != seq) result[r] = nullptr;
  }
  lock.unlock();
  report(rank_, "exchange", seq, missing, world_->timeout_ms, timed_out);
  return result;
}

void HostGroup::release(const std::vector<bool>* skip, std::vector<int>* timed_out) {
  const uint64_t seq = seq_;
  std::unique_lock lock(world_->mutex);
  world_->release_seq[rank_] = seq;
  world_->cv.notify_all();
  const auto missing = world_->wait_for(lock, world_->release_seq, seq, skip);
  lock.unlock();
  report(rank_, "release", seq, missing, world_->timeout_ms, timed_out);
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
  EPX_CHECK_ARG(num_ranks >= 1 && num_ranks <= 1024, "num_ranks must be in [1, 1024], got {}", num_ranks);
  EPX_CHECK_ARG(options.timeout_ms >= 1, "timeout_ms must be >= 1, got {}", options.timeout_ms);
  auto world = std::make_shared<host::HostWorld>(num_ranks, options.timeout_ms);
  std::vector<std::shared_ptr<Group>> groups;
  for (int r = 0; r < num_ranks; ++r) groups.push_back(std::make_shared<host::HostGroup>(world, r));
  return groups;
}

void run_host_ranks(const std::vector<std::shared_ptr<Group>>& groups,
                    const std::function<void(int rank, Group& group)>& fn) {
  std::vector<std::exception_ptr> errors(groups.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < groups.size(); ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(static_cast<int>(r), *groups[r]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace epx
