// The device replica choice: one thread per (token, k) entry, the shared rule of replica_rule.h.
#include <cuda_runtime.h>

#include "core/check.h"
#include "eplb/cuda/device_replicas_kernels.h"
#include "eplb/replica_rule.h"

namespace epx::eplb::cuda {
namespace {

template <typename T>
__global__ void choose_replicas_kernel(ReplicaChoiceLaunch a) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= a.num_entries) return;
  const int64_t e = static_cast<int64_t>(static_cast<const T*>(a.in)[i]);
  int32_t chosen = -1;
  if (e >= 0 && e < a.num_logical) {
    const int32_t begin = a.offsets[e], end = a.offsets[e + 1];
    const uint64_t token = static_cast<uint64_t>(a.first_token + i / a.num_topk);
    chosen = rule::pick_replica(a.slots + begin, end - begin, a.slots_per_gpu, a.gpu, a.layer_key, e, token,
                                static_cast<uint64_t>(i % a.num_topk), a.dynamic, a.rank_invariant);
  }
  static_cast<T*>(a.out)[i] = static_cast<T>(chosen);
}

// Switches to `device` for the scope (kernels and copies go to the caller's device of the table).
struct OnDevice {
  int previous = 0;
  explicit OnDevice(int device) {
    cudaGetDevice(&previous);
    cudaSetDevice(device);
  }
  ~OnDevice() { cudaSetDevice(previous); }
};

}  // namespace

void launch_choose_replicas(const ReplicaChoiceLaunch& a, int device, cudaStream_t s) {
  if (a.num_entries == 0) return;
  OnDevice guard(device);
  constexpr int kThreads = 256;
  const auto blocks = static_cast<unsigned>((a.num_entries + kThreads - 1) / kThreads);
  if (a.int64) {
    choose_replicas_kernel<int64_t><<<blocks, kThreads, 0, s>>>(a);
  } else {
    choose_replicas_kernel<int32_t><<<blocks, kThreads, 0, s>>>(a);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    epx::detail::raise(ErrorCode::kCudaError, "choose_replicas kernel launch failed: {}", cudaGetErrorString(err));
  }
}

void copy_to_device(void* dst, const void* src, size_t bytes, int device, cudaStream_t s) {
  if (bytes == 0) return;
  OnDevice guard(device);
  // Synchronous with respect to the host buffer: pageable memory is staged before cudaMemcpyAsync returns only
  // for small copies, so wait for the copy (a table upload is rare: once per rebalance).
  cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  if (err != cudaSuccess) {
    epx::detail::raise(ErrorCode::kCudaError, "copying the replica table to cuda:{} failed: {}", device,
                       cudaGetErrorString(err));
  }
}

}  // namespace epx::eplb::cuda
