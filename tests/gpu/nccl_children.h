// One process per GPU on an NCCL group, for the GPU tests that run a case on NCCL groups (tests/gpu:
// hierarchical_test.cpp's HierarchicalNccl.*, hierarchical_low_latency_test.cpp's HierarchicalLowLatencyNccl.*,
// relocation_test.cpp's NcclRelocation.*).
// The parent test re-executes its own binary once per rank (a fork of a process that already used CUDA cannot use
// it) with a gtest filter that selects one child test, and hands each child its rank through environment variables
// named `<prefix>_RANK`, `<prefix>_RANKS`, `<prefix>_SEED` and `<prefix>_ID_FILE`; a child test skips when they are
// not set (a plain run of the binary). Rank 0 draws the NCCL id and writes it to the id file, the others read it.
// Headers only; POSIX only.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "epx/cuda.h"
#include "testing/gpu_util.h"
#include "testing/processes.h"

namespace epx::testing {

// What a child process learns from its parent.
struct NcclChild {
  int rank = 0;
  int num_ranks = 0;
  uint64_t seed = 0;
  std::string id_file;
  int device = 0;  // rank % visible GPUs; ranks that share a GPU are hosts of their own to NCCL (rank_process_device)
};

// The child's rank, rank count, seed and id file from `<prefix>_*`, and its GPU; nullopt when `<prefix>_RANK` is not
// set (the binary runs as a parent or plainly). Call it first in a child test: where ranks share a GPU it sets the
// environment NCCL reads (rank_process_device).
inline std::optional<NcclChild> nccl_child(const std::string& prefix) {
  const char* rank = std::getenv((prefix + "_RANK").c_str());
  if (rank == nullptr) return std::nullopt;
  const auto value = [&](const char* name) {
    const char* v = std::getenv((prefix + name).c_str());
    return std::string(v == nullptr ? "" : v);
  };
  NcclChild c;
  c.rank = std::atoi(rank);
  c.num_ranks = std::atoi(value("_RANKS").c_str());
  c.seed = std::strtoull(value("_SEED").c_str(), nullptr, 10);
  c.id_file = value("_ID_FILE");
  print_stack_on_crash(c.rank);
  std::setvbuf(stdout, nullptr, _IONBF, 0);  // gtest's failures reach the log even when the process crashes later
  c.device = rank_process_device(c.rank, c.num_ranks, std::max(1, num_gpus()));
  return c;
}

// The mark a child leaves when its test passed (NcclChildPass), next to the id file.
inline std::string nccl_child_mark(const std::string& id_file, int rank) {
  return id_file + ".passed." + std::to_string(rank);
}

// Declare it first in a child test, so that it is destroyed last (after the test's groups and buffers): marks this
// rank as passed when the test ran to its end with no failure and no skip. The parent requires the mark, since a
// child exits 0 also when it matched no test, was sharded out or skipped.
class NcclChildPass {
 public:
  explicit NcclChildPass(const NcclChild& child) : mark_(nccl_child_mark(child.id_file, child.rank)) {}
  ~NcclChildPass() {
    if (!::testing::Test::HasFailure() && !::testing::Test::IsSkipped()) std::ofstream(mark_) << "passed\n";
  }
  NcclChildPass(const NcclChildPass&) = delete;
  NcclChildPass& operator=(const NcclChildPass&) = delete;

 private:
  std::string mark_;
};

// The NCCL id: rank 0 draws it and writes it to id_file, the others wait for the file (up to 60 s; empty: none came).
inline std::vector<uint8_t> shared_nccl_id(int rank, const std::string& id_file) {
  std::vector<uint8_t> id;
  if (rank == 0) {
    id = nccl_unique_id();
    std::ofstream(id_file + ".tmp", std::ios::binary).write(reinterpret_cast<const char*>(id.data()), id.size());
    std::rename((id_file + ".tmp").c_str(), id_file.c_str());
    return id;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream f(id_file, std::ios::binary);
    if (f) return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return id;
}

// Runs the test `child_suite.child_test` of this binary in num_ranks child processes (rank r on GPU NcclChild::device,
// which the child passes to create_cuda_group; with fewer GPUs than ranks, ranks share them as NCCL hosts of their
// own), with `<env_prefix>_*` set as above and the id file /tmp/<env_prefix in lower case>_nccl_id_<pid>, and expects
// each child to exit 0 within 240 s with its pass mark (NcclChildPass; a child still running then is killed with the
// others, and so is one still running 60 s after another failed). The children get the parent's environment less
// GTEST_* (so that none writes the parent's reports or picks a shard). A child's own output (its gtest failures) goes
// to the parent's stdout.
inline void run_nccl_children(int num_ranks, uint64_t seed, const std::string& child_suite,
                              const std::string& child_test, const std::string& env_prefix) {
  std::string lower = env_prefix;
  for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  const std::string id_file = "/tmp/" + lower + "_nccl_id_" + std::to_string(getpid());
  std::remove(id_file.c_str());
  for (int r = 0; r < num_ranks; ++r) std::remove(nccl_child_mark(id_file, r).c_str());
  std::vector<std::string> gtest_vars;  // NOTE: collected before fork: the child only unsets, sets and execs
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    if (entry.rfind("GTEST_", 0) == 0) gtest_vars.push_back(entry.substr(0, entry.find('=')));
  }
  const std::string filter = "--gtest_filter=" + child_suite + "." + child_test;
  const std::string rank_var = env_prefix + "_RANK", ranks_var = env_prefix + "_RANKS", seed_var = env_prefix + "_SEED",
                    id_var = env_prefix + "_ID_FILE";
  const std::string ranks_value = std::to_string(num_ranks), seed_value = std::to_string(seed);
  const std::string sharing = sharing_note(num_ranks, num_gpus());
  if (!sharing.empty()) std::printf("[ note     ] %s.%s%s\n", child_suite.c_str(), child_test.c_str(), sharing.c_str());
  std::vector<pid_t> children;
  for (int r = 0; r < num_ranks; ++r) {
    const std::string rank_value = std::to_string(r);  // NOTE: built before fork: the child only sets and execs
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      for (const std::string& name : gtest_vars) unsetenv(name.c_str());
      setenv(rank_var.c_str(), rank_value.c_str(), 1);
      setenv(ranks_var.c_str(), ranks_value.c_str(), 1);
      setenv(seed_var.c_str(), seed_value.c_str(), 1);
      setenv(id_var.c_str(), id_file.c_str(), 1);
      execl("/proc/self/exe", child_suite.c_str(), filter.c_str(), nullptr);
      _exit(3);
    }
    children.push_back(pid);
  }
  const std::vector<int> statuses =
      wait_children(children, std::chrono::steady_clock::now() + std::chrono::seconds(240), std::chrono::seconds(60));
  for (int r = 0; r < num_ranks; ++r) {
    const int status = statuses[r];
    const std::string mark = nccl_child_mark(id_file, r);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0 && std::ifstream(mark).good())
        << "rank " << r << " failed, skipped or ran no test (exit " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1)
        << ", signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0) << "; its output is above)";
    std::remove(mark.c_str());
  }
  std::remove(id_file.c_str());
}

}  // namespace epx::testing
