#include <cstdio>
#include <vector>

#include "epx/routing.h"
#include "epx/version.h"

int main() {
  std::vector<int64_t> topk = {0, 3, 2, -1};
  const auto layout = epx::compute_layout_host(epx::TensorView::of(topk.data(), epx::DType::kInt64, {2, 2}), 4, 2);
  std::printf("epx %s: tokens per rank %d %d\n", epx::version(), layout.num_tokens_per_rank[0],
              layout.num_tokens_per_rank[1]);
  // token 0 -> experts 0 (rank 0) and 3 (rank 1); token 1 -> expert 2 (rank 1).
  return layout.num_tokens_per_rank[0] == 1 && layout.num_tokens_per_rank[1] == 2 ? 0 : 1;
}
