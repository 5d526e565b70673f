// The NCCL WeightTransport (issue 16): ranks of a cuda Group of one process per GPU, on one host or several,
// moving weights with ncclSend / ncclRecv on the group's communicator. A round:
//   1. gather_message_totals: one all-gather of every rank's per-peer totals and message-size sequences; every
//      rank checks the whole matrix, so a mismatch raises the same error everywhere before any data moves (an
//      unmatched ncclRecv would otherwise wait for the timeout, and mismatched sizes are undefined in NCCL);
//   2. a rank's messages to itself: device-to-device copies on the transport's stream, send i to receive i;
//   3. one ncclGroupStart, ncclSend per SendOp and ncclRecv per RecvOp in their order (NCCL matches the sends
//      and receives between two ranks in order: the WeightTransport contract), ncclGroupEnd, all on the same
//      stream; a non-blocking communicator may answer ncclInProgress, polled until it has enqueued the group;
//   4. the host polls cudaStreamQuery together with ncclCommGetAsyncError against the group's timeout.
// When step 4 returns, this rank's receives landed and its sends were read (NCCL completes a send on the sender's
// stream only once the data left its buffer), as the contract asks.
// NOTE: the transport does not own the communicator: on a timeout or an NCCL error it cannot abort it, so the
// error says that the caller must (the transfer may still be running), and free_temp stops freeing.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "comm/cuda/cuda_group.h"
#include "comm/cuda/nccl_loader.h"
#include "core/check.h"
#include "core/cuda/cuda_util.h"
#include "core/timeout.h"
#include "eplb/cuda/transport.h"

namespace epx::eplb {

namespace {

// What every failure after data may have started moving tells the caller.
constexpr const char* kAbortAdvice =
    "this transport cannot be used again: the group ended the transfer with its failure (an owned communicator is "
    "rebuilt in the group's next collective; a borrowed one must be aborted by its owner before the weight buffers "
    "are freed); the weights of that relocation are incomplete: make a new transport and relocate again";

class NcclTransport final : public WeightTransport {
 public:
  explicit NcclTransport(cuda::CudaGroup& group) : group_(group), device_(group.device().index) {
    cuda::DeviceGuard guard(device_);
    cuda::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "nccl transport: stream");
  }

  ~NcclTransport() override {
    cuda::DeviceGuard guard(device_);
    // NOTE: does not wait: after a failure the stream may hold a transfer that never ends; its resources go once
    // the communicator is aborted.
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return group_.rank(); }
  int num_ranks() const override { return group_.num_ranks(); }

  void exchange(std::span<const SendOp> sends, std::span<const RecvOp> recvs) override {
    EPX_CHECK(ErrorCode::kPeerFailure, failed_.empty(),
              "cuda rank {}: nccl transport: an earlier exchange failed ({}); {}", rank(), failed_, kAbortAdvice);
    gather_message_totals(group_, sends, recvs, "nccl transport");
    const int me = rank();
    ncclComm_t comm = group_.collective_comm();  // throws kPeerFailure when the group failed for good
    cuda::DeviceGuard guard(device_);
    // Own messages: the i-th send to self lands in the i-th receive from self (sizes checked above).
    size_t next_self = 0;
    for (const RecvOp& op : recvs) {
      if (op.peer != me || op.bytes == 0) continue;
      while (sends[next_self].peer != me || sends[next_self].bytes == 0) ++next_self;
      const SendOp& from = sends[next_self++];
      cuda::check_cuda(cudaMemcpyAsync(op.data, from.data, op.bytes, cudaMemcpyDeviceToDevice, stream_),
                       "nccl transport: copy of a rank's message to itself");
    }
    const cuda::NcclApi& api = cuda::nccl();
    const auto deadline = detail::deadline_after_ms(group_.timeout_ms());
    check_posted(api.GroupStart(), "ncclGroupStart");
    // NOTE: after ncclGroupStart every path calls ncclGroupEnd once, so no group is left open on this thread.
    ncclResult_t posted = ncclSuccess;
    const char* what = "";
    for (const SendOp& op : sends) {
      if (posted != ncclSuccess && posted != ncclInProgress) break;
      if (op.peer == me || op.bytes == 0) continue;
      posted = api.Send(op.data, op.bytes, ncclUint8, op.peer, comm, stream_);
      what = "ncclSend";
    }
    for (const RecvOp& op : recvs) {
      if (posted != ncclSuccess && posted != ncclInProgress) break;
      if (op.peer == me || op.bytes == 0) continue;
      posted = api.Recv(op.data, op.bytes, ncclUint8, op.peer, comm, stream_);
      what = "ncclRecv";
    }
    const ncclResult_t ended = api.GroupEnd();
    if (posted != ncclSuccess && posted != ncclInProgress) {
      fail(ErrorCode::kNcclError, fmt::format("{} failed: {}", what, api.GetErrorString(posted)));
    }
    if (ended == ncclInProgress) {
      wait_enqueued(comm, deadline);
    } else if (ended != ncclSuccess) {
      fail(ErrorCode::kNcclError, fmt::format("ncclGroupEnd failed: {}", api.GetErrorString(ended)));
    }
    wait_stream(comm, deadline);
  }

