// Order statistics of timing samples, shared by the GPU tests (tests/gpu) and the benchmark drivers (tools/cuda,
// tools/bench_host.cpp). Host only; headers only (src/testing is not compiled into the library).
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace epx::testing {

// The upper median (element size / 2 once sorted, so always a sample); 0 for no samples.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Element floor(p * size) once sorted, clamped to the last; 0 for no samples. p in [0, 1].
inline double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

}  // namespace epx::testing
