// Low-latency mailboxes of the host backend (private; see host_buffer.h for the protocol).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ep/low_latency_scales.h"
#include "ep/validate.h"
#include "epx/quant.h"
#include "epx/tensor.h"
#include "comm/host/host_group.h"

namespace epx::host {

enum class LowLatencyKind : int { kDispatch, kCombine };

// One rank's message for one low-latency call: immutable once posted, freed by reference count.
struct LowLatencyPost {
  LowLatencyKind kind = LowLatencyKind::kDispatch;
  uint64_t seq = 0;        // the sender's low-latency call number (1, 2, ...)
  std::vector<bool> mask;  // the sender's rank mask when it posted
  // The sender failed this call before it could send (invalid input): receivers raise kPeerFailure.
  bool failed = false;
  std::string reason;
  int64_t hidden = 0;
  // Dispatch: the sender's tokens.
  int64_t num_tokens = 0, num_topk = 0, max_tokens = 0, num_experts = 0;
  bool use_fp8 = false;
  ScaleFormat scale_format = ScaleFormat::kFloat32;
  std::vector<int64_t> topk;    // [T, K]
  std::vector<uint8_t> x;       // [T, H]: bf16, or fp8 after quantize_fp8_host
  std::vector<uint8_t> scales;  // [T, H / 128]: fp32 or uint8; fp8 only
  // Combine: the expert outputs of the received slots, per (local expert, destination rank) block.
  // dispatch_seq and num_local_experts identify the dispatch being reversed; receivers check them
  // before indexing the blocks.
  uint64_t dispatch_seq = 0;
  int64_t num_local_experts = 0;
  std::vector<int64_t> block_offset;  // [E_local, R]: first row of the block in `rows`
  std::vector<int32_t> block_count;   // [E_local, R]
  std::vector<uint16_t> rows;         // bf16 [sum of counts, H]
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
  std::vector<int32_t> recv_block_count;  // [E_local, R]: pairs received per block (set on receive)
  int set_idx = 0;
  uint64_t dispatch_number = 0;  // the buffer's dispatch count, never reset: owner of the buffer set
  std::shared_ptr<void> recv_x, recv_x_scales, recv_count, recv_src_info, recv_layout_range;
  TensorView cumulative_recv_counts;
  // Combine.
  std::shared_ptr<const LowLatencyState> dispatch;
  std::vector<float> topk_weights;  // [T, K]
  TensorView out;                   // [T, H] bf16
};

}  // namespace epx::host
