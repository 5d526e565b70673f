#include "comm/cuda/owned_comm.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "core/timeout.h"

namespace epx::cuda {
namespace {

// The bound of the local waits (the revoke's quiescence, the destructor's finalize): no peer takes part in them,
// so a long group timeout need not hold a rank there.
constexpr int64_t kLocalWaitMs = 10'000;

}  // namespace

OwnedComm::OwnedComm(ncclComm_t comm, int rank, int64_t timeout_ms, const NcclApi& api, ncclComm_t spare)
    : api_(api), comm_(comm), spare_(spare), rank_(rank), timeout_ms_(detail::clamp_timeout_ms(timeout_ms)) {}

OwnedComm::~OwnedComm() {
  if (spare_ != nullptr) api_.CommAbort(spare_);
  if (comm_ == nullptr) return;
  if (state_ == State::kHealthy) {
    const ncclResult_t r = api_.CommFinalize(comm_);
    const auto deadline = detail::deadline_after_ms(std::min(timeout_ms_, kLocalWaitMs));
    if ((r == ncclSuccess || r == ncclInProgress) && wait_comm(api_, comm_, deadline) == ncclSuccess) {
      api_.CommDestroy(comm_);
      return;
    }
  }
  // NOTE: a revoked communicator must not be finalized (NCCL refuses it); an abort frees it without peers.
  api_.CommAbort(comm_);
}

void OwnedComm::fail_for_good(std::string why) noexcept {
  if (comm_ != nullptr) api_.CommAbort(comm_);
  if (spare_ != nullptr) api_.CommAbort(spare_);
  comm_ = spare_ = nullptr;
  state_ = State::kFailed;
  if (failure_.empty()) failure_ = std::move(why);
}

bool OwnedComm::revoke() noexcept {
  if (state_ != State::kHealthy) return state_ == State::kRevoked;
  if (api_.CommRevoke == nullptr) {
    fail_for_good(
        fmt::format("NCCL {} cannot revoke a communicator (ncclCommRevoke needs NCCL >= 2.28.7)", api_.version));
    return false;
  }
  const ncclResult_t r = api_.CommRevoke(comm_, 0);
  if (r != ncclSuccess && r != ncclInProgress) {
    fail_for_good(fmt::format("ncclCommRevoke failed: {}", api_.GetErrorString(r)));
    return false;
  }
  const int64_t bound_ms = std::min(timeout_ms_, kLocalWaitMs);
  const ncclResult_t quiet = wait_comm(api_, comm_, detail::deadline_after_ms(bound_ms));
  // NOTE: a communicator whose peer's revoke broke its network connections quiesces reporting that remote error
  // (it stays): with a spare the rebuild does not need this one, so the revoke counts.
  if (quiet != ncclSuccess && !(quiet != ncclInProgress && spare_ != nullptr)) {
    fail_for_good(quiet == ncclInProgress
                      ? fmt::format("the revoked communicator did not quiesce within {} ms", bound_ms)
                      : fmt::format("ncclCommRevoke ended with {}", api_.GetErrorString(quiet)));
    return false;
  }
  state_ = State::kRevoked;
  return true;
}

ncclComm_t OwnedComm::ready(std::chrono::steady_clock::time_point deadline, bool* timed_out) {
  *timed_out = false;
  if (state_ != State::kRevoked) return get();
  // With a spare: the next spare splits off it, then it replaces the revoked one. Without: a split of the revoked one.
  ncclComm_t parent = spare_ != nullptr ? spare_ : comm_;
  std::string why;
  const ncclComm_t child = split_same_ranks(api_, parent, rank_, deadline, timed_out, &why);
  if (child == nullptr) {
    // split_same_ranks aborted the parent
    if (parent == spare_) spare_ = nullptr;
    if (parent == comm_) comm_ = nullptr;
    fail_for_good("rebuilding the communicator after a failure" + why);
    return nullptr;
  }
  api_.CommAbort(comm_);  // the revoked one: local, waits for no peer
  if (parent == spare_) {
    comm_ = spare_;
    spare_ = child;
  } else {
    comm_ = child;
  }
  state_ = State::kHealthy;
  ++rebuilds_;
  return comm_;
}

ncclComm_t split_same_ranks(const NcclApi& api, ncclComm_t parent, int rank,
                            std::chrono::steady_clock::time_point deadline, bool* timed_out, std::string* why) {
  *timed_out = false;
  // NOTE: a non-blocking split writes the new handle from NCCL's thread when the child's creation ends (success or
  // not), and only then: the slot must outlive that write. It is freed once the handle came; when the deadline
  // passes first it is leaked on purpose (8 bytes), since the aborted creation may still write it.
  auto* slot = new ncclComm_t(nullptr);
  const ncclResult_t posted = api.CommSplit(parent, /*color=*/0, /*key=*/rank, slot, nullptr);
  if (posted != ncclSuccess && posted != ncclInProgress) {
    delete slot;  // NCCL returned without starting the creation
    api.CommAbort(parent);
    *why = fmt::format(": ncclCommSplit failed: {}", api.GetErrorString(posted));
    return nullptr;
  }
  const auto child = [&] { return __atomic_load_n(slot, __ATOMIC_ACQUIRE); };
  // NOTE: NCCL 2.28 writes the child's handle when its creation ends, also when it failed, and records the outcome
  // on the parent (the split runs as the parent's job); the child's own state reads ncclSuccess either way. So the
  // split is done when the handle came and the parent left ncclInProgress, and it succeeded when both report
  // ncclSuccess (the child too, should a later NCCL record the outcome there).
  ncclResult_t state = ncclInProgress;
  detail::poll_until(deadline, [&] {
    const ncclComm_t c = child();
    if (c == nullptr) return false;
    state = comm_state(api, parent);
    if (state == ncclSuccess) state = comm_state(api, c);
    return state != ncclInProgress;
  });
  const ncclComm_t fresh = child();
  if (fresh != nullptr && state == ncclSuccess) {
    delete slot;
    return fresh;
  }
  *timed_out = state == ncclInProgress;
  *why = *timed_out ? " did not complete by its deadline: a rank did not come to its next call of the group in time"
                    : fmt::format(": NCCL reports {}", api.GetErrorString(state));
  // NOTE: aborting the parent also aborts a child still being created (NCCL's child abort flag).
  api.CommAbort(parent);
  if (const ncclComm_t late = child(); late != nullptr) {
    api.CommAbort(late);
    delete slot;
  }
  return nullptr;
}

}  // namespace epx::cuda
