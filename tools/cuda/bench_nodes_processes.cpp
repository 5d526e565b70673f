// `epx bench --nodes N --processes` on GPUs (tools/bench_nodes.h; issue 17): the hierarchical run with one process
// per rank on an NCCL group, the production process model across hosts, so that the network leg of both paths runs
// on NCCL (src/comm/cuda/net_leg.h) instead of the ranks-as-threads exchange. The parent draws the NCCL id, starts
// this binary once per rank with the same arguments and EPX_BENCH_NODES_{RANK,DIR,ID} set, and waits (bounded);
// each rank process runs the phases of the threads run (run_cuda_rank_phases), then NCCL send/recv of its network
// leg's payload bytes on a communicator of its own (the baseline: the same bytes as the hierarchical path's network
// leg, to the same peers, with no epx bookkeeping), and writes its timings and results to <dir>/rank<r>.bin. Rank r
// runs on GPU r % visible GPUs; ranks that share a GPU are NCCL hosts of their own (testing::rank_process_device), so
// NCCL runs them on its socket transport over loopback, as two hosts.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "bench_nodes.h"
#include "cuda/bench_util.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "testing/processes.h"

extern char** environ;

namespace epx::cli {
namespace {

constexpr const char* kRankEnv = "EPX_BENCH_NODES_RANK";
constexpr const char* kDirEnv = "EPX_BENCH_NODES_DIR";
constexpr const char* kIdEnv = "EPX_BENCH_NODES_ID";  // the group's NCCL id, hex
constexpr std::chrono::seconds kChildLimit{900};      // the whole run of one rank process
constexpr std::chrono::seconds kFailedPeerGrace{60};  // how long the others may run on once a rank process failed
constexpr uint32_t kFileMagic = 0x65707862;           // "epxb"

// The baseline phases: the network leg's payload of the hierarchical phase of the same name (tools/bench_nodes.cpp's
// leg bytes), sent with grouped ncclSend/ncclRecv to the same peers.
constexpr int kNumBaselines = 3;
constexpr const char* kBaselinePhases[kNumBaselines] = {"dispatch_bf16", "dispatch_fp8_cached", "combine_bf16"};
constexpr int kBaselineOfPhase[kNumBaselines] = {0, 2, 3};  // kNodesPhases index of each baseline's phase

std::string to_hex(const std::vector<uint8_t>& bytes) {
  std::string s;
  for (uint8_t b : bytes) s += fmt::format("{:02x}", b);
  return s;
}

std::vector<uint8_t> from_hex(const std::string& s) {
  std::vector<uint8_t> bytes;
  for (size_t i = 0; i + 1 < s.size(); i += 2) bytes.push_back(static_cast<uint8_t>(std::stoul(s.substr(i, 2), 0, 16)));
  return bytes;
}

// Length-prefixed vectors of trivially copyable elements, in the rank files.
template <typename T>
void put(std::ofstream& f, const std::vector<T>& v) {
  const uint64_t n = v.size();
  f.write(reinterpret_cast<const char*>(&n), sizeof(n));
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T)));
}

template <typename T>
std::vector<T> get(std::ifstream& f, const std::string& path) {
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), sizeof(n));
  if (!f || n > (uint64_t{1} << 40) / sizeof(T)) throw Error(ErrorCode::kInternal, fmt::format("{}: truncated", path));
  std::vector<T> v(n);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T)));
  if (!f) throw Error(ErrorCode::kInternal, fmt::format("{}: truncated", path));
  return v;
}

std::string rank_file(const std::string& dir, int rank) { return fmt::format("{}/rank{}.bin", dir, rank); }

