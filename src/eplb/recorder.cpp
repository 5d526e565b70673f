#include "epx/eplb/recorder.h"

#include <algorithm>
#include <limits>

#include "core/check.h"

namespace epx::eplb {

const char* to_string(RecordMode mode) noexcept {
  switch (mode) {
    case RecordMode::kStat:
      return "stat";
    case RecordMode::kStatApprox:
      return "stat_approx";
    case RecordMode::kPerPass:
      return "per_pass";
    case RecordMode::kPerToken:
      return "per_token";
  }
  return "?";
}

RecordMode record_mode_from_string(const std::string& name) {
  if (name == "stat") return RecordMode::kStat;
  if (name == "stat_approx") return RecordMode::kStatApprox;
  if (name == "per_pass") return RecordMode::kPerPass;
  if (name == "per_token") return RecordMode::kPerToken;
  epx::detail::raise(ErrorCode::kInvalidArgument,
                     "record mode must be 'stat', 'stat_approx', 'per_pass' or 'per_token', got '{}'", name);
}

LoadRecorder::LoadRecorder(int num_layers, int num_logical, int num_physical, int num_gpus,
                           const RecorderOptions& options)
    : num_layers_(num_layers),
      num_logical_(num_logical),
      num_physical_(num_physical),
      num_gpus_(num_gpus),
      options_(options) {
  EPX_CHECK_ARG(num_layers >= 1 && num_logical >= 1 && num_physical >= 1,
                "num_layers, num_logical and num_physical must be >= 1, got {}, {}, {}", num_layers, num_logical,
                num_physical);
  EPX_CHECK_ARG(num_gpus >= 1 && num_physical % num_gpus == 0, "num_physical ({}) must be divisible by num_gpus ({})",
                num_physical, num_gpus);
  EPX_CHECK_ARG(options.buffer_steps >= 1, "buffer_steps must be >= 1, got {}", options.buffer_steps);
  open_.counts.assign(static_cast<size_t>(num_layers) * num_physical, 0);
  buffer_sum_.assign(open_.counts.size(), 0);
}

void LoadRecorder::check_location(const ExpertLocation& location) const {
  EPX_CHECK_ARG(
      location.num_layers() == num_layers_ && location.num_logical() == num_logical_ &&
          location.num_physical() == num_physical_ && location.num_gpus() == num_gpus_,
      "location shape ({} layers, {} logical, {} physical, {} GPUs) must match the recorder's ({}, {}, {}, {})",
      location.num_layers(), location.num_logical(), location.num_physical(), location.num_gpus(), num_layers_,
      num_logical_, num_physical_, num_gpus_);
}

void LoadRecorder::record_pass(const ExpertLocation& location, std::span<const int64_t> physical_counts) {
  EPX_CHECK_ARG(options_.mode != RecordMode::kPerToken, "record_pass is not allowed in per_token mode");
  check_location(location);
  EPX_CHECK_ARG(physical_counts.size() == open_.counts.size(),
                "physical_counts must have num_layers * num_physical = {} entries, got {}", open_.counts.size(),
                physical_counts.size());
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  for (size_t i = 0; i < physical_counts.size(); ++i) {
    const int64_t c = physical_counts[i];
    EPX_CHECK_ARG(c >= 0 && c + open_.counts[i] <= kMax, "physical_counts[{}] must be in [0, {}] for the step, got {}",
                  i, kMax - open_.counts[i], c);
  }
  if (open_.phy2log && open_.phy2log != location.phy2log_table()) {
    EPX_CHECK_ARG(*open_.phy2log == *location.phy2log_table(),
                  "all passes of a step must use the same placement (end_step() between placement changes)");
  }
  open_.phy2log = location.phy2log_table();
  for (size_t i = 0; i < physical_counts.size(); ++i) open_.counts[i] += static_cast<int32_t>(physical_counts[i]);
  if (options_.mode == RecordMode::kPerPass) {
    open_.passes.push_back({num_steps_, std::vector<int32_t>(physical_counts.begin(), physical_counts.end())});
  }
}

void LoadRecorder::record_tokens(const ExpertLocation& location, int layer, std::span<const int64_t> topk_physical) {
  EPX_CHECK_ARG(options_.mode == RecordMode::kPerToken, "record_tokens needs per_token mode, the recorder is in {}",
                to_string(options_.mode));
  check_location(location);
  EPX_CHECK_ARG(layer >= 0 && layer < num_layers_, "layer must be in [0, {}), got {}", num_layers_, layer);
  for (size_t i = 0; i < topk_physical.size(); ++i) {
    EPX_CHECK_ARG(topk_physical[i] >= -1 && topk_physical[i] < num_physical_,
                  "topk_physical[{}] must be in [-1, {}), got {}", i, num_physical_, topk_physical[i]);
  }
  if (open_.phy2log && open_.phy2log != location.phy2log_table()) {
    EPX_CHECK_ARG(*open_.phy2log == *location.phy2log_table(),
                  "all passes of a step must use the same placement (end_step() between placement changes)");
  }
  open_.phy2log = location.phy2log_table();
  TokenRecord record{num_steps_, layer, {}};
  record.topk_physical.reserve(topk_physical.size());
  int32_t* counts = open_.counts.data() + static_cast<int64_t>(layer) * num_physical_;
  for (int64_t s : topk_physical) {
    record.topk_physical.push_back(static_cast<int32_t>(s));
    if (s >= 0) ++counts[s];
  }
  open_.tokens.push_back(std::move(record));
}

void LoadRecorder::end_step() {
  open_.index = num_steps_++;
  const auto capacity = static_cast<size_t>(std::max(kMaxUtilizationWindow, options_.buffer_steps));
  const double step_utilization = counts_utilization(open_.counts.data());
  if (step_utilization_.size() < capacity) {
    step_utilization_.push_back(step_utilization);
  } else {
    step_utilization_[step_utilization_head_] = step_utilization;
    step_utilization_head_ = static_cast<int>((step_utilization_head_ + 1) % capacity);
  }
  last_step_count_sum_ = 0;
  for (int32_t c : open_.counts) last_step_count_sum_ += c;
  Step next;
  next.counts.assign(open_.counts.size(), 0);
  for (size_t i = 0; i < buffer_sum_.size(); ++i) buffer_sum_[i] += open_.counts[i];
  if (static_cast<int>(ring_.size()) < options_.buffer_steps) {
    ring_.push_back(std::move(open_));
  } else {
    const auto& evicted = ring_[ring_head_].counts;
    for (size_t i = 0; i < buffer_sum_.size(); ++i) buffer_sum_[i] -= evicted[i];
    ring_[ring_head_] = std::move(open_);
    ring_head_ = (ring_head_ + 1) % options_.buffer_steps;
  }
  open_ = std::move(next);
}

void LoadRecorder::clear() {
  ring_.clear();
  ring_head_ = 0;
  std::fill(buffer_sum_.begin(), buffer_sum_.end(), 0);
  step_utilization_.clear();
  step_utilization_head_ = 0;
  last_step_count_sum_ = 0;
  open_ = Step{};
  open_.counts.assign(static_cast<size_t>(num_layers_) * num_physical_, 0);
}

std::vector<const LoadRecorder::Step*> LoadRecorder::window_steps(int window) const {
  EPX_CHECK_ARG(window >= 1, "window must be >= 1 step, got {}", window);
  const int n = static_cast<int>(ring_.size());
  const int take = std::min(window, n);
  std::vector<const Step*> out;
  out.reserve(take);
  for (int i = n - take; i < n; ++i) out.push_back(&ring_[(ring_head_ + i) % n]);
  return out;
}

std::vector<int64_t> LoadRecorder::physical_loads(int window) const {
  EPX_CHECK_ARG(window >= 1, "window must be >= 1 step, got {}", window);
  if (window >= steps_in_buffer()) return buffer_sum_;
  std::vector<int64_t> out(static_cast<size_t>(num_layers_) * num_physical_, 0);
  for (const Step* step : window_steps(window)) {
    for (size_t i = 0; i < out.size(); ++i) out[i] += step->counts[i];
  }
  return out;
}

std::vector<int64_t> LoadRecorder::logical_loads(int window) const {
  std::vector<int64_t> out(static_cast<size_t>(num_layers_) * num_logical_, 0);
  for (const Step* step : window_steps(window)) {
    if (!step->phy2log) continue;  // nothing recorded in that step
    for (int l = 0; l < num_layers_; ++l) {
      for (int s = 0; s < num_physical_; ++s) {
        const int64_t i = static_cast<int64_t>(l) * num_physical_ + s;
        out[static_cast<int64_t>(l) * num_logical_ + (*step->phy2log)[i]] += step->counts[i];
      }
    }
  }
  return out;
}

namespace {

// (mean GPU load + 1e-5) / (max GPU load + 1e-5) of one layer's slot counts, as SGLang's compute_utilization_rate.
template <typename Count>
double layer_utilization(const Count* counts, int num_physical, int num_gpus, std::vector<double>& gpu) {
  const int spg = num_physical / num_gpus;
  gpu.assign(num_gpus, 0.0);
  for (int s = 0; s < num_physical; ++s) gpu[s / spg] += static_cast<double>(counts[s]);
  double sum = 0, max_load = 0;
  for (double v : gpu) {
    sum += v;
    max_load = std::max(max_load, v);
  }
  return (sum / num_gpus + 1e-5) / (max_load + 1e-5);
}

}  // namespace

std::vector<double> LoadRecorder::utilization_per_layer(int window) const {
  const auto loads = physical_loads(window);
  std::vector<double> out(num_layers_);
  std::vector<double> gpu;
  for (int l = 0; l < num_layers_; ++l) {
    out[l] = layer_utilization(loads.data() + static_cast<int64_t>(l) * num_physical_, num_physical_, num_gpus_, gpu);
  }
  return out;
}

double LoadRecorder::counts_utilization(const int32_t* counts) const {
  std::vector<double> gpu;
  double sum = 0;
  for (int l = 0; l < num_layers_; ++l) {
    sum += layer_utilization(counts + static_cast<int64_t>(l) * num_physical_, num_physical_, num_gpus_, gpu);
  }
  return sum / num_layers_;
}

std::vector<double> LoadRecorder::step_utilizations(int window) const {
  EPX_CHECK_ARG(window >= 1, "window must be >= 1 step, got {}", window);
  const size_t n = step_utilization_.size();
  const size_t take = std::min(static_cast<size_t>(window), n);
  std::vector<double> out;
  out.reserve(take);
  for (size_t i = n - take; i < n; ++i) out.push_back(step_utilization_[(step_utilization_head_ + i) % n]);
  return out;
}

double LoadRecorder::mean_step_utilization(int window) const {
  const auto values = step_utilizations(window);
  if (values.empty()) return 1.0;
  double sum = 0;
  for (double v : values) sum += v;
  return sum / static_cast<double>(values.size());
}

double LoadRecorder::utilization(int window) const {
  const auto per_layer = utilization_per_layer(window);
  double sum = 0;
  for (double v : per_layer) sum += v;
  return sum / num_layers_;
}

std::vector<LoadRecorder::PassRecord> LoadRecorder::passes() const {
  std::vector<PassRecord> out;
  for (const Step* step : window_steps(std::max(1, steps_in_buffer()))) {
    out.insert(out.end(), step->passes.begin(), step->passes.end());
  }
  return out;
}

std::vector<LoadRecorder::TokenRecord> LoadRecorder::tokens() const {
  std::vector<TokenRecord> out;
  for (const Step* step : window_steps(std::max(1, steps_in_buffer()))) {
    out.insert(out.end(), step->tokens.begin(), step->tokens.end());
  }
  return out;
}

}  // namespace epx::eplb
