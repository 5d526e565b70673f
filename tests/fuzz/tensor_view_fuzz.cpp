// Fuzzes TensorView's size checks (include/epx/tensor.h, src/core/check.h) and the Buffer API's argument
// validators (src/ep/validate.h) with views of arbitrary dims, strides, dtypes (valid or not), devices and
// data pointers built from the input bytes.
//
// Oracle: every call either returns, and then what it promised holds (checked here against independent
// 128-bit arithmetic: element counts and byte sizes fit int64, contiguity as defined, every validated view
// has the shape, dtype and device asked for, its elements span no more than 2^63 - 1 bytes), or throws
// epx::Error(kInvalidArgument) with a message; anything else (another exception, a crash, UB, a leak) is a
// finding. The validators read shapes only, so the data pointers point at a small static block.
#include <fmt/format.h>
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/check.h"
#include "ep/validate.h"
#include "epx/buffer.h"
#include "epx/error.h"
#include "epx/routing.h"
#include "epx/tensor.h"

namespace epx {
namespace {

using i128 = __int128;

constexpr i128 kInt64Max = INT64_MAX;
constexpr int kNumDTypes = 7;  // DType's enumerators; values past them are invalid dtypes
// The bounds as the Buffer API states them (include/epx/buffer.h, src/ep/validate.h), written out here so
// the oracle does not share the validators' constants.
constexpr int64_t kContractMaxExperts = INT32_MAX;
constexpr int64_t kContractMaxWorstTokens = INT32_MAX;
constexpr int64_t kContractLowLatencyMaxHidden = 16384;
constexpr int64_t kContractLowLatencyMaxTopk = 16;
constexpr int64_t kContractLowLatencyMaxExperts = 1024;

alignas(256) unsigned char g_block[4096];

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "tensor_view_fuzz: invariant broken: %s\n", what.c_str());
  std::abort();
}

#define FUZZ_ASSERT(cond, ...)                          \
  do {                                                  \
    if (!(cond)) ::epx::fail(fmt::format(__VA_ARGS__)); \
  } while (0)

// The input as a stream of choices. Sizes come from a pool of values seen before in this input half the
// time, so that the shapes that must agree between arguments (T, H, K, ...) can.
class Source {
 public:
  Source(const uint8_t* data, size_t size) : in_(data, size) {}

  bool flag() { return in_.ConsumeBool(); }
  template <typename T>
  T in_range(T lo, T hi) {
    return in_.ConsumeIntegralInRange<T>(lo, hi);
  }

  int64_t size() {
    int64_t v = 0;
    switch (in_.ConsumeIntegralInRange<int>(0, 4)) {
      case 0:
        v = in_.ConsumeIntegralInRange<int64_t>(-2, 9);
        break;
      case 1: {  // 2^k + {-1, 0, 1}, k in [0, 63], and its negation
        const int k = in_.ConsumeIntegralInRange<int>(0, 63);
        v = static_cast<int64_t>((uint64_t{1} << k) + static_cast<uint64_t>(in_.ConsumeIntegralInRange<int>(-1, 1)));
        if (in_.ConsumeBool()) v = static_cast<int64_t>(0 - static_cast<uint64_t>(v));
        break;
      }
      case 2:
        v = in_.ConsumeIntegral<int64_t>();
        break;
      default:
        if (!pool_.empty()) return pool_[in_.ConsumeIntegralInRange<size_t>(0, pool_.size() - 1)];
        v = in_.ConsumeIntegralInRange<int64_t>(0, 1024);
        break;
    }
    remember(v);
    return v;
  }
  void remember(int64_t v) {
    if (pool_.size() < 64) pool_.push_back(v);
  }

  DType dtype() { return static_cast<DType>(in_.ConsumeIntegralInRange<int>(0, kNumDTypes + 1)); }

  Device device() {
    if (in_.ConsumeIntegralInRange<int>(0, 3) != 0) return Device::cpu();
    Device d;
    d.kind = static_cast<DeviceKind>(in_.ConsumeIntegralInRange<int>(0, 2));
    d.index = in_.ConsumeIntegralInRange<int>(-1, 2);
    return d;
  }

