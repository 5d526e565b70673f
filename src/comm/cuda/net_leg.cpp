#include "comm/cuda/net_leg.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <string>

#include "comm/cuda/nccl_loader.h"
#include "core/check.h"
#include "core/cuda/cuda_util.h"
#include "core/timeout.h"

namespace epx::cuda {
namespace {

std::vector<int64_t> offsets_of(const std::vector<int64_t>& bytes) {
  std::vector<int64_t> offsets(bytes.size() + 1, 0);
  for (size_t i = 0; i < bytes.size(); ++i) offsets[i + 1] = offsets[i] + bytes[i];
  return offsets;
}

void check_lists(const std::vector<int>& peers, const std::vector<int64_t>& send_bytes,
                 const std::vector<int64_t>& recv_bytes, int num_ranks) {
  EPX_CHECK(ErrorCode::kInternal, send_bytes.size() == peers.size() && recv_bytes.size() == peers.size(),
            "exchange: {} peers, {} send sizes, {} receive sizes", peers.size(), send_bytes.size(), recv_bytes.size());
  for (size_t i = 0; i < peers.size(); ++i) {
    EPX_CHECK(ErrorCode::kInternal, peers[i] >= 0 && peers[i] < num_ranks && send_bytes[i] >= 0 && recv_bytes[i] >= 0,
              "exchange: peer {} ({} bytes out, {} in) of {} ranks", peers[i], send_bytes[i], recv_bytes[i], num_ranks);
  }
}

// This thread in cudaStreamCaptureModeRelaxed while it lives. NOTE: a host wait for eager work (an event query) is
// then legal while another thread captures in cudaStreamCaptureModeGlobal, or this one in any mode; in the default
// mode the query would be refused and invalidate that capture. Events recorded inside a capture stay unqueryable.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;  // then the mode to restore
};

// Ranks as threads of one process. What each rank publishes in the first rendezvous of a call: where its
// messages land, and its two events. Per call:
//   1. record `ready` on the stream (the receive buffer's allocation and everything before it are ordered);
//   2. rendezvous (all_gather_bytes of the posts);
//   3. per remote peer p with bytes for it: the stream waits for p's `ready`, then copies into p's buffer;
//   4. record `sent` on the stream; rendezvous (barrier): every rank recorded its `sent`;
//   5. per remote peer p with bytes from it: the stream waits for p's `sent`.
// NOTE: cudaStreamWaitEvent binds to the event's latest record when it is called. A rank records `ready` of call
// k + 1 only after the first rendezvous of k + 1, which its peers reach only after their step 5 of call k, and
// `sent` of k + 1 only after that rendezvous too; so every wait sees the record of its own call. Cost: two host
// rendezvous per call (about 10-50 us with threads), and the copies of a rank are serialized on its stream.
class SharedMemoryExchange final : public ByteExchange {
 public:
  explicit SharedMemoryExchange(CudaGroup& group) : group_(group), rank_(group.rank()) {
    EPX_CHECK(ErrorCode::kUnsupported, group.num_ranks() <= kMaxExchangeRanks,
              "the single-process hierarchical exchange supports up to {} ranks, got {}", kMaxExchangeRanks,
              group.num_ranks());
    DeviceGuard guard(group.device().index);
    check_cuda(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate (exchange)");
    check_cuda(cudaEventCreateWithFlags(&sent_, cudaEventDisableTiming), "cudaEventCreate (exchange)");
  }
  ~SharedMemoryExchange() override {
    DeviceGuard guard(group_.device().index);
    cudaEventDestroy(ready_);
    cudaEventDestroy(sent_);
  }

  void run(const std::vector<int>& peers, const void* send, const std::vector<int64_t>& send_bytes, void* recv,
           const std::vector<int64_t>& recv_bytes, cudaStream_t stream, const char* what) override {
    const int num_ranks = group_.num_ranks();
    check_lists(peers, send_bytes, recv_bytes, num_ranks);
    const std::vector<int64_t> send_off = offsets_of(send_bytes), recv_off = offsets_of(recv_bytes);
    Post mine{};
    mine.recv = static_cast<char*>(recv);
    mine.ready = ready_;
    mine.sent = sent_;
    for (int r = 0; r < kMaxExchangeRanks; ++r) mine.bytes_from[r] = -1;
    for (size_t i = 0; i < peers.size(); ++i) {
      mine.offset_from[peers[i]] = recv_off[i];
      mine.bytes_from[peers[i]] = recv_bytes[i];
    }
    check_cuda(cudaEventRecord(ready_, stream), "cudaEventRecord (exchange ready)");
    std::vector<Post> posts(num_ranks);
    group_.all_gather_bytes(&mine, posts.data(), sizeof(Post));
    const char* src = static_cast<const char*>(send);
    for (size_t i = 0; i < peers.size(); ++i) {
      const int p = peers[i];
      EPX_CHECK(ErrorCode::kInternal, posts[p].bytes_from[rank_] == send_bytes[i],
                "{}: rank {} sends {} bytes to rank {}, which expects {}", what, rank_, send_bytes[i], p,
                posts[p].bytes_from[rank_]);
      if (send_bytes[i] == 0) continue;
      if (p != rank_) check_cuda(cudaStreamWaitEvent(stream, posts[p].ready, 0), "cudaStreamWaitEvent (exchange)");
      check_cuda(cudaMemcpyAsync(posts[p].recv + posts[p].offset_from[rank_], src + send_off[i], send_bytes[i],
                                 cudaMemcpyDefault, stream),
                 "cudaMemcpyAsync (exchange)");
    }
    check_cuda(cudaEventRecord(sent_, stream), "cudaEventRecord (exchange sent)");
    group_.barrier();
    for (size_t i = 0; i < peers.size(); ++i) {
      const int p = peers[i];
      if (p == rank_ || recv_bytes[i] == 0) continue;
      check_cuda(cudaStreamWaitEvent(stream, posts[p].sent, 0), "cudaStreamWaitEvent (exchange)");
    }
  }

 private:
  struct Post {
    char* recv;
    cudaEvent_t ready;
    cudaEvent_t sent;
    int64_t offset_from[kMaxExchangeRanks];  // where sender r's message lands in recv
    int64_t bytes_from[kMaxExchangeRanks];   // its bytes; -1: r is not a peer
  };

  CudaGroup& group_;
  int rank_;
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t sent_ = nullptr;
};

// One process per GPU: grouped point-to-point on the group's communicator, on the caller's stream. A failing
// ncclGroupEnd and a wait for the exchange that runs out go through CudaGroup::fail: the transfers may be in flight
// or half posted, and only a revoke or an abort of the communicator ends them.
class NcclExchange final : public ByteExchange {
 public:
  explicit NcclExchange(CudaGroup& group) : group_(group), rank_(group.rank()) {
    DeviceGuard guard(group.device().index);
    check_cuda(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate (exchange)");
  }
  ~NcclExchange() override {
    DeviceGuard guard(group_.device().index);
    cudaEventDestroy(done_);
  }

  void run(const std::vector<int>& peers, const void* send, const std::vector<int64_t>& send_bytes, void* recv,
           const std::vector<int64_t>& recv_bytes, cudaStream_t stream, const char* what) override {
    check_lists(peers, send_bytes, recv_bytes, group_.num_ranks());
    // NOTE: a communicator revoked by an earlier failure is rebuilt here (collective, host work that a capture cannot
    // record): under capture the caller must make one eager call of the group first.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing (exchange)");
    EPX_CHECK(ErrorCode::kInvalidArgument, capture == cudaStreamCaptureStatusNone || !group_.nccl_rebuild_pending(),
              "cuda rank {}: the {}: the group must rebuild its NCCL communicator after an earlier failure, which "
              "cannot happen while the stream is captured into a CUDA graph: make one call of the group outside the "
              "capture on every rank first (e.g. barrier()); graphs captured before the failure hold the old "
              "communicator and must be captured again",
              rank_, what);
    ncclComm_t comm = group_.collective_comm();  // throws kPeerFailure when the group failed for good
    const std::vector<int64_t> send_off = offsets_of(send_bytes), recv_off = offsets_of(recv_bytes);
    const char* src = static_cast<const char*>(send);
    char* dst = static_cast<char*>(recv);
    const NcclApi& api = nccl();
    check(api.GroupStart(), "ncclGroupStart");
    // NOTE: a throw between ncclGroupStart and ncclGroupEnd would leave this thread inside NCCL's group, which then
    // queues every later NCCL call of the thread (the barrier's all-gather, the revoke) without running it: end the
    // group first. The operations posted so far then wait for peers that post the rest, so the group fails (an owned
    // communicator is revoked, which ends them).
    try {
      for (size_t i = 0; i < peers.size(); ++i) {
        if (peers[i] == rank_) {
          EPX_CHECK(ErrorCode::kInternal, send_bytes[i] == recv_bytes[i],
                    "{}: rank {} sends itself {} bytes and expects {}", what, rank_, send_bytes[i], recv_bytes[i]);
          if (send_bytes[i] > 0) {
            check_cuda(
                cudaMemcpyAsync(dst + recv_off[i], src + send_off[i], send_bytes[i], cudaMemcpyDeviceToDevice, stream),
                "cudaMemcpyAsync (exchange, own message)");
          }
          continue;
        }
        if (send_bytes[i] > 0) {
          check(api.Send(src + send_off[i], static_cast<size_t>(send_bytes[i]), ncclUint8, peers[i], comm, stream),
                "ncclSend");
        }
        if (recv_bytes[i] > 0) {
          check(api.Recv(dst + recv_off[i], static_cast<size_t>(recv_bytes[i]), ncclUint8, peers[i], comm, stream),
                "ncclRecv");
        }
        if (send_bytes[i] > 0 || recv_bytes[i] > 0) add_pending_peer(peers[i]);
      }
    } catch (const Error& e) {
      (void)api.GroupEnd();
      group_.fail(e.code(), fmt::format("the {} failed while posting its sends and receives: {}", what, e.what()));
    } catch (...) {  // e.g. std::bad_alloc: the group still ends, the error is the caller's
      (void)api.GroupEnd();
      throw;
    }
    const ncclResult_t ended = api.GroupEnd();
    if (ended == ncclInProgress) {
      // A non-blocking communicator (the groups epx creates) finishes enqueuing later: bounded wait on the host.
      ncclResult_t state = ncclInProgress;
      const bool enqueued = detail::poll_until(detail::deadline_after_ms(group_.timeout_ms()), [&] {
        state = comm_state(comm);
        return state != ncclInProgress;
      });
      if (!enqueued) {
        group_.fail(ErrorCode::kTimeout, fmt::format("the {}'s ncclGroupEnd (send/recv with ranks {}) did not "
                                                     "complete within {} ms",
                                                     what, pending_peers(), group_.timeout_ms()));
      }
      if (state != ncclSuccess) {
        group_.fail(ErrorCode::kNcclError,
                    fmt::format("the {}'s ncclGroupEnd failed: {}", what, api.GetErrorString(state)));
      }
    } else if (ended != ncclSuccess) {
      group_.fail(ErrorCode::kNcclError,
                  fmt::format("the {}'s ncclGroupEnd failed: {}", what, api.GetErrorString(ended)));
    }
    // NOTE: not under capture: the captured exchange runs when the graph is launched, and a query of an event
    // recorded into a capture says nothing about it.
    if (capture == cudaStreamCaptureStatusNone) {
      check_cuda(cudaEventRecord(done_, stream), "cudaEventRecord (exchange done)");
      recorded_ = true;
      last_what_ = what;
    }
  }

  void wait_finished() override {
    if (!recorded_) return;
    ncclComm_t comm = group_.nccl_comm();
    const auto deadline = detail::deadline_after_ms(group_.timeout_ms());
    ncclResult_t state = ncclSuccess;
    const RelaxedCaptureMode relaxed;  // done_ was recorded outside any capture (run)
    const bool ended = detail::poll_until(deadline, [&] {
      const cudaError_t status = cudaEventQuery(done_);
      if (status == cudaSuccess) return true;
      if (status != cudaErrorNotReady) check_cuda(status, "cudaEventQuery (exchange done)");
      state = comm == nullptr ? ncclSuccess : comm_state(comm);
      return state != ncclSuccess && state != ncclInProgress;  // NCCL saw a peer fail: no use waiting
    });
    const std::string peers = pending_peers();
    // NOTE: forgotten before failing: a borrowed communicator is not aborted and the stream may stay stuck, but the
    // group refuses every later collective, so the next call fails at once instead of waiting here again.
    recorded_ = false;
    peers_.clear();
    if (!ended) {
      group_.fail(ErrorCode::kTimeout,
                  fmt::format("the hierarchical exchanges up to the {} (NCCL send/recv with ranks {}) did not finish "
                              "within {} ms: a peer never posted its matching send or receive (it failed or left the "
                              "call, or is stuck); the outputs of that call are invalid",
                              last_what_, peers, group_.timeout_ms()));
    }
    if (state != ncclSuccess && state != ncclInProgress) {
      group_.fail(ErrorCode::kPeerFailure,
                  fmt::format("NCCL reports {} during the hierarchical exchanges up to the {} (send/recv with ranks "
                              "{}): a peer failed; the outputs of that call are invalid",
                              nccl().GetErrorString(state), last_what_, peers));
    }
  }

 private:
  // Before any transfer was enqueued: the group is intact.
  void check(ncclResult_t result, const char* what) const {
    if (result != ncclSuccess && result != ncclInProgress) {
      detail::raise(ErrorCode::kNcclError, "cuda rank {}: {} failed: {}", rank_, what, nccl().GetErrorString(result));
    }
  }

  void add_pending_peer(int peer) {
    if (std::find(peers_.begin(), peers_.end(), peer) == peers_.end()) peers_.push_back(peer);
  }
  std::string pending_peers() const {
    std::vector<int> sorted = peers_;
    std::sort(sorted.begin(), sorted.end());
    return fmt::format("{{{}}}", fmt::join(sorted, ", "));
  }

  CudaGroup& group_;
  int rank_;
  cudaEvent_t done_ = nullptr;  // recorded after the last exchange run() enqueued outside a capture
  bool recorded_ = false;       // done_ holds an exchange wait_finished() has not seen finish
  const char* last_what_ = "";  // that exchange's name
  std::vector<int> peers_;      // the remote peers of the exchanges since the last wait_finished()
};

}  // namespace

std::unique_ptr<ByteExchange> make_byte_exchange(CudaGroup& group) {
  if (!group.single_process()) return std::make_unique<NcclExchange>(group);
  EPX_CHECK(ErrorCode::kUnsupported, group.single_process(),
            "the hierarchical normal path needs an NCCL group or ranks of one process");
  return std::make_unique<SharedMemoryExchange>(group);
}

}  // namespace epx::cuda
