// Grid-level helpers shared by both kernel paths.
#pragma once

#include "comm/cuda/device/ordering.cuh"

namespace epx::cuda {
namespace {

// The last-block finisher: one thread of every block calls it once per launch, after a __syncthreads() that ends
// the block's work; it returns true in the last block to arrive, which resets *ticket for the next launch (stream
// order). Release: each block fences (gpu scope) before its increment, so its block's work (the barrier put it in
// this thread's past) precedes the increment. Acquire: the last block fences after its increment, so every other
// block's work precedes what it does next, including a st_release_sys that publishes it to other GPUs.
__device__ __forceinline__ bool last_block_arrives(unsigned int* ticket) {
  __threadfence();
  const unsigned int prev = atomicAdd(ticket, 1u);
  if (prev != gridDim.x - 1) return false;
  *reinterpret_cast<volatile unsigned int*>(ticket) = 0;
  fence_acq_rel_gpu();
  return true;
}

}  // namespace
}  // namespace epx::cuda