  // Absent (ndim -1) sometimes; otherwise 0 to 6 dims (5 and 6 are beyond kMaxDims: hand-built views).
  TensorView view() {
    TensorView v;
    v.ndim = in_.ConsumeIntegralInRange<int>(-1, 6);
    if (v.ndim < 0) return v;
    v.data = in_.ConsumeIntegralInRange<int>(0, 7) == 0 ? nullptr : g_block;
    v.dtype = dtype();
    v.device = device();
    for (int d = 0; d < kMaxDims; ++d) v.shape[d] = size();
    // Contiguous strides most of the time, else arbitrary.
    if (in_.ConsumeBool()) {
      int64_t stride = 1;
      for (int d = std::min(v.ndim, kMaxDims) - 1; d >= 0; --d) {
        v.strides[d] = stride;
        if (__builtin_mul_overflow(stride, v.shape[d], &stride)) stride = 1;
      }
    } else {
      for (int d = 0; d < kMaxDims; ++d) v.strides[d] = size();
    }
    return v;
  }

  bool empty() { return in_.remaining_bytes() == 0; }

 private:
  FuzzedDataProvider in_;
  std::vector<int64_t> pool_;
};

// ---- independent references ------------------------------------------------------------------------------

// The element count, or -1 when a view no memory can back: ndim outside [0, kMaxDims], a negative dim, or a
// count or byte size above 2^63 - 1. An absent view has 0 elements.
i128 ref_numel(const TensorView& t) {
  if (t.ndim < 0) return 0;
  if (t.ndim > kMaxDims) return -1;
  bool zero = false;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) return -1;
    zero = zero || t.shape[d] == 0;
  }
  if (zero) return 0;
  i128 n = 1;
  for (int d = 0; d < t.ndim; ++d) {
    n *= t.shape[d];
    if (n > kInt64Max) return -1;
  }
  return n;
}

// Contiguous (row-major): no elements, or every dim of size > 1 has the row-major stride. Only for views
// that memory can back (ref_numel >= 0).
bool ref_contiguous(const TensorView& t) {
  if (ref_numel(t) == 0) return true;
  i128 expected = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] != 1 && t.strides[d] != expected) return false;
    expected *= t.shape[d];
  }
  return true;
}

// Bytes from the lowest to one past the highest element address (any stride signs), 0 without elements.
i128 ref_span_bytes(const TensorView& t) {
  const i128 n = ref_numel(t);
  if (n <= 0) return 0;
  i128 span = 1;
  for (int d = 0; d < t.ndim; ++d) {
    const i128 s = t.strides[d] < 0 ? -static_cast<i128>(t.strides[d]) : static_cast<i128>(t.strides[d]);
    span += (static_cast<i128>(t.shape[d]) - 1) * s;  // < 2^126 per dim
    if (span > kInt64Max) return span;                // before 4 such terms could wrap 128 bits
  }
  return span * static_cast<i128>(dtype_size(t.dtype));
}

template <typename F>
bool throws_invalid_argument(F&& f) {
  try {
    f();
    return false;
  } catch (const Error& e) {
    FUZZ_ASSERT(e.code() == ErrorCode::kInvalidArgument, "expected kInvalidArgument, got {}", e.what());
    FUZZ_ASSERT(std::string(e.what()).size() > std::string("epx invalid_argument: ").size(), "empty message");
    return true;
  }
}

// What check_tensor promises for a view it accepted.
void expect_checked(const TensorView& t, const char* name, std::initializer_list<DType> dtypes,
                    std::initializer_list<int64_t> shape, Device device) {
  FUZZ_ASSERT(t.defined() && t.ndim == static_cast<int>(shape.size()), "{}: ndim {} accepted", name, t.ndim);
  int d = 0;
  for (int64_t s : shape) {
    FUZZ_ASSERT(s < 0 || t.shape[d] == s, "{}: dim {} = {} accepted for {}", name, d, t.shape[d], s);
    ++d;
  }
  bool dtype_ok = false;
  for (DType dt : dtypes) dtype_ok = dtype_ok || t.dtype == dt;
  FUZZ_ASSERT(dtype_ok, "{}: dtype {} accepted", name, static_cast<int>(t.dtype));
  FUZZ_ASSERT(t.device == device, "{}: device {} accepted", name, to_string(t.device));
  const i128 n = ref_numel(t);
  FUZZ_ASSERT(n >= 0 && n * static_cast<i128>(dtype_size(t.dtype)) <= kInt64Max, "{} {}: size accepted", name,
              t.describe());
  FUZZ_ASSERT(ref_contiguous(t), "{} {}: non-contiguous view accepted", name, t.describe());
  FUZZ_ASSERT(t.data != nullptr || n == 0, "{}: null data accepted", name);
}

