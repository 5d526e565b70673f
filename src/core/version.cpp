#include "epx/version.h"

namespace epx {

const char* version() noexcept { return EPX_VERSION_STRING; }

bool built_with_cuda() noexcept {
#ifdef EPX_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace epx
