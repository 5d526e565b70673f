// Attention context parallelism: SGLang's zigzag split of a prefill batch over the attention-CP ranks
// (python/sglang/srt/layers/cp/zigzag.py, ZigzagCPStrategy.can_apply / build_metadata).
#include <algorithm>

#include "core/check.h"
#include "core/limits.h"
#include "epx/dp.h"

namespace epx {

namespace {

constexpr int64_t kMaxZigzagSeqs = int64_t{1} << 24;

void check_cp_size(int cp_size, const char* what) {
  EPX_CHECK_ARG(cp_size >= 1 && cp_size <= kMaxDpWorldSize, "{}: cp_size must be in [1, {}], got {}", what,
                kMaxDpWorldSize, cp_size);
}

// Checks the lengths and returns their sum.
int64_t check_seq_lens(std::span<const int64_t> extend_seq_lens, const char* what) {
  EPX_CHECK_ARG(static_cast<int64_t>(extend_seq_lens.size()) <= kMaxZigzagSeqs,
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

}  // namespace

bool can_zigzag_split(std::span<const int64_t> extend_seq_lens, int cp_size, ForwardMode mode, int64_t num_tokens) {
  check_cp_size(cp_size, "can_zigzag_split");
  check_seq_lens(extend_seq_lens, "can_zigzag_split");
  EPX_CHECK_ARG(num_tokens >= 0, "can_zigzag_split: num_tokens must be >= 0, got {}", num_tokens);
  const int64_t segments = 2 * static_cast<int64_t>(cp_size);
  if (cp_size <= 1 || num_tokens < segments) return false;
  if (mode != ForwardMode::kExtend && mode != ForwardMode::kMixed) return false;
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

}  // namespace epx
