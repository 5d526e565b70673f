// Low-latency kernels, by direction: low_latency_dispatch.cu and low_latency_combine.cu, with shared device
// helpers in low_latency_device.cuh. This file loads them all. Protocol: docs/low-latency.md.
#include "ep/cuda/low_latency_device.cuh"

namespace epx::cuda {

cudaError_t preload_low_latency_kernels() {
  for (auto preload : {preload_low_latency_dispatch_kernels, preload_low_latency_combine_kernels}) {
    const cudaError_t err = preload();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace epx::cuda
