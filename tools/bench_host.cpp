// `epx bench` on the host backend (run_host_bench, bench.h): dispatch + combine of a DeepSeek-V3-shaped MoE step,
// normal and low-latency, every rank a thread of this process, timed by wall clock between barriers. The command
// itself (flags, modes, the printed table) is tools/cmd_bench.cpp.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "bench.h"
#include "bench_inputs.h"
#include "epx/buffer.h"
#include "epx/group.h"
#include "epx/quant.h"
#include "epx/routing.h"
#include "epx/version.h"
#include "testing/stats.h"

namespace epx::cli {
namespace {

using Clock = std::chrono::steady_clock;

using testing::median;

struct PhaseTimes {
  std::vector<double> seconds;  // per iteration, max over ranks (the collective's time)
  double bytes = 0;             // logical bytes received, summed over ranks, per iteration
};

// Runs `body` num_warmup + num_iters times on every rank, timing each iteration on each rank between
// barriers; the iteration's time is the slowest rank's.
template <typename Body>
PhaseTimes time_phase(const std::vector<std::shared_ptr<Group>>& groups, const BenchConfig& config, Body body) {
  const int num_ranks = static_cast<int>(groups.size());
  const int total = config.num_warmup + config.num_iters;
  std::vector<std::vector<double>> per_rank(num_ranks, std::vector<double>(total));
  std::vector<double> bytes(num_ranks, 0);
  run_host_ranks(groups, [&](int rank, Group& group) {
    for (int i = 0; i < total; ++i) {
      group.barrier();
      const auto start = Clock::now();
      const double b = body(rank, i);
      per_rank[rank][i] = std::chrono::duration<double>(Clock::now() - start).count();
      if (i == total - 1) bytes[rank] = b;
    }
  });
  PhaseTimes out;
  for (int i = config.num_warmup; i < total; ++i) {
    double worst = 0;
    for (int r = 0; r < num_ranks; ++r) worst = std::max(worst, per_rank[r][i]);
    out.seconds.push_back(worst);
  }
  for (double b : bytes) out.bytes += b;
  return out;
}

nlohmann::json phase_json(const std::string& name, const PhaseTimes& t, int num_ranks) {
  const double sec = median(t.seconds);
  nlohmann::json j = {{"name", name}, {"time_us", sec * 1e6}};
  if (t.bytes > 0) j["logical_gbps"] = t.bytes / num_ranks / sec / 1e9;
  return j;
}

}  // namespace

nlohmann::json run_host_bench(const BenchConfig& config) {
  const int num_ranks = config.num_ranks > 0 ? config.num_ranks : 4;
  const int64_t hidden = config.hidden;
  const int num_topk = config.num_topk;
  check_expert_split(config.num_experts, num_ranks);
  auto groups = create_host_groups(num_ranks);
  std::vector<std::unique_ptr<Buffer>> buffers;
  BufferOptions options;
  options.num_low_latency_bytes = 1;  // the host backend sizes its own slots; any non-zero enables the path
  for (auto& g : groups) buffers.push_back(Buffer::create(g, options));

  std::mt19937_64 rng(config.seed);
  std::vector<RankInputs> inputs =
      make_rank_inputs(rng, num_ranks, config.num_tokens, hidden, num_topk, config.num_experts);
  auto x_view = [&](int r) {
    return TensorView::of(inputs[r].x.data(), DType::kBFloat16, {inputs[r].num_tokens, hidden});
  };
  auto topk_view = [&](int r) {
    return TensorView::of(inputs[r].topk.data(), DType::kInt64, {inputs[r].num_tokens, num_topk});
  };
  auto weights_view = [&](int r) {
    return TensorView::of(inputs[r].weights.data(), DType::kFloat32, {inputs[r].num_tokens, num_topk});
  };
  auto progress = [&](const char* what) {
    if (config.progress) std::fprintf(stderr, "[epx bench] host backend, %d ranks: %s\n", num_ranks, what);
  };

  nlohmann::json phases = nlohmann::json::array();
  nlohmann::json checks = nlohmann::json::array();
  bool passed = true;

  // ---- normal mode ----
  progress("layout");
  std::vector<Layout> layouts(num_ranks);
  phases.push_back(phase_json("layout",
                              time_phase(groups, config,
                                         [&](int r, int) {
                                           layouts[r] =
                                               buffers[r]->get_dispatch_layout(topk_view(r), config.num_experts);
                                           return 0.0;
                                         }),
                              num_ranks));

  std::vector<DispatchResult> results(num_ranks);
  progress("dispatch bf16");
  phases.push_back(phase_json("dispatch_bf16",
                              time_phase(groups, config,
                                         [&](int r, int) {
                                           DispatchArgs a;
                                           a.x = x_view(r);
                                           a.topk_idx = topk_view(r);
                                           a.topk_weights = weights_view(r);
                                           a.num_experts = config.num_experts;
                                           a.layout = &layouts[r];
                                           results[r] = buffers[r]->dispatch(a);
                                           return static_cast<double>(results[r].recv_x.nbytes());
                                         }),
                              num_ranks));

  progress("dispatch fp8");
  phases.push_back(phase_json(
      "dispatch_fp8",
      time_phase(groups, config,
                 [&](int r, int) {
                   DispatchArgs a;
                   a.x = TensorView::of(inputs[r].x_fp8.data(), DType::kFloat8E4M3, {inputs[r].num_tokens, hidden});
                   a.x_scales = TensorView::of(inputs[r].x_scales.data(), DType::kFloat32,
                                               {inputs[r].num_tokens, hidden / kFp8BlockSize});
                   a.handle = results[r].handle;  // cached mode: same routes
                   const DispatchResult res = buffers[r]->dispatch(a);
                   return static_cast<double>(res.recv_x.nbytes() + res.recv_x_scales.nbytes());
                 }),
      num_ranks));

  progress("combine");
  std::vector<CombineResult> combined(num_ranks);
  phases.push_back(phase_json("combine",
                              time_phase(groups, config,
                                         [&](int r, int) {
                                           CombineArgs a;
                                           a.x = results[r].recv_x;
                                           a.handle = results[r].handle;
                                           combined[r] = buffers[r]->combine(a);
                                           return static_cast<double>(results[r].recv_x.nbytes());
                                         }),
                              num_ranks));

  // Check: identity experts give back x * (number of distinct ranks the token visited); exact here
  // because x holds small integers.
  {
    int64_t bad = 0;
    for (int r = 0; r < num_ranks; ++r) {
      const auto* out = combined[r].x.data_as<const uint16_t>();
      bad += count_identity_combine_mismatches(inputs[r], std::vector<uint16_t>(out, out + combined[r].x.numel()),
                                               hidden, num_topk, config.num_experts, num_ranks);
    }
    checks.push_back({{"name", "normal: combine(dispatch(x)) == x * ranks visited"}, {"mismatches", bad}});
    passed = passed && bad == 0;
  }

  // ---- low-latency mode ----
  const int64_t ll_tokens = config.num_ll_tokens;
  std::vector<RankInputs> ll_inputs = make_rank_inputs(rng, num_ranks, ll_tokens, hidden, num_topk, config.num_experts);
  for (bool use_fp8 : {false, true}) {
    progress(use_fp8 ? "low-latency dispatch fp8" : "low-latency dispatch bf16");
    std::vector<LowLatencyDispatchResult> ll(num_ranks);
    auto ll_dispatch = [&](int r) {
      LowLatencyDispatchArgs a;
      a.x = TensorView::of(ll_inputs[r].x.data(), DType::kBFloat16, {ll_tokens, hidden});
      a.topk_idx = TensorView::of(ll_inputs[r].topk.data(), DType::kInt64, {ll_tokens, num_topk});
      a.max_tokens_per_rank = ll_tokens;
      a.num_experts = config.num_experts;
      a.use_fp8 = use_fp8;
      ll[r] = buffers[r]->low_latency_dispatch(a);
      // Logical bytes: the pairs received.
      const auto* counts = ll[r].recv_count.data_as<const int32_t>();
      double pairs = 0;
      for (int64_t e = 0; e < ll[r].recv_count.numel(); ++e) pairs += counts[e];
      return pairs * static_cast<double>(use_fp8 ? hidden + hidden / kFp8BlockSize * 4 : hidden * 2);
    };
    phases.push_back(phase_json(use_fp8 ? "ll_dispatch_fp8" : "ll_dispatch_bf16",
                                time_phase(groups, config, [&](int r, int) { return ll_dispatch(r); }), num_ranks));
    if (use_fp8) continue;
    progress("low-latency combine");
    std::vector<LowLatencyCombineResult> out(num_ranks);
    phases.push_back(phase_json(
        "ll_combine",
        time_phase(
            groups, config,
            [&](int r, int) {
              LowLatencyCombineArgs a;
              a.x = ll[r].recv_x;
              a.topk_idx = TensorView::of(ll_inputs[r].topk.data(), DType::kInt64, {ll_tokens, num_topk});
              a.topk_weights = TensorView::of(ll_inputs[r].weights.data(), DType::kFloat32, {ll_tokens, num_topk});
              a.handle = ll[r].handle;
              out[r] = buffers[r]->low_latency_combine(a);
              const auto* counts = ll[r].recv_count.data_as<const int32_t>();
              double pairs = 0;
              for (int64_t e = 0; e < ll[r].recv_count.numel(); ++e) pairs += counts[e];
              return pairs * static_cast<double>(hidden * 2);
            }),
        num_ranks));
    // Check: identity experts give back x * sum of weights (exact: small integers times eighths).
    int64_t bad = 0;
    for (int r = 0; r < num_ranks; ++r) {
      const auto* o = out[r].x.data_as<const uint16_t>();
      for (int64_t t = 0; t < ll_tokens; ++t) {
        float wsum = 0;
        for (int k = 0; k < num_topk; ++k) wsum += ll_inputs[r].weights[t * num_topk + k];
        for (int64_t c = 0; c < hidden; ++c) {
          const float expected = bf16_to_float(float_to_bf16(bf16_to_float(ll_inputs[r].x[t * hidden + c]) * wsum));
          bad += bf16_to_float(o[t * hidden + c]) != expected;
        }
      }
    }
    checks.push_back({{"name", "low-latency: combine(dispatch(x)) == x * sum(weights)"}, {"mismatches", bad}});
    passed = passed && bad == 0;
  }

  return {{"backend", "host"},
          {"device", fmt::format("cpu ({} rank threads)", num_ranks)},
          {"epx_version", version()},
          {"settings",
           {{"num_ranks", num_ranks},
            {"num_tokens", config.num_tokens},
            {"hidden", hidden},
            {"num_topk", num_topk},
            {"num_experts", config.num_experts},
            {"num_ll_tokens", ll_tokens},
            {"num_warmup", config.num_warmup},
            {"num_iters", config.num_iters},
            {"seed", config.seed}}},
          {"phases", phases},
          {"check", {{"passed", passed}, {"details", checks}}}};
}

}  // namespace epx::cli
