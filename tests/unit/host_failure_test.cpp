// Host backend under failures: a late rank, one rank's invalid input, mismatched handles, "wait
// forever", and thread creation failing in run_host_ranks (issue 13, defects 1, 2, 3, 5 and 7).
//
// Routing (normal and low-latency rounds): R = 3 ranks, E = 6 experts (2 per rank), T = 5 tokens per
// rank, top-2 distinct random experts per token, no -1. x holds small integers (|x| <= 8) and every
// weight is 1, so every sum below is exact in bf16: combine of identity experts returns
// x[t] * (number of ranks token t visited) in normal mode and x[t] * K in low-latency mode.
// Fault tests assert who raised what, that the peers learned of the failure in well under the group
// timeout, and that a valid round on all ranks afterwards matches the reference.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>

#include "ep/validate.h"
#include "epx/buffer.h"
#include "epx/error.h"
#include "epx/group.h"
#include "epx/quant.h"
#include "test_util.h"

#if defined(__SANITIZE_ADDRESS__)
#define EPX_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EPX_TEST_ASAN 1
#endif
#endif

namespace epx {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kRanks = 3;
constexpr int64_t kHidden = 128, kExperts = 6, kTokens = 5, kTopk = 2, kMaxTokens = 8;
constexpr int64_t kTimeoutMs = 4'000;

struct RankInput {
  std::vector<uint16_t> x;     // [T, H] bf16 small integers
  std::vector<int64_t> topk;   // [T, K]
  std::vector<float> weights;  // [T, K], all 1
};

std::vector<RankInput> make_inputs(unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> value(-8, 8);
  std::vector<RankInput> in(kRanks);
  for (auto& d : in) {
    d.x.resize(kTokens * kHidden);
    for (auto& v : d.x) v = float_to_bf16(static_cast<float>(value(rng)));
    d.topk = testing::random_topk(rng, kTokens, kTopk, kExperts);
    d.weights.assign(kTokens * kTopk, 1.f);
  }
  return in;
}

// What a rank's call raised: the code (0 if nothing) and message, and how long the call took.
struct Outcome {
  int code = 0;
  std::string message;
  double ms = 0;
};

Outcome attempt(const std::function<void()>& fn) {
  Outcome o;
  const auto start = Clock::now();
  try {
    fn();
  } catch (const Error& e) {
    o.code = static_cast<int>(e.code());
    o.message = e.what();
  }
  o.ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  return o;
}

constexpr int code(ErrorCode c) { return static_cast<int>(c); }

// Rank `bad` raised kInvalidArgument; every other rank raised kPeerFailure naming it, within half the timeout.
void expect_one_rank_failed(const std::vector<Outcome>& out, int bad) {
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + out[r].message);
    if (r == bad) {
      EXPECT_EQ(out[r].code, code(ErrorCode::kInvalidArgument));
      continue;
    }
    EXPECT_EQ(out[r].code, code(ErrorCode::kPeerFailure));
    EXPECT_NE(out[r].message.find("ranks [" + std::to_string(bad) + "]"), std::string::npos);
    EXPECT_LT(out[r].ms, kTimeoutMs / 2.0);
  }
}

std::vector<std::unique_ptr<Buffer>> make_buffers(const std::vector<std::shared_ptr<Group>>& groups) {
  BufferOptions options;
  options.num_low_latency_bytes = 1;  // the host backend sizes its own slots
  std::vector<std::unique_ptr<Buffer>> buffers;
  for (const auto& g : groups) buffers.push_back(Buffer::create(g, options));
  return buffers;
}

DispatchArgs normal_args(RankInput& d) {
  DispatchArgs a;
  a.x = TensorView::of(d.x.data(), DType::kBFloat16, {kTokens, kHidden});
  a.topk_idx = TensorView::of(d.topk.data(), DType::kInt64, {kTokens, kTopk});
  a.topk_weights = TensorView::of(d.weights.data(), DType::kFloat32, {kTokens, kTopk});
  a.num_experts = kExperts;
  return a;
}

// Number of distinct ranks token t of `d` visits.
int64_t num_visited(const RankInput& d, int64_t t) {
  bool seen[kRanks] = {};
  int64_t n = 0;
  for (int64_t k = 0; k < kTopk; ++k) {
    const int64_t e = d.topk[t * kTopk + k];
    if (e >= 0 && !seen[e / (kExperts / kRanks)]) {
      seen[e / (kExperts / kRanks)] = true;
      ++n;
    }
  }
  return n;
}

