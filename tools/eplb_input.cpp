// The input files of `epx eplb plan` (tools/eplb_input.h), moved out of cmd_eplb.cpp unchanged.
#include "eplb_input.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "command.h"
#include "epx/eplb/sglang_format.h"
#include "epx/error.h"

namespace epx::cli {

namespace {

// The library's message without its "epx invalid_argument: " prefix (the CLI's line names the flag instead).
std::string library_message(const Error& e) {
  std::string message = e.what();
  const std::string prefix = std::string("epx ") + to_string(e.code()) + ": ";
  if (message.rfind(prefix, 0) == 0) message.erase(0, prefix.size());
  return message;
}

}  // namespace

std::vector<std::vector<double>> parse_weights(const std::string& text, const std::string& path) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && (text[first] == '{' || text[first] == '[')) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw BadInput("--weights '" + path + "' is not valid JSON: " + e.what());
    }
    if (j.is_object() && j.contains("logical_count") && !j.contains("weights")) {
      // SGLang's recorded distribution (its dump converted to JSON, or an --init-expert-location file): the passes
      // are summed, as SGLang's init_by_eplb does. NOTE: the document is dropped first, so that one parsed copy of
      // the text is held at a time (kParseBytesPerByte).
      j = nlohmann::json();
      eplb::SglangLogicalCount count;
      try {
        count = eplb::parse_sglang_logical_count(text);
      } catch (const Error& e) {
        throw BadInput(fmt::format("--weights '{}' (SGLang logical_count): {}", path, library_message(e)));
      }
      std::vector<std::vector<double>> out(static_cast<size_t>(count.num_layers));
      for (int l = 0; l < count.num_layers; ++l) {
        const auto first = count.counts.begin() + static_cast<int64_t>(l) * count.num_logical;
        out[l].assign(first, first + count.num_logical);
      }
      return out;
    }
    const nlohmann::json& rows = j.is_object() && j.contains("weights") ? j["weights"] : j;
    if (!rows.is_array()) throw BadInput("--weights JSON must hold an array of rows in field 'weights'");
    std::vector<std::vector<double>> out;
    for (size_t l = 0; l < rows.size(); ++l) {
      if (!rows[l].is_array()) throw BadInput("--weights row " + std::to_string(l) + " is not an array");
      std::vector<double> row;
      for (size_t e = 0; e < rows[l].size(); ++e) {
        if (!rows[l][e].is_number()) {
          throw BadInput("--weights[" + std::to_string(l) + "][" + std::to_string(e) + "] is not a number");
        }
        row.push_back(rows[l][e].get<double>());
      }
      out.push_back(std::move(row));
    }
    return out;
  }
  std::vector<std::vector<double>> out;
  std::istringstream lines(text);
  std::string line;
  int64_t line_no = 0;
  while (std::getline(lines, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    std::vector<double> row;
    size_t begin = 0;
    for (int64_t col = 1;; ++col) {
      const size_t comma = line.find(',', begin);
      std::string cell = line.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
      const size_t lo = cell.find_first_not_of(" \t\r"), hi = cell.find_last_not_of(" \t\r");
      cell = lo == std::string::npos ? "" : cell.substr(lo, hi - lo + 1);
      const auto v = parse_decimal_number(cell);
      if (!v) {
        throw BadInput(fmt::format("--weights '{}' line {} column {}: '{}' is not a number (plain decimal)", path,
                                   line_no, col, cell));
      }
      row.push_back(*v);
      if (comma == std::string::npos) break;
      begin = comma + 1;
    }
    out.push_back(std::move(row));
  }
  return out;
}

// The library's weight checks, in the CLI's words, plus row sums: a row whose sum overflows a double
// would make every load comparison and the balancedness meaningless (inf / inf).
void check_weights(const std::vector<std::vector<double>>& weight, const std::string& path) {
  if (weight.empty()) throw BadInput("--weights '" + path + "' holds no layers");
  const size_t num_logical = weight[0].size();
  if (num_logical == 0) throw BadInput("--weights '" + path + "': row 0 holds no experts");
  for (size_t l = 0; l < weight.size(); ++l) {
    if (weight[l].size() != num_logical) {
      throw BadInput(fmt::format("--weights '{}' is ragged: row {} has {} experts, row 0 has {}", path, l,
                                 weight[l].size(), num_logical));
    }
    double sum = 0;
    for (size_t e = 0; e < num_logical; ++e) {
      const double v = weight[l][e];
      if (!std::isfinite(v) || v < 0) {
        throw BadInput(fmt::format("--weights '{}': weight[{}][{}] must be finite and >= 0, got {}", path, l, e, v));
      }
      sum += v;
    }
    if (!std::isfinite(sum)) {
      throw BadInput(
          fmt::format("--weights '{}': row {} sums to more than the largest double ({:g}); scale the "
                      "loads down",
                      path, l, std::numeric_limits<double>::max()));
    }
  }
}

