// `epx tbo split`: where two-batch overlap cuts a batch.
//   epx tbo split --extend 4096,4096,100 [--threshold 0.48]
//   epx tbo split --decode N --tokens-per-seq K
// Output: one line of JSON. Bad input: exit 2 and one line on stderr.
#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "command.h"
#include "core/limits.h"
#include "epx/tbo.h"

namespace epx::cli {
namespace {

// One bound for every token count of this command (--extend lengths and their sum, --decode,
// --tokens-per-seq): the library's kMaxTboTokens (2^40).
constexpr const char* kMaxTokensText = "2^40 = 1099511627776";

int64_t parse_count(const std::string& text, const char* option, int64_t lo) {
  const auto value = parse_decimal_int(text);
  if (!value) {
    throw BadInput(fmt::format("{}: '{}' is not an integer (decimal, in [{}, {}])", option, text, lo, kMaxTokensText));
  }
  if (*value < lo || *value > kMaxTboTokens) {
    throw BadInput(fmt::format("{} must be >= {} and <= {}, got {}", option, lo, kMaxTokensText, *value));
  }
  return *value;
}

void add_split(CLI::App& tbo) {
  auto* cmd = tbo.add_subcommand("split", "Print the split of a batch into two micro-batches");
  struct Args {
    std::string extend, decode, tokens_per_seq, threshold = "0.48";
  };
  auto args = std::make_shared<Args>();
  auto* extend = cmd->add_option("--extend", args->extend,
                                 "Extend lengths of the sequences, comma-separated, each and their sum in [0, 2^40]");
  auto* decode = cmd->add_option("--decode", args->decode, "Decode/verify batch of N tokens, N in [0, 2^40]");
  auto* tps =
      cmd->add_option("--tokens-per-seq", args->tokens_per_seq, "Tokens per sequence (with --decode), in [1, 2^40]");
  auto* threshold =
      cmd->add_option("--threshold", args->threshold, "Two-chunk threshold in [0, 0.5] (with --extend; default 0.48)");
  cmd->callback([=] {
    TboSplit split;
    if (extend->count() > 0 && decode->count() > 0) throw BadInput("give --extend or --decode, not both");
    if (extend->count() > 0) {
      if (tps->count() > 0) throw BadInput("--tokens-per-seq goes with --decode, not --extend");
      std::vector<int64_t> lens;
      int64_t total = 0;
      size_t begin = 0;
      while (true) {
        const size_t comma = args->extend.find(',', begin);
        const size_t len = comma == std::string::npos ? std::string::npos : comma - begin;
        const std::string text = args->extend.substr(begin, len);
        const auto value = parse_decimal_int(text);
        if (!value) {
          throw BadInput(fmt::format("--extend: '{}' (sequence {}) is not an integer (decimal, in [0, {}])", text,
                                     lens.size(), kMaxTokensText));
        }
        if (*value < 0) {
          throw BadInput(fmt::format("--extend: length {} of sequence {} is negative", *value, lens.size()));
        }
        if (*value > kMaxTboTokens) {
          throw BadInput(fmt::format("--extend: length {} of sequence {} exceeds {} (the bound of --decode too)",
                                     *value, lens.size(), kMaxTokensText));
        }
        lens.push_back(*value);
        total += *value;  // <= 2^40 before, <= 2^41 after: no overflow
        if (total > kMaxTboTokens) {
          throw BadInput(fmt::format("--extend: the lengths sum to more than {} tokens (the bound of --decode too)",
                                     kMaxTokensText));
        }
        if (comma == std::string::npos) break;
        begin = comma + 1;
      }
      const auto t = parse_decimal_number(args->threshold);
      if (!t) throw BadInput(fmt::format("--threshold: '{}' is not a number (decimal, in [0, 0.5])", args->threshold));
      if (*t < 0.0 || *t > 0.5) throw BadInput(fmt::format("--threshold must be in [0, 0.5], got {}", *t));
      split = compute_tbo_split_extend(lens, *t);
    } else if (decode->count() > 0) {
      if (tps->count() == 0) throw BadInput("--decode needs --tokens-per-seq");
      if (threshold->count() > 0) throw BadInput("--threshold goes with --extend, not --decode");
      const int64_t n = parse_count(args->decode, "--decode", 0);
      const int64_t k = parse_count(args->tokens_per_seq, "--tokens-per-seq", 1);
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