void expect_scaled(const std::vector<uint16_t>& x, const Tensor& out, const std::function<int64_t(int64_t)>& factor) {
  ASSERT_EQ(out.sizes(), (std::vector<int64_t>{kTokens, kHidden}));
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int64_t h = 0; h < kHidden; ++h) {
      ASSERT_EQ(bf16_to_float(out.data_as<uint16_t>()[t * kHidden + h]),
                bf16_to_float(x[t * kHidden + h]) * static_cast<float>(factor(t)))
          << "token " << t << " channel " << h;
    }
  }
}

// One valid normal round on this rank: dispatch, identity experts, combine; checks rows and sums.
void normal_round(Buffer& buffer, std::vector<RankInput>& in, int rank) {
  const DispatchResult d = buffer.dispatch(normal_args(in[rank]));
  // Rows by source rank, then token: recompute the expected row count and data.
  int64_t row = 0;
  const int64_t per_rank = kExperts / kRanks;
  for (int s = 0; s < kRanks; ++s) {
    for (int64_t t = 0; t < kTokens; ++t) {
      bool sent = false;
      for (int64_t k = 0; k < kTopk; ++k) sent = sent || in[s].topk[t * kTopk + k] / per_rank == rank;
      if (!sent) continue;
      ASSERT_LT(row, d.recv_x.size(0));
      ASSERT_EQ(std::memcmp(d.recv_x.data_as<uint16_t>() + row * kHidden, in[s].x.data() + t * kHidden, kHidden * 2), 0)
          << "row " << row;
      ++row;
    }
  }
  ASSERT_EQ(d.recv_x.size(0), row);
  CombineArgs c;
  c.x = d.recv_x.view();
  c.handle = d.handle;
  const CombineResult out = buffer.combine(c);
  expect_scaled(in[rank].x, out.x, [&](int64_t t) { return num_visited(in[rank], t); });
}

LowLatencyDispatchArgs ll_args(RankInput& d) {
  LowLatencyDispatchArgs a;
  a.x = TensorView::of(d.x.data(), DType::kBFloat16, {kTokens, kHidden});
  a.topk_idx = TensorView::of(d.topk.data(), DType::kInt64, {kTokens, kTopk});
  a.max_tokens_per_rank = kMaxTokens;
  a.num_experts = kExperts;
  return a;
}

LowLatencyCombineArgs ll_combine_args(RankInput& d, const LowLatencyDispatchResult& res) {
  LowLatencyCombineArgs a;
  a.x = res.recv_x.view();  // identity experts
  a.topk_idx = TensorView::of(d.topk.data(), DType::kInt64, {kTokens, kTopk});
  a.topk_weights = TensorView::of(d.weights.data(), DType::kFloat32, {kTokens, kTopk});
  a.handle = res.handle;
  return a;
}

// One valid low-latency round on this rank; every rank present, so out = x * K.
void ll_round(Buffer& buffer, std::vector<RankInput>& in, int rank) {
  const LowLatencyDispatchResult d = buffer.low_latency_dispatch(ll_args(in[rank]));
  const LowLatencyCombineResult out = buffer.low_latency_combine(ll_combine_args(in[rank], d));
  expect_scaled(in[rank].x, out.x, [](int64_t) { return kTopk; });
  EXPECT_EQ(buffer.rank_mask(), std::vector<bool>(kRanks, false));
}

// ---- defect 1: a late rank must not read a timed-out rank's stack ----------------------------------

// Overwrites a stretch of this thread's stack below the caller's frame: what a returned frame held is gone.
[[gnu::noinline]] void scribble_stack() {
  volatile unsigned char junk[16384];
  for (size_t i = 0; i < sizeof(junk); ++i) junk[i] = 0xA5;
}

TEST(HostFailure, LateRankSeesWithdrawnBarrier) {
  auto groups = create_host_groups(2, {.timeout_ms = 200});
  std::vector<Outcome> out(2);
  run_host_ranks(groups, [&](int rank, Group& group) {
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(700));
    out[rank] = attempt([&] { group.barrier(); });
  });
  EXPECT_EQ(out[0].code, code(ErrorCode::kTimeout)) << out[0].message;
  EXPECT_EQ(out[1].code, code(ErrorCode::kPeerFailure)) << out[1].message;
  EXPECT_LT(out[1].ms, 100.0) << "the late rank must learn at once that rank 0 gave up";
  // The group is usable again.
  run_host_ranks(groups, [&](int, Group& group) { group.barrier(); });
}

