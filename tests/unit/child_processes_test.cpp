// The process helpers of the one-process-per-rank GPU tests and `epx bench --processes` (src/testing/processes.h):
// wait_children's bounds (the deadline, the grace after a failed child) and rank_process_device's environment.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "testing/processes.h"

namespace epx::testing {
namespace {

using Clock = std::chrono::steady_clock;

// A child that sleeps `ms`, then exits with `code`.
pid_t child(int ms, int code) {
  const pid_t pid = fork();
  if (pid == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    _exit(code);
  }
  return pid;
}

TEST(WaitChildren, ReturnsEveryStatusInOrder) {
  const std::vector<pid_t> kids = {child(150, 3), child(10, 0)};
  const std::vector<int> st = wait_children(kids, Clock::now() + std::chrono::seconds(20));
  ASSERT_EQ(st.size(), 2u);
  EXPECT_TRUE(WIFEXITED(st[0]) && WEXITSTATUS(st[0]) == 3);
  EXPECT_TRUE(WIFEXITED(st[1]) && WEXITSTATUS(st[1]) == 0);
}

TEST(WaitChildren, KillsWhatOutlivesTheDeadline) {
  const auto start = Clock::now();
  const std::vector<pid_t> kids = {child(60'000, 0), child(10, 0)};
  const std::vector<int> st = wait_children(kids, start + std::chrono::milliseconds(300));
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  EXPECT_TRUE(WIFSIGNALED(st[0]) && WTERMSIG(st[0]) == SIGKILL);
  EXPECT_TRUE(WIFEXITED(st[1]) && WEXITSTATUS(st[1]) == 0);
}

TEST(WaitChildren, AFailedChildLeavesTheOthersOnlyTheGrace) {
  // The second child fails at once; the first would run for a minute (a rank waiting for its dead peer): it is
  // killed once the grace (300 ms) passed, long before the deadline.
  const auto start = Clock::now();
  const std::vector<pid_t> kids = {child(60'000, 0), child(10, 1)};
  const std::vector<int> st = wait_children(kids, start + std::chrono::seconds(120), std::chrono::milliseconds(300));
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  EXPECT_TRUE(WIFSIGNALED(st[0]) && WTERMSIG(st[0]) == SIGKILL);
  EXPECT_TRUE(WIFEXITED(st[1]) && WEXITSTATUS(st[1]) == 1);
}

TEST(WaitChildren, ChildrenThatSucceedLeaveTheOthersTheirTime) {
  const std::vector<pid_t> kids = {child(400, 0), child(10, 0)};
  const std::vector<int> st =
      wait_children(kids, Clock::now() + std::chrono::seconds(20), std::chrono::milliseconds(50));
  EXPECT_TRUE(WIFEXITED(st[0]) && WEXITSTATUS(st[0]) == 0);  // not cut short: nobody failed
  EXPECT_TRUE(WIFEXITED(st[1]) && WEXITSTATUS(st[1]) == 0);
}

TEST(RankProcessDevice, SharedGpusMakeEachRankAnNcclHostOfItsOwn) {
  unsetenv("NCCL_HOSTID");
  unsetenv("NCCL_SOCKET_IFNAME");
  setenv("NCCL_IB_DISABLE", "0", 1);  // the caller's choice is kept
  EXPECT_EQ(rank_process_device(3, 4, 2), 1);
  EXPECT_EQ(std::string(std::getenv("NCCL_HOSTID")), "epx-test-host-of-rank-3");
  EXPECT_EQ(std::string(std::getenv("NCCL_SOCKET_IFNAME")), "lo");
  EXPECT_EQ(std::string(std::getenv("NCCL_IB_DISABLE")), "0");
  EXPECT_NE(sharing_note(4, 2).find("4 ranks share 2 GPU(s)"), std::string::npos);
  unsetenv("NCCL_HOSTID");
  EXPECT_EQ(rank_process_device(1, 2, 2), 1);  // a GPU per rank: NCCL's own view stays
  EXPECT_EQ(std::getenv("NCCL_HOSTID"), nullptr);
  EXPECT_EQ(sharing_note(2, 2), "");
  unsetenv("NCCL_SOCKET_IFNAME");
  unsetenv("NCCL_IB_DISABLE");
}

}  // namespace
}  // namespace epx::testing
