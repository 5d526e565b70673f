// The TBO stage executor: two operation lists, cut at yield points, interleaved stage by stage.
#include "core/check.h"
#include "epx/tbo.h"

namespace epx {

std::vector<std::vector<TboOperation>> split_tbo_stages(const std::vector<TboOperation>& ops) {
  std::vector<std::vector<TboOperation>> stages;
  std::vector<TboOperation> pending;
  for (const TboOperation& op : ops) {
    if (op.is_yield()) {
      stages.push_back(std::move(pending));
      pending.clear();
    } else {
      pending.push_back(op);
    }
  }
  if (!pending.empty()) stages.push_back(std::move(pending));
  return stages;
}

namespace {

void run_stage(const std::vector<TboOperation>& stage, int batch_idx) {
  for (const TboOperation& op : stage) op.fn(batch_idx);
}

}  // namespace

void execute_two_batch_overlap(const std::vector<TboOperation>& ops_a, const std::vector<TboOperation>& ops_b,
                               int delta_stages) {
  const auto stages_a = split_tbo_stages(ops_a);
  const auto stages_b = split_tbo_stages(ops_b);
  const int num_stages = static_cast<int>(stages_a.size());
  EPX_CHECK_ARG(stages_b.size() == stages_a.size(),
                "ops_a and ops_b must have the same number of stages, got {} and {}", stages_a.size(), stages_b.size());
  EPX_CHECK_ARG(delta_stages >= 0 && delta_stages <= num_stages, "delta_stages must be in [0, {}], got {}", num_stages,
                delta_stages);
  for (int i = 0; i < delta_stages; ++i) run_stage(stages_a[i], 0);
  for (int i = 0; i < num_stages - delta_stages; ++i) {
    run_stage(stages_a[i + delta_stages], 0);
    run_stage(stages_b[i], 1);
  }
  for (int i = num_stages - delta_stages; i < num_stages; ++i) run_stage(stages_b[i], 1);
}

}  // namespace epx
