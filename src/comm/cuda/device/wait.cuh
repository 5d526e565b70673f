// The one bounded wait of epx's kernels (normal and low-latency paths): every spin on a signal has a budget on one
// clock (%globaltimer ns) and says who it waited for (the caller's on_timeout records it, device/error.cuh).
#pragma once

#include <cstdint>

#include "comm/cuda/device/ordering.cuh"

namespace epx::cuda {
namespace {

// Polls *p with ld_acquire_sys (so a true return orders the signaller's earlier writes before the caller's later
// reads) until ready(value) holds: returns true. Every kPollsPerCheck polls it asks give_up() (a failure
// recorded elsewhere: returns false) and reads the clock: timeout_ns after the first poll it calls
// on_timeout(last value seen) and returns false. One thread calls it; the caller shares the result with its block.
// kPollsPerCheck trades the clock and give_up() reads against the reaction time: the normal path's waits check
// every 256 polls, the low-latency path's every poll (its give_up is one volatile load of the rank mask).
template <int kPollsPerCheck, typename Ready, typename GiveUp, typename OnTimeout>
__device__ __forceinline__ bool bounded_wait(const uint64_t* p, uint64_t timeout_ns, Ready ready, GiveUp give_up,
                                             OnTimeout on_timeout) {
  static_assert(kPollsPerCheck > 0 && (kPollsPerCheck & (kPollsPerCheck - 1)) == 0, "a power of two");
  const uint64_t start = global_ns();
  for (uint32_t i = 0;; ++i) {
    const uint64_t v = ld_acquire_sys(p);
    if (ready(v)) return true;
    if ((i & (kPollsPerCheck - 1)) == kPollsPerCheck - 1) {
      if (give_up()) return false;
      if (global_ns() - start > timeout_ns) {
        on_timeout(v);
        return false;
      }
    }
  }
}

}  // namespace
}  // namespace epx::cuda
