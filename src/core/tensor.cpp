#include "epx/tensor.h"

#include <fmt/format.h>

#include <cstdlib>
#include <new>

#include "core/check.h"
#include "core/cuda/alloc.h"

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

namespace {

// A contiguous view; `name` names the caller in the errors.
TensorView contiguous_view(void* data, DType dtype, const std::vector<int64_t>& shape, Device device,
                           std::string_view name) {
  EPX_CHECK_ARG(shape.size() <= static_cast<size_t>(kMaxDims), "{}: tensors have at most {} dims, got {}", name,
                kMaxDims, shape.size());
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = static_cast<int>(shape.size());
  v.device = device;
  for (int d = 0; d < v.ndim; ++d) v.shape[d] = shape[d];
  detail::checked_nbytes(v, name);
  // NOTE: the byte check bounds every partial product below, unless a dim is 0: then the view has no elements
  // and its other dims may multiply past int64 (found by fuzzing); such a view addresses no memory, so the
  // strides past the overflow are 0.
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.strides[d] = stride;
    if (__builtin_mul_overflow(stride, shape[d], &stride)) stride = 0;
  }
  return v;
}

}  // namespace

TensorView TensorView::of(void* data, DType dtype, const std::vector<int64_t>& shape, Device device) {
  return contiguous_view(data, dtype, shape, device, "tensor");
}

TensorView TensorView::of(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  return of(data, dtype, std::vector<int64_t>(shape), device);
}

int64_t TensorView::numel() const { return detail::checked_numel(*this, "tensor"); }

size_t TensorView::nbytes() const { return static_cast<size_t>(detail::checked_nbytes(*this, "tensor")); }

bool TensorView::is_contiguous() const {
  if (ndim > kMaxDims) return false;  // shape[] has kMaxDims entries (reading past them was found by fuzzing)
  // NOTE: a view with no elements addresses no memory, whatever its strides (numpy gives [0, H] arrays
  // strides (0, 0)), so it is contiguous.
  for (int d = 0; d < ndim; ++d) {
    if (shape[d] == 0) return true;
  }
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    if (__builtin_mul_overflow(expected, shape[d], &expected)) return false;  // no memory spans it
  }
  return true;
}

std::string TensorView::describe() const {
  if (!defined()) return "absent";
  if (ndim > kMaxDims) return fmt::format("{}[{} dims] on {}", to_string(dtype), ndim, to_string(device));
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
  t.view_ = contiguous_view(nullptr, dtype, shape, device, "Tensor::empty");
  const int64_t bytes = detail::checked_nbytes(t.view_, "Tensor::empty");
  t.storage_ = (allocator ? allocator : default_allocator())->allocate(static_cast<size_t>(bytes), device, stream);
  EPX_CHECK(ErrorCode::kOutOfMemory, t.storage_ != nullptr || bytes == 0,
            "Tensor::empty: allocating {} bytes for {} failed", bytes, t.view_.describe());
  t.view_.data = t.storage_.get();
  return t;
}

Tensor Tensor::wrap(TensorView view, std::shared_ptr<void> keep_alive) {
  Tensor t;
  t.view_ = view;
  t.storage_ = std::move(keep_alive);
  return t;
}

namespace detail {

int64_t checked_numel(const TensorView& t, std::string_view name) {
  if (t.ndim < 0) return 0;
  EPX_CHECK_ARG(t.ndim <= kMaxDims, "{} has {} dims, more than the limit {}", name, t.ndim, kMaxDims);
  for (int d = 0; d < t.ndim; ++d) {
    EPX_CHECK_ARG(t.shape[d] >= 0, "{} dim {} must be >= 0, got {}", name, d, t.shape[d]);
  }
  int64_t n = 1;
  for (int d = 0; d < t.ndim; ++d) {
    if (__builtin_mul_overflow(n, t.shape[d], &n)) {
      // NOTE: a zero dim makes the product 0 whatever the others are.
      for (int z = 0; z < t.ndim; ++z) {
        if (t.shape[z] == 0) return 0;
      }
      raise(ErrorCode::kInvalidArgument, "{} {} has more than 2^63 - 1 elements", name, t.describe());
    }
  }
  return n;
}

int64_t checked_nbytes(const TensorView& t, std::string_view name) {
  const int64_t n = checked_numel(t, name);
  int64_t bytes = 0;
  if (__builtin_mul_overflow(n, static_cast<int64_t>(dtype_size(t.dtype)), &bytes)) {
    raise(ErrorCode::kInvalidArgument, "{} {}: {} elements * {} bytes overflows int64 (max 2^63 - 1 bytes)", name,
          t.describe(), n, dtype_size(t.dtype));
  }
  return bytes;
}

int64_t checked_span_bytes(const TensorView& t, std::string_view name) {
  if (checked_numel(t, name) == 0) return 0;
  int64_t last = 0;  // element offset of the last element: sum of (shape[d] - 1) * strides[d]
  for (int d = 0; d < t.ndim; ++d) {
    EPX_CHECK_ARG(t.strides[d] >= 0, "{} stride {} must be >= 0, got {} ({})", name, d, t.strides[d], t.describe());
    int64_t step = 0;
    if (__builtin_mul_overflow(t.shape[d] - 1, t.strides[d], &step) || __builtin_add_overflow(last, step, &last)) {
      raise(ErrorCode::kInvalidArgument, "{} {}: stride {} = {} spans more than 2^63 - 1 elements", name,
            t.describe(), d, t.strides[d]);
    }
  }
  int64_t bytes = 0;
  if (__builtin_add_overflow(last, 1, &last) ||
      __builtin_mul_overflow(last, static_cast<int64_t>(dtype_size(t.dtype)), &bytes)) {
    raise(ErrorCode::kInvalidArgument, "{} {}: its strides span more than 2^63 - 1 bytes", name, t.describe());
  }
  return bytes;
}

}  // namespace detail

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
  detail::checked_nbytes(t, name);
  const int64_t numel = detail::checked_numel(t, name);
  EPX_CHECK_ARG(t.is_contiguous(), "{} must be contiguous", name);
  EPX_CHECK_ARG(t.data != nullptr || numel == 0, "{} has a null data pointer", name);
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
