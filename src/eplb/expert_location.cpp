#include "epx/eplb/expert_location.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "eplb/replica_rule.h"

namespace epx::eplb {

namespace {

void check_layout(int num_layers, int num_logical, int num_physical, int num_gpus, int num_nodes) {
  EPX_CHECK_ARG(num_layers >= 1, "num_layers must be >= 1, got {}", num_layers);
  EPX_CHECK_ARG(num_logical >= 1, "num_logical must be >= 1, got {}", num_logical);
  EPX_CHECK_ARG(num_physical >= num_logical, "num_physical must be >= num_logical ({}), got {}", num_logical,
                num_physical);
  EPX_CHECK_ARG(num_gpus >= 1 && num_physical % num_gpus == 0,
                "num_physical ({}) must be divisible by num_gpus ({}) for equal slots per GPU", num_physical, num_gpus);
  EPX_CHECK_ARG(num_nodes >= 1 && num_gpus % num_nodes == 0, "num_gpus ({}) must be divisible by num_nodes ({})",
                num_gpus, num_nodes);
}

}  // namespace

ExpertLocation::ExpertLocation(int num_layers, int num_logical, int num_physical, int num_gpus, int num_nodes,
                               std::vector<int32_t> phy2log)
    : num_layers_(num_layers),
      num_logical_(num_logical),
      num_physical_(num_physical),
      num_gpus_(num_gpus),
      num_nodes_(num_nodes) {
  check_layout(num_layers, num_logical, num_physical, num_gpus, num_nodes);
  EPX_CHECK_ARG(phy2log.size() == static_cast<size_t>(num_layers) * num_physical,
                "phy2log must have num_layers * num_physical = {} entries, got {}",
                static_cast<int64_t>(num_layers) * num_physical, phy2log.size());
  phy2log_ = std::make_shared<const std::vector<int32_t>>(std::move(phy2log));
  log2phy_offsets_.assign(static_cast<size_t>(num_layers) * (num_logical + 1), 0);
  log2phy_slots_.assign(static_cast<size_t>(num_layers) * num_physical, 0);
  for (int l = 0; l < num_layers; ++l) rebuild_layer(l);
}

ExpertLocation ExpertLocation::trivial(int num_layers, int num_logical, int num_physical, int num_gpus, int num_nodes) {
  check_layout(num_layers, num_logical, num_physical, num_gpus, num_nodes);
  return ExpertLocation(num_layers, num_logical, num_physical, num_gpus, num_nodes,
                        trivial_phy2log(num_layers, num_logical, num_physical));
}

ExpertLocation ExpertLocation::from_placement(const Placement& placement, int num_gpus, int num_nodes) {
  return ExpertLocation(placement.num_layers, placement.num_logical, placement.num_physical, num_gpus, num_nodes,
                        placement.phy2log);
}

void ExpertLocation::rebuild_layer(int layer) {
  const int32_t* row = phy2log_->data() + static_cast<int64_t>(layer) * num_physical_;
  int32_t* offsets = log2phy_offsets_.data() + static_cast<int64_t>(layer) * (num_logical_ + 1);
  int32_t* slots = log2phy_slots_.data() + static_cast<int64_t>(layer) * num_physical_;
  std::fill(offsets, offsets + num_logical_ + 1, 0);
  for (int s = 0; s < num_physical_; ++s) {
    EPX_CHECK_ARG(row[s] >= 0 && row[s] < num_logical_, "phy2log[{}][{}] must be in [0, {}), got {}", layer, s,
                  num_logical_, row[s]);
    ++offsets[row[s] + 1];
  }
  for (int e = 0; e < num_logical_; ++e) {
    EPX_CHECK_ARG(offsets[e + 1] >= 1, "logical expert {} has no replica in layer {} (every expert needs >= 1)", e,
                  layer);
    offsets[e + 1] += offsets[e];
  }
  std::vector<int32_t> fill(offsets, offsets + num_logical_);
  for (int s = 0; s < num_physical_; ++s) slots[fill[row[s]]++] = s;
}

void ExpertLocation::check_layer_index(int layer) const {
  EPX_CHECK_ARG(layer >= 0 && layer < num_layers_, "layer must be in [0, {}), got {}", num_layers_, layer);
}

int ExpertLocation::max_replicas() const {
  int best = 0;
  for (int l = 0; l < num_layers_; ++l) {
    for (int e = 0; e < num_logical_; ++e) best = std::max(best, replica_count(l, e));
  }
  return best;
}

std::span<const int32_t> ExpertLocation::phy2log(int layer) const {
  check_layer_index(layer);
  return {phy2log_->data() + static_cast<int64_t>(layer) * num_physical_, static_cast<size_t>(num_physical_)};
}

std::span<const int32_t> ExpertLocation::replicas(int layer, int expert) const {
  check_layer_index(layer);
  EPX_CHECK_ARG(expert >= 0 && expert < num_logical_, "expert must be in [0, {}), got {}", num_logical_, expert);
  const int32_t* offsets = log2phy_offsets_.data() + static_cast<int64_t>(layer) * (num_logical_ + 1);
  const int32_t* slots = log2phy_slots_.data() + static_cast<int64_t>(layer) * num_physical_;
  return {slots + offsets[expert], static_cast<size_t>(offsets[expert + 1] - offsets[expert])};
}

void ExpertLocation::set_layer(int layer, std::span<const int32_t> phy2log) {
  check_layer_index(layer);
  EPX_CHECK_ARG(phy2log.size() == static_cast<size_t>(num_physical_), "set_layer: phy2log must have {} entries, got {}",
                num_physical_, phy2log.size());
  auto next = std::make_shared<std::vector<int32_t>>(*phy2log_);
  std::copy(phy2log.begin(), phy2log.end(), next->begin() + static_cast<int64_t>(layer) * num_physical_);
  auto previous = phy2log_;
  phy2log_ = std::move(next);
  try {
    rebuild_layer(layer);
  } catch (...) {
    phy2log_ = std::move(previous);
    rebuild_layer(layer);
    throw;
  }
}

bool ExpertLocation::operator==(const ExpertLocation& other) const {
  return num_layers_ == other.num_layers_ && num_logical_ == other.num_logical_ &&
         num_physical_ == other.num_physical_ && num_gpus_ == other.num_gpus_ && num_nodes_ == other.num_nodes_ &&
         *phy2log_ == *other.phy2log_;
}

std::string ExpertLocation::to_json() const {
  nlohmann::json j;
  j["num_layers"] = num_layers_;
  j["num_logical"] = num_logical_;
  j["num_physical"] = num_physical_;
  j["num_gpus"] = num_gpus_;
  j["num_nodes"] = num_nodes_;
  auto rows = nlohmann::json::array();
  for (int l = 0; l < num_layers_; ++l) {
    const auto row = phy2log(l);
    rows.push_back(std::vector<int32_t>(row.begin(), row.end()));
  }
  j["phy2log"] = std::move(rows);
  return j.dump();
}

ExpertLocation ExpertLocation::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    epx::detail::raise(ErrorCode::kInvalidArgument, "expert location JSON does not parse: {}", e.what());
  }
  EPX_CHECK_ARG(j.is_object(), "expert location JSON must be an object");
  auto get_int = [&](const char* key) {
    EPX_CHECK_ARG(j.contains(key) && j[key].is_number_integer(), "expert location JSON needs integer field '{}'", key);
    return j[key].get<int>();
  };
  const int num_layers = get_int("num_layers"), num_logical = get_int("num_logical");
  const int num_physical = get_int("num_physical"), num_gpus = get_int("num_gpus"), num_nodes = get_int("num_nodes");
  check_layout(num_layers, num_logical, num_physical, num_gpus, num_nodes);
  EPX_CHECK_ARG(
      j.contains("phy2log") && j["phy2log"].is_array() && j["phy2log"].size() == static_cast<size_t>(num_layers),
      "expert location JSON field 'phy2log' must be an array of num_layers = {} rows", num_layers);
  std::vector<int32_t> phy2log;
  phy2log.reserve(static_cast<size_t>(num_layers) * num_physical);
  for (int l = 0; l < num_layers; ++l) {
    const auto& row = j["phy2log"][l];
    EPX_CHECK_ARG(row.is_array() && row.size() == static_cast<size_t>(num_physical),
                  "phy2log row {} must have num_physical = {} entries", l, num_physical);
    for (const auto& v : row) {
      EPX_CHECK_ARG(v.is_number_integer(), "phy2log row {} has a non-integer entry", l);
      phy2log.push_back(v.get<int32_t>());
    }
  }
  return ExpertLocation(num_layers, num_logical, num_physical, num_gpus, num_nodes, std::move(phy2log));
}

