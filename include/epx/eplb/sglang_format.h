// SGLang's EPLB files as plain data, so that an engine migrating from SGLang can feed epx its recorded loads and
// placements, and hand epx's placements back to SGLang.
//
// What SGLang reads and writes (python/sglang/srt/eplb/expert_location.py, expert_distribution.py):
//   --init-expert-location  "trivial", a path ending in .pt (torch.load), a path ending in .json, or the JSON text
//                           itself. The object holds either
//                             "physical_to_logical_map": [num_layers][num_physical] logical expert ids, passed as
//                               the only keyword of init_by_mapping, so SGLang rejects any other key; or
//                             "logical_count": [num_layers][num_logical] or [num_passes][num_layers][num_logical]
//                               token counts (a 2-D one is taken as one pass); SGLang sums the passes and runs its
//                               EPLB algorithm on them (init_by_eplb).
//   the recorder's dump     (/dump_expert_distribution_record) torch.save files only: in `stat` / `stat_approx`
//                           mode {"rank", "logical_count": int32 [buffer_size, num_layers, num_logical] (all ranks
//                           summed; unfilled ring entries are zeros), "average_utilization_rate_over_window": float
//                           or None}, written by rank 0; in `per_pass` / `per_token` mode one file per rank with
//                           "records" and "last_physical_to_logical_map". A .pt file needs torch to unpickle, so epx
//                           does not read it: convert it first, e.g.
//                             d = torch.load(path); json.dump({"logical_count": d["logical_count"].tolist()}, f)
//                           (in Python, epx.eplb.load_sglang_logical_count also takes the dict torch.load returns).
// epx reads the JSON forms of both objects (the dump's keys included) and writes the two --init-expert-location
// forms. Parsers take the text; reading a file (regular files of bounded size) is the caller's job.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace epx::eplb {

// Bounds of what the parsers accept: experts (logical or physical) per layer, layers and passes.
inline constexpr int64_t kMaxSglangExperts = int64_t{1} << 20;
inline constexpr int64_t kMaxSglangLayers = int64_t{1} << 20;
inline constexpr int64_t kMaxSglangPasses = int64_t{1} << 24;

// SGLang's "logical_count", summed over its passes as SGLang's init_by_eplb does.
struct SglangLogicalCount {
  int num_passes = 0;  // the first dimension of a 3-D logical_count; 1 for a 2-D one
  int num_layers = 0;
  int num_logical = 0;
  std::vector<int64_t> counts;  // [num_layers * num_logical]: sum over passes
  // The dump's other keys when present and not null.
  std::optional<int64_t> rank;
  std::optional<double> average_utilization_rate_over_window;
};

// Parses a JSON object holding "logical_count" (2-D or 3-D, rectangular, at least one pass, layer and expert;
// every count an integer >= 0 and every sum over passes <= INT64_MAX) and, optionally, "rank" (an integer) and
// "average_utilization_rate_over_window" (a number or null). Other keys are ignored. Throws
// Error(kInvalidArgument) naming the field and index, or the bound, that the text breaks.
SglangLogicalCount parse_sglang_logical_count(const std::string& json_text);

// {"logical_count": [[...] per layer]} of logical_count [num_layers * num_logical] (counts >= 0): a file SGLang's
// --init-expert-location accepts (it rebalances from it) and parse_sglang_logical_count reads back. Throws
// Error(kInvalidArgument) for num_layers < 1, a size that is not a multiple of num_layers, or a negative count.
std::string to_sglang_logical_count_json(std::span<const int64_t> logical_count, int num_layers);

// SGLang's "physical_to_logical_map".
struct SglangExpertLocation {
  int num_layers = 0;
  int num_physical = 0;
  int num_logical_seen = 0;      // the largest id + 1 (the file does not say num_logical; SGLang's model does)
  std::vector<int32_t> phy2log;  // [num_layers * num_physical]
};

// Parses a JSON object holding "physical_to_logical_map": [num_layers][num_physical] integer ids in
// [0, kMaxSglangExperts), rectangular, at least one layer and slot. Other keys are ignored (SGLang itself would
// reject them). Throws Error(kInvalidArgument) naming the field and index or the bound. Whether every logical
// expert has a replica is checked where num_logical is known (the ExpertLocation constructor).
SglangExpertLocation parse_sglang_expert_location(const std::string& json_text);

// {"physical_to_logical_map": [[...] per layer]} of phy2log [num_layers * num_physical], the only key (SGLang
// passes the object's keys as keywords of init_by_mapping, which takes no other). Throws Error(kInvalidArgument)
// for num_layers < 1, a size that is not a multiple of num_layers, or a negative id.
std::string to_sglang_expert_location_json(std::span<const int32_t> phy2log, int num_layers);

}  // namespace epx::eplb
