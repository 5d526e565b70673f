// TBO split rules (extend balanced / two-chunk with threshold and guard, decode), the children's
// per-sequence fields, and the `epx tbo split` CLI (run as the built binary, EPX_CLI_PATH).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "epx/error.h"
#include "epx/tbo.h"
#include "test_util.h"

namespace epx {
namespace {

using Lens = std::vector<int64_t>;

void expect_split(const Lens& lens, double threshold, int64_t seq, int64_t token, bool two_chunk) {
  const TboSplit s = compute_tbo_split_extend(lens, threshold);
  EXPECT_EQ(s.split_seq_index, seq) << ::testing::PrintToString(lens) << " t=" << threshold;
  EXPECT_EQ(s.split_token_index, token) << ::testing::PrintToString(lens) << " t=" << threshold;
  EXPECT_EQ(s.two_chunk, two_chunk) << ::testing::PrintToString(lens) << " t=" << threshold;
}

TEST(TboSplit, ExtendHandWorked) {
  // Balanced: |4096 - 4196| = 100, then |8192 - 100| grows: split after sequence 0; 4096/8292 = 49.4%.
  expect_split({4096, 4096, 100}, 0.48, 1, 4096, false);
  // Balanced leaves 60 of 600 tokens left (10%): the 500-token sequence is cut at 300.
  expect_split({10, 20, 30, 500, 40}, 0.48, 3, 300, true);
  // Ties move right: [1,1,1,1] balances at 2.
  expect_split({1, 1, 1, 1}, 0.48, 2, 2, false);
  expect_split({7, 0, 0, 7}, 0.48, 3, 7, false);
}

TEST(TboSplit, ThresholdEdges) {
  expect_split({48, 52}, 0.48, 1, 48, false);  // exactly 48%: not below the threshold
  expect_split({47, 53}, 0.48, 1, 50, true);   // 47%: cut sequence 1 at token 50
  expect_split({52, 48}, 0.48, 1, 52, false);  // exactly 52%
  expect_split({53, 47}, 0.48, 0, 50, true);   // 53%: cut sequence 0
  expect_split({49, 51}, 0.5, 1, 50, true);    // 0.5: anything off-centre is cut
  expect_split({50, 50}, 0.5, 1, 50, false);
  expect_split({1, 1000}, 0.0, 1, 1, false);  // 0 disables two-chunk
  expect_split({1, 1000}, 0.48, 1, 500, true);
}

TEST(TboSplit, TwoChunkGuard) {
  // One sequence of 3 tokens: cut at 1 (child A: 1 sequence, 1 token).
  expect_split({3}, 0.48, 0, 1, true);
  // One token: child A would hold 1 sequence and 0 tokens -> the balanced split (nothing) stands.
  expect_split({1}, 0.48, 0, 0, false);
  // [1,1,1]: balanced at 2 (67%); the cut would give A 2 sequences and 1 token -> keep the balanced split.
  expect_split({1, 1, 1}, 0.48, 2, 2, false);
  // The guard is sequences <= tokens: [4,1,4] cuts sequence 1 at token 4 (A: 2 sequences, 4 tokens),
  // leaving 0 of sequence 1's tokens in A.
  expect_split({4, 1, 4}, 0.48, 1, 4, true);
  expect_split({0}, 0.48, 0, 0, false);
}

// The rules restated as a brute force: balanced = the largest boundary with the least |left - right|.
TboSplit brute_force(const Lens& lens, double threshold) {
  const int64_t total = std::accumulate(lens.begin(), lens.end(), int64_t{0});
  TboSplit s;
  int64_t best_diff = INT64_MAX;
  for (size_t i = 1; i < lens.size(); ++i) {
    const int64_t left = std::accumulate(lens.begin(), lens.begin() + i, int64_t{0});
    const int64_t diff = std::llabs(2 * left - total);
    if (diff <= best_diff) best_diff = diff, s.split_seq_index = static_cast<int64_t>(i);
  }
  s.split_token_index = std::accumulate(lens.begin(), lens.begin() + s.split_seq_index, int64_t{0});
  const double left = static_cast<double>(s.split_token_index);
  if (left < total * threshold || left > total * (1 - threshold)) {
    int64_t cut = 0;
    while (std::accumulate(lens.begin(), lens.begin() + cut + 1, int64_t{0}) <= total / 2) ++cut;
    if (cut + 1 <= total / 2) s = {cut, total / 2, true};
  }
  return s;
}

TEST(TboSplit, RandomExtendMatchesBruteForceAndChildrenRebuildTheParent) {
  std::mt19937 rng(17);
  int num_two_chunk = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const int n = 1 + static_cast<int>(rng() % 12);
    Lens lens(n);
    const bool skewed = rng() % 2;
    for (auto& l : lens)
      l = rng() % 7 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % (skewed && rng() % 4 == 0 ? 5000 : 60));
    if (std::accumulate(lens.begin(), lens.end(), int64_t{0}) == 0) lens[0] = 1;
    const double threshold = (rng() % 51) / 100.0;
    const TboSplit got = compute_tbo_split_extend(lens, threshold);
    const TboSplit want = brute_force(lens, threshold);
    ASSERT_EQ(got.split_seq_index, want.split_seq_index) << ::testing::PrintToString(lens) << " t=" << threshold;
    ASSERT_EQ(got.split_token_index, want.split_token_index) << ::testing::PrintToString(lens);
    ASSERT_EQ(got.two_chunk, want.two_chunk) << ::testing::PrintToString(lens);
    num_two_chunk += got.two_chunk;

