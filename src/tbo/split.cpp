// TBO split rules and the children's per-sequence fields.
#include <cmath>
#include <cstdlib>
#include <numeric>

#include "core/check.h"
#include "core/limits.h"
#include "epx/tbo.h"

namespace epx {

namespace {

int64_t balanced_split(std::span<const int64_t> lens, int64_t total) {
  int64_t left = 0, best = 0;
  int64_t min_diff = INT64_MAX;
  for (size_t i = 1; i < lens.size(); ++i) {
    left += lens[i - 1];
    const int64_t diff = std::llabs(left - (total - left));
    // Past the balance point the difference only grows: stop at the first increase.
    if (diff > min_diff) break;
    min_diff = diff;
    best = static_cast<int64_t>(i);
  }
  return best;
}

int64_t first_over_half(std::span<const int64_t> lens, int64_t total) {
  int64_t left = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    left += lens[i];
    if (left > total / 2) return static_cast<int64_t>(i);
  }
  return 0;
}

}  // namespace

TboSplit compute_tbo_split_extend(std::span<const int64_t> extend_lens, double threshold) {
  EPX_CHECK_ARG(!extend_lens.empty(), "extend_lens must hold at least one sequence");
  EPX_CHECK_ARG(std::isfinite(threshold) && threshold >= 0.0 && threshold <= 0.5,
                "threshold must be in [0, 0.5], got {}", threshold);
  int64_t total = 0;
  for (size_t i = 0; i < extend_lens.size(); ++i) {
    EPX_CHECK_ARG(extend_lens[i] >= 0 && extend_lens[i] <= kMaxTboTokens,
                  "extend_lens[{}] must be in [0, 2^40], got {}", i, extend_lens[i]);
    total += extend_lens[i];
  }
  EPX_CHECK_ARG(total <= kMaxTboTokens, "the sum of extend_lens must be <= 2^40, got {}", total);
  TboSplit split;
  split.split_seq_index = balanced_split(extend_lens, total);
  split.split_token_index =
      std::accumulate(extend_lens.begin(), extend_lens.begin() + split.split_seq_index, int64_t{0});
  const double left = static_cast<double>(split.split_token_index);
  const double whole = static_cast<double>(total);
  if (left < whole * threshold || left > whole * (1.0 - threshold)) {
    const int64_t cut_seq = first_over_half(extend_lens, total);
    // NOTE: child A would hold cut_seq + 1 sequences (the cut one included) and total / 2 tokens; the
    // consumers need at least one token per sequence, so a degenerate batch keeps the balanced split.
    if (cut_seq + 1 <= total / 2) {
      split.split_seq_index = cut_seq;
      split.split_token_index = total / 2;
      split.two_chunk = true;
    }
  }
  return split;
}

TboSplit compute_tbo_split_decode(int64_t num_tokens, int64_t tokens_per_seq) {
  EPX_CHECK_ARG(num_tokens >= 0, "num_tokens must be >= 0, got {}", num_tokens);
  EPX_CHECK_ARG(tokens_per_seq >= 1, "tokens_per_seq must be >= 1, got {}", tokens_per_seq);
  EPX_CHECK_ARG(num_tokens % tokens_per_seq == 0, "num_tokens {} must be a multiple of tokens_per_seq {}", num_tokens,
                tokens_per_seq);
  TboSplit split;
  split.split_seq_index = num_tokens / tokens_per_seq / 2;
  split.split_token_index = split.split_seq_index * tokens_per_seq;
  return split;
}

