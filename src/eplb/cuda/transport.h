// The CUDA WeightTransport's constructor, built only with the CUDA backend (src/eplb/cuda/transport.cpp);
// make_cuda_transport (relocation.cpp) checks the arguments and calls it.
#pragma once

#include <memory>

#include "epx/eplb/relocation.h"

namespace epx::eplb {

std::unique_ptr<WeightTransport> make_cuda_transport_impl(Group& group, size_t staging_bytes);

}  // namespace epx::eplb
