#include "epx/eplb/recorder.h"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

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
  EPX_CHECK_ARG(options.rank >= 0, "rank must be >= 0, got {}", options.rank);
  EPX_CHECK_ARG(options.max_record_bytes >= 0, "max_record_bytes must be >= 0, got {}", options.max_record_bytes);
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

void LoadRecorder::use_placement(const ExpertLocation& location) {
  if (open_.phy2log && open_.phy2log != location.phy2log_table()) {
    EPX_CHECK_ARG(*open_.phy2log == *location.phy2log_table(),
                  "all passes of a step must use the same placement (end_step() between placement changes)");
  }
  open_.phy2log = location.phy2log_table();
}

int64_t LoadRecorder::next_pass_id(const PassInfo& info) {
  last_pass_id_ = info.forward_pass_id >= 0 ? info.forward_pass_id : last_pass_id_ + 1;
  return last_pass_id_;
}

namespace {

int64_t record_size(const PassRecord& r) {
  return static_cast<int64_t>(sizeof(PassRecord)) +
         static_cast<int64_t>(r.global_physical_count.size() + r.topk_ids.size()) * 4 +
         static_cast<int64_t>(r.input_ids.size() + r.positions.size() + r.extend_seq_lens.size()) * 8;
}

void check_pass_info(const PassInfo& info) {
  EPX_CHECK_ARG(info.forward_pass_id >= -1, "info.forward_pass_id must be >= 0 (or -1: the next id), got {}",
                info.forward_pass_id);
}

}  // namespace

void LoadRecorder::keep_record(PassRecord record) {
  const int64_t bytes = record_size(record);
  if (bytes > options_.max_record_bytes - record_bytes_) {
    ++dropped_passes_;
    return;
  }
  record_bytes_ += bytes;
  records_.push_back(std::move(record));
}

void LoadRecorder::record_pass(const ExpertLocation& location, std::span<const int64_t> physical_counts,
                               const PassInfo& info) {
  EPX_CHECK_ARG(options_.mode != RecordMode::kPerToken,
                "record_pass is not allowed in per_token mode (record_token_pass records the top-k ids)");
  check_location(location);
  check_pass_info(info);
  EPX_CHECK_ARG(info.input_ids.empty() && info.positions.empty() && info.extend_seq_lens.empty(),
                "record_pass: info.input_ids, positions and extend_seq_lens are per_token fields and must be empty");
  EPX_CHECK_ARG(physical_counts.size() == open_.counts.size(),
                "physical_counts must have num_layers * num_physical = {} entries, got {}", open_.counts.size(),
                physical_counts.size());
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  for (size_t i = 0; i < physical_counts.size(); ++i) {
    const int64_t c = physical_counts[i];
    EPX_CHECK_ARG(c >= 0 && c + open_.counts[i] <= kMax, "physical_counts[{}] must be in [0, {}] for the step, got {}",
                  i, kMax - open_.counts[i], c);
  }
  use_placement(location);
  for (size_t i = 0; i < physical_counts.size(); ++i) open_.counts[i] += static_cast<int32_t>(physical_counts[i]);
  if (options_.mode == RecordMode::kPerPass) {
    PassRecord record;
    record.forward_pass_id = next_pass_id(info);
    record.rank = options_.rank;
    record.step = num_steps_;
    record.forward_mode = info.forward_mode;
    record.global_physical_count.assign(physical_counts.begin(), physical_counts.end());
    record.phy2log = open_.phy2log;
    keep_record(std::move(record));
  }
}

