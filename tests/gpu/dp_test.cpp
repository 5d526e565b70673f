// GPU tests of DP-attention gather/scatter and the batch-metadata sync against the host backend.
//
// Ranks: 2, one per GPU (NCCL cannot put two ranks of one communicator on one GPU), as threads of this
// process. Layouts: pure DP (attn_dp 2: rank d is DP rank d) and attention TP 2 (one DP rank held by
// both ranks, which then hold the same local batch). Every case draws fresh random rows (a share of
// them -0, which SUM_LEN turns into +0), runs them through host groups (the oracle) and cuda groups,
// poisons every cuda output with 0xAB bytes first, and compares every element of every output: gather
// and slice-scatter bit-exactly, reduce-scatter within one bf16 rounding (NCCL may add in bf16). Local
// tensors carry 3 padding rows past the count (CUDA-graph padding), which scatter must zero.
// The seed is printed.
#include "epx/dp.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <string>

#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/quant.h"
#include "testing/gpu_util.h"
#include "testing/routing.h"

namespace epx {
namespace {

using testing::fresh_seed;
using testing::num_gpus;

constexpr int kNumRanks = 2;
constexpr int64_t kPadRows = 3;


// One set of groups per process: the DP communicator is created once per group.
std::vector<std::shared_ptr<Group>>& cuda_groups() {
  static auto groups = [] {
    CudaGroupOptions o;
    o.timeout_ms = 20'000;
    return create_cuda_groups({0, 1}, o);
  }();
  return groups;
}
std::vector<std::shared_ptr<Group>>& host_groups() {
  static auto groups = create_host_groups(kNumRanks);
  return groups;
}

// A fast hash fill (mt19937 over 10^8 elements would dominate the run).
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Random finite values of magnitude about 2^-8 to 2^8 (random sign, exponent and mantissa bits), one in
// 64 a negative zero. Raw element bytes of `dtype`, made on the bits (fast: up to 10^8 elements).
std::vector<uint8_t> random_rows(uint64_t seed, int64_t rows, int64_t hidden, DType dtype) {
  const int64_t n = rows * hidden;
  std::vector<uint8_t> out(static_cast<size_t>(n) * dtype_size(dtype));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = mix(seed * 0x100000001b3ull + static_cast<uint64_t>(i));
    const uint32_t sign = static_cast<uint32_t>(h >> 63);
    const uint32_t exponent = 119 + static_cast<uint32_t>((h >> 40) % 16);  // 2^-8 .. 2^7
    const bool neg_zero = ((h >> 32) & 63) == 0;
    if (dtype == DType::kFloat32) {
      const uint32_t bits =
          neg_zero ? 0x80000000u : (sign << 31) | (exponent << 23) | static_cast<uint32_t>(h & 0x7fffff);
      std::memcpy(out.data() + i * 4, &bits, 4);
    } else {
      const uint16_t bits =
          neg_zero ? uint16_t{0x8000} : static_cast<uint16_t>((sign << 15) | (exponent << 7) | (h & 0x7f));
      std::memcpy(out.data() + i * 2, &bits, 2);
    }
  }
  return out;
}

struct DeviceBuffer {
  void* ptr = nullptr;
  int device = 0;
  DeviceBuffer(size_t bytes, int dev) : device(dev) {
    cudaSetDevice(dev);
    if (bytes > 0) {
      EXPECT_EQ(cudaMalloc(&ptr, bytes), cudaSuccess);
    }
  }
  ~DeviceBuffer() {
    if (ptr != nullptr) {
      cudaSetDevice(device);
      cudaFree(ptr);
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

struct Case {
  ParallelSizes sizes;
  std::vector<int64_t> tokens;  // per DP rank
  DpPaddingMode mode = DpPaddingMode::kMaxLen;
  DType dtype = DType::kBFloat16;
  int64_t hidden = 7168;
};

std::string describe(const Case& c, uint64_t seed) {
  std::string t;
  for (auto v : c.tokens) t += std::to_string(v) + ",";
  return "attn_dp " + std::to_string(c.sizes.attn_dp_size) + " tokens [" + t + "] " + to_string(c.mode) + " " +
         to_string(c.dtype) + " hidden " + std::to_string(c.hidden) + " seed " + std::to_string(seed);
}

// Counts elements that differ: exactly, or (reduce_tolerance) by more than one bf16 / fp32 rounding
// of the larger magnitude.
int64_t count_mismatches(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, DType dtype,
                         bool reduce_tolerance) {
  EXPECT_EQ(got.size(), want.size());
  if (!reduce_tolerance) {
    int64_t bad = 0;
    const size_t elem = dtype_size(dtype);
    for (size_t i = 0; i + elem <= got.size(); i += elem) bad += std::memcmp(&got[i], &want[i], elem) != 0;
    return bad;
  }
  int64_t bad = 0;
  const size_t elem = dtype_size(dtype);
  for (size_t i = 0; i + elem <= got.size(); i += elem) {
    float a, b;
    if (dtype == DType::kFloat32) {
      std::memcpy(&a, &got[i], 4);
      std::memcpy(&b, &want[i], 4);
    } else {
      uint16_t x, y;
      std::memcpy(&x, &got[i], 2);
      std::memcpy(&y, &want[i], 2);
      a = bf16_to_float(x);
      b = bf16_to_float(y);
    }
    const float ulp = dtype == DType::kFloat32 ? 1.2e-7f : 7.9e-3f;
    bad += std::abs(a - b) > ulp * std::max(std::abs(a), std::abs(b)) + 1e-30f;
  }
  return bad;
}

void run_case(const Case& c) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(describe(c, seed));
  std::fprintf(stderr, "case: %s\n", describe(c, seed).c_str());
  const ParallelLayout layout = ParallelLayout::create(c.sizes);
  const DpGatherPlan plan = plan_dp_gather(c.tokens, c.mode, layout.attn_tp_size());
  const int64_t H = c.hidden;
  const size_t elem = dtype_size(c.dtype);
  const size_t global_bytes = static_cast<size_t>(plan.buffer_len * H) * elem;

  // Inputs. local: per DP rank (its TP ranks share it), count + kPadRows rows (the padding rows random
  // too: gather must ignore them). partial: per rank, the partial global buffer for reduce-scatter.
  std::vector<std::vector<uint8_t>> dp_local(layout.attn_dp_size());
  for (int d = 0; d < layout.attn_dp_size(); ++d) {
    dp_local[d] = random_rows(seed * 131 + d, c.tokens[d] + kPadRows, H, c.dtype);
  }
  std::vector<std::vector<uint8_t>> partial(kNumRanks);
  for (int r = 0; r < kNumRanks; ++r) partial[r] = random_rows(seed * 137 + 1000 + r, plan.buffer_len, H, c.dtype);
  auto local_rows = [&](int r) { return c.tokens[layout.coords(r).attn_dp_rank] + kPadRows; };

  // Oracle: the host backend.
  std::vector<std::vector<uint8_t>> want_global(kNumRanks), want_slice(kNumRanks), want_rs(kNumRanks);
  run_host_ranks(host_groups(), [&](int r, Group& g) {
    auto local = dp_local[layout.coords(r).attn_dp_rank];
    want_global[r].assign(global_bytes, 0xCD);
    dp_gather(g, layout, plan, TensorView::of(local.data(), c.dtype, {local_rows(r), H}),
              TensorView::of(want_global[r].data(), c.dtype, {plan.buffer_len, H}));
    want_slice[r].assign(static_cast<size_t>(local_rows(r) * H) * elem, 0xCD);
    dp_scatter(g, layout, plan, TensorView::of(want_global[r].data(), c.dtype, {plan.buffer_len, H}),
               TensorView::of(want_slice[r].data(), c.dtype, {local_rows(r), H}), DpScatterKind::kSlice);
    want_rs[r].assign(static_cast<size_t>(local_rows(r) * H) * elem, 0xCD);
    dp_scatter(g, layout, plan, TensorView::of(partial[r].data(), c.dtype, {plan.buffer_len, H}),
               TensorView::of(want_rs[r].data(), c.dtype, {local_rows(r), H}), DpScatterKind::kReduceScatter);
  });

  // Under test: the cuda backend, every output poisoned first.
  std::vector<std::vector<uint8_t>> got_global(kNumRanks), got_slice(kNumRanks), got_rs(kNumRanks);
  run_host_ranks(cuda_groups(), [&](int r, Group& g) {
    const int dev = g.device().index;
    cudaSetDevice(dev);
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    const auto& host_local = dp_local[layout.coords(r).attn_dp_rank];
    const size_t local_bytes = static_cast<size_t>(local_rows(r) * H) * elem;
    DeviceBuffer local(local_bytes, dev), global(global_bytes, dev), part(global_bytes, dev), out(local_bytes, dev);
    cudaMemcpyAsync(local.ptr, host_local.data(), local_bytes, cudaMemcpyHostToDevice, stream);
    cudaMemcpyAsync(part.ptr, partial[r].data(), global_bytes, cudaMemcpyHostToDevice, stream);
    testing::poison(global.ptr, global_bytes, stream);
    const Device device = Device::cuda(dev);
    const auto global_view = TensorView::of(global.ptr, c.dtype, {plan.buffer_len, H}, device);
    const auto out_view = TensorView::of(out.ptr, c.dtype, {local_rows(r), H}, device);
    dp_gather(g, layout, plan, TensorView::of(local.ptr, c.dtype, {local_rows(r), H}, device), global_view, stream);
    got_global[r].resize(global_bytes);
    cudaMemcpyAsync(got_global[r].data(), global.ptr, global_bytes, cudaMemcpyDeviceToHost, stream);

    testing::poison(out.ptr, local_bytes, stream);
    dp_scatter(g, layout, plan, global_view, out_view, DpScatterKind::kSlice, stream);
    got_slice[r].resize(local_bytes);
    cudaMemcpyAsync(got_slice[r].data(), out.ptr, local_bytes, cudaMemcpyDeviceToHost, stream);

    testing::poison(out.ptr, local_bytes, stream);
    dp_scatter(g, layout, plan, TensorView::of(part.ptr, c.dtype, {plan.buffer_len, H}, device), out_view,
               DpScatterKind::kReduceScatter, stream);
    got_rs[r].resize(local_bytes);
    cudaMemcpyAsync(got_rs[r].data(), out.ptr, local_bytes, cudaMemcpyDeviceToHost, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cudaStreamDestroy(stream);
  });

  for (int r = 0; r < kNumRanks; ++r) {
    EXPECT_EQ(count_mismatches(got_global[r], want_global[r], c.dtype, false), 0) << "gather, rank " << r;
    EXPECT_EQ(count_mismatches(got_slice[r], want_slice[r], c.dtype, false), 0) << "slice scatter, rank " << r;
    EXPECT_EQ(count_mismatches(got_rs[r], want_rs[r], c.dtype, true), 0) << "reduce-scatter, rank " << r;
  }
}

class DpGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (num_gpus() < kNumRanks) GTEST_SKIP() << "needs 2 GPUs";
  }
};

ParallelSizes pure_dp() {
  ParallelSizes s;
  s.world_size = 2;
  s.attn_dp_size = 2;
  return s;
}
ParallelSizes attn_tp2() {
  ParallelSizes s;
  s.world_size = 2;
  s.attn_dp_size = 1;
  return s;
}

// NOTE: the 8192-token cases use hidden 512 so that the host oracle stays within seconds; hidden 7168
// runs at up to 4096 tokens.
TEST_F(DpGpuTest, PureDpBothModesManyCounts) {
  const std::vector<std::vector<int64_t>> counts = {{1, 1}, {0, 5}, {8192, 0}, {17, 8192}, {8192, 8192}, {300, 129}};
  for (const auto& t : counts) {
    for (auto mode : {DpPaddingMode::kMaxLen, DpPaddingMode::kSumLen}) {
      run_case({pure_dp(), t, mode, DType::kBFloat16, t[0] + t[1] > 1000 ? 512 : 7168});
    }
  }
  for (auto mode : {DpPaddingMode::kMaxLen, DpPaddingMode::kSumLen}) {
    run_case({pure_dp(), {4096, 1}, mode, DType::kBFloat16, 7168});
  }
}

TEST_F(DpGpuTest, Float32AndOddHidden) {
  for (auto mode : {DpPaddingMode::kMaxLen, DpPaddingMode::kSumLen}) {
    run_case({pure_dp(), {33, 2}, mode, DType::kFloat32, 7168});
    run_case({pure_dp(), {3, 0}, mode, DType::kBFloat16, 7});  // rows not 16-byte multiples
    run_case({pure_dp(), {3, 4}, mode, DType::kFloat32, 5});
  }
}

TEST_F(DpGpuTest, AllRanksIdle) {
  for (auto mode : {DpPaddingMode::kMaxLen, DpPaddingMode::kSumLen}) run_case({pure_dp(), {0, 0}, mode});
}

TEST_F(DpGpuTest, AttentionTp2) {
  // One DP rank held by both ranks: MAX_LEN splits its slot over them; reduce-scatter takes the
  // per-rank reduce path.
  for (int64_t n : {1, 2, 1001, 8192}) {
    for (auto mode : {DpPaddingMode::kMaxLen, DpPaddingMode::kSumLen}) {
      run_case({attn_tp2(), {n}, mode, DType::kBFloat16, n > 1000 ? 512 : 7168});
    }
  }
}

// An argument rejected on one rank only (docs/reliability.md, "Invalid arguments of dp_gather / dp_scatter on one
// rank"): rank 0's local lives on the host; it raises kInvalidArgument naming local, but first joins the call's NCCL
// collective with zero rows, so rank 1's gather completes (rank 0's slot zeroed) and the next calls of both ranks are
// in step (before, rank 0 skipped the collective and rank 1's next call paired with the wrong one).
TEST_F(DpGpuTest, BadArgumentOnOneRankStillJoinsTheCollective) {
  const ParallelLayout layout = ParallelLayout::pure_dp(2);
  const DpGatherPlan plan = plan_dp_gather(std::vector<int64_t>{1, 1}, DpPaddingMode::kMaxLen);
  const int64_t H = 8;
  std::vector<std::string> errors(kNumRanks);
  std::vector<std::vector<uint16_t>> got(kNumRanks);
  run_host_ranks(cuda_groups(), [&](int r, Group& g) {
    const int dev = g.device().index;
    cudaSetDevice(dev);
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    std::vector<uint16_t> host(H, float_to_bf16(1.0f + r));
    DeviceBuffer local(H * 2, dev), global(plan.buffer_len * H * 2, dev);
    cudaMemcpyAsync(local.ptr, host.data(), H * 2, cudaMemcpyHostToDevice, stream);
    testing::poison(global.ptr, plan.buffer_len * H * 2, stream);
    const Device device = Device::cuda(dev);
    const auto local_view = r == 0 ? TensorView::of(host.data(), DType::kBFloat16, {1, H})
                                   : TensorView::of(local.ptr, DType::kBFloat16, {1, H}, device);
    try {
      dp_gather(g, layout, plan, local_view, TensorView::of(global.ptr, DType::kBFloat16, {plan.buffer_len, H}, device),
                stream);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      errors[r] = e.what();
    }
    got[r].resize(plan.buffer_len * H);
    cudaMemcpyAsync(got[r].data(), global.ptr, plan.buffer_len * H * 2, cudaMemcpyDeviceToHost, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cudaStreamDestroy(stream);
  });
  EXPECT_NE(errors[0].find("local"), std::string::npos) << errors[0];
  EXPECT_TRUE(errors[1].empty()) << errors[1];
  for (int64_t h = 0; h < H; ++h) {
    EXPECT_EQ(bf16_to_float(got[1][h]), 0.0f) << "rank 0's slot: zero rows of its own";
    EXPECT_EQ(bf16_to_float(got[1][plan.offsets[1] * H + h]), 2.0f) << "rank 1's own row";
  }
  // The next batch-metadata sync tells rank 1 (its gather lacked rank 0's rows); the one after passes. Then rank 0
  // fails a sync (BatchMetadataSync::fail): rank 1's sync raises at once, naming it.
  std::vector<std::string> sync_errors(kNumRanks * 3);
  run_host_ranks(cuda_groups(), [&](int r, Group& g) {
    cudaSetDevice(g.device().index);
    BatchMetadataSync sync(g, layout);
    for (int step = 0; step < 3; ++step) {
      try {
        if (step == 2 && r == 0) {
          sync.fail("test");
          continue;
        }
        (void)sync.sync(BatchMetadata::idle());
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kPeerFailure) << e.what();
        sync_errors[step * kNumRanks + r] = e.what();
      }
    }
  });
  EXPECT_NE(sync_errors[1].find("rank 0 rejected 1 dp_gather"), std::string::npos) << sync_errors[1];
  EXPECT_TRUE(sync_errors[0].empty()) << sync_errors[0];
  EXPECT_TRUE(sync_errors[2].empty() && sync_errors[3].empty()) << sync_errors[2] << " | " << sync_errors[3];
  EXPECT_NE(sync_errors[5].find("rank 0 could not make this sync"), std::string::npos) << sync_errors[5];
  // The next calls pair as they should.
  run_case({pure_dp(), {3, 2}, DpPaddingMode::kMaxLen, DType::kBFloat16, 64});
}

TEST_F(DpGpuTest, MetadataSyncMatchesReduction) {
  const ParallelLayout layout = ParallelLayout::pure_dp(2);
  std::mt19937 rng(static_cast<uint32_t>(fresh_seed()));
  std::vector<std::unique_ptr<BatchMetadataSync>> syncs;
  for (auto& g : cuda_groups()) syncs.push_back(std::make_unique<BatchMetadataSync>(*g, layout));
  for (int step = 0; step < 20; ++step) {
    std::vector<std::optional<BatchMetadata>> mine(kNumRanks);
    for (int r = 0; r < kNumRanks; ++r) {
      if (rng() % 4 == 0) continue;  // no batch: the fallback record
      BatchMetadata m;
      m.forward_mode = rng() % 2 ? ForwardMode::kDecode : ForwardMode::kExtend;
      m.num_tokens = 1 + rng() % 5000;
      m.num_tokens_for_logprob = rng() % 10;
      m.can_run_decode_graph = rng() % 2;
      m.is_extend_in_batch = m.forward_mode == ForwardMode::kExtend;
      m.can_run_tbo = rng() % 2;
      m.prefill_graph_max_prefix_len = rng() % 100;
      m.attention_pairs = rng() % 1000;
      mine[r] = m;
    }
    std::vector<BatchMetadata> records;
    for (const auto& m : mine) records.push_back(m.value_or(BatchMetadata::idle()));
    const GlobalBatchInfo want = reduce_batch_metadata(records);
    std::vector<BatchSyncResult> got(kNumRanks);
    run_host_ranks(cuda_groups(), [&](int r, Group&) { got[r] = syncs[r]->sync(mine[r]); });
    for (int r = 0; r < kNumRanks; ++r) {
      SCOPED_TRACE("step " + std::to_string(step) + " rank " + std::to_string(r));
      EXPECT_EQ(got[r].global.num_tokens, want.num_tokens);
      EXPECT_EQ(got[r].global.num_tokens_for_logprob, want.num_tokens_for_logprob);
      EXPECT_EQ(got[r].global.attention_pairs, want.attention_pairs);
      EXPECT_EQ(got[r].global.can_run_decode_graph, want.can_run_decode_graph);
      EXPECT_EQ(got[r].global.can_run_tbo, want.can_run_tbo);
      EXPECT_EQ(got[r].global.forward_mode, want.forward_mode);
      EXPECT_EQ(got[r].global.prefill_graph_max_prefix_len, want.prefill_graph_max_prefix_len);
      EXPECT_EQ(got[r].global.is_extend_in_batch, want.is_extend_in_batch);
      EXPECT_EQ(got[r].run_idle_batch, !mine[r].has_value() && want.any_tokens);
    }
  }
}

}  // namespace
}  // namespace epx
