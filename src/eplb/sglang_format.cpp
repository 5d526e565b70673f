// SGLang's EPLB JSON files (include/epx/eplb/sglang_format.h).
#include "epx/eplb/sglang_format.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/check.h"

namespace epx::eplb {

namespace {

using Json = nlohmann::json;

Json parse_object(const std::string& text, const char* what, const char* key) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    epx::detail::raise(ErrorCode::kInvalidArgument, "SGLang {} JSON does not parse: {}", what, e.what());
  }
  EPX_CHECK_ARG(j.is_object() && j.contains(key), "SGLang {} JSON must be an object with field '{}'", what, key);
  return j;
}

// `a` as an array of `expected` (>= 1) entries, or of any non-zero count when expected < 0. `name` names it.
const Json& array_of(const Json& a, int64_t expected, int64_t bound, const std::string& name, const char* unit) {
  EPX_CHECK_ARG(a.is_array(), "{} must be an array of {}", name, unit);
  const auto n = static_cast<int64_t>(a.size());
  EPX_CHECK_ARG(n >= 1, "{} holds no {}", name, unit);
  EPX_CHECK_ARG(n <= bound, "{} holds {} {}, more than the bound {}", name, n, unit, bound);
  EPX_CHECK_ARG(expected < 0 || n == expected, "{} holds {} {}, the first row holds {} (rows must be equal)", name, n,
                unit, expected);
  return a;
}

// A JSON integer in [0, max] (read as the widest type nlohmann holds, so large values are rejected, not cut).
std::optional<int64_t> non_negative(const Json& v, int64_t max) {
  if (!v.is_number_integer()) return std::nullopt;
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    return u <= static_cast<uint64_t>(max) ? std::optional<int64_t>(static_cast<int64_t>(u)) : std::nullopt;
  }
  const auto s = v.get<int64_t>();
  return s >= 0 && s <= max ? std::optional<int64_t>(s) : std::nullopt;
}

template <typename T>
std::string rows_json(const char* key, std::span<const T> flat, int num_layers) {
  EPX_CHECK_ARG(num_layers >= 1, "{}: num_layers must be >= 1, got {}", key, num_layers);
  EPX_CHECK_ARG(flat.size() % static_cast<size_t>(num_layers) == 0,
                "{}: {} values do not divide into num_layers = {} rows", key, flat.size(), num_layers);
  const size_t width = flat.size() / static_cast<size_t>(num_layers);
  Json rows = Json::array();
  for (int l = 0; l < num_layers; ++l) {
    Json row = Json::array();
    for (size_t i = 0; i < width; ++i) {
      const T v = flat[static_cast<size_t>(l) * width + i];
      EPX_CHECK_ARG(v >= 0, "{}[{}][{}] = {} must be >= 0", key, l, i, v);
      row.push_back(v);
    }
    rows.push_back(std::move(row));
  }
  return Json{{key, std::move(rows)}}.dump();
}

}  // namespace

