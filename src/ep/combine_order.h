// The order in which a normal combine adds a token's rows when CombineArgs::order_topk_idx is given (DeepEP V2's
// combine reference; include/epx/buffer.h). One definition for the host backend and the cuda kernels, so both sum
// alike. Private to the library.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define EPX_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define EPX_HOST_DEVICE inline
#endif

namespace epx::ep {

// Writes to order[0, n) the ranks for which in_rank(r) holds, and returns n: first those named by a top-k slot, by
// the last slot that names each (expert e names rank e / experts_per_rank; topk(k) outside
// [0, num_ranks * experts_per_rank) names none), then the others by ascending r. last: scratch of num_ranks ints.
template <class InRank, class Topk>
EPX_HOST_DEVICE int deepep_v2_rank_order(int num_ranks, int num_topk, int64_t experts_per_rank, InRank in_rank,
                                         Topk topk, int* last, int* order) {
  const int64_t num_experts = experts_per_rank * num_ranks;
  for (int r = 0; r < num_ranks; ++r) last[r] = -1;
  for (int k = 0; k < num_topk; ++k) {
    const int64_t e = topk(k);
    if (e >= 0 && e < num_experts) last[e / experts_per_rank] = k;
  }
  int n = 0;
  for (int k = 0; k < num_topk; ++k) {
    const int64_t e = topk(k);
    if (e < 0 || e >= num_experts) continue;
    const int r = static_cast<int>(e / experts_per_rank);
    if (last[r] == k && in_rank(r)) order[n++] = r;
  }
  for (int r = 0; r < num_ranks; ++r) {
    if (last[r] < 0 && in_rank(r)) order[n++] = r;
  }
  return n;
}

}  // namespace epx::ep
