#include "epx/tensor.h"

#include <fmt/format.h>

#include <cstdlib>
#include <new>

#include "core/check.h"
#include "core/cuda_alloc.h"

namespace epx {

size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBFloat16:
      return 2;
    case DType::kFloat8E4M3:
      return 1;
    case DType::kFloat32:
      return 4;
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
    case DType::kBool:
      return 1;
    case DType::kUInt8:
      return 1;
  }
  return 0;
}

const char* to_string(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat8E4M3:
      return "fp8_e4m3";
    case DType::kFloat32:
      return "fp32";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kBool:
      return "bool";
    case DType::kUInt8:
      return "uint8";
  }
  return "unknown";
}

std::string to_string(Device device) {
  return device.is_cuda() ? fmt::format("cuda:{}", device.index) : std::string("cpu");
}

TensorView TensorView::of(void* data, DType dtype, const std::vector<int64_t>& shape, Device device) {
  EPX_CHECK_ARG(shape.size() <= static_cast<size_t>(kMaxDims), "tensors have at most {} dims, got {}", kMaxDims,
                shape.size());
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = static_cast<int>(shape.size());
  v.device = device;
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    EPX_CHECK_ARG(shape[d] >= 0, "tensor dim {} must be >= 0, got {}", d, shape[d]);
    v.shape[d] = shape[d];
    v.strides[d] = stride;
    stride *= shape[d];
  }
  return v;
}

TensorView TensorView::of(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  return of(data, dtype, std::vector<int64_t>(shape), device);
}

int64_t TensorView::numel() const {
  if (ndim < 0) return 0;
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  // NOTE: a view with no elements addresses no memory, whatever its strides (numpy gives [0, H] arrays
  // strides (0, 0)), so it is contiguous.
  for (int d = 0; d < ndim; ++d) {
    if (shape[d] == 0) return true;
  }
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::describe() const {
  if (!defined()) return "absent";
  std::string dims;
  for (int d = 0; d < ndim; ++d) dims += fmt::format("{}{}", d ? ", " : "", shape[d]);
  return fmt::format("{}[{}] on {}", to_string(dtype), dims, to_string(device));
}

namespace {

class DefaultAllocator final : public Allocator {
 public:
  std::shared_ptr<void> allocate(size_t bytes, Device device, Stream stream) override {
    if (device.is_cuda()) {
#ifdef EPX_WITH_CUDA
      return detail::cuda_allocate(bytes, device, stream);
#else
      detail::raise(ErrorCode::kUnsupported, "cannot allocate on {}: this epx build has no CUDA backend",
                    to_string(device));
#endif
    }
    void* p = ::operator new (bytes > 0 ? bytes : 1, std::align_val_t{256}, std::nothrow);
    if (p == nullptr) detail::raise(ErrorCode::kOutOfMemory, "host allocation of {} bytes failed", bytes);
    return {p, [](void* q) { ::operator delete (q, std::align_val_t{256}); }};
  }
};

}  // namespace

std::shared_ptr<Allocator> default_allocator() {
  static const auto instance = std::make_shared<DefaultAllocator>();
  return instance;
}

Tensor Tensor::empty(DType dtype, const std::vector<int64_t>& shape, Device device,
                     const std::shared_ptr<Allocator>& allocator, Stream stream) {
  Tensor t;
  t.view_ = TensorView::of(nullptr, dtype, shape, device);
  t.storage_ = (allocator ? allocator : default_allocator())->allocate(t.view_.nbytes(), device, stream);
  t.view_.data = t.storage_.get();
  return t;
}

Tensor Tensor::wrap(TensorView view, std::shared_ptr<void> keep_alive) {
  Tensor t;
  t.view_ = view;
  t.storage_ = std::move(keep_alive);
  return t;
}

namespace {

void check_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> shape) {
  EPX_CHECK_ARG(t.defined(), "{} is required", name);
  EPX_CHECK_ARG(t.ndim == static_cast<int>(shape.size()), "{} must have {} dims, got {}", name, shape.size(),
                t.describe());
  int d = 0;
  for (int64_t expected : shape) {
    EPX_CHECK_ARG(expected < 0 || t.shape[d] == expected, "{} dim {} must be {}, got {}", name, d, expected,
                  t.describe());
    ++d;
  }
  EPX_CHECK_ARG(t.is_contiguous(), "{} must be contiguous", name);
  EPX_CHECK_ARG(t.data != nullptr || t.numel() == 0, "{} has a null data pointer", name);
}

}  // namespace

void check_tensor(const TensorView& t, const char* name, DType dtype, std::initializer_list<int64_t> shape) {
  check_shape(t, name, shape);
  EPX_CHECK_ARG(t.dtype == dtype, "{} must be {}, got {}", name, to_string(dtype), t.describe());
}

void check_tensor(const TensorView& t, const char* name, std::initializer_list<DType> dtypes,
                  std::initializer_list<int64_t> shape) {
  check_shape(t, name, shape);
  bool ok = false;
  std::string names;
  for (DType d : dtypes) {
    ok = ok || t.dtype == d;
    names += fmt::format("{}{}", names.empty() ? "" : " or ", to_string(d));
  }
  EPX_CHECK_ARG(ok, "{} must be {}, got {}", name, names, t.describe());
}

void check_device(const TensorView& t, const char* name, Device device) {
  EPX_CHECK_ARG(t.device == device, "{} must be on {}, got {}", name, to_string(device), t.describe());
}

}  // namespace epx
