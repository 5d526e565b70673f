// Low-latency kernels (src/ep/cuda/low_latency.*) against the host backend, in one process.
//
// Routing: every rank draws T tokens with K distinct experts of E uniformly, then sets ~5% of the
// top-k slots to -1. Ranks map to GPUs round-robin (2 ranks on 2 GPUs, 4 ranks on 2 GPUs). Each rank's
// region is a cudaMalloc on its GPU; peers reach it through peer access (one process, no IPC).
// Outputs are poisoned before every run and every element the contract defines is compared: counts,
// layout ranges and src_info exactly, received data and scales bit-exactly on the packed rows
// [0, recv_count[e]) of each expert, combine output bit-exactly (both sides sum in fp32 in ascending k
// without fused multiply-add). The packed layout is also checked on its own: range begins are the prefix
// sums of the counts, src_info is a token index below the count and -1 past it.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>

#include "ep/cuda/low_latency.h"
#include "epx/buffer.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/quant.h"
#include "testing/gpu_util.h"
#include "testing/routing.h"
#include "testing/stats.h"

namespace epx::cuda {
namespace {

using testing::download;

#define CUDA_OK(call)                                                          \
  do {                                                                         \
    const cudaError_t err_ = (call);                                           \
    ASSERT_EQ(err_, cudaSuccess) << #call << ": " << cudaGetErrorString(err_); \
  } while (0)

#define CUDA_CHECK_THROW(call) testing::cuda_ok((call), #call)

struct Case {
  int num_ranks;
  int64_t num_tokens;  // per rank (all ranks; rank 1 may be idle)
  int64_t max_tokens;
  int64_t hidden;
  int num_topk;
  int64_t num_experts;
  bool use_fp8;
  bool ue8m0;
  bool idle_rank1 = false;
  bool token_staged = true;         // the flat routing's rows (false: per pair, as the hierarchical forward writes)
  bool programmatic_launch = true;  // LowLatencyConfig::programmatic_launch (false: plain stream order)
  bool expert_side = false;         // LowLatencyConfig::expert_side_reduction (the host reference too)
};

struct RankInputs {
  std::vector<uint16_t> x;     // [T, H]
  std::vector<int64_t> topk;   // [T, K]
  std::vector<float> weights;  // [T, K]
  std::vector<uint16_t> y;     // [E_local, R * M, H] expert outputs
  int64_t num_tokens = 0;
};

std::vector<RankInputs> make_inputs(const Case& c, std::mt19937& rng) {
  std::vector<RankInputs> in(c.num_ranks);
  const int64_t e_local = c.num_experts / c.num_ranks;
  std::uniform_real_distribution<float> value(-3.f, 3.f);
  for (int r = 0; r < c.num_ranks; ++r) {
    auto& v = in[r];
    v.num_tokens = (c.idle_rank1 && r == 1) ? 0 : c.num_tokens;
    v.x.resize(v.num_tokens * c.hidden);
    for (auto& e : v.x) e = float_to_bf16(value(rng));
    v.topk = testing::random_distinct_topk(rng, v.num_tokens, c.num_topk, c.num_experts, /*p_masked=*/0.05);
    v.weights.resize(v.num_tokens * c.num_topk);
    for (auto& w : v.weights) w = value(rng);
    v.y.resize(e_local * c.num_ranks * c.max_tokens * c.hidden);
    // NOTE: y is large (up to ~0.5 GB per rank); a hash of (seed, index) fills it far faster than
    // mt19937 + float conversion, and still differs per element and per call.
    // Filled by several threads: the GPU machine has many cores and y reaches ~0.5 GB.
    const uint32_t seed = static_cast<uint32_t>(rng());
    const unsigned num_threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
    std::vector<std::thread> workers;
    for (unsigned w = 0; w < num_threads; ++w) {
      workers.emplace_back([&v, seed, w, num_threads] {
        for (size_t i = w; i < v.y.size(); i += num_threads) {
          uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
          h ^= h >> 15;
          h *= 2246822519u;
          h ^= h >> 13;
          // bf16 with exponent 126..129 (|value| in [0.5, 4)) and a random sign and mantissa.
          v.y[i] = static_cast<uint16_t>(((h >> 31) << 15) | ((126u + ((h >> 7) & 3u)) << 7) | (h & 0x7fu));
        }
      });
    }
    for (auto& t : workers) t.join();
  }
  return in;
}

// What the host backend produces for one rank.
struct Expected {
  std::vector<uint8_t> recv_x;  // [E_local, R*M, H * elem]
  std::vector<uint8_t> recv_scales;
  std::vector<int32_t> recv_count, src_info;
  std::vector<int64_t> layout_range;
  std::vector<uint16_t> out;  // [T, H]
};

template <typename T>
std::vector<T> copy_out(const Tensor& t) {
  std::vector<T> v(t.nbytes() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), t.data(), t.nbytes());
  return v;
}

// timeout_ms bounds the host ranks' waits: long, except where a rank is meant to be absent.
std::vector<Expected> host_reference(const Case& c, std::vector<RankInputs>& in, const std::vector<bool>& present,
                                     int64_t timeout_ms = 120'000) {
  std::vector<Expected> out(c.num_ranks);
  HostGroupOptions options;
  options.timeout_ms = timeout_ms;
  auto groups = create_host_groups(c.num_ranks, options);
  run_host_ranks(groups, [&](int r, Group&) {
    if (!present[r]) return;
    BufferOptions bo;
    bo.num_low_latency_bytes = 1;
    bo.low_latency.expert_side_reduction = c.expert_side;
    auto buffer = Buffer::create(groups[r], bo);
    for (int m = 0; m < c.num_ranks; ++m) {
      if (!present[m]) buffer->mask_rank(m);
    }
    LowLatencyDispatchArgs a;
    a.x = TensorView::of(in[r].x.data(), DType::kBFloat16, {in[r].num_tokens, c.hidden});
    a.topk_idx = TensorView::of(in[r].topk.data(), DType::kInt64, {in[r].num_tokens, c.num_topk});
    a.max_tokens_per_rank = c.max_tokens;
    a.num_experts = c.num_experts;
    a.use_fp8 = c.use_fp8;
    a.scale_format = c.ue8m0 ? ScaleFormat::kUE8M0 : ScaleFormat::kFloat32;
    const auto d = buffer->low_latency_dispatch(a);
    out[r].recv_x = copy_out<uint8_t>(d.recv_x);
    if (c.use_fp8) out[r].recv_scales = copy_out<uint8_t>(d.recv_x_scales);
    out[r].recv_count = copy_out<int32_t>(d.recv_count);
    out[r].src_info = copy_out<int32_t>(d.recv_src_info);
    out[r].layout_range = copy_out<int64_t>(d.recv_layout_range);
    const int64_t e_local = c.num_experts / c.num_ranks;
    LowLatencyCombineArgs b;
    b.x = TensorView::of(in[r].y.data(), DType::kBFloat16, {e_local, c.num_ranks * c.max_tokens, c.hidden});
    b.topk_idx = a.topk_idx;
    b.topk_weights = TensorView::of(in[r].weights.data(), DType::kFloat32, {in[r].num_tokens, c.num_topk});
    b.handle = d.handle;
    out[r].out = copy_out<uint16_t>(buffer->low_latency_combine(b).x);
  });
  return out;
}

// One rank's outputs, copied to the host.
struct Outputs {
  std::vector<int32_t> count, src_info;
  std::vector<int64_t> range;
  std::vector<uint8_t> data, scales;
  std::vector<uint16_t> out;
};

// Every element the contract defines: counts, ranges and src_info exactly; data and scales of the packed
// rows [0, recv_count[e]) bit-exactly; the combined output bit-exactly. Returns the number of mismatches.
int64_t compare_outputs(const Case& c, int r, const Outputs& o, const Expected& e) {
  const int64_t e_local = c.num_experts / c.num_ranks, R = c.num_ranks, M = c.max_tokens, H = c.hidden;
  const int64_t elem = c.use_fp8 ? 1 : 2;
  int64_t bad = 0;
  auto expect = [&](bool ok, const std::string& what) {
    if (!ok && bad++ < 5) ADD_FAILURE() << "rank " << r << ": " << what;
  };
  expect(o.count == e.recv_count, "recv_count");
  expect(o.range == e.layout_range, "layout_range");
  expect(o.src_info == e.src_info, "src_info");
  if (o.count.size() != static_cast<size_t>(e_local) || o.range.size() != static_cast<size_t>(e_local * R) ||
      o.src_info.size() != static_cast<size_t>(e_local * R * M)) {
    expect(false, "output sizes");
    return bad;
  }
  // The packed layout itself (what a masked grouped GEMM relies on), independently of the host backend.
  for (int64_t el = 0; el < e_local; ++el) {
    int64_t begin = 0;
    for (int64_t src = 0; src < R; ++src) {
      expect(o.range[el * R + src] >> 32 == begin, "layout_range begin of expert " + std::to_string(el) + " source " +
                                                       std::to_string(src) + " is not the prefix sum");
      begin += o.range[el * R + src] & 0xffffffff;
    }
    expect(o.count[el] == begin, "recv_count of expert " + std::to_string(el) + " is not the sum of the ranges");
    for (int64_t i = 0; i < R * M; ++i) {
      const int32_t v = o.src_info[el * R * M + i];
      expect(i < begin ? (v >= 0 && v < M) : v == -1,
             "src_info of expert " + std::to_string(el) + " row " + std::to_string(i) + " = " + std::to_string(v));
    }
  }
  const int64_t scale_bytes = (H / 128) * (c.ue8m0 ? 1 : 4);
  for (int64_t el = 0; el < e_local; ++el) {
    for (int64_t i = 0; i < e.recv_count[el]; ++i) {
      const int64_t row = el * R * M + i;
      expect(std::memcmp(o.data.data() + row * H * elem, e.recv_x.data() + row * H * elem, H * elem) == 0,
             "recv_x row " + std::to_string(row));
      if (c.use_fp8) {
        expect(std::memcmp(o.scales.data() + row * scale_bytes, e.recv_scales.data() + row * scale_bytes,
                           scale_bytes) == 0,
               "scales row " + std::to_string(row));
      }
    }
  }
  expect(o.out.size() == e.out.size(), "combine output size");
  for (size_t i = 0; i < std::min(o.out.size(), e.out.size()); ++i) {
    expect(o.out[i] == e.out[i], "combine out element " + std::to_string(i) + ": got " +
                                     std::to_string(bf16_to_float(o.out[i])) + " want " +
                                     std::to_string(bf16_to_float(e.out[i])));
  }
  return bad;
}

// One rank's device side.
struct DeviceRank {
  int device = 0;
  cudaStream_t stream = nullptr;
  char* region = nullptr;
  ErrorRecord* error = nullptr;
  void *x = nullptr, *topk = nullptr, *weights = nullptr, *y = nullptr, *out = nullptr;
  int* cumulative = nullptr;
};

class Rig {
 public:
  Rig(const Case& c, int num_gpus, uint64_t timeout_ns = 2'000'000'000) : c_(c) {
    layout_ = LowLatencyLayout::make(c.max_tokens, c.hidden, c.num_ranks, c.num_experts);
    // Ranks sharing a GPU: the combine grids LowLatencyEngine passes them.
    CUDA_CHECK_THROW(cudaSetDevice(0));
    shared_gpu_ = shared_gpu_combine_grid((c.num_ranks + num_gpus - 1) / num_gpus);
    ranks_.resize(c.num_ranks);
    for (int r = 0; r < c.num_ranks; ++r) {
      auto& d = ranks_[r];
      d.device = r % num_gpus;
      CUDA_CHECK_THROW(cudaSetDevice(d.device));
      for (int p = 0; p < num_gpus; ++p) {
        if (p == d.device) continue;
        const cudaError_t err = cudaDeviceEnablePeerAccess(p, 0);
        if (err == cudaErrorPeerAccessAlreadyEnabled)
          cudaGetLastError();
        else
          CUDA_CHECK_THROW(err);
      }
      CUDA_CHECK_THROW(cudaStreamCreateWithFlags(&d.stream, cudaStreamNonBlocking));
      CUDA_CHECK_THROW(cudaMalloc(&d.region, layout_.total_bytes));
      CUDA_CHECK_THROW(cudaMemset(d.region, 0, layout_.total_bytes));
      CUDA_CHECK_THROW(cudaHostAlloc(reinterpret_cast<void**>(&d.error), sizeof(ErrorRecord), cudaHostAllocMapped));
      std::memset(d.error, 0, sizeof(ErrorRecord));
      const int64_t e_local = c.num_experts / c.num_ranks;
      CUDA_CHECK_THROW(cudaMalloc(&d.x, std::max<int64_t>(1, c.max_tokens * c.hidden * 2)));
      CUDA_CHECK_THROW(cudaMalloc(&d.topk, std::max<int64_t>(1, c.max_tokens * c.num_topk * 8)));
      CUDA_CHECK_THROW(cudaMalloc(&d.weights, std::max<int64_t>(1, c.max_tokens * c.num_topk * 4)));
      CUDA_CHECK_THROW(cudaMalloc(&d.y, e_local * c.num_ranks * c.max_tokens * c.hidden * 2));
      CUDA_CHECK_THROW(cudaMalloc(&d.out, std::max<int64_t>(1, c.max_tokens * c.hidden * 2)));
      CUDA_CHECK_THROW(cudaMalloc(&d.cumulative, e_local * 4));
      CUDA_CHECK_THROW(cudaMemset(d.cumulative, 0, e_local * 4));
    }
    for (int r = 0; r < c.num_ranks; ++r) {
      auto& p = peers_.emplace_back();
      p.rank = r;
      p.num_ranks = c.num_ranks;
      p.error = ranks_[r].error;
      p.timeout_ns = timeout_ns;
      for (int q = 0; q < c.num_ranks; ++q) p.bases[q] = ranks_[q].region;
    }
  }
  ~Rig() {
    for (auto& d : ranks_) {
      cudaSetDevice(d.device);
      cudaStreamSynchronize(d.stream);
      for (void* p :
           {static_cast<void*>(d.region), d.x, d.topk, d.weights, d.y, d.out, static_cast<void*>(d.cumulative)}) {
        cudaFree(p);
      }
      cudaFreeHost(d.error);
      cudaStreamDestroy(d.stream);
    }
  }

