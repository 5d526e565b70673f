// Child processes of the GPU tests that run one process per GPU (tests/gpu: multiprocess, hierarchical, relocation).
// POSIX only; headers only (src/testing is not compiled into the library).
#pragma once

#include <sys/types.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace epx::testing {

// Waits for the children until `deadline`; a child still running then is killed with every other one (SIGKILL), so a
// hung rank cannot hang the caller. Once a child ended with a failure (a nonzero exit or a signal), the others get
// `grace` more at most (a rank whose peer died usually waits for it until its own timeout). Returns each child's
// waitpid status, in order (read it with WIFEXITED / WEXITSTATUS / WIFSIGNALED).
inline std::vector<int> wait_children(const std::vector<pid_t>& children,
                                      std::chrono::steady_clock::time_point deadline,
                                      std::chrono::steady_clock::duration grace = std::chrono::hours(24)) {
  std::vector<int> statuses(children.size(), 0);
  std::vector<bool> done(children.size(), false);
  size_t left = children.size();
  while (left > 0) {
    for (size_t i = 0; i < children.size(); ++i) {
      int status = 0;
      if (done[i] || waitpid(children[i], &status, WNOHANG) == 0) continue;
      done[i] = true;
      statuses[i] = status;
      --left;
      const bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
      if (failed) deadline = std::min(deadline, std::chrono::steady_clock::now() + grace);
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      for (size_t i = 0; i < children.size(); ++i) {
        if (done[i]) continue;
        kill(children[i], SIGKILL);
        waitpid(children[i], &statuses[i], 0);
        done[i] = true;
      }
      left = 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return statuses;
}

// The GPU of rank `rank` of `num_ranks` when each rank is a process of its own: rank % num_gpus (num_gpus >= 1).
// Where ranks share a GPU (fewer GPUs than ranks), NCCL would refuse two ranks of one communicator on one GPU of one
// host ("duplicate GPU"); so each rank then presents itself to NCCL as a host of its own (NCCL_HOSTID), and NCCL
// connects the ranks over its network transport, the socket transport over loopback (NCCL_SOCKET_IFNAME=lo and no
// InfiniBand, unless the environment says otherwise): two nodes of one GPU each, on one GPU. epx still sees one host
// (its host id is the hostname and the kernel's boot id, core/host_id.h), so peer memory within a node still maps
// through CUDA IPC. Call it in the rank's process before NCCL initializes there.
inline int rank_process_device(int rank, int num_ranks, int num_gpus) {
  if (num_gpus < num_ranks) {
    setenv("NCCL_HOSTID", ("epx-test-host-of-rank-" + std::to_string(rank)).c_str(), 1);
    setenv("NCCL_SOCKET_IFNAME", "lo", 0);
    setenv("NCCL_IB_DISABLE", "1", 0);
  }
  return rank % num_gpus;
}

// ", ranks share N GPU(s) ..." where rank_process_device makes ranks share GPUs, else empty: for a test's trace.
inline std::string sharing_note(int num_ranks, int num_gpus) {
  if (num_gpus >= num_ranks) return "";
  return ", " + std::to_string(num_ranks) + " ranks share " + std::to_string(num_gpus) +
         " GPU(s) as NCCL hosts of their own (sockets over loopback)";
}

}  // namespace epx::testing
