#include <cuda_runtime.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <nccl.h>

#include "doctor.h"

namespace epx::cli {
namespace {

// NVML is loaded at run time so the CLI needs no NVML at link time; absent NVML just means no NVLink report.
struct Nvml {
  using Init = int (*)();
  using GetHandle = int (*)(unsigned, void**);
  using LinkState = int (*)(void*, unsigned, int*);
  void* lib = nullptr;
  GetHandle get_handle = nullptr;
  LinkState link_state = nullptr;

  Nvml() {
    lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return;
    auto init = reinterpret_cast<Init>(dlsym(lib, "nvmlInit_v2"));
    get_handle = reinterpret_cast<GetHandle>(dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
    link_state = reinterpret_cast<LinkState>(dlsym(lib, "nvmlDeviceGetNvLinkState"));
    if (init == nullptr || init() != 0) get_handle = nullptr;
  }
  // Active NVLinks of a GPU (NVML index == CUDA index when CUDA_VISIBLE_DEVICES is unset), or -1.
  int active_links(int index) const {
    if (get_handle == nullptr || link_state == nullptr) return -1;
    void* dev = nullptr;
    if (get_handle(static_cast<unsigned>(index), &dev) != 0) return -1;
    int active = 0;
    for (unsigned link = 0; link < 18; ++link) {
      int state = 0;
      if (link_state(dev, link, &state) == 0 && state == 1) ++active;
    }
    return active;
  }
};

}  // namespace

nlohmann::json cuda_doctor() {
  nlohmann::json j;
  int driver = 0, runtime = 0, nccl = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  ncclGetVersion(&nccl);
  j["cuda_driver"] = fmt::format("{}.{}", driver / 1000, (driver % 1000) / 10);
  j["cuda_runtime"] = fmt::format("{}.{}", runtime / 1000, (runtime % 1000) / 10);
  j["nccl"] = fmt::format("{}.{}.{}", nccl / 10000, (nccl % 10000) / 100, nccl % 100);
  // ncclCommRevoke (2.28.7): what lets an NCCL group rebuild its communicator after a timeout (owned_comm.h).
  j["nccl_groups_rebuild_after_failure"] = nccl >= 22807;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    j["gpus"] = nlohmann::json::array();
    j["peer"] = nlohmann::json::array();
    j["error"] = cudaGetErrorString(err);
    return j;
  }
  const Nvml nvml;
  nlohmann::json gpus = nlohmann::json::array();
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, d);
    gpus.push_back({{"index", d},
                    {"name", prop.name},
                    {"compute_capability", fmt::format("{}.{}", prop.major, prop.minor)},
                    {"sms", prop.multiProcessorCount},
                    {"memory_gib", static_cast<double>(prop.totalGlobalMem) / (1u << 30)},
                    {"l2_mib", static_cast<double>(prop.l2CacheSize) / (1u << 20)},
                    {"active_nvlinks", nvml.active_links(d)}});
  }
  j["gpus"] = gpus;
  nlohmann::json pairs = nlohmann::json::array();
  for (int a = 0; a < count; ++a) {
    for (int b = 0; b < count; ++b) {
      if (a == b) continue;
      int access = 0, atomics = 0, rank = 0;
      cudaDeviceGetP2PAttribute(&access, cudaDevP2PAttrAccessSupported, a, b);
      cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, a, b);
      cudaDeviceGetP2PAttribute(&rank, cudaDevP2PAttrPerformanceRank, a, b);
      pairs.push_back({{"from", a},
                       {"to", b},
                       {"peer_access", access == 1},
                       {"native_atomics", atomics == 1},
                       {"performance_rank", rank}});
    }
  }
  j["peer"] = pairs;
  return j;
}

}  // namespace epx::cli