  void upload(const std::vector<RankInputs>& in) {
    for (int r = 0; r < c_.num_ranks; ++r) {
      auto& d = ranks_[r];
      CUDA_CHECK_THROW(cudaSetDevice(d.device));
      CUDA_CHECK_THROW(cudaMemcpyAsync(d.x, in[r].x.data(), in[r].x.size() * 2, cudaMemcpyHostToDevice, d.stream));
      CUDA_CHECK_THROW(
          cudaMemcpyAsync(d.topk, in[r].topk.data(), in[r].topk.size() * 8, cudaMemcpyHostToDevice, d.stream));
      CUDA_CHECK_THROW(
          cudaMemcpyAsync(d.weights, in[r].weights.data(), in[r].weights.size() * 4, cudaMemcpyHostToDevice, d.stream));
      CUDA_CHECK_THROW(cudaMemcpyAsync(d.y, in[r].y.data(), in[r].y.size() * 2, cudaMemcpyHostToDevice, d.stream));
      num_tokens_[r] = in[r].num_tokens;
    }
  }

  // Poisons the outputs of the set the next dispatch/combine will use, and its staging area (so stale rows
  // from an earlier round cannot pass for this round's).
  void poison(int set) {
    const auto& s = layout_.sets[set];
    const int64_t slots = layout_.num_local_experts * c_.num_ranks * c_.max_tokens;
    for (auto& d : ranks_) {
      CUDA_CHECK_THROW(cudaSetDevice(d.device));
      CUDA_CHECK_THROW(cudaMemsetAsync(d.region + s.dispatch_data, 0x7b, slots * c_.hidden * 2, d.stream));
      CUDA_CHECK_THROW(cudaMemsetAsync(d.region + s.dispatch_src_info, 0x7b, slots * 4, d.stream));
      CUDA_CHECK_THROW(cudaMemsetAsync(d.region + s.recv_x, 0x7c, slots * c_.hidden * 2, d.stream));
      CUDA_CHECK_THROW(cudaMemsetAsync(d.region + s.recv_x_scales, 0x7c, slots * (c_.hidden / 128) * 4, d.stream));
      CUDA_CHECK_THROW(cudaMemsetAsync(d.region + s.recv_src_info, 0x7c, slots * 4, d.stream));
      CUDA_CHECK_THROW(cudaMemsetAsync(d.region + s.recv_count, 0x7b, layout_.num_local_experts * 4, d.stream));
      CUDA_CHECK_THROW(
          cudaMemsetAsync(d.region + s.layout_range, 0x7b, layout_.num_local_experts * c_.num_ranks * 8, d.stream));
      CUDA_CHECK_THROW(cudaMemsetAsync(d.out, 0x7b, c_.max_tokens * c_.hidden * 2, d.stream));
    }
    // NOTE: peers write into this rank's region from their own streams: without this sync a fast peer's
    // dispatch could land before a slow rank's poison (or upload) and be overwritten by it.
    sync();
  }