// This rank's median seconds of each baseline phase (the parent takes the slowest rank's).
std::vector<double> time_nccl_baseline(const BenchConfig& config, const std::vector<RankInputs>& inputs, Group& group,
                                       cudaStream_t stream) {
  const int R = config.num_ranks, rank = group.rank();
  const int64_t H = config.hidden;
  ncclUniqueId mine{};
  if (rank == 0) nccl_ok(ncclGetUniqueId(&mine), "ncclGetUniqueId");
  std::vector<ncclUniqueId> ids(R);
  group.all_gather_bytes(&mine, ids.data(), sizeof(ncclUniqueId));
  ncclComm_t comm = nullptr;
  nccl_ok(ncclCommInitRank(&comm, R, ids[0], rank), "ncclCommInitRank (the baseline's communicator)");
  const std::vector<int64_t> rows = network_leg_rows(config, inputs);  // [s * R + d]
  std::vector<int64_t> to(R), from(R);
  for (int p = 0; p < R; ++p) {
    to[p] = rows[rank * R + p];
    from[p] = rows[p * R + rank];
  }
  // Row bytes as tools/bench_nodes.cpp counts the legs: bf16 rows, fp8 rows with fp32 scales, combine partials.
  const int64_t row_bytes[kNumBaselines] = {H * 2, H + H / 128 * 4, H * (config.bf16_node_partials ? 2 : 4)};
  int64_t most = 0;
  for (int64_t b : row_bytes) {
    int64_t out = 0, in = 0;
    for (int p = 0; p < R; ++p) out += to[p] * b, in += from[p] * b;
    most = std::max({most, out, in});
  }
  void* send = nullptr;
  void* recv = nullptr;
  cuda_ok(cudaMalloc(&send, std::max<int64_t>(most, 1)), "cudaMalloc");
  cuda_ok(cudaMalloc(&recv, std::max<int64_t>(most, 1)), "cudaMalloc");
  cuda_ok(cudaMemset(send, 1, std::max<int64_t>(most, 1)), "cudaMemset");
  std::vector<double> seconds(kNumBaselines);
  auto meet = [&](int) { group.barrier(); };
  for (int b = 0; b < kNumBaselines; ++b) {
    const bool combine = b == 2;  // the combine's rows go back: send what the dispatch received
    const std::vector<int64_t>& out_rows = combine ? from : to;
    const std::vector<int64_t>& in_rows = combine ? to : from;
    seconds[b] =
        1e-3 * median_event_ms(stream, config.num_warmup, config.num_iters, meet, [&](int) {
          nccl_ok(ncclGroupStart(), "ncclGroupStart");
          int64_t out_at = 0, in_at = 0;
          for (int p = 0; p < R; ++p) {
            const int64_t out = out_rows[p] * row_bytes[b], in = in_rows[p] * row_bytes[b];
            if (out > 0) {
              nccl_ok(ncclSend(static_cast<char*>(send) + out_at, out, ncclUint8, p, comm, stream), "ncclSend");
            }
            if (in > 0) {
              nccl_ok(ncclRecv(static_cast<char*>(recv) + in_at, in, ncclUint8, p, comm, stream), "ncclRecv");
            }
            out_at += out;
            in_at += in;
          }
          nccl_ok(ncclGroupEnd(), "ncclGroupEnd");
        });
  }
  cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  cudaFree(send);
  cudaFree(recv);
  ncclCommDestroy(comm);
  return seconds;
}

// The arguments this process was started with (/proc/self/cmdline), for the rank processes.
std::vector<std::string> own_arguments() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  for (size_t at = 0; at < all.size();) {
    const size_t end = all.find('\0', at);
    args.push_back(all.substr(at, end == std::string::npos ? std::string::npos : end - at));
    if (end == std::string::npos) break;
    at = end + 1;
  }
  if (args.empty()) throw Error(ErrorCode::kInternal, "bench --processes: /proc/self/cmdline is empty");
  return args;
}

}  // namespace

bool nodes_bench_child() { return std::getenv(kRankEnv) != nullptr; }

void run_nodes_bench_child(const BenchConfig& config) {
  const int R = config.num_ranks;
  const int rank = std::atoi(std::getenv(kRankEnv));
  const char* dir = std::getenv(kDirEnv);
  const char* id_hex = std::getenv(kIdEnv);
  if (rank < 0 || rank >= R || dir == nullptr || id_hex == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{} = {} must be in [0, {}) with {} and {} set (a rank process of bench --processes)",
                            kRankEnv, rank, R, kDirEnv, kIdEnv));
  }
  const int gpus = cuda_device_count();
  if (gpus == 0) throw Error(ErrorCode::kUnsupported, "bench --processes: no GPU visible in a rank process");
  const int device = testing::rank_process_device(rank, R, gpus);
  cuda_ok(cudaSetDevice(device), "cudaSetDevice");
  keep_mem_pools_warm(gpus);
  CudaGroupOptions options;
  options.gpus_per_node = nodes_topology(config).gpus_per_node;
  std::shared_ptr<Group> group = create_cuda_group(from_hex(id_hex), rank, R, device, options);
  if (config.progress) {
    std::fprintf(stderr, "[epx bench] rank %d of %d: a process on cuda:%d, NCCL group of %d nodes\n", rank, R, device,
                 group->topology().num_nodes);
  }
  const std::vector<RankInputs> inputs = make_nodes_inputs(config);
  const std::vector<RankInputs> ll_inputs = make_nodes_ll_inputs(config);
  RoutingRun run(R);
  std::vector<double> seconds(kNumNodesPhases + kNumLowLatencyPhases);
  run_cuda_rank_phases(config, inputs[rank], ll_inputs[rank], group, false, seconds.data(), run);
  cudaStream_t stream;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const std::vector<double> baseline = time_nccl_baseline(config, inputs, *group, stream);
  cudaStreamDestroy(stream);
  group->barrier();

  const std::string path = rank_file(dir, rank);
  std::ofstream f(path + ".tmp", std::ios::binary);
  f.write(reinterpret_cast<const char*>(&kFileMagic), sizeof(kFileMagic));
  put(f, seconds);
  put(f, baseline);
  for (const auto& phase : run.dispatched) {
    const DispatchSnapshot& d = phase[rank];
    for (const auto* v : {&d.recv_x, &d.recv_x_scales, &d.recv_topk_idx, &d.recv_topk_weights, &d.recv_src_idx,
                          &d.rank_prefix_matrix}) {
      put(f, *v);
    }
    put(f, d.num_recv_tokens_per_expert);
  }
  put(f, run.combined[rank]);
  put(f, run.ll_dispatched[rank]);
  put(f, run.ll_combined[rank]);
  f.close();
  if (!f) throw Error(ErrorCode::kInternal, fmt::format("bench --processes: cannot write {}", path));
  std::filesystem::rename(path + ".tmp", path);
}