const char* to_string(ReplicaChoice choice) noexcept { return choice == ReplicaChoice::kStatic ? "static" : "dynamic"; }

ReplicaChoice replica_choice_from_string(const std::string& name) {
  if (name == "static") return ReplicaChoice::kStatic;
  if (name == "dynamic") return ReplicaChoice::kDynamic;
  epx::detail::raise(ErrorCode::kInvalidArgument, "replica choice must be 'static' or 'dynamic', got '{}'", name);
}

void choose_replicas(const ExpertLocation& location, int layer, std::span<const int64_t> topk_logical, int num_topk,
                     std::span<int64_t> topk_physical, int gpu, const ReplicaChoiceOptions& options,
                     int64_t first_token) {
  EPX_CHECK_ARG(num_topk >= 1, "num_topk must be >= 1, got {}", num_topk);
  EPX_CHECK_ARG(topk_logical.size() % num_topk == 0, "topk_logical size ({}) must be a multiple of num_topk ({})",
                topk_logical.size(), num_topk);
  EPX_CHECK_ARG(topk_physical.size() == topk_logical.size(), "topk_physical must have {} entries, got {}",
                topk_logical.size(), topk_physical.size());
  EPX_CHECK_ARG(layer >= 0 && layer < location.num_layers(), "layer must be in [0, {}), got {}", location.num_layers(),
                layer);
  EPX_CHECK_ARG(gpu >= 0 && gpu < location.num_gpus(), "gpu must be in [0, {}), got {}", location.num_gpus(), gpu);
  EPX_CHECK_ARG(first_token >= 0, "first_token must be >= 0, got {}", first_token);
  const int64_t num_logical = location.num_logical();
  for (size_t i = 0; i < topk_logical.size(); ++i) {
    EPX_CHECK_ARG(topk_logical[i] >= -1 && topk_logical[i] < num_logical,
                  "topk_logical[{}] must be in [-1, {}), got {}", i, num_logical, topk_logical[i]);
  }
  const int spg = location.slots_per_gpu();
  const uint64_t key = rule::layer_key(options.seed, layer);
  for (size_t i = 0; i < topk_logical.size(); ++i) {
    const int64_t e = topk_logical[i];
    if (e < 0) {
      topk_physical[i] = -1;
      continue;
    }
    const auto reps = location.replicas(layer, static_cast<int>(e));
    const uint64_t token = static_cast<uint64_t>(first_token) + i / num_topk;
    topk_physical[i] = rule::pick_replica(reps.data(), static_cast<int>(reps.size()), spg, gpu, key, e, token,
                                          i % num_topk, options.mode == ReplicaChoice::kDynamic,
                                          options.rank_invariant);
  }
}

}  // namespace epx::eplb
