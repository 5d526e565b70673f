#include "comm/cuda/peer_memory.h"

#include <cuda_runtime.h>

#include <mutex>
#include <set>
#include <utility>

#include "core/check.h"
#include "core/cuda/cuda_util.h"
#include "core/host_id.h"

namespace epx::cuda {
namespace {

// Peer access is per (device, peer) pair and process-wide: enable each pair once, so no call fails
// with cudaErrorPeerAccessAlreadyEnabled (which compute-sanitizer reports as an error).
void enable_peer_access(int device, int peer) {
  static std::mutex mutex;
  static std::set<std::pair<int, int>> enabled;
  std::lock_guard lock(mutex);
  if (!enabled.insert({device, peer}).second) return;
  const cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // enabled outside epx
  } else {
    if (err != cudaSuccess) enabled.erase({device, peer});
    check_cuda(err, "cudaDeviceEnablePeerAccess");
  }
}

}  // namespace

PeerRegions open_peer_regions(Group& group, bool single_process, void* mine, int device, int gpus_per_node) {
  DeviceGuard guard(device);
  const int rank = group.rank();
  const int num_ranks = group.num_ranks();
  PeerRegions out{std::vector<char*>(num_ranks, nullptr), std::vector<bool>(num_ranks, false)};
  const auto mapped = [&](int r) { return gpus_per_node <= 0 || r / gpus_per_node == rank / gpus_per_node; };
  if (single_process) {
    struct Entry {
      void* ptr;
      int device;
    };
    Entry entry{mine, device};
    std::vector<Entry> all(num_ranks);
    group.all_gather_bytes(&entry, all.data(), sizeof(Entry));
    for (int r = 0; r < num_ranks; ++r) {
      if (!mapped(r)) continue;
      out.ptrs[r] = static_cast<char*>(all[r].ptr);
      if (all[r].device == device) continue;
      int can = 0;
      check_cuda(cudaDeviceCanAccessPeer(&can, device, all[r].device), "cudaDeviceCanAccessPeer");
      EPX_CHECK(ErrorCode::kUnsupported, can != 0,
                "cuda:{} (rank {}) has no peer access to cuda:{} (rank {}): the cuda backend needs NVLink or PCIe "
                "peer-to-peer between all GPUs of a group",
                device, rank, all[r].device, r);
      enable_peer_access(device, all[r].device);
    }
    return out;
  }
  struct Entry {
    cudaIpcMemHandle_t handle;
    detail::HostId host;
  };
  Entry entry{};
  check_cuda(cudaIpcGetMemHandle(&entry.handle, mine), "cudaIpcGetMemHandle");
  entry.host = detail::this_host();
  std::vector<Entry> all(num_ranks);
  group.all_gather_bytes(&entry, all.data(), sizeof(Entry));
  // NOTE: decided collectively, so that every rank raises alike instead of some waiting for the others in their next
  // collective: the first (rank, peer) pair, by rank, where the rank would have to map a peer on another host.
  std::vector<detail::HostId> hosts(num_ranks);
  for (int r = 0; r < num_ranks; ++r) hosts[r] = all[r].host;
  const int32_t remote = detail::first_peer_on_other_host(hosts, rank, mapped);
  std::vector<int32_t> remotes(num_ranks);
  group.all_gather_bytes(&remote, remotes.data(), sizeof(int32_t));
  for (int r = 0; r < num_ranks; ++r) {
    if (remotes[r] < 0) continue;
    detail::raise(ErrorCode::kUnsupported,
                  "rank {} (host {}) would map the memory of rank {} (host {}), but peer memory (CUDA IPC) reaches "
                  "only the GPUs of one host: ranks on several hosts need the hierarchical routings with "
                  "gpus_per_node = the ranks of one host (BufferOptions::normal_routing and low_latency_routing, "
                  "docs/internode.md)",
                  r, all[r].host.text, remotes[r], all[remotes[r]].host.text);
  }
  for (int r = 0; r < num_ranks; ++r) {
    if (r == rank) {
      out.ptrs[r] = static_cast<char*>(mine);
      continue;
    }
    if (!mapped(r)) continue;
    void* ptr = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&ptr, all[r].handle, cudaIpcMemLazyEnablePeerAccess);
    if (err == cudaErrorPeerAccessUnsupported || err == cudaErrorInvalidDevice) {
      cudaGetLastError();
      detail::raise(ErrorCode::kUnsupported, "rank {} (cuda:{}) cannot map rank {}'s memory: no peer access ({})", rank,
                    device, r, cudaGetErrorString(err));
    }
    check_cuda(err, "cudaIpcOpenMemHandle");
    out.ptrs[r] = static_cast<char*>(ptr);
    out.ipc_opened[r] = true;
  }
  return out;
}

void close_peer_regions(PeerRegions& regions) {
  for (size_t r = 0; r < regions.ptrs.size(); ++r) {
    if (regions.ipc_opened[r]) cudaIpcCloseMemHandle(regions.ptrs[r]);
    regions.ipc_opened[r] = false;
  }
}

}  // namespace epx::cuda
