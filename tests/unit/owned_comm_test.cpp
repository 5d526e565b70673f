// The life of an owned NCCL communicator across failures (src/comm/cuda/owned_comm.h): revoke, rebuild by split,
// and every way that fails for good. NCCL is replaced by a fake table (no GPU, no libnccl): each fake communicator
// reports ncclInProgress for a set number of polls, then its final state, and records what was done to it. The real
// NCCL behaviour behind it (ncclCommRevoke, the rebuild from the spare) is tested on GPUs by
// MultiProcess.LatePeerThenTheGroupRebuildsItsCommunicator (tests/gpu/multiprocess_test.cpp), also over NCCL's
// socket transport (two ranks on one GPU as hosts of their own), where a peer's revoke leaves a remote error.
#include <gtest/gtest.h>

#ifdef EPX_WITH_CUDA
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/cuda/owned_comm.h"
#include "core/timeout.h"

namespace epx::cuda {
namespace {

struct FakeComm {
  int polls_left = 0;  // ncclCommGetAsyncError answers ncclInProgress this many more times; < 0: forever
  ncclResult_t final_state = ncclSuccess;
  int revokes = 0, finalizes = 0, destroys = 0, aborts = 0;
};

// What the fake NCCL does next, and what it saw.
struct FakeNccl {
  std::vector<std::unique_ptr<FakeComm>> comms;
  int revoke_polls = 2;  // polls until a revoked communicator quiesces; < 0: never
  ncclResult_t revoke_returns = ncclInProgress;
  ncclResult_t revoke_final = ncclSuccess;  // the state once quiet (a remote error: a peer's revoke broke connections)
  ncclResult_t split_returns = ncclInProgress;
  bool split_publishes = true;  // writes the child's handle (its creation ended); false: no rank joins
  // The split's outcome: NCCL 2.28 reports it on the parent (ncclInProgress for child_polls polls, then
  // child_final) and writes the child's handle either way, the child reading ncclSuccess; outcome_on_child: on the
  // child instead (the parent reads ncclSuccess).
  int child_polls = 3;
  ncclResult_t child_final = ncclSuccess;
  bool outcome_on_child = false;
  int splits = 0, split_color = -1, split_key = -1;
  ncclConfig_t* split_config = reinterpret_cast<ncclConfig_t*>(1);
};
FakeNccl* g = nullptr;

FakeComm* fake(ncclComm_t c) { return reinterpret_cast<FakeComm*>(c); }
ncclComm_t make_comm(int polls = 0, ncclResult_t final_state = ncclSuccess) {
  g->comms.push_back(std::make_unique<FakeComm>());
  g->comms.back()->polls_left = polls;
  g->comms.back()->final_state = final_state;
  return reinterpret_cast<ncclComm_t>(g->comms.back().get());
}

ncclResult_t fake_async_error(ncclComm_t c, ncclResult_t* state) {
  FakeComm* f = fake(c);
  if (f->polls_left != 0) {
    if (f->polls_left > 0) --f->polls_left;
    *state = ncclInProgress;
  } else {
    *state = f->final_state;
  }
  return ncclSuccess;
}
ncclResult_t fake_revoke(ncclComm_t c, int flags) {
  EXPECT_EQ(flags, 0);
  ++fake(c)->revokes;
  fake(c)->polls_left = g->revoke_polls;
  fake(c)->final_state = g->revoke_final;
  return g->revoke_returns;
}
ncclResult_t fake_split(ncclComm_t c, int color, int key, ncclComm_t* child, ncclConfig_t* config) {
  ++g->splits;
  g->split_color = color;
  g->split_key = key;
  g->split_config = config;
  if (g->split_returns != ncclInProgress && g->split_returns != ncclSuccess) return g->split_returns;
  if (!g->split_publishes) return g->split_returns;
  if (g->outcome_on_child) {
    *child = make_comm(g->child_polls, g->child_final);
  } else {
    fake(c)->polls_left = g->child_polls;
    fake(c)->final_state = g->child_final;
    *child = make_comm(0, ncclSuccess);
  }
  return g->split_returns;
}
ncclResult_t fake_finalize(ncclComm_t c) {
  ++fake(c)->finalizes;
  return ncclSuccess;
}
ncclResult_t fake_destroy(ncclComm_t c) {
  ++fake(c)->destroys;
  return ncclSuccess;
}
ncclResult_t fake_abort(ncclComm_t c) {
  ++fake(c)->aborts;
  return ncclSuccess;
}
const char* fake_error_string(ncclResult_t r) { return r == ncclRemoteError ? "remote error" : "some error"; }

class OwnedCommTest : public ::testing::Test {
 protected:
  void SetUp() override {
    g = &nccl_;
    api_.CommGetAsyncError = fake_async_error;
    api_.CommRevoke = fake_revoke;
    api_.CommSplit = fake_split;
    api_.CommFinalize = fake_finalize;
    api_.CommDestroy = fake_destroy;
    api_.CommAbort = fake_abort;
    api_.GetErrorString = fake_error_string;
    api_.version = 22809;
  }
  void TearDown() override { g = nullptr; }

