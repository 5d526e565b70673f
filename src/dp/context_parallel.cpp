// Attention context parallelism: SGLang's zigzag and interleave splits of a prefill batch over the attention-CP
// ranks (python/sglang/srt/layers/cp/zigzag.py, ZigzagCPStrategy, and cp/interleave.py, InterleaveCPStrategy:
// can_apply / build_metadata; cp/base.py, ContextParallelStrategyKind, for the names).
#include <algorithm>

#include "core/check.h"
#include "core/limits.h"
#include "epx/dp.h"

namespace epx {

namespace {

constexpr int64_t kMaxCpSeqs = int64_t{1} << 24;

void check_cp_size(int cp_size, const char* what) {
  EPX_CHECK_ARG(cp_size >= 1 && cp_size <= kMaxDpWorldSize, "{}: cp_size must be in [1, {}], got {}", what,
                kMaxDpWorldSize, cp_size);
}

// Checks the lengths and returns their sum.
int64_t check_seq_lens(std::span<const int64_t> extend_seq_lens, const char* what) {
  EPX_CHECK_ARG(static_cast<int64_t>(extend_seq_lens.size()) <= kMaxCpSeqs,
                "{}: extend_seq_lens must hold at most 2^24 sequences, got {}", what, extend_seq_lens.size());
  int64_t sum = 0;
  for (size_t i = 0; i < extend_seq_lens.size(); ++i) {
    EPX_CHECK_ARG(extend_seq_lens[i] >= 0 && extend_seq_lens[i] <= kMaxDpBufferRows - sum,
                  "{}: extend_seq_lens[{}] = {} must be >= 0 and keep the total within 2^40 rows", what, i,
                  extend_seq_lens[i]);
    sum += extend_seq_lens[i];
  }
  return sum;
}

bool is_cp_extend(ForwardMode mode) { return mode == ForwardMode::kExtend || mode == ForwardMode::kMixed; }

}  // namespace

bool can_zigzag_split(std::span<const int64_t> extend_seq_lens, int cp_size, ForwardMode mode, int64_t num_tokens) {
  check_cp_size(cp_size, "can_zigzag_split");
  check_seq_lens(extend_seq_lens, "can_zigzag_split");
  EPX_CHECK_ARG(num_tokens >= 0, "can_zigzag_split: num_tokens must be >= 0, got {}", num_tokens);
  const int64_t segments = 2 * static_cast<int64_t>(cp_size);
  if (cp_size <= 1 || num_tokens < segments) return false;
  if (!is_cp_extend(mode)) return false;
  return std::all_of(extend_seq_lens.begin(), extend_seq_lens.end(), [&](int64_t len) { return len >= segments; });
}

ZigzagSplit plan_zigzag_split(std::span<const int64_t> extend_seq_lens, int cp_size, int64_t num_tokens) {
  check_cp_size(cp_size, "plan_zigzag_split");
  EPX_CHECK_ARG(!extend_seq_lens.empty(), "plan_zigzag_split: extend_seq_lens must name at least one sequence");
  const int64_t sum = check_seq_lens(extend_seq_lens, "plan_zigzag_split");
  if (num_tokens == -1) num_tokens = sum;
  EPX_CHECK_ARG(num_tokens >= sum && num_tokens <= kMaxDpBufferRows,
                "plan_zigzag_split: num_tokens must be -1 or in [sum of extend_seq_lens = {}, 2^40], got {}", sum,
                num_tokens);
  const int64_t segments = 2 * static_cast<int64_t>(cp_size);
  ZigzagSplit split;
  split.cp_size = cp_size;
  split.seq_lens.assign(extend_seq_lens.begin(), extend_seq_lens.end());
  split.seq_lens.back() += num_tokens - sum;  // SGLang: the padding rows join the last sequence
  const size_t num_seqs = split.seq_lens.size();
  split.seq_offsets.resize(num_seqs);
  split.block_lens.resize(num_seqs * static_cast<size_t>(segments));
  split.num_tokens.assign(cp_size, 0);
  int64_t offset = 0;
  for (size_t s = 0; s < num_seqs; ++s) {
    split.seq_offsets[s] = offset;
    offset += split.seq_lens[s];
    const int64_t base = split.seq_lens[s] / segments, rem = split.seq_lens[s] % segments;
    int64_t* blocks = split.block_lens.data() + s * segments;
    for (int64_t b = 0; b < segments; ++b) blocks[b] = base + (b < rem ? 1 : 0);
    for (int c = 0; c < cp_size; ++c) split.num_tokens[c] += blocks[c] + blocks[segments - 1 - c];
  }
  split.max_rank_len = *std::max_element(split.num_tokens.begin(), split.num_tokens.end());
  split.padded_rank_len = (split.max_rank_len + segments - 1) / segments * segments;
  return split;
}

namespace {

void check_split(const ZigzagSplit& split, const char* what) {
  check_cp_size(split.cp_size, what);
  const size_t segments = 2 * static_cast<size_t>(split.cp_size);
  EPX_CHECK_ARG(!split.seq_lens.empty() && split.seq_offsets.size() == split.seq_lens.size() &&
                    split.block_lens.size() == split.seq_lens.size() * segments &&
                    split.num_tokens.size() == static_cast<size_t>(split.cp_size),
                "{}: split must come from plan_zigzag_split ({} sequences, {} offsets, {} blocks, {} rank counts)",
                what, split.seq_lens.size(), split.seq_offsets.size(), split.block_lens.size(),
                split.num_tokens.size());
}

// The first batch row of block b of sequence s.
int64_t block_start(const ZigzagSplit& split, size_t s, int64_t b) {
  const int64_t* blocks = split.block_lens.data() + s * 2 * split.cp_size;
  int64_t start = split.seq_offsets[s];
  for (int64_t i = 0; i < b; ++i) start += blocks[i];
  return start;
}

}  // namespace

std::vector<int64_t> zigzag_local_rows(const ZigzagSplit& split, int cp_rank) {
  check_split(split, "zigzag_local_rows");
  EPX_CHECK_ARG(cp_rank >= 0 && cp_rank < split.cp_size, "zigzag_local_rows: cp_rank must be in [0, {}), got {}",
                split.cp_size, cp_rank);
  const int64_t segments = 2 * static_cast<int64_t>(split.cp_size);
  std::vector<int64_t> rows;
  rows.reserve(static_cast<size_t>(split.num_tokens[cp_rank]));
  // NOTE: SGLang's zigzag_index takes the early block of every sequence, then the late block of every sequence.
  for (const int64_t b : {static_cast<int64_t>(cp_rank), segments - 1 - cp_rank}) {
    for (size_t s = 0; s < split.seq_lens.size(); ++s) {
      const int64_t start = block_start(split, s, b);
      for (int64_t i = 0; i < split.block_lens[s * segments + b]; ++i) rows.push_back(start + i);
    }
  }
  return rows;
}

std::vector<int64_t> zigzag_gathered_rows(const ZigzagSplit& split) {
  check_split(split, "zigzag_gathered_rows");
  int64_t total = 0;
  for (int64_t len : split.seq_lens) total += len;
  std::vector<int64_t> out(static_cast<size_t>(total), -1);
  int64_t gathered = 0;
  for (int c = 0; c < split.cp_size; ++c) {
    for (int64_t row : zigzag_local_rows(split, c)) out[row] = gathered++;
  }
  return out;
}

// ---- interleave -----------------------------------------------------------------------------------

const char* to_string(CpStrategy strategy) noexcept {
  return strategy == CpStrategy::kZigzag ? "zigzag" : "interleave";
}

CpStrategy parse_cp_strategy(std::string_view cp_strategy) {
  if (cp_strategy == "zigzag") return CpStrategy::kZigzag;
  if (cp_strategy == "interleave") return CpStrategy::kInterleave;
  detail::raise(ErrorCode::kInvalidArgument,
                "parse_cp_strategy: cp_strategy must be \"zigzag\" or \"interleave\", got \"{}\"", cp_strategy);
}

bool can_interleave_split(int cp_size, ForwardMode mode, int64_t num_tokens) {
  check_cp_size(cp_size, "can_interleave_split");
  EPX_CHECK_ARG(num_tokens >= 0, "can_interleave_split: num_tokens must be >= 0, got {}", num_tokens);
  return cp_size > 1 && num_tokens >= cp_size && is_cp_extend(mode);
}

bool can_cp_split(CpStrategy strategy, std::span<const int64_t> extend_seq_lens, int cp_size, ForwardMode mode,
                  int64_t num_tokens) {
  switch (strategy) {
    case CpStrategy::kZigzag:
      return can_zigzag_split(extend_seq_lens, cp_size, mode, num_tokens);
    case CpStrategy::kInterleave:
      check_seq_lens(extend_seq_lens, "can_cp_split");
      return can_interleave_split(cp_size, mode, num_tokens);
  }
  detail::raise(ErrorCode::kInvalidArgument, "can_cp_split: strategy must be kZigzag or kInterleave, got {}",
                static_cast<int>(strategy));
}

InterleaveSplit plan_interleave_split(std::span<const int64_t> extend_seq_lens, int cp_size, int64_t num_tokens) {
  check_cp_size(cp_size, "plan_interleave_split");
  EPX_CHECK_ARG(!extend_seq_lens.empty(), "plan_interleave_split: extend_seq_lens must name at least one sequence");
  const int64_t sum = check_seq_lens(extend_seq_lens, "plan_interleave_split");
  if (num_tokens == -1) num_tokens = sum;
  EPX_CHECK_ARG(num_tokens >= sum && num_tokens <= kMaxDpBufferRows,
                "plan_interleave_split: num_tokens must be -1 or in [sum of extend_seq_lens = {}, 2^40], got {}", sum,
                num_tokens);
  InterleaveSplit split;
  split.cp_size = cp_size;
  split.seq_lens.assign(extend_seq_lens.begin(), extend_seq_lens.end());
  split.seq_offsets.resize(split.seq_lens.size());
  int64_t offset = 0;
  for (size_t s = 0; s < split.seq_lens.size(); ++s) {
    split.seq_offsets[s] = offset;
    offset += split.seq_lens[s];
  }
  split.num_batch_tokens = num_tokens;
  split.num_real_batch_tokens = sum;
  split.num_tokens.resize(cp_size);
  split.num_real_tokens.resize(cp_size);
  // Rank c holds the rows r < n with r % cp == c: ceil((n - c) / cp) of them (0 when n <= c).
  const auto rows_below = [cp_size](int64_t n, int c) { return n > c ? (n - c + cp_size - 1) / cp_size : 0; };
  for (int c = 0; c < cp_size; ++c) {
    split.num_tokens[c] = rows_below(num_tokens, c);
    split.num_real_tokens[c] = rows_below(sum, c);
  }
  split.max_rank_len = split.num_tokens[0];
  split.padded_rank_len = (split.max_rank_len + cp_size - 1) / cp_size * cp_size;
  return split;
}

namespace {

// NOTE: a split is cheap to re-plan (O(num_seqs + cp)), so a hand-edited one is caught here instead of giving
// rows out of range.
void check_split(const InterleaveSplit& split, const char* what) {
  check_cp_size(split.cp_size, what);
  bool ok = !split.seq_lens.empty() && split.seq_offsets.size() == split.seq_lens.size();
  if (ok) {
    try {
      const InterleaveSplit want = plan_interleave_split(split.seq_lens, split.cp_size, split.num_batch_tokens);
      ok = want.seq_offsets == split.seq_offsets && want.num_real_batch_tokens == split.num_real_batch_tokens &&
           want.num_tokens == split.num_tokens && want.num_real_tokens == split.num_real_tokens &&
           want.max_rank_len == split.max_rank_len && want.padded_rank_len == split.padded_rank_len;
    } catch (const Error&) {
      ok = false;
    }
  }
  EPX_CHECK_ARG(ok, "{}: split must come from plan_interleave_split ({} sequences, {} offsets, {} rows, cp_size {})",
                what, split.seq_lens.size(), split.seq_offsets.size(), split.num_batch_tokens, split.cp_size);
}

void check_cp_rank(const InterleaveSplit& split, int cp_rank, const char* what) {
  EPX_CHECK_ARG(cp_rank >= 0 && cp_rank < split.cp_size, "{}: cp_rank must be in [0, {}), got {}", what, split.cp_size,
                cp_rank);
}

}  // namespace

std::vector<int64_t> interleave_local_rows(const InterleaveSplit& split, int cp_rank) {
  check_split(split, "interleave_local_rows");
  check_cp_rank(split, cp_rank, "interleave_local_rows");
  std::vector<int64_t> rows;
  rows.reserve(static_cast<size_t>(split.num_tokens[cp_rank]));
  for (int64_t row = cp_rank; row < split.num_batch_tokens; row += split.cp_size) rows.push_back(row);
  return rows;
}

std::vector<int64_t> interleave_gathered_rows(const InterleaveSplit& split, bool real_rows_only) {
  check_split(split, "interleave_gathered_rows");
  const std::vector<int64_t>& counts = real_rows_only ? split.num_real_tokens : split.num_tokens;
  const int64_t total = real_rows_only ? split.num_real_batch_tokens : split.num_batch_tokens;
  std::vector<int64_t> rank_start(counts.size(), 0);  // [cp_size] exclusive prefix sums of the shard counts
  for (size_t c = 1; c < counts.size(); ++c) rank_start[c] = rank_start[c - 1] + counts[c - 1];
  std::vector<int64_t> out(static_cast<size_t>(total));
  for (int64_t row = 0; row < total; ++row) out[row] = rank_start[row % split.cp_size] + row / split.cp_size;
  return out;
}

InterleaveQueries interleave_local_queries(const InterleaveSplit& split, int cp_rank,
                                           std::span<const int64_t> prefix_lens) {
  check_split(split, "interleave_local_queries");
  check_cp_rank(split, cp_rank, "interleave_local_queries");
  const size_t num_seqs = split.seq_lens.size();
  EPX_CHECK_ARG(prefix_lens.empty() || prefix_lens.size() == num_seqs,
                "interleave_local_queries: prefix_lens must be empty or hold num_seqs = {} lengths, got {}", num_seqs,
                prefix_lens.size());
  for (size_t s = 0; s < prefix_lens.size(); ++s) {
    EPX_CHECK_ARG(prefix_lens[s] >= 0 && prefix_lens[s] <= kMaxDpBufferRows,
                  "interleave_local_queries: prefix_lens[{}] must be in [0, 2^40], got {}", s, prefix_lens[s]);
  }
  InterleaveQueries queries;
  const size_t n = static_cast<size_t>(split.num_real_tokens[cp_rank]);
  queries.seq_idx.reserve(n);
  queries.kv_lens.reserve(n);
  size_t s = 0;
  // NOTE: local rows ascend, so the sequence index only moves forward; empty sequences are stepped over.
  for (int64_t row = cp_rank; row < split.num_real_batch_tokens; row += split.cp_size) {
    while (row >= split.seq_offsets[s] + split.seq_lens[s]) ++s;
    queries.seq_idx.push_back(static_cast<int64_t>(s));
    queries.kv_lens.push_back((prefix_lens.empty() ? 0 : prefix_lens[s]) + row - split.seq_offsets[s] + 1);
  }
  return queries;
}

}  // namespace epx
