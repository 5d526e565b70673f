// The normal (high-throughput) half of the cuda Buffer: owns the normal path's peer-visible region, its error
// records, streams and the copy-engine orchestration, and runs the kernels of normal_kernels.h behind the Buffer
// contract (private to the CUDA backend). The collective error protocol (what a recorded error or an early exit
// means for the peers, the reset) stays with the buffer, which the engine calls through NormalCallHooks.
//
// Each call is plan, then run: the host checks and sizes the call first (rows, ring rows), the routing's plan
// (DispatchPlan, made once per fresh dispatch and kept in the handle) and the call's shapes choose the data path
// (NormalStep), and the run only enqueues. Protocol: docs/normal-kernels.md.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/cuda/peer_memory.h"
#include "ep/cuda/copy_engine_host.h"
#include "ep/cuda/normal_copy_engines.h"
#include "ep/cuda/normal_kernels.h"
#include "ep/cuda/normal_plan.h"
#include "ep/validate.h"
#include "epx/buffer.h"

namespace epx::cuda {

// What the engine needs of the buffer's collective error protocol (CudaBuffer; docs/reliability.md).
class NormalCallHooks {
 public:
  // Before the call enqueues anything: raises what earlier calls recorded and runs a pending reset (which may
  // synchronize `stream`). keep_invalid_topk: leave an invalid-topk record for this dispatch's notify to carry.
  virtual void begin_collective(Stream stream, bool keep_invalid_topk) = 0;
  // Right before the call's first protocol kernel is enqueued: from then on the peers meet this rank in the call.
  virtual void mark_enqueued() = 0;
  // Raises (once) what the device recorded (error_records()).
  virtual void raise_recorded_errors() = 0;
  // The current call's number, alike on every rank (after begin_collective): a fresh dispatch's handle keeps it
  // as its id, which the kernels of its cached dispatches and combines compare across ranks (kErrHandleMismatch).
  virtual uint64_t call_id() const = 0;

 protected:
  ~NormalCallHooks() = default;
};

// One call's sizes and data path, fixed on the host before its data step is enqueued.
struct NormalStep {
  NormalPath path = NormalPath::kSmRing;
  int64_t row_bytes = 0;       // SM rings: bytes of one ring row
  int64_t ring_rows = 0;       // SM rings: rows of one (source, channel) ring
  int64_t slot_bytes = 0;      // copy engines: bytes of each staging slot
  StageFields fields{};        // copy-engine dispatch: the fields in a slot
  int64_t weights_offset = 0;  // copy-engine combine: where a slot's top-k weights rows start (x rows from 0)
};

class NormalDispatchHandle;

class NormalEngine {
 public:
  // Checks the options (the user's names in the messages), allocates the region, the error records, the streams
  // and events, and loads the normal kernels (preload_normal_kernels). Not collective: open_peers is.
  NormalEngine(Group& group, int num_sms, int64_t num_normal_bytes, std::shared_ptr<Allocator> allocator,
               const NormalConfig& config);
  // Frees what the constructor made; the caller first made sure no peer writes into the region any more.
  ~NormalEngine();
  NormalEngine(const NormalEngine&) = delete;
  NormalEngine& operator=(const NormalEngine&) = delete;

  // Collective over the group: maps every rank's region, or with gpus_per_node > 0 only those of this rank's node
  // (the hierarchical routing, which never runs the flat kernels; the others' entries stay null).
  void open_peers(bool single_process, int gpus_per_node = 0);

  Layout get_dispatch_layout(const TensorView& topk_idx, int64_t num_experts, Stream stream, NormalCallHooks& hooks);
  DispatchResult dispatch(const DispatchArgs& args, NormalCallHooks& hooks);
  CombineResult combine(const CombineArgs& args, NormalCallHooks& hooks);

  // The error records in mapped host memory [2]: [0] timeouts and aborts, [1] bad values (ErrorRecord).
  ErrorRecord* error_records() const { return errors_; }
  // Rank r's abort word (its region, as mapped here; null where open_peers did not map it).
  char* abort_word(int r) const { return comm_.peers[r] != nullptr ? comm_.peers[r] + comm_.off_abort : nullptr; }
  // The buffer's reset: zeroes this rank's signal area (on `stream`, then synchronizes it), restarts the
  // copy-engine tags and clears the error records.
  void reset_signals(Stream stream);

 private:
  Tensor empty(DType dtype, const std::vector<int64_t>& shape, Stream stream) {
    return Tensor::empty(dtype, shape, group_.device(), allocator_, stream);
  }
  Layout compute_layout(const TensorView& topk_idx, int64_t num_experts, Stream stream);
  // Rows of row_bytes in one (source, channel) ring; kInvalidArgument when fewer than kNormalMinRingRows fit.
  int64_t ring_rows_for(int64_t row_bytes) const;
  // A fresh dispatch's routing up to notify: the layout (or a copy of the caller's), scan, epoch (with the call's
  // shape word, ep::encode_call_shape).
  std::shared_ptr<NormalDispatchHandle> begin_fresh(const DispatchArgs& args, const ep::DispatchShape& shape,
                                                    uint64_t shape_word, NormalCallHooks& hooks);
  // The fresh dispatch's notify (early_mask: the destinations whose whole-x copy already started), which also
  // compares every rank's shape word with this one's; without num_worst_tokens it waits for notify and makes the
  // plan from the counts.
  void notify(NormalDispatchHandle& h, const DispatchArgs& args, unsigned early_mask, uint64_t shape_word,
              NormalCallHooks& hooks);
  // The destinations (bits) whose whole-x copy a fresh dispatch with kernel arguments k starts before notify into
  // staging slots of slot_bytes (NormalConfig::early_copies; docs/normal-kernels.md, "Early copies"); 0: none.
  unsigned early_copy_mask(const DispatchArgs& args, const DispatchKernelArgs& k, int64_t slot_bytes) const;
  // Reads recv_meta to the host (synchronizes `stream`; `what` names the wait in errors).
  void read_counts(const NormalDispatchHandle& h, Stream stream, const char* what);
  // The data path of a dispatch (kernel arguments k) or of a combine with hidden H and K weights per row.
  void choose_dispatch_path(NormalStep& step, const DispatchPlan& plan, const DispatchArgs& args,
                            const DispatchKernelArgs& k) const;
  void choose_combine_path(NormalStep& step, const DispatchPlan& plan, int64_t H, int K, Stream stream) const;

  Group& group_;
  std::shared_ptr<Allocator> allocator_;
  int rank_ = 0;
  int num_ranks_ = 0;
  int device_ = 0;
  int num_channels_ = 1;
  // BufferOptions::num_sms: sizes the channels (rings, signals); a call may use fewer SMs (DispatchArgs::num_sms).
  int num_sms_ = 1;
  NormalConfig config_;  // the same on every rank (Buffer::create checked it)
  int64_t region_bytes_ = 0;
  void* region_ = nullptr;
  PeerRegions peer_regions_;
  ErrorRecord* errors_ = nullptr;         // mapped host memory [2]
  ErrorRecord* errors_device_ = nullptr;  // its device alias
  int32_t* meta_host_ = nullptr;          // pinned staging of the receive counts
  CommArgs comm_{};
  StageTimeline timeline_{false};
  std::unique_ptr<NormalCopyEngines> copy_;
  // The previous fresh dispatch without num_worst_tokens on two ranks: its tokens and the rows it sent the peer
  // (EarlyCopies::kAuto's guess of the next one's share; 0 tokens: none yet).
  int64_t last_fresh_tokens_ = 0;
  int64_t last_fresh_peer_rows_ = 0;
};

}  // namespace epx::cuda
