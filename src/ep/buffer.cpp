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
      // NOTE: checked before the cuda buffer's collective creation: ranks that pass the same options fail alike
      // here. A rank whose normal_routing differs from its peers' fails alone and they time out in that creation.
      EPX_CHECK(ErrorCode::kUnsupported,
                options.normal_routing == NormalRouting::kFlat ||
                    (options.normal_routing == NormalRouting::kAuto && group->topology().num_nodes == 1),
                "the cuda backend has no hierarchical (multi-node) normal path yet (docs/multi-node.md); got "
                "normal_routing {} on {} nodes",
                static_cast<int>(options.normal_routing), group->topology().num_nodes);
#ifdef EPX_WITH_CUDA
      return cuda::create_cuda_buffer(std::move(group), options);
#else
      detail::raise(ErrorCode::kUnsupported, "this epx build has no CUDA backend");
#endif
  }
  detail::raise(ErrorCode::kInternal, "unknown backend {}", static_cast<int>(group->backend()));
}

}  // namespace epx
