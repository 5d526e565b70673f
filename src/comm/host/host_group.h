// The host backend's Group: ranks are threads of one process that share memory.
//
// Collectives rendezvous by per-rank sequence numbers. A collective is two phases:
//   exchange(ptr)  every participant publishes a pointer (call n) and waits until all participants
//                  published call n; it returns all pointers. Peers' memory may then be read.
//   release()      every participant says it is done reading call n and waits for the others, so
//                  no published memory is freed or reused while a peer still reads it.
// NOTE: a rank cannot publish call n+1 before every participant released call n, so the pointers
// of call n stay valid until this rank's release().
//
// Failures (see docs/reliability.md):
//   - A rank that leaves a collective before every peer released it (its wait timed out) withdraws
//     its publication first, so a late peer sees "withdrawn" and raises instead of reading memory
//     that may be gone. release() never returns while a peer that took this rank's pointers is
//     still reading them (readers do no waits between exchange and release).
//   - A rank that fails before it can publish (e.g. invalid input) calls fail() instead of
//     exchange(): it takes part with an error flag, and every peer's exchange() raises
//     Error(kPeerFailure) naming it, at once. The sequence numbers stay in step, so the group is
//     usable again afterwards.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "epx/group.h"

namespace epx::host {

class HostWorld;

class HostGroup final : public Group {
 public:
  HostGroup(std::shared_ptr<HostWorld> world, int rank);

  int rank() const override { return rank_; }
  int num_ranks() const override;
  Backend backend() const override { return Backend::kHost; }
  Device device() const override { return Device::cpu(); }
  int64_t timeout_ms() const override;
  Topology topology() const override;
  void barrier() override;
  void all_gather_bytes(const void* send, void* recv, size_t bytes) override;

  // A copy of `bytes` at `data` in memory the group owns (rotating over the slots all_gather_bytes uses), to
  // publish with exchange(): it outlives the caller's objects, so a peer that still reads it after this rank
  // returned (a peer this rank skipped) reads valid memory.
  const void* publish_copy(const void* data, size_t bytes);
  // Phase 1 of a collective. `skip` (optional, [num_ranks]) names ranks not to wait for. If
  // `timed_out` is null a wait that expires throws Error(kTimeout), and a peer that withdrew (it gave
  // up on this call) makes it throw Error(kPeerFailure); else those ranks are appended to `timed_out`
  // and their pointers are null. A peer that called fail() makes it throw Error(kPeerFailure) naming
  // that peer and its reason, in either mode, after completing the collective (no release() then).
  std::vector<const void*> exchange(const void* mine, const std::vector<bool>* skip = nullptr,
                                    std::vector<int>* timed_out = nullptr);
  // Phase 2. Same skip/timeout rules; ranks that time out here are appended to `timed_out`.
  void release(const std::vector<bool>* skip = nullptr, std::vector<int>* timed_out = nullptr);
  // Instead of exchange() + release(): this rank failed before it could publish (`reason` says why).
  // Completes the collective with an error flag, waiting (bounded) until every peer not in `skip` (the same
  // optional [num_ranks] mask the peers pass to exchange()) has seen it. Never throws; the caller raises its
  // own error afterwards.
  void fail(const std::string& reason, const std::vector<bool>* skip = nullptr) noexcept;
  // The number of this rank's last collective (1, 2, ...): the same on every rank that made the same calls,
  // so it names a collective across ranks (e.g. the dispatch that made a handle).
  uint64_t seq() const { return seq_; }

  // The object stored under `key` for the whole world (shared by every rank's group), made by make()
  // on the first call. Lets host objects meet without a collective (e.g. low-latency mailboxes, where
  // a masked or dead rank must not be waited for).
  std::shared_ptr<void> world_object(const std::string& key, const std::function<std::shared_ptr<void>()>& make);

 private:
  std::shared_ptr<HostWorld> world_;
  int rank_;
  uint64_t seq_ = 0;
  std::array<std::vector<char>, 4> gather_staging_;  // all_gather_bytes' published copies
  size_t gather_next_ = 0;
};

}  // namespace epx::host
