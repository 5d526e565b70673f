// Tensors at the API boundary: a non-owning TensorView (DLPack-like) for inputs, and an owning Tensor
// for outputs that epx allocates. No framework types: the Python bindings convert via DLPack.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

struct CUstream_st;

namespace epx {

// Same type as cudaStream_t, so a CUDA stream can be passed directly; nullptr = the default stream.
using Stream = CUstream_st*;

enum class DType : uint8_t {
  kBFloat16,
  kFloat8E4M3,  // OCP e4m3fn: max 448, no infinities
  kFloat32,
  kInt32,
  kInt64,
  kBool,   // one byte per element, 0 or 1
  kUInt8,  // UE8M0 scale exponents are stored as uint8
};

size_t dtype_size(DType dtype) noexcept;
const char* to_string(DType dtype) noexcept;

enum class DeviceKind : uint8_t { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  static Device cpu() { return {}; }
  static Device cuda(int index) { return {DeviceKind::kCuda, index}; }
  bool is_cuda() const { return kind == DeviceKind::kCuda; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};
std::string to_string(Device device);

inline constexpr int kMaxDims = 4;

// A non-owning view: pointer, dtype, shape and strides (in elements), device.
// A default-constructed view is "absent" (defined() == false): optional arguments use that.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int ndim = -1;  // -1: absent
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t strides[kMaxDims] = {0, 0, 0, 0};
  Device device{};

  // A contiguous (row-major) view. Throws Error(kInvalidArgument) for more than kMaxDims dims, a negative
  // dim, or a shape of more than 2^63 - 1 bytes.
  static TensorView of(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = {});
  static TensorView of(void* data, DType dtype, const std::vector<int64_t>& shape, Device device = {});

  bool defined() const { return ndim >= 0; }
  int64_t size(int dim) const { return shape[dim]; }
  // Elements (0 when absent) and bytes. Throw Error(kInvalidArgument) for a view no memory can back: ndim
  // above kMaxDims, a negative dimension, or more than 2^63 - 1 elements or bytes (a hand-built view).
  int64_t numel() const;
  size_t nbytes() const;
  // Row-major strides for every dim of size > 1 (a view with no elements is contiguous whatever its strides);
  // false for ndim above kMaxDims, which no memory can back.
  bool is_contiguous() const;
  // The dims; at most kMaxDims of them (a hand-built view with a larger ndim has no more).
  std::vector<int64_t> sizes() const { return {shape, shape + (ndim < 0 ? 0 : ndim > kMaxDims ? kMaxDims : ndim)}; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data);
  }
  // "bf16[4096, 7168] on cuda:0"
  std::string describe() const;
};

// Allocates memory for Tensors that epx returns. The default allocates host memory with operator new
// and device memory with cudaMallocAsync on the call's stream from the device's default pool (whose
// release threshold epx raises so freed memory stays cached); the memory is freed with cudaFreeAsync on
// that same stream, so keep the stream alive until the tensors are released. A framework can plug its
// caching allocator in here.
class Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns memory aligned to at least 256 bytes, with a deleter that frees it. Throws kOutOfMemory.
  virtual std::shared_ptr<void> allocate(size_t bytes, Device device, Stream stream) = 0;
};
std::shared_ptr<Allocator> default_allocator();

// An owning tensor: shared storage plus a contiguous view.
class Tensor {
 public:
  Tensor() = default;
  // Allocates a contiguous tensor; contents are uninitialized. Throws Error(kInvalidArgument) for a bad
  // shape (see TensorView::of; the message names the bytes), kOutOfMemory when the allocator fails.
  static Tensor empty(DType dtype, const std::vector<int64_t>& shape, Device device = {},
                      const std::shared_ptr<Allocator>& allocator = nullptr, Stream stream = nullptr);
  // Wraps memory owned elsewhere; `keep_alive` (may be null) is held as long as the tensor.
  static Tensor wrap(TensorView view, std::shared_ptr<void> keep_alive);

  bool defined() const { return view_.defined(); }
  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: a Tensor is usable wherever a view is
  void* data() const { return view_.data; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(view_.data);
  }
  DType dtype() const { return view_.dtype; }
  Device device() const { return view_.device; }
  int ndim() const { return view_.ndim; }
  int64_t size(int dim) const { return view_.shape[dim]; }
  int64_t numel() const { return view_.numel(); }
  size_t nbytes() const { return view_.nbytes(); }
  std::vector<int64_t> sizes() const { return view_.sizes(); }

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

// ---- validation helpers (throw Error(kInvalidArgument) naming `name`) ----------------------------
// shape entries < 0 are wildcards. Requires a defined, contiguous view with dims >= 0 whose element count
// and byte size fit in int64.
void check_tensor(const TensorView& t, const char* name, DType dtype, std::initializer_list<int64_t> shape);
void check_tensor(const TensorView& t, const char* name, std::initializer_list<DType> dtypes,
                  std::initializer_list<int64_t> shape);
void check_device(const TensorView& t, const char* name, Device device);

}  // namespace epx
