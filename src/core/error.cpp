#include "epx/error.h"

namespace epx {

const char* to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid_argument";
    case ErrorCode::kOutOfMemory:
      return "out_of_memory";
    case ErrorCode::kCudaError:
      return "cuda_error";
    case ErrorCode::kNcclError:
      return "nccl_error";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kPeerFailure:
      return "peer_failure";
    case ErrorCode::kInternal:
      return "internal";
    case ErrorCode::kUnsupported:
      return "unsupported";
  }
  return "unknown";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(std::string("epx ") + to_string(code) + ": " + message), code_(code) {}

}  // namespace epx
