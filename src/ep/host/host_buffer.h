// The host backend of epx::Buffer (private): ranks are threads of one process.
//
// Normal mode moves data through HostGroup's two-phase rendezvous: every rank publishes a read-only
// description of its inputs (exchange), every rank pulls the rows addressed to it, then all release.
// Low-latency mode uses a per-buffer mailbox shared by the ranks' buffers (host_low_latency.cpp; the routing
// and receive sides, flat or hierarchical, in host_low_latency_routing.cpp):
// a sender posts an immutable, reference-counted copy of what it sends and never waits; a receiver
// waits, with the group's timeout, only for the ranks it has not masked. So a masked or dead rank is
// never waited on, and no rank ever reads memory that its owner may still change.
// See docs/host-backend.md for the exact semantics (orders, accumulation order, masking, timeouts).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "comm/host/host_group.h"
#include "ep/host/host_low_latency.h"
#include "ep/host/host_normal.h"
#include "ep/validate.h"
#include "epx/buffer.h"

namespace epx::host {

// Receive-side storage of one low-latency buffer set (two alternate).
struct LowLatencyRecvSet {
  int64_t max_tokens = 0, hidden = 0, num_local_experts = 0;
  std::shared_ptr<void> x;             // [E_local, R * M, H] elements of up to 2 bytes
  std::shared_ptr<void> x_scales;      // [E_local, R * M, H / 128] elements of up to 4 bytes
  std::shared_ptr<void> count;         // int32 [E_local]
  std::shared_ptr<void> src_info;      // int32 [E_local, R * M]
  std::shared_ptr<void> layout_range;  // int64 [E_local, R]
  uint64_t owner_dispatch = 0;         // LowLatencyState::dispatch_number of the result the set holds
};

class HostBuffer final : public Buffer {
 public:
  HostBuffer(std::shared_ptr<Group> group, HostGroup* host_group, const BufferOptions& options);
  ~HostBuffer() override;

  Group& group() override { return *group_; }
  Layout get_dispatch_layout(const TensorView& topk_idx, int64_t num_experts, Stream stream) override;
  DispatchResult dispatch(const DispatchArgs& args) override;
  CombineResult combine(const CombineArgs& args) override;
  LowLatencyDispatchResult low_latency_dispatch(const LowLatencyDispatchArgs& args) override;
  LowLatencyCombineResult low_latency_combine(const LowLatencyCombineArgs& args) override;
  void mask_rank(int rank) override;
  void unmask_rank(int rank) override;
  std::vector<bool> rank_mask() const override { return mask_; }
  void clear_rank_mask() override;
  NormalRouting normal_routing() const override {
    return hierarchical_ ? NormalRouting::kHierarchical : NormalRouting::kFlat;
  }
  LowLatencyRouting low_latency_routing() const override {
    return ll_hierarchical_ ? LowLatencyRouting::kHierarchical : LowLatencyRouting::kFlat;
  }
  void clean_low_latency_buffer() override;

  Tensor alloc(DType dtype, const std::vector<int64_t>& shape) const;

 private:
  // Sets the outputs every normal dispatch shares (prefix matrix, expert counts, handle) from its routes.
  void finish_dispatch(DispatchResult& result, std::shared_ptr<const Routes> routes, int64_t num_rows,
                       int64_t num_worst_tokens) const;
  // The hierarchical routing (host_hierarchical.cpp), after dispatch()/combine() validated their arguments and
  // built this rank's post.
  DispatchResult dispatch_hierarchical(const DispatchArgs& args, std::shared_ptr<const Routes> cached,
                                       const std::optional<HostLayout>& layout, DispatchPost& mine);
  CombineResult combine_hierarchical(const CombineArgs& args, const HostDispatchHandle& handle,
                                     const CombinePost& mine);
  // Post this rank's message of low-latency call `seq` (never blocks).
  void post(std::shared_ptr<const LowLatencyPost> message);
  // Waits until every rank not masked has posted call `seq` of `kind`, or the group timeout. Ranks that
  // did not post in time, posted something else, or masked this rank are masked here. Returns the
  // posts by rank (null where masked).
  // A post flagged as failed (a peer's invalid input) raises Error(kPeerFailure) naming it, after the wait.
  // wait_ns: optional int64 [R] (wait_recv_cost_ns): entry r grows by the time until r's post was there.
  std::vector<std::shared_ptr<const LowLatencyPost>> collect(uint64_t seq, int kind, const TensorView& wait_ns = {});
  // Runs prepare() (the validation of a low-latency call). If it throws, posts a failure for call
  // ++ll_seq_ first, so that peers raise at once and the sequence numbers stay in step.
  template <typename Prepare>
  void prepare_or_post_failure(LowLatencyKind kind, Prepare&& prepare);
  // The receive sides (host_low_latency_routing.cpp): the forwarders' legs computed from the call's posts.
  void finish_dispatch_receive(const std::shared_ptr<LowLatencyState>& state);
  void finish_combine_receive(const std::shared_ptr<LowLatencyState>& state);
  // Raises (once) pending_timeout_ as kTimeout; the end of a combine's receive calls it.
  void raise_pending_timeout();

  std::shared_ptr<Group> group_;
  HostGroup* host_group_;
  BufferOptions options_;
  int rank_;
  int num_ranks_;
  Topology topology_;
  bool hierarchical_;         // normal dispatch/combine take the hierarchical routing (BufferOptions::normal_routing)
  bool ll_hierarchical_;      // BufferOptions::low_latency_routing resolved
  LowLatencyRoute ll_route_;  // BufferOptions::low_latency_routing: the group's topology, or one node (flat)
  std::vector<bool> mask_;
  std::shared_ptr<LowLatencyMailbox> mailbox_;
  uint64_t ll_seq_ = 0;             // low-latency calls since creation or clean (the same on every rank)
  uint64_t ll_epoch_ = 0;           // clean_low_latency_buffer calls: handles and hooks of older epochs are stale
  uint64_t ll_num_dispatches_ = 0;  // never reset: names a dispatch's buffer set
  int64_t ll_max_tokens_ = 0;       // fixed by the first low-latency dispatch
  LowLatencyRecvSet recv_sets_[2];
  // LowLatencyConfig::raise_on_timeout: the ranks masked since the last raise, raised as kTimeout once this rank's
  // low-latency round is complete (end of a combine's receive), so the call sequence stays in step with the peers.
  std::string pending_timeout_;
};

}  // namespace epx::host
