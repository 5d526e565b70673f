// make_cuda_transport: argument checks for every build; the transport itself is in src/eplb/cuda/transport.cpp.
#include "core/check.h"
#include "epx/eplb/relocation.h"
#ifdef EPX_WITH_CUDA
#include "eplb/cuda/transport.h"
#endif

namespace epx::eplb {

std::unique_ptr<WeightTransport> make_cuda_transport(Group& group, size_t staging_bytes) {
  EPX_CHECK_ARG(group.backend() == Backend::kCuda, "make_cuda_transport needs a cuda group, got a {} group",
                to_string(group.backend()));
  EPX_CHECK_ARG(staging_bytes > 0, "staging_bytes must be positive, got 0");
#ifdef EPX_WITH_CUDA
  return make_cuda_transport_impl(group, staging_bytes);
#else
  epx::detail::raise(ErrorCode::kUnsupported, "make_cuda_transport: this build of epx has no CUDA backend");
#endif
}

}  // namespace epx::eplb
