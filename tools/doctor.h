#pragma once

#include <nlohmann/json.hpp>

namespace epx::cli {

#ifdef EPX_WITH_CUDA
// GPUs, driver/runtime/NCCL versions, peer access and NVLink between each pair (tools/cuda/doctor.cpp).
nlohmann::json cuda_doctor();
#endif

}  // namespace epx::cli
