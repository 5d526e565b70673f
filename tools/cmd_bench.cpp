// `epx bench`: dispatch + combine of a DeepSeek-V3-shaped MoE step: normal and low-latency on the host
// backend (tools/bench_host.cpp), or on GPUs (tools/cuda/bench_normal.cpp: normal kernels,
// tools/cuda/bench_low_latency.cpp: low-latency kernels). On all visible GPUs with the CUDA backend; without a GPU
// (or with --host) on the host backend. This file holds the flags, the modes (--model, --nodes, --dp, --tbo,
// --eplb) and the printed table.
#include <fmt/format.h>

#include <cstdio>
#include <fstream>

#include "bench.h"
#include "bench_dp.h"
#include "bench_model.h"
#include "bench_nodes.h"
#include "command.h"
#include "epx/error.h"
#include "epx/quant.h"

namespace epx::cli {
namespace {

void print_report(const nlohmann::json& report) {
  std::printf("epx bench — %s backend, %s\n", report["backend"].get<std::string>().c_str(),
              report["device"].get<std::string>().c_str());
  std::printf("%-46s %12s %14s %9s %16s\n", "phase", "time (us)", "logical GB/s", "of floor", "back to back (us)");
  for (const auto& p : report["phases"]) {
    const std::string gbps = p.contains("logical_gbps") ? fmt::format("{:.3g}", p["logical_gbps"].get<double>()) : "-";
    const std::string of_floor =
        p.contains("fraction_of_floor") ? fmt::format("{:.0f}%", 100 * p["fraction_of_floor"].get<double>()) : "-";
    std::string pipelined = "-";
    if (p.contains("pipelined_us")) {
      pipelined = fmt::format("{:.1f}", p["pipelined_us"].get<double>());
      if (p.contains("pipelined_fraction_of_floor")) {
        pipelined += fmt::format(" ({:.0f}%)", 100 * p["pipelined_fraction_of_floor"].get<double>());
      }
    }
    std::printf("%-46s %12.1f %14s %9s %16s\n", p["name"].get<std::string>().c_str(), p["time_us"].get<double>(),
                gbps.c_str(), of_floor.c_str(), pipelined.c_str());
    if (p.contains("alone_us")) {  // a local phase timed again while the other rank threads wait
      std::printf("%-46s %12.1f %14s %9s %16s\n", "  the same, one rank at a time", p["alone_us"].get<double>(), "-",
                  "-", "-");
    }
  }
  std::printf("check: %s\n", report["check"]["passed"].get<bool>() ? "passed" : "FAILED");
}

// The host backend holds every rank's tensors in this process. Lower bounds of what the run touches, per
// rank: normal mode x (bf16), its fp8 copy, the combined output and at least as many received rows as the
// rank sends (7 bytes per element); low-latency mode the received rows, --ll-tokens x --topk of them (bf16).
// Each rank's low-latency receive buffer [E_local, R * M, H] bf16 (E x M x H x 2 bytes) is one allocation,
// mostly untouched, but one allocation larger than physical memory fails.
void check_host_bench_memory(const BenchConfig& c) {
  const int num_ranks = c.num_ranks > 0 ? c.num_ranks : 4;
  const double hidden = static_cast<double>(c.hidden);
  const double normal = static_cast<double>(c.num_tokens) * hidden * 7;
  const double low_latency = static_cast<double>(c.num_ll_tokens) * c.num_topk * hidden * 2;
  check_fits_in_memory(num_ranks * (normal + low_latency),
                       fmt::format("bench on the host backend: {} ranks x (--tokens {} x --hidden {} x 7 bytes + "
                                   "--ll-tokens {} x --topk {} x --hidden {} x 2 bytes)",
                                   num_ranks, c.num_tokens, c.hidden, c.num_ll_tokens, c.num_topk, c.hidden));
  check_fits_in_memory(static_cast<double>(c.num_experts) * static_cast<double>(c.num_ll_tokens) * hidden * 2,
                       fmt::format("bench on the host backend: each rank's low-latency receive buffer, --experts {} x "
                                   "--ll-tokens {} x --hidden {} x 2 bytes,",
                                   c.num_experts, c.num_ll_tokens, c.hidden));
}

// `epx bench --model`: flags checked (each bad value names its flag), the model run, the table printed and the
// JSON written. Pure arithmetic, so it runs whatever the build or the machine.
void run_model_command(const BenchConfig& c, ModelConfig m, const std::string& nodes, bool nodes_given,
                       bool experts_given, const std::string& json_path,
                       const std::vector<std::pair<CLI::Option*, const char*>>& not_with_model) {
  for (const auto& [opt, name] : not_with_model) {
    if (opt->count() > 0) throw BadInput(fmt::format("{} does not apply to --model (a prediction, not a run)", name));
  }
  if (nodes_given) {
    m.num_nodes.clear();
    size_t begin = 0;
    while (true) {
      const size_t comma = nodes.find(',', begin);
      const std::string item = nodes.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
      const auto v = parse_decimal_int(item);
      if (!v || *v < 1 || *v > 1024) {
        throw BadInput(fmt::format("--nodes: '{}' (item {}) is not an integer in [1, 1024]", item, m.num_nodes.size()));
      }
      if (m.num_nodes.size() == 64) throw BadInput("--nodes: more than 64 items");
      m.num_nodes.push_back(static_cast<int>(*v));
      if (comma == std::string::npos) break;
      begin = comma + 1;
    }
  }
  m.num_tokens = c.num_tokens;
  m.num_ll_tokens = c.num_ll_tokens;
  m.hidden = c.hidden;
  m.num_topk = c.num_topk;
  m.num_experts = experts_given ? c.num_experts : 0;
  m.seed = c.seed;
  model_experts(m);  // every shape checked before any work
  if (validate_only()) return;
  std::ofstream json_file;
  if (!json_path.empty()) {
    json_file.open(json_path);
    if (!json_file) throw BadInput(fmt::format("--json: cannot write '{}'", json_path));
  }
  const nlohmann::json report = run_model(m);
  print_model_report(report);
  if (json_file.is_open()) {
    json_file << report.dump(2) << "\n";
    json_file.close();
    if (!json_file) throw Error(ErrorCode::kInternal, fmt::format("--json: writing '{}' failed", json_path));
  }
}

// The flags of `epx bench --nodes N` / `--routing hierarchical` as given.
struct NodesFlags {
  bool nodes_given = false;
  std::string nodes;      // --nodes as typed
  int gpus_per_node = 0;  // 0: --gpus-per-node not given
  bool force_hierarchical = false;
  bool ranks_given = false;
  std::vector<const char*> not_with_nodes;  // flags given that the run does not take
};

// `epx bench --nodes N` / `--routing hierarchical`: flags checked (each bad value names its flag and bound), the
// run (bench_nodes.h), the table printed and the JSON written.
void run_nodes_command(BenchConfig c, bool use_cuda, const NodesFlags& f, const std::string& json_path) {
  for (const char* name : f.not_with_nodes) {
    throw BadInput(fmt::format("{} does not apply to --nodes / --routing (a run of dispatch/combine only)", name));
  }
  int num_nodes = 1;
  if (f.nodes_given) {
    const auto v = parse_decimal_int(f.nodes);
    if (!v || *v < 1 || *v > 1024) {
      throw BadInput(
          fmt::format("--nodes: '{}' is not an integer in [1, 1024] (a comma-separated list needs --model)", f.nodes));
    }
    num_nodes = static_cast<int>(*v);
  }
  if (num_nodes == 1 && !f.force_hierarchical) {
    throw BadInput(
        "--nodes 1 has no network leg: pass --nodes 2 or more, or --routing hierarchical to force the hierarchical "
        "path on one node");
  }
  int num_ranks = c.num_ranks;
  std::string ranks_from = " of --ranks";
  if (!f.ranks_given) {
    if (f.gpus_per_node > 0) {
      const int64_t product = int64_t{num_nodes} * f.gpus_per_node;
      if (product > 1024) {
        throw BadInput(fmt::format("--nodes {} x --gpus-per-node {} = {} ranks exceeds 1024", num_nodes,
                                   f.gpus_per_node, product));
      }
      num_ranks = static_cast<int>(product);
      ranks_from = " of --nodes x --gpus-per-node";
    } else if (use_cuda) {
#ifdef EPX_WITH_CUDA
      num_ranks = cuda_device_count();
#endif
      ranks_from = " (one per visible GPU; set --ranks)";
    } else {
      num_ranks = 4;
      ranks_from = " (the host backend's default; set --ranks)";
    }
  }
  if (num_nodes > num_ranks || num_ranks % num_nodes != 0) {
    throw BadInput(fmt::format("--nodes {} must divide the {} ranks{}", num_nodes, num_ranks, ranks_from));
  }
  if (f.gpus_per_node > 0 && int64_t{num_nodes} * f.gpus_per_node != num_ranks) {
    throw BadInput(fmt::format("--nodes {} x --gpus-per-node {} = {} ranks, but --ranks is {}", num_nodes,
                               f.gpus_per_node, int64_t{num_nodes} * f.gpus_per_node, num_ranks));
  }
  if (c.num_experts % num_ranks != 0) {
    throw BadInput(
        fmt::format("--experts {} must be divisible by the {} ranks{}", c.num_experts, num_ranks, ranks_from));
  }
  if (use_cuda && num_ranks > 8) {
    throw BadInput(
        fmt::format("--nodes on GPUs: {} ranks{} exceed 8, the most the flat run beside the hierarchical one takes "
                    "on the cuda backend (--host runs up to 1024)",
                    num_ranks, ranks_from));
  }
  if (c.num_sms.size() > 1) {
    throw BadInput(fmt::format("--sms takes one value with --nodes / --routing, got {}", c.num_sms.size()));
  }
  if (c.processes && num_nodes < 2) {
    throw BadInput(
        fmt::format("--processes times the network leg on NCCL: it needs --nodes 2 or more, got {}", num_nodes));
  }
  if (c.processes && !use_cuda) {
    throw BadInput(
        "--processes runs ranks as processes on NCCL groups: it needs the cuda backend and a visible GPU (not --host)");
  }
  if (!use_cuda) {
    // Per rank and routing at least x, its fp8 copy, the combined output and as many received rows as the rank
    // sends (7 bytes per element, as the plain host bench), twice: both routings' results are compared.
    check_fits_in_memory(
        static_cast<double>(num_ranks) * static_cast<double>(c.num_tokens) * static_cast<double>(c.hidden) * 14,
        fmt::format("bench --nodes on the host backend: {} ranks x --tokens {} x --hidden {} x 14 bytes", num_ranks,
                    c.num_tokens, c.hidden));
    // The low-latency phases: every rank's receive buffer [E_local, R * M, H] bf16 (E x M x H x 2 bytes each).
    check_fits_in_memory(static_cast<double>(num_ranks) * static_cast<double>(c.num_experts) *
                             static_cast<double>(c.num_ll_tokens) * static_cast<double>(c.hidden) * 2,
                         fmt::format("bench --nodes on the host backend: {} ranks' low-latency receive buffers, "
                                     "--experts {} x --ll-tokens {} x --hidden {} x 2 bytes each",
                                     num_ranks, c.num_experts, c.num_ll_tokens, c.hidden));
  }
  c.num_ranks = num_ranks;
  c.num_nodes = num_nodes;
  c.force_hierarchical = f.force_hierarchical;
  if (validate_only()) return;
#ifdef EPX_WITH_CUDA
  if (nodes_bench_child()) {  // a rank of a --processes run: its phases, then its results to the parent's file
    run_nodes_bench_child(c);
    return;
  }
#endif
  std::ofstream json_file;  // opened before the run, so an unwritable path fails before the work
  if (!json_path.empty()) {
    json_file.open(json_path);
    if (!json_file) throw BadInput(fmt::format("--json: cannot write '{}'", json_path));
  }
  nlohmann::json report;
#ifdef EPX_WITH_CUDA
  if (use_cuda) report = run_cuda_nodes_bench(c);
#endif
  if (!use_cuda) report = run_host_nodes_bench(c);
  print_nodes_report(report);
  if (json_file.is_open()) {
    json_file << report.dump(2) << "\n";
    json_file.close();
    if (!json_file) throw Error(ErrorCode::kInternal, fmt::format("--json: writing '{}' failed", json_path));
  }
  if (!report["check"]["passed"].get<bool>()) throw CLI::RuntimeError(kExitFailure);
}

void add_bench(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench",
                                 "Run dispatch + combine of a DeepSeek-V3-shaped MoE step, normal and low-latency: on "
                                 "all visible GPUs (one rank each), or on the host backend without a GPU");
  auto config = std::make_shared<BenchConfig>();
  auto json_path = std::make_shared<std::string>();
  auto* ranks = cmd->add_option("--ranks", config->num_ranks, "Ranks (default: all visible GPUs; host backend: 4)")
                    ->check(int_in(1, 1024));
  auto* tokens = cmd->add_option("--tokens", config->num_tokens,
                                 "Tokens per rank, normal mode (default 4096; host "
                                 "backend 512)")
                     ->check(int_in(0, int64_t{1} << 20));
  auto* hidden =
      cmd->add_option("--hidden", config->hidden, "Hidden size, a multiple of 128 (default 7168; host backend 2048)")
          ->check(int_in(128, 65536));
  cmd->add_option("--topk", config->num_topk, "Experts per token (default 8)")->check(int_in(1, 16));
  auto* experts = cmd->add_option("--experts", config->num_experts,
                                  "Experts, a multiple of the ranks (default 256; --model: per configuration the "
                                  "smallest multiple of the ranks and --groups >= 256, e.g. 288 for EP72)")
                      ->check(int_in(1, 4096));
  cmd->add_option("--ll-tokens", config->num_ll_tokens,
                  "Tokens per rank, low-latency mode (default 128; on GPUs also 1, 32, 64 and 256)")
      ->check(int_in(1, 4096));
  // NOTE: a string parsed in the callback: CLI11's delimiter drops empty items, so "24," would pass.
  auto sms = std::make_shared<std::string>();
  auto* sms_opt = cmd->add_option("--sms", *sms,
                                  "SM counts to sweep for the normal kernels, comma-separated, each in [1, 1024] "
                                  "(cuda; default 24)");
  auto* warmup =
      cmd->add_option("--warmup", config->num_warmup, "Warm-up iterations (default 5)")->check(int_in(0, 10000));
  auto* iters = cmd->add_option("--iters", config->num_iters, "Timed iterations; the median is reported (default 20)")
                    ->check(int_in(1, 100000));
  auto* host = cmd->add_flag("--host", config->host, "Use the host backend even when GPUs are visible");
  auto backend = std::make_shared<std::string>("auto");
  auto* backend_opt = cmd->add_option("--backend", *backend,
                                      "auto (cuda when GPUs are visible, else host), host (as --host) or cuda (fails "
                                      "without a CUDA build and a GPU)")
                          ->check(one_of({"auto", "host", "cuda"}));
  cmd->add_option("--seed", config->seed, "Random seed (default 1)")->check(uint64_any());
  cmd->add_option("--json", *json_path, "Also write the report as JSON to this file");
  auto* quiet = cmd->add_flag("--quiet")->description("No progress lines on stderr");
  auto* dp = cmd->add_flag("--dp")->description(
      "Instead: DP-attention gather/scatter (1 to 8192 tokens per rank, both padding modes) beside plain NCCL "
      "collectives, and the batch-metadata sync per step (GPUs only)");
  auto* tbo = cmd->add_flag("--tbo")->description(
      "Instead: an MoE step (dispatch, cuBLAS expert GEMMs, combine) on two micro-batches with and without "
      "two-batch overlap (GPUs only; --tokens, --sms[0] = SMs of the communication kernels)");
  auto* eplb = cmd->add_flag("--eplb")->description(
      "Instead: EPLB live: low-latency decode steps on Zipf routing, one rebalance from the recorded counts, the "
      "relocation of one layer's expert weights between the GPUs, the steps again (GPUs only; --ranks may exceed "
      "the GPUs, --ll-tokens, --experts, --topk, --hidden)");
  // ---- the scale model (issue 17) ----
  auto model_config = std::make_shared<ModelConfig>();
  auto* model = cmd->add_flag("--model")->description(
      "Instead: the scale model (no GPU needed): predicted dispatch/combine times for --nodes x --gpus-per-node from "
      "the routing statistics of group-limited top-k (docs/internode.md, \"Scale model\")");
  auto nodes = std::make_shared<std::string>();
  auto* nodes_opt = cmd->add_option(
      "--nodes", *nodes,
      "Instead: the normal dispatch/combine with hierarchical routing over this many nodes, an integer in [1, 1024] "
      "dividing --ranks (host groups, or cuda groups of ranks as threads, with that topology), timed beside the flat "
      "routing on the same inputs: time, bytes of the network and node legs, results compared bit for bit "
      "(docs/internode.md), and the low-latency path likewise (--ll-tokens). --model: node counts, "
      "comma-separated, each in [1, 1024] (default 1,2,4,9: EP8, EP16, "
      "EP32, EP72)");
  auto* gpus_per_node = cmd->add_option("--gpus-per-node", model_config->gpus_per_node,
                                        "--nodes: ranks per node (default --ranks / --nodes; sets --ranks when that is "
                                        "not given); --model: GPUs per node (default 8)")
                            ->check(int_in(1, 72));
  auto routing = std::make_shared<std::string>("auto");
  auto* routing_opt = cmd->add_option("--routing", *routing,
                                      "With --nodes: auto (hierarchical on more than one node) or hierarchical "
                                      "(forced, also on one node: --routing hierarchical alone runs it on one node "
                                      "of --ranks ranks)")
                          ->check(one_of({"auto", "hierarchical"}));
  auto node_partials = std::make_shared<std::string>("fp32");
  auto* node_partials_opt =
      cmd->add_option("--node-partials", *node_partials,
                      "fp32 or bf16: the hierarchical combines' per-node partial sums over the network leg "
                      "(BufferOptions::node_partials; bf16 halves those bytes, docs/internode.md). With --nodes / "
                      "--routing: the run's option (default fp32, the library's); with --model: the predicted "
                      "combine's network rows (default bf16, DeepEP's internode choice)")
          ->check(one_of({"fp32", "bf16"}));
  auto* processes = cmd->add_flag("--processes")
                        ->description(
                            "With --nodes on GPUs: the hierarchical run with one process per rank on an NCCL group, so "
                            "that the network "
                            "leg runs on NCCL as across hosts (ranks beyond the visible GPUs share them, each an NCCL "
                            "host of its own: "
                            "sockets over loopback), timed beside NCCL send/recv of the network leg's bytes; the flat "
                            "run stays ranks "
                            "as threads (docs/internode.md)");
  auto* net_gbps = cmd->add_option("--net-gbps", model_config->links.network_gbps,
                                   "--model: network GB/s per GPU, each way (default 50: 400 Gb/s)")
                       ->check(number_in(0.1, 1e5));
  auto* nvlink_gbps = cmd->add_option("--nvlink-gbps", model_config->links.nvlink_gbps,
                                      "--model: NVLink GB/s per GPU, each way (default 385, the copy-engine rate "
                                      "measured on 2x H200)")
                          ->check(number_in(0.1, 1e5));
  auto* latency_us = cmd->add_option("--latency-us", model_config->links.latency_us,
                                     "--model: latency of a network message, us (default 5)")
                         ->check(number_in(0, 1e6));
  auto* groups = cmd->add_option("--groups", model_config->num_groups, "--model: expert groups (n_group; default 8)")
                     ->check(int_in(1, 256));
  auto* topk_group = cmd->add_option("--topk-group", model_config->num_topk_groups,
                                     "--model: groups a token picks its experts in (topk_group; default 4)")
                         ->check(int_in(1, 256));
  cmd->callback([=] {
    BenchConfig c = *config;
    c.progress = quiet->count() == 0;
    if (sms_opt->count() > 0) {
      c.num_sms.clear();
      size_t begin = 0;
      while (true) {
        const size_t comma = sms->find(',', begin);
        const std::string item = sms->substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
        const auto v = parse_decimal_int(item);
        if (!v || *v < 1 || *v > 1024) {
          throw BadInput(fmt::format("--sms: '{}' (item {}) is not an integer in [1, 1024]", item, c.num_sms.size()));
        }
        c.num_sms.push_back(static_cast<int>(*v));
        if (comma == std::string::npos) break;
        begin = comma + 1;
      }
    }
    if (c.hidden % kFp8BlockSize != 0) {
      throw BadInput(fmt::format("--hidden must be a multiple of {}, got {}", kFp8BlockSize, c.hidden));
    }
    const std::vector<std::pair<CLI::Option*, const char*>> model_only = {{net_gbps, "--net-gbps"},
                                                                          {nvlink_gbps, "--nvlink-gbps"},
                                                                          {latency_us, "--latency-us"},
                                                                          {groups, "--groups"},
                                                                          {topk_group, "--topk-group"}};
    const bool nodes_run = model->count() == 0 && (nodes_opt->count() > 0 || routing_opt->count() > 0);
    if (!nodes_run && processes->count() > 0) throw BadInput("--processes applies only to --nodes / --routing");
    if (model->count() == 0 && !nodes_run && gpus_per_node->count() > 0) {
      throw BadInput("--gpus-per-node applies only to --nodes or --model");
    }
    if (!nodes_run && model->count() == 0 && node_partials_opt->count() > 0) {
      throw BadInput("--node-partials applies only to --nodes / --routing or --model (the hierarchical combine)");
    }
    model_config->fp32_node_partials = node_partials_opt->count() > 0 && *node_partials == "fp32";
    if (model->count() == 0) {
      for (const auto& [opt, name] : model_only) {
        if (opt->count() > 0) throw BadInput(fmt::format("{} applies only to --model", name));
      }
    } else {
      run_model_command(c, *model_config, *nodes, nodes_opt->count() > 0, experts->count() > 0, *json_path,
                        {{ranks, "--ranks"},
                         {sms_opt, "--sms"},
                         {warmup, "--warmup"},
                         {iters, "--iters"},
                         {host, "--host"},
                         {backend_opt, "--backend"},
                         {routing_opt, "--routing"},
                         {dp, "--dp"},
                         {tbo, "--tbo"},
                         {eplb, "--eplb"}});
      return;
    }
    if (*backend == "host") c.host = true;
    if (*backend == "cuda" && c.host) throw BadInput("--backend cuda contradicts --host");
    bool use_cuda = false;
#ifdef EPX_WITH_CUDA
    use_cuda = !c.host && cuda_device_count() > 0;
#endif
    if (*backend == "cuda" && !use_cuda) {
      throw Error(ErrorCode::kUnsupported, "--backend cuda needs a CUDA build and a visible GPU");
    }
    if (!use_cuda) {
      // Host defaults are scaled down so the run takes seconds on a small CPU.
      if (tokens->count() == 0) c.num_tokens = 512;
      if (hidden->count() == 0) c.hidden = 2048;
    }
    if (nodes_run) {
      NodesFlags f;
      f.nodes_given = nodes_opt->count() > 0;
      f.nodes = *nodes;
      f.gpus_per_node = gpus_per_node->count() > 0 ? model_config->gpus_per_node : 0;
      f.force_hierarchical = *routing == "hierarchical";
      c.bf16_node_partials = *node_partials == "bf16";
      f.ranks_given = ranks->count() > 0;
      c.processes = processes->count() > 0;
      for (const auto& [opt, name] :
           std::vector<std::pair<CLI::Option*, const char*>>{{dp, "--dp"}, {tbo, "--tbo"}, {eplb, "--eplb"}}) {
        if (opt->count() > 0) f.not_with_nodes.push_back(name);
      }
      run_nodes_command(c, use_cuda, f, *json_path);
      return;
    }
    nlohmann::json report;
    if (dp->count() + tbo->count() + eplb->count() > 1) {
      throw BadInput("--dp, --tbo and --eplb are separate runs: pass one of them");
    }
    const bool extra = dp->count() > 0 || tbo->count() > 0 || eplb->count() > 0;
    const char* extra_name = dp->count() > 0 ? "--dp" : tbo->count() > 0 ? "--tbo" : "--eplb";
    if (extra && !use_cuda) {
      throw Error(ErrorCode::kUnsupported,
                  fmt::format("{} needs a CUDA build and visible GPUs (--host has no such run)", extra_name));
    }
    const int num_ranks = c.num_ranks > 0 ? c.num_ranks : (use_cuda ? 0 : 4);
    if (num_ranks > 0 && c.num_experts % num_ranks != 0) {
      throw BadInput(fmt::format("--experts {} must be divisible by the {} ranks{}", c.num_experts, num_ranks,
                                 c.num_ranks > 0 ? " of --ranks" : " (the host backend's default; set --ranks)"));
    }
    if (!use_cuda) check_host_bench_memory(c);
    if (validate_only()) return;
    // Opened before the run, so an unwritable path fails before minutes of work.
    std::ofstream json_file;
    if (!json_path->empty()) {
      json_file.open(*json_path);
      if (!json_file) throw BadInput(fmt::format("--json: cannot write '{}'", *json_path));
    }
#ifdef EPX_WITH_CUDA
    if (extra) {
      report = dp->count() > 0    ? run_cuda_dp_bench(c)
               : tbo->count() > 0 ? run_cuda_tbo_bench(c)
                                  : run_cuda_eplb_bench(c);
    } else if (use_cuda) {
      report = run_cuda_bench(c);
    }
#endif
    if (!use_cuda) report = run_host_bench(c);
    print_report(report);
    if (json_file.is_open()) {
      json_file << report.dump(2) << "\n";
      json_file.close();
      if (!json_file) throw Error(ErrorCode::kInternal, fmt::format("--json: writing '{}' failed", *json_path));
    }
    if (!report["check"]["passed"].get<bool>()) throw CLI::RuntimeError(kExitFailure);
  });
}

const bool kRegistered = register_command(10, add_bench);

}  // namespace
}  // namespace epx::cli
