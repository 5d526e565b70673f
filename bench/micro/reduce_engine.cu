// Micro-benchmark for issue 15, direction 1: how fast can a few SMs run the normal path's receive tail (the
// copy-engine combine reduction: for each token, the sum of its rows from every source rank, bf16 in, fp32
// accumulate, bf16 out)? Everything is local HBM, so one GPU answers it.
//
// Variants, each on `blocks` CTAs (one per SM):
//   regs4   the current reduce_token shape: one token per warp, 4 int4 per lane per row in flight, rows in pairs
//   regs8   the same with 8 int4 per lane per row (twice the bytes in flight, more registers)
//   regs6   6 int4 per lane per row (what fits the real kernel's 128 registers without spills)
//   bulk    a TMA receive engine: one producer thread per CTA streams each token's source rows into a ring of
//           shared-memory stages with cp.async.bulk (completion on an mbarrier), consumer warps sum from shared
//           memory and store; ~170 KB in flight per SM without registers
//   bulk_nostore, bulk_loads: the engine without its output stores, and its loads alone (where the time goes)
// Checked: every variant's output equals a plain reference kernel's, bit for bit (same summation order).
//
// Build and run (GPU machine): nvcc -O3 -std=c++17 -arch=sm_90 -o reduce_engine bench/micro/reduce_engine.cu
//   ./reduce_engine [tokens=4096] [hidden=7168] [sources=2] [bulk stages=as many as fit]
// Not part of the CMake build (CI has no GPU); results and the decision: docs/perf-notes.md (R2).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

constexpr int kMaxSources = 8;

struct Args {
  const uint16_t* src[kMaxSources];  // [T, H] bf16 each
  int num_sources;
  int64_t tokens;
  int64_t hidden;
  uint16_t* out;  // [T, H]
};

__device__ __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ uint32_t pack(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ void add8(float* acc, int4 v) {
  const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                         static_cast<uint32_t>(v.w)};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    acc[2 * q] += lo(w[q]);
    acc[2 * q + 1] += hi(w[q]);
  }
}
__device__ __forceinline__ int4 pack8(const float* acc) {
  int4 o;
  o.x = static_cast<int>(pack(acc[0], acc[1]));
  o.y = static_cast<int>(pack(acc[2], acc[3]));
  o.z = static_cast<int>(pack(acc[4], acc[5]));
  o.w = static_cast<int>(pack(acc[6], acc[7]));
  return o;
}

// Reference: one thread per int4 chunk, sources in order.
__global__ void reference_kernel(Args a) {
  const int64_t chunks = a.tokens * (a.hidden / 8);
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < chunks; i += int64_t{gridDim.x} * blockDim.x) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int s = 0; s < a.num_sources; ++s) add8(acc, reinterpret_cast<const int4*>(a.src[s])[i]);
    reinterpret_cast<int4*>(a.out)[i] = pack8(acc);
  }
}

// The current shape (reduce_token): a warp per token, kUnroll int4 per lane per row, rows two at a time.
template <int kUnroll>
__global__ void __launch_bounds__(512) regs_kernel(Args a) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  const int64_t num_chunks = a.hidden / 8;
  for (int64_t t = blockIdx.x * int64_t{num_warps} + warp; t < a.tokens; t += int64_t{gridDim.x} * num_warps) {
    for (int64_t v0 = lane; v0 < num_chunks; v0 += 32 * kUnroll) {
      float acc[kUnroll][8];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[u][q] = 0.f;
      for (int s = 0; s < a.num_sources; s += 2) {
        int4 in0[kUnroll], in1[kUnroll];
        const int4* r0 = reinterpret_cast<const int4*>(a.src[s] + t * a.hidden);
        const int4* r1 = s + 1 < a.num_sources ? reinterpret_cast<const int4*>(a.src[s + 1] + t * a.hidden) : nullptr;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = v0 + 32 * u;
          in0[u] = v < num_chunks ? __ldcg(r0 + v) : make_int4(0, 0, 0, 0);
          in1[u] = (r1 != nullptr && v < num_chunks) ? __ldcg(r1 + v) : make_int4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) add8(acc[u], in0[u]);
        if (r1 != nullptr) {
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) add8(acc[u], in1[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + 32 * u;
        if (v < num_chunks) reinterpret_cast<int4*>(a.out + t * a.hidden)[v] = pack8(acc[u]);
      }
    }
  }
}

