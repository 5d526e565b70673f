// Micro-benchmark for issue 15's layout target (<= 10 us eager): where does an eager get_dispatch_layout's time go?
// One GPU answers it (the layout has no communication). Times, each the median of many calls:
//   host   the CPU time of one call: Buffer::get_dispatch_layout (the whole call, with the previous result freed
//          as in `epx bench`), its pieces (cudaMallocAsync + cudaFreeAsync, the kernel launch alone, an empty
//          launch), and the whole call with two rank threads calling at once (as `epx bench --ranks 2` does)
//   eager  CUDA events around one call on an idle stream (what `epx bench` reports as the layout's time_us),
//          and around an empty kernel (the floor of that measure: launch latency)
//   gpu    the kernel alone: a CUDA graph of 50 launches, per launch; blocks sized to the tokens (L1) and of 1024
// Shapes: --tokens 4096, top-8 of 256 experts, 2 ranks (the layout of EP2), int64 top-k.
//
// Build (GPU machine, after a CUDA build of epx in build-gpu):
//   nvcc -O3 -std=c++17 -arch=sm_90 -DEPX_WITH_CUDA=1 -Iinclude -Isrc -o layout_cost bench/micro/layout_cost.cu \
//        build-gpu/libepx.a -ldl
// Run: ./layout_cost [tokens=4096]. Not part of the CMake build; results and the decision: docs/perf-notes.md.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "ep/cuda/normal_kernels.h"
#include "epx/buffer.h"
#include "epx/cuda.h"

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

namespace {

__global__ void empty_kernel() {}

// What a cluster of 8 costs by itself: launch, the two cluster barriers of the layout kernel, nothing else.
__global__ void __cluster_dims__(8, 1, 1) empty_cluster_kernel(int syncs) {
  namespace cg = cooperative_groups;
  for (int i = 0; i < syncs; ++i) cg::this_cluster().sync();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Median CPU microseconds of fn() over n calls (after 50 warm-up calls).
double host_us(int n, const std::function<void()>& fn) {
  for (int i = 0; i < 50; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < n; ++i) {
    const auto a = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count());
  }
  return median(t);
}

// Median event microseconds of fn() enqueued on an idle stream (synchronized before and after each call).
double eager_us(cudaStream_t s, int n, const std::function<void()>& fn) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < n + 20; ++i) {
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaEventRecord(a, s));
    fn();
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 20) t.push_back(ms * 1e3);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return median(t);
}