std::optional<TboSplit> compute_tbo_split(ForwardMode mode, int64_t num_tokens, std::span<const int64_t> extend_lens,
                                          int64_t tokens_per_seq, double threshold) {
  switch (mode) {
    case ForwardMode::kExtend:
    case ForwardMode::kMixed: {
      const TboSplit split = compute_tbo_split_extend(extend_lens, threshold);
      const int64_t total = std::accumulate(extend_lens.begin(), extend_lens.end(), int64_t{0});
      EPX_CHECK_ARG(num_tokens == total, "num_tokens {} must equal the sum of extend_lens {}", num_tokens, total);
      return split;
    }
    case ForwardMode::kDecode:
    case ForwardMode::kTargetVerify:
      return compute_tbo_split_decode(num_tokens, tokens_per_seq);
    case ForwardMode::kIdle:
    case ForwardMode::kPrebuilt:
      // NOTE: SGLang (compute_split_seq_index) returns 0 for IDLE and PREBUILT and asserts num_tokens == 0; for
      // PREBUILT that is also the decode rule at 0 tokens.
      EPX_CHECK_ARG(num_tokens == 0, "an {} batch must have num_tokens 0, got {}", to_string(mode), num_tokens);
      return TboSplit{};
    case ForwardMode::kDraftExtend:
      return std::nullopt;
  }
  EPX_CHECK_ARG(false, "mode {} is not a ForwardMode", static_cast<int>(mode));
  return std::nullopt;
}

TboChildren split_tbo_children(const TboSeqFields& parent, const TboSplit& split) {
  const int64_t n = parent.num_seqs();
  EPX_CHECK_ARG(
      static_cast<int64_t>(parent.prefix_lens.size()) == n && static_cast<int64_t>(parent.seq_lens.size()) == n,
      "extend_lens, prefix_lens and seq_lens must have the same size, got {}, {}, {}", n, parent.prefix_lens.size(),
      parent.seq_lens.size());
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    EPX_CHECK_ARG(parent.extend_lens[i] >= 0 && parent.extend_lens[i] <= kMaxTboTokens,
                  "extend_lens[{}] must be in [0, 2^40], got {}", i, parent.extend_lens[i]);
    EPX_CHECK_ARG(parent.prefix_lens[i] >= 0 && parent.prefix_lens[i] <= kMaxTboTokens,
                  "prefix_lens[{}] must be in [0, 2^40], got {}", i, parent.prefix_lens[i]);
    EPX_CHECK_ARG(parent.seq_lens[i] == parent.prefix_lens[i] + parent.extend_lens[i],
                  "seq_lens[{}] must be prefix_lens + extend_lens = {}, got {}", i,
                  parent.prefix_lens[i] + parent.extend_lens[i], parent.seq_lens[i]);
    total += parent.extend_lens[i];
  }
  const int64_t s = split.split_seq_index;
  EPX_CHECK_ARG(s >= 0 && (s < n || (!split.two_chunk && s <= n)), "split_seq_index must be in [0, {}{}, got {}", n,
                split.two_chunk ? ")" : "]", s);
  const int64_t before = std::accumulate(parent.extend_lens.begin(), parent.extend_lens.begin() + s, int64_t{0});
  int64_t cut = 0;  // tokens of sequence s that go to A
  if (split.two_chunk) {
    cut = split.split_token_index - before;
    EPX_CHECK_ARG(cut >= 0 && cut <= parent.extend_lens[s],
                  "split_token_index {} must fall inside sequence {} (tokens [{}, {}])", split.split_token_index, s,
                  before, before + parent.extend_lens[s]);
  } else {
    EPX_CHECK_ARG(split.split_token_index == before,
                  "split_token_index must be the sum of the first {} extend_lens = {}, got {}", s, before,
                  split.split_token_index);
  }
  TboChildren c;
  auto take = [&](TboSeqFields& dst, int64_t begin, int64_t end) {
    dst.extend_lens.assign(parent.extend_lens.begin() + begin, parent.extend_lens.begin() + end);
    dst.prefix_lens.assign(parent.prefix_lens.begin() + begin, parent.prefix_lens.begin() + end);
    dst.seq_lens.assign(parent.seq_lens.begin() + begin, parent.seq_lens.begin() + end);
  };
  take(c.a, 0, s);
  take(c.b, s, n);
  c.seq_begin_b = s;
  if (split.two_chunk) {
    c.a.extend_lens.push_back(cut);
    c.a.prefix_lens.push_back(parent.prefix_lens[s]);
    c.a.seq_lens.push_back(parent.prefix_lens[s] + cut);
    c.b.extend_lens[0] -= cut;
    c.b.prefix_lens[0] += cut;
  }
  c.num_tokens_a = split.split_token_index;
  c.num_tokens_b = total - split.split_token_index;
  return c;
}

}  // namespace epx
