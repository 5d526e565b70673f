// Small host helpers of the CUDA backend: error checks, a kernel launch with attributes and a scoped device switch.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <initializer_list>
#include <utility>

#include "core/check.h"
#include "core/timeout.h"

namespace epx::cuda {

// What went wrong, for messages. NOTE: cudart is linked statically and loads libcuda.so.1 itself on the
// first call; with no driver every call returns cudaErrorInsufficientDriver, whose own text ("driver
// version is insufficient") does not say that the driver may be missing altogether.
inline const char* cuda_error_text(cudaError_t err) {
  switch (err) {
    case cudaErrorInsufficientDriver:
      return "no CUDA driver (libcuda.so.1) found, or it is older than the CUDA runtime epx was built with "
             "(cudaErrorInsufficientDriver)";
    case cudaErrorStubLibrary:
      return "libcuda.so.1 is the CUDA toolkit's stub, not a driver (cudaErrorStubLibrary)";
    case cudaErrorNoDevice:
      return "no CUDA GPU is visible (cudaErrorNoDevice; check CUDA_VISIBLE_DEVICES)";
    default:
      return cudaGetErrorString(err);
  }
}

// kUnsupported when the machine has no driver or GPU, kOutOfMemory for a failed allocation.
inline ErrorCode cuda_error_code(cudaError_t err) {
  switch (err) {
    case cudaErrorMemoryAllocation:
      return ErrorCode::kOutOfMemory;
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorNoDevice:
      return ErrorCode::kUnsupported;
    default:
      return ErrorCode::kCudaError;
  }
}

// Loads each kernel into the current device's context now (cudaFuncGetAttributes), so that no first launch
// waits for the device to drain under lazy loading (see preload_normal_kernels); returns the first error.
inline cudaError_t preload_kernels(std::initializer_list<const void*> kernels) {
  for (const void* k : kernels) {
    cudaFuncAttributes attr{};
    const cudaError_t err = cudaFuncGetAttributes(&attr, k);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls are not blamed
    detail::raise(cuda_error_code(err), "{} failed: {}", what, cuda_error_text(err));
  }
}

// kernel<<<grid, block, smem_bytes, stream>>>(args...) through cudaLaunchKernelEx; returns the launch's error.
// programmatic: a programmatic dependent launch (cudaLaunchAttributeProgrammaticStreamSerialization): the grid may be
// scheduled before the previous kernel on the stream completes, once that kernel lets it (its blocks called
// griddepcontrol.launch_dependents or exited), so the kernel must call griddepcontrol_wait
// (comm/cuda/device/pdl.cuh) before it touches memory an earlier kernel wrote. Stream capture records the relation
// as a programmatic graph edge. No host synchronization; nothing allocated.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                          bool programmatic, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Sets the current device for a scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  int device_ = 0;
};

// Polls `stream` (every 20 us) until its work is done or failed (the error is cleared, not raised) or `deadline`
// passed; true unless the deadline passed first. For waits that must stay bounded and cannot throw (failure paths).
// Not on a stream under capture (the query would end the capture).
inline bool stream_idle_by(cudaStream_t stream, std::chrono::steady_clock::time_point deadline) noexcept {
  const bool idle = detail::poll_until(deadline, [&] { return cudaStreamQuery(stream) != cudaErrorNotReady; });
  cudaGetLastError();
  return idle;
}

}  // namespace epx::cuda
