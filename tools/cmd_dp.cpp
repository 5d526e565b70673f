// `epx dp`: DP-attention planning from the command line.
//   epx dp padding-mode --tokens 3000,200 [--extend] [--graph] [--symmetric-a2a] [--attn-tp N]
//   epx dp groups --world 8 [--attn-dp N] [--attn-cp N] [--moe-ep N] [--moe-dp N]
// Output: one line of JSON. Bad input: exit 2 and one line on stderr.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "command.h"
#include "core/limits.h"
#include "epx/dp.h"
#include "epx/error.h"

namespace epx::cli {
namespace {

using Json = nlohmann::ordered_json;

// {"a": 1, "b": [1, 2]}: the separators of the documented examples.
std::string to_line(const Json& j) {
  std::string out;
  if (j.is_object()) {
    out += "{";
    for (auto it = j.begin(); it != j.end(); ++it) {
      out += fmt::format("{}{}: {}", it == j.begin() ? "" : ", ", Json(it.key()).dump(), to_line(it.value()));
    }
    return out + "}";
  }
  if (j.is_array()) {
    out += "[";
    for (size_t i = 0; i < j.size(); ++i) out += fmt::format("{}{}", i ? ", " : "", to_line(j[i]));
    return out + "]";
  }
  return j.dump();
}

int64_t parse_int(const std::string& text, const char* option) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end) {
    throw BadInput(fmt::format("{}: '{}' is not an integer", option, text));
  }
  return value;
}

std::vector<int64_t> parse_list(const std::string& text, const char* option) {
  std::vector<int64_t> values;
  size_t begin = 0;
  while (true) {
    const size_t comma = text.find(',', begin);
    values.push_back(
        parse_int(text.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin), option));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return values;
}

// ParallelLayout::create, its error message in the CLI's words: the flags instead of the field names.
ParallelLayout create_layout(const ParallelSizes& sizes) {
  try {
    return ParallelLayout::create(sizes);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kInvalidArgument) throw;
    std::string message = e.what();
    message.erase(0, message.find(": ") + 2);  // "epx invalid_argument: "
    static const std::pair<const char*, const char*> kNames[] = {
        {"world_size", "--world"},         {"attn_dp_size", "--attn-dp"}, {"attn_cp_size", "--attn-cp"},
        {"moe_ep_size", "--moe-ep"},       {"moe_dp_size", "--moe-dp"},   {"attn_tp_size", "the attention TP size"},
        {"moe_tp_size", "the MoE TP size"}};
    for (const auto& [field, flag] : kNames) {
      for (size_t at = message.find(field); at != std::string::npos; at = message.find(field, at)) {
        message.replace(at, std::strlen(field), flag);
      }
    }
    throw BadInput(message);
  }
}

void add_padding_mode(CLI::App& dp) {
  auto* cmd = dp.add_subcommand("padding-mode", "Choose MAX_LEN or SUM_LEN for one step and print the gather plan");
  auto tokens = std::make_shared<std::string>();
  auto attn_tp = std::make_shared<std::string>("1");
  auto* tokens_opt =
      cmd->add_option("--tokens", *tokens,
                      "Tokens of each DP rank, comma-separated (e.g. 3000,200); 1 to 1024 ranks, the sum in [0, 2^40]");
  auto* extend = cmd->add_flag("--extend")->description("Some DP rank runs an extend (prefill) batch");
  auto* graph = cmd->add_flag("--graph")->description("The step replays a CUDA graph");
  auto* symmetric = cmd->add_flag("--symmetric-a2a")->description("The all-to-all backend needs equal shapes");
  cmd->add_option("--attn-tp", *attn_tp, "Attention-TP ranks per DP rank (MAX_LEN slots round up to it; default 1)");
  cmd->callback([=] {
    if (tokens_opt->count() == 0) throw BadInput("dp padding-mode needs --tokens N,N,...");
    const auto counts = parse_list(*tokens, "--tokens");
    if (counts.size() > static_cast<size_t>(kMaxDpWorldSize)) {
      throw BadInput(fmt::format("--tokens names {} DP ranks, more than {}", counts.size(), kMaxDpWorldSize));
    }
    int64_t total = 0;
    for (size_t d = 0; d < counts.size(); ++d) {
      if (counts[d] < 0) throw BadInput(fmt::format("--tokens: count {} of DP rank {} is negative", counts[d], d));
      if (counts[d] > kMaxDpBufferRows) {
        throw BadInput(fmt::format("--tokens: count {} of DP rank {} exceeds 2^40", counts[d], d));
      }
      total += counts[d];  // <= 1024 * 2^40: no overflow
    }
    if (total > kMaxDpBufferRows) {
      throw BadInput(fmt::format("--tokens: the counts sum to {}, more than 2^40 rows", total));
    }
    const int64_t tp = parse_int(*attn_tp, "--attn-tp");
    if (tp < 1 || tp > kMaxDpWorldSize) {
      throw BadInput(fmt::format("--attn-tp must be in [1, {}], got {}", kMaxDpWorldSize, tp));
    }
    PaddingModeOptions options;
    options.is_extend_in_batch = extend->count() > 0;
    options.in_cuda_graph = graph->count() > 0;
    options.symmetric_a2a = symmetric->count() > 0;
    const DpPaddingMode mode = choose_padding_mode(counts, options);
    if (mode == DpPaddingMode::kMaxLen) {
      const int64_t max = *std::max_element(counts.begin(), counts.end());
      const int64_t slot = (max + tp - 1) / tp * tp;
      if (slot > kMaxDpBufferRows / static_cast<int64_t>(counts.size())) {
        throw BadInput(
            fmt::format("--tokens: MAX_LEN needs {} DP ranks x {} rows (the largest count rounded up to "
                        "--attn-tp {}), more than 2^40 rows",
                        counts.size(), slot, tp));
      }
    }
    const DpGatherPlan plan = plan_dp_gather(counts, mode, static_cast<int>(tp));
    Json j;
    j["mode"] = to_string(plan.mode);
    j["buffer_len"] = plan.buffer_len;
    j["offsets"] = plan.offsets;
    std::printf("%s\n", to_line(j).c_str());
  });
}