// ---- the calls --------------------------------------------------------------------------------------------

void fuzz_view_methods(Source& in) {
  const TensorView t = in.view();
  const i128 n = ref_numel(t);
  const bool numel_threw = throws_invalid_argument([&] {
    const int64_t got = t.numel();
    FUZZ_ASSERT(got == n, "numel() = {} for {}", got, t.describe());
  });
  FUZZ_ASSERT(numel_threw == (n < 0), "numel() {} for {}", numel_threw ? "threw" : "returned", t.describe());
  const i128 bytes = n < 0 ? -1 : n * static_cast<i128>(dtype_size(t.dtype));
  const bool nbytes_threw = throws_invalid_argument([&] {
    const size_t got = t.nbytes();
    FUZZ_ASSERT(static_cast<i128>(got) == bytes, "nbytes() = {} for {}", got, t.describe());
  });
  FUZZ_ASSERT(nbytes_threw == (bytes < 0 || bytes > kInt64Max), "nbytes() {} for {}",
              nbytes_threw ? "threw" : "returned", t.describe());
  (void)t.describe();
  const bool contiguous = t.is_contiguous();
  if (n >= 0) FUZZ_ASSERT(contiguous == ref_contiguous(t), "is_contiguous() = {} for {}", contiguous, t.describe());
  FUZZ_ASSERT(t.sizes().size() == static_cast<size_t>(std::clamp(t.ndim, 0, kMaxDims)), "sizes() of {}", t.describe());
  const std::initializer_list<int64_t> shape2 = {in.size() < 0 ? -1 : t.shape[0], -1};
  const DType want = in.dtype();
  const Device device = in.device();
  if (!throws_invalid_argument([&] {
        check_tensor(t, "t", want, shape2);
        check_device(t, "t", device);
      })) {
    expect_checked(t, "t", {want}, shape2, device);
  }
  // A contiguous view from a shape vector (TensorView::of) and, when small, an allocated tensor.
  std::vector<int64_t> dims(static_cast<size_t>(in.in_range<int>(0, 5)));
  for (auto& d : dims) d = in.size();
  const DType dtype = in.dtype();
  TensorView probe;
  probe.ndim = static_cast<int>(dims.size());
  probe.dtype = dtype;
  for (size_t d = 0; d < dims.size() && d < static_cast<size_t>(kMaxDims); ++d) probe.shape[d] = dims[d];
  const i128 of_numel = ref_numel(probe);
  const i128 of_bytes = of_numel * static_cast<i128>(dtype_size(dtype));
  const bool of_ok = of_numel >= 0 && of_bytes <= kInt64Max;
  const bool of_threw = throws_invalid_argument([&] {
    const TensorView v = TensorView::of(g_block, dtype, dims);
    FUZZ_ASSERT(v.ndim == static_cast<int>(dims.size()) && v.numel() == of_numel && ref_contiguous(v) &&
                    v.is_contiguous() && static_cast<i128>(v.nbytes()) == of_bytes,
                "TensorView::of gave {}", v.describe());
    if (of_bytes <= 1 << 16) {
      const Tensor owned = Tensor::empty(dtype, dims);
      FUZZ_ASSERT(owned.numel() == of_numel && (owned.data() != nullptr || of_bytes == 0), "Tensor::empty");
    }
  });
  FUZZ_ASSERT(of_threw == !of_ok, "TensorView::of {} for {} dims", of_threw ? "threw" : "returned", dims.size());
}

struct FakeDispatchHandle final : DispatchHandle {
  int64_t tokens = 0;
  Tensor matrix;
  int64_t num_tokens() const override { return tokens; }
  int64_t num_recv_tokens() const override { return 0; }
  const Tensor& rank_prefix_matrix() const override { return matrix; }
};

struct FakeLowLatencyHandle final : LowLatencyHandle {};

// Bytes of one received row as validate.cpp's received_row_bytes defines it, in 128 bits.
i128 ref_row_bytes(const ep::DispatchShape& s, const TensorView& x) {
  return static_cast<i128>(s.hidden) * static_cast<i128>(dtype_size(x.dtype)) + s.scale_bytes +
         static_cast<i128>(s.num_topk) * 12 + 4;
}

