// Backend entry points behind dp_gather / dp_scatter (private).
//
// The public calls validate their arguments, then dispatch on group.backend(). A CUDA implementation
// (NCCL all-gather / all-reduce / reduce-scatter on the group's communicator, plus a slice copy) goes to
// src/dp/gather_cuda.cpp with these signatures and is called from the kCuda case in gather.cpp.
#pragma once

#include "epx/dp.h"

namespace epx::host {
// Defined in src/dp/gather_host.cpp. Arguments already validated on this rank.
void dp_gather_host(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& local,
                    const TensorView& global);
void dp_scatter_host(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& global,
                     const TensorView& local, DpScatterKind kind);
}  // namespace epx::host
