// Placeholder until the dp bindings land (being written in this session).
#include "bind.h"

namespace epx::py {
void register_dp(nb::module_&) {}
}  // namespace epx::py
