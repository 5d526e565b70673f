// Fuzzes the input files of `epx eplb plan` (tools/eplb_input.h): the load file (--weights, JSON or CSV) and
// the current placement (--current, JSON), through the functions the CLI calls.
//
// Input: first byte 'c': a --current file, the next three bytes pick the shape (layers, logical experts,
// physical experts), the rest is the text; otherwise the rest after the first byte is a --weights file.
//
// Oracle: parsing either throws BadInput whose message starts with the flag, or gives values that hold
// what the CLI relies on: weights a non-empty rectangle of finite values >= 0 with finite row sums (and, for
// CSV, exactly the cells of the documented grammar, as an independent reader sees them); a placement of the
// asked shape whose ids are in range and cover every logical expert in every row. Any other exception, a
// crash, UB or a leak is a finding.
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "command.h"
#include "eplb_input.h"

namespace epx::cli {
namespace {

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "eplb_input_fuzz: invariant broken: %s\n", what.c_str());
  std::abort();
}

#define FUZZ_ASSERT(cond, ...)                               \
  do {                                                       \
    if (!(cond)) ::epx::cli::fail(fmt::format(__VA_ARGS__)); \
  } while (0)

bool is_blank(char c) { return c == ' ' || c == '\t' || c == '\r'; }

// The documented CSV cell: [-+]? (digits [. digits?] | . digits) ([eE] [-+]? digits)?, written afresh.
bool is_plain_decimal(const std::string& cell) {
  size_t i = 0, n = cell.size();
  auto digits = [&] {
    size_t k = 0;
    while (i < n && cell[i] >= '0' && cell[i] <= '9') ++i, ++k;
    return k;
  };
  if (i < n && (cell[i] == '+' || cell[i] == '-')) ++i;
  size_t mantissa = digits();
  if (i < n && cell[i] == '.') {
    ++i;
    mantissa += digits();
  }
  if (mantissa == 0) return false;
  if (i < n && (cell[i] == 'e' || cell[i] == 'E')) {
    ++i;
    if (i < n && (cell[i] == '+' || cell[i] == '-')) ++i;
    if (digits() == 0) return false;
  }
  return i == n;
}

// The CSV as an independent reader sees it: lines split at '\n', blank lines skipped, cells split at ',' and
// trimmed of spaces, tabs and '\r'. False when a cell is not a finite plain decimal.
bool read_csv(const std::string& text, std::vector<std::vector<double>>& rows) {
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(begin, end - begin);
    begin = end + 1;
    bool blank = true;
    for (char c : line) blank = blank && is_blank(c);
    if (blank) continue;
    std::vector<double> row;
    size_t cell_begin = 0;
    while (true) {
      size_t comma = line.find(',', cell_begin);
      std::string cell = line.substr(cell_begin, comma == std::string::npos ? std::string::npos : comma - cell_begin);
      while (!cell.empty() && is_blank(cell.back())) cell.pop_back();
      size_t lead = 0;
      while (lead < cell.size() && is_blank(cell[lead])) ++lead;
      cell.erase(0, lead);
      if (!is_plain_decimal(cell)) return false;
      const double v = std::strtod(cell.c_str(), nullptr);
      if (!std::isfinite(v)) return false;
      row.push_back(v);
      if (comma == std::string::npos) break;
      cell_begin = comma + 1;
    }
    rows.push_back(std::move(row));
  }
  return true;
}

bool looks_like_json(const std::string& text) {
  const size_t first = text.find_first_not_of(" \t\r\n");
  return first != std::string::npos && (text[first] == '{' || text[first] == '[');
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

void fuzz_weights(const std::string& text) {
  std::vector<std::vector<double>> weight;
  bool parsed = false;
  try {
    weight = parse_weights(text, "w");
    parsed = true;
    check_weights(weight, "w");
  } catch (const BadInput& e) {
    FUZZ_ASSERT(std::string(e.what()).rfind("--weights", 0) == 0, "message '{}'", e.what());
    if (!parsed && !looks_like_json(text)) {
      std::vector<std::vector<double>> rows;
      FUZZ_ASSERT(!read_csv(text, rows), "CSV rejected ({}) but every cell is a plain decimal", e.what());
    }
    return;
  }
  FUZZ_ASSERT(!weight.empty() && !weight[0].empty(), "empty weights accepted");
  for (const auto& row : weight) {
    FUZZ_ASSERT(row.size() == weight[0].size(), "ragged weights accepted");
    double sum = 0;
    for (double v : row) {
      FUZZ_ASSERT(std::isfinite(v) && v >= 0, "weight {} accepted", v);
      sum += v;
    }
    FUZZ_ASSERT(std::isfinite(sum), "row sum {} accepted", sum);
  }
  if (!looks_like_json(text)) {
    std::vector<std::vector<double>> rows;
    FUZZ_ASSERT(read_csv(text, rows), "CSV accepted with a cell that is not a plain decimal");
    FUZZ_ASSERT(rows.size() == weight.size(), "CSV: {} rows read, {} accepted", rows.size(), weight.size());
    for (size_t l = 0; l < rows.size(); ++l) {
      for (size_t e = 0; e < rows[l].size(); ++e) {
        FUZZ_ASSERT(same_bits(rows[l][e], weight[l][e]), "CSV cell [{}][{}]: {} read, {} accepted", l, e, rows[l][e],
                    weight[l][e]);
      }
    }
  }
}

void fuzz_current(const uint8_t* shape, const std::string& text) {
  const int num_layers = 1 + shape[0] % 4;
  const int num_logical = 1 + shape[1] % 8;
  const int num_physical = num_logical + shape[2] % 8;
  std::vector<int32_t> phy2log;
  try {
    phy2log = parse_current(text, num_layers, num_logical, num_physical);
  } catch (const BadInput& e) {
    FUZZ_ASSERT(std::string(e.what()).rfind("--current", 0) == 0, "message '{}'", e.what());
    return;
  }
  FUZZ_ASSERT(phy2log.size() == static_cast<size_t>(num_layers) * num_physical, "{} ids for {} x {}", phy2log.size(),
              num_layers, num_physical);
  for (int l = 0; l < num_layers; ++l) {
    std::vector<bool> present(num_logical);
    for (int s = 0; s < num_physical; ++s) {
      const int32_t id = phy2log[static_cast<size_t>(l) * num_physical + s];
      FUZZ_ASSERT(id >= 0 && id < num_logical, "id {} accepted with {} logical experts", id, num_logical);
      present[id] = true;
    }
    for (int e = 0; e < num_logical; ++e) FUZZ_ASSERT(present[e], "row {} lacks logical expert {}", l, e);
  }
}

}  // namespace
}  // namespace epx::cli

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] == 'c') {
    if (size < 4) return 0;
    epx::cli::fuzz_current(data + 1, std::string(reinterpret_cast<const char*>(data + 4), size - 4));
  } else {
    epx::cli::fuzz_weights(std::string(reinterpret_cast<const char*>(data + 1), size - 1));
  }
  return 0;
}