TEST(HostFailure, LateRankAfterDispatchTimeoutFailsCleanly) {
  auto groups = create_host_groups(2, {.timeout_ms = 200});
  std::vector<std::unique_ptr<Buffer>> buffers;
  for (const auto& g : groups) buffers.push_back(Buffer::create(g));
  // Two ranks, experts 0..3; rank r sends every token to experts 0 and 2 (both ranks).
  std::vector<std::vector<uint16_t>> x(2, std::vector<uint16_t>(4 * kHidden, float_to_bf16(1.f)));
  std::vector<std::vector<int64_t>> topk(2, std::vector<int64_t>{0, 2, 0, 2, 0, 2, 0, 2});
  std::vector<Outcome> out(2);
  std::atomic<bool> rank1_done{false};
  run_host_ranks(groups, [&](int rank, Group&) {
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(700));
    DispatchArgs a;
    a.x = TensorView::of(x[rank].data(), DType::kBFloat16, {4, kHidden});
    a.topk_idx = TensorView::of(topk[rank].data(), DType::kInt64, {4, 2});
    a.num_experts = 4;
    out[rank] = attempt([&] { buffers[rank]->dispatch(a); });
    if (rank == 0) {
      // Reuse the dead frame while rank 1 may still look at what rank 0 published (ASan: invalid reads).
      while (!rank1_done.load()) {
        scribble_stack();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } else {
      rank1_done = true;
    }
  });
  EXPECT_EQ(out[0].code, code(ErrorCode::kTimeout)) << out[0].message;
  EXPECT_EQ(out[1].code, code(ErrorCode::kPeerFailure)) << out[1].message;
  EXPECT_NE(out[1].message.find("given up"), std::string::npos) << out[1].message;
}

// ---- defect 2: one rank's invalid input, then the group is reused ----------------------------------

TEST(HostFailure, InvalidNormalDispatchOnOneRank) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto in = make_inputs(seed);
  auto groups = create_host_groups(kRanks, {.timeout_ms = kTimeoutMs});
  auto buffers = make_buffers(groups);
  std::vector<Outcome> out(kRanks);
  run_host_ranks(groups, [&](int rank, Group&) {
    RankInput bad = in[rank];
    if (rank == 1) bad.topk[3] = kExperts;  // out of range
    out[rank] = attempt([&] { buffers[rank]->dispatch(normal_args(bad)); });
  });
  expect_one_rank_failed(out, 1);
  run_host_ranks(groups, [&](int rank, Group&) { normal_round(*buffers[rank], in, rank); });
}

TEST(HostFailure, InvalidNormalCombineOnOneRank) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto in = make_inputs(seed);
  auto groups = create_host_groups(kRanks, {.timeout_ms = kTimeoutMs});
  auto buffers = make_buffers(groups);
  std::vector<Outcome> out(kRanks);
  run_host_ranks(groups, [&](int rank, Group&) {
    const DispatchResult d = buffers[rank]->dispatch(normal_args(in[rank]));
    std::vector<uint16_t> rows(static_cast<size_t>(d.recv_x.numel() + kHidden));
    CombineArgs c;
    c.x = TensorView::of(rows.data(), DType::kBFloat16, {d.recv_x.size(0) + (rank == 1 ? 1 : 0), kHidden});
    if (d.recv_x.nbytes() > 0) std::memcpy(rows.data(), d.recv_x.data(), d.recv_x.nbytes());
    c.handle = d.handle;
    out[rank] = attempt([&] { buffers[rank]->combine(c); });
  });
  expect_one_rank_failed(out, 1);
  run_host_ranks(groups, [&](int rank, Group&) {
    normal_round(*buffers[rank], in, rank);
    buffers[rank]->clean_low_latency_buffer();
    ll_round(*buffers[rank], in, rank);
  });
}

TEST(HostFailure, InvalidLowLatencyDispatchOnOneRank) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto in = make_inputs(seed);
  auto groups = create_host_groups(kRanks, {.timeout_ms = kTimeoutMs});
  auto buffers = make_buffers(groups);
  std::vector<Outcome> out(kRanks);
  run_host_ranks(groups, [&](int rank, Group&) {
    RankInput bad = in[rank];
    if (rank == 1) bad.topk[0] = kExperts + 5;  // out of range
    out[rank] = attempt([&] { buffers[rank]->low_latency_dispatch(ll_args(bad)); });
  });
  expect_one_rank_failed(out, 1);
  run_host_ranks(groups, [&](int rank, Group&) {
    ll_round(*buffers[rank], in, rank);
    normal_round(*buffers[rank], in, rank);
    buffers[rank]->clean_low_latency_buffer();
    ll_round(*buffers[rank], in, rank);
  });
}

