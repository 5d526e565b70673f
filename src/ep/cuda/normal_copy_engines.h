// The copy-engine path's orchestration on the host (NormalEngine's part for NormalPath::kCopyEngine): the side
// streams and events, the chunked transfers into the peers' staging slots and the signals that announce them.
// Private to the CUDA backend; protocol: docs/normal-kernels.md, "copy engines".
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <exception>

#include "ep/cuda/copy_engine_host.h"
#include "ep/cuda/normal_kernels.h"
#include "ep/cuda/normal_plan.h"

namespace epx::cuda {

class NormalCopyEngines {
 public:
  // Creates the copy and signal streams and the events. stream_signals: NormalConfig::stream_signals.
  NormalCopyEngines(bool stream_signals, StageTimeline& timeline);
  // Waits for the side streams, then destroys them and the events.
  ~NormalCopyEngines();
  NormalCopyEngines(const NormalCopyEngines&) = delete;
  NormalCopyEngines& operator=(const NormalCopyEngines&) = delete;

  // The send side of a copy-engine dispatch (on the copy stream; SM packing into the packing stage at stage_x /
  // stage_scales on `stream`), enqueued before the outputs exist. The receive side is one launch_unpack_fields on
  // `stream` with tag(), then join.
  void send_dispatch(const CommArgs& comm, const DispatchKernelArgs& k, const DispatchPlan& plan, const StageFields& f,
                     int64_t slot_bytes, char* stage_x, char* stage_scales, int num_sms, cudaStream_t stream);
  // The send side of a copy-engine combine; the receive side is launch_combine_reduce with tag(), then join.
  void send_combine(const CommArgs& comm, const CombineKernelArgs& k, const DispatchPlan& plan, int64_t slot_bytes,
                    int64_t weights_offset, cudaStream_t stream);
  // The side streams fork from `stream` at a send and join it again at the end of the call.
  void join(cudaStream_t stream);
  // join for a call that leaves by an exception: the same stream order, errors ignored (never throws).
  void join_quietly(cudaStream_t stream) noexcept;
  // Counts a copy-engine operation this rank does not send in: a fresh dispatch whose peer started its early
  // copies before notify and that then takes the SM rings. The tags stay alike on every rank.
  void count_operation() { ++seq_; }
  // The tag of this copy-engine operation's ce_tail signals: a host count (the same on every rank: all take the
  // copy-engine path alike), never replayed by a graph (the path is not taken under capture).
  uint64_t tag() const { return seq_ << 32; }
  // The buffer's reset zeroed the ce_tail signals: the count starts again.
  void reset_tags() { seq_ = 0; }

 private:
  void start_side_streams(cudaStream_t stream);
  // After copy_stream_'s copies of chunk j: ce_tail[me] = tag() + rows.v[d] at every remote d with
  // rows.v[d] >= 0 (from signal_stream_).
  void signal_rows(const CommArgs& comm, const RowCounts& rows, int j);

  StageTimeline& timeline_;
  cudaStream_t copy_stream_ = nullptr;    // copy-engine transfers into peers' staging
  cudaStream_t signal_stream_ = nullptr;  // announces finished transfers (stream writes, else a kernel)
  WriteValue64 write_value_ = nullptr;
  uint64_t seq_ = 0;  // copy-engine operations so far (tag)
  cudaEvent_t ev_start_ = nullptr, ev_copies_done_ = nullptr, ev_signals_done_ = nullptr;
  cudaEvent_t ev_pack_[kMaxCopyChunks] = {};
  cudaEvent_t ev_copy_[kMaxCopyChunks] = {};
};

// A call that leaves by an exception after its side streams forked (a copy-engine send enqueued; the output
// allocation or a later launch threw) joins them into `stream` first: the copies still read x, the scales copy and
// the packing stage, which are freed on (or by the caller after) `stream`, and still write signals that a reset
// would otherwise race. Declare it after every tensor the copies read, so that it runs before they are freed.
class JoinOnThrow {
 public:
  JoinOnThrow(NormalCopyEngines& copy, cudaStream_t stream) : copy_(copy), stream_(stream) {}
  ~JoinOnThrow() {
    if (std::uncaught_exceptions() > exceptions_) copy_.join_quietly(stream_);
  }
  JoinOnThrow(const JoinOnThrow&) = delete;
  JoinOnThrow& operator=(const JoinOnThrow&) = delete;

 private:
  NormalCopyEngines& copy_;
  cudaStream_t stream_;
  int exceptions_ = std::uncaught_exceptions();
};

}  // namespace epx::cuda
