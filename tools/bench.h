// `epx bench`: the main job. Shared between the command (cmd_bench.cpp), the host path (bench_host.cpp) and the
// CUDA path (tools/cuda/bench_normal.cpp, CUDA builds only).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace epx::cli {

struct BenchConfig {
  int num_ranks = 0;          // 0: all visible GPUs (cuda) or 4 (host)
  int64_t num_tokens = 4096;  // per rank, normal mode
  int64_t hidden = 7168;
  int num_topk = 8;
  int64_t num_experts = 256;
  int64_t num_ll_tokens = 128;      // per rank, low-latency mode
  std::vector<int> num_sms = {24};  // normal kernels: SM counts to sweep (cuda)
  int num_warmup = 5;
  int num_iters = 20;
  bool host = false;     // force the host backend
  bool progress = true;  // progress lines on stderr
  uint64_t seed = 1;
  // `--nodes` / `--routing hierarchical` (tools/bench_nodes.h): the normal path over num_nodes nodes of
  // num_ranks / num_nodes ranks, beside the flat path. 0: not that run.
  int num_nodes = 0;
  bool force_hierarchical = false;  // --routing hierarchical: the hierarchical path also on one node
  bool bf16_node_partials = false;  // --node-partials bf16: BufferOptions::node_partials = kBFloat16
  bool processes = false;           // --processes: the hierarchical run with one process per rank on NCCL (cuda)
};

// Each returns a JSON report: {"backend", "device", "settings", "phases": [{"name", "time_us",
// "logical_gbps", ...}], "check": {"passed": bool, "details": ...}, ...}.
nlohmann::json run_host_bench(const BenchConfig& config);
#ifdef EPX_WITH_CUDA
// Number of visible CUDA devices (0 when there is no driver or GPU).
int cuda_device_count();
nlohmann::json run_cuda_bench(const BenchConfig& config);
// Low-latency phases on `devices` (one rank each, in order): {"settings", "phases", "check"}. peer_gbps: the
// copy-engine peer bandwidth measured in the same run (the floor).
nlohmann::json run_cuda_ll_bench(const BenchConfig& config, const std::vector<int>& devices, double peer_gbps);
#endif

}  // namespace epx::cli
