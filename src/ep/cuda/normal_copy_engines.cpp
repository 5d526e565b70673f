#include <cuda.h>

#include <vector>

#include "core/check.h"
#include "core/cuda/cuda_util.h"
#include "ep/cuda/normal_copy_engines.h"

namespace epx::cuda {

NormalCopyEngines::NormalCopyEngines(bool stream_signals, StageTimeline& timeline)
    : timeline_(timeline), write_value_(stream_signals ? stream_write_value() : nullptr) {
  check_cuda(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking), "cudaStreamCreate (copies)");
  check_cuda(cudaStreamCreateWithFlags(&signal_stream_, cudaStreamNonBlocking), "cudaStreamCreate (signals)");
  std::vector<cudaEvent_t*> events{&ev_start_, &ev_copies_done_, &ev_signals_done_};
  for (auto& e : ev_pack_) events.push_back(&e);
  for (auto& e : ev_copy_) events.push_back(&e);
  for (cudaEvent_t* e : events) {
    check_cuda(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreate");
  }
}

NormalCopyEngines::~NormalCopyEngines() {
  cudaStreamSynchronize(copy_stream_);
  cudaStreamSynchronize(signal_stream_);
  for (cudaEvent_t e : {ev_start_, ev_copies_done_, ev_signals_done_}) cudaEventDestroy(e);
  for (cudaEvent_t e : ev_pack_) cudaEventDestroy(e);
  for (cudaEvent_t e : ev_copy_) cudaEventDestroy(e);
  cudaStreamDestroy(copy_stream_);
  cudaStreamDestroy(signal_stream_);
}

void NormalCopyEngines::start_side_streams(cudaStream_t stream) {
  check_cuda(cudaEventRecord(ev_start_, stream), "cudaEventRecord");
  check_cuda(cudaStreamWaitEvent(copy_stream_, ev_start_, 0), "cudaStreamWaitEvent");
}

void NormalCopyEngines::join(cudaStream_t stream) {
  check_cuda(cudaEventRecord(ev_copies_done_, copy_stream_), "cudaEventRecord");
  check_cuda(cudaStreamWaitEvent(stream, ev_copies_done_, 0), "cudaStreamWaitEvent");
  check_cuda(cudaEventRecord(ev_signals_done_, signal_stream_), "cudaEventRecord");
  check_cuda(cudaStreamWaitEvent(stream, ev_signals_done_, 0), "cudaStreamWaitEvent");
}

void NormalCopyEngines::join_quietly(cudaStream_t stream) noexcept {
  if (cudaEventRecord(ev_copies_done_, copy_stream_) == cudaSuccess) cudaStreamWaitEvent(stream, ev_copies_done_, 0);
  if (cudaEventRecord(ev_signals_done_, signal_stream_) == cudaSuccess) {
    cudaStreamWaitEvent(stream, ev_signals_done_, 0);
  }
}

void NormalCopyEngines::signal_rows(const CommArgs& comm, const RowCounts& rows, int j) {
  // The signal goes on its own stream after an event, so that the copy stream moves on to the next
  // chunk at once (a write on the copy stream itself waits for the copy and a memory barrier first:
  // measured 5% slower, docs/perf-notes.md).
  check_cuda(cudaEventRecord(ev_copy_[j], copy_stream_), "cudaEventRecord");
  check_cuda(cudaStreamWaitEvent(signal_stream_, ev_copy_[j], 0), "cudaStreamWaitEvent");
  if (write_value_ == nullptr) {
    launch_signal_rows(comm, rows, tag(), signal_stream_);
    return;
  }
  // NOTE: the write follows the copies (stream order) and, by default, a system-scope memory barrier:
  // the rows are in the destination's memory before the destination can see the count.
  for (int d = 0; d < comm.num_ranks; ++d) {
    if (d == comm.rank || rows.v[d] < 0) continue;
    auto* addr = reinterpret_cast<uint64_t*>(comm.peers[d] + comm.off_ce_tail) + comm.rank;
    const CUresult r =
        write_value_(signal_stream_, reinterpret_cast<CUdeviceptr>(addr), tag() + static_cast<uint64_t>(rows.v[d]), 0);
    if (r != CUDA_SUCCESS) {
      detail::raise(ErrorCode::kCudaError, "cuStreamWriteValue64 (signal rows) failed: error {}", static_cast<int>(r));
    }
  }
}

void NormalCopyEngines::send_dispatch(const CommArgs& comm, const DispatchKernelArgs& k, const DispatchPlan& plan,
                                      const StageFields& f, int64_t slot_bytes, char* stage_x, char* stage_scales,
                                      int num_sms, cudaStream_t stream) {
  const int R = comm.num_ranks, me = comm.rank;
  const int64_t T = plan.num_tokens, xb = k.x_row_bytes, sb = k.scale_row_bytes;
  // Per remote destination: whole x (chunks of tokens) or SM-packed rows (chunks of rows).
  const RowCounts& send = plan.send_rows;
  const RowCounts& offset = plan.pack_offset;
  const unsigned pack_mask = plan.pack_mask;
  const int num_chunks = plan.dispatch_chunks;
  auto slot_at = [&](int d) { return comm.peers[d] + comm.off_ring + stage_slot(me, d, R) * slot_bytes; };

  ++seq_;
  timeline_.mark("send", stream);
  start_side_streams(stream);
  launch_copy_dispatch_begin(comm, k, f, slot_bytes, copy_stream_);  // waits for the peers' release
  timeline_.mark("begin", copy_stream_);
  CopyBatch batch;
  for (int j = 0; j < num_chunks; ++j) {
    if (pack_mask != 0) {
      launch_pack_fields(comm, k, stage_x, stage_scales, offset, pack_mask, j, num_chunks, num_sms, stream);
      check_cuda(cudaEventRecord(ev_pack_[j], stream), "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(copy_stream_, ev_pack_[j], 0), "cudaStreamWaitEvent");
    }
    RowCounts end{};
    for (int d = 0; d < R; ++d) {
      end.v[d] = -1;
      if (d == me) continue;
      const bool whole = !(pack_mask & (1u << d));
      const int64_t n = whole ? T : send.v[d];
      const int64_t b = chunk_begin(n, num_chunks, j);
      end.v[d] = chunk_begin(n, num_chunks, j + 1);
      const char* from_x = whole ? k.x + b * xb : stage_x + (offset.v[d] + b) * xb;
      batch.add(slot_at(d) + f.x + b * xb, from_x, (end.v[d] - b) * xb);
      if (sb > 0) {
        const char* from_s = whole ? k.x_scales + b * sb : stage_scales + (offset.v[d] + b) * sb;
        batch.add(slot_at(d) + f.scales + b * sb, from_s, (end.v[d] - b) * sb);
      }
    }
    batch.issue(copy_stream_);
    timeline_.mark("copy", copy_stream_);
    signal_rows(comm, end, j);
  }
}

void NormalCopyEngines::send_combine(const CommArgs& comm, const CombineKernelArgs& k, const DispatchPlan& plan,
                                     int64_t slot_bytes, int64_t weights_offset, cudaStream_t stream) {
  const int R = comm.num_ranks, me = comm.rank;
  const int64_t H = k.hidden, K = k.num_topk;
  // Rows this rank received from d in dispatch go back to d: x[rank_prefix(d) + i], contiguous.
  const RowCounts& rows = plan.combine_rows;
  const RowCounts& base = plan.combine_base;
  const int num_chunks = plan.combine_chunks;
  ++seq_;
  timeline_.mark("send", stream);
  start_side_streams(stream);
  // NOTE: the copies overwrite peers' staging: wait until they finished reading the previous operation.
  launch_wait_released(comm, kSiteCopyCombineReleased, copy_stream_);
  timeline_.mark("released", copy_stream_);
  auto slot_at = [&](int d) { return comm.peers[d] + comm.off_ring + stage_slot(me, d, R) * slot_bytes; };
  CopyBatch batch;
  for (int d = 0; d < R && k.topk_weights != nullptr; ++d) {
    if (d != me) {
      batch.add(slot_at(d) + weights_offset, k.topk_weights + base.v[d] * K, rows.v[d] * K * 4);
    }
  }
  for (int j = 0; j < num_chunks; ++j) {
    RowCounts end{};
    for (int d = 0; d < R; ++d) {
      end.v[d] = -1;
      if (d == me) continue;
      const int64_t b = chunk_begin(rows.v[d], num_chunks, j);
      end.v[d] = chunk_begin(rows.v[d], num_chunks, j + 1);
      batch.add(slot_at(d) + b * H * 2, k.x + (base.v[d] + b) * H, (end.v[d] - b) * H * 2);
    }
    batch.issue(copy_stream_);
    timeline_.mark("copy", copy_stream_);
    signal_rows(comm, end, j);
  }
}

}  // namespace epx::cuda