void fuzz_dispatch(Source& in) {
  const int num_ranks = in.in_range<int>(1, 1 << 20);
  in.remember(num_ranks);
  const Device device = in.flag() ? Device::cpu() : in.device();
  DispatchArgs a;
  a.x = in.view();
  a.x_scales = in.flag() ? in.view() : TensorView{};
  a.topk_idx = in.flag() ? in.view() : TensorView{};
  a.topk_weights = in.flag() ? in.view() : TensorView{};
  a.num_experts = in.size();
  Layout layout;
  if (in.flag()) {
    layout.num_tokens_per_rank = Tensor::wrap(in.view(), nullptr);
    layout.num_tokens_per_expert = Tensor::wrap(in.view(), nullptr);
    layout.is_token_in_rank = Tensor::wrap(in.view(), nullptr);
    a.layout = &layout;
  }
  if (in.flag()) {
    auto handle = std::make_shared<FakeDispatchHandle>();
    handle->tokens = in.size();
    a.handle = handle;
  }
  a.expert_alignment = in.in_range<int>(-1, 4);
  a.num_worst_tokens = in.size();
  ep::DispatchShape s;
  if (throws_invalid_argument([&] { s = ep::validate_dispatch(a, num_ranks, device); })) return;
  expect_checked(a.x, "x", {DType::kBFloat16, DType::kFloat8E4M3}, {-1, -1}, device);
  FUZZ_ASSERT(s.num_tokens == a.x.shape[0] && s.hidden == a.x.shape[1] && s.hidden >= 1, "shape of {}", a.x.describe());
  FUZZ_ASSERT(s.is_fp8 == (a.x.dtype == DType::kFloat8E4M3), "is_fp8");
  FUZZ_ASSERT(a.num_worst_tokens >= 0 && a.num_worst_tokens <= kContractMaxWorstTokens, "num_worst_tokens {}",
              a.num_worst_tokens);
  FUZZ_ASSERT(a.expert_alignment >= 1, "expert_alignment {}", a.expert_alignment);
  if (s.is_fp8) {
    const TensorView& sc = a.x_scales;
    FUZZ_ASSERT(s.hidden % kFp8BlockSize == 0 && sc.ndim == 2 && sc.shape[0] == s.num_tokens, "x_scales {}",
                sc.describe());
    FUZZ_ASSERT(sc.dtype == DType::kFloat32 || sc.dtype == DType::kUInt8 || sc.dtype == DType::kInt32, "x_scales {}",
                sc.describe());
    FUZZ_ASSERT(sc.device == device && (sc.data != nullptr || ref_numel(sc) == 0), "x_scales {}", sc.describe());
    // NOTE: any strides, but the kernels index t * strides[0] + j * strides[1]: that must not wrap.
    FUZZ_ASSERT(ref_span_bytes(sc) <= kInt64Max, "x_scales {} with strides [{}, {}] spans more than 2^63 - 1 bytes",
                sc.describe(), sc.strides[0], sc.strides[1]);
    FUZZ_ASSERT(s.scale_bytes == sc.shape[1] * static_cast<int64_t>(dtype_size(sc.dtype)), "scale_bytes");
  } else {
    FUZZ_ASSERT(!a.x_scales.defined() && s.scale_bytes == 0, "x_scales with bf16 x");
  }
  const i128 rows = a.num_worst_tokens > 0 ? a.num_worst_tokens : 1;
  FUZZ_ASSERT(ref_row_bytes(s, a.x) * rows <= kInt64Max, "num_worst_tokens {} x row bytes wraps", a.num_worst_tokens);
  if (s.is_cached) {
    FUZZ_ASSERT(a.handle->num_tokens() == s.num_tokens && !a.topk_idx.defined() && !a.topk_weights.defined() &&
                    a.layout == nullptr,
                "cached mode");
    return;
  }
  FUZZ_ASSERT(a.num_experts >= 1 && a.num_experts <= kContractMaxExperts && a.num_experts % num_ranks == 0,
              "num_experts {} with {} ranks", a.num_experts, num_ranks);
  expect_checked(a.topk_idx, "topk_idx", {DType::kInt64, DType::kInt32}, {s.num_tokens, -1}, device);
  FUZZ_ASSERT(s.num_topk == a.topk_idx.shape[1] && s.num_topk >= 1, "num_topk {}", s.num_topk);
  if (a.topk_weights.defined()) {
    expect_checked(a.topk_weights, "topk_weights", {DType::kFloat32}, {s.num_tokens, s.num_topk}, device);
  }
  if (a.layout != nullptr) {
    expect_checked(layout.num_tokens_per_rank, "num_tokens_per_rank", {DType::kInt32}, {num_ranks}, device);
    expect_checked(layout.num_tokens_per_expert, "num_tokens_per_expert", {DType::kInt32}, {a.num_experts}, device);
    expect_checked(layout.is_token_in_rank, "is_token_in_rank", {DType::kBool}, {s.num_tokens, num_ranks}, device);
  }
}

