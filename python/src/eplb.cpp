// Placeholder until the eplb bindings land (being written in this session).
#include "bind.h"

namespace epx::py {
void register_eplb(nb::module_&) {}
}  // namespace epx::py
