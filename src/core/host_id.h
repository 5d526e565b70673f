// Which host a rank runs on, so that ranks can tell whether peer memory (CUDA IPC, peer access) can reach each other.
// Host C++ only; the cuda backend's peer mapping and the EPLB transport choice compare these.
#pragma once

#include <functional>
#include <vector>

namespace epx::detail {

// Fixed size and zero-padded, so ranks exchange and compare it as bytes.
struct HostId {
  char text[112] = {};  // "hostname/boot id": two containers or hosts may share a hostname, not a running kernel
};

// This process's host: gethostname(), then the kernel's boot id (/proc/sys/kernel/random/boot_id; empty where it
// cannot be read). The same value on every call.
HostId this_host();

bool same_host(const HostId& a, const HostId& b);

// The lowest rank r with mapped(r) whose host differs from hosts[rank], or -1 when there is none.
int first_peer_on_other_host(const std::vector<HostId>& hosts, int rank, const std::function<bool(int)>& mapped);

}  // namespace epx::detail
