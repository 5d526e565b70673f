// The hierarchical low-latency routing of the cuda Buffer (LowLatencyRouting::kHierarchical, and kAuto on more than one
// node; docs/internode.md, "Low-latency across nodes"). LowLatencyEngine keeps the flat region, the sets, the masks,
// the results and the handles, and calls this object for the parts that differ: the send half of each call (pack, the
// network leg, forwarding; the combine's rows, weights, partials) and the combine's receive. The dispatch's receive is
// the flat kernel (ll::dispatch, kRecv) after join_dispatch. Kernels: hierarchical_low_latency_kernels.h. Private to
// the CUDA backend.
//
// Streams: the send half runs on this object's communication stream, forked from the caller's stream by an event; the
// caller's stream then waits only until the call's inputs were read (the pack, or the combine's rows and weights), as
// the flat send kernel would hold it, and the receive (or its hook) joins the communication stream at the end of that
// call's send half. So no kernel of a receive runs before its own rank forwarded, and forwarding never waits for a
// receive or a host action of a peer: a receive waits only for what the peers' send halves enqueued.
//
// Host waits and bounds: the network leg goes through comm/cuda/net_leg.h. Ranks as threads: two host rendezvous per
// exchange (bounded by the group's timeout, kTimeout), so a call cannot be captured in a CUDA graph. NCCL groups:
// grouped send/recv on the stream, no host wait; every call first waits, bounded, for the previous call's exchanges
// (ByteExchange::wait_finished), so a peer that never posts ends in kTimeout there (the group's communicator aborted)
// instead of a stream that never drains. Device waits are the flat path's bounded waits (a timeout masks the peer).
//
// CUDA graphs (NCCL groups): a dispatch + combine, with or without hooks, can be captured on the caller's stream after
// one eager dispatch (which allocates and maps the relay region: ensure). Under capture nothing here waits on the host
// or allocates: the communication stream joins the capture through the fork event and rejoins the caller's stream
// through the inputs-read and done events (each hook must run before the capture ends), the exchanges are captured
// NCCL send/recv, and the wait for the previous call's exchanges is skipped (the host cannot wait for captured work);
// so captured exchanges are not bounded. Tags are device-side sequence numbers (low_latency.h), fresh on every replay.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/cuda/cuda_group.h"
#include "comm/cuda/net_leg.h"
#include "comm/cuda/peer_memory.h"
#include "ep/cuda/hierarchical_low_latency_kernels.h"
#include "ep/cuda/low_latency.h"
#include "epx/buffer.h"

namespace epx::cuda {

// The relay region's layout for N nodes of G ranks, M tokens per rank, hidden H, E_local experts per rank, partials of
// partial_bytes (4: fp32, 2: bf16) per element.
RelayOffsets make_relay_offsets(int num_nodes, int gpus_per_node, int64_t max_tokens, int64_t hidden,
                                int64_t num_local_experts, int partial_bytes);

class LowLatencyRelay {
 public:
  // Collective over `group` (an all-gather of the ranks' devices): loads the kernels, makes the stream, the events and
  // the exchange. The relay region comes at the first dispatch (ensure). node_partials: BufferOptions::node_partials.
  LowLatencyRelay(CudaGroup& group, int device, NodePartials node_partials);
  ~LowLatencyRelay();
  LowLatencyRelay(const LowLatencyRelay&) = delete;
  LowLatencyRelay& operator=(const LowLatencyRelay&) = delete;

  // Collective when the shapes change (the first dispatch, or the first after clean with other shapes): allocates,
  // zeroes and maps (within the node) the relay region for `layout`. Otherwise nothing.
  void ensure(const LowLatencyLayout& layout);
  // Bounded by the group's timeout: the previous exchanges finished (NCCL; kTimeout and the group failed otherwise).
  void wait_exchanges();

  // The send half of a dispatch into flat set `set`; then join_dispatch(set, stream) before the flat receive kernel.
  void send_dispatch(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                     const LowLatencyDispatchLaunch& launch, cudaStream_t stream);
  void join_dispatch(int set, cudaStream_t stream);
  // The send half of a combine into combine set `set`, then its receive (joins, then llh::combine on `stream`).
  void send_combine(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                    const LowLatencyCombineLaunch& launch, cudaStream_t stream);
  void receive_combine(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                       const LowLatencyCombineLaunch& launch, cudaStream_t stream);

  // Not collective; LowLatencyEngine::clean calls it between its barriers, the device idle: zeroes the region.
  void clean();

 private:
  void fork(cudaStream_t stream);
  // The exchange of `bytes` per other node among the ranks of this local index (nothing on one node).
  void exchange(const char* send, char* recv, int64_t bytes, const char* what);

  CudaGroup& group_;
  int device_;
  Topology topology_;
  int rank_;
  std::unique_ptr<ByteExchange> exchange_;
  std::vector<int> net_peers_;  // (m, local rank) for every node m, ascending
  cudaStream_t comm_ = nullptr;
  cudaEvent_t fork_ = nullptr;
  cudaEvent_t inputs_read_ = nullptr;
  cudaEvent_t dispatch_done_[2] = {};
  cudaEvent_t combine_done_[2] = {};
  RelayRecord rec_[2];  // the record of the last dispatch into each set (its combine reads those messages)
  int64_t max_tokens_ = 0, hidden_ = 0, num_experts_ = 0;  // the shapes of the region
  char* region_ = nullptr;
  PeerRegions peers_map_;
  RelayView view_{};
};

}  // namespace epx::cuda
