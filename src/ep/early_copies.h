// EarlyCopies::kAuto's guess (include/epx/buffer.h, docs/normal-kernels.md "Early copies"): whether the peer of a
// fresh two-rank dispatch will need at least 15/16 of this rank's tokens, so that copying the whole x before notify
// moves few bytes it does not need. Plain C++ (unit-tested on the CPU); the cuda NormalEngine calls it.
#pragma once

#include <algorithm>
#include <cstdint>

namespace epx::ep {

// The share of tokens that reach the other rank of two when each token picks num_topk distinct experts uniformly
// among num_experts split evenly over the ranks: 1 - C(E / 2, K) / C(E, K) (a token misses the peer only when all of
// its experts are this rank's).
inline double uniform_peer_share(int64_t num_experts, int64_t num_topk) {
  double miss = 1.0;
  for (int64_t i = 0; i < num_topk; ++i) {
    miss *= std::max<double>(0.0, static_cast<double>(num_experts - num_experts / 2 - i)) /
            static_cast<double>(num_experts - i);
  }
  return 1.0 - miss;
}

// The previous fresh dispatch's share when there was one (last_tokens > 0: it sent last_peer_rows of last_tokens to
// the peer), else the uniform share; dense means >= 15/16, the whole-copy rule's threshold (whole_copy).
inline bool expect_dense_peer(int64_t num_experts, int64_t num_topk, int64_t last_tokens, int64_t last_peer_rows) {
  if (last_tokens > 0) return last_peer_rows * 16 >= last_tokens * 15;
  return uniform_peer_share(num_experts, num_topk) * 16 >= 15;
}

}  // namespace epx::ep
