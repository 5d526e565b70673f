#include "core/check.h"
#include "core/limits.h"
#include "ep/backends.h"
#include "ep/validate.h"

namespace epx {

std::unique_ptr<Buffer> Buffer::create(std::shared_ptr<Group> group, const BufferOptions& options) {
  EPX_CHECK_ARG(group != nullptr, "group must not be null");
  // NOTE: only the cuda buffer's creation is collective (the host backend's buffers may be made one after
  // the other by one thread); its options size and lay out memory the peers index, so its constructor
  // starts with ep::agree_on_options.
  if (group->backend() != Backend::kCuda) ep::validate_options(options);
  switch (group->backend()) {
    case Backend::kHost:
      return host::create_host_buffer(std::move(group), options);
    case Backend::kCuda:
#ifdef EPX_WITH_CUDA
      return cuda::create_cuda_buffer(std::move(group), options);
#else
      detail::raise(ErrorCode::kUnsupported, "this epx build has no CUDA backend");
#endif
  }
  detail::raise(ErrorCode::kInternal, "unknown backend {}", static_cast<int>(group->backend()));
}

}  // namespace epx