void fuzz_combine(Source& in) {
  const Device device = in.flag() ? Device::cpu() : in.device();
  const int64_t num_tokens = in.size(), num_rows = in.size();
  if (num_tokens < 0 || num_rows < 0) return;  // a handle's counts
  CombineArgs a;
  if (in.flag()) a.handle = std::make_shared<FakeDispatchHandle>();
  a.x = in.view();
  a.topk_weights = in.flag() ? in.view() : TensorView{};
  a.bias_0 = in.flag() ? in.view() : TensorView{};
  a.bias_1 = in.flag() ? in.view() : TensorView{};
  if (throws_invalid_argument([&] { ep::validate_combine(a, num_tokens, num_rows, device); })) return;
  FUZZ_ASSERT(a.handle != nullptr, "no handle accepted");
  expect_checked(a.x, "x", {DType::kBFloat16}, {num_rows, -1}, device);
  const int64_t hidden = a.x.shape[1];
  FUZZ_ASSERT(hidden >= 1, "hidden {}", hidden);
  if (a.topk_weights.defined())
    expect_checked(a.topk_weights, "topk_weights", {DType::kFloat32}, {num_rows, -1}, device);
  if (a.bias_0.defined()) expect_checked(a.bias_0, "bias_0", {DType::kBFloat16}, {num_tokens, hidden}, device);
  if (a.bias_1.defined()) expect_checked(a.bias_1, "bias_1", {DType::kBFloat16}, {num_tokens, hidden}, device);
}

void fuzz_low_latency(Source& in) {
  const int num_ranks = in.in_range<int>(1, 1 << 20);
  in.remember(num_ranks);
  const Device device = in.flag() ? Device::cpu() : in.device();
  LowLatencyDispatchArgs a;
  a.x = in.view();
  a.topk_idx = in.view();
  a.max_tokens_per_rank = in.size();
  a.num_experts = in.size();
  a.use_fp8 = in.flag();
  a.scale_format = static_cast<ScaleFormat>(in.in_range<int>(0, 2));
  a.cumulative_recv_counts = in.flag() ? in.view() : TensorView{};
  ep::LowLatencyShape s;
  if (throws_invalid_argument([&] { s = ep::validate_low_latency_dispatch(a, num_ranks, device); })) return;
  const int64_t m = a.max_tokens_per_rank;
  FUZZ_ASSERT(m >= 1 && static_cast<i128>(m) * num_ranks < (i128{1} << 31), "max_tokens_per_rank {} x {} ranks", m,
              num_ranks);
  expect_checked(a.x, "x", {DType::kBFloat16}, {-1, -1}, device);
  FUZZ_ASSERT(s.num_tokens == a.x.shape[0] && s.num_tokens <= m, "num_tokens {}", s.num_tokens);
  FUZZ_ASSERT(s.hidden == a.x.shape[1] && s.hidden % kFp8BlockSize == 0 && s.hidden >= kFp8BlockSize &&
                  s.hidden <= kContractLowLatencyMaxHidden,
              "hidden {}", s.hidden);
  expect_checked(a.topk_idx, "topk_idx", {DType::kInt64, DType::kInt32}, {s.num_tokens, -1}, device);
  FUZZ_ASSERT(s.num_topk == a.topk_idx.shape[1] && s.num_topk >= 1 && s.num_topk <= kContractLowLatencyMaxTopk,
              "num_topk {}", s.num_topk);
  FUZZ_ASSERT(a.num_experts >= 1 && a.num_experts <= kContractLowLatencyMaxExperts && a.num_experts % num_ranks == 0 &&
                  s.num_local_experts == a.num_experts / num_ranks,
              "num_experts {}", a.num_experts);
  FUZZ_ASSERT(a.scale_format == ScaleFormat::kFloat32 || a.scale_format == ScaleFormat::kUE8M0, "scale_format");
  if (a.cumulative_recv_counts.defined()) {
    expect_checked(a.cumulative_recv_counts, "cumulative_recv_counts", {DType::kInt32}, {s.num_local_experts}, device);
  }

  // The combine of that dispatch.
  LowLatencyCombineArgs c;
  c.handle = std::make_shared<FakeLowLatencyHandle>();
  in.remember(s.num_local_experts);
  in.remember(num_ranks * m);
  c.x = in.view();
  c.topk_idx = in.flag() ? a.topk_idx : in.view();
  c.topk_weights = in.view();
  c.out = in.flag() ? in.view() : TensorView{};
  if (throws_invalid_argument([&] { ep::validate_low_latency_combine(c, s, m, num_ranks, device); })) return;
  expect_checked(c.x, "x", {DType::kBFloat16}, {s.num_local_experts, num_ranks * m, s.hidden}, device);
  expect_checked(c.topk_idx, "topk_idx", {DType::kInt64, DType::kInt32}, {s.num_tokens, s.num_topk}, device);
  expect_checked(c.topk_weights, "topk_weights", {DType::kFloat32}, {s.num_tokens, s.num_topk}, device);
  if (c.out.defined()) expect_checked(c.out, "out", {DType::kBFloat16}, {s.num_tokens, s.hidden}, device);
}

