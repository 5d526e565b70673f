// Private helpers for argument checks: throw epx::Error with a formatted message.
#pragma once

#include <fmt/format.h>

#include "epx/error.h"

namespace epx::detail {

template <typename... Args>
[[noreturn]] void raise(ErrorCode code, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(code, fmt::format(format, std::forward<Args>(args)...));
}

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
