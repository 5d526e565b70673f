// `epx bench --nodes N` and `--routing hierarchical` (issue 17): the normal dispatch/combine with hierarchical
// routing (docs/internode.md) over N nodes of ranks / N ranks, timed beside the flat single-node path on the
// same routing, with the bytes of each leg and a check that the two give the same results. Host backend in
// bench_nodes.cpp (wall time), cuda backend in tools/cuda/bench_nodes.cpp (CUDA events); the pieces both share
// are declared here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.h"
#include "bench_inputs.h"
#include "epx/buffer.h"
#include "epx/group.h"

namespace epx::cli {

// Each rank's inputs (bench_inputs.h), drawn from config.seed. x holds small integers and the weights are eighths,
// so every sum the combine makes is exact in fp32 and bf16 (a node's partial too: at most 8 significant bits): the
// hierarchical combine must then equal the flat one bit for bit (docs/internode.md), with either NodePartials.
std::vector<RankInputs> make_nodes_inputs(const BenchConfig& config);

// The nodes run's topology: config.num_nodes nodes of config.num_ranks / config.num_nodes ranks.
Topology nodes_topology(const BenchConfig& config);

// Payload rows of the normal path's network leg per call, [s * R + d] from rank s to rank d: a token of s crosses
// once to the rank with s's local index on every other node that one of its experts lives on (docs/internode.md);
// the per-pair form of the report's network rows.
std::vector<int64_t> network_leg_rows(const BenchConfig& config, const std::vector<RankInputs>& inputs);

// Sets the routings of one run in `options` (flat: both paths kFlat; else the topology's, or kHierarchical when
// config.force_hierarchical) and its NodePartials.
void set_nodes_routing(const BenchConfig& config, bool flat, BufferOptions& options);

// Host copies of one rank's DispatchResult (undefined tensors: empty).
struct DispatchSnapshot {
  std::vector<uint8_t> recv_x;
  std::vector<uint8_t> recv_x_scales;
  std::vector<uint8_t> recv_topk_idx;
  std::vector<uint8_t> recv_topk_weights;
  std::vector<uint8_t> recv_src_idx;
  std::vector<uint8_t> rank_prefix_matrix;
  std::vector<int32_t> num_recv_tokens_per_expert;
};

// What one routing produced, per phase (kNodesPhases order) and rank.
inline constexpr int kNumNodesPhases = 4;
inline constexpr const char* kNodesPhases[kNumNodesPhases] = {"dispatch_bf16", "dispatch_bf16_cached",
                                                              "dispatch_fp8_cached", "combine_bf16"};
// The low-latency phases, on config.num_ll_tokens tokens per rank (BufferOptions::low_latency_routing), on both
// backends (the cuda run eager, timed per call: the hierarchical low-latency exchange of ranks as threads meets on the
// host, so it is not captured into a graph as the plain bench's low-latency phases are).
inline constexpr int kNumLowLatencyPhases = 2;
inline constexpr const char* kLowLatencyPhases[kNumLowLatencyPhases] = {"ll_dispatch_fp8", "ll_combine_bf16"};
struct RoutingRun {
  RoutingRun() = default;
  // The per-rank vectors sized for num_ranks ranks (empty results), as a cuda run fills them rank by rank.
  explicit RoutingRun(int num_ranks)
      : combined(num_ranks), ll_dispatched(num_ranks), ll_combined(num_ranks) {
    for (auto& d : dispatched) d.resize(num_ranks);
  }
  // Folds one rank's medians (kNumNodesPhases, then kNumLowLatencyPhases) into the slowest rank's.
  void add_rank_seconds(const double* rank_seconds) {
    for (int p = 0; p < kNumNodesPhases; ++p) seconds[p] = std::max(seconds[p], rank_seconds[p]);
    for (int p = 0; p < kNumLowLatencyPhases; ++p) {
      ll_seconds[p] = std::max(ll_seconds[p], rank_seconds[kNumNodesPhases + p]);
    }
  }

  double seconds[kNumNodesPhases] = {};         // median over iterations of the slowest rank
  std::vector<DispatchSnapshot> dispatched[3];  // [phase 0..2][rank]: the last call's results
  std::vector<std::vector<uint16_t>> combined;  // [rank] [T, H] bf16: the last combine's output
  bool has_low_latency = false;
  double ll_seconds[kNumLowLatencyPhases] = {};
  // [rank]: the last fp8 dispatch's defined bytes: per local expert its count, its layout ranges, then its received
  // rows [0, count) of recv_x, scales and source indices (the rows past the count are unspecified).
  std::vector<std::vector<uint8_t>> ll_dispatched;
  std::vector<std::vector<uint16_t>> ll_combined;  // [rank] [T_ll, H] bf16: the last combine of identity experts
};

// RoutingRun::ll_dispatched's bytes of one low-latency dispatch whose tensors are in host memory.
std::vector<uint8_t> low_latency_snapshot(const LowLatencyDispatchResult& r);

// The low-latency inputs of a nodes run (config.num_ll_tokens per rank), from their own generator so that the
// normal path's inputs stay those of make_nodes_inputs.
std::vector<RankInputs> make_nodes_ll_inputs(const BenchConfig& config);

// The report of a nodes run: {"backend", "device", "epx_version", "run": "nodes", "settings", "legs", "phases":
// [{"name", "phase", "routing", "time_us", leg bytes...}], "check": {"passed", "details"}}. `tested` ran with
// the topology's routing (hierarchical), `flat` on one-node groups with the flat routing; same inputs.
// ll_inputs: make_nodes_ll_inputs's, read when both runs have the low-latency phases.
nlohmann::json nodes_report(const BenchConfig& config, const std::vector<RankInputs>& inputs,
                            const std::vector<RankInputs>& ll_inputs, const RoutingRun& flat, const RoutingRun& tested,
                            const std::string& backend, const std::string& device, nlohmann::json extra_settings);
void print_nodes_report(const nlohmann::json& report);

nlohmann::json run_host_nodes_bench(const BenchConfig& config);
#ifdef EPX_WITH_CUDA
// config.processes: the hierarchical run with one process per rank (bench_nodes_processes.cpp), the report's
// "nccl_baseline" beside it.
nlohmann::json run_cuda_nodes_bench(const BenchConfig& config);

// One rank's phases on its cuda group (tools/cuda/bench_nodes.cpp; ranks as threads or one process per rank):
// seconds[0, kNumNodesPhases + kNumLowLatencyPhases) this rank's medians, and run's entries of this rank (run's
// per-rank vectors sized to config.num_ranks).
void run_cuda_rank_phases(const BenchConfig& config, const RankInputs& in, const RankInputs& ll_in,
                          const std::shared_ptr<Group>& group, bool flat, double* seconds, RoutingRun& run);

// --processes (tools/cuda/bench_nodes_processes.cpp): the parent starts one `epx bench` process per rank with the
// same arguments (nodes_bench_child() is true there), waits for them and reads back their results: the tested
// RoutingRun, and in *nccl_baseline the NCCL send/recv of the network leg's bytes beside it.
RoutingRun run_cuda_routing_in_processes(const BenchConfig& config, nlohmann::json* nccl_baseline);
bool nodes_bench_child();
void run_nodes_bench_child(const BenchConfig& config);
#endif

}  // namespace epx::cli