void fuzz_layout(Source& in) {
  const int num_ranks = in.in_range<int>(-1, 64);
  const int64_t num_experts = in.size();
  TensorView topk_idx = in.view();
  if (throws_invalid_argument([&] { ep::validate_layout_args(topk_idx, num_experts, num_ranks, Device::cpu()); })) {
    return;
  }
  expect_checked(topk_idx, "topk_idx", {DType::kInt64, DType::kInt32}, {-1, -1}, Device::cpu());
  FUZZ_ASSERT(topk_idx.shape[1] >= 1 && num_ranks >= 1 && num_experts >= 1 && num_experts % num_ranks == 0,
              "layout args");
  // The host layout reads the entries: back the view with bytes of the input when they fit the block, and
  // keep the outputs small.
  const i128 bytes = ref_numel(topk_idx) * static_cast<i128>(dtype_size(topk_idx.dtype));
  if (bytes > static_cast<i128>(sizeof g_block) || num_experts > 4096 ||
      static_cast<i128>(topk_idx.shape[0]) * num_ranks > (1 << 16)) {
    return;
  }
  for (i128 b = 0; b < bytes; ++b)
    g_block[static_cast<size_t>(b)] = static_cast<unsigned char>(in.in_range<int>(0, 255));
  topk_idx.data = g_block;
  HostLayout layout;
  if (throws_invalid_argument([&] { layout = compute_layout_host(topk_idx, num_experts, num_ranks); })) return;
  const int64_t num_tokens = topk_idx.shape[0];
  FUZZ_ASSERT(layout.num_tokens_per_rank.size() == static_cast<size_t>(num_ranks) &&
                  layout.num_tokens_per_expert.size() == static_cast<size_t>(num_experts) &&
                  layout.is_token_in_rank.size() == static_cast<size_t>(num_tokens * num_ranks),
              "layout sizes");
  int64_t pairs = 0;
  for (int32_t c : layout.num_tokens_per_expert) pairs += c;
  int64_t valid = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t k = 0; k < topk_idx.shape[1]; ++k) {
      const int64_t e = topk_at(topk_idx, t, k);
      FUZZ_ASSERT(e >= -1 && e < num_experts, "entry {} accepted", e);
      valid += e >= 0;
    }
  }
  FUZZ_ASSERT(pairs == valid, "num_tokens_per_expert sums to {}, {} entries", pairs, valid);
}

}  // namespace
}  // namespace epx

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  epx::Source in(data, size);
  while (!in.empty()) {
    switch (in.in_range<int>(0, 5)) {
      case 0:
        epx::fuzz_view_methods(in);
        break;
      case 1:
        epx::fuzz_dispatch(in);
        break;
      case 2:
        epx::fuzz_combine(in);
        break;
      case 3:
        epx::fuzz_low_latency(in);
        break;
      case 4:
        epx::fuzz_layout(in);
        break;
      default: {
        const int buffer_num_sms = in.in_range<int>(1, 1024), num_sms = in.in_range<int>(-2, 1100);
        int got = 0;
        if (!epx::throws_invalid_argument([&] { got = epx::ep::resolve_num_sms(num_sms, buffer_num_sms); })) {
          FUZZ_ASSERT(num_sms >= 0 && num_sms <= buffer_num_sms && got == (num_sms == 0 ? buffer_num_sms : num_sms),
                      "resolve_num_sms({}, {}) = {}", num_sms, buffer_num_sms, got);
        }
      }
    }
  }
  return 0;
}
