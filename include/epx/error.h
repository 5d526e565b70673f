// epx error model: every public call validates its arguments and throws epx::Error before touching
// memory. The message names the argument and the bound it broke.
#pragma once

#include <stdexcept>
#include <string>

namespace epx {

enum class ErrorCode : int {
  kInvalidArgument = 1,  // bad shape, dtype, range, or inconsistent arguments
  kOutOfMemory = 2,      // host or device allocation failed
  kCudaError = 3,        // a CUDA runtime/driver call failed
  kNcclError = 4,        // an NCCL call failed
  kTimeout = 5,          // a bounded wait expired; the message says who was waited for
  kPeerFailure = 6,      // a peer rank failed or was masked while it was needed
  kInternal = 7,         // a broken invariant inside epx (a bug: please report it)
  kUnsupported = 8,      // the request is valid but this build/backend/machine cannot do it
};

// The code's stable name, e.g. "invalid_argument".
const char* to_string(ErrorCode code) noexcept;

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace epx