  LowLatencyDispatchLaunch dispatch_args(int r) const {
    return {ranks_[r].x,
            ranks_[r].topk,
            true,
            num_tokens_[r],
            c_.num_topk,
            c_.use_fp8,
            c_.ue8m0,
            /*scales_fp32=*/!c_.ue8m0,
            /*scales_column_major=*/false,
            ranks_[r].cumulative,
            /*token_staged=*/c_.token_staged,
            /*programmatic_launch=*/c_.programmatic_launch,
            /*pair_map=*/c_.expert_side};
  }
  LowLatencyCombineLaunch combine_args(int r, int dispatch_set) const {
    return {ranks_[r].y,
            ranks_[r].topk,
            true,
            static_cast<const float*>(ranks_[r].weights),
            num_tokens_[r],
            c_.num_topk,
            ranks_[r].out,
            dispatch_set,
            LowLatencyConfig{}.combine_send_parts,
            /*dispatch_id=*/0,
            /*programmatic_launch=*/c_.programmatic_launch,
            /*expert_side=*/c_.expert_side,
            /*partial_send_blocks=*/shared_gpu_.send_blocks,
            /*recv_blocks=*/shared_gpu_.recv_blocks,
            /*wait_cost=*/nullptr,
            /*solo_max_rows=*/LowLatencyConfig{}.combine_solo_max_rows};
  }

  // Enqueues one full dispatch + combine on every present rank: the fused kernels, or the send and receive
  // halves (sends before receives).
  void enqueue_round(int set, const std::vector<bool>& present, bool fused = false) {
    // One launch per present rank, on its device and stream.
    auto each = [&](auto launch) {
      for (int r = 0; r < c_.num_ranks; ++r) {
        if (!present[r]) continue;
        cudaSetDevice(ranks_[r].device);
        launch(r, ranks_[r].stream);
      }
    };
    if (fused) {
      each([&](int r, cudaStream_t st) {
        launch_low_latency_dispatch(ll::Phase::kBoth, peers_[r], layout_, set, dispatch_args(r), st);
      });
      each([&](int r, cudaStream_t st) {
        launch_low_latency_combine(ll::Phase::kBoth, peers_[r], layout_, set, combine_args(r, set), st);
      });
      return;
    }
    each([&](int r, cudaStream_t st) {
      launch_low_latency_dispatch(ll::Phase::kSend, peers_[r], layout_, set, dispatch_args(r), st);
    });
    each([&](int r, cudaStream_t st) {
      launch_low_latency_dispatch(ll::Phase::kRecv, peers_[r], layout_, set, dispatch_args(r), st);
    });
    each([&](int r, cudaStream_t st) {
      launch_low_latency_combine(ll::Phase::kSend, peers_[r], layout_, set, combine_args(r, set), st);
    });
    each([&](int r, cudaStream_t st) {
      launch_low_latency_combine(ll::Phase::kRecv, peers_[r], layout_, set, combine_args(r, set), st);
    });
  }

  // Every rank's region back to zero (signals, sequence numbers, counters), as clean_low_latency_buffer does: a
  // send half run alone leaves signals no receive consumed, which a later receive would take for its peer's.
  void clean() {
    sync();
    for (auto& d : ranks_) {
      CUDA_CHECK_THROW(cudaSetDevice(d.device));
      CUDA_CHECK_THROW(cudaMemset(d.region, 0, layout_.total_bytes));
    }
    for (auto& d : ranks_) {
      CUDA_CHECK_THROW(cudaSetDevice(d.device));
      CUDA_CHECK_THROW(cudaDeviceSynchronize());
    }
  }

  void sync() {
    for (auto& d : ranks_) {
      CUDA_CHECK_THROW(cudaSetDevice(d.device));
      CUDA_CHECK_THROW(cudaStreamSynchronize(d.stream));
    }
  }

