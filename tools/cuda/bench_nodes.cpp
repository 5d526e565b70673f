// `epx bench --nodes N` / `--routing hierarchical` on GPUs (tools/bench_nodes.h): cuda groups of ranks as threads
// (rank r on GPU r % visible GPUs, as the plain bench's --ranks), once with the flat routing on one node and once
// with gpus_per_node = ranks / N and the hierarchical routing (normal: src/ep/cuda/hierarchical_engine.*; low-latency:
// src/ep/cuda/hierarchical_low_latency_engine.*), each phase timed with CUDA events per rank (the ranks meet before
// each iteration, outside the events; the slowest rank's median), the results downloaded and compared on the host.
#include "bench_nodes.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <set>

#include "bench.h"
#include "cuda/bench_util.h"
#include "epx/buffer.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/routing.h"

namespace epx::cli {
namespace {

// NOTE: with ranks of one process on several GPUs the hierarchical exchange copies between stream-ordered
// allocations of different devices (docs/internode.md), which the default pools do not grant to peers: grant
// every device used read/write access to every other one's default pool, where the pair has peer access.
void grant_pool_access(const std::vector<int>& devices) {
  const std::set<int> used(devices.begin(), devices.end());
  for (int owner : used) {
    cudaMemPool_t pool;
    cuda_ok(cudaDeviceGetDefaultMemPool(&pool, owner), "cudaDeviceGetDefaultMemPool");
    for (int peer : used) {
      int can = 0;
      if (peer == owner || cudaDeviceCanAccessPeer(&can, peer, owner) != cudaSuccess || can == 0) continue;
      cudaMemAccessDesc desc{};
      desc.location.type = cudaMemLocationTypeDevice;
      desc.location.id = peer;
      desc.flags = cudaMemAccessFlagsProtReadWrite;
      cuda_ok(cudaMemPoolSetAccess(pool, &desc, 1), "cudaMemPoolSetAccess");
    }
  }
}

DispatchSnapshot download_snapshot(const DispatchResult& r, cudaStream_t stream) {
  return {testing::download<uint8_t>(r.recv_x, stream),
          testing::download<uint8_t>(r.recv_x_scales, stream),
          testing::download<uint8_t>(r.recv_topk_idx, stream),
          testing::download<uint8_t>(r.recv_topk_weights, stream),
          testing::download<uint8_t>(r.recv_src_idx, stream),
          testing::download<uint8_t>(r.rank_prefix_matrix, stream),
          r.num_recv_tokens_per_expert};
}

// A host copy of a device tensor (undefined stays undefined), for the host-side snapshots of bench_nodes.h.
Tensor host_copy(const Tensor& t, cudaStream_t stream) {
  if (!t.defined()) return {};
  Tensor h = Tensor::empty(t.dtype(), t.sizes());
  cuda_ok(cudaMemcpyAsync(h.data(), t.data(), t.nbytes(), cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return h;
}

}  // namespace

void run_cuda_rank_phases(const BenchConfig& config, const RankInputs& in, const RankInputs& ll_in,
                          const std::shared_ptr<Group>& group, bool flat, double* seconds, RoutingRun& run) {
  const int num_ranks = config.num_ranks;
  const int64_t T = config.num_tokens, H = config.hidden, E = config.num_experts;
  const int K = config.num_topk;
  const int num_sms = config.num_sms.empty() ? 24 : config.num_sms[0];
  const int64_t T_ll = config.num_ll_tokens;
  Group& g = *group;
  const int r = g.rank();
  cuda_ok(cudaSetDevice(g.device().index), "cudaSetDevice");
  cudaStream_t stream;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  BufferOptions options;
  options.num_sms = num_sms;
  options.num_normal_bytes = normal_buffer_size_hint(H, num_ranks, num_sms, T);
  set_nodes_routing(config, flat, options);
  options.num_low_latency_bytes = low_latency_buffer_size_hint(T_ll, H, num_ranks, E);
  auto buffer = Buffer::create(group, tuned_from_env(options));
  const Device device = g.device();
  Tensor x = testing::upload(in.x, DType::kBFloat16, {T, H}, device, stream);
  Tensor x8 = testing::upload(in.x_fp8, DType::kFloat8E4M3, {T, H}, device, stream);
  Tensor scales = testing::upload(in.x_scales, DType::kFloat32, {T, H / 128}, device, stream);
  Tensor topk = testing::upload(in.topk, DType::kInt64, {T, K}, device, stream);
  Tensor weights = testing::upload(in.weights, DType::kFloat32, {T, K}, device, stream);
  Layout layout = buffer->get_dispatch_layout(topk, E, stream);
  cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  const int warm = config.num_warmup, iters = config.num_iters;
  auto meet = [&](int) { g.barrier(); };
  DispatchResult fresh, cached, fp8;
  CombineResult combined;
  seconds[0] = 1e-3 * median_event_ms(stream, warm, iters, meet, [&](int) {
                 DispatchArgs a;
                 a.x = x;
                 a.topk_idx = topk;
                 a.topk_weights = weights;
                 a.num_experts = E;
                 a.layout = &layout;
                 a.stream = stream;
                 fresh = buffer->dispatch(a);
               });
  seconds[1] = 1e-3 * median_event_ms(stream, warm, iters, meet, [&](int) {
                 DispatchArgs a;
                 a.x = x;
                 a.handle = fresh.handle;
                 a.stream = stream;
                 cached = buffer->dispatch(a);
               });
  seconds[2] = 1e-3 * median_event_ms(stream, warm, iters, meet, [&](int) {
                 DispatchArgs a;
                 a.x = x8;
                 a.x_scales = scales;
                 a.handle = fresh.handle;
                 a.stream = stream;
                 fp8 = buffer->dispatch(a);
               });
  seconds[3] = 1e-3 * median_event_ms(stream, warm, iters, meet, [&](int) {
                 CombineArgs a;
                 a.x = fresh.recv_x;
                 a.handle = fresh.handle;
                 a.stream = stream;
                 combined = buffer->combine(a);
               });
  run.dispatched[0][r] = download_snapshot(fresh, stream);
  run.dispatched[1][r] = download_snapshot(cached, stream);
  run.dispatched[2][r] = download_snapshot(fp8, stream);
  run.combined[r] = testing::download<uint16_t>(combined.x, stream);

  // Low-latency, as the host run (bench_nodes.cpp): fp8 dispatch timed; a bf16 dispatch whose rows are the
  // identity experts' outputs; their combine timed.
  Tensor ll_x = testing::upload(ll_in.x, DType::kBFloat16, {T_ll, H}, device, stream);
  Tensor ll_topk = testing::upload(ll_in.topk, DType::kInt64, {T_ll, K}, device, stream);
  Tensor ll_weights = testing::upload(ll_in.weights, DType::kFloat32, {T_ll, K}, device, stream);
  auto ll_dispatch = [&](bool use_fp8) {
    LowLatencyDispatchArgs a;
    a.x = ll_x;
    a.topk_idx = ll_topk;
    a.max_tokens_per_rank = T_ll;
    a.num_experts = E;
    a.use_fp8 = use_fp8;
    a.stream = stream;
    return buffer->low_latency_dispatch(a);
  };
  LowLatencyDispatchResult ll;
  seconds[kNumNodesPhases] = 1e-3 * median_event_ms(stream, warm, iters, meet, [&](int) { ll = ll_dispatch(true); });
  LowLatencyDispatchResult ll_host;
  ll_host.recv_x = host_copy(ll.recv_x, stream);
  ll_host.recv_x_scales = host_copy(ll.recv_x_scales, stream);
  ll_host.recv_count = host_copy(ll.recv_count, stream);
  ll_host.recv_src_info = host_copy(ll.recv_src_info, stream);
  ll_host.recv_layout_range = host_copy(ll.recv_layout_range, stream);
  run.ll_dispatched[r] = low_latency_snapshot(ll_host);
  g.barrier();  // every rank's fp8 results are read before the next dispatch reuses the receive buffers
  ll = ll_dispatch(false);
  LowLatencyCombineResult ll_out;
  seconds[kNumNodesPhases + 1] = 1e-3 * median_event_ms(stream, warm, iters, meet, [&](int) {
                                   LowLatencyCombineArgs a;
                                   a.x = ll.recv_x;
                                   a.topk_idx = ll_topk;
                                   a.topk_weights = ll_weights;
                                   a.handle = ll.handle;
                                   a.stream = stream;
                                   ll_out = buffer->low_latency_combine(a);
                                 });
  run.ll_combined[r] = testing::download<uint16_t>(ll_out.x, stream);

  // Every tensor frees on `stream`: release them before destroying it.
  fresh = cached = fp8 = {};
  combined = {};
  layout = {};
  x = x8 = scales = topk = weights = Tensor();
  ll = ll_host = {};
  ll_out = {};
  ll_x = ll_topk = ll_weights = Tensor();
  buffer.reset();
  cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
}

namespace {

// One routing on cuda groups of gpus_per_node ranks per node (0: one node); `flat`: both paths routed flat, else
// the topology's routing (or kHierarchical, forced).
RoutingRun run_cuda_routing(const BenchConfig& config, const std::vector<RankInputs>& inputs,
                            const std::vector<RankInputs>& ll_inputs, const std::vector<int>& devices,
                            int gpus_per_node, bool flat, const char* label) {
  const int num_ranks = config.num_ranks;
  if (config.progress) {
    std::fprintf(stderr, "[epx bench] cuda backend, %d ranks, %s: dispatch and combine\n", num_ranks, label);
  }
  CudaGroupOptions group_options;
  group_options.gpus_per_node = gpus_per_node;
  auto groups = create_cuda_groups(devices, group_options);
  RoutingRun run(num_ranks);
  std::vector<std::vector<double>> seconds(num_ranks, std::vector<double>(kNumNodesPhases + kNumLowLatencyPhases));
  run_host_ranks(groups, [&](int r, Group&) {
    run_cuda_rank_phases(config, inputs[r], ll_inputs[r], groups[r], flat, seconds[r].data(), run);
  });
  for (const auto& rank_seconds : seconds) run.add_rank_seconds(rank_seconds.data());
  run.has_low_latency = true;
  return run;
}

}  // namespace

nlohmann::json run_cuda_nodes_bench(const BenchConfig& config) {
  const int num_gpus = cuda_device_count();
  if (num_gpus == 0) throw Error(ErrorCode::kUnsupported, "bench --nodes: no GPU visible");
  check_expert_split(config.num_experts, config.num_ranks);
  std::vector<int> devices(config.num_ranks);
  for (int r = 0; r < config.num_ranks; ++r) devices[r] = r % num_gpus;
  keep_mem_pools_warm(num_gpus);
  grant_pool_access(devices);
  cudaDeviceProp prop{};
  cuda_ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const std::vector<RankInputs> inputs = make_nodes_inputs(config);
  const std::vector<RankInputs> ll_inputs = make_nodes_ll_inputs(config);
  const Topology topo = nodes_topology(config);
  // --processes: the rank processes first, while this process holds no buffers.
  nlohmann::json nccl_baseline;
  const RoutingRun tested = config.processes ? run_cuda_routing_in_processes(config, &nccl_baseline)
                                             : run_cuda_routing(config, inputs, ll_inputs, devices, topo.gpus_per_node,
                                                                false, "hierarchical");
  const RoutingRun flat = run_cuda_routing(config, inputs, ll_inputs, devices, 0, true, "flat");
  const int num_used = std::min(num_gpus, config.num_ranks);
  nlohmann::json report = nodes_report(
      config, inputs, ll_inputs, flat, tested, "cuda",
      fmt::format("{} x {} ({} SMs)", num_used, prop.name, prop.multiProcessorCount),
      {{"num_sms", config.num_sms.empty() ? 24 : config.num_sms[0]},
       {"devices", devices},
       {"hierarchical_run", config.processes ? "one process per rank on an NCCL group (network leg on NCCL)"
                                             : "ranks as threads (network leg: the threads' exchange)"},
       {"timing", "CUDA events per rank, the ranks meeting before each iteration; slowest rank, median"}});
  if (config.processes) report["nccl_baseline"] = nccl_baseline;
  return report;
}

}  // namespace epx::cli