TEST(HostFailure, InvalidLowLatencyCombineOnOneRank) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto in = make_inputs(seed);
  auto groups = create_host_groups(kRanks, {.timeout_ms = kTimeoutMs});
  auto buffers = make_buffers(groups);
  std::vector<Outcome> out(kRanks);
  run_host_ranks(groups, [&](int rank, Group&) {
    const LowLatencyDispatchResult d = buffers[rank]->low_latency_dispatch(ll_args(in[rank]));
    LowLatencyCombineArgs c = ll_combine_args(in[rank], d);
    if (rank == 1) c.topk_weights = TensorView::of(in[rank].weights.data(), DType::kFloat32, {kTokens, 1});
    out[rank] = attempt([&] { buffers[rank]->low_latency_combine(c); });
  });
  expect_one_rank_failed(out, 1);
  run_host_ranks(groups, [&](int rank, Group&) {
    ll_round(*buffers[rank], in, rank);
    buffers[rank]->clear_rank_mask();
    buffers[rank]->clean_low_latency_buffer();
    ll_round(*buffers[rank], in, rank);
    normal_round(*buffers[rank], in, rank);
  });
}

// clean_low_latency_buffer re-agrees the sequence numbers, even when the ranks made different numbers of
// low-latency calls before (here rank 0 made one alone, which masked the others on it).
TEST(HostFailure, CleanReagreesLowLatencySequence) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto in = make_inputs(seed);
  auto groups = create_host_groups(kRanks, {.timeout_ms = 300});
  auto buffers = make_buffers(groups);
  buffers[0]->low_latency_dispatch(ll_args(in[0]));  // alone: the others are masked after the timeout
  run_host_ranks(groups, [&](int rank, Group&) {
    buffers[rank]->clean_low_latency_buffer();
    ll_round(*buffers[rank], in, rank);
    ll_round(*buffers[rank], in, rank);
  });
}

// ---- defect 3: mismatched handles ------------------------------------------------------------------

TEST(HostFailure, NormalCombineWithHandlesOfDifferentDispatches) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto in = make_inputs(seed);
  auto other = make_inputs(seed + 1);
  // The second dispatch sends every token of every rank to every rank (many more rows).
  for (auto& d : other) {
    for (int64_t t = 0; t < kTokens; ++t) {
      d.topk[t * kTopk] = 0;
      d.topk[t * kTopk + 1] = 2;
    }
  }
  auto groups = create_host_groups(kRanks, {.timeout_ms = kTimeoutMs});
  auto buffers = make_buffers(groups);
  std::vector<Outcome> out(kRanks);
  run_host_ranks(groups, [&](int rank, Group&) {
    const DispatchResult a = buffers[rank]->dispatch(normal_args(in[rank]));
    const DispatchResult b = buffers[rank]->dispatch(normal_args(other[rank]));
    const DispatchResult& mine = rank == 0 ? b : a;  // rank 0 reverses the big dispatch, the others the small one
    CombineArgs c;
    c.x = mine.recv_x.view();
    c.handle = mine.handle;
    out[rank] = attempt([&] { buffers[rank]->combine(c); });
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(out[r].code, code(ErrorCode::kInvalidArgument)) << "rank " << r << ": " << out[r].message;
    EXPECT_NE(out[r].message.find("different dispatches"), std::string::npos) << out[r].message;
  }
  run_host_ranks(groups, [&](int rank, Group&) { normal_round(*buffers[rank], in, rank); });
}

TEST(HostFailure, CachedDispatchWithHandlesOfDifferentDispatches) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto in = make_inputs(seed);
  auto groups = create_host_groups(kRanks, {.timeout_ms = kTimeoutMs});
  auto buffers = make_buffers(groups);
  std::vector<Outcome> out(kRanks);
  run_host_ranks(groups, [&](int rank, Group&) {
    const DispatchResult a = buffers[rank]->dispatch(normal_args(in[rank]));
    const DispatchResult b = buffers[rank]->dispatch(normal_args(in[rank]));  // same routes, another dispatch
    DispatchArgs cached;
    cached.x = TensorView::of(in[rank].x.data(), DType::kBFloat16, {kTokens, kHidden});
    cached.handle = rank == 2 ? b.handle : a.handle;
    out[rank] = attempt([&] { buffers[rank]->dispatch(cached); });
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(out[r].code, code(ErrorCode::kInvalidArgument)) << "rank " << r << ": " << out[r].message;
  }
  run_host_ranks(groups, [&](int rank, Group&) { normal_round(*buffers[rank], in, rank); });
}