  // Compares rank r's outputs in `set` with the host backend's; returns the number of mismatches.
  int64_t compare(int r, int set, const Expected& e) {
    const auto& d = ranks_[r];
    const auto& s = layout_.sets[set];
    const int64_t e_local = layout_.num_local_experts, R = c_.num_ranks, M = c_.max_tokens, H = c_.hidden;
    const int64_t slots = e_local * R * M;
    Outputs o;
    o.count.resize(e_local);
    o.src_info.resize(slots);
    o.range.resize(e_local * R);
    o.data.resize(slots * H * (c_.use_fp8 ? 1 : 2));
    o.scales.resize(c_.use_fp8 ? slots * (H / 128) * (c_.ue8m0 ? 1 : 4) : 0);
    o.out.resize(num_tokens_[r] * H);
    cudaSetDevice(d.device);
    cudaMemcpy(o.count.data(), d.region + s.recv_count, e_local * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(o.src_info.data(), d.region + s.recv_src_info, slots * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(o.range.data(), d.region + s.layout_range, e_local * R * 8, cudaMemcpyDeviceToHost);
    cudaMemcpy(o.data.data(), d.region + s.recv_x, o.data.size(), cudaMemcpyDeviceToHost);
    if (!o.scales.empty()) {
      cudaMemcpy(o.scales.data(), d.region + s.recv_x_scales, o.scales.size(), cudaMemcpyDeviceToHost);
    }
    cudaMemcpy(o.out.data(), d.out, o.out.size() * 2, cudaMemcpyDeviceToHost);
    return compare_outputs(c_, r, o, e);
  }

  ErrorRecord error(int r) const { return *ranks_[r].error; }
  const LowLatencyLayout& layout() const { return layout_; }
  DeviceRank& rank(int r) { return ranks_[r]; }
  const LowLatencyPeers& peers(int r) const { return peers_[r]; }

 private:
  Case c_;
  LowLatencyLayout layout_;
  std::vector<DeviceRank> ranks_;
  std::vector<LowLatencyPeers> peers_;
  int64_t num_tokens_[kLowLatencyMaxRanks] = {};
  SharedGpuCombineGrid shared_gpu_;
};

class LowLatencyKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::print_stack_on_crash();
    num_gpus_ = testing::num_gpus();
    if (num_gpus_ == 0) GTEST_SKIP() << "no GPU";
  }
  // NOTE: more than two ranks per GPU are left out: each rank's kernel spins until its peers' kernels have
  // written, and a GPU does not promise to run four such grids at once (four ranks on one H200 timed out on
  // 2026-12-01), so such a case would test the scheduler, not the protocol. Grids of 1024 blocks (1024 experts)
  // need a GPU per rank for the same reason.
  // One device per rank, round robin over the visible GPUs.
  std::vector<int> devices_for(const Case& c) const {
    std::vector<int> devices;
    for (int r = 0; r < c.num_ranks; ++r) devices.push_back(r % num_gpus_);
    return devices;
  }
  bool runs_here(const Case& c, int max_ranks_per_gpu = 2) const {
    if (c.num_ranks <= max_ranks_per_gpu * num_gpus_) return true;
    std::printf("[ skipped  ] R=%d on %d GPU(s): more than %d rank(s) per GPU\n", c.num_ranks, num_gpus_,
                max_ranks_per_gpu);
    return false;
  }
  int num_gpus_ = 0;
};

TEST_F(LowLatencyKernels, MatchHostBackend) {
  std::mt19937 rng(20261130);
  std::vector<Case> cases = {
      {2, 128, 128, 7168, 8, 256, false, false},
      {2, 128, 128, 7168, 8, 256, true, false},
      {2, 32, 64, 2048, 6, 16, true, true},
      {2, 1, 1, 5120, 1, 16, false, false},
      {2, 256, 256, 8192, 9, 288, true, false},
      {4, 128, 128, 7168, 8, 256, true, false},
      {4, 32, 32, 2048, 9, 288, false, false},
      {2, 64, 128, 2048, 8, 256, false, false, /*idle_rank1=*/true},
      // Rows per pair (the hierarchical forward's staging, read by the same receive).
      {2, 128, 128, 7168, 8, 256, true, false, false, /*token_staged=*/false},
      {2, 32, 64, 2048, 6, 16, false, false, /*idle_rank1=*/true, /*token_staged=*/false},
      // Plain stream order (the other cases launch programmatically, the library default).
      {2, 128, 128, 7168, 8, 256, true, false, false, true, /*programmatic_launch=*/false},
      {2, 1, 1, 5120, 1, 16, false, false, false, false, /*programmatic_launch=*/false},
      // The expert-side reduction (one bf16 partial row per token and expert rank; the host reference sums alike).
      {2, 128, 128, 7168, 8, 256, true, false, false, true, true, /*expert_side=*/true},
      {2, 1, 1, 5120, 1, 16, false, false, false, true, true, /*expert_side=*/true},
      {2, 64, 128, 2048, 8, 256, false, false, /*idle_rank1=*/true, false, false, /*expert_side=*/true},
      {4, 128, 128, 7168, 8, 256, true, false, false, true, true, /*expert_side=*/true},
  };
  for (const Case& c : cases) {
    if (!runs_here(c)) continue;
    SCOPED_TRACE("R=" + std::to_string(c.num_ranks) + " T=" + std::to_string(c.num_tokens) + " H=" +
                 std::to_string(c.hidden) + " K=" + std::to_string(c.num_topk) + " E=" + std::to_string(c.num_experts) +
                 (c.use_fp8 ? (c.ue8m0 ? " fp8/ue8m0" : " fp8") : " bf16") + (c.token_staged ? "" : " rows per pair") +
                 (c.programmatic_launch ? "" : " plain launches") + (c.expert_side ? " expert-side reduction" : ""));
    Rig rig(c, num_gpus_);
    const std::vector<bool> all(c.num_ranks, true);
    // Three rounds alternate sets 0, 1, 0 with fresh data each time, so tags and set reuse are exercised;
    // round 0 uses the split kernels, rounds 1 and 2 the fused ones (so each set sees both).
    for (int round = 0; round < 3; ++round) {
      auto in = make_inputs(c, rng);
      const auto expected = host_reference(c, in, all);
      const int set = round % 2;
      rig.upload(in);
      rig.poison(set);
      rig.enqueue_round(set, all, /*fused=*/round >= 1);
      rig.sync();
      for (int r = 0; r < c.num_ranks; ++r) {
        EXPECT_EQ(rig.error(r).code, kErrNone) << "rank " << r << " recorded a timeout/overflow";
        EXPECT_EQ(rig.compare(r, set, expected[r]), 0) << "round " << round;
      }
    }
  }
}

// The limits of the contract: hidden 16384, top-16, 1024 experts (grids of 1024 blocks), fp8 with UE8M0, and
// a batch at M that leaves many slots empty on an idle rank.
TEST_F(LowLatencyKernels, LimitShapes) {
  std::mt19937 rng(16384);
  for (const Case& c : {Case{2, 16, 16, 16384, 16, 1024, true, true}, Case{2, 64, 64, 16384, 16, 1024, false, false,
                                                                           /*idle_rank1=*/true}}) {
    if (!runs_here(c, /*max_ranks_per_gpu=*/1)) continue;
    SCOPED_TRACE("H=" + std::to_string(c.hidden) + " T=" + std::to_string(c.num_tokens));
    Rig rig(c, num_gpus_);
    const std::vector<bool> all(c.num_ranks, true);
    for (int round = 0; round < 2; ++round) {
      auto in = make_inputs(c, rng);
      const auto expected = host_reference(c, in, all);
      rig.upload(in);
      rig.poison(round);
      rig.enqueue_round(round, all, /*fused=*/round == 1);
      rig.sync();
      for (int r = 0; r < c.num_ranks; ++r) {
        EXPECT_EQ(rig.error(r).code, kErrNone) << "rank " << r;
        EXPECT_EQ(rig.compare(r, round, expected[r]), 0) << "round " << round;
      }
    }
  }
}

// A small case for compute-sanitizer (memcheck, racecheck), run by scripts/gpu-check.sh.
TEST_F(LowLatencyKernels, SmallCase) {
  std::mt19937 rng(3);
  const Case c{2, 8, 8, 256, 4, 16, true, false};
  Rig rig(c, num_gpus_);
  const std::vector<bool> all(c.num_ranks, true);
  for (int round = 0; round < 2; ++round) {
    auto in = make_inputs(c, rng);
    const auto expected = host_reference(c, in, all);
    rig.upload(in);
    rig.poison(round);
    rig.enqueue_round(round, all);
    rig.sync();
    for (int r = 0; r < c.num_ranks; ++r) EXPECT_EQ(rig.compare(r, round, expected[r]), 0);
  }
}

TEST_F(LowLatencyKernels, GraphReplayWithNewData) {
  std::mt19937 rng(77);
  const Case c{2, 128, 128, 7168, 8, 256, true, false};
  Rig rig(c, num_gpus_);
  const std::vector<bool> all(c.num_ranks, true);
  // One graph per rank holding two rounds (sets 0 and 1), replayed with new inputs each time.
  std::vector<cudaGraphExec_t> execs(c.num_ranks);
  auto in = make_inputs(c, rng);
  rig.upload(in);
  rig.sync();
  for (int r = 0; r < c.num_ranks; ++r) {
    auto& d = rig.rank(r);
    cudaSetDevice(d.device);
    CUDA_OK(cudaStreamBeginCapture(d.stream, cudaStreamCaptureModeThreadLocal));
    // Set 0: the split kernels; set 1 (the one checked): the fused ones.
    launch_low_latency_dispatch(ll::Phase::kSend, rig.peers(r), rig.layout(), 0, rig.dispatch_args(r), d.stream);
    launch_low_latency_dispatch(ll::Phase::kRecv, rig.peers(r), rig.layout(), 0, rig.dispatch_args(r), d.stream);
    launch_low_latency_combine(ll::Phase::kSend, rig.peers(r), rig.layout(), 0, rig.combine_args(r, 0), d.stream);
    launch_low_latency_combine(ll::Phase::kRecv, rig.peers(r), rig.layout(), 0, rig.combine_args(r, 0), d.stream);
    launch_low_latency_dispatch(ll::Phase::kBoth, rig.peers(r), rig.layout(), 1, rig.dispatch_args(r), d.stream);
    launch_low_latency_combine(ll::Phase::kBoth, rig.peers(r), rig.layout(), 1, rig.combine_args(r, 1), d.stream);
    cudaGraph_t graph;
    CUDA_OK(cudaStreamEndCapture(d.stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&execs[r], graph, 0));
    cudaGraphDestroy(graph);
  }
  for (int replay = 0; replay < 100; ++replay) {
    const bool check = replay % 50 == 49;
    // New tokens, routing and weights every replay; new expert outputs (~0.5 GB per rank) only for the
    // checked replays, where the host reference needs them.
    if (check) {
      in = make_inputs(c, rng);
    } else {
      auto fresh =
          make_inputs(Case{c.num_ranks, c.num_tokens, 0, c.hidden, c.num_topk, c.num_experts, c.use_fp8, c.ue8m0}, rng);
      for (int r = 0; r < c.num_ranks; ++r) fresh[r].y = std::move(in[r].y);
      in = std::move(fresh);
    }
    std::vector<Expected> expected;
    if (check) expected = host_reference(c, in, all);
    rig.upload(in);
    rig.poison(1);
    for (int r = 0; r < c.num_ranks; ++r) {
      cudaSetDevice(rig.rank(r).device);
      CUDA_OK(cudaGraphLaunch(execs[r], rig.rank(r).stream));
    }
    rig.sync();
    if (check) {
      for (int r = 0; r < c.num_ranks; ++r) {
        EXPECT_EQ(rig.error(r).code, kErrNone);
        EXPECT_EQ(rig.compare(r, 1, expected[r]), 0) << "replay " << replay;
      }
    }
  }
  for (auto e : execs) cudaGraphExecDestroy(e);
}

TEST_F(LowLatencyKernels, AbsentRankTimesOutAndIsMasked) {
  std::mt19937 rng(5);
  const Case c{2, 64, 64, 2048, 8, 16, false, false};
  // 1 ms: rank 1 never runs, rank 0 must not hang.
  Rig rig(c, num_gpus_, 1'000'000);
  auto in = make_inputs(c, rng);
  const std::vector<bool> present = {true, false};
  const auto expected = host_reference(c, in, present, /*timeout_ms=*/200);
  rig.upload(in);
  rig.poison(0);
  rig.enqueue_round(0, present);
  rig.sync();
  const ErrorRecord error = rig.error(0);
  EXPECT_EQ(error.code, kErrTimeout);
  EXPECT_EQ(error.where, kSiteLowLatencyDispatchRecv);
  EXPECT_EQ(error.rank, 0);
  EXPECT_EQ(error.peer, 1);
  int mask[kLowLatencyMaxRanks];
  cudaSetDevice(rig.rank(0).device);
  cudaMemcpy(mask, rig.rank(0).region + rig.layout().control_offset + offsetof(LowLatencyControl, mask), sizeof(mask),
             cudaMemcpyDeviceToHost);
  EXPECT_EQ(mask[1], 1);
  EXPECT_EQ(rig.compare(0, 0, expected[0]), 0);
}

// A buffer with just the low-latency memory case `c` needs.
std::unique_ptr<Buffer> low_latency_buffer(std::shared_ptr<Group> group, const Case& c) {
  BufferOptions options;
  options.num_low_latency_bytes = low_latency_buffer_size_hint(c.max_tokens, c.hidden, c.num_ranks, c.num_experts);
  options.low_latency.programmatic_launch = c.programmatic_launch;
  options.low_latency.expert_side_reduction = c.expert_side;
  return Buffer::create(std::move(group), options);
}

template <typename T>
void* to_device(const std::vector<T>& v) {
  void* p = nullptr;
  if (cudaMalloc(&p, std::max<size_t>(1, v.size() * sizeof(T))) != cudaSuccess) return nullptr;
  cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return p;
}

// The same kernels through the public Buffer API on cuda groups (one thread per rank): plain calls,
// then the hook split; the rank-mask calls.
TEST_F(LowLatencyKernels, BufferApiWithHooks) {
  std::mt19937 rng(31);
  // The third case with plain launches (BufferOptions::low_latency.programmatic_launch = false), the last with the
  // expert-side reduction (its send half waits for the peers' weights, so the GEMM sits between a waiting send and
  // the receive).
  for (const Case& c : {Case{2, 128, 128, 7168, 8, 256, true, false}, Case{4, 32, 64, 2048, 9, 288, false, false},
                        Case{2, 32, 64, 2048, 8, 16, true, false, false, true, /*programmatic_launch=*/false},
                        Case{2, 128, 128, 7168, 8, 256, true, false, false, true, true, /*expert_side=*/true}}) {
    if (!runs_here(c)) continue;
    const std::vector<bool> all(c.num_ranks, true);
    auto in = make_inputs(c, rng);
    const auto expected = host_reference(c, in, all);
    const std::vector<int> devices = devices_for(c);
    auto groups = create_cuda_groups(devices);
    const int64_t e_local = c.num_experts / c.num_ranks;
    run_host_ranks(groups, [&](int r, Group& group) {
      cudaSetDevice(devices[r]);
      auto buffer = low_latency_buffer(groups[r], c);
      cudaStream_t stream;
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      void* x = to_device(in[r].x);
      void* topk = to_device(in[r].topk);
      void* weights = to_device(in[r].weights);
      void* y = to_device(in[r].y);
      const Device dev = Device::cuda(devices[r]);
      // Hook mode runs a GEMM (fp32, 2048^3, ~0.1 ms) on the same stream between the send and the receive half,
      // as a model would between dispatch and its experts.
      cublasHandle_t blas = nullptr;
      ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
      cublasSetStream(blas, stream);
      constexpr int kGemm = 2048;
      float *ga = nullptr, *gc = nullptr;
      cudaMalloc(&ga, sizeof(float) * kGemm * kGemm);
      cudaMalloc(&gc, sizeof(float) * kGemm * kGemm);
      cudaMemsetAsync(ga, 0, sizeof(float) * kGemm * kGemm, stream);
      auto gemm = [&] {
        const float alpha = 1.f, beta = 0.f;
        ASSERT_EQ(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, kGemm, kGemm, kGemm, &alpha, ga, kGemm, ga, kGemm, &beta,
                              gc, kGemm),
                  CUBLAS_STATUS_SUCCESS);
      };
      // One dispatch + combine through the Buffer, compared with the host backend.
      auto check_round = [&](bool hook, const std::string& what) {
        LowLatencyDispatchArgs a;
        a.x = TensorView::of(x, DType::kBFloat16, {in[r].num_tokens, c.hidden}, dev);
        a.topk_idx = TensorView::of(topk, DType::kInt64, {in[r].num_tokens, c.num_topk}, dev);
        a.max_tokens_per_rank = c.max_tokens;
        a.num_experts = c.num_experts;
        a.use_fp8 = c.use_fp8;
        a.return_recv_hook = hook;
        a.stream = stream;
        auto d = buffer->low_latency_dispatch(a);
        EXPECT_EQ(static_cast<bool>(d.recv_hook), hook);
        if (hook) {
          gemm();
          d.recv_hook();
        }
        LowLatencyCombineArgs b;
        b.x = TensorView::of(y, DType::kBFloat16, {e_local, c.num_ranks * c.max_tokens, c.hidden}, dev);
        b.topk_idx = a.topk_idx;
        b.topk_weights = TensorView::of(weights, DType::kFloat32, {in[r].num_tokens, c.num_topk}, dev);
        b.handle = d.handle;
        b.return_recv_hook = hook;
        b.stream = stream;
        auto out = buffer->low_latency_combine(b);
        if (hook) {
          gemm();
          out.recv_hook();
        }
        cudaStreamSynchronize(stream);
        Outputs o{download<int32_t>(d.recv_count),
                  download<int32_t>(d.recv_src_info),
                  download<int64_t>(d.recv_layout_range),
                  download<uint8_t>(d.recv_x),
                  c.use_fp8 ? download<uint8_t>(d.recv_x_scales) : std::vector<uint8_t>{},
                  download<uint16_t>(out.x)};
        EXPECT_EQ(compare_outputs(c, r, o, expected[r]), 0)
            << what << ", R=" << c.num_ranks << (c.programmatic_launch ? "" : ", plain launches");
      };
      check_round(false, "plain");
      check_round(true, "hook");
      group.barrier();
      const int peer = (r + 1) % c.num_ranks;
      buffer->mask_rank(peer);
      EXPECT_TRUE(buffer->rank_mask()[peer]);
      buffer->clear_rank_mask();
      EXPECT_FALSE(buffer->rank_mask()[peer]);
      EXPECT_THROW(buffer->mask_rank(r), Error);
      buffer->mask_rank(peer);
      buffer->unmask_rank(peer);
      EXPECT_FALSE(buffer->rank_mask()[peer]);
      buffer->unmask_rank(r);  // its own bit: a no-op
      EXPECT_THROW(buffer->unmask_rank(c.num_ranks), Error);
      EXPECT_THROW(buffer->unmask_rank(-1), Error);
      // After a clean (collective: sequence numbers restart at 0 on every rank) the same call matches again.
      buffer->mask_rank(peer);
      buffer->clean_low_latency_buffer();
      EXPECT_FALSE(buffer->rank_mask()[peer]);
      check_round(false, "after clean_low_latency_buffer");
      cudaStreamSynchronize(stream);
      for (void* p : {x, topk, weights, y, static_cast<void*>(ga), static_cast<void*>(gc)}) cudaFree(p);
      cublasDestroy(blas);
      buffer.reset();
      cudaStreamDestroy(stream);
    });
  }
}

