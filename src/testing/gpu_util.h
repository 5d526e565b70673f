// CUDA helpers shared by the GPU tests (tests/gpu) and the GPU benchmark drivers (tools/cuda): error checks, the
// visible GPU count, tensor copies, poisoning, timing with CUDA events and a crash handler that prints the stack.
// CUDA builds only; headers only (src/testing is not compiled into the library). Host-only helpers: stats.h
// (median, percentile) and routing.h (seeds, random top-k, placements); the CPU tests': tests/unit/test_util.h.
#pragma once

#include <cuda_runtime.h>
#include <execinfo.h>
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/cuda/alloc.h"
#include "epx/error.h"
#include "epx/tensor.h"
#include "testing/stats.h"

namespace epx::testing {

// Throws Error(kCudaError) "what: <CUDA's message>" unless err is cudaSuccess.
inline void cuda_ok(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw Error(ErrorCode::kCudaError, fmt::format("{}: {}", what, cudaGetErrorString(err)));
}

// Visible CUDA devices; 0 without a driver or GPU.
inline int num_gpus() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// A device copy of `bytes` bytes enqueued on `stream`; no bytes give a null view of `shape`, as torch passes an
// empty tensor. Copy errors are not checked: the test's comparison reports them.
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

// The byte a test fills an output with before the run under test, so that an element the kernels forget to write
// shows up in the comparison.
inline constexpr int kPoisonByte = 0xAB;

// Fills `bytes` bytes at `ptr` with `byte`, enqueued on `stream`; returns cudaMemsetAsync's result.
inline cudaError_t poison(void* ptr, size_t bytes, cudaStream_t stream, int byte = kPoisonByte) {
  return cudaMemsetAsync(ptr, byte, bytes, stream);
}

// Buffer outputs filled with kPoisonByte as they are allocated (BufferOptions::allocator), so an output element no
// kernel writes fails the comparison instead of holding a stale right value.
class PoisonAllocator final : public Allocator {
 public:
  std::shared_ptr<void> allocate(size_t bytes, Device device, Stream stream) override {
    if (!device.is_cuda()) return default_allocator()->allocate(bytes, device, stream);
    if (bytes == 0) return nullptr;
    auto p = detail::cuda_allocate(bytes, device, stream);
    poison(p.get(), bytes, stream);
    return p;
  }
};

// CUDA events for timing, created on the current device and destroyed with the object: record(i, stream) marks
// event i, elapsed_ms(from, to) waits for event `to` and reads the time between the two.
class EventTimer {
 public:
  explicit EventTimer(int num_events = 2) : events_(num_events, nullptr) {
    for (auto& e : events_) {
      const cudaError_t err = cudaEventCreate(&e);
      if (err != cudaSuccess) {
        destroy();
        cuda_ok(err, "cudaEventCreate");
      }
    }
  }
  ~EventTimer() { destroy(); }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  cudaEvent_t event(int i) const { return events_[i]; }
  void record(int i, cudaStream_t stream) { cuda_ok(cudaEventRecord(events_[i], stream), "cudaEventRecord"); }
  // NOTE: returns the float CUDA measures, widened, so callers scale exactly as with cudaEventElapsedTime.
  double elapsed_ms(int from = 0, int to = 1) {
    cuda_ok(cudaEventSynchronize(events_[to]), "cudaEventSynchronize");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, events_[from], events_[to]), "cudaEventElapsedTime");
    return ms;
  }

 private:
  void destroy() {
    for (auto& e : events_) {
      if (e != nullptr) cudaEventDestroy(e);
      e = nullptr;
    }
  }
  std::vector<cudaEvent_t> events_;
};

// Times `body(rep)` on `stream` between events 0 and 1 of `timer`, `warmup` times unrecorded and then `iters`
// times, waiting for event 1 each time; returns the median in milliseconds. `before(rep)` runs ahead of each
// repetition, outside the events (a barrier of the ranks, so that no rank is timed waiting for a late peer). Body
// may use timer.event(0), e.g. to fork another stream from the start.
template <typename Before, typename Body>
double median_event_ms(EventTimer& timer, cudaStream_t stream, int warmup, int iters, Before before, Body body) {
  std::vector<double> samples;
  for (int rep = 0; rep < warmup + iters; ++rep) {
    before(rep);
    timer.record(0, stream);
    body(rep);
    timer.record(1, stream);
    const double ms = timer.elapsed_ms(0, 1);
    if (rep >= warmup) samples.push_back(ms);
  }
  return median(samples);
}
// The same with events of its own, on the current device.
template <typename Before, typename Body>
double median_event_ms(cudaStream_t stream, int warmup, int iters, Before before, Body body) {
  EventTimer timer;
  return median_event_ms(timer, stream, warmup, iters, before, body);
}

// Back to back: `calls` calls of `body` between two events, no synchronization in between (the host runs
// ahead, as in a model step), `iters` times after `warmup` rounds; returns the median time per call in
// seconds.
template <typename Body>
double time_back_to_back(cudaStream_t stream, int warmup, int iters, int calls, Body body) {
  const double ms = median_event_ms(
      stream, warmup, iters, [](int) {},
      [&](int) {
        for (int c = 0; c < calls; ++c) body();
      });
  return ms * 1e-3 / calls;
}

// Median host time of the last time_on_stream call on this thread: how long `body` took to enqueue.
inline thread_local double t_last_host_s = 0;

// Times `body` (called with the iteration index, or with nothing) on `stream` with CUDA events: warm-up,
// then iterations; returns the median in seconds and leaves the median enqueue time in t_last_host_s.
template <typename Body>
double time_on_stream(cudaStream_t stream, int warmup, int iters, Body body) {
  std::vector<double> host;
  const double ms = median_event_ms(
      stream, warmup, iters, [](int) {},
      [&](int i) {
        const auto h0 = std::chrono::steady_clock::now();
        if constexpr (std::is_invocable_v<Body, int>) {
          body(i);
        } else {
          body();
        }
        if (i >= warmup) host.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - h0).count());
      });
  t_last_host_s = median(host);
  return ms * 1e-3;
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
