#pragma once

namespace epx {

// "0.1.0"
const char* version() noexcept;
// True when this build contains the CUDA backend.
bool built_with_cuda() noexcept;

}  // namespace epx
