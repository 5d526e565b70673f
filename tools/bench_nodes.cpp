// `epx bench --nodes N` / `--routing hierarchical`: what the host and cuda runs share (inputs, leg bytes, the
// comparison and the report) and the host run (ranks as threads, wall time). See bench_nodes.h.
#include "bench_nodes.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <type_traits>

#include "epx/buffer.h"
#include "epx/quant.h"
#include "epx/routing.h"
#include "epx/version.h"
#include "testing/stats.h"

namespace epx::cli {
namespace {

// Rows of one call, summed over the ranks (payload rows; a rank's rows to itself are not counted).
struct LegRows {
  double network = 0;           // hierarchical: (token, destination node other than its own)
  double network_max_rank = 0;  // the same, the busiest sending rank
  double node = 0;              // hierarchical: forwarder (n, l) to (n, g), g != l, per (token, destination rank)
  double flat_peer = 0;         // flat: (token, destination rank other than its own)
  double flat_cross_node = 0;   // flat: those of them whose destination is on another node
  // The low-latency path moves (token, expert) pairs: hierarchical, the pairs a forwarder (or, in its own node, the
  // source) writes to another rank; flat, the pairs whose expert is on another rank than the source.
  double pair_node = 0;
  double pair_flat_peer = 0;
  std::vector<int64_t> network_to;  // [s * R + d]: the network rows from rank s to rank d (network_leg_rows)
};

LegRows count_leg_rows(const BenchConfig& config, const std::vector<RankInputs>& inputs, const Topology& topo,
                       int64_t num_tokens) {
  const int num_ranks = topo.num_ranks();
  const int64_t experts_per_rank = config.num_experts / num_ranks;
  LegRows rows;
  rows.network_to.assign(static_cast<size_t>(num_ranks) * num_ranks, 0);
  for (int s = 0; s < num_ranks; ++s) {
    const HostLayout layout = compute_layout_host(
        TensorView::of(const_cast<int64_t*>(inputs[s].topk.data()), DType::kInt64, {num_tokens, config.num_topk}),
        config.num_experts, num_ranks);
    const int home = topo.node_of(s);
    const int local = topo.local_rank_of(s);
    double sent = 0;
    for (int64_t t = 0; t < num_tokens; ++t) {
      const uint8_t* in_rank = layout.is_token_in_rank.data() + t * num_ranks;
      for (int n = 0; n < topo.num_nodes; ++n) {
        bool reached = false;
        for (int g = 0; g < topo.gpus_per_node; ++g) {
          const int d = topo.rank_of(n, g);
          if (in_rank[d] == 0) continue;
          reached = true;
          rows.node += g != local;
          rows.flat_peer += d != s;
          rows.flat_cross_node += n != home;
        }
        if (reached && n != home) {
          ++sent;
          ++rows.network_to[static_cast<size_t>(s) * num_ranks + topo.rank_of(n, local)];
        }
      }
    }
    rows.network += sent;
    rows.network_max_rank = std::max(rows.network_max_rank, sent);
    for (int64_t i = 0; i < num_tokens * config.num_topk; ++i) {
      const int64_t e = inputs[s].topk[i];
      if (e < 0) continue;
      const int d = static_cast<int>(e / experts_per_rank);
      const int n = topo.node_of(d);
      rows.pair_node += d != (n == home ? s : topo.rank_of(n, local));
      rows.pair_flat_peer += d != s;
    }
  }
  return rows;
}

}  // namespace

std::vector<int64_t> network_leg_rows(const BenchConfig& config, const std::vector<RankInputs>& inputs) {
  return count_leg_rows(config, inputs, nodes_topology(config), config.num_tokens).network_to;
}

namespace {

template <typename T>
int64_t count_different(const std::vector<T>& a, const std::vector<T>& b) {
  const size_t common = std::min(a.size(), b.size());
  int64_t n = static_cast<int64_t>(std::max(a.size(), b.size()) - common);
  for (size_t i = 0; i < common; ++i) n += a[i] != b[i];
  return n;
}

// Bytes (expert counts: entries) in which two snapshots differ; a length difference counts as that many.
int64_t count_different(const DispatchSnapshot& a, const DispatchSnapshot& b) {
  return count_different(a.recv_x, b.recv_x) + count_different(a.recv_x_scales, b.recv_x_scales) +
         count_different(a.recv_topk_idx, b.recv_topk_idx) + count_different(a.recv_topk_weights, b.recv_topk_weights) +
         count_different(a.recv_src_idx, b.recv_src_idx) + count_different(a.rank_prefix_matrix, b.rank_prefix_matrix) +
         count_different(a.num_recv_tokens_per_expert, b.num_recv_tokens_per_expert);
}

std::vector<uint8_t> host_bytes(const Tensor& t) {
  if (!t.defined() || t.nbytes() == 0) return {};
  const auto* p = static_cast<const uint8_t*>(t.data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

DispatchSnapshot host_snapshot(const DispatchResult& r) {
  return {host_bytes(r.recv_x),        host_bytes(r.recv_x_scales),
          host_bytes(r.recv_topk_idx), host_bytes(r.recv_topk_weights),
          host_bytes(r.recv_src_idx),  host_bytes(r.rank_prefix_matrix),
          r.num_recv_tokens_per_expert};
}

// Runs body(rank) num_warmup + num_iters times on every rank, each time between barriers; returns the median
// over the timed iterations of the slowest rank's wall time.
template <typename Body>
double time_slowest_rank(const std::vector<std::shared_ptr<Group>>& groups, const BenchConfig& config, Body body) {
  const int num_ranks = static_cast<int>(groups.size());
  const int total = config.num_warmup + config.num_iters;
  std::vector<std::vector<double>> seconds(num_ranks, std::vector<double>(total));
  run_host_ranks(groups, [&](int rank, Group& group) {
    for (int i = 0; i < total; ++i) {
      group.barrier();
      const auto start = std::chrono::steady_clock::now();
      body(rank);
      seconds[rank][i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
  });
  std::vector<double> slowest;
  for (int i = config.num_warmup; i < total; ++i) {
    double worst = 0;
    for (int r = 0; r < num_ranks; ++r) worst = std::max(worst, seconds[r][i]);
    slowest.push_back(worst);
  }
  return testing::median(slowest);
}

// One routing on host groups of gpus_per_node ranks per node (0: one node).
RoutingRun run_host_routing(const BenchConfig& config, const std::vector<RankInputs>& inputs,
                            const std::vector<RankInputs>& ll_inputs, int gpus_per_node, bool flat, const char* label) {
  const int num_ranks = config.num_ranks;
  const int64_t num_tokens = config.num_tokens, hidden = config.hidden;
  const int num_topk = config.num_topk;
  HostGroupOptions group_options;
  group_options.gpus_per_node = gpus_per_node;
  auto groups = create_host_groups(num_ranks, group_options);
  std::vector<std::unique_ptr<Buffer>> buffers;
  BufferOptions options;
  set_nodes_routing(config, flat, options);
  options.num_low_latency_bytes =
      low_latency_buffer_size_hint(config.num_ll_tokens, hidden, num_ranks, config.num_experts);
  for (auto& g : groups) buffers.push_back(Buffer::create(g, options));
  auto view = [&](const auto& v, DType dtype, int64_t cols) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    return TensorView::of(const_cast<T*>(v.data()), dtype, {num_tokens, cols});
  };
  auto progress = [&](const char* what) {
    if (config.progress) std::fprintf(stderr, "[epx bench] host backend, %d ranks, %s: %s\n", num_ranks, label, what);
  };

  std::vector<Layout> layouts(num_ranks);
  run_host_ranks(groups, [&](int r, Group&) {
    layouts[r] = buffers[r]->get_dispatch_layout(view(inputs[r].topk, DType::kInt64, num_topk), config.num_experts);
  });
  RoutingRun run;
  std::vector<DispatchResult> results[3];
  for (auto& r : results) r.resize(num_ranks);
  progress("dispatch bf16");
  run.seconds[0] = time_slowest_rank(groups, config, [&](int r) {
    DispatchArgs a;
    a.x = view(inputs[r].x, DType::kBFloat16, hidden);
    a.topk_idx = view(inputs[r].topk, DType::kInt64, num_topk);
    a.topk_weights = view(inputs[r].weights, DType::kFloat32, num_topk);
    a.num_experts = config.num_experts;
    a.layout = &layouts[r];
    results[0][r] = buffers[r]->dispatch(a);
  });
  progress("dispatch bf16, cached");
  run.seconds[1] = time_slowest_rank(groups, config, [&](int r) {
    DispatchArgs a;
    a.x = view(inputs[r].x, DType::kBFloat16, hidden);
    a.handle = results[0][r].handle;
    results[1][r] = buffers[r]->dispatch(a);
  });
  progress("dispatch fp8, cached");
  run.seconds[2] = time_slowest_rank(groups, config, [&](int r) {
    DispatchArgs a;
    a.x = view(inputs[r].x_fp8, DType::kFloat8E4M3, hidden);
    a.x_scales = view(inputs[r].x_scales, DType::kFloat32, hidden / kFp8BlockSize);
    a.handle = results[0][r].handle;
    results[2][r] = buffers[r]->dispatch(a);
  });
  progress("combine");
  std::vector<CombineResult> combined(num_ranks);
  run.seconds[3] = time_slowest_rank(groups, config, [&](int r) {
    CombineArgs a;
    a.x = results[0][r].recv_x;
    a.handle = results[0][r].handle;
    combined[r] = buffers[r]->combine(a);
  });
  for (int p = 0; p < 3; ++p) {
    for (int r = 0; r < num_ranks; ++r) run.dispatched[p].push_back(host_snapshot(results[p][r]));
  }
  for (int r = 0; r < num_ranks; ++r) {
    const auto* out = combined[r].x.data_as<const uint16_t>();
    run.combined.emplace_back(out, out + combined[r].x.numel());
  }

  // Low-latency: fp8 dispatch timed; a bf16 dispatch whose rows are the identity experts' outputs; combine timed.
  const int64_t ll_tokens = config.num_ll_tokens;
  auto ll_view = [&](const auto& v, DType dtype, int64_t cols) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    return TensorView::of(const_cast<T*>(v.data()), dtype, {ll_tokens, cols});
  };
  auto ll_dispatch = [&](int r, bool use_fp8) {
    LowLatencyDispatchArgs a;
    a.x = ll_view(ll_inputs[r].x, DType::kBFloat16, hidden);
    a.topk_idx = ll_view(ll_inputs[r].topk, DType::kInt64, num_topk);
    a.max_tokens_per_rank = ll_tokens;
    a.num_experts = config.num_experts;
    a.use_fp8 = use_fp8;
    return buffers[r]->low_latency_dispatch(a);
  };
  std::vector<LowLatencyDispatchResult> ll(num_ranks);
  progress("low-latency dispatch fp8");
  run.ll_seconds[0] = time_slowest_rank(groups, config, [&](int r) { ll[r] = ll_dispatch(r, true); });
  for (int r = 0; r < num_ranks; ++r) run.ll_dispatched.push_back(low_latency_snapshot(ll[r]));
  run_host_ranks(groups, [&](int r, Group&) { ll[r] = ll_dispatch(r, false); });
  progress("low-latency combine");
  std::vector<LowLatencyCombineResult> ll_out(num_ranks);
  run.ll_seconds[1] = time_slowest_rank(groups, config, [&](int r) {
    LowLatencyCombineArgs a;
    a.x = ll[r].recv_x;
    a.topk_idx = ll_view(ll_inputs[r].topk, DType::kInt64, num_topk);
    a.topk_weights = ll_view(ll_inputs[r].weights, DType::kFloat32, num_topk);
    a.handle = ll[r].handle;
    ll_out[r] = buffers[r]->low_latency_combine(a);
  });
  for (int r = 0; r < num_ranks; ++r) {
    const auto* out = ll_out[r].x.data_as<const uint16_t>();
    run.ll_combined.emplace_back(out, out + ll_out[r].x.numel());
  }
  run.has_low_latency = true;
  return run;
}

}  // namespace

// RoutingRun::ll_dispatched's bytes of one low-latency dispatch (row-major scales, the default).
std::vector<uint8_t> low_latency_snapshot(const LowLatencyDispatchResult& r) {
  std::vector<uint8_t> out;
  auto append = [&out](const void* p, size_t bytes) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + bytes);
  };
  // Rows [first, first + count) of a [E_local, slots, ...] tensor.
  auto append_rows = [&](const Tensor& t, int64_t first, int64_t count) {
    const size_t row_bytes = t.nbytes() / static_cast<size_t>(t.size(0) * t.size(1));
    append(static_cast<const uint8_t*>(t.data()) + first * row_bytes, count * row_bytes);
  };
  const auto* counts = r.recv_count.data_as<const int32_t>();
  const int64_t slots = r.recv_x.size(1), sources = r.recv_layout_range.size(1);
  for (int64_t e = 0; e < r.recv_count.numel(); ++e) {
    append(counts + e, sizeof(int32_t));
    append(r.recv_layout_range.data_as<const int64_t>() + e * sources, sources * sizeof(int64_t));
    append_rows(r.recv_x, e * slots, counts[e]);
    append_rows(r.recv_x_scales, e * slots, counts[e]);
    append_rows(r.recv_src_info, e * slots, counts[e]);
  }
  return out;
}

std::vector<RankInputs> make_nodes_inputs(const BenchConfig& config) {
  std::mt19937_64 rng(config.seed);
  return make_rank_inputs(rng, config.num_ranks, config.num_tokens, config.hidden, config.num_topk, config.num_experts);
}

std::vector<RankInputs> make_nodes_ll_inputs(const BenchConfig& config) {
  std::mt19937_64 rng(config.seed ^ 0x6c6c);  // "ll"
  return make_rank_inputs(rng, config.num_ranks, config.num_ll_tokens, config.hidden, config.num_topk,
                          config.num_experts);
}

Topology nodes_topology(const BenchConfig& config) {
  return Topology{config.num_nodes, config.num_ranks / config.num_nodes};
}

void set_nodes_routing(const BenchConfig& config, bool flat, BufferOptions& options) {
  options.normal_routing =
      flat ? NormalRouting::kFlat : (config.force_hierarchical ? NormalRouting::kHierarchical : NormalRouting::kAuto);
  options.low_latency_routing =
      flat ? LowLatencyRouting::kFlat
           : (config.force_hierarchical ? LowLatencyRouting::kHierarchical : LowLatencyRouting::kAuto);
  options.node_partials = config.bf16_node_partials ? NodePartials::kBFloat16 : NodePartials::kFloat32;
}

nlohmann::json nodes_report(const BenchConfig& config, const std::vector<RankInputs>& inputs,
                            const std::vector<RankInputs>& ll_inputs, const RoutingRun& flat, const RoutingRun& tested,
                            const std::string& backend, const std::string& device, nlohmann::json extra_settings) {
  const Topology topo = nodes_topology(config);
  const int num_ranks = config.num_ranks;
  const int64_t num_tokens = config.num_tokens, hidden = config.hidden;
  const LegRows rows = count_leg_rows(config, inputs, topo, num_tokens);
  // Payload bytes per row: bf16 rows, fp8 rows with fp32 scales; the combine's network leg carries fp32 partials
  // (bf16 with --node-partials bf16; both backends), its node leg bf16 rows.
  const double bf16_row = static_cast<double>(hidden) * 2;
  const double fp8_row = static_cast<double>(hidden + hidden / kFp8BlockSize * 4);
  const double partial_row = static_cast<double>(hidden) * (config.bf16_node_partials ? 2 : 4);
  const double network_row[kNumNodesPhases] = {bf16_row, bf16_row, fp8_row, partial_row};
  const double node_row[kNumNodesPhases] = {bf16_row, bf16_row, fp8_row, bf16_row};
  const double flat_row[kNumNodesPhases] = {bf16_row, bf16_row, fp8_row, bf16_row};

  nlohmann::json phases = nlohmann::json::array();
  for (int p = 0; p < kNumNodesPhases; ++p) {
    const double t = tested.seconds[p], f = flat.seconds[p];
    nlohmann::json h = {{"name", fmt::format("{}_hierarchical", kNodesPhases[p])},
                        {"phase", kNodesPhases[p]},
                        {"routing", "hierarchical"},
                        {"time_us", t * 1e6},
                        {"network_bytes", rows.network * network_row[p]},
                        {"network_bytes_max_rank", rows.network_max_rank * network_row[p]},
                        {"node_bytes", rows.node * node_row[p]}};
    if (t > 0) h["flat_over_hierarchical"] = f / t;
    phases.push_back(h);
    phases.push_back({{"name", fmt::format("{}_flat", kNodesPhases[p])},
                      {"phase", kNodesPhases[p]},
                      {"routing", "flat"},
                      {"time_us", f * 1e6},
                      {"peer_bytes", rows.flat_peer * flat_row[p]},
                      {"cross_node_bytes", rows.flat_cross_node * flat_row[p]}});
  }

  const bool low_latency = flat.has_low_latency && tested.has_low_latency;
  LegRows ll_rows;
  if (low_latency) {
    // Low-latency: records of fp8 rows over the network and partial rows back; (token, expert) pairs in the
    // node, fp8 one way and bf16 back, as the flat path's pairs.
    ll_rows = count_leg_rows(config, ll_inputs, topo, config.num_ll_tokens);
    const double network_ll_row[kNumLowLatencyPhases] = {fp8_row, partial_row};
    const double pair_row[kNumLowLatencyPhases] = {fp8_row, bf16_row};
    for (int p = 0; p < kNumLowLatencyPhases; ++p) {
      const double t = tested.ll_seconds[p], f = flat.ll_seconds[p];
      nlohmann::json h = {{"name", fmt::format("{}_hierarchical", kLowLatencyPhases[p])},
                          {"phase", kLowLatencyPhases[p]},
                          {"routing", "hierarchical"},
                          {"time_us", t * 1e6},
                          {"network_bytes", ll_rows.network * network_ll_row[p]},
                          {"network_bytes_max_rank", ll_rows.network_max_rank * network_ll_row[p]},
                          {"node_bytes", ll_rows.pair_node * pair_row[p]}};
      if (t > 0) h["flat_over_hierarchical"] = f / t;
      phases.push_back(h);
      phases.push_back({{"name", fmt::format("{}_flat", kLowLatencyPhases[p])},
                        {"phase", kLowLatencyPhases[p]},
                        {"routing", "flat"},
                        {"time_us", f * 1e6},
                        {"peer_bytes", ll_rows.pair_flat_peer * pair_row[p]}});
    }
  }

  // Checks: the hierarchical results against the flat ones, every rank and byte; and the combine against
  // identity experts (x times the ranks the token visited, exact for small integers).
  nlohmann::json checks = nlohmann::json::array();
  bool passed = true;
  const char* dispatch_names[3] = {"dispatch bf16 (recv_x, top-k ids and weights, src_idx, prefix matrix, counts)",
                                   "dispatch bf16 cached (recv_x, src_idx, prefix matrix, counts)",
                                   "dispatch fp8 cached (recv_x, scales, src_idx, prefix matrix, counts)"};
  for (int p = 0; p < 3; ++p) {
    int64_t bad = 0;
    for (int r = 0; r < num_ranks; ++r) bad += count_different(tested.dispatched[p][r], flat.dispatched[p][r]);
    checks.push_back(
        {{"name", fmt::format("hierarchical == flat, {}: bytes that differ", dispatch_names[p])}, {"mismatches", bad}});
    passed = passed && bad == 0;
  }
  int64_t bad_vs_flat = 0, bad_vs_identity = 0;
  for (int r = 0; r < num_ranks; ++r) {
    bad_vs_flat += count_different(tested.combined[r], flat.combined[r]);
    bad_vs_identity += count_identity_combine_mismatches(inputs[r], tested.combined[r], hidden, config.num_topk,
                                                         config.num_experts, num_ranks);
  }
  checks.push_back({{"name", "hierarchical == flat, combine bf16: elements that differ"}, {"mismatches", bad_vs_flat}});
  checks.push_back({{"name", "hierarchical combine(dispatch(x)) == x * ranks visited (every element)"},
                    {"mismatches", bad_vs_identity}});
  passed = passed && bad_vs_flat == 0 && bad_vs_identity == 0;
  if (low_latency) {
    int64_t bad_dispatch = 0, bad_combine = 0, bad_combine_identity = 0;
    const int64_t ll_tokens = config.num_ll_tokens;
    for (int r = 0; r < num_ranks; ++r) {
      bad_dispatch += count_different(tested.ll_dispatched[r], flat.ll_dispatched[r]);
      bad_combine += count_different(tested.ll_combined[r], flat.ll_combined[r]);
      const std::vector<uint16_t>& out = tested.ll_combined[r];
      if (out.size() != static_cast<size_t>(ll_tokens * hidden)) {
        bad_combine_identity += ll_tokens * hidden;
        continue;
      }
      for (int64_t t = 0; t < ll_tokens; ++t) {
        float weight = 0;  // exact: eighths
        for (int k = 0; k < config.num_topk; ++k) {
          if (ll_inputs[r].topk[t * config.num_topk + k] >= 0) weight += ll_inputs[r].weights[t * config.num_topk + k];
        }
        for (int64_t c = 0; c < hidden; ++c) {
          const float expected = bf16_to_float(ll_inputs[r].x[t * hidden + c]) * weight;  // exact, then rounded once
          bad_combine_identity += out[t * hidden + c] != float_to_bf16(expected);
        }
      }
    }
    checks.push_back({{"name",
                       "hierarchical == flat, low-latency dispatch fp8 (counts, layout ranges, received rows, "
                       "scales, source indices): bytes that differ"},
                      {"mismatches", bad_dispatch}});
    checks.push_back({{"name", "hierarchical == flat, low-latency combine bf16: elements that differ"},
                      {"mismatches", bad_combine}});
    checks.push_back({{"name",
                       "hierarchical low-latency combine of identity experts == x * sum of weights (every "
                       "element)"},
                      {"mismatches", bad_combine_identity}});
    passed = passed && bad_dispatch == 0 && bad_combine == 0 && bad_combine_identity == 0;
  }

  nlohmann::json settings = {
      {"num_ranks", num_ranks},
      {"num_nodes", topo.num_nodes},
      {"gpus_per_node", topo.gpus_per_node},
      {"routing", config.force_hierarchical ? "hierarchical (forced)" : "hierarchical (auto)"},
      {"reference", "flat routing on one-node groups, the same inputs"},
      {"node_partials", config.bf16_node_partials ? "bf16" : "fp32"},
      {"num_tokens", num_tokens},
      {"hidden", hidden},
      {"num_topk", config.num_topk},
      {"num_experts", config.num_experts},
      {"num_ll_tokens", config.num_ll_tokens},
      {"low_latency", low_latency ? "run: BufferOptions::low_latency_routing, the same topology" : "not run"},
      {"num_warmup", config.num_warmup},
      {"num_iters", config.num_iters},
      {"seed", config.seed},
      {"leg_bytes",
       "payload rows per call summed over ranks, a rank's rows to itself left out: bf16 "
       "hidden x 2, fp8 hidden + hidden / 128 x 4, combine network leg fp32 partials hidden x "
       "4; the records' metadata (source index, flags, top-k) is not counted"}};
  settings.update(extra_settings);
  return {{"backend", backend},
          {"device", device},
          {"epx_version", version()},
          {"run", "nodes"},
          {"settings", settings},
          {"legs",
           {{"network_rows", rows.network},
            {"ll_network_records", ll_rows.network},
            {"ll_node_pairs", ll_rows.pair_node},
            {"ll_flat_peer_pairs", ll_rows.pair_flat_peer},
            {"network_rows_max_rank", rows.network_max_rank},
            {"node_rows", rows.node},
            {"flat_peer_rows", rows.flat_peer},
            {"flat_cross_node_rows", rows.flat_cross_node}}},
          {"phases", phases},
          {"check", {{"passed", passed}, {"details", checks}}}};
}

void print_nodes_report(const nlohmann::json& report) {
  const auto& s = report["settings"];
  std::printf("epx bench --nodes — %s backend, %s\n", report["backend"].get<std::string>().c_str(),
              report["device"].get<std::string>().c_str());
  std::printf(
      "%d nodes x %d ranks, %s, %s node partials; beside the flat routing on one node; leg bytes per call, all "
      "ranks\n",
      s["num_nodes"].get<int>(), s["gpus_per_node"].get<int>(), s["routing"].get<std::string>().c_str(),
      s.value("node_partials", std::string("fp32")).c_str());
  std::printf("%-22s %14s %14s %10s %14s %14s %14s\n", "phase", "hier. (us)", "flat (us)", "flat/hier", "network MB",
              "node MB", "flat peer MB");
  const auto& phases = report["phases"];
  for (size_t i = 0; i + 1 < phases.size(); i += 2) {
    const auto& h = phases[i];
    const auto& f = phases[i + 1];
    const std::string ratio =
        h.contains("flat_over_hierarchical") ? fmt::format("{:.2f}", h["flat_over_hierarchical"].get<double>()) : "-";
    std::printf("%-22s %14.1f %14.1f %10s %14.3f %14.3f %14.3f\n", h["phase"].get<std::string>().c_str(),
                h["time_us"].get<double>(), f["time_us"].get<double>(), ratio.c_str(),
                h["network_bytes"].get<double>() / 1e6, h["node_bytes"].get<double>() / 1e6,
                f["peer_bytes"].get<double>() / 1e6);
  }
  if (report.contains("nccl_baseline")) {
    std::printf("beside NCCL send/recv of the network leg's bytes (one process per rank):\n");
    std::printf("%-22s %14s %14s %10s\n", "phase", "hier. (us)", "nccl (us)", "hier/nccl");
    for (const auto& b : report["nccl_baseline"]) {
      std::printf("%-22s %14.1f %14.1f %10.2f\n", b["phase"].get<std::string>().c_str(),
                  b["hierarchical_time_us"].get<double>(), b["nccl_time_us"].get<double>(),
                  b["hierarchical_over_nccl"].get<double>());
    }
  }
  std::printf("low-latency (--ll-tokens %lld): %s\n", static_cast<long long>(s["num_ll_tokens"].get<int64_t>()),
              s["low_latency"].get<std::string>().c_str());
  for (const auto& c : report["check"]["details"]) {
    std::printf("  %s: %lld\n", c["name"].get<std::string>().c_str(),
                static_cast<long long>(c["mismatches"].get<int64_t>()));
  }
  std::printf("check: %s\n", report["check"]["passed"].get<bool>() ? "passed" : "FAILED");
}

nlohmann::json run_host_nodes_bench(const BenchConfig& config) {
  check_expert_split(config.num_experts, config.num_ranks);
  const std::vector<RankInputs> inputs = make_nodes_inputs(config);
  const std::vector<RankInputs> ll_inputs = make_nodes_ll_inputs(config);
  const Topology topo = nodes_topology(config);
  const RoutingRun flat = run_host_routing(config, inputs, ll_inputs, 0, true, "flat");
  const RoutingRun tested = run_host_routing(config, inputs, ll_inputs, topo.gpus_per_node, false, "hierarchical");
  return nodes_report(config, inputs, ll_inputs, flat, tested, "host",
                      fmt::format("cpu ({} rank threads)", config.num_ranks),
                      {{"timing", "wall time per call between barriers, slowest rank, median"}});
}

}  // namespace epx::cli
