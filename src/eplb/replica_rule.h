// The replica choice rule of ReplicaChoice (epx/eplb/expert_location.h), one entry at a time (C++17: nvcc compiles
// it too, so it takes `dynamic` for the mode and includes nothing of the C++20 headers): shared by the host
// choose_replicas and the device kernel (device_replicas_kernels.cu), so both pick the same slot by construction.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define EPX_REPLICA_FN __host__ __device__ inline
#else
#define EPX_REPLICA_FN inline
#endif

namespace epx::eplb::rule {

// splitmix64: a counter-based hash, so choices need no shared RNG state.
EPX_REPLICA_FN uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Key of a (seed, layer): hashed once per call.
EPX_REPLICA_FN uint64_t layer_key(uint64_t seed, int layer) { return mix(seed ^ mix(static_cast<uint64_t>(layer))); }

// The slot of logical expert `e` for (token, k) on `gpu`: reps[0, n) its replica slots ascending (n >= 1),
// slots_per_gpu the location's slots per GPU.
EPX_REPLICA_FN int32_t pick_replica(const int32_t* reps, int n, int slots_per_gpu, int gpu, uint64_t layer_key,
                                    int64_t e, uint64_t token, uint64_t k, bool dynamic, bool rank_invariant) {
  const uint64_t count = static_cast<uint64_t>(n);
  const uint64_t expert_key = mix(layer_key ^ static_cast<uint64_t>(e));
  if (!dynamic) {  // ReplicaChoice::kStatic
    if (rank_invariant) return reps[(expert_key + token) % count];
    for (int i = 0; i < n; ++i) {
      if (reps[i] / slots_per_gpu == gpu) return reps[i];
    }
    // Number the GPUs without a replica 0, 1, ... so that they divide evenly over the replicas.
    uint64_t ordinal = static_cast<uint64_t>(gpu);
    int last_gpu = -1;
    for (int i = 0; i < n; ++i) {
      const int g = reps[i] / slots_per_gpu;
      if (g < gpu && g != last_gpu) --ordinal;
      last_gpu = g;
    }
    return reps[(expert_key + ordinal) % count];
  }
  uint64_t key = mix(expert_key ^ mix(token * 64 + k));
  if (!rank_invariant) key = mix(key ^ static_cast<uint64_t>(gpu + 1));
  return reps[key % count];
}

}  // namespace epx::eplb::rule
