// Low-latency mailboxes of the host backend (private; see host_buffer.h for the protocol).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/host/host_group.h"
#include "ep/low_latency_scales.h"
#include "ep/validate.h"
#include "epx/quant.h"
#include "epx/tensor.h"

namespace epx::host {

enum class LowLatencyKind : int { kDispatch, kCombine };

// One source rank's tokens for one destination node: the tokens with an expert on that node, by ascending token
// index. With the hierarchical routing it is what crosses the network once, to the forwarder (node, source's local
// index); the flat routing is the same with one node holding every rank (host_low_latency_routing.cpp).
struct LowLatencyNodeMessage {
  int64_t num_records = 0;
  std::vector<int32_t> src_idx;  // [n]: the token's index on its source rank
  std::vector<int64_t> topk;     // [n, K]: the token's expert ids on this node, -1 in the other slots
  std::vector<uint8_t> x;        // [n, row bytes]: bf16, or fp8 after quantize_fp8_host
  std::vector<uint8_t> scales;   // [n, H / 128 wire scales]: fp32 or uint8; fp8 only
};

// One rank's message for one low-latency call: immutable once posted, freed by reference count.
struct LowLatencyPost {
  LowLatencyKind kind = LowLatencyKind::kDispatch;
  uint64_t seq = 0;        // the sender's low-latency call number (1, 2, ...)
  std::vector<bool> mask;  // the sender's rank mask when it posted
  // The sender failed this call before it could send (invalid input): receivers raise kPeerFailure.
  bool failed = false;
  std::string reason;
  int64_t hidden = 0;
  // Dispatch: the sender's tokens, one message per node of its routing (LowLatencyRoute).
  int64_t num_tokens = 0, num_topk = 0, max_tokens = 0, num_experts = 0;
  bool use_fp8 = false;
  ScaleFormat scale_format = ScaleFormat::kFloat32;
  std::vector<LowLatencyNodeMessage> node_messages;  // [routing nodes]
  // Combine: the expert outputs of the received slots, per (local expert, destination rank) block.
  // dispatch_seq and num_local_experts identify the dispatch being reversed; receivers check them
  // before indexing the blocks.
  uint64_t dispatch_seq = 0;
  int64_t num_local_experts = 0;
  std::vector<int64_t> block_offset;  // [E_local, R]: first row of the block in `rows`
  std::vector<int32_t> block_count;   // [E_local, R]
  std::vector<uint16_t> rows;         // bf16 [sum of counts, H]
  // As a source: the weights of its records in each node message of the dispatch, for that node's forwarder.
  std::vector<std::vector<float>> node_weights;  // [routing nodes] -> [records, K]
};

// The low-latency routing of one buffer (BufferOptions::low_latency_routing) as a topology: the group's with the
// hierarchical routing, one node of every rank with the flat one, so both take the same code. Rank (n, l) of the
// topology is n * G + l; experts are split evenly over the ranks.
struct LowLatencyRoute {
  Topology topology;

  // The rank that receives src's tokens for `node` and forwards them there (src itself on its own node).
  int forwarder(int src, int node) const { return topology.rank_of(node, topology.local_rank_of(src)); }
  int node_of_expert(int64_t expert, int64_t num_local_experts) const {
    return static_cast<int>(expert / (num_local_experts * topology.gpus_per_node));
  }
  // Whether src's pairs for dst travel in the call whose posts are `posts`, as collected by src or dst (null where
  // masked): the links src-dst, src-f and f-dst are all open, f = forwarder(src, node of dst); a link is open when
  // both ends posted and neither post masks the other end (Buffer::mask_rank).
  bool reaches(const std::vector<std::shared_ptr<const LowLatencyPost>>& posts, int src, int dst) const;
  // This rank's dispatch messages, one per node (topk [T, K], T rows of row_bytes, T scale rows of scale_bytes).
  // node_slot [T, N]: the token's record in each, -1 if none.
  std::vector<LowLatencyNodeMessage> pack(const std::vector<int64_t>& topk, int64_t num_tokens, int64_t num_topk,
                                          const uint8_t* x, size_t row_bytes, const uint8_t* scales, size_t scale_bytes,
                                          int64_t num_local_experts, std::vector<int32_t>& node_slot) const;
};

// Shared by the same-numbered low-latency buffers of all ranks of one host world.
struct LowLatencyMailbox {
  static constexpr size_t kMaxPostsPerRank = 4;  // a rank more calls behind than this is masked

  std::mutex mutex;
  std::condition_variable cv;
  std::vector<std::deque<std::shared_ptr<const LowLatencyPost>>> posts;  // [R], oldest first
  int num_attached = 0;                                                  // buffers of this mailbox still alive
};

// The mailbox of this rank's next low-latency buffer. Ranks pair their buffers by creation order.
std::shared_ptr<LowLatencyMailbox> attach_mailbox(HostGroup& group);
// This rank's buffer is going away. Its posts stay readable (a peer may not have read its last one
// yet); the last buffer to detach drops every post.
void detach_mailbox(LowLatencyMailbox& mailbox, int rank);

// The state of one low-latency call, shared by its handle and its receive hook.
struct LowLatencyState {
  const void* owner = nullptr;  // the HostBuffer
  LowLatencyKind kind = LowLatencyKind::kDispatch;
  uint64_t seq = 0;
  uint64_t epoch = 0;  // HostBuffer::ll_epoch_ when made
  bool received = false;
  ep::LowLatencyShape shape;
  int64_t max_tokens = 0, num_experts = 0;
  bool use_fp8 = false;
  ScaleFormat scale_format = ScaleFormat::kFloat32;  // between ranks (UE8M0 also for round_scale)
  ep::LowLatencyScales scales;                       // what the receiver returns
  // Dispatch.
  std::vector<int64_t> topk;              // [T, K]
  std::vector<int32_t> slot_idx;          // [T, K]: index of (t, k) in its (expert, rank) block, -1 if none
  std::vector<int32_t> node_slot;         // [T, N]: the token's record in the message to each node, -1 if none
  std::vector<int32_t> recv_block_count;  // [E_local, R]: pairs received per block (set on receive)
  int set_idx = 0;
  uint64_t dispatch_number = 0;  // the buffer's dispatch count, never reset: owner of the buffer set
  std::shared_ptr<void> recv_x, recv_x_scales, recv_count, recv_src_info, recv_layout_range;
  TensorView cumulative_recv_counts;
  TensorView wait_recv_cost_ns;  // the call's (LowLatency{Dispatch,Combine}Args), or undefined
  // Combine.
  std::shared_ptr<const LowLatencyState> dispatch;
  TensorView out;  // [T, H] bf16
};

}  // namespace epx::host
