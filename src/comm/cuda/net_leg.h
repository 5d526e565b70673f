// The exchange legs of the hierarchical normal path (docs/internode.md): an all-to-all-v of byte buffers among a
// set of peer ranks, enqueued on a CUDA stream. Private to the CUDA backend.
//
// Two implementations, chosen from the group (make_byte_exchange):
//   NCCL groups (one process per GPU): grouped ncclSend/ncclRecv (ncclUint8) inside ncclGroupStart/End on the
//     group's communicator, through the loaded NCCL (nccl_loader.h). Nothing waits on the host except a
//     non-blocking communicator's ncclInProgress after ncclGroupEnd (bounded by the group's timeout; under capture
//     this also waits until NCCL's thread has enqueued the transfers into the graph), so the call can be captured in
//     a CUDA graph (the hierarchical low-latency path's captured test: HierarchicalLowLatencyNccl.TwoNodesGraph). A
//     peer that never posts its matching send or receive keeps the NCCL kernels, and so the stream, waiting forever:
//     run() records an event after each exchange and wait_finished() bounds the wait for it; at the deadline the group
//     fails (CudaGroup::fail revokes an owned communicator, which ends the kernels, and rebuilds it in the next
//     collective call).
//   ranks as threads (create_cuda_groups, possibly several ranks on one GPU): cudaMemcpyAsync into each
//     receiver's buffer, whose address is exchanged with all_gather_bytes. Ordering across the ranks' streams
//     with two events per rank and two host rendezvous per call (see SharedMemoryExchange in net_leg.cpp); the
//     host waits for the peers there, not for the GPU.
// Both copy a rank's message to itself with one cudaMemcpyAsync on the stream (never through NCCL).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/cuda/cuda_group.h"
#include "core/limits.h"

namespace epx::cuda {

class ByteExchange {
 public:
  virtual ~ByteExchange() = default;

  // Collective over the whole group: every rank calls it at the same point of its call sequence, each with its own
  // peer list (ascending ranks, itself included; if p lists q then q lists p). Message i of `send` (device memory,
  // the messages back to back in peer order) has send_bytes[i] bytes and goes to peers[i]; the message from
  // peers[i] lands at recv + the sum of recv_bytes[0..i) and has recv_bytes[i] bytes. send_bytes on a rank for p
  // must equal recv_bytes on p for that rank (the single-process exchange checks it: kInternal). Zero-byte messages
  // are skipped (their pointers may be null). Enqueued on `stream`, which must be current on the group's device:
  // the send buffer is read and the receive buffer written in the stream's order; both must stay allocated until
  // the stream reaches that point. `what` names the exchange in errors ("dispatch network leg"). Throws kTimeout (a
  // peer did not come within the group's timeout), kNcclError, kPeerFailure (the NCCL group failed for good earlier),
  // kInvalidArgument (the group's communicator waits for its rebuild after a failure, and `stream` is being captured).
  virtual void run(const std::vector<int>& peers, const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                   const std::vector<int64_t>& recv_bytes, cudaStream_t stream, const char* what) = 0;

  // Not collective. Waits until the exchanges run() enqueued since the last wait_finished() have finished on the
  // device, bounded by the group's timeout from this call; call it before the host depends on them or before the
  // next exchange. NCCL: polls the event run() recorded together with ncclCommGetAsyncError; at the deadline it
  // fails the group (CudaGroup::fail: an owned communicator is revoked, ending the exchange, and rebuilt in the next
  // collective call of every rank) and throws kTimeout naming this rank, the exchanges' peers and the timeout;
  // kPeerFailure at once when NCCL reports that a peer failed. Exchanges enqueued while the stream was being captured
  // into a CUDA graph are not tracked (their work runs when the graph is launched, unbounded on the host). The event
  // query runs with this thread in cudaStreamCaptureModeRelaxed, so it is legal during any capture (the event is never
  // recorded inside one) and cannot invalidate another thread's Global-mode capture; a caller that captures may still
  // skip it (the hierarchical low-latency relay does: what it would wait for is ordered before the graph anyway). Ranks
  // as threads: returns at once (their exchanges wait for the peers on the host, in run(), bounded there).
  virtual void wait_finished() {}
};

// The exchange for `group` (which must outlive it): NCCL send/recv when the group has a communicator, peer copies
// when its ranks are threads of this process (at most kMaxExchangeRanks of them).
std::unique_ptr<ByteExchange> make_byte_exchange(CudaGroup& group);

// The single-process exchange's post holds one entry per rank: as many as a group of threads has (before, 8, which
// refused every ranks-as-threads group above 8 ranks that the rank caps allow).
inline constexpr int kMaxExchangeRanks = kCudaMaxRanks;

}  // namespace epx::cuda
