// Sizes at the limits (issue 13, defect 4): every product of user-given sizes is checked and every bound
// named. Each case below once wrapped around int64 silently (or threw std::length_error) and must now throw
// Error(kInvalidArgument) naming the argument, before any memory is touched.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/timeout.h"
#include "epx/buffer.h"
#include "epx/error.h"
#include "epx/group.h"
#include "epx/tensor.h"
#include "test_util.h"

namespace epx {
namespace {

constexpr int64_t kPow62 = int64_t{1} << 62;

// The code and message of the Error fn throws ("no error" when it returns).
template <typename Fn>
std::pair<ErrorCode, std::string> error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
  return {ErrorCode::kInternal, "no error"};
}

#define EXPECT_INVALID(expr, needle)                                                                   \
  do {                                                                                                 \
    const auto [code, message] = error_of([&] { (void)(expr); });                                      \
    EXPECT_EQ(code, ErrorCode::kInvalidArgument) << message;                                           \
    EXPECT_NE(message.find(needle), std::string::npos) << "want '" << (needle) << "' in: " << message; \
  } while (0)

TEST(SizeLimits, CheckedArithmetic) {
  EXPECT_EQ(detail::checked_mul(int64_t{1} << 31, int64_t{1} << 31, "a * b"), int64_t{1} << 62);
  EXPECT_EQ(detail::checked_add(INT64_MAX - 1, 1, "a + b"), INT64_MAX);
  EXPECT_INVALID(detail::checked_mul(kPow62, 4, "num_ranks * max_tokens_per_rank"),
                 "num_ranks * max_tokens_per_rank = 4611686018427387904 * 4 overflows int64");
  EXPECT_INVALID(detail::checked_add(INT64_MAX, 1, "rows + 1"), "rows + 1 =");
}

// Defect 5: "wait forever" (INT64_MAX) is clamped to kMaxTimeoutMs when a CUDA group or the DP communicator
// is made (src/comm/cuda/cuda_group.cpp, src/dp/cuda/comm.cpp use these helpers); the clamped budget converts
// to nanoseconds and a steady-clock deadline without overflow, an unclamped one throws instead of wrapping.
TEST(SizeLimits, TimeoutClampAndConversions) {
  EXPECT_EQ(kMaxTimeoutMs, int64_t{3'153'600'000'000});
  EXPECT_EQ(detail::clamp_timeout_ms(INT64_MAX), kMaxTimeoutMs);
  EXPECT_EQ(detail::clamp_timeout_ms(60'000), 60'000);
  EXPECT_EQ(detail::timeout_ns(kMaxTimeoutMs), int64_t{3'153'600'000'000} * 1'000'000);
  const auto now = std::chrono::steady_clock::now();
  EXPECT_GT(detail::deadline_after_ms(kMaxTimeoutMs), now + std::chrono::hours(24 * 365 * 99));
  EXPECT_GE(detail::deadline_after_ms(1), now + std::chrono::milliseconds(1));
  EXPECT_INVALID(detail::timeout_ns(INT64_MAX), "timeout_ms");
  EXPECT_INVALID(detail::deadline_after_ms(INT64_MAX), "timeout_ms");
}

// detail::poll_until, the bounded wait that replaces the CUDA backend's unbounded synchronizes (the hierarchical
// exchange's event, a fresh dispatch's stream), on fake queries: done at once, done after a few polls, never done
// (false after the deadline, not much later), done only by the last poll after the deadline, and a query that
// throws.
TEST(SizeLimits, PollUntilIsBounded) {
  using Clock = std::chrono::steady_clock;
  int calls = 0;
  EXPECT_TRUE(detail::poll_until(Clock::now() + std::chrono::seconds(10), [&] { return ++calls >= 1; }));
  EXPECT_EQ(calls, 1);
  calls = 0;
  EXPECT_TRUE(detail::poll_until(Clock::now() + std::chrono::seconds(10), [&] { return ++calls >= 3; }));
  EXPECT_EQ(calls, 3);

  calls = 0;
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::milliseconds(50);
  EXPECT_FALSE(detail::poll_until(deadline, [&] {
    ++calls;
    return false;
  }));
  const auto waited = Clock::now() - start;
  EXPECT_GE(waited, std::chrono::milliseconds(50));
  EXPECT_LT(waited, std::chrono::seconds(5));
  EXPECT_GE(calls, 2);

  // Work that finished while the poller slept past the deadline counts as finished.
  const auto finish = Clock::now() + std::chrono::milliseconds(5);
  EXPECT_TRUE(detail::poll_until(
      finish, [&] { return Clock::now() > finish; }, std::chrono::milliseconds(20)));

  const auto [code, message] = error_of([&] {
    detail::poll_until(Clock::now() + std::chrono::seconds(10),
                       []() -> bool { throw Error(ErrorCode::kCudaError, "query failed"); });
  });
  EXPECT_EQ(code, ErrorCode::kCudaError) << message;
}

TEST(SizeLimits, TensorEmptyRejectsOverflowingBytes) {
  // 2^62 * 8 elements * 8 bytes wrapped to a 0-byte tensor.
  EXPECT_INVALID(Tensor::empty(DType::kInt64, {kPow62, 8}), "Tensor::empty");
  // 2^61 int64 elements fit in int64, their 2^64 bytes do not.
  EXPECT_INVALID(Tensor::empty(DType::kInt64, {int64_t{1} << 61}), "bytes");
  // A zero dim makes any other dim harmless.
  const Tensor none = Tensor::empty(DType::kInt64, {kPow62, 0});
  EXPECT_EQ(none.numel(), 0);
  EXPECT_EQ(none.nbytes(), 0u);
}

TEST(SizeLimits, HandBuiltViewsAreCheckedByName) {
  std::vector<uint16_t> buf(16);
  TensorView negative = TensorView::of(buf.data(), DType::kBFloat16, {4, 4});
  negative.shape[0] = -4;  // strides stay {4, 1}: contiguous by the old test
  EXPECT_INVALID(check_tensor(negative, "x", DType::kBFloat16, {-1, 4}), "x dim 0 must be >= 0, got -4");
  EXPECT_INVALID(negative.numel(), "dim 0 must be >= 0");

  TensorView huge = TensorView::of(buf.data(), DType::kBFloat16, {4, 4});
  huge.shape[0] = huge.shape[1] = int64_t{1} << 32;  // 2^64 elements wrapped to 0
  huge.strides[0] = int64_t{1} << 32;
  EXPECT_INVALID(check_tensor(huge, "topk_weights", DType::kBFloat16, {-1, -1}), "topk_weights");
  EXPECT_INVALID(huge.numel(), "more than 2^63 - 1 elements");

  TensorView many_bytes = TensorView::of(buf.data(), DType::kInt64, {1});
  many_bytes.shape[0] = int64_t{1} << 61;  // 2^61 elements, 2^64 bytes
  EXPECT_INVALID(check_tensor(many_bytes, "topk_idx", DType::kInt64, {-1}), "topk_idx");
  EXPECT_INVALID(many_bytes.nbytes(), "overflows int64");

  TensorView too_many_dims = TensorView::of(buf.data(), DType::kBFloat16, {4, 4});
  too_many_dims.ndim = 7;
  EXPECT_INVALID(check_tensor(too_many_dims, "x", DType::kBFloat16, {-1, -1}), "x");
  EXPECT_INVALID(too_many_dims.numel(), "more than the limit 4");

  EXPECT_INVALID(TensorView::of(buf.data(), DType::kFloat32, {kPow62, 4}), "more than 2^63 - 1 elements");
}

TEST(SizeLimits, SizeHintsThrowInsteadOfWrapping) {
  // Used to return a wrapped 362 MB.
  EXPECT_INVALID(normal_buffer_size_hint(7168, 8, 24, int64_t{1} << 51), "max_tokens_per_rank");
  EXPECT_INVALID(normal_buffer_size_hint(int64_t{1} << 62, 8, 24), "hidden");
  EXPECT_INVALID(normal_buffer_size_hint(7168, 1 << 20, 1 << 30), "num_ranks");
  // Large but representable: no wrap, and more tokens never mean fewer bytes.
  EXPECT_GT(normal_buffer_size_hint(7168, 8, 24, int64_t{1} << 40), normal_buffer_size_hint(7168, 8, 24, 1 << 20));
  EXPECT_INVALID(low_latency_buffer_size_hint(int64_t{1} << 40, 16384, 8, 1024), "max_tokens_per_rank");
  EXPECT_INVALID(low_latency_buffer_size_hint(1 << 20, int64_t{1} << 50, 8, 1024), "hidden");
  EXPECT_GT(low_latency_buffer_size_hint(int64_t{1} << 30, 16384, 8, 1024),
            low_latency_buffer_size_hint(128, 16384, 8, 1024));
}

TEST(SizeLimits, LowLatencySlotCountOverflow) {
  // 4 ranks * 2^62 tokens = 2^64 slots wrapped to 0 < 2^31: accepted, then an 8-byte write landed in a
  // 1-byte block. Every rank gets the same invalid input, so each must throw on its own.
  auto groups = create_host_groups(4, {.timeout_ms = 5'000});
  run_host_ranks(groups, [&](int rank, Group&) {
    BufferOptions options;
    options.num_low_latency_bytes = 1 << 20;
    auto buffer = Buffer::create(groups[rank], options);
    std::vector<uint16_t> x(2 * 128);
    std::vector<int64_t> topk = {0, 1};
    LowLatencyDispatchArgs args;
    args.x = TensorView::of(x.data(), DType::kBFloat16, {2, 128});
    args.topk_idx = TensorView::of(topk.data(), DType::kInt64, {2, 1});
    args.max_tokens_per_rank = kPow62;
    args.num_experts = 4;
    EXPECT_INVALID(buffer->low_latency_dispatch(args), "num_ranks * max_tokens_per_rank");
  });
}

TEST(SizeLimits, NormalDispatchBoundsAndViews) {
  auto groups = create_host_groups(1, {.timeout_ms = 5'000});
  auto buffer = Buffer::create(groups[0]);
  std::vector<uint16_t> x(2 * 128);
  std::vector<int64_t> topk = {0, 1};
  DispatchArgs args;
  args.x = TensorView::of(x.data(), DType::kBFloat16, {2, 128});
  args.topk_idx = TensorView::of(topk.data(), DType::kInt64, {2, 1});
  args.num_experts = 2;
  // Used to return a [2^62, 128] tensor backed by a wrapped allocation.
  args.num_worst_tokens = kPow62;
  EXPECT_INVALID(buffer->dispatch(args), "num_worst_tokens");
  args.num_worst_tokens = int64_t{1} << 31;
  EXPECT_INVALID(buffer->dispatch(args), "2^31 - 1");
  args.num_worst_tokens = 0;

  // A hand-built x with a negative dimension used to pass validation and throw std::length_error.
  DispatchArgs bad = args;
  bad.x.shape[0] = -2;
  EXPECT_INVALID(buffer->dispatch(bad), "x dim 0 must be >= 0");

  // fp8 x with strided scales: a negative stride or one whose span wraps int64 used to be indexed as given.
  std::vector<uint8_t> x8(2 * 128);
  std::vector<float> scales(2);
  DispatchArgs fp8 = args;
  fp8.x = TensorView::of(x8.data(), DType::kFloat8E4M3, {2, 128});
  fp8.x_scales = TensorView::of(scales.data(), DType::kFloat32, {2, 1});
  fp8.x_scales.strides[0] = -1;
  EXPECT_INVALID(buffer->dispatch(fp8), "x_scales stride 0 must be >= 0, got -1");
  fp8.x_scales.strides[0] = kPow62;
  EXPECT_INVALID(buffer->dispatch(fp8), "x_scales");
  EXPECT_INVALID(detail::checked_span_bytes(fp8.x_scales, "x_scales"), "strides span more than 2^63 - 1 bytes");
  fp8.x_scales.strides[0] = int64_t{1} << 40;  // 2^40 + 1 elements: fits int64, bytes too
  EXPECT_EQ(detail::checked_span_bytes(fp8.x_scales, "x_scales"), ((int64_t{1} << 40) + 1) * 4);
  fp8.x_scales.strides[0] = 1;  // column-major [2, 1] is also contiguous
  EXPECT_EQ(buffer->dispatch(fp8).recv_x.size(0), 2);

  // Valid input still works after the rejections.
  args.num_worst_tokens = 8;
  const DispatchResult result = buffer->dispatch(args);
  EXPECT_EQ(result.recv_x.size(0), 8);
}

}  // namespace
}  // namespace epx
