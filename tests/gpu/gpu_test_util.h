// Helpers shared by the GPU tests (tests/gpu/*_test.cpp): the visible GPU count, fresh seeds, host <-> device
// copies of tensors and a crash handler that prints the stack. Host helpers of the CPU tests: tests/unit/test_util.h.
#pragma once

#include <cuda_runtime.h>
#include <execinfo.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "epx/tensor.h"

namespace epx::testing {

// Visible CUDA devices; 0 without a driver or GPU.
inline int num_gpus() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// A new seed per call (printed by the tests that use it, so a failure can be replayed).
inline uint64_t fresh_seed() {
  static std::atomic<uint64_t> counter{0};
  return std::random_device{}() * 1000003ull + counter++;
}

// A device copy of `bytes` bytes enqueued on `stream`; no bytes give a null view of `shape`, as torch passes an
// empty tensor.
inline Tensor upload(const void* data, size_t bytes, DType dtype, std::vector<int64_t> shape, Device device,
                     Stream stream) {
  if (bytes == 0) return Tensor::wrap(TensorView::of(nullptr, dtype, shape, device), nullptr);
  Tensor t = Tensor::empty(dtype, shape, device, nullptr, stream);
  cudaMemcpyAsync(t.data(), data, bytes, cudaMemcpyHostToDevice, stream);
  return t;
}
template <typename T>
Tensor upload(const std::vector<T>& v, DType dtype, std::vector<int64_t> shape, Device device, Stream stream) {
  return upload(v.data(), v.size() * sizeof(T), dtype, std::move(shape), device, stream);
}

// The tensor's bytes as T, copied on `stream` and waited for; empty for an undefined tensor.
template <typename T>
std::vector<T> download(const Tensor& t, Stream stream = nullptr) {
  std::vector<T> out(t.defined() ? t.nbytes() / sizeof(T) : 0);
  if (!out.empty()) cudaMemcpyAsync(out.data(), t.data(), t.nbytes(), cudaMemcpyDeviceToHost, stream);
  cudaStreamSynchronize(stream);
  return out;
}

// A crash (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) prints "rank R: signal S, stack:" (without the rank when it is
// negative) and the stack before the process dies (function names need -rdynamic, which tests/CMakeLists.txt
// sets for the GPU tests; addresses resolve with addr2line otherwise).
inline void print_stack_on_crash(int rank = -1) {
  static int crash_rank = -1;
  crash_rank = rank;
  for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL}) {
    std::signal(sig, [](int s) {
      void* frames[64];
      const int n = backtrace(frames, 64);
      char line[64];
      const int len = crash_rank >= 0 ? std::snprintf(line, sizeof(line), "rank %d: signal %d, stack:\n", crash_rank, s)
                                      : std::snprintf(line, sizeof(line), "signal %d, stack:\n", s);
      if (len > 0) (void)!write(STDERR_FILENO, line, static_cast<size_t>(len));
      backtrace_symbols_fd(frames, n, STDERR_FILENO);
      std::signal(s, SIG_DFL);
      std::raise(s);
    });
  }
}

}  // namespace epx::testing