// Handles of different dispatches in a low-latency combine (issue 13, defect 3, cuda side): rank 0 reverses its first
// dispatch, rank 1 its second. Every combine signal carries the sender's dispatch id, so each rank leaves the other's
// rows out and its next call raises kInvalidArgument naming the peer (not silently wrong data); after
// clean_low_latency_buffer a round matches the host backend again.
TEST_F(LowLatencyKernels, MismatchedHandlesAreReported) {
  std::mt19937 rng(77);
  const Case c{2, 64, 64, 2048, 8, 16, false, false};
  if (!runs_here(c)) GTEST_SKIP() << "needs " << c.num_ranks << " ranks";
  const std::vector<bool> all(c.num_ranks, true);
  auto in = make_inputs(c, rng);
  auto in2 = make_inputs(c, rng);
  const auto expected = host_reference(c, in, all);
  const std::vector<int> devices = devices_for(c);
  auto groups = create_cuda_groups(devices);
  const int64_t e_local = c.num_experts / c.num_ranks;
  std::vector<std::string> messages(c.num_ranks);
  std::vector<int> codes(c.num_ranks, -1);
  std::vector<int64_t> bad(c.num_ranks, -1);
  run_host_ranks(groups, [&](int r, Group& group) {
    cudaSetDevice(devices[r]);
    auto buffer = low_latency_buffer(groups[r], c);
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    void* x = to_device(in[r].x);
    void* topk = to_device(in[r].topk);
    void* topk2 = to_device(in2[r].topk);
    void* weights = to_device(in[r].weights);
    void* weights2 = to_device(in2[r].weights);
    void* y = to_device(in[r].y);
    const Device dev = Device::cuda(devices[r]);
    auto dispatch = [&](void* tk) {
      LowLatencyDispatchArgs a;
      a.x = TensorView::of(x, DType::kBFloat16, {in[r].num_tokens, c.hidden}, dev);
      a.topk_idx = TensorView::of(tk, DType::kInt64, {in[r].num_tokens, c.num_topk}, dev);
      a.max_tokens_per_rank = c.max_tokens;
      a.num_experts = c.num_experts;
      a.use_fp8 = c.use_fp8;
      a.stream = stream;
      return buffer->low_latency_dispatch(a);
    };
    auto combine = [&](const LowLatencyDispatchResult& d, void* tk, void* w) {
      LowLatencyCombineArgs b;
      b.x = TensorView::of(y, DType::kBFloat16, {e_local, c.num_ranks * c.max_tokens, c.hidden}, dev);
      b.topk_idx = TensorView::of(tk, DType::kInt64, {in[r].num_tokens, c.num_topk}, dev);
      b.topk_weights = TensorView::of(w, DType::kFloat32, {in[r].num_tokens, c.num_topk}, dev);
      b.handle = d.handle;
      b.stream = stream;
      return buffer->low_latency_combine(b);
    };
    {
      auto d1 = dispatch(topk);
      auto d2 = dispatch(topk2);
      if (r == 0) {
        (void)combine(d1, topk, weights);
      } else {
        (void)combine(d2, topk2, weights2);
      }
      cudaStreamSynchronize(stream);
      try {
        (void)dispatch(topk);
        ADD_FAILURE() << "rank " << r << ": no error";
      } catch (const Error& e) {
        codes[r] = static_cast<int>(e.code());
        messages[r] = e.what();
      }
    }
    buffer->clean_low_latency_buffer();
    auto d = dispatch(topk);
    auto out = combine(d, topk, weights);
    cudaStreamSynchronize(stream);
    Outputs o{download<int32_t>(d.recv_count),
              download<int32_t>(d.recv_src_info),
              download<int64_t>(d.recv_layout_range),
              download<uint8_t>(d.recv_x),
              std::vector<uint8_t>{},
              download<uint16_t>(out.x)};
    bad[r] = compare_outputs(c, r, o, expected[r]);
    // NOTE: out.x was allocated on `stream` and frees on it (cudaFreeAsync): drop it before the stream, or the
    // free runs on a destroyed stream (a SIGSEGV inside the driver, 1x H200, 2026-12-03).
    out = {};
    d = {};
    for (void* p : {x, topk, topk2, weights, weights2, y}) cudaFree(p);
    buffer.reset();
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  });
  for (int r = 0; r < c.num_ranks; ++r) {
    EXPECT_EQ(codes[r], static_cast<int>(ErrorCode::kInvalidArgument)) << messages[r];
    EXPECT_NE(messages[r].find("another low-latency dispatch"), std::string::npos) << messages[r];
    EXPECT_EQ(bad[r], 0);
  }
}