// Per-launch microseconds of a CUDA graph of `count` launches of fn (the GPU time without the host).
double graph_us(cudaStream_t s, int count, const std::function<void()>& fn) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < count; ++i) fn();
  CHECK(cudaStreamEndCapture(s, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  const double per = eager_us(s, 20, [&] { CHECK(cudaGraphLaunch(ge, s)); }) / count;
  CHECK(cudaGraphExecDestroy(ge));
  CHECK(cudaGraphDestroy(g));
  return per;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace epx;
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 4096;
  const int K = 8, R = 2;
  const int64_t E = 256;
  std::mt19937 rng(7);
  std::vector<int64_t> topk(T * K);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> pool(E);
    for (int64_t e = 0; e < E; ++e) pool[e] = e;
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int k = 0; k < K; ++k) topk[t * K + k] = pool[k];
  }

  // One rank alone, then two rank threads calling at once (both on GPU 0).
  for (int ranks : {1, 2}) {
    auto groups = create_cuda_groups(std::vector<int>(ranks, 0));
    std::vector<double> whole(ranks), eager(ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        CHECK(cudaSetDevice(0));
        cudaStream_t s;
        CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        BufferOptions o;
        o.num_sms = 24;
        o.num_normal_bytes = int64_t{64} << 20;
        auto buffer = Buffer::create(groups[r], o);
        Tensor t = Tensor::empty(DType::kInt64, {T, K}, groups[r]->device(), nullptr, s);
        CHECK(cudaMemcpyAsync(t.data(), topk.data(), topk.size() * 8, cudaMemcpyHostToDevice, s));
        CHECK(cudaStreamSynchronize(s));
        Layout layout;
        std::printf("rank %d of %d: buffer ready\n", r, ranks);
        groups[r]->barrier();
        whole[r] = host_us(2000, [&] { layout = buffer->get_dispatch_layout(t, E, s); });
        CHECK(cudaStreamSynchronize(s));
        groups[r]->barrier();
        eager[r] = eager_us(s, 200, [&] { layout = buffer->get_dispatch_layout(t, E, s); });
        groups[r]->barrier();
        if (ranks == 1) {
          // The pieces, one rank only.
          void* out = nullptr;
          CHECK(cudaMalloc(&out, 4 * (R + E) + T * R + 256));
          auto* counts = static_cast<int32_t*>(out);
          auto* in_rank = static_cast<uint8_t*>(out) + 4 * (R + E) + 64;
          epx::cuda::ErrorRecord* rec = nullptr;
          CHECK(cudaMalloc(&rec, sizeof(epx::cuda::ErrorRecord)));
          CHECK(cudaMemset(rec, 0, sizeof(epx::cuda::ErrorRecord)));
          auto launch = [&] {
            epx::cuda::launch_layout(t.data(), true, T, K, E, R, counts, counts + R, in_rank, rec, 0, s);
          };
          auto launch1024 = [&] {
            epx::cuda::launch_layout(t.data(), true, T, K, E, R, counts, counts + R, in_rank, rec, 0, s, 1024);
          };
          const double alloc = host_us(2000, [&] {
            void* p = nullptr;
            CHECK(cudaMallocAsync(&p, 4 * (R + E) + T * R, s));
            CHECK(cudaFreeAsync(p, s));
          });
          const double launch_host = host_us(2000, launch);
          const double empty_host = host_us(2000, [&] { empty_kernel<<<1, 32, 0, s>>>(); });
          CHECK(cudaStreamSynchronize(s));
          const double eager_kernel = eager_us(s, 200, launch);
          const double eager_empty = eager_us(s, 200, [&] { empty_kernel<<<1, 32, 0, s>>>(); });
          const double gpu_kernel = graph_us(s, 50, launch);
          const double gpu_empty = graph_us(s, 50, [&] { empty_kernel<<<1, 32, 0, s>>>(); });
          const double eager_1024 = eager_us(s, 200, launch1024);
          for (int threads : {128, 1024}) {
            for (int syncs : {0, 2}) {
              std::printf("  graph: empty cluster kernel, 8 x %d threads, %d cluster syncs: %.2f us per launch\n",
                          threads, syncs, graph_us(s, 50, [&] { empty_cluster_kernel<<<8, threads, 0, s>>>(syncs); }));
            }
          }
          const double gpu_1024 = graph_us(s, 50, launch1024);
          std::printf(
              "pieces (1 rank, T=%lld): host cudaMallocAsync+cudaFreeAsync %.2f us, host launch_layout %.2f us, "
              "host empty launch %.2f us\n",
              static_cast<long long>(T), alloc, launch_host, empty_host);
          std::printf(
              "  eager layout kernel alone %.2f us, eager empty kernel %.2f us; graph: layout kernel %.2f us, "
              "empty kernel %.2f us per launch\n",
              eager_kernel, eager_empty, gpu_kernel, gpu_empty);
          std::printf("  cluster blocks of 1024 threads (before L1): eager %.2f us, graph %.2f us per launch\n",
                      eager_1024, gpu_1024);
          CHECK(cudaFree(out));
          CHECK(cudaFree(rec));
        }
        std::printf("%d rank(s), rank %d: get_dispatch_layout host %.2f us, eager (events) %.2f us\n", ranks, r,
                    whole[r], eager[r]);
        layout = {};
        t = Tensor();  // NOTE: before its stream goes (the memory is freed on the stream it was allocated on)
        buffer.reset();
        CHECK(cudaStreamDestroy(s));
      });
    }
    for (auto& th : threads) th.join();
  }
  return 0;
}
