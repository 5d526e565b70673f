// choose_transport for cuda groups: copy engines where every pair of GPUs has peer access, NCCL otherwise.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "comm/cuda/cuda_group.h"
#include "core/check.h"
#include "core/cuda/cuda_util.h"
#include "core/host_id.h"
#include "eplb/cuda/transport.h"

namespace epx::eplb {

namespace {

// What a rank tells the others: where it runs. Fixed size, zero-padded, so ranks compare bytes.
struct Whereabouts {
  detail::HostId host;   // core/host_id.h
  char bus_id[32] = {};  // the GPU's PCI bus id, e.g. "0000:19:00.0"
};

}  // namespace

TransportKind choose_cuda_transport(Group& group) {
  auto* cuda_group = dynamic_cast<cuda::CudaGroup*>(&group);
  EPX_CHECK_ARG(cuda_group != nullptr, "choose_transport needs a group made by epx's cuda backend");
  // Ranks as threads have no communicator: copy engines are their only transport.
  if (cuda_group->single_process()) return TransportKind::kCuda;
  const int device = group.device().index;
  cuda::DeviceGuard guard(device);
  Whereabouts mine;
  mine.host = detail::this_host();
  if (cudaDeviceGetPCIBusId(mine.bus_id, sizeof(mine.bus_id) - 1, device) != cudaSuccess) {
    cudaGetLastError();
    mine.bus_id[0] = '\0';  // unknown: no peer access claimed
  }
  const int R = group.num_ranks();
  std::vector<Whereabouts> all(static_cast<size_t>(R));
  group.all_gather_bytes(&mine, all.data(), sizeof(Whereabouts));
  // This rank's verdict: every peer on this host, its GPU visible here and reachable by peer access.
  uint8_t reachable = mine.bus_id[0] != '\0';
  for (int r = 0; r < R && reachable; ++r) {
    if (r == group.rank()) continue;
    reachable = detail::same_host(all[r].host, mine.host) && all[r].bus_id[0] != '\0';
    int peer = -1, can = 0;
    if (reachable && cudaDeviceGetByPCIBusId(&peer, all[r].bus_id) != cudaSuccess) {
      cudaGetLastError();
      reachable = 0;  // hidden from this process (CUDA_VISIBLE_DEVICES): CUDA IPC cannot map its memory
    }
    if (reachable && peer != device) {
      reachable = cudaDeviceCanAccessPeer(&can, device, peer) == cudaSuccess && can != 0;
      cudaGetLastError();
    }
  }
  std::vector<uint8_t> verdicts(static_cast<size_t>(R));
  group.all_gather_bytes(&reachable, verdicts.data(), 1);
  const bool everywhere = std::all_of(verdicts.begin(), verdicts.end(), [](uint8_t v) { return v != 0; });
  return everywhere ? TransportKind::kCuda : TransportKind::kNccl;
}

}  // namespace epx::eplb
