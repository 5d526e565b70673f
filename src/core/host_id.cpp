#include "core/host_id.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace epx::detail {

HostId this_host() {
  char name[64] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) name[0] = '?';
  char boot[40] = {};
  if (std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    if (std::fgets(boot, sizeof(boot), f) == nullptr) boot[0] = '\0';
    std::fclose(f);
  }
  boot[std::strcspn(boot, "\n")] = '\0';
  HostId id;
  std::snprintf(id.text, sizeof(id.text), "%s/%s", name, boot);
  return id;
}

bool same_host(const HostId& a, const HostId& b) { return std::memcmp(a.text, b.text, sizeof(a.text)) == 0; }

int first_peer_on_other_host(const std::vector<HostId>& hosts, int rank, const std::function<bool(int)>& mapped) {
  for (int r = 0; r < static_cast<int>(hosts.size()); ++r) {
    if (r != rank && mapped(r) && !same_host(hosts[r], hosts[rank])) return r;
  }
  return -1;
}

}  // namespace epx::detail