    TboSeqFields parent;
    for (int i = 0; i < n; ++i) {
      parent.extend_lens.push_back(lens[i]);
      parent.prefix_lens.push_back(static_cast<int64_t>(rng() % 1000));
      parent.seq_lens.push_back(parent.prefix_lens.back() + lens[i]);
    }
    const TboChildren c = split_tbo_children(parent, got);
    const int64_t total = std::accumulate(lens.begin(), lens.end(), int64_t{0});
    ASSERT_EQ(c.num_tokens_a, got.split_token_index);
    ASSERT_EQ(c.num_tokens_a + c.num_tokens_b, total);
    ASSERT_EQ(std::accumulate(c.a.extend_lens.begin(), c.a.extend_lens.end(), int64_t{0}), c.num_tokens_a);
    ASSERT_EQ(std::accumulate(c.b.extend_lens.begin(), c.b.extend_lens.end(), int64_t{0}), c.num_tokens_b);
    if (got.two_chunk) {
      ASSERT_LE(std::llabs(c.num_tokens_a - c.num_tokens_b), 1);
    }
    // Every child sequence is consistent, and gluing the cut sequence back gives the parent.
    for (const TboSeqFields* f : {&c.a, &c.b}) {
      for (int64_t i = 0; i < f->num_seqs(); ++i) ASSERT_EQ(f->seq_lens[i], f->prefix_lens[i] + f->extend_lens[i]);
    }
    TboSeqFields glued = c.a;
    size_t from = 0;
    if (got.two_chunk) {
      glued.extend_lens.back() += c.b.extend_lens[0];
      ASSERT_EQ(c.b.prefix_lens[0], glued.seq_lens.back());
      glued.seq_lens.back() = c.b.seq_lens[0];
      from = 1;
    }
    for (size_t i = from; i < c.b.extend_lens.size(); ++i) {
      glued.extend_lens.push_back(c.b.extend_lens[i]);
      glued.prefix_lens.push_back(c.b.prefix_lens[i]);
      glued.seq_lens.push_back(c.b.seq_lens[i]);
    }
    ASSERT_EQ(glued.extend_lens, parent.extend_lens);
    ASSERT_EQ(glued.prefix_lens, parent.prefix_lens);
    ASSERT_EQ(glued.seq_lens, parent.seq_lens);
    ASSERT_EQ(c.seq_begin_b, got.split_seq_index);
  }
  EXPECT_GT(num_two_chunk, 300);
}

TEST(TboSplit, Decode) {
  auto s = compute_tbo_split_decode(10, 1);
  EXPECT_EQ(s.split_seq_index, 5);
  EXPECT_EQ(s.split_token_index, 5);
  EXPECT_FALSE(s.two_chunk);
  s = compute_tbo_split_decode(18, 2);  // 9 sequences of 2 (speculative verify)
  EXPECT_EQ(s.split_seq_index, 4);
  EXPECT_EQ(s.split_token_index, 8);
  s = compute_tbo_split_decode(4, 4);  // one sequence: child A empty
  EXPECT_EQ(s.split_seq_index, 0);
  EXPECT_EQ(s.split_token_index, 0);
  s = compute_tbo_split_decode(0, 3);
  EXPECT_EQ(s.split_seq_index, 0);
  EXPECT_THROW(compute_tbo_split_decode(10, 0), Error);
  EXPECT_THROW(compute_tbo_split_decode(-2, 1), Error);
  EXPECT_THROW(compute_tbo_split_decode(10, 3), Error);
}

