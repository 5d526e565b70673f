// Kernel of the device replica choice (private; CUDA builds only; C++17 for nvcc). See epx/eplb/device_replicas.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace epx::eplb::cuda {

struct ReplicaChoiceLaunch {
  const int32_t* offsets;  // [num_logical + 1] of the layer
  const int32_t* slots;    // [num_physical] of the layer
  int num_logical;
  int slots_per_gpu;
  int gpu;
  uint64_t layer_key;
  bool dynamic;  // ReplicaChoice::kDynamic, else kStatic
  bool rank_invariant;
  int64_t first_token;
  int num_topk;
  int64_t num_entries;
  bool int64;  // ids are int64, else int32
  const void* in;
  void* out;
};

// Enqueues the choice of every entry on `stream` (device `device`); throws Error(kCudaError) on a launch failure.
void launch_choose_replicas(const ReplicaChoiceLaunch& a, int device, cudaStream_t stream);

// bytes from host memory to device memory on `stream` (device `device`); the host buffer may be freed on return.
void copy_to_device(void* dst, const void* src, size_t bytes, int device, cudaStream_t stream);

}  // namespace epx::eplb::cuda