TEST(HostFailure, LowLatencyCombineWithHandlesOfDifferentDispatches) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto in = make_inputs(seed);
  auto groups = create_host_groups(kRanks, {.timeout_ms = kTimeoutMs});
  auto buffers = make_buffers(groups);
  std::vector<Outcome> out(kRanks);
  run_host_ranks(groups, [&](int rank, Group&) {
    const LowLatencyDispatchResult first = buffers[rank]->low_latency_dispatch(ll_args(in[rank]));
    buffers[rank]->low_latency_combine(ll_combine_args(in[rank], first));
    const LowLatencyDispatchResult second = buffers[rank]->low_latency_dispatch(ll_args(in[rank]));
    // Equal shapes: before the fix rank 0 silently combined the wrong dispatch's rows.
    out[rank] =
        attempt([&] { buffers[rank]->low_latency_combine(ll_combine_args(in[rank], rank == 0 ? first : second)); });
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(out[r].code, code(ErrorCode::kInvalidArgument)) << "rank " << r << ": " << out[r].message;
    EXPECT_NE(out[r].message.find("same dispatch"), std::string::npos) << out[r].message;
  }
  run_host_ranks(groups, [&](int rank, Group&) { ll_round(*buffers[rank], in, rank); });
}

TEST(HostFailure, LowLatencyCombineWithHandleOfADifferentExpertCount) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto in = make_inputs(seed);
  auto groups = create_host_groups(kRanks, {.timeout_ms = kTimeoutMs});
  auto buffers = make_buffers(groups);
  std::vector<Outcome> out(kRanks);
  run_host_ranks(groups, [&](int rank, Group&) {
    const LowLatencyDispatchResult small = buffers[rank]->low_latency_dispatch(ll_args(in[rank]));
    buffers[rank]->clean_low_latency_buffer();
    LowLatencyDispatchArgs big = ll_args(in[rank]);
    big.num_experts = 4 * kExperts;  // the same ids, 8 local experts per rank
    const LowLatencyDispatchResult large = buffers[rank]->low_latency_dispatch(big);
    out[rank] =
        attempt([&] { buffers[rank]->low_latency_combine(ll_combine_args(in[rank], rank == 0 ? small : large)); });
  });
  // Rank 0's handle is from before the clean: its own error; the others learn of it at once.
  expect_one_rank_failed(out, 0);
  EXPECT_NE(out[0].message.find("clean_low_latency_buffer"), std::string::npos) << out[0].message;
  run_host_ranks(groups, [&](int rank, Group&) {
    buffers[rank]->clean_low_latency_buffer();
    ll_round(*buffers[rank], in, rank);
  });
}

// ---- defect 5 (host part): "wait forever" ----------------------------------------------------------

TEST(HostFailure, WaitForeverIsClampedNotOverflowed) {
  auto groups = create_host_groups(kRanks, {.timeout_ms = std::numeric_limits<int64_t>::max()});
  EXPECT_EQ(groups[0]->timeout_ms(), int64_t{100} * 365 * 24 * 3600 * 1000);
  auto in = make_inputs(7);
  auto buffers = make_buffers(groups);
  run_host_ranks(groups, [&](int rank, Group& group) {
    if (rank == 2) std::this_thread::sleep_for(std::chrono::milliseconds(100));  // late, not absent
    group.barrier();
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ll_round(*buffers[rank], in, rank);  // nobody masked for being 100 ms late
    normal_round(*buffers[rank], in, rank);
  });
}

// ---- defect 7: run_host_ranks when threads cannot be created --------------------------------------

