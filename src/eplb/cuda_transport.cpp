// make_cuda_transport, make_nccl_transport and the transport choice: argument checks for every build; the
// transports themselves are in src/eplb/cuda/ (CUDA builds only).
#include <string>

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

std::unique_ptr<WeightTransport> make_nccl_transport(Group& group) {
  EPX_CHECK_ARG(group.backend() == Backend::kCuda,
                "make_nccl_transport needs a cuda group of one process per GPU, got a {} group (rank {} of {})",
                to_string(group.backend()), group.rank(), group.num_ranks());
#ifdef EPX_WITH_CUDA
  return make_nccl_transport_impl(group);
#else
  epx::detail::raise(ErrorCode::kUnsupported, "make_nccl_transport: this build of epx has no CUDA backend");
#endif
}

const char* to_string(TransportKind kind) noexcept {
  switch (kind) {
    case TransportKind::kAuto:
      return "auto";
    case TransportKind::kHost:
      return "host";
    case TransportKind::kCuda:
      return "cuda";
    case TransportKind::kNccl:
      return "nccl";
  }
  return "?";
}

TransportKind transport_kind_from_string(const std::string& name) {
  if (name == "auto") return TransportKind::kAuto;
  if (name == "host") return TransportKind::kHost;
  if (name == "cuda") return TransportKind::kCuda;
  if (name == "nccl") return TransportKind::kNccl;
  epx::detail::raise(ErrorCode::kInvalidArgument, "transport must be 'auto', 'host', 'cuda' or 'nccl', got '{}'", name);
}

TransportKind choose_transport(Group& group) {
  if (group.backend() != Backend::kCuda) return TransportKind::kHost;
#ifdef EPX_WITH_CUDA
  return choose_cuda_transport(group);
#else
  epx::detail::raise(ErrorCode::kUnsupported, "choose_transport: this build of epx has no CUDA backend");
#endif
}

std::unique_ptr<WeightTransport> make_transport_for(Group& group, TransportKind kind, size_t staging_bytes) {
  const TransportKind chosen = kind == TransportKind::kAuto ? choose_transport(group) : kind;
  switch (chosen) {
    case TransportKind::kHost:
      EPX_CHECK_ARG(group.backend() != Backend::kCuda,
                    "transport 'host' needs a host group, got a cuda group: use 'auto', 'cuda' or 'nccl'");
      return make_host_transport(group);
    case TransportKind::kCuda:
      return make_cuda_transport(group, staging_bytes);
    case TransportKind::kNccl:
      return make_nccl_transport(group);
    case TransportKind::kAuto:
      break;
  }
  epx::detail::raise(ErrorCode::kInternal, "make_transport_for: no transport for kind {}", static_cast<int>(chosen));
}

}  // namespace epx::eplb
