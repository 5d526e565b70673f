// Timeouts of group waits: the clamp applied when a group is created (kMaxTimeoutMs, epx/group.h), checked
// conversions of a budget in milliseconds into deadlines and nanoseconds, and a bounded poll.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>

#include "core/check.h"
#include "epx/group.h"

namespace epx::detail {

// A group's budget: timeout_ms (>= 1, checked by the caller) clamped to kMaxTimeoutMs (100 years), so that
// "wait forever" (INT64_MAX) is a budget no deadline arithmetic overflows on.
inline int64_t clamp_timeout_ms(int64_t timeout_ms) { return std::min(timeout_ms, kMaxTimeoutMs); }

// timeout_ms in nanoseconds. Throws kInvalidArgument if it overflows int64 (never for a clamped budget:
// 100 years are 3.2e18 ns < 2^63).
inline int64_t timeout_ns(int64_t timeout_ms) { return checked_mul(timeout_ms, 1'000'000, "timeout_ms * 10^6 ns"); }

// now + timeout_ms on the steady clock, checked like timeout_ns (and the sum with the clock's reading).
inline std::chrono::steady_clock::time_point deadline_after_ms(int64_t timeout_ms) {
  using Clock = std::chrono::steady_clock;
  const auto budget = std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(timeout_ns(timeout_ms)));
  const Clock::time_point now = Clock::now();
  checked_add(now.time_since_epoch().count(), budget.count(), "steady clock + timeout_ms");
  return now + budget;
}

// A bounded poll: calls done() until it returns true or `deadline` has passed, sleeping `interval` between calls
// (0: yield only, for waits on the critical path). The host waits of the CUDA backend pass cudaEventQuery /
// cudaStreamQuery (with a check of the communicator's state) instead of a synchronize that can block forever.
// done() is called at least once, and once more after the deadline so that work that finished while the poller
// slept is not reported late. Returns whether done() returned true; what done() throws propagates.
template <typename Done>
bool poll_until(std::chrono::steady_clock::time_point deadline, Done done,
                std::chrono::microseconds interval = std::chrono::microseconds(20)) {
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return done();
    if (interval.count() > 0) {
      std::this_thread::sleep_for(interval);
    } else {
      std::this_thread::yield();
    }
  }
  return true;
}

}  // namespace epx::detail