TEST(HostFailure, RunHostRanksJoinsWhenThreadCreationFails) {
#ifdef EPX_TEST_ASAN
  GTEST_SKIP() << "an address-space limit breaks the sanitizer's own allocations";
#else
  // In a child process: limit the address space to what is mapped now plus 256 MiB, so that only a few
  // 8 MiB thread stacks fit, then start 1024 ranks. Exit 0: Error(kOutOfMemory) naming the started count.
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    long pages = 0;
    std::ifstream("/proc/self/statm") >> pages;
    const rlim_t limit = static_cast<rlim_t>(pages) * sysconf(_SC_PAGESIZE) + (rlim_t{256} << 20);
    const rlimit rl{limit, limit};
    if (setrlimit(RLIMIT_AS, &rl) != 0) _exit(3);
    try {
      // The started ranks wait in a barrier (so their stacks are not reused) until the others time out.
      auto groups = create_host_groups(1024, {.timeout_ms = 1'000});
      run_host_ranks(groups, [](int, Group& group) { group.barrier(); });
      _exit(4);  // every thread started: the limit did not bite
    } catch (const Error& e) {
      const std::string what = e.what();
      _exit(e.code() == ErrorCode::kOutOfMemory && what.find("of 1024") != std::string::npos ? 0 : 5);
    } catch (...) {
      _exit(6);
    }
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "child died by signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WEXITSTATUS(status), 0);
#endif
}

// ---- buffer options: invalid on one rank, or different between ranks (the cuda buffer's creation) ---------

TEST(HostFailure, InvalidBufferOptionsOnOneRankFailEveryRankAtOnce) {
  auto groups = create_host_groups(kRanks, {.timeout_ms = kTimeoutMs});
  std::vector<Outcome> out(kRanks);
  run_host_ranks(groups, [&](int rank, Group& group) {
    BufferOptions options;
    if (rank == 1) options.low_latency.combine_send_parts = 3;
    out[rank] = attempt([&] { ep::agree_on_options(group, options); });
  });
  EXPECT_NE(out[1].message.find("low_latency.combine_send_parts must be 1, 2, 4 or 8, got 3"), std::string::npos)
      << out[1].message;
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + out[r].message);
    EXPECT_EQ(out[r].code, code(r == 1 ? ErrorCode::kInvalidArgument : ErrorCode::kPeerFailure));
    EXPECT_LT(out[r].ms, kTimeoutMs / 2.0);
  }
  // Alike and valid: every rank passes, on the same group.
  run_host_ranks(groups, [&](int, Group& group) { EXPECT_NO_THROW(ep::agree_on_options(group, BufferOptions{})); });
}

TEST(HostFailure, BufferOptionsThatDifferBetweenRanksFailEveryRank) {
  auto groups = create_host_groups(kRanks, {.timeout_ms = kTimeoutMs});
  std::vector<Outcome> out(kRanks);
  run_host_ranks(groups, [&](int rank, Group& group) {
    BufferOptions options;
    options.normal.stage_timeline = rank == 0;  // a per-rank debug switch: may differ
    if (rank == 2) options.normal.whole_copies = false;
    out[rank] = attempt([&] { ep::agree_on_options(group, options); });
  });
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + out[r].message);
    EXPECT_EQ(out[r].code, code(ErrorCode::kInvalidArgument));
    EXPECT_NE(out[r].message.find("BufferOptions.normal.whole_copies must be the same on every rank"),
              std::string::npos);
  }
  // Ranges are checked by Buffer::create on the host backend too (its creation is not collective).
  BufferOptions bad;
  bad.normal.max_copy_chunks = 0;
  try {
    (void)Buffer::create(groups[0], bad);
    ADD_FAILURE() << "max_copy_chunks 0 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("normal.max_copy_chunks must be in [1, 8], got 0"), std::string::npos);
  }
}

// The low-latency launch mode is agreed like the other kernel switches: it changes no protocol (plain and
// programmatic launches interoperate), but every rank then runs, and times, the same kernels.
TEST(HostFailure, LowLatencyProgrammaticLaunchMustAgree) {
  auto groups = create_host_groups(kRanks, {.timeout_ms = kTimeoutMs});
  std::vector<Outcome> out(kRanks);
  run_host_ranks(groups, [&](int rank, Group& group) {
    BufferOptions options;
    if (rank == 0) options.low_latency.programmatic_launch = false;
    out[rank] = attempt([&] { ep::agree_on_options(group, options); });
  });
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r) + ": " + out[r].message);
    EXPECT_EQ(out[r].code, code(ErrorCode::kInvalidArgument));
    EXPECT_NE(out[r].message.find("BufferOptions.low_latency.programmatic_launch must be the same on every rank"),
              std::string::npos);
  }
  run_host_ranks(groups, [&](int, Group& group) {
    BufferOptions options;
    options.low_latency.programmatic_launch = false;
    EXPECT_NO_THROW(ep::agree_on_options(group, options));
  });
}

}  // namespace
}  // namespace epx
