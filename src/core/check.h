// Private helpers for argument checks: throw epx::Error with a formatted message.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string_view>

#include "epx/error.h"

namespace epx {
struct TensorView;
}

namespace epx::detail {

template <typename... Args>
[[noreturn]] void raise(ErrorCode code, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(code, fmt::format(format, std::forward<Args>(args)...));
}

// ---- checked size arithmetic ---------------------------------------------------------------------
// Every product or sum of user-given sizes goes through these: on overflow of int64 (2^63 - 1) they throw
// Error(kInvalidArgument) naming the quantity, e.g. checked_mul(num_ranks, max_tokens, "num_ranks *
// max_tokens_per_rank") -> "num_ranks * max_tokens_per_rank = 4 * 4611686018427387904 overflows int64 (max
// 2^63 - 1)". Operands are expected to be >= 0 (callers check signs first, naming the argument).
inline constexpr int64_t kMaxSize = INT64_MAX;

inline int64_t checked_mul(int64_t a, int64_t b, std::string_view what) {
  int64_t result = 0;
  if (__builtin_mul_overflow(a, b, &result)) {
    raise(ErrorCode::kInvalidArgument, "{} = {} * {} overflows int64 (max 2^63 - 1)", what, a, b);
  }
  return result;
}

inline int64_t checked_add(int64_t a, int64_t b, std::string_view what) {
  int64_t result = 0;
  if (__builtin_add_overflow(a, b, &result)) {
    raise(ErrorCode::kInvalidArgument, "{} = {} + {} overflows int64 (max 2^63 - 1)", what, a, b);
  }
  return result;
}

// Elements of a view, checked: throws kInvalidArgument naming `name` for ndim outside [0, kMaxDims], a
// negative dimension, or an element count or byte size (numel * dtype_size) above 2^63 - 1. An absent
// view has 0 elements. Defined in src/core/tensor.cpp.
int64_t checked_numel(const TensorView& t, std::string_view name);
// Bytes of a view (numel * dtype_size), with the checks of checked_numel.
int64_t checked_nbytes(const TensorView& t, std::string_view name);
// Bytes from the first to one past the last element of a strided view (0 when it has no elements), with
// the checks of checked_numel; also throws kInvalidArgument for a negative stride or a span above 2^63 - 1.
int64_t checked_span_bytes(const TensorView& t, std::string_view name);

}  // namespace epx::detail

// EPX_CHECK_ARG(n > 0, "num_ranks must be >= 1, got {}", n)
#define EPX_CHECK_ARG(cond, ...)                                                        \
  do {                                                                                  \
    if (!(cond)) ::epx::detail::raise(::epx::ErrorCode::kInvalidArgument, __VA_ARGS__); \
  } while (0)

#define EPX_CHECK(code, cond, ...)                          \
  do {                                                      \
    if (!(cond)) ::epx::detail::raise((code), __VA_ARGS__); \
  } while (0)