TEST(TboSplit, ByForwardMode) {
  const Lens lens{10, 20, 30, 500, 40};
  auto s = compute_tbo_split(ForwardMode::kExtend, 600, lens, 0);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->split_token_index, 300);
  EXPECT_TRUE(s->two_chunk);
  s = compute_tbo_split(ForwardMode::kTargetVerify, 12, {}, 4);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->split_seq_index, 1);
  EXPECT_EQ(s->split_token_index, 4);
  s = compute_tbo_split(ForwardMode::kIdle, 0, {}, 0);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->split_token_index, 0);
  EXPECT_FALSE(compute_tbo_split(ForwardMode::kDraftExtend, 5, Lens{5}, 1).has_value());
  // PREBUILT: SGLang's split index 0 with num_tokens 0 (the batch runs no forward pass).
  s = compute_tbo_split(ForwardMode::kPrebuilt, 0, {}, 1);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->split_seq_index, 0);
  EXPECT_EQ(s->split_token_index, 0);
  EXPECT_FALSE(s->two_chunk);
  EXPECT_THROW(compute_tbo_split(ForwardMode::kPrebuilt, 4, {}, 1), Error);
  EXPECT_THROW(compute_tbo_split(ForwardMode::kIdle, 3, {}, 1), Error);
  EXPECT_THROW(compute_tbo_split(ForwardMode::kExtend, 601, lens, 0), Error);
}

// SGLang splits a MIXED batch (chunked prefill + decode, the decode sequences with extend length 1) by the
// extend rule (two_batch_overlap.py: compute_split_seq_index branches on forward_mode.is_extend(), which
// holds for MIXED), two-chunk included.
TEST(TboSplit, MixedUsesTheExtendRule) {
  std::mt19937 rng(16);
  for (int iter = 0; iter < 300; ++iter) {
    Lens lens(1 + rng() % 12);
    for (auto& l : lens) l = rng() % 3 == 0 ? 1 : static_cast<int64_t>(rng() % 900);  // decode seqs: 1
    const int64_t total = std::accumulate(lens.begin(), lens.end(), int64_t{0});
    for (double threshold : {0.0, 0.3, kDefaultTboThreshold}) {
      const auto mixed = compute_tbo_split(ForwardMode::kMixed, total, lens, 1, threshold);
      ASSERT_TRUE(mixed.has_value());
      const TboSplit extend = compute_tbo_split_extend(lens, threshold);
      EXPECT_EQ(mixed->split_seq_index, extend.split_seq_index);
      EXPECT_EQ(mixed->split_token_index, extend.split_token_index);
      EXPECT_EQ(mixed->two_chunk, extend.two_chunk);
    }
  }
  // A 2000-token prefill chunk followed by three decode sequences: the balanced split leaves 2000 of 2003
  // tokens on the left, so the chunk is cut at total / 2.
  const auto s = compute_tbo_split(ForwardMode::kMixed, 2003, Lens{2000, 1, 1, 1}, 1);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->split_seq_index, 0);
  EXPECT_EQ(s->split_token_index, 1001);
  EXPECT_TRUE(s->two_chunk);
  EXPECT_THROW(compute_tbo_split(ForwardMode::kMixed, 2004, Lens{2000, 1, 1, 1}, 1), Error);  // sum differs
}