namespace {

// SGLang's --init-expert-location file ({"physical_to_logical_map": [[...]]}), checked as parse_current checks
// its own form.
std::vector<int32_t> parse_current_sglang(const std::string& text, int num_layers, int num_logical, int num_physical) {
  eplb::SglangExpertLocation loc;
  try {
    loc = eplb::parse_sglang_expert_location(text);
  } catch (const Error& e) {
    throw BadInput(fmt::format("--current (SGLang physical_to_logical_map): {}", library_message(e)));
  }
  if (loc.num_layers != num_layers) {
    throw BadInput(
        fmt::format("--current physical_to_logical_map has {} layers, --weights has {}", loc.num_layers, num_layers));
  }
  if (loc.num_physical != num_physical) {
    throw BadInput(fmt::format("--current physical_to_logical_map rows have {} slots, --replicas is {}",
                               loc.num_physical, num_physical));
  }
  std::vector<char> present(num_logical);
  for (int l = 0; l < num_layers; ++l) {
    std::fill(present.begin(), present.end(), 0);
    for (int s = 0; s < num_physical; ++s) {
      const int32_t id = loc.phy2log[static_cast<size_t>(l) * num_physical + s];
      if (id >= num_logical) {
        throw BadInput(fmt::format(
            "--current physical_to_logical_map[{}][{}] = {} is outside [0, {}) (the logical experts of --weights)", l,
            s, id, num_logical));
      }
      present[id] = 1;
    }
    const auto missing = std::find(present.begin(), present.end(), 0);
    if (missing != present.end()) {
      throw BadInput(fmt::format(
          "--current physical_to_logical_map row {} holds no replica of logical expert {} (each needs >= 1)", l,
          missing - present.begin()));
    }
  }
  return std::move(loc.phy2log);
}

}  // namespace

std::vector<int32_t> parse_current(const std::string& text, int num_layers, int num_logical, int num_physical) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw BadInput(std::string("--current is not valid JSON: ") + e.what());
  }
  if (j.is_object() && j.contains("physical_to_logical_map") && !j.contains("phy2log")) {
    j = nlohmann::json();  // one parsed copy at a time
    return parse_current_sglang(text, num_layers, num_logical, num_physical);
  }
  if (!j.is_object() || !j.contains("phy2log") || !j["phy2log"].is_array()) {
    throw BadInput("--current JSON needs a field 'phy2log' with one row per layer");
  }
  const auto& rows = j["phy2log"];
  if (rows.size() != static_cast<size_t>(num_layers)) {
    throw BadInput("--current has " + std::to_string(rows.size()) + " layers, --weights has " +
                   std::to_string(num_layers));
  }
  std::vector<int32_t> out;
  std::vector<char> present(num_logical);
  for (size_t l = 0; l < rows.size(); ++l) {
    if (!rows[l].is_array() || rows[l].size() != static_cast<size_t>(num_physical)) {
      throw BadInput("--current phy2log row " + std::to_string(l) +
                     " must have --replicas = " + std::to_string(num_physical) + " entries");
    }
    std::fill(present.begin(), present.end(), 0);
    for (size_t s = 0; s < rows[l].size(); ++s) {
      const auto& v = rows[l][s];
      if (!v.is_number_integer()) throw BadInput("--current phy2log row " + std::to_string(l) + " has a non-integer");
      // NOTE: read as the widest type nlohmann holds, so ids beyond int32 are rejected, not truncated.
      const bool in_range = v.is_number_unsigned() ? v.get<uint64_t>() < static_cast<uint64_t>(num_logical)
                                                   : v.get<int64_t>() >= 0 && v.get<int64_t>() < num_logical;
      if (!in_range) {
        throw BadInput(
            fmt::format("--current phy2log[{}][{}] = {} is outside [0, {}) (the logical experts of "
                        "--weights)",
                        l, s, v.dump(), num_logical));
      }
      const auto id = static_cast<int32_t>(v.get<int64_t>());
      present[id] = 1;
      out.push_back(id);
    }
    const auto missing = std::find(present.begin(), present.end(), 0);
    if (missing != present.end()) {
      throw BadInput(fmt::format("--current phy2log row {} holds no replica of logical expert {} (each needs >= 1)", l,
                                 missing - present.begin()));
    }
  }
  return out;
}

}  // namespace epx::cli