SglangLogicalCount parse_sglang_logical_count(const std::string& json_text) {
  const Json j = parse_object(json_text, "logical count", "logical_count");
  SglangLogicalCount out;
  if (j.contains("rank") && !j["rank"].is_null()) {
    EPX_CHECK_ARG(j["rank"].is_number_integer(), "SGLang logical count field 'rank' must be an integer, got {}",
                  j["rank"].dump());
    out.rank = j["rank"].get<int64_t>();
  }
  if (j.contains("average_utilization_rate_over_window")) {
    const Json& v = j["average_utilization_rate_over_window"];
    EPX_CHECK_ARG(v.is_null() || v.is_number(),
                  "SGLang logical count field 'average_utilization_rate_over_window' must be a number or null, got {}",
                  v.dump());
    if (v.is_number()) out.average_utilization_rate_over_window = v.get<double>();
  }
  const Json& top = array_of(j["logical_count"], -1, kMaxSglangPasses, "logical_count", "rows");
  // NOTE: 3-D when the first row's first entry is itself an array (SGLang's [buffer_size, layers, experts]).
  const bool three_d = top[0].is_array() && !top[0].empty() && top[0][0].is_array();
  const int64_t num_passes = three_d ? static_cast<int64_t>(top.size()) : 1;
  int64_t num_layers = -1, num_logical = -1;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  for (int64_t p = 0; p < num_passes; ++p) {
    const std::string pass_name = three_d ? fmt::format("logical_count[{}]", p) : "logical_count";
    const Json& layers = array_of(three_d ? top[p] : top, num_layers, kMaxSglangLayers, pass_name, "layers");
    if (num_layers < 0) {
      num_layers = static_cast<int64_t>(layers.size());
    }
    for (int64_t l = 0; l < num_layers; ++l) {
      const std::string row_name = fmt::format("{}[{}]", pass_name, l);
      const Json& row = array_of(layers[l], num_logical, kMaxSglangExperts, row_name, "experts");
      if (num_logical < 0) {
        num_logical = static_cast<int64_t>(row.size());
        EPX_CHECK_ARG(num_layers * num_logical <= kMaxSglangExperts * 1024,
                      "logical_count: {} layers x {} experts exceed the bound of {} counts", num_layers, num_logical,
                      kMaxSglangExperts * 1024);
        out.counts.assign(static_cast<size_t>(num_layers * num_logical), 0);
      }
      for (int64_t e = 0; e < num_logical; ++e) {
        const auto v = non_negative(row[e], kMax);
        EPX_CHECK_ARG(v.has_value(), "{}[{}] = {} must be an integer in [0, 2^63) (SGLang records int32 counts)",
                      row_name, e, row[e].dump());
        int64_t& sum = out.counts[static_cast<size_t>(l * num_logical + e)];
        EPX_CHECK_ARG(*v <= kMax - sum, "logical_count: the sum over passes of [{}][{}] exceeds INT64_MAX", l, e);
        sum += *v;
      }
    }
  }
  out.num_passes = static_cast<int>(num_passes);
  out.num_layers = static_cast<int>(num_layers);
  out.num_logical = static_cast<int>(num_logical);
  return out;
}

std::string to_sglang_logical_count_json(std::span<const int64_t> logical_count, int num_layers) {
  return rows_json<int64_t>("logical_count", logical_count, num_layers);
}

SglangExpertLocation parse_sglang_expert_location(const std::string& json_text) {
  const Json j = parse_object(json_text, "expert location", "physical_to_logical_map");
  const Json& layers =
      array_of(j["physical_to_logical_map"], -1, kMaxSglangLayers, "physical_to_logical_map", "layers");
  SglangExpertLocation out;
  out.num_layers = static_cast<int>(layers.size());
  int64_t num_physical = -1;
  int32_t max_id = -1;
  for (int l = 0; l < out.num_layers; ++l) {
    const std::string row_name = fmt::format("physical_to_logical_map[{}]", l);
    const Json& row = array_of(layers[l], num_physical, kMaxSglangExperts, row_name, "slots");
    if (num_physical < 0) {
      num_physical = static_cast<int64_t>(row.size());
      out.phy2log.reserve(static_cast<size_t>(out.num_layers * num_physical));
    }
    for (int64_t s = 0; s < num_physical; ++s) {
      const auto v = non_negative(row[s], kMaxSglangExperts - 1);
      EPX_CHECK_ARG(v.has_value(), "{}[{}] = {} must be an integer logical expert id in [0, {})", row_name, s,
                    row[s].dump(), kMaxSglangExperts);
      out.phy2log.push_back(static_cast<int32_t>(*v));
      max_id = std::max(max_id, static_cast<int32_t>(*v));
    }
  }
  out.num_physical = static_cast<int>(num_physical);
  out.num_logical_seen = max_id + 1;
  return out;
}

std::string to_sglang_expert_location_json(std::span<const int32_t> phy2log, int num_layers) {
  return rows_json<int32_t>("physical_to_logical_map", phy2log, num_layers);
}

}  // namespace epx::eplb
