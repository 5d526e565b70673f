// Small host helpers of the CUDA backend: error checks and a scoped device switch.
#pragma once

#include <cuda_runtime.h>

#include <initializer_list>

#include "core/check.h"

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

}  // namespace epx::cuda