  static std::chrono::steady_clock::time_point in_ms(int64_t ms) { return detail::deadline_after_ms(ms); }
  // Revokes `owned`, then expects its rebuild to fail for good with an error NCCL reports (not at the deadline).
  static void expect_rebuild_fails(OwnedComm& owned) {
    ASSERT_TRUE(owned.revoke());
    bool timed_out = true;
    EXPECT_EQ(owned.ready(in_ms(1'000), &timed_out), nullptr);
    EXPECT_FALSE(timed_out);
    EXPECT_EQ(owned.state(), OwnedComm::State::kFailed);
  }

  FakeNccl nccl_;
  NcclApi api_;
};

TEST_F(OwnedCommTest, HealthyCommunicatorIsUsedAsIsAndFinalizedAtTheEnd) {
  ncclComm_t comm = make_comm();
  FakeComm* f = fake(comm);
  {
    OwnedComm owned(comm, 3, 1'000, api_);
    EXPECT_EQ(owned.state(), OwnedComm::State::kHealthy);
    EXPECT_EQ(owned.get(), comm);
    bool timed_out = true;
    EXPECT_EQ(owned.ready(in_ms(100), &timed_out), comm);
    EXPECT_FALSE(timed_out);
    EXPECT_EQ(nccl_.splits, 0);
  }
  EXPECT_EQ(f->finalizes, 1);
  EXPECT_EQ(f->destroys, 1);
  EXPECT_EQ(f->aborts, 0);
}

TEST_F(OwnedCommTest, RevokeThenTheNextCallSplitsAFreshCommunicatorOfTheSameRanks) {
  ncclComm_t comm = make_comm();
  FakeComm* parent = fake(comm);
  OwnedComm owned(comm, 3, 1'000, api_);
  EXPECT_TRUE(owned.revoke());
  EXPECT_EQ(parent->revokes, 1);
  EXPECT_EQ(owned.state(), OwnedComm::State::kRevoked);
  EXPECT_EQ(owned.get(), nullptr);
  EXPECT_TRUE(owned.revoke());  // already revoked: no second ncclCommRevoke (NCCL refuses one)
  EXPECT_EQ(parent->revokes, 1);
  EXPECT_EQ(parent->aborts, 0);  // kept until the rebuild, which splits it

  bool timed_out = true;
  ncclComm_t fresh = owned.ready(in_ms(1'000), &timed_out);
  ASSERT_NE(fresh, nullptr);
  EXPECT_NE(fresh, comm);
  EXPECT_FALSE(timed_out);
  EXPECT_EQ(nccl_.splits, 1);
  EXPECT_EQ(nccl_.split_color, 0);
  EXPECT_EQ(nccl_.split_key, 3);           // the rank keeps its number
  EXPECT_EQ(nccl_.split_config, nullptr);  // the parent's configuration: non-blocking
  EXPECT_EQ(parent->aborts, 1);            // the revoked one is freed (abort: no peer is waited for)
  EXPECT_EQ(parent->finalizes, 0);         // NCCL refuses to finalize a revoked communicator
  EXPECT_EQ(owned.state(), OwnedComm::State::kHealthy);
  EXPECT_EQ(owned.get(), fresh);
  EXPECT_EQ(owned.rebuilds(), 1);
  EXPECT_TRUE(owned.failure().empty());

  // A second failure and rebuild.
  EXPECT_TRUE(owned.revoke());
  ncclComm_t third = owned.ready(in_ms(1'000), &timed_out);
  ASSERT_NE(third, nullptr);
  EXPECT_NE(third, fresh);
  EXPECT_EQ(fake(fresh)->aborts, 1);
  EXPECT_EQ(owned.rebuilds(), 2);
}

TEST_F(OwnedCommTest, RevokedCommunicatorIsAbortedNotFinalizedAtTheEnd) {
  ncclComm_t comm = make_comm();
  {
    OwnedComm owned(comm, 0, 1'000, api_);
    ASSERT_TRUE(owned.revoke());
  }
  EXPECT_EQ(fake(comm)->finalizes, 0);
  EXPECT_EQ(fake(comm)->aborts, 1);
}

TEST_F(OwnedCommTest, WithoutNcclCommRevokeTheCommunicatorIsAbortedForGood) {
  api_.CommRevoke = nullptr;  // NCCL older than 2.28.7
  api_.version = 22703;
  ncclComm_t comm = make_comm();
  OwnedComm owned(comm, 1, 1'000, api_);
  EXPECT_FALSE(owned.revoke());
  EXPECT_EQ(owned.state(), OwnedComm::State::kFailed);
  EXPECT_EQ(fake(comm)->aborts, 1);
  EXPECT_NE(owned.failure().find("2.28.7"), std::string::npos) << owned.failure();
  EXPECT_NE(owned.failure().find("22703"), std::string::npos) << owned.failure();
  bool timed_out = true;
  EXPECT_EQ(owned.ready(in_ms(100), &timed_out), nullptr);
  EXPECT_FALSE(timed_out);
  EXPECT_EQ(nccl_.splits, 0);
  EXPECT_FALSE(owned.revoke());  // failed stays failed
}

TEST_F(OwnedCommTest, RevokeThatNcclRejectsAborts) {
  nccl_.revoke_returns = ncclInvalidUsage;
  ncclComm_t comm = make_comm();
  OwnedComm owned(comm, 0, 1'000, api_);
  EXPECT_FALSE(owned.revoke());
  EXPECT_EQ(owned.state(), OwnedComm::State::kFailed);
  EXPECT_EQ(fake(comm)->aborts, 1);
  EXPECT_NE(owned.failure().find("ncclCommRevoke failed"), std::string::npos) << owned.failure();
}

TEST_F(OwnedCommTest, RevokeThatNeverQuiescesAbortsWithinTheTimeout) {
  nccl_.revoke_polls = -1;
  ncclComm_t comm = make_comm();
  OwnedComm owned(comm, 0, 50, api_);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(owned.revoke());
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, std::chrono::milliseconds(50));
  EXPECT_LT(waited, std::chrono::seconds(5));
  EXPECT_EQ(fake(comm)->aborts, 1);
  EXPECT_NE(owned.failure().find("did not quiesce within 50 ms"), std::string::npos) << owned.failure();
}

TEST_F(OwnedCommTest, RebuildThatNoRankJoinsTimesOutAndAbortsForGood) {
  nccl_.split_publishes = false;  // the child's creation never ends: a peer never calls
  ncclComm_t comm = make_comm();
  OwnedComm owned(comm, 0, 1'000, api_);
  ASSERT_TRUE(owned.revoke());
  const auto start = std::chrono::steady_clock::now();
  bool timed_out = false;
  EXPECT_EQ(owned.ready(in_ms(60), &timed_out), nullptr);
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(timed_out);
  EXPECT_GE(waited, std::chrono::milliseconds(60));
  EXPECT_LT(waited, std::chrono::seconds(5));
  EXPECT_EQ(owned.state(), OwnedComm::State::kFailed);
  EXPECT_EQ(fake(comm)->aborts, 1);  // which also aborts the child still being created (NCCL's child abort flag)
  EXPECT_NE(owned.failure().find("did not complete by its deadline"), std::string::npos) << owned.failure();
  EXPECT_EQ(owned.ready(in_ms(60), &timed_out), nullptr);  // no second attempt
  EXPECT_EQ(nccl_.splits, 1);
}

TEST_F(OwnedCommTest, RebuildThatNcclRejectsFailsForGoodWithItsError) {
  nccl_.split_returns = ncclSystemError;
  ncclComm_t comm = make_comm();
  OwnedComm owned(comm, 0, 1'000, api_);
  expect_rebuild_fails(owned);
  EXPECT_EQ(fake(comm)->aborts, 1);
  EXPECT_NE(owned.failure().find("ncclCommSplit failed: some error"), std::string::npos) << owned.failure();
}

// A peer died during the rebuild: NCCL 2.28 still hands out the child's handle (its own state reads success) and
// reports the error on the parent; a later NCCL might report it on the child. Either way: failed for good, both
// aborted, the error named.
TEST_F(OwnedCommTest, ChildThatFailsItsCreationIsAbortedWithTheParent) {
  for (const bool on_child : {false, true}) {
    SCOPED_TRACE(on_child ? "outcome on the child" : "outcome on the parent (NCCL 2.28)");
    nccl_.comms.clear();
    nccl_.child_final = ncclRemoteError;
    nccl_.outcome_on_child = on_child;
    ncclComm_t comm = make_comm();
    OwnedComm owned(comm, 0, 1'000, api_);
    expect_rebuild_fails(owned);
    ASSERT_EQ(nccl_.comms.size(), 2u);
    EXPECT_EQ(nccl_.comms[0]->aborts, 1);
    EXPECT_EQ(nccl_.comms[1]->aborts, 1);
    EXPECT_NE(owned.failure().find("NCCL reports remote error"), std::string::npos) << owned.failure();
  }
}

TEST_F(OwnedCommTest, SplitSameRanksGivesAChildAndLeavesTheParent) {
  ncclComm_t comm = make_comm();
  bool timed_out = true;
  std::string why;
  const ncclComm_t child = split_same_ranks(api_, comm, 5, in_ms(1'000), &timed_out, &why);
  ASSERT_NE(child, nullptr);
  EXPECT_NE(child, comm);
  EXPECT_FALSE(timed_out);
  EXPECT_TRUE(why.empty()) << why;
  EXPECT_EQ(nccl_.split_key, 5);
  EXPECT_EQ(fake(comm)->aborts, 0);
  EXPECT_EQ(fake(child)->aborts, 0);
}

// With a spare (create_cuda_group splits one off at creation): the rebuild promotes it and splits the next spare off
// it, so the revoked communicator is never split (NCCL refuses to split one in error).
TEST_F(OwnedCommTest, RebuildPromotesTheSpareAndSplitsTheNextOffIt) {
  ncclComm_t comm = make_comm();
  ncclComm_t spare = make_comm();
  ncclComm_t second_spare = nullptr;
  {
    OwnedComm owned(comm, 2, 1'000, api_, spare);
    EXPECT_TRUE(owned.has_spare());
    ASSERT_TRUE(owned.revoke());
    EXPECT_EQ(fake(comm)->revokes, 1);
    EXPECT_EQ(fake(spare)->revokes, 0);
    bool timed_out = true;
    EXPECT_EQ(owned.ready(in_ms(1'000), &timed_out), spare);
    EXPECT_FALSE(timed_out);
    EXPECT_EQ(nccl_.splits, 1);
    EXPECT_EQ(nccl_.split_key, 2);
    EXPECT_EQ(fake(comm)->aborts, 1);  // the revoked one, freed once the split is done
    EXPECT_EQ(fake(spare)->aborts, 0);
    EXPECT_TRUE(owned.has_spare());
    ASSERT_EQ(nccl_.comms.size(), 3u);
    second_spare = reinterpret_cast<ncclComm_t>(nccl_.comms[2].get());
    EXPECT_EQ(owned.rebuilds(), 1);

    // A second failure: the second spare takes over.
    ASSERT_TRUE(owned.revoke());
    EXPECT_EQ(owned.ready(in_ms(1'000), &timed_out), second_spare);
    EXPECT_EQ(fake(spare)->aborts, 1);
    EXPECT_EQ(owned.rebuilds(), 2);
  }
  EXPECT_EQ(fake(second_spare)->finalizes, 1);  // the healthy one at the end
  EXPECT_EQ(nccl_.comms[3]->aborts, 1);         // the unused spare: aborted (it never carried traffic)
}

// Over NCCL's network transports a peer's revoke closes the connections, and this rank's communicator reports the
// remote error after its own revoke too: with a spare that revoke still counts; without one it fails for good.
TEST_F(OwnedCommTest, RevokeThatQuiescesWithARemoteErrorRebuildsFromTheSpare) {
  nccl_.revoke_final = ncclRemoteError;
  {
    ncclComm_t comm = make_comm();
    ncclComm_t spare = make_comm();
    OwnedComm owned(comm, 0, 1'000, api_, spare);
    EXPECT_TRUE(owned.revoke());
    EXPECT_EQ(owned.state(), OwnedComm::State::kRevoked);
    bool timed_out = true;
    EXPECT_EQ(owned.ready(in_ms(1'000), &timed_out), spare);
    EXPECT_EQ(owned.state(), OwnedComm::State::kHealthy);
  }
  nccl_.comms.clear();
  ncclComm_t comm = make_comm();
  OwnedComm owned(comm, 0, 1'000, api_);
  EXPECT_FALSE(owned.revoke());
  EXPECT_EQ(owned.state(), OwnedComm::State::kFailed);
  EXPECT_NE(owned.failure().find("ncclCommRevoke ended with remote error"), std::string::npos) << owned.failure();
}

TEST_F(OwnedCommTest, SpareWhoseSplitFailsIsAbortedWithEverything) {
  nccl_.child_final = ncclRemoteError;  // a peer died during the rebuild
  ncclComm_t comm = make_comm();
  ncclComm_t spare = make_comm();
  OwnedComm owned(comm, 0, 1'000, api_, spare);
  expect_rebuild_fails(owned);
  EXPECT_FALSE(owned.has_spare());
  ASSERT_EQ(nccl_.comms.size(), 3u);
  for (const auto& c : nccl_.comms) EXPECT_EQ(c->aborts, 1);
  EXPECT_NE(owned.failure().find("NCCL reports remote error"), std::string::npos) << owned.failure();
}

}  // namespace
}  // namespace epx::cuda
#else
TEST(OwnedCommTest, NeedsACudaBuild) { GTEST_SKIP() << "the owned NCCL communicator exists in CUDA builds only"; }
#endif
