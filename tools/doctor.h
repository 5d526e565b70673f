#pragma once

#include <nlohmann/json.hpp>

namespace epx::cli {

#ifdef EPX_WITH_CUDA
// GPUs, driver/runtime/NCCL versions, peer access and NVLink between each pair (doctor_cuda.cpp).
nlohmann::json cuda_doctor();
#endif

}  // namespace epx::cli
