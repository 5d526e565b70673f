// The host backend's Group: ranks are threads of one process that share memory.
//
// Collectives rendezvous by per-rank sequence numbers. A collective is two phases:
//   exchange(ptr)  every participant publishes a pointer (call n) and waits until all participants
//                  published call n; it returns all pointers. Peers' memory may then be read.
//   release()      every participant says it is done reading call n and waits for the others, so
//                  no published memory is freed or reused while a peer still reads it.
// NOTE: a rank cannot publish call n+1 before every participant released call n, so the pointers
// of call n stay valid until this rank's release().
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
  void barrier() override;
  void all_gather_bytes(const void* send, void* recv, size_t bytes) override;

  // Phase 1 of a collective. `skip` (optional, [num_ranks]) names ranks not to wait for. If
  // `timed_out` is null a wait that expires throws Error(kTimeout); else the ranks that did not
  // arrive are appended to it and their pointers are null.
  std::vector<const void*> exchange(const void* mine, const std::vector<bool>* skip = nullptr,
                                    std::vector<int>* timed_out = nullptr);
  // Phase 2. Same skip/timeout rules; ranks that time out here are appended to `timed_out`.
  void release(const std::vector<bool>* skip = nullptr, std::vector<int>* timed_out = nullptr);

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
