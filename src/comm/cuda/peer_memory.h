// Mapping every rank's device region into this rank's address space (private to the CUDA backend).
#pragma once

#include <vector>

#include "epx/group.h"

namespace epx::cuda {

struct PeerRegions {
  std::vector<char*> ptrs;       // [num_ranks]: each rank's region as seen from this rank's device
  std::vector<bool> ipc_opened;  // [num_ranks]: mapped through CUDA IPC (must be closed)
};

// Collective over `group`. Single-process groups exchange raw pointers and enable peer access between
// the devices; multi-process groups exchange CUDA IPC handles and where each rank runs (core/host_id.h). A device pair
// without peer access is Error(kUnsupported) naming both ranks and devices; so is, on every rank alike, a rank that
// would have to map one on another host (CUDA IPC works within a host only). gpus_per_node > 0: only the ranks of
// this rank's node (rank / gpus_per_node alike) are mapped; the others' entries stay null (the hierarchical
// routings, whose peers on other nodes are reached over the network only).
PeerRegions open_peer_regions(Group& group, bool single_process, void* mine, int device, int gpus_per_node = 0);
// Closes the IPC mappings (not the local region).
void close_peer_regions(PeerRegions& regions);

}  // namespace epx::cuda
