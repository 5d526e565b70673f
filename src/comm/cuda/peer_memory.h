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
// the devices; multi-process groups exchange CUDA IPC handles. A device pair without peer access is
// Error(kUnsupported) naming both ranks and devices.
PeerRegions open_peer_regions(Group& group, bool single_process, void* mine, int device);
// Closes the IPC mappings (not the local region).
void close_peer_regions(PeerRegions& regions);

}  // namespace epx::cuda
