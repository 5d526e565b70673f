// Placeholder until the tbo bindings land (being written in this session).
#include "bind.h"

namespace epx::py {
void register_tbo(nb::module_&) {}
}  // namespace epx::py
