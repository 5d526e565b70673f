// `epx dp`: DP-attention planning from the command line.
//   epx dp padding-mode --tokens 3000,200 [--extend] [--graph] [--symmetric-a2a] [--attn-tp N]
//   epx dp groups --world 8 [--attn-dp N] [--attn-cp N] [--moe-ep N] [--moe-dp N]
// Output: one line of JSON. Bad input: exit 2 and one line on stderr.
#include <fmt/format.h>

#include <charconv>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "command.h"
#include "epx/dp.h"

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

void add_padding_mode(CLI::App& dp) {
  auto* cmd = dp.add_subcommand("padding-mode", "Choose MAX_LEN or SUM_LEN for one step and print the gather plan");
  auto tokens = std::make_shared<std::string>();
  auto attn_tp = std::make_shared<std::string>("1");
  auto* tokens_opt = cmd->add_option("--tokens", *tokens, "Tokens of each DP rank, comma-separated (e.g. 3000,200)");
  auto* extend = cmd->add_flag("--extend")->description("Some DP rank runs an extend (prefill) batch");
  auto* graph = cmd->add_flag("--graph")->description("The step replays a CUDA graph");
  auto* symmetric = cmd->add_flag("--symmetric-a2a")->description("The all-to-all backend needs equal shapes");
  cmd->add_option("--attn-tp", *attn_tp, "Attention-TP ranks per DP rank (MAX_LEN slots round up to it; default 1)");
  cmd->callback([=] {
    if (tokens_opt->count() == 0) throw BadInput("dp padding-mode needs --tokens N,N,...");
    const auto counts = parse_list(*tokens, "--tokens");
    for (size_t d = 0; d < counts.size(); ++d) {
      if (counts[d] < 0) throw BadInput(fmt::format("--tokens: count {} of DP rank {} is negative", counts[d], d));
    }
    const int64_t tp = parse_int(*attn_tp, "--attn-tp");
    if (tp < 1 || tp > 1024) throw BadInput(fmt::format("--attn-tp must be in [1, 1024], got {}", tp));
    PaddingModeOptions options;
    options.is_extend_in_batch = extend->count() > 0;
    options.in_cuda_graph = graph->count() > 0;
    options.symmetric_a2a = symmetric->count() > 0;
    const DpPaddingMode mode = choose_padding_mode(counts, options);
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
  auto* world = cmd->add_option("--world", args->world, "Ranks (tp)");
  cmd->add_option("--attn-dp", args->attn_dp, "Attention DP ranks (default 1)");
  cmd->add_option("--attn-cp", args->attn_cp, "Attention CP ranks (default 1)");
  cmd->add_option("--moe-ep", args->moe_ep, "MoE EP ranks (default: world / moe-dp)");
  cmd->add_option("--moe-dp", args->moe_dp, "MoE DP ranks (default 1)");
  cmd->callback([=] {
    if (world->count() == 0) throw BadInput("dp groups needs --world N");
    auto size = [](const std::string& text, const char* option) {
      const int64_t v = parse_int(text, option);
      if (v < 0 || v > 1024) throw BadInput(fmt::format("{} must be in [0, 1024], got {}", option, v));
      return static_cast<int>(v);
    };
    ParallelSizes s;
    s.world_size = size(args->world, "--world");
    s.attn_dp_size = size(args->attn_dp, "--attn-dp");
    s.attn_cp_size = size(args->attn_cp, "--attn-cp");
    s.moe_ep_size = size(args->moe_ep, "--moe-ep");
    s.moe_dp_size = size(args->moe_dp, "--moe-dp");
    const ParallelLayout layout = ParallelLayout::create(s);
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
