// The NCCL communicator of a group that epx created (create_cuda_group(unique_id, ...)), kept usable across
// failures. Private to the CUDA backend; CUDA builds only.
//
// When a wait on the communicator runs out (a peer is late or absent) or NCCL reports an error, the group calls
// revoke(): ncclCommRevoke ends the NCCL kernels in flight on every stream, so the streams drain, and the
// communicator stays, revoked, until it is rebuilt. Every rank's next collective call of the group calls ready()
// first, which makes a fresh communicator of the same ranks (ncclCommSplit, color 0, key = rank: every rank keeps
// its number) and then frees the revoked one. The split meets the other ranks through NCCL's bootstrap, not through
// the revoked connections; it completes once every rank called it, and ready() waits for that until the deadline
// it is given.
//
// The spare: a second communicator of the same ranks, split off the first at creation and never used for traffic,
// so that it holds no connection a failure could break. Over NCCL's network transports a rank's revoke closes its
// connections, and a peer's communicator then records a remote error that stays (ncclCommGetAsyncError keeps
// reporting it after that peer's own revoke), and NCCL refuses to split a communicator in error. So with a spare,
// a revoke whose communicator reports an error once it quiesced still counts (rebuild pending), and the rebuild
// promotes the spare and splits the next spare off it; without one (OwnedComm made without), the fresh
// communicator is split off the revoked one, which works where the peers' connections did not break (NVLink,
// shared memory).
//
// The communicator fails for good (aborted: get() is null and stays null) when:
// - the library cannot revoke (NCCL older than 2.28.7 has no ncclCommRevoke), or the revoke fails or does not
//   quiesce within min(timeout, 10 s) (without a spare: or quiesces reporting an error);
// - the split fails, or does not complete by its deadline (a rank never came to its next call).
//
// The group calls it from its rank's thread only (not thread-safe). Every NCCL call goes through `api`, so the
// state machine is tested without a GPU against a fake table (tests/unit/owned_comm_test.cpp).
#pragma once

#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "comm/cuda/nccl_loader.h"

namespace epx::cuda {

class OwnedComm {
 public:
  enum class State {
    kHealthy,  // get() is usable
    kRevoked,  // after a failure: the next ready() rebuilds it
    kFailed,   // aborted for good
  };

  // Takes ownership of `comm`, a non-blocking communicator whose creation has completed, and of `spare` (null: none),
  // split off it (split_same_ranks). `timeout_ms` (clamped) bounds the revoke's quiescence and the destructor's
  // finalize, each to min(timeout_ms, 10 s).
  OwnedComm(ncclComm_t comm, int rank, int64_t timeout_ms, const NcclApi& api, ncclComm_t spare = nullptr);
  // Healthy: ncclCommFinalize + ncclCommDestroy, bounded as above, else ncclCommAbort; revoked: ncclCommAbort
  // (no peer is waited for). The spare: ncclCommAbort (it never carried traffic).
  ~OwnedComm();
  OwnedComm(const OwnedComm&) = delete;
  OwnedComm& operator=(const OwnedComm&) = delete;

  State state() const { return state_; }
  // The communicator while healthy; null while revoked and after a failure for good.
  ncclComm_t get() const { return state_ == State::kHealthy ? comm_ : nullptr; }
  // Rebuilds so far.
  int rebuilds() const { return rebuilds_; }
  // Whether a spare is held (the next rebuild promotes it).
  bool has_spare() const { return spare_ != nullptr; }
  // Why the communicator failed for good (empty otherwise).
  const std::string& failure() const { return failure_; }

  // After a failed wait on get() (a timeout, an NCCL error): revokes the communicator and returns true (a rebuild is
  // pending), or aborts it and returns false (failed for good: failure() says why). Returns whether a rebuild is
  // pending when the communicator is not healthy.
  bool revoke() noexcept;

  // Collective: the communicator for the group's next NCCL call. Healthy: get(). Revoked: the rebuild (with a spare:
  // the spare, once the next spare is split off it; else a split of the revoked one), waiting for the other ranks
  // until `deadline`; returns the fresh communicator, or null after failing for good (every communicator aborted;
  // failure() says why, and *timed_out whether the deadline passed rather than NCCL reporting an error). Failed:
  // null.
  ncclComm_t ready(std::chrono::steady_clock::time_point deadline, bool* timed_out);

  // Aborts the communicator for good (e.g. a revoke that reported quiescence but left the stream blocked); failure()
  // then says why. Idempotent.
  void fail_for_good(std::string why) noexcept;

 private:
  const NcclApi& api_;
  ncclComm_t comm_;
  ncclComm_t spare_;
  int rank_;
  int64_t timeout_ms_;
  State state_ = State::kHealthy;
  int rebuilds_ = 0;
  std::string failure_;
};

// Collective: splits a communicator of the same ranks off `parent` (color 0, key = rank, the parent's
// configuration), waiting for the other ranks until `deadline`. Returns it, or null with *why set and *timed_out
// telling whether the deadline passed rather than NCCL reporting an error; on failure `parent` is aborted (which
// also ends a child still being created) and so is a child that came.
ncclComm_t split_same_ranks(const NcclApi& api, ncclComm_t parent, int rank,
                            std::chrono::steady_clock::time_point deadline, bool* timed_out, std::string* why);

}  // namespace epx::cuda
