// The hierarchical normal dispatch/combine of the cuda Buffer (NormalRouting::kHierarchical, and kAuto on more
// than one node; docs/internode.md): the same calls and results as the host backend's hierarchical path
// (src/ep/host/host_hierarchical.cpp), on the kernels of hierarchical_kernels.h and the exchanges of
// comm/cuda/net_leg.h. Private to the CUDA backend.
//
// Each call starts with a host rendezvous (all_gather_bytes of a small header: status, shapes, handle id and, in a
// fresh dispatch, the rank's per-rank and per-node counts), so that bad or mismatched arguments fail every rank
// alike before any data moves, as on the host backend. Host syncs: a fresh dispatch synchronizes its stream once
// (the layout's counts, also in worst-token mode in this first version; a bounded poll: kTimeout on every rank if
// the stream does not get there within the group's timeout); cached dispatches and combines do not synchronize the
// device, but wait on the host for the peers (the header, the exchanges' rendezvous). On NCCL groups every call
// first waits, bounded, for the previous call's exchanges (ByteExchange::wait_finished): a peer that never posted
// its send/recv there fails the group (its communicator revoked, rebuilt by the next call) with kTimeout on this call.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/cuda/cuda_group.h"
#include "comm/cuda/device/error_record.h"
#include "comm/cuda/net_leg.h"
#include "epx/buffer.h"

namespace epx::cuda {

struct HierarchicalRoutes;

class HierarchicalEngine {
 public:
  // Not collective. Loads the kernels (see preload_normal_kernels), allocates a mapped error record and pinned
  // staging for the counts. node_partials: BufferOptions::node_partials (the combine's network leg).
  HierarchicalEngine(CudaGroup& group, std::shared_ptr<Allocator> allocator, int num_sms, NodePartials node_partials);
  ~HierarchicalEngine();
  HierarchicalEngine(const HierarchicalEngine&) = delete;
  HierarchicalEngine& operator=(const HierarchicalEngine&) = delete;

  // Fills layout.num_tokens_per_node (int32 [num_nodes]) from layout.is_token_in_rank, on `stream`.
  void add_tokens_per_node(Layout& layout, Stream stream);
  // Buffer::get_dispatch_layout where the buffer has no flat engine (more than kNormalMaxRanks ranks): the layout
  // kernel's counts and is_token_in_rank, then num_tokens_per_node. No host sync; an invalid topk_idx entry is
  // raised by the dispatch (which runs the layout again).
  Layout get_dispatch_layout(const TensorView& topk_idx, int64_t num_experts, Stream stream);
  // Collective, as Buffer::dispatch / Buffer::combine.
  DispatchResult dispatch(const DispatchArgs& args);
  CombineResult combine(const CombineArgs& args);
  // Waits (bounded by the group's timeout) for this rank's last network exchange: Error(kTimeout) when a peer never
  // posted its part (NCCL groups; see ByteExchange::wait_finished). The buffer's destructor calls it before it
  // synchronizes the stream of its last call, which would otherwise wait for such an exchange forever.
  void wait_exchanges();

 private:
  Tensor empty(DType dtype, const std::vector<int64_t>& shape, Stream stream) const;
  // The layout kernel on topk_idx into one allocation: int32 counts [R] per rank, [E] per expert, [N] per node (the
  // latter filled by the caller), 256-byte aligned, then bool is_token_in_rank [T, R].
  struct LayoutOutput {
    Tensor storage;
    int32_t* counts = nullptr;
    uint8_t* in_rank = nullptr;
  };
  LayoutOutput run_layout(const TensorView& topk_idx, int64_t num_experts, ErrorRecord* error, cudaStream_t stream);
  // The fresh dispatch's routing: layout, per-node scan, the counts to the host (the one sync), checked against
  // args.layout. Fills `routes` with this rank's tensors and counts.
  void route_locally(const DispatchArgs& args, int64_t num_tokens, HierarchicalRoutes& routes);

  CudaGroup& group_;
  std::shared_ptr<Allocator> allocator_;
  Topology topology_;
  int rank_ = 0;
  int num_ranks_ = 0;
  int device_ = 0;
  int num_sms_ = 1;
  bool bf16_partials_ = false;  // NodePartials::kBFloat16
  uint64_t call_seq_ = 0;       // collective calls so far: the same on every rank
  std::unique_ptr<ByteExchange> exchange_;
  ErrorRecord* error_ = nullptr;         // mapped host memory: an invalid topk_idx entry the dispatch's layout found
                                         // ([1]: get_dispatch_layout's, never read)
  ErrorRecord* error_device_ = nullptr;  // its device alias
  int32_t* counts_host_ = nullptr;       // pinned: the layout's counts and the caller's per-node counts
};

}  // namespace epx::cuda