// ---- TMA receive engine ------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// Global -> shared, `bytes` (multiple of 16, both 16-byte aligned), completion counted on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// Ring of kStages stages; a stage holds one token's rows from every source (sources x hidden bf16). Warp 0 lane
// 0 produces (waits for the stage to be empty, arms its full barrier with the byte count, issues the bulk
// loads); warps 1.. consume (wait full, sum from shared memory, store, arrive on empty).
// mode 0: the engine; 1: no output stores (the sums feed a never-taken store); 2: loads only (consumers release
// each stage at once): where the time goes.
__global__ void __launch_bounds__(512) bulk_kernel(Args a, int stages, int mode) {
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + stages;
  unsigned char* ring = smem + 128 * ((2 * stages * 8 + 127) / 128);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int consumers = (blockDim.x >> 5) - 1;
  const int64_t row_bytes = a.hidden * 2;
  const int64_t stage_bytes = row_bytes * a.num_sources;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], consumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int64_t my_tokens = a.tokens > blockIdx.x ? (a.tokens - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  if (warp == 0) {
    if (lane != 0) return;
    for (int64_t i = 0; i < my_tokens; ++i) {
      const int s = static_cast<int>(i % stages);
      const uint32_t round = static_cast<uint32_t>(i / stages);
      if (round > 0) mbar_wait(&empty[s], (round - 1) & 1);
      const int64_t t = blockIdx.x + i * gridDim.x;
      mbar_expect_tx(&full[s], static_cast<uint32_t>(stage_bytes));
      for (int src = 0; src < a.num_sources; ++src) {
        bulk_load(ring + s * stage_bytes + src * row_bytes, a.src[src] + t * a.hidden, static_cast<uint32_t>(row_bytes),
                  &full[s]);
      }
    }
    return;
  }
  const int ct = threadIdx.x - 32, num_ct = consumers * 32;
  const int64_t num_chunks = a.hidden / 8;
  for (int64_t i = 0; i < my_tokens; ++i) {
    const int s = static_cast<int>(i % stages);
    mbar_wait(&full[s], static_cast<uint32_t>(i / stages) & 1);
    const int64_t t = blockIdx.x + i * gridDim.x;
    const int4* stage = reinterpret_cast<const int4*>(ring + s * stage_bytes);
    for (int64_t v = ct; mode != 2 && v < num_chunks; v += num_ct) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int src = 0; src < a.num_sources; ++src) add8(acc, stage[src * num_chunks + v]);
      if (mode == 0 || acc[0] == 12345.f) reinterpret_cast<int4*>(a.out + t * a.hidden)[v] = pack8(acc);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);
  }
}

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? std::atoll(argv[1]) : 4096;
  const int64_t H = argc > 2 ? std::atoll(argv[2]) : 7168;
  const int S = argc > 3 ? std::atoi(argv[3]) : 2;
  if (H % 8 != 0 || S < 1 || S > kMaxSources) {
    std::fprintf(stderr, "hidden must be a multiple of 8, sources in [1, %d]\n", kMaxSources);
    return 2;
  }
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  Args a{};
  a.num_sources = S;
  a.tokens = T;
  a.hidden = H;
  std::vector<uint16_t> host(static_cast<size_t>(T * H));
  uint32_t x = 12345;
  for (int s = 0; s < S; ++s) {
    for (auto& v : host) {
      x = x * 1664525u + 1013904223u;
      v = static_cast<uint16_t>(0x3c00 + ((x >> 16) & 0x3ff) - (((x >> 8) & 1) ? 0x8000 : 0));  // +-[0.0078, 0.0156)
    }
    void* p = nullptr;
    CHECK(cudaMalloc(&p, host.size() * 2));
    CHECK(cudaMemcpy(p, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
    a.src[s] = static_cast<const uint16_t*>(p);
  }
  uint16_t *out = nullptr, *ref = nullptr;
  CHECK(cudaMalloc(&out, host.size() * 2));
  CHECK(cudaMalloc(&ref, host.size() * 2));
  Args r = a;
  r.out = ref;
  reference_kernel<<<prop.multiProcessorCount * 4, 256>>>(r);
  CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> want(host.size()), got(host.size());
  CHECK(cudaMemcpy(want.data(), ref, want.size() * 2, cudaMemcpyDeviceToHost));
  const double bytes = static_cast<double>(T * H * 2) * (S + 1);  // S rows read, one written per token
  // Stages: as many token stages as fit in the opt-in shared memory (or argv[4]).
  const size_t stage_bytes = static_cast<size_t>(H) * 2 * S;
  const int max_stages = static_cast<int>((prop.sharedMemPerBlockOptin - 128) / stage_bytes);
  const int kStages = argc > 4 ? std::min(std::atoi(argv[4]), max_stages) : max_stages;
  const size_t bulk_smem = 128 + static_cast<size_t>(kStages) * stage_bytes;
  const bool bulk_fits = kStages >= 2;
  if (bulk_fits) {
    CHECK(cudaFuncSetAttribute(bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bulk_smem)));
  }
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::printf("tokens %lld hidden %lld sources %d: %.1f MB moved per call; %s, %d SMs\n", static_cast<long long>(T),
              static_cast<long long>(H), S, bytes / 1e6, prop.name, prop.multiProcessorCount);
  std::printf("%-8s %6s %10s %10s %12s %s\n", "variant", "blocks", "median_us", "GB/s", "GB/s per SM", "check");
  std::printf("bulk: %d stages of %zu bytes (%zu bytes of shared memory in flight per SM)\n", kStages, stage_bytes,
              bulk_smem - 128);
  for (const char* name : {"regs4", "regs6", "regs8", "bulk", "bulk_nostore", "bulk_loads"}) {
    if (std::strncmp(name, "bulk", 4) == 0 && !bulk_fits) continue;
    for (int blocks : {8, 16, 24, 32, 48, 64, prop.multiProcessorCount}) {
      a.out = out;
      auto launch = [&] {
        if (std::strcmp(name, "regs4") == 0) regs_kernel<4><<<blocks, 512>>>(a);
        if (std::strcmp(name, "regs8") == 0) regs_kernel<8><<<blocks, 512>>>(a);
        if (std::strcmp(name, "regs6") == 0) regs_kernel<6><<<blocks, 512>>>(a);
        if (std::strcmp(name, "bulk") == 0) bulk_kernel<<<blocks, 512, bulk_smem>>>(a, kStages, 0);
        if (std::strcmp(name, "bulk_nostore") == 0) bulk_kernel<<<blocks, 512, bulk_smem>>>(a, kStages, 1);
        if (std::strcmp(name, "bulk_loads") == 0) bulk_kernel<<<blocks, 512, bulk_smem>>>(a, kStages, 2);
      };
      CHECK(cudaMemset(out, 0xff, host.size() * 2));  // poison
      launch();
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaMemcpy(got.data(), out, got.size() * 2, cudaMemcpyDeviceToHost));
      int64_t bad = 0;
      for (size_t i = 0; i < got.size(); ++i) bad += got[i] != want[i];
      std::vector<float> ms;
      for (int it = 0; it < 25; ++it) {
        CHECK(cudaEventRecord(e0));
        launch();
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float m = 0;
        CHECK(cudaEventElapsedTime(&m, e0, e1));
        if (it >= 5) ms.push_back(m);
      }
      std::sort(ms.begin(), ms.end());
      const double us = ms[ms.size() / 2] * 1e3;
      // The variants without output stores move only the reads.
      const bool no_output = std::strcmp(name, "bulk_nostore") == 0 || std::strcmp(name, "bulk_loads") == 0;
      const double moved = no_output ? static_cast<double>(T * H * 2) * S : bytes;
      std::printf("%-8s %6d %10.1f %10.0f %12.1f %s\n", name, blocks, us, moved / us / 1e3, moved / us / 1e3 / blocks,
                  no_output ? "(no output; reads only)"
                  : bad == 0                                                                ? "ok"
                                                                                            : "MISMATCH");
    }
  }
  return 0;
}