  void copy(void* dst, const void* src, size_t bytes) override {
    device_copy(device_, stream_, dst, src, bytes, "nccl transport");
  }

  void* allocate_temp(size_t bytes) override { return device_allocate_temp(device_, bytes, "nccl transport"); }

  void free_temp(void* ptr) noexcept override {
    // NOTE: after a failure NCCL may still write into a receive buffer: cudaFree would synchronize with that
    // transfer (forever, if a peer is gone), so the buffer is leaked instead.
    if (!failed_.empty()) return;
    cuda::DeviceGuard guard(device_);
    cudaFree(ptr);
  }

 private:
  // An error from posting a call before any transfer was enqueued.
  void check_posted(ncclResult_t result, const char* what) const {
    if (result != ncclSuccess && result != ncclInProgress) {
      detail::raise(ErrorCode::kNcclError, "cuda rank {}: nccl transport: {} failed: {}", rank(), what,
                    cuda::nccl().GetErrorString(result));
    }
  }

  // A non-blocking communicator enqueues the group's transfers after ncclGroupEnd returned ncclInProgress.
  void wait_enqueued(ncclComm_t comm, std::chrono::steady_clock::time_point deadline) {
    while (true) {
      const ncclResult_t state = cuda::comm_state(comm);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        fail(ErrorCode::kPeerFailure,
             fmt::format("ncclGroupEnd: NCCL reports {} (a peer failed)", cuda::nccl().GetErrorString(state)));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        fail(ErrorCode::kTimeout, fmt::format("ncclGroupEnd did not enqueue the transfers within {} ms: a peer "
                                              "rank is absent or stuck",
                                              group_.timeout_ms()));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // The stream holds the self copies and the group's transfers; polled with the communicator's state so that a
  // failure NCCL detects ends the wait at once.
  void wait_stream(ncclComm_t comm, std::chrono::steady_clock::time_point deadline) {
    while (true) {
      const cudaError_t status = cudaStreamQuery(stream_);
      if (status == cudaSuccess) return;
      if (status != cudaErrorNotReady) {
        cudaGetLastError();
        fail(ErrorCode::kInternal, fmt::format("the transfer's stream failed: {}", cudaGetErrorString(status)));
      }
      const ncclResult_t state = cuda::comm_state(comm);
      if (state != ncclSuccess && state != ncclInProgress) {
        fail(ErrorCode::kPeerFailure,
             fmt::format("NCCL reports {} during the transfer (a peer failed)", cuda::nccl().GetErrorString(state)));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        fail(ErrorCode::kTimeout, fmt::format("the transfer did not complete within {} ms: a peer rank is absent "
                                              "or stuck",
                                              group_.timeout_ms()));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // Marks the transport failed (no further exchange, free_temp leaks) and fails the group, which ends the transfer
  // (CudaGroup::fail: an owned communicator is revoked and rebuilt in the group's next collective) and throws.
  [[noreturn]] void fail(ErrorCode code, const std::string& what) {
    failed_ = what;
    group_.fail(code, fmt::format("nccl transport: {}; {}", what, kAbortAdvice));
    detail::raise(code, "cuda rank {}: nccl transport: {}", rank(), what);  // not reached: CudaGroup::fail throws
  }

  cuda::CudaGroup& group_;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  std::string failed_{};  // why an exchange failed; empty while the transport works
};

}  // namespace

std::unique_ptr<WeightTransport> make_nccl_transport_impl(Group& group) {
  auto* cuda_group = dynamic_cast<cuda::CudaGroup*>(&group);
  EPX_CHECK_ARG(cuda_group != nullptr, "make_nccl_transport needs a group made by epx's cuda backend");
  EPX_CHECK_ARG(!cuda_group->single_process(),
                "make_nccl_transport needs a cuda group of one process per GPU with an NCCL communicator "
                "(create_cuda_group); this one (rank {} of {}) has its ranks as threads of one process "
                "(create_cuda_groups): use make_cuda_transport",
                group.rank(), group.num_ranks());
  return std::make_unique<NcclTransport>(*cuda_group);
}

}  // namespace epx::eplb