RoutingRun run_cuda_routing_in_processes(const BenchConfig& config, nlohmann::json* nccl_baseline) {
  const int R = config.num_ranks;
  if (cuda_device_count() < R) {
    // Ranks will share GPUs as NCCL hosts of their own: the id's bootstrap address on the interface they use.
    setenv("NCCL_SOCKET_IFNAME", "lo", 0);
    setenv("NCCL_IB_DISABLE", "1", 0);
  }
  if (config.progress) {
    std::fprintf(stderr, "[epx bench] cuda backend, %d ranks as processes on an NCCL group: hierarchical\n", R);
  }
  const std::string id = to_hex(nccl_unique_id());
  char dir_template[] = "/tmp/epx-bench-nodes-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) throw Error(ErrorCode::kInternal, "bench --processes: mkdtemp failed");
  const std::string dir = dir_template;
  const std::vector<std::string> args = own_arguments();
  std::vector<pid_t> children;
  for (int r = 0; r < R; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      if (entry.rfind("EPX_BENCH_NODES_", 0) != 0) env.push_back(entry);
    }
    env.push_back(fmt::format("{}={}", kRankEnv, r));
    env.push_back(fmt::format("{}={}", kDirEnv, dir));
    env.push_back(fmt::format("{}={}", kIdEnv, id));
    std::vector<char*> envp, argv;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::vector<std::string> child_args = args;
    for (std::string& a : child_args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), envp.data()) != 0) {
      for (pid_t p : children) kill(p, SIGKILL);
      testing::wait_children(children, std::chrono::steady_clock::now());
      throw Error(ErrorCode::kInternal, fmt::format("bench --processes: cannot start rank {}'s process", r));
    }
    children.push_back(pid);
  }
  const std::vector<int> statuses =
      testing::wait_children(children, std::chrono::steady_clock::now() + kChildLimit, kFailedPeerGrace);
  const auto cleanup = [&] { std::filesystem::remove_all(dir); };
  for (int r = 0; r < R; ++r) {
    const int st = statuses[r];
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0 || !std::filesystem::exists(rank_file(dir, r))) {
      cleanup();
      throw Error(ErrorCode::kInternal,
                  fmt::format("bench --processes: rank {}'s process {} (its messages are above; every rank process "
                              "is stopped after {} s)",
                              r,
                              WIFSIGNALED(st) ? fmt::format("ended by signal {}", WTERMSIG(st))
                                              : fmt::format("exited with {} or wrote no results", WEXITSTATUS(st)),
                              kChildLimit.count()));
    }
  }
  RoutingRun run(R);
  std::vector<double> baseline(kNumBaselines, 0.0);
  for (int r = 0; r < R; ++r) {
    const std::string path = rank_file(dir, r);
    std::ifstream f(path, std::ios::binary);
    uint32_t magic = 0;
    f.read(reinterpret_cast<char*>(&magic), sizeof(magic));
    if (magic != kFileMagic) {
      cleanup();
      throw Error(ErrorCode::kInternal, fmt::format("bench --processes: {} is not a rank file", path));
    }
    const auto seconds = get<double>(f, path);
    const auto nccl = get<double>(f, path);
    if (seconds.size() != kNumNodesPhases + kNumLowLatencyPhases || nccl.size() != kNumBaselines) {
      cleanup();
      throw Error(ErrorCode::kInternal, fmt::format("bench --processes: {} holds the timings of another build", path));
    }
    run.add_rank_seconds(seconds.data());
    for (int b = 0; b < kNumBaselines; ++b) baseline[b] = std::max(baseline[b], nccl[b]);
    for (auto& phase : run.dispatched) {
      DispatchSnapshot& d = phase[r];
      for (auto* v : {&d.recv_x, &d.recv_x_scales, &d.recv_topk_idx, &d.recv_topk_weights, &d.recv_src_idx,
                      &d.rank_prefix_matrix}) {
        *v = get<uint8_t>(f, path);
      }
      d.num_recv_tokens_per_expert = get<int32_t>(f, path);
    }
    run.combined[r] = get<uint16_t>(f, path);
    run.ll_dispatched[r] = get<uint8_t>(f, path);
    run.ll_combined[r] = get<uint16_t>(f, path);
  }
  cleanup();
  run.has_low_latency = true;
  *nccl_baseline = nlohmann::json::array();
  for (int b = 0; b < kNumBaselines; ++b) {
    const double hier = run.seconds[kBaselineOfPhase[b]];
    nccl_baseline->push_back({{"phase", kBaselinePhases[b]},
                              {"nccl_time_us", baseline[b] * 1e6},
                              {"hierarchical_time_us", hier * 1e6},
                              {"hierarchical_over_nccl", baseline[b] > 0 ? hier / baseline[b] : 0.0}});
  }
  return run;
}

}  // namespace epx::cli