TEST(TboSplit, RejectsBadInput) {
  auto expect_invalid = [](const std::function<void()>& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "expected " << needle;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_invalid([] { compute_tbo_split_extend(Lens{5, -1}); }, "extend_lens[1] must be in [0, 2^40], got -1");
  expect_invalid([] { compute_tbo_split_extend(Lens{}); }, "at least one sequence");
  expect_invalid([] { compute_tbo_split_extend(Lens{5}, 0.51); }, "threshold must be in [0, 0.5], got 0.51");
  expect_invalid([] { compute_tbo_split_extend(Lens{5}, -0.1); }, "threshold must be in [0, 0.5]");
  expect_invalid([] { compute_tbo_split_decode(5, 0); }, "tokens_per_seq must be >= 1, got 0");
}

TEST(TboChildren, HandWorkedTwoChunk) {
  // The 500-token sequence (prefix 100) is cut at token 300 of the batch: 240 tokens go to A.
  const TboSeqFields parent{{10, 20, 30, 500, 40}, {0, 5, 0, 100, 7}, {10, 25, 30, 600, 47}};
  const TboChildren c = split_tbo_children(parent, {3, 300, true});
  EXPECT_EQ(c.a.extend_lens, (Lens{10, 20, 30, 240}));
  EXPECT_EQ(c.a.prefix_lens, (Lens{0, 5, 0, 100}));
  EXPECT_EQ(c.a.seq_lens, (Lens{10, 25, 30, 340}));
  EXPECT_EQ(c.b.extend_lens, (Lens{260, 40}));
  EXPECT_EQ(c.b.prefix_lens, (Lens{340, 7}));
  EXPECT_EQ(c.b.seq_lens, (Lens{600, 47}));
  EXPECT_EQ(c.num_tokens_a, 300);
  EXPECT_EQ(c.num_tokens_b, 300);
  EXPECT_EQ(c.seq_begin_b, 3);
  // Sequence-boundary split.
  const TboChildren d = split_tbo_children(parent, {2, 30, false});
  EXPECT_EQ(d.a.extend_lens, (Lens{10, 20}));
  EXPECT_EQ(d.b.extend_lens, (Lens{30, 500, 40}));
  EXPECT_EQ(d.b.prefix_lens, (Lens{0, 100, 7}));
  // Decode: one token per sequence.
  const TboSeqFields dec{{1, 1, 1}, {9, 19, 29}, {10, 20, 30}};
  const TboChildren e = split_tbo_children(dec, compute_tbo_split_decode(3, 1));
  EXPECT_EQ(e.a.seq_lens, (Lens{10}));
  EXPECT_EQ(e.b.seq_lens, (Lens{20, 30}));
}

TEST(TboChildren, RejectsInconsistentInput) {
  const TboSeqFields parent{{10, 20}, {0, 5}, {10, 25}};
  EXPECT_THROW(split_tbo_children(parent, {1, 11, false}), Error);  // token index not at the boundary
  EXPECT_THROW(split_tbo_children(parent, {3, 30, false}), Error);  // past the end
  EXPECT_THROW(split_tbo_children(parent, {1, 31, true}), Error);   // outside sequence 1
  EXPECT_THROW(split_tbo_children(parent, {2, 30, true}), Error);   // no sequence 2 to cut
  EXPECT_THROW(split_tbo_children({{10, 20}, {0, 5}, {10, 24}}, {1, 10, false}), Error);  // seq_len wrong
  EXPECT_THROW(split_tbo_children({{10, 20}, {0}, {10, 25}}, {1, 10, false}), Error);     // sizes
  EXPECT_NO_THROW(split_tbo_children(parent, {2, 30, false}));                            // B empty is allowed
}

// ---- CLI ---------------------------------------------------------------------------------------------

using epx::testing::CliResult;
using epx::testing::expect_bad_input;
using epx::testing::run_cli;

TEST(TboCli, SplitJson) {
  auto r = run_cli("tbo split --extend 4096,4096,100");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "{\"split_seq_index\": 1, \"split_token_index\": 4096, \"two_chunk\": false}\n");
  r = run_cli("tbo split --extend 10,20,30,500,40");
  EXPECT_EQ(r.out, "{\"split_seq_index\": 3, \"split_token_index\": 300, \"two_chunk\": true}\n");
  r = run_cli("tbo split --extend 47,53 --threshold 0.45");
  EXPECT_EQ(r.out, "{\"split_seq_index\": 1, \"split_token_index\": 47, \"two_chunk\": false}\n");
  r = run_cli("tbo split --decode 18 --tokens-per-seq 2");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "{\"split_seq_index\": 4, \"split_token_index\": 8, \"two_chunk\": false}\n");
}

TEST(TboCli, BadInputExitsTwoWithOneLine) {
  expect_bad_input("tbo split --extend 4096,-1", "negative");
  expect_bad_input("tbo split --extend 4096,100 --threshold 0.6", "--threshold must be in [0, 0.5]");
  expect_bad_input("tbo split --extend 4096,100 --threshold abc", "not a number");
  expect_bad_input("tbo split --decode 16 --tokens-per-seq 0", "--tokens-per-seq must be >= 1");
  expect_bad_input("tbo split --decode -16 --tokens-per-seq 2", "must be >= 0");
  expect_bad_input("tbo split --decode 15 --tokens-per-seq 2", "multiple");
  expect_bad_input("tbo split --decode 16", "needs --tokens-per-seq");
  expect_bad_input("tbo split", "needs --extend");
  expect_bad_input("tbo split --extend 5,5 --decode 4 --tokens-per-seq 1", "not both");
}

}  // namespace
}  // namespace epx