void LoadRecorder::record_token_pass(const ExpertLocation& location, std::span<const int64_t> topk_physical,
                                     int64_t num_tokens, int num_topk, const PassInfo& info) {
  EPX_CHECK_ARG(options_.mode == RecordMode::kPerToken, "record_token_pass needs per_token mode, the recorder is in {}",
                to_string(options_.mode));
  check_location(location);
  check_pass_info(info);
  EPX_CHECK_ARG(num_tokens >= 0 && num_tokens <= std::numeric_limits<int32_t>::max(),
                "num_tokens must be in [0, 2^31), got {}", num_tokens);
  EPX_CHECK_ARG(num_topk >= 1 && num_topk <= 1024, "num_topk must be in [1, 1024], got {}", num_topk);
  const int64_t per_layer = num_tokens * num_topk;
  EPX_CHECK_ARG(static_cast<int64_t>(topk_physical.size()) == num_layers_ * per_layer,
                "topk_physical must have num_layers * num_tokens * num_topk = {} * {} * {} = {} entries, got {}",
                num_layers_, num_tokens, num_topk, num_layers_ * per_layer, topk_physical.size());
  EPX_CHECK_ARG(info.input_ids.empty() || static_cast<int64_t>(info.input_ids.size()) == num_tokens,
                "info.input_ids must be empty or hold num_tokens = {} ids, got {}", num_tokens, info.input_ids.size());
  EPX_CHECK_ARG(info.positions.empty() || static_cast<int64_t>(info.positions.size()) == num_tokens,
                "info.positions must be empty or hold num_tokens = {} positions, got {}", num_tokens,
                info.positions.size());
  int64_t extend_sum = 0;
  for (size_t i = 0; i < info.extend_seq_lens.size(); ++i) {
    EPX_CHECK_ARG(info.extend_seq_lens[i] >= 0 && info.extend_seq_lens[i] <= num_tokens - extend_sum,
                  "info.extend_seq_lens[{}] = {} must be >= 0 and keep the sum within num_tokens = {}", i,
                  info.extend_seq_lens[i], num_tokens);
    extend_sum += info.extend_seq_lens[i];
  }
  std::vector<int32_t> counts(open_.counts.size(), 0);
  for (size_t i = 0; i < topk_physical.size(); ++i) {
    const int64_t s = topk_physical[i];
    EPX_CHECK_ARG(s >= -1 && s < num_physical_, "topk_physical[{}] must be in [-1, {}), got {}", i, num_physical_, s);
    if (s >= 0) ++counts[static_cast<int64_t>(i) / per_layer * num_physical_ + s];
  }
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  for (size_t i = 0; i < counts.size(); ++i) {
    EPX_CHECK_ARG(static_cast<int64_t>(open_.counts[i]) + counts[i] <= kMax,
                  "the step's count of layer {} slot {} would exceed 2^31 - 1", i / num_physical_, i % num_physical_);
  }
  use_placement(location);
  for (size_t i = 0; i < counts.size(); ++i) open_.counts[i] += counts[i];
  PassRecord record;
  record.forward_pass_id = next_pass_id(info);
  record.rank = options_.rank;
  record.step = num_steps_;
  record.forward_mode = info.forward_mode;
  record.num_tokens = num_tokens;
  record.num_topk = num_topk;
  // NOTE: the size is known before the copies; a record over the cap is dropped without building it.
  const int64_t bytes =
      static_cast<int64_t>(sizeof(PassRecord)) + static_cast<int64_t>(counts.size() + topk_physical.size()) * 4 +
      static_cast<int64_t>(info.input_ids.size() + info.positions.size() + info.extend_seq_lens.size()) * 8;
  if (bytes > options_.max_record_bytes - record_bytes_) {
    ++dropped_passes_;
    return;
  }
  record.global_physical_count = std::move(counts);
  record.phy2log = open_.phy2log;
  record.topk_ids.assign(topk_physical.begin(), topk_physical.end());
  record.input_ids = info.input_ids;
  record.positions = info.positions;
  record.extend_seq_lens = info.extend_seq_lens;
  keep_record(std::move(record));
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
  records_.clear();
  records_.shrink_to_fit();
  record_bytes_ = 0;
  dropped_passes_ = 0;
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

int sglang_forward_mode_value(ForwardMode mode) noexcept {
  switch (mode) {
    case ForwardMode::kExtend:
      return 1;
    case ForwardMode::kDecode:
      return 2;
    case ForwardMode::kMixed:
      return 3;
    case ForwardMode::kIdle:
      return 4;
    case ForwardMode::kTargetVerify:
      return 5;
    case ForwardMode::kDraftExtend:
      return 6;
    case ForwardMode::kPrebuilt:
      return 7;
  }
  return 0;
}

std::string LoadRecorder::records_json(const ExpertLocation& last_location) const {
  EPX_CHECK_ARG(options_.mode == RecordMode::kPerPass || options_.mode == RecordMode::kPerToken,
                "records_json needs per_pass or per_token mode, the recorder is in {} (its dump is logical_count: "
                "to_sglang_logical_count_json)",
                to_string(options_.mode));
  check_location(last_location);
  using nlohmann::json;
  auto rows = [&](const int32_t* data, int64_t num_rows, int64_t row_len) {
    json out = json::array();
    for (int64_t r = 0; r < num_rows; ++r) {
      out.push_back(std::vector<int32_t>(data + r * row_len, data + (r + 1) * row_len));
    }
    return out;
  };
  const bool per_token = options_.mode == RecordMode::kPerToken;
  json records = json::array();
  for (const PassRecord& r : records_) {
    json j;
    j["forward_pass_id"] = r.forward_pass_id;
    j["rank"] = r.rank;
    j["gatherer_key"] = "primary";
    j["global_physical_count"] = rows(r.global_physical_count.data(), num_layers_, num_physical_);
    std::vector<int64_t> logical(static_cast<size_t>(num_layers_) * num_logical_, 0);
    for (int64_t i = 0; i < static_cast<int64_t>(r.global_physical_count.size()); ++i) {
      logical[i / num_physical_ * num_logical_ + (*r.phy2log)[i]] += r.global_physical_count[i];
    }
    json logical_rows = json::array();
    for (int l = 0; l < num_layers_; ++l) {
      logical_rows.push_back(std::vector<int64_t>(logical.begin() + static_cast<int64_t>(l) * num_logical_,
                                                  logical.begin() + static_cast<int64_t>(l + 1) * num_logical_));
    }
    j["logical_count"] = std::move(logical_rows);
    j["step"] = r.step;
    j["forward_mode"] = r.forward_mode ? json(sglang_forward_mode_value(*r.forward_mode)) : json(nullptr);
    j["forward_mode_name"] = r.forward_mode ? json(to_string(*r.forward_mode)) : json(nullptr);
    if (per_token) {
      j["input_ids"] = r.input_ids;
      j["positions"] = r.positions;
      j["extend_seq_lens"] = r.extend_seq_lens;
      json layers = json::array();
      for (int l = 0; l < num_layers_; ++l) {
        layers.push_back(
            rows(r.topk_ids.data() + static_cast<int64_t>(l) * r.num_tokens * r.num_topk, r.num_tokens, r.num_topk));
      }
      j["topk_ids_of_layer"] = std::move(layers);
      j["misc_objects"] = json::array();
    }
    records.push_back(std::move(j));
  }
  json out;
  out["records"] = std::move(records);
  out["last_physical_to_logical_map"] = rows(last_location.phy2log_table()->data(), num_layers_, num_physical_);
  out["mode"] = to_string(options_.mode);
  out["rank"] = options_.rank;
  out["dropped_passes"] = dropped_passes_;
  out["max_record_bytes"] = options_.max_record_bytes;
  return out.dump();
}

}  // namespace epx::eplb
