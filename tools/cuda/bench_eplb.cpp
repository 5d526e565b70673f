// `epx bench --eplb` (issue 16): EPLB live on GPUs. A decode loop of low-latency steps (replica choice on the
// device, fp8 dispatch counting per physical slot, bf16 combine) on skewed routing (Zipf over the logical experts,
// drawn per token), recorded, then one rebalance: the counts summed over the ranks (all_reduce_counts), a new
// placement, the expert weights relocated over the cuda transport (DeepSeek-V3-sized experts, one layer), and the
// same loop again. Prints the GPU utilization (mean / max pairs received per GPU) before and after, the step time
// before and after and the relocation's time and bytes (the serving stall of one rebalanced layer).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <random>

#include "cuda/bench_util.h"
#include "bench_dp.h"
#include "epx/cuda.h"
#include "epx/eplb/device_replicas.h"
#include "epx/eplb/dispatch_counts.h"
#include "epx/eplb/expert_location.h"
#include "epx/eplb/placement.h"
#include "epx/eplb/relocation.h"
#include "epx/error.h"

namespace epx::cli {
namespace {

using eplb::ExpertLocation;
using eplb::Placement;
using eplb::PlacementShape;
using eplb::RelocationPlan;

constexpr int kSteps = 40;                       // decode steps per phase (before / after the rebalance)
constexpr double kZipf = 1.2;                    // routing skew over the logical experts
constexpr size_t kW13Bytes = size_t{4096} * 7168;  // DeepSeek-V3 expert, fp8: w13 [2 x 2048, 7168]
constexpr size_t kW2Bytes = size_t{7168} * 2048;   // and w2 [7168, 2048]

// The byte every slot holding logical expert e is filled with (checked after the relocation).
uint8_t fill_byte(int32_t e) { return static_cast<uint8_t>(e % 251 + 1); }

// [steps, T, K] logical ids: each token draws K distinct experts from a Zipf distribution over a random
// popularity order shared by every rank.
std::vector<int64_t> zipf_routing(std::mt19937_64& rng, const std::vector<int32_t>& order, int steps, int64_t T,
                                  int K) {
  const int E = static_cast<int>(order.size());
  std::vector<double> w(E);
  for (int i = 0; i < E; ++i) w[i] = std::pow(i + 1.0, -kZipf);
  std::discrete_distribution<int> pick(w.begin(), w.end());
  std::vector<int64_t> ids(static_cast<size_t>(steps) * T * K);
  std::vector<int32_t> chosen;
  for (int64_t t = 0; t < int64_t{steps} * T; ++t) {
    chosen.clear();
    while (static_cast<int>(chosen.size()) < K) {
      const int32_t e = order[pick(rng)];
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    for (int k = 0; k < K; ++k) ids[t * K + k] = chosen[k];
  }
  return ids;
}

struct PhaseResult {
  double step_us = 0;                 // median over the steps (dispatch + combine), this rank
  std::vector<int64_t> slot_counts;   // [P]: pairs each physical slot received, summed over the ranks
};

}  // namespace

nlohmann::json run_cuda_eplb_bench(const BenchConfig& config) {
  const int num_gpus = cuda_device_count();
  const int R = config.num_ranks > 0 ? config.num_ranks : num_gpus;
  const int E = static_cast<int>(config.num_experts), K = config.num_topk;
  const int64_t T = config.num_ll_tokens, H = config.hidden, M = std::max<int64_t>(T, 1);
  const int P = E + (32 + R - 1) / R * R;  // DeepSeek-V3's 32 redundant slots, rounded up to whole GPUs
  if (E % R != 0) throw Error(ErrorCode::kInvalidArgument, fmt::format("--experts {} must be divisible by {} ranks", E, R));
  std::vector<int> devices(R);
  for (int r = 0; r < R; ++r) devices[r] = r % num_gpus;
  std::mt19937_64 rng(config.seed);
  std::vector<int32_t> order(E);
  for (int i = 0; i < E; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::vector<int64_t>> routing(R);
  for (int r = 0; r < R; ++r) routing[r] = zipf_routing(rng, order, 2 * kSteps, T, K);

  ExpertLocation before = ExpertLocation::trivial(1, E, P, R);
  std::vector<int32_t> new_p2l;
  RelocationPlan plan;
  std::vector<PhaseResult> phase(2);
  std::vector<double> step_us[2] = {std::vector<double>(R), std::vector<double>(R)};
  std::vector<double> reloc_s(R);
  std::vector<int64_t> reloc_bytes(R), bad_slots(R);
  const int slots = P / R;

  auto note = [&](int r, const char* what) {
    if (config.progress && r == 0) std::fprintf(stderr, "[epx bench --eplb] %d ranks: %s\n", R, what);
  };
  auto groups = create_cuda_groups(devices);
  run_host_ranks(groups, [&](int r, Group& g) {
    cuda_ok(cudaSetDevice(g.device().index), "cudaSetDevice");
    cudaStream_t stream;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    // NOTE: the tensors below free their memory on `stream` (cudaFreeAsync), so it is destroyed after them.
    std::unique_ptr<CUstream_st, decltype(&cudaStreamDestroy)> stream_owner(stream, cudaStreamDestroy);
    BufferOptions options;
    options.num_low_latency_bytes = low_latency_buffer_size_hint(M, H, R, P);
    auto buffer = Buffer::create(groups[r], tuned_from_env(options));
    auto empty = [&](DType dt, std::vector<int64_t> shape) { return Tensor::empty(dt, shape, g.device(), nullptr, stream); };
    Tensor logical = empty(DType::kInt64, {2 * kSteps, T, K});
    cuda_ok(cudaMemcpyAsync(logical.data(), routing[r].data(), routing[r].size() * 8, cudaMemcpyHostToDevice, stream),
            "upload routing");
    Tensor physical = empty(DType::kInt64, {T, K});
    Tensor x = empty(DType::kBFloat16, {T, H});
    cuda_ok(cudaMemsetAsync(x.data(), 0x3c, x.nbytes(), stream), "memset x");
    Tensor w = empty(DType::kFloat32, {T, K});
    cuda_ok(cudaMemsetAsync(w.data(), 0, w.nbytes(), stream), "memset w");
    Tensor y = empty(DType::kBFloat16, {P / R, R * M, H});
    cuda_ok(cudaMemsetAsync(y.data(), 0x3c, y.nbytes(), stream), "memset y");
    Tensor counts = empty(DType::kInt32, {P / R});
    // Expert weights of one layer: this rank's slots, old and new buffers (the relocation is double-buffered).
    std::vector<Tensor> old_w, new_w;
    for (size_t bytes : {kW13Bytes, kW2Bytes}) {
      old_w.push_back(empty(DType::kUInt8, {slots, static_cast<int64_t>(bytes)}));
      new_w.push_back(empty(DType::kUInt8, {slots, static_cast<int64_t>(bytes)}));
      for (int s = 0; s < slots; ++s) {
        cuda_ok(cudaMemsetAsync(old_w.back().data_as<uint8_t>() + s * bytes, fill_byte(before.phy2log(0)[r * slots + s]),
                                bytes, stream),
                "fill weights");
      }
      cuda_ok(cudaMemsetAsync(new_w.back().data(), 0, new_w.back().nbytes(), stream), "poison");
    }
    cuda_ok(cudaStreamSynchronize(stream), "setup");

    auto run_phase = [&](int which, const ExpertLocation& location) {
      auto table = eplb::DeviceReplicaTable::upload(location, g.device(), stream);
      cuda_ok(cudaMemsetAsync(counts.data(), 0, counts.nbytes(), stream), "zero counts");
      // Every step timed (no warm-up): each draws its own routing, and the counts cover all of them.
      const double ms = median_event_ms(
          stream, 0, kSteps, [&](int) { g.barrier(); },
          [&](int step) {
            const TensorView ids =
                TensorView::of(logical.data_as<int64_t>() + (static_cast<int64_t>(which) * kSteps + step) * T * K,
                               DType::kInt64, {T, K}, g.device());
            eplb::choose_replicas(*table, 0, ids, physical, r, {}, static_cast<int64_t>(step) * T, stream);
            LowLatencyDispatchArgs a;
            a.x = x;
            a.topk_idx = physical;
            a.max_tokens_per_rank = M;
            a.num_experts = P;
            a.use_fp8 = true;
            a.cumulative_recv_counts = counts;
            a.stream = stream;
            auto res = buffer->low_latency_dispatch(a);
            LowLatencyCombineArgs c;
            c.x = y;
            c.topk_idx = physical;
            c.topk_weights = w;
            c.handle = res.handle;
            c.stream = stream;
            buffer->low_latency_combine(c);
          });
      step_us[which][r] = ms * 1e3;
      std::vector<int32_t> mine(P / R);
      cuda_ok(cudaMemcpy(mine.data(), counts.data(), counts.nbytes(), cudaMemcpyDeviceToHost), "download counts");
      std::vector<int64_t> all(P, 0);  // this rank's slots in place, the others 0: the sum is every slot's count
      for (int s = 0; s < P / R; ++s) all[r * (P / R) + s] = mine[s];
      eplb::all_reduce_counts(g, all);
      if (r == 0) phase[which].slot_counts = all;
    };

    note(r, "decode steps before the rebalance");
    run_phase(0, before);
    note(r, "rebalance");
    g.barrier();
    if (r == 0) {  // the rebalance: logical loads from the recorded slot counts, a new placement, the plan
      std::vector<std::vector<double>> load(1, std::vector<double>(E, 0));
      for (int s = 0; s < P; ++s) load[0][before.phy2log(0)[s]] += static_cast<double>(phase[0].slot_counts[s]);
      PlacementShape shape;
      shape.num_physical = P;
      shape.num_gpus = R;
      const Placement placement = eplb::rebalance(load, shape);
      new_p2l = placement.phy2log;
      plan = eplb::plan_relocation(before.phy2log(0), new_p2l, R, 1);
    }
    g.barrier();
    note(r, "relocation");
    auto transport = eplb::make_cuda_transport(g);
    eplb::ExpertWeights weights;
    for (size_t i = 0; i < old_w.size(); ++i) {
      weights.old_slots.push_back(old_w[i].data());
      weights.new_slots.push_back(new_w[i].data());
      weights.bytes_per_slot.push_back(i == 0 ? kW13Bytes : kW2Bytes);
    }
    g.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    const auto stats = eplb::relocate_weights(plan, weights, *transport);
    g.barrier();
    reloc_s[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    reloc_bytes[r] = stats.bytes_received;
    for (size_t i = 0; i < new_w.size(); ++i) {  // first and last byte of every slot
      const size_t bytes = weights.bytes_per_slot[i];
      for (int s = 0; s < slots; ++s) {
        uint8_t ends[2] = {0, 0};
        const uint8_t* base = new_w[i].data_as<uint8_t>() + s * bytes;
        cuda_ok(cudaMemcpy(&ends[0], base, 1, cudaMemcpyDeviceToHost), "check");
        cuda_ok(cudaMemcpy(&ends[1], base + bytes - 1, 1, cudaMemcpyDeviceToHost), "check");
        const uint8_t want = fill_byte(new_p2l[r * slots + s]);
        bad_slots[r] += ends[0] != want || ends[1] != want;
      }
    }
    const ExpertLocation after(1, E, P, R, 1, new_p2l);
    note(r, "decode steps after the rebalance");
    run_phase(1, after);
  });

  auto utilization = [&](const std::vector<int64_t>& slot_counts) {
    std::vector<double> per_gpu(R, 0);
    for (int s = 0; s < P; ++s) per_gpu[s / slots] += static_cast<double>(slot_counts[s]);
    const double mx = *std::max_element(per_gpu.begin(), per_gpu.end());
    double sum = 0;
    for (double v : per_gpu) sum += v;
    return mx > 0 ? sum / R / mx : 1.0;
  };
  const double util_before = utilization(phase[0].slot_counts), util_after = utilization(phase[1].slot_counts);
  const double step_before = *std::max_element(step_us[0].begin(), step_us[0].end());
  const double step_after = *std::max_element(step_us[1].begin(), step_us[1].end());
  const double reloc = *std::max_element(reloc_s.begin(), reloc_s.end());
  int64_t moved = 0, wrong = 0;
  for (int r = 0; r < R; ++r) moved += reloc_bytes[r], wrong += bad_slots[r];

  cudaDeviceProp prop{};
  cuda_ok(cudaGetDeviceProperties(&prop, devices[0]), "cudaGetDeviceProperties");
  nlohmann::json report;
  report["backend"] = "cuda";
  report["device"] = fmt::format("{} rank(s) on {} x {}", R, std::min(R, num_gpus), prop.name);
  report["settings"] = {{"num_ranks", R},      {"tokens_per_rank", T}, {"hidden", H},       {"num_topk", K},
                        {"num_logical", E},    {"num_physical", P},    {"zipf_exponent", kZipf},
                        {"steps_per_phase", kSteps}, {"expert_bytes", kW13Bytes + kW2Bytes}};
  report["phases"] = nlohmann::json::array(
      {{{"name", fmt::format("eplb decode step before ({} tokens)", T)}, {"time_us", step_before}},
       {{"name", fmt::format("eplb decode step after ({} tokens)", T)}, {"time_us", step_after}},
       {{"name", "eplb relocation (1 layer)"}, {"time_us", reloc * 1e6}, {"logical_gbps", moved / reloc / 1e9}}});
  report["eplb"] = {{"utilization_before", util_before}, {"utilization_after", util_after},
                    {"slots_moved", plan.num_transfers()}, {"bytes_moved", moved}, {"relocation_ms", reloc * 1e3}};
  std::printf("eplb: GPU utilization (mean / max pairs per GPU) %.3f before, %.3f after the rebalance; %lld slots "
              "(%.2f GB) relocated in %.1f ms\n",
              util_before, util_after, static_cast<long long>(plan.num_transfers()), moved / 1e9, reloc * 1e3);
  const bool passed = wrong == 0 && (R == 1 || util_after >= util_before);
  report["check"] = {{"passed", passed},
                     {"details", fmt::format("{} relocated slots with wrong bytes; utilization {:.3f} -> {:.3f}", wrong,
                                             util_before, util_after)}};
  return report;
}

}  // namespace epx::cli
