#include "core/check.h"
#include "core/limits.h"
#include "ep/backends.h"

namespace epx {

std::unique_ptr<Buffer> Buffer::create(std::shared_ptr<Group> group, const BufferOptions& options) {
  EPX_CHECK_ARG(group != nullptr, "group must not be null");
  EPX_CHECK_ARG(options.num_normal_bytes >= 0, "num_normal_bytes must be >= 0, got {}", options.num_normal_bytes);
  EPX_CHECK_ARG(options.num_low_latency_bytes >= 0, "num_low_latency_bytes must be >= 0, got {}",
                options.num_low_latency_bytes);
  EPX_CHECK_ARG(options.num_sms >= 1 && options.num_sms <= kMaxNumSms, "num_sms must be in [1, {}], got {}", kMaxNumSms,
                options.num_sms);
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
