// `epx tbo split`: where two-batch overlap cuts a batch.
//   epx tbo split --extend 4096,4096,100 [--threshold 0.48]
//   epx tbo split --decode N --tokens-per-seq K
// Output: one line of JSON. Bad input: exit 2 and one line on stderr.
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "command.h"
#include "epx/tbo.h"

namespace epx::cli {
namespace {

int64_t parse_int(const std::string& text, const char* option) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end) throw BadInput(fmt::format("{}: '{}' is not an integer", option, text));
  return value;
}

double parse_double(const std::string& text, const char* option) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(value)) {
    throw BadInput(fmt::format("{}: '{}' is not a number", option, text));
  }
  return value;
}

void add_split(CLI::App& tbo) {
  auto* cmd = tbo.add_subcommand("split", "Print the split of a batch into two micro-batches");
  struct Args {
    std::string extend, decode, tokens_per_seq, threshold = "0.48";
  };
  auto args = std::make_shared<Args>();
  auto* extend = cmd->add_option("--extend", args->extend, "Extend lengths of the sequences, comma-separated");
  auto* decode = cmd->add_option("--decode", args->decode, "Decode/verify batch of N tokens");
  auto* tps = cmd->add_option("--tokens-per-seq", args->tokens_per_seq, "Tokens per sequence (with --decode)");
  auto* threshold =
      cmd->add_option("--threshold", args->threshold, "Two-chunk threshold in [0, 0.5] (with --extend; default 0.48)");
  cmd->callback([=] {
    TboSplit split;
    if (extend->count() > 0 && decode->count() > 0) throw BadInput("give --extend or --decode, not both");
    if (extend->count() > 0) {
      if (tps->count() > 0) throw BadInput("--tokens-per-seq goes with --decode, not --extend");
      std::vector<int64_t> lens;
      size_t begin = 0;
      while (true) {
        const size_t comma = args->extend.find(',', begin);
        const size_t len = comma == std::string::npos ? std::string::npos : comma - begin;
        lens.push_back(parse_int(args->extend.substr(begin, len), "--extend"));
        if (lens.back() < 0) {
          throw BadInput(fmt::format("--extend: length {} of sequence {} is negative", lens.back(), lens.size() - 1));
        }
        if (comma == std::string::npos) break;
        begin = comma + 1;
      }
      const double t = parse_double(args->threshold, "--threshold");
      if (t < 0.0 || t > 0.5) throw BadInput(fmt::format("--threshold must be in [0, 0.5], got {}", t));
      split = compute_tbo_split_extend(lens, t);
    } else if (decode->count() > 0) {
      if (tps->count() == 0) throw BadInput("--decode needs --tokens-per-seq");
      if (threshold->count() > 0) throw BadInput("--threshold goes with --extend, not --decode");
      const int64_t n = parse_int(args->decode, "--decode");
      const int64_t k = parse_int(args->tokens_per_seq, "--tokens-per-seq");
      if (n < 0) throw BadInput(fmt::format("--decode: token count must be >= 0, got {}", n));
      if (k < 1) throw BadInput(fmt::format("--tokens-per-seq must be >= 1, got {}", k));
      if (n % k != 0) throw BadInput(fmt::format("--decode {} must be a multiple of --tokens-per-seq {}", n, k));
      split = compute_tbo_split_decode(n, k);
    } else {
      throw BadInput("tbo split needs --extend LENS or --decode N --tokens-per-seq K");
    }
    // The separators of the documented example.
    std::printf("%s\n", fmt::format(R"({{"split_seq_index": {}, "split_token_index": {}, "two_chunk": {}}})",
                                    split.split_seq_index, split.split_token_index, split.two_chunk)
                            .c_str());
  });
}

void add_tbo(CLI::App& app) {
  auto* tbo = app.add_subcommand("tbo", "Two-batch overlap: split rules");
  tbo->require_subcommand(1);
  add_split(*tbo);
}

const bool kRegistered = register_command(50, add_tbo);

}  // namespace
}  // namespace epx::cli