// DeepEP's round_scale and DeepGEMM's column-major scales (ScaleLayout), written by the receive kernel: counts,
// data and scales of the received rows match the host backend byte for byte, with and without the hook.
TEST_F(LowLatencyKernels, ScaleOptionsMatchHostBackend) {
  std::mt19937 rng(512);
  const Case c{2, 64, 64, 2048, 8, 32, true, false};
  if (!runs_here(c)) GTEST_SKIP() << "needs " << c.num_ranks << " ranks";
  const auto in = make_inputs(c, rng);
  struct Option {
    ScaleFormat format;
    bool round;
    ScaleLayout layout;
  };
  const std::vector<Option> options = {{ScaleFormat::kFloat32, true, ScaleLayout::kRowMajor},
                                       {ScaleFormat::kFloat32, false, ScaleLayout::kColumnMajor},
                                       {ScaleFormat::kFloat32, true, ScaleLayout::kColumnMajor},
                                       {ScaleFormat::kUE8M0, false, ScaleLayout::kColumnMajor},
                                       {ScaleFormat::kUE8M0, false, ScaleLayout::kRowMajor}};
  const int R = c.num_ranks;
  const int64_t e_local = c.num_experts / R, slots = R * c.max_tokens;
  struct Got {
    std::vector<int32_t> count;
    std::vector<uint8_t> x, scales;
    std::vector<int64_t> scale_shape;
    size_t scale_elem = 0;
  };
  auto args_for = [&](const Option& o, const void* x, const void* topk, int r, Device dev) {
    LowLatencyDispatchArgs a;
    a.x = TensorView::of(const_cast<void*>(x), DType::kBFloat16, {in[r].num_tokens, c.hidden}, dev);
    a.topk_idx = TensorView::of(const_cast<void*>(topk), DType::kInt64, {in[r].num_tokens, c.num_topk}, dev);
    a.max_tokens_per_rank = c.max_tokens;
    a.num_experts = c.num_experts;
    a.use_fp8 = true;
    a.scale_format = o.format;
    a.round_scale = o.round;
    a.scale_layout = o.layout;
    return a;
  };
  // Host backend.
  std::vector<std::vector<Got>> want(options.size(), std::vector<Got>(R));
  {
    auto hosts = create_host_groups(R, {.timeout_ms = 20'000});
    run_host_ranks(hosts, [&](int r, Group&) {
      BufferOptions bo;
      bo.num_low_latency_bytes = 1;
      auto buffer = Buffer::create(hosts[r], bo);
      for (size_t i = 0; i < options.size(); ++i) {
        const auto d =
            buffer->low_latency_dispatch(args_for(options[i], in[r].x.data(), in[r].topk.data(), r, Device::cpu()));
        Got& g = want[i][r];
        g.count.assign(d.recv_count.data_as<int32_t>(), d.recv_count.data_as<int32_t>() + e_local);
        const auto* xb = static_cast<const uint8_t*>(d.recv_x.data());
        const auto* sb = static_cast<const uint8_t*>(d.recv_x_scales.data());
        g.x.assign(xb, xb + d.recv_x.nbytes());
        g.scales.assign(sb, sb + d.recv_x_scales.nbytes());
        g.scale_shape = d.recv_x_scales.sizes();
        g.scale_elem = dtype_size(d.recv_x_scales.dtype());
      }
    });
  }
  std::vector<int> devices;
  for (int r = 0; r < R; ++r) devices.push_back(r % num_gpus_);
  auto groups = create_cuda_groups(devices);
  run_host_ranks(groups, [&](int r, Group&) {
    cudaSetDevice(devices[r]);
    BufferOptions bo;
    bo.num_low_latency_bytes = low_latency_buffer_size_hint(c.max_tokens, c.hidden, R, c.num_experts);
    auto buffer = Buffer::create(groups[r], bo);
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    void* x = to_device(in[r].x);
    void* topk = to_device(in[r].topk);
    for (size_t i = 0; i < options.size(); ++i) {
      for (const bool hook : {false, true}) {
        SCOPED_TRACE("option " + std::to_string(i) + (hook ? " hook" : " plain") + " rank " + std::to_string(r));
        auto a = args_for(options[i], x, topk, r, Device::cuda(devices[r]));
        a.return_recv_hook = hook;
        a.stream = stream;
        auto d = buffer->low_latency_dispatch(a);
        if (hook) d.recv_hook();
        cudaStreamSynchronize(stream);
        const Got& w = want[i][r];
        ASSERT_EQ(d.recv_x_scales.sizes(), w.scale_shape);
        ASSERT_EQ(dtype_size(d.recv_x_scales.dtype()), w.scale_elem);
        const auto count = download<int32_t>(d.recv_count);
        const auto xs = download<uint8_t>(d.recv_x);
        const auto sc = download<uint8_t>(d.recv_x_scales);
        ASSERT_EQ(count, w.count);
        const bool cm = options[i].layout == ScaleLayout::kColumnMajor;
        const int64_t units = cm ? w.scale_shape[1] : w.scale_shape[2];
        int64_t bad = 0;
        for (int64_t e = 0; e < e_local; ++e) {
          for (int64_t row = 0; row < count[e]; ++row) {
            const int64_t x0 = (e * slots + row) * c.hidden;
            bad += std::memcmp(xs.data() + x0, w.x.data() + x0, c.hidden) != 0;
            for (int64_t u = 0; u < units; ++u) {
              const int64_t at = cm ? (e * units + u) * slots + row : (e * slots + row) * units + u;
              bad += std::memcmp(sc.data() + at * w.scale_elem, w.scales.data() + at * w.scale_elem, w.scale_elem) != 0;
            }
          }
        }
        EXPECT_EQ(bad, 0);
      }
    }
    cudaFree(x);
    cudaFree(topk);
    buffer.reset();
    cudaStreamDestroy(stream);
  });
}

// One rank's dispatch + combine through the Buffer API, for the mask tests below: `between` runs after the dispatch's
// send half (the dispatch returns its hook) and before its receive half, `before_combine` between the dispatch and
// the combine. Returns the combine output.
struct MaskRound {
  const Case& c;
  Buffer& buffer;
  cudaStream_t stream;
  Device dev;
  int64_t num_tokens;
  void *x, *topk, *weights, *y;
  std::vector<uint16_t> run(const std::function<void()>& between, const std::function<void()>& before_combine) {
    LowLatencyDispatchArgs a;
    a.x = TensorView::of(x, DType::kBFloat16, {num_tokens, c.hidden}, dev);
    a.topk_idx = TensorView::of(topk, DType::kInt64, {num_tokens, c.num_topk}, dev);
    a.max_tokens_per_rank = c.max_tokens;
    a.num_experts = c.num_experts;
    a.use_fp8 = c.use_fp8;
    a.return_recv_hook = static_cast<bool>(between);
    a.stream = stream;
    auto d = buffer.low_latency_dispatch(a);
    if (between) {
      cudaStreamSynchronize(stream);  // the send half is out
      between();
      d.recv_hook();
    }
    if (before_combine) {
      cudaStreamSynchronize(stream);
      before_combine();
    }
    LowLatencyCombineArgs b;
    const int64_t e_local = c.num_experts / c.num_ranks;
    b.x = TensorView::of(y, DType::kBFloat16, {e_local, c.num_ranks * c.max_tokens, c.hidden}, dev);
    b.topk_idx = a.topk_idx;
    b.topk_weights = TensorView::of(weights, DType::kFloat32, {num_tokens, c.num_topk}, dev);
    b.handle = d.handle;
    b.stream = stream;
    auto out = buffer.low_latency_combine(b);
    cudaStreamSynchronize(stream);
    std::vector<uint16_t> result = download<uint16_t>(out.x);
    out = {};  // frees on `stream` (cudaFreeAsync): before the stream goes
    return result;
  }
};

// The same rank's four device copies of a round's inputs.
struct DeviceInputs {
  void *x = nullptr, *topk = nullptr, *weights = nullptr, *y = nullptr;
  explicit DeviceInputs(const RankInputs& in)
      : x(to_device(in.x)), topk(to_device(in.topk)), weights(to_device(in.weights)), y(to_device(in.y)) {}
  ~DeviceInputs() {
    for (void* p : {x, topk, weights, y}) cudaFree(p);
  }
  DeviceInputs(const DeviceInputs&) = delete;
  DeviceInputs& operator=(const DeviceInputs&) = delete;
};

// A rank whose dispatch receive found a source masked, and whose mask was lifted before the combine, sent that source
// none of its rows: its combine signals say so (kCombineNoRows), and the source counts its experts as zero instead of
// adding the rows an earlier call left in the same buffer set (review of fd96f8c). Rank 1 masks rank 0 between its
// dispatch's halves and unmasks it before the combine; rank 0's output must equal the host backend's with rank 1
// absent, in both combine modes; the next round matches the host backend again.
TEST_F(LowLatencyKernels, MaskLiftedBeforeCombineLeavesNoStaleRows) {
  for (const bool expert_side : {false, true}) {
    SCOPED_TRACE(expert_side ? "expert-side reduction" : "per-expert combine");
    std::mt19937 rng(expert_side ? 91 : 90);
    Case c{2, 64, 64, 2048, 8, 32, false, false};
    c.expert_side = expert_side;
    if (!runs_here(c)) GTEST_SKIP() << "needs " << c.num_ranks << " ranks";
    auto old_in = make_inputs(c, rng);  // rounds 1 and 2 (sets 0 and 1): rows a stale read would find
    auto in = make_inputs(c, rng);      // rounds 3 and 4
    const auto expected_all = host_reference(c, in, {true, true});
    const auto expected_alone = host_reference(c, in, {true, false});
    const std::vector<int> devices = devices_for(c);
    auto groups = create_cuda_groups(devices);
    std::vector<std::vector<uint16_t>> third(c.num_ranks), fourth(c.num_ranks);
    run_host_ranks(groups, [&](int r, Group& group) {
      cudaSetDevice(devices[r]);
      auto buffer = low_latency_buffer(groups[r], c);
      cudaStream_t stream;
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      {
        DeviceInputs a(old_in[r]), b(in[r]);
        const Device dev = Device::cuda(devices[r]);
        MaskRound old_round{c, *buffer, stream, dev, old_in[r].num_tokens, a.x, a.topk, a.weights, a.y};
        MaskRound round{c, *buffer, stream, dev, in[r].num_tokens, b.x, b.topk, b.weights, b.y};
        old_round.run(nullptr, nullptr);
        old_round.run(nullptr, nullptr);
        if (r == 1) {
          third[r] = round.run([&] { buffer->mask_rank(0); }, [&] { buffer->unmask_rank(0); });
        } else {
          third[r] = round.run(nullptr, nullptr);
        }
        group.barrier();
        EXPECT_FALSE(buffer->rank_mask()[1 - r]) << "rank " << r;
        fourth[r] = round.run(nullptr, nullptr);
      }
      buffer.reset();
      cudaStreamDestroy(stream);
    });
    EXPECT_EQ(third[0], expected_alone[0].out) << "rank 0 read rows rank 1 never sent this call";
    for (int r = 0; r < c.num_ranks; ++r) EXPECT_EQ(fourth[r], expected_all[r].out) << "rank " << r << ", next round";
  }
}

// Expert-side reduction, a one-sided mask: rank 0 masks rank 2 between its dispatch's halves (after rank 2 received
// rank 0's pairs), so rank 0 sends rank 2 no weights and rank 2 waits for them until its timeout. Rank 2's partials
// for rank 1 must not wait with them: rank 1 gets them in time, masks nobody and matches the host backend (before the
// fix every send block of rank 2 could wait for rank 0's weights first, so rank 1 timed out on rank 2 too; review of
// fd96f8c). Rank 2, the last source, is the one masked, so rank 0's packed rows of rank 1's pairs (and the test's
// expert outputs at them) are those of the host run with every rank. Three ranks: on one GPU they share it (the
// expert-side grids are small there).
TEST_F(LowLatencyKernels, ExpertSideOneSidedMaskStaysOneSided) {
  std::mt19937 rng(93);
  Case c{3, 32, 32, 2048, 6, 24, false, false};
  c.expert_side = true;
  if (!runs_here(c, 3)) GTEST_SKIP() << "needs " << c.num_ranks << " ranks";
  auto in = make_inputs(c, rng);
  const auto expected = host_reference(c, in, {true, true, true});
  const std::vector<int> devices = devices_for(c);
  CudaGroupOptions options;
  options.timeout_ms = 2'000;
  auto groups = create_cuda_groups(devices, options);
  std::vector<std::vector<uint16_t>> first(c.num_ranks);
  std::vector<std::vector<bool>> masks(c.num_ranks);
  run_host_ranks(groups, [&](int r, Group& group) {
    cudaSetDevice(devices[r]);
    auto buffer = low_latency_buffer(groups[r], c);
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    {
      DeviceInputs d(in[r]);
      MaskRound round{c, *buffer, stream, Device::cuda(devices[r]), in[r].num_tokens, d.x, d.topk, d.weights, d.y};
      if (r == 0) {
        first[r] = round.run([&] { buffer->mask_rank(2); }, nullptr);
      } else {
        try {
          first[r] = round.run(nullptr, nullptr);
        } catch (const Error& e) {
          ADD_FAILURE() << "rank " << r << ": " << e.what();
        }
      }
      masks[r] = buffer->rank_mask();
      group.barrier();
      buffer->clear_rank_mask();
      group.barrier();
      EXPECT_EQ(round.run(nullptr, nullptr), expected[r].out) << "rank " << r << ", the round after (usable again)";
    }
    buffer.reset();
    cudaStreamDestroy(stream);
  });
  EXPECT_EQ(first[1], expected[1].out) << "rank 1's combine with every partial in time";
  EXPECT_TRUE(masks[0][2]);
  EXPECT_TRUE(masks[2][0]) << "rank 2 waited for rank 0's weights until its timeout";
  EXPECT_FALSE(masks[1][0]);
  EXPECT_FALSE(masks[1][2]) << "rank 1 timed out on rank 2: rank 2's partials waited for rank 0's weights";
  EXPECT_FALSE(masks[2][1]);
}

// Timing of EP2 (or EP1x2 on one GPU), 128 tokens, hidden 7168, top-8 of 256: fp8 dispatch, bf16 combine.
// Each rank's graph holds kInner back-to-back rounds so the launch skew between ranks is amortized.
TEST_F(LowLatencyKernels, Timing) {
  std::mt19937 rng(9);
  std::string json = "[";
  for (int64_t tokens : {1, 32, 64, 128, 256}) {
    const Case c{2, tokens, tokens, 7168, 8, 256, true, false};
    Rig rig(c, num_gpus_);
    auto in = make_inputs(c, rng);
    rig.upload(in);
    rig.sync();
    constexpr int kInner = 20;
    // dispatch, combine, dispatch+combine, dispatch send half alone, combine send half alone (us per call,
    // rank 0), then dispatch and its send half alone with rows per pair (the staging the token-staged rows replace
    // from LowLatencyConfig::token_rows_min_tokens on), then dispatch, combine and dispatch+combine again with plain
    // launches (LowLatencyConfig::programmatic_launch = false; the others launch programmatically, the default). A
    // send half alone waits on nothing: its time is the sender's cost without the peer. Last, combine and
    // dispatch+combine with the expert-side reduction (LowLatencyConfig::expert_side_reduction; programmatic); and the
    // combine with every expert sent by all its parts (LowLatencyConfig::combine_solo_max_rows = 0; the others use
    // the default).
    constexpr int kNumTimings = 13;
    double result[kNumTimings] = {};
    for (int which = 0; which < kNumTimings; ++which) {
      rig.clean();  // the send halves alone (3, 4, 6) leave unconsumed signals
      const bool programmatic = which < 7 || which >= 10;
      const bool expert_side = which == 10 || which == 11;
      const bool no_solo = which == 12;
      // 7, 8, 9: as 0, 1, 2; 10, 11: 1, 2; 12: 1
      const int kind = which < 7 ? which : which < 10 ? which - 7 : which < 12 ? which - 9 : 1;
      std::vector<cudaGraphExec_t> execs(c.num_ranks);
      for (int r = 0; r < c.num_ranks; ++r) {
        auto& d = rig.rank(r);
        cudaSetDevice(d.device);
        CUDA_OK(cudaStreamBeginCapture(d.stream, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < kInner; ++i) {
          const int set = i % 2;
          LowLatencyDispatchLaunch da = rig.dispatch_args(r);
          if (kind >= 5) da.token_staged = false;
          da.programmatic_launch = programmatic;
          da.pair_map = expert_side;
          auto ca = [&](int dset) {
            LowLatencyCombineLaunch a = rig.combine_args(r, dset);
            a.programmatic_launch = programmatic;
            a.expert_side = expert_side;
            if (no_solo) a.solo_max_rows = 0;
            return a;
          };
          if (kind == 3 || kind == 6) {
            launch_low_latency_dispatch(ll::Phase::kSend, rig.peers(r), rig.layout(), set, da, d.stream);
            continue;
          }
          // The full calls use the fused kernels (what a call without a hook launches).
          if ((kind != 1 && kind != 4) || i == 0) {
            launch_low_latency_dispatch(ll::Phase::kBoth, rig.peers(r), rig.layout(), set, da, d.stream);
          }
          if (kind == 4) {
            launch_low_latency_combine(ll::Phase::kSend, rig.peers(r), rig.layout(), set, ca(0), d.stream);
          } else if (kind != 0 && kind != 5) {
            launch_low_latency_combine(ll::Phase::kBoth, rig.peers(r), rig.layout(), set, ca(kind == 1 ? 0 : set),
                                       d.stream);
          }
        }
        cudaGraph_t graph;
        CUDA_OK(cudaStreamEndCapture(d.stream, &graph));
        CUDA_OK(cudaGraphInstantiate(&execs[r], graph, 0));
        cudaGraphDestroy(graph);
      }
      std::vector<double> samples;
      cudaSetDevice(rig.rank(0).device);
      testing::EventTimer timer;
      for (int rep = 0; rep < 60; ++rep) {
        cudaSetDevice(rig.rank(0).device);
        timer.record(0, rig.rank(0).stream);
        for (int r = 0; r < c.num_ranks; ++r) {
          cudaSetDevice(rig.rank(r).device);
          CUDA_OK(cudaGraphLaunch(execs[r], rig.rank(r).stream));
        }
        cudaSetDevice(rig.rank(0).device);
        timer.record(1, rig.rank(0).stream);
        rig.sync();
        const double ms = timer.elapsed_ms();
        if (rep >= 10) samples.push_back(ms);
      }
      // A combine-only graph still holds one dispatch round: subtract it using the dispatch number (launched alike).
      double per = testing::median(samples) * 1e3;
      if (kind == 1 || kind == 4)
        per = (per - result[programmatic ? 0 : 7]) / kInner;
      else
        per /= kInner;
      result[which] = per;
      for (auto e : execs) cudaGraphExecDestroy(e);
      for (int r = 0; r < c.num_ranks; ++r) {
        const ErrorRecord e = rig.error(r);
        EXPECT_EQ(e.code, kErrNone) << "tokens " << tokens << ", timing " << which << ", rank " << r << ": site "
                                    << e.where << ", peer " << e.peer << ", expert " << e.channel << ", expected "
                                    << e.expected << ", observed " << e.observed;
      }
    }
    std::printf(
        "[ll timing] EP2 tokens=%ld hidden=7168 top8/256 fp8 dispatch %.1f us, bf16 combine %.1f us, "
        "round trip %.1f us; send halves alone: dispatch %.1f us, combine %.1f us; rows per pair: dispatch %.1f us, "
        "send half alone %.1f us; plain launches: dispatch %.1f us, combine %.1f us, round trip %.1f us; expert-side "
        "reduction: combine %.1f us, round trip %.1f us; no solo sends: combine %.1f us\n",
        static_cast<long>(tokens), result[0], result[1], result[2], result[3], result[4], result[5], result[6],
        result[7], result[8], result[9], result[10], result[11], result[12]);
    json +=
        std::string(json.size() > 1 ? "," : "") + "{\"tokens\":" + std::to_string(tokens) +
        ",\"dispatch_us\":" + std::to_string(result[0]) + ",\"combine_us\":" + std::to_string(result[1]) +
        ",\"round_trip_us\":" + std::to_string(result[2]) + ",\"dispatch_send_alone_us\":" + std::to_string(result[3]) +
        ",\"combine_send_alone_us\":" + std::to_string(result[4]) +
        ",\"dispatch_rows_per_pair_us\":" + std::to_string(result[5]) +
        ",\"dispatch_send_alone_rows_per_pair_us\":" + std::to_string(result[6]) +
        ",\"dispatch_no_pdl_us\":" + std::to_string(result[7]) + ",\"combine_no_pdl_us\":" + std::to_string(result[8]) +
        ",\"round_trip_no_pdl_us\":" + std::to_string(result[9]) +
        ",\"combine_expert_side_us\":" + std::to_string(result[10]) +
        ",\"round_trip_expert_side_us\":" + std::to_string(result[11]) +
        ",\"combine_no_solo_us\":" + std::to_string(result[12]) + "}";
  }
  json += "]";
  if (const char* path = std::getenv("EPX_LL_TIMING_JSON")) std::ofstream(path) << json << "\n";
}

}  // namespace
}  // namespace epx::cuda