void add_groups(CLI::App& dp) {
  auto* cmd = dp.add_subcommand("groups", "Print the attention TP/CP/DP and MoE TP/EP/DP groups of a rank layout");
  struct Args {
    std::string world, attn_dp = "1", attn_cp = "1", moe_ep = "0", moe_dp = "1";
  };
  auto args = std::make_shared<Args>();
  auto* world = cmd->add_option("--world", args->world, "Ranks (tp), in [1, 1024]");
  cmd->add_option("--attn-dp", args->attn_dp, "Attention DP ranks, in [1, world] (default 1)");
  cmd->add_option("--attn-cp", args->attn_cp, "Attention CP ranks, in [1, world] (default 1)");
  cmd->add_option("--moe-ep", args->moe_ep, "MoE EP ranks, in [0, world] (default 0: world / moe-dp)");
  cmd->add_option("--moe-dp", args->moe_dp, "MoE DP ranks, in [1, world] (default 1)");
  cmd->callback([=] {
    if (world->count() == 0) throw BadInput("dp groups needs --world N");
    auto size = [](const std::string& text, const char* option, int64_t lo, int64_t hi, const char* why) {
      const int64_t v = parse_int(text, option);
      if (v < lo || v > hi) throw BadInput(fmt::format("{} must be in [{}, {}]{}, got {}", option, lo, hi, why, v));
      return static_cast<int>(v);
    };
    ParallelSizes s;
    s.world_size = size(args->world, "--world", 1, kMaxDpWorldSize, "");
    s.attn_dp_size = size(args->attn_dp, "--attn-dp", 1, s.world_size, " (--world)");
    s.attn_cp_size = size(args->attn_cp, "--attn-cp", 1, s.world_size, " (--world)");
    s.moe_ep_size = size(args->moe_ep, "--moe-ep", 0, s.world_size, " (--world; 0: derive)");
    s.moe_dp_size = size(args->moe_dp, "--moe-dp", 1, s.world_size, " (--world)");
    const ParallelLayout layout = create_layout(s);
    const ParallelSizes& d = layout.sizes();
    Json j;
    j["sizes"] = Json{{"world", d.world_size},     {"attn_tp", d.attn_tp_size}, {"attn_cp", d.attn_cp_size},
                      {"attn_dp", d.attn_dp_size}, {"moe_tp", d.moe_tp_size},   {"moe_ep", d.moe_ep_size},
                      {"moe_dp", d.moe_dp_size}};
    for (ParallelGroupKind kind : {ParallelGroupKind::kAttnTp, ParallelGroupKind::kAttnCp, ParallelGroupKind::kAttnDp,
                                   ParallelGroupKind::kMoeTp, ParallelGroupKind::kMoeEp, ParallelGroupKind::kMoeDp}) {
      j[to_string(kind)] = layout.groups(kind);
    }
    std::printf("%s\n", to_line(j).c_str());
  });
}

void add_dp(CLI::App& app) {
  auto* dp = app.add_subcommand("dp", "DP attention: padding mode, gather plan, rank groups");
  dp->require_subcommand(1);
  add_padding_mode(*dp);
  add_groups(*dp);
}

const bool kRegistered = register_command(40, add_dp);

}  // namespace
}  // namespace epx::cli
