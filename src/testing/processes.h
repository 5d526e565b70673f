// Child processes of the GPU tests that run one process per GPU (tests/gpu: multiprocess, hierarchical, relocation).
// POSIX only; headers only (src/testing is not compiled into the library).
#pragma once

#include <sys/types.h>
#include <sys/wait.h>

#include <chrono>
#include <csignal>
#include <thread>
#include <vector>

namespace epx::testing {

// Waits for each child in order until `deadline`; a child still running then is killed with every other one
// (SIGKILL), so a hung rank cannot hang the test. Returns each child's waitpid status, in order (read it with
// WIFEXITED / WEXITSTATUS / WIFSIGNALED).
inline std::vector<int> wait_children(const std::vector<pid_t>& children,
                                      std::chrono::steady_clock::time_point deadline) {
  std::vector<int> statuses(children.size(), 0);
  for (size_t i = 0; i < children.size(); ++i) {
    int status = 0;
    while (waitpid(children[i], &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        for (pid_t p : children) kill(p, SIGKILL);
        waitpid(children[i], &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    statuses[i] = status;
  }
  return statuses;
}

}  // namespace epx::testing
