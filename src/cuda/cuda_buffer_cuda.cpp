// The cuda backend's Buffer: peer memory, the normal kernels' host side, handles and errors.
// NOTE: ~780 lines because the facade and the normal path's engine are still one class (CudaBuffer); the
// low-latency engine, the copy-engine helpers (copy_engine_host.h) and the region layout (normal_region.h) are
// out already. Splitting off a NormalEngine with a plan/run interface is the next step of issue 14, to be made
// with the 2-GPU tests at hand.
#include <cuda.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/limits.h"
#include "core/timeout.h"
#include "cuda/copy_engine_host.h"
#include "cuda/cuda_group.h"
#include "cuda/cuda_util.h"
#include "cuda/low_latency_engine.h"
#include "cuda/normal_kernels.h"
#include "cuda/peer_memory.h"
#include "ep/backends.h"
#include "ep/validate.h"
#include "epx/log.h"

namespace epx::cuda {
namespace {

class CudaDispatchHandle final : public DispatchHandle {
 public:
  int64_t num_tokens() const override { return num_tokens_; }
  int64_t num_recv_tokens() const override { return num_recv_; }
  const Tensor& rank_prefix_matrix() const override { return rank_prefix; }

  const void* owner = nullptr;  // the buffer that made it
  int num_channels = 0;
  int num_local_experts = 0;
  int64_t num_tokens_ = 0;
  int64_t num_recv_ = -1;                   // -1: unknown on the host (worst-token mode)
  int64_t num_rows = 0;                     // rows of the dispatch outputs
  Tensor is_token_in_rank;                  // uint8 [T, R]
  Tensor excl_pos;                          // int32 [R][T + 1]
  Tensor list_tok;                          // int32 [R][T]
  Tensor chan_start;                        // int32 [R][C + 1]
  Tensor recv_meta;                         // int32 RecvMetaLayout
  Tensor recv_expert_counts;                // int32 [E_local]
  Tensor rank_prefix;                       // int32 [R, R], written by notify
  std::vector<int32_t> expert_counts_host;  // empty when unknown
  std::vector<int32_t> meta_host;           // recv_meta on the host; empty when unknown (worst-token mode)
};

class CudaBuffer final : public Buffer {
 public:
  CudaBuffer(std::shared_ptr<Group> group, const BufferOptions& options)
      : group_(std::move(group)),
        allocator_(options.allocator ? options.allocator : default_allocator()),
        config_(options.normal),
        write_value_(options.normal.stream_signals ? stream_write_value() : nullptr),
        timeline_(options.normal.stage_timeline) {
    ep::agree_on_options(*group_, options);  // first: every rank fails alike, before any local check
    cgroup_ = dynamic_cast<CudaGroup*>(group_.get());
    EPX_CHECK_ARG(cgroup_ != nullptr, "group must be a cuda group (see epx/cuda.h)");
    rank_ = group_->rank();
    num_ranks_ = group_->num_ranks();
    device_ = group_->device().index;
    EPX_CHECK(ErrorCode::kUnsupported, num_ranks_ <= kNormalMaxRanks,
              "the cuda backend supports up to {} ranks per host, got {}", kNormalMaxRanks, num_ranks_);
    num_channels_ = std::clamp(options.num_sms / 2, 1, kNormalMaxChannels);
    num_sms_ = std::max(1, options.num_sms);
    EPX_CHECK_ARG(options.num_sms <= 2 * kNormalMaxChannels, "num_sms must be <= {} on the cuda backend, got {}",
                  2 * kNormalMaxChannels, options.num_sms);
    int64_t bytes = options.num_normal_bytes;
    if (bytes == 0) bytes = normal_buffer_size_hint(8192, num_ranks_, options.num_sms);
    EPX_CHECK_ARG(bytes > kNormalSignalBytes, "num_normal_bytes must be > {} (signals) on the cuda backend, got {}",
                  kNormalSignalBytes, bytes);
    region_bytes_ = align_up(bytes, 4096);

    DeviceGuard guard(device_);
    check_cuda(cudaMalloc(&region_, region_bytes_), "cudaMalloc (peer region)");
    check_cuda(cudaMemset(region_, 0, kNormalSignalBytes), "cudaMemset (signals)");
    check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&errors_), 2 * sizeof(ErrorRecord),
                             cudaHostAllocMapped | cudaHostAllocPortable),
               "cudaHostAlloc (error records)");
    std::memset(errors_, 0, 2 * sizeof(ErrorRecord));
    check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&errors_device_), errors_, 0),
               "cudaHostGetDevicePointer");
    check_cuda(cudaHostAlloc(reinterpret_cast<void**>(&meta_host_), sizeof(int32_t) * 8192, cudaHostAllocPortable),
               "cudaHostAlloc (receive counts)");
    check_cuda(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking), "cudaStreamCreate (copies)");
    check_cuda(cudaStreamCreateWithFlags(&signal_stream_, cudaStreamNonBlocking), "cudaStreamCreate (signals)");
    check_cuda(cudaStreamCreateWithFlags(&abort_stream_, cudaStreamNonBlocking), "cudaStreamCreate (abort)");
    for (cudaEvent_t* e : all_events()) {
      check_cuda(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreate");
    }
    // NOTE: load every protocol kernel now, before the barrier below: with lazy loading a kernel's first
    // launch waits for the device to drain, which deadlocks against a peer's spinning kernel when ranks
    // share a process and a GPU (see preload_normal_kernels).
    check_cuda(preload_normal_kernels(), "cudaFuncGetAttributes (preload normal kernels)");
    check_cuda(preload_low_latency_kernels(), "cudaFuncGetAttributes (preload low-latency kernels)");
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    world_ = share_world(*cgroup_);  // collective
    if (world_ == nullptr) {
      log(LogLevel::kWarn, fmt::format("epx cuda rank {}: no shared memory with the other ranks' processes (ranks "
                                       "on several hosts, or no /dev/shm): after a timeout of the normal path "
                                       "this buffer must be destroyed and made again on every rank",
                                       rank_));
    }
    open_peers();
    if (world_ != nullptr) seen_generation_ = world_->reset_generation.load();
    group_->barrier();
    if (options.num_low_latency_bytes > 0) {
      low_latency_ = std::make_unique<LowLatencyEngine>(*group_, cgroup_->single_process(), device_,
                                                        options.num_low_latency_bytes, allocator_, options.low_latency);
    }

    comm_.rank = rank_;
    comm_.num_ranks = num_ranks_;
    comm_.num_channels = num_channels_;
    const NormalRegionLayout region = NormalRegionLayout::make(num_ranks_, num_channels_, region_bytes_);
    comm_.off_epoch = region.off_epoch;
    comm_.off_tail = region.off_tail;
    comm_.off_head = region.off_head;
    comm_.off_done = region.off_done;
    comm_.off_notify_flag = region.off_notify_flag;
    comm_.off_notify = region.off_notify;
    comm_.off_copy_counter = region.off_copy_counter;
    comm_.off_ce_tail = region.off_ce_tail;
    comm_.off_abort = region.off_abort;
    comm_.signal_bytes = kNormalSignalBytes;
    comm_.off_ring = region.off_ring;
    comm_.ring_bytes = region.ring_bytes;
    comm_.ring_slab_bytes = region.ring_slab_bytes;
    comm_.timeout_ns = static_cast<uint64_t>(detail::timeout_ns(group_->timeout_ms()));
    comm_.error = errors_device_;
  }

  ~CudaBuffer() override {
    DeviceGuard guard(device_);
    // NOTE: peers may still write into our region until they finished their last call: wait for them.
    try {
      if (last_stream_ != nullptr) cudaStreamSynchronize(last_stream_);
      group_->barrier();
    } catch (...) {
    }
    close_peer_regions(peer_regions_);
    cudaStreamSynchronize(copy_stream_);
    cudaStreamSynchronize(signal_stream_);
    for (cudaEvent_t* e : all_events()) cudaEventDestroy(*e);
    cudaStreamDestroy(copy_stream_);
    cudaStreamDestroy(signal_stream_);
    cudaStreamSynchronize(abort_stream_);
    cudaStreamDestroy(abort_stream_);
    cudaFree(region_);
    cudaFreeHost(errors_);
    cudaFreeHost(meta_host_);
  }

  Group& group() override { return *group_; }

  Layout get_dispatch_layout(const TensorView& topk_idx, int64_t num_experts, Stream stream) override {
    ep::validate_layout_args(topk_idx, num_experts, num_ranks_, group_->device());
    EPX_CHECK_ARG(num_experts <= kNormalMaxExperts, "num_experts must be <= {} on the cuda backend, got {}",
                  kNormalMaxExperts, num_experts);
    DeviceGuard guard(device_);
    raise_recorded_errors();
    return compute_layout(topk_idx, num_experts, stream);
  }

  DispatchResult dispatch(const DispatchArgs& args) override {
    return joined([&] { return run_dispatch(args); });
  }
  CombineResult combine(const CombineArgs& args) override {
    return joined([&] { return run_combine(args); });
  }

  LowLatencyDispatchResult low_latency_dispatch(const LowLatencyDispatchArgs& args) override {
    return low_latency().dispatch(args);
  }
  LowLatencyCombineResult low_latency_combine(const LowLatencyCombineArgs& args) override {
    return low_latency().combine(args);
  }
  void mask_rank(int rank) override { low_latency().mask_rank(rank); }
  void unmask_rank(int rank) override {
    if (low_latency_) {
      low_latency_->unmask_rank(rank);
    } else {  // no low-latency memory: nothing is masked
      EPX_CHECK_ARG(rank >= 0 && rank < num_ranks_, "unmask_rank: rank must be in [0, {}), got {}", num_ranks_, rank);
    }
  }
  std::vector<bool> rank_mask() const override {
    return low_latency_ ? low_latency_->rank_mask() : std::vector<bool>(num_ranks_, false);
  }
  void clear_rank_mask() override {
    if (low_latency_) low_latency_->clear_rank_mask();
  }
  void clean_low_latency_buffer() override {
    if (low_latency_) {
      low_latency_->clean();
    } else {
      group_->barrier();
    }
  }

 private:
  LowLatencyEngine& low_latency() const {
    EPX_CHECK_ARG(low_latency_ != nullptr,
                  "this buffer has no low-latency memory: create it with BufferOptions::num_low_latency_bytes = "
                  "low_latency_buffer_size_hint(...)");
    return *low_latency_;
  }
  void open_peers();
  Layout compute_layout(const TensorView& topk_idx, int64_t num_experts, Stream stream);
  Tensor empty(DType dtype, const std::vector<int64_t>& shape, Stream stream) {
    return Tensor::empty(dtype, shape, group_->device(), allocator_, stream);
  }
  int64_t ring_rows_for(int64_t row_bytes) const {
    const int64_t rows = comm_.ring_slab_bytes / row_bytes;
    EPX_CHECK_ARG(rows >= kNormalMinRingRows,
                  "num_normal_bytes too small: rows of {} bytes need >= {} bytes of ring per rank and channel "
                  "({} ranks, {} channels), have {} in all",
                  row_bytes, kNormalMinRingRows * row_bytes, num_ranks_, num_channels_, comm_.ring_bytes);
    return std::min(rows, kNormalMaxRingRows);
  }
  // Raises (once) what the device recorded since the last call. A timeout also asks every rank of
  // this process to reset its signals on its next call. keep_invalid_topk: leave an invalid-topk record
  // for this dispatch's notify to carry to the peers (it is raised at the end of the dispatch).
  void raise_recorded_errors(bool keep_invalid_topk = false);
  void begin_collective(Stream stream, bool keep_invalid_topk = false);
  void request_reset();
  DispatchResult run_dispatch(const DispatchArgs& args);
  CombineResult run_combine(const CombineArgs& args);
  // Runs one collective call (numbered by call_seq_, alike on every rank). An error before the call enqueued
  // its first protocol kernel (invalid arguments, an allocation, an error a previous call recorded) would leave
  // the peers waiting for this rank until their timeout: abort_call tells them at once. Timeouts and peer
  // failures are left alone (the peers are in the same state).
  template <typename Call>
  auto joined(Call&& call) -> decltype(call()) {
    ++call_seq_;
    enqueued_ = false;
    try {
      return call();
    } catch (const Error& e) {
      if (!enqueued_ && e.code() != ErrorCode::kTimeout && e.code() != ErrorCode::kPeerFailure) abort_call();
      throw;
    }
  }
  // Marks this call as left: every peer's abort word (their waits give up with kErrPeerAborted), the shared
  // aborted_call (a peer that comes to the call later fails at once) and a reset for everyone's next call.
  void abort_call() noexcept;
  // Called right before the call's first protocol kernel is enqueued.
  void mark_enqueued() { enqueued_ = true; }
  // Waits until every rank's reset_step reaches `step` (CudaWorld); kTimeout at the group's timeout.
  void wait_reset_step(uint64_t step, const char* what);

  // Copy-engine path (docs/normal-kernels.md). Bytes of each staging slot when the host knows the
  // counts and the largest transfer between two ranks (pair_bytes) fits one, else 0 (SM path). Every
  // rank decides alike: the inputs come from notify (global maximum rows, smallest ring area).
  int64_t copy_slot_bytes(const CudaDispatchHandle& h, int64_t pair_bytes) const;
  // The send side of the copy-engine dispatch (on copy_stream_; SM packing on `stream`), enqueued before
  // the outputs exist; returns the packing stage, which must live until the call's end. The receive side
  // is one launch_unpack_fields on `stream`, then join_side_streams.
  Tensor send_with_copy_engines(const DispatchKernelArgs& k, const CudaDispatchHandle& h, const StageFields& f,
                                int64_t slot_bytes, int num_sms, Stream stream);
  static bool capturing(Stream stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
    return status != cudaStreamCaptureStatusNone;
  }
  // The send side of the copy-engine combine; the receive side is launch_combine_reduce, then
  // join_side_streams.
  void send_combine_with_copy_engines(const CombineKernelArgs& k, const CudaDispatchHandle& h, int64_t slot_bytes,
                                      int64_t weights_offset, Stream stream);
  // The side streams fork from `stream` (start_side_streams) and join it again at the end of the call.
  void start_side_streams(Stream stream);
  void join_side_streams(Stream stream);
  // After copy_stream_'s copies of chunk j: ce_tail[me] = ce_tag + rows.v[d] at every remote d with
  // rows.v[d] >= 0 (from signal_stream_).
  void signal_rows(const RowCounts& rows, int j);
  // The tag of this copy-engine operation's ce_tail signals: a host count (the same on every rank: all
  // take the copy-engine path alike), never replayed by a graph (the path is not taken under capture).
  uint64_t ce_tag() const { return ce_seq_ << 32; }
  std::vector<cudaEvent_t*> all_events() {
    std::vector<cudaEvent_t*> v{&ev_start_, &ev_copies_done_, &ev_signals_done_};
    for (auto& e : ev_pack_) v.push_back(&e);
    for (auto& e : ev_copy_) v.push_back(&e);
    return v;
  }

  std::shared_ptr<Group> group_;
  CudaGroup* cgroup_ = nullptr;
  std::shared_ptr<Allocator> allocator_;
  int rank_ = 0;
  int num_ranks_ = 0;
  int device_ = 0;
  int num_channels_ = 1;
  // BufferOptions::num_sms: sizes the channels (rings, signals); a call may use fewer SMs (DispatchArgs::num_sms).
  int num_sms_ = 1;
  NormalConfig config_;                   // the same on every rank (Buffer::create checked it)
  cudaStream_t copy_stream_ = nullptr;    // copy-engine transfers into peers' staging
  cudaStream_t signal_stream_ = nullptr;  // announces finished transfers (stream writes, else a kernel)
  WriteValue64 write_value_ = nullptr;
  uint64_t ce_seq_ = 0;  // copy-engine operations so far (ce_tag)
  cudaEvent_t ev_start_ = nullptr, ev_copies_done_ = nullptr, ev_signals_done_ = nullptr;
  cudaEvent_t ev_pack_[kMaxCopyChunks] = {};
  cudaEvent_t ev_copy_[kMaxCopyChunks] = {};
  int64_t region_bytes_ = 0;
  void* region_ = nullptr;
  PeerRegions peer_regions_;
  std::unique_ptr<LowLatencyEngine> low_latency_;
  ErrorRecord* errors_ = nullptr;         // mapped host memory [2]
  ErrorRecord* errors_device_ = nullptr;  // its device alias
  int32_t* meta_host_ = nullptr;          // pinned staging of the receive counts
  CommArgs comm_{};
  StageTimeline timeline_{false};
  // Reset requests, shared with the other ranks' buffers (see CudaWorld); null when the processes share no
  // memory (then a timeout cannot be recovered from in place).
  std::shared_ptr<CudaWorld> world_;
  uint64_t seen_generation_ = 0;
  Stream last_stream_ = nullptr;
  uint64_t call_seq_ = 0;                // collective calls so far, failed ones included (joined); restarts at a reset
  bool enqueued_ = false;                // the current call enqueued a protocol kernel
  cudaStream_t abort_stream_ = nullptr;  // abort_call's writes (idle otherwise, so they never wait)
};

void CudaBuffer::open_peers() {
  peer_regions_ = open_peer_regions(*group_, cgroup_->single_process(), region_, device_);
  for (int r = 0; r < num_ranks_; ++r) comm_.peers[r] = peer_regions_.ptrs[r];
}

void CudaBuffer::request_reset() {
  CudaWorld* world = world_.get();
  if (world == nullptr) return;
  // Every rank that failed asks for the same next generation, so simultaneous failures reset once.
  uint64_t current = world->reset_generation.load();
  const uint64_t target = seen_generation_ + 1;
  while (current < target && !world->reset_generation.compare_exchange_weak(current, target)) {
  }
}

void CudaBuffer::raise_recorded_errors(bool keep_invalid_topk) {
  ErrorRecord rec[2];
  std::memcpy(rec, errors_, sizeof(rec));
  if (rec[0].code == kErrNone && rec[1].code == kErrNone) return;
  if (keep_invalid_topk && rec[0].code == kErrNone && rec[1].code == kErrInvalidTopk) return;
  std::memset(errors_, 0, sizeof(rec));
  if (rec[0].code == kErrPeerAborted) {
    request_reset();  // the leaving rank asked for it already; the same generation
    detail::raise(ErrorCode::kPeerFailure,
                  "cuda rank {}: peer rank {} left the call before it started (its own error says why; {} "
                  "waited in {}); {}",
                  rank_, rec[0].peer, rank_, wait_site_name(rec[0].where),
                  world_ != nullptr ? "the buffer resets on the next call of every rank"
                                    : "this buffer cannot reset (no memory shared with the other ranks' processes): "
                                      "destroy it and make a new one on every rank");
  }
  if (rec[0].code == kErrTimeout) {
    request_reset();
    const auto& e = rec[0];
    detail::raise(ErrorCode::kTimeout,
                  "cuda rank {} timed out after {} ms in {}: peer rank {}, channel {}, expected counter {:#x}, "
                  "observed {:#x}; {}",
                  e.rank, group_->timeout_ms(), wait_site_name(e.where), e.peer, e.channel, e.expected, e.observed,
                  world_ != nullptr ? "the buffer resets on the next call of every rank"
                                    : "this buffer cannot reset (no memory shared with the other ranks' processes): "
                                      "destroy it and make a new one on every rank");
  }
  const auto& e = rec[1];
  if (e.code == kErrInvalidTopk) {
    detail::raise(ErrorCode::kInvalidArgument, "topk_idx[{}][{}] = {} is outside [-1, num_experts = {}) (rank {})",
                  e.peer, e.channel, e.observed, e.expected, e.rank);
  }
  detail::raise(ErrorCode::kInvalidArgument,
                "num_worst_tokens = {} is smaller than the {} rows received by rank {} in an earlier dispatch; the "
                "extra rows were dropped",
                e.expected, e.observed, e.rank);
}

void CudaBuffer::begin_collective(Stream stream, bool keep_invalid_topk) {
  raise_recorded_errors(keep_invalid_topk);
  last_stream_ = stream;
  CudaWorld* world = world_.get();
  if (world == nullptr) return;
  // A peer left this very call before it started (abort_call): nothing of it will come.
  if (world->aborted_call.load() == ((seen_generation_ << 32) | (call_seq_ & 0xffffffffu))) {
    detail::raise(ErrorCode::kPeerFailure,
                  "cuda rank {}: peer rank {} left the call before it started (its own error says why); the buffer "
                  "resets on the next call of every rank",
                  rank_, world->abort_rank.load());
  }
  const uint64_t generation = world->reset_generation.load();
  if (generation == seen_generation_) return;
  // A rank timed out or left a call. Step 1: no kernel of this rank runs on the old signals (its device waits end at
  // the timeout at the latest); step 2: it zeroed its own signals. A rank passes each step once every rank reached it,
  // so nobody writes new signals into a region that is still to be zeroed. A rank that does not come within the timeout
  // makes this call fail with kTimeout; the reset stays pending and the next call waits again (a step already taken is
  // not repeated).
  std::atomic<uint64_t>& mine = world->reset_step[rank_];
  const uint64_t idle = 2 * generation - 1, zeroed = 2 * generation;
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (reset)");
  check_cuda(cudaStreamSynchronize(abort_stream_), "cudaStreamSynchronize (reset)");  // our abort writes landed
  if (mine.load() < idle) mine.store(idle);
  wait_reset_step(idle, "no kernel runs on the old signals");
  if (mine.load() < zeroed) {
    check_cuda(cudaMemsetAsync(region_, 0, kNormalSignalBytes, stream), "cudaMemsetAsync (reset)");
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (reset)");
    ce_seq_ = 0;
    std::memset(errors_, 0, 2 * sizeof(ErrorRecord));
    mine.store(zeroed);
  }
  wait_reset_step(zeroed, "its signals are zeroed");
  seen_generation_ = generation;
  call_seq_ = 1;  // every rank restarts its numbering with the call that completes the reset
}

void CudaBuffer::abort_call() noexcept {
  // Peers' kernels of this call poll their abort word with their timeout checks; it is zeroed by the reset.
  const uint8_t who = static_cast<uint8_t>(rank_ + 1);  // little-endian: the word reads rank + 1
  for (int r = 0; r < num_ranks_; ++r) {
    if (r != rank_) cudaMemsetAsync(comm_.peers[r] + comm_.off_abort, who, 1, abort_stream_);
  }
  CudaWorld* world = world_.get();
  if (world != nullptr) {
    world->abort_rank.store(rank_);
    world->aborted_call.store((seen_generation_ << 32) | (call_seq_ & 0xffffffffu));
    request_reset();
  }
  // Bounded: the stream has nothing else to do, so the writes finish in microseconds.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (cudaStreamQuery(abort_stream_) == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void CudaBuffer::wait_reset_step(uint64_t step, const char* what) {
  const auto deadline = detail::deadline_after_ms(group_->timeout_ms());
  for (int r = 0; r < num_ranks_; ++r) {
    while (world_->reset_step[r].load() < step) {
      EPX_CHECK(ErrorCode::kTimeout, std::chrono::steady_clock::now() < deadline,
                "cuda rank {}: the buffer's reset after a timeout waited {} ms for rank {} to report that {}; "
                "the reset stays pending and the next call of this rank waits again",
                rank_, group_->timeout_ms(), r, what);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

int64_t CudaBuffer::copy_slot_bytes(const CudaDispatchHandle& h, int64_t pair_bytes) const {
  if (!config_.copy_engines || num_ranks_ < 2 || h.meta_host.empty()) return 0;
  const RecvMetaLayout m{num_ranks_, num_channels_, h.num_local_experts};
  const int64_t ring = int64_t{h.meta_host[m.min_ring_kib()]} << 10;
  const int64_t slot = ring / (num_ranks_ - 1) / 256 * 256;
  return pair_bytes <= slot ? slot : 0;
}

void CudaBuffer::start_side_streams(Stream stream) {
  check_cuda(cudaEventRecord(ev_start_, stream), "cudaEventRecord");
  check_cuda(cudaStreamWaitEvent(copy_stream_, ev_start_, 0), "cudaStreamWaitEvent");
}

void CudaBuffer::join_side_streams(Stream stream) {
  check_cuda(cudaEventRecord(ev_copies_done_, copy_stream_), "cudaEventRecord");
  check_cuda(cudaStreamWaitEvent(stream, ev_copies_done_, 0), "cudaStreamWaitEvent");
  check_cuda(cudaEventRecord(ev_signals_done_, signal_stream_), "cudaEventRecord");
  check_cuda(cudaStreamWaitEvent(stream, ev_signals_done_, 0), "cudaStreamWaitEvent");
}

void CudaBuffer::signal_rows(const RowCounts& rows, int j) {
  // The signal goes on its own stream after an event, so that the copy stream moves on to the next
  // chunk at once (a write on the copy stream itself waits for the copy and a memory barrier first:
  // measured 5% slower, docs/perf-notes.md).
  check_cuda(cudaEventRecord(ev_copy_[j], copy_stream_), "cudaEventRecord");
  check_cuda(cudaStreamWaitEvent(signal_stream_, ev_copy_[j], 0), "cudaStreamWaitEvent");
  if (write_value_ == nullptr) {
    launch_signal_rows(comm_, rows, ce_tag(), signal_stream_);
    return;
  }
  // NOTE: the write follows the copies (stream order) and, by default, a system-scope memory barrier:
  // the rows are in the destination's memory before the destination can see the count.
  for (int d = 0; d < num_ranks_; ++d) {
    if (d == rank_ || rows.v[d] < 0) continue;
    auto* addr = reinterpret_cast<uint64_t*>(comm_.peers[d] + comm_.off_ce_tail) + rank_;
    const CUresult r = write_value_(signal_stream_, reinterpret_cast<CUdeviceptr>(addr),
                                    ce_tag() + static_cast<uint64_t>(rows.v[d]), 0);
    if (r != CUDA_SUCCESS) {
      detail::raise(ErrorCode::kCudaError, "cuStreamWriteValue64 (signal rows) failed: error {}", static_cast<int>(r));
    }
  }
}

Tensor CudaBuffer::send_with_copy_engines(const DispatchKernelArgs& k, const CudaDispatchHandle& h,
                                          const StageFields& f, int64_t slot_bytes, int num_sms, Stream stream) {
  const int R = num_ranks_, me = rank_;
  const RecvMetaLayout m{R, num_channels_, h.num_local_experts};
  const auto& meta = h.meta_host;
  const int64_t T = h.num_tokens_, xb = k.x_row_bytes, sb = k.scale_row_bytes;
  // Per remote destination: whole x (chunks of tokens) or SM-packed rows (chunks of rows).
  RowCounts send{}, offset{};
  unsigned pack_mask = 0;
  int64_t packed = 0;
  for (int d = 0; d < R; ++d) {
    send.v[d] = meta[m.send_count(d)];
    if (d != me && !whole_copy(send.v[d], T, config_.whole_copies)) {
      pack_mask |= 1u << d;
      offset.v[d] = packed;
      packed += send.v[d];
    }
  }
  Tensor stage;
  char *stage_x = nullptr, *stage_scales = nullptr;
  if (packed > 0) {
    stage = empty(DType::kUInt8, {packed * (xb + sb)}, stream);
    stage_x = static_cast<char*>(stage.data());
    stage_scales = stage_x + packed * xb;
  }
  const int num_chunks = copy_chunks(meta[m.max_pair_rows()], config_.max_copy_chunks);
  auto slot_at = [&](int d) { return comm_.peers[d] + comm_.off_ring + stage_slot(me, d, R) * slot_bytes; };

  ++ce_seq_;
  timeline_.mark("send", stream);
  start_side_streams(stream);
  launch_copy_dispatch_begin(comm_, k, f, slot_bytes, copy_stream_);  // waits for the peers' release
  timeline_.mark("begin", copy_stream_);
  CopyBatch batch;
  for (int j = 0; j < num_chunks; ++j) {
    if (pack_mask != 0) {
      launch_pack_fields(comm_, k, stage_x, stage_scales, offset, pack_mask, j, num_chunks, num_sms, stream);
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
    signal_rows(end, j);
  }
  return stage;
}

void CudaBuffer::send_combine_with_copy_engines(const CombineKernelArgs& k, const CudaDispatchHandle& h,
                                                int64_t slot_bytes, int64_t weights_offset, Stream stream) {
  const int R = num_ranks_, me = rank_, C = num_channels_;
  const RecvMetaLayout m{R, C, h.num_local_experts};
  const int64_t H = k.hidden, K = k.num_topk;
  // Rows this rank received from d in dispatch go back to d: x[rank_prefix(d) + i], contiguous.
  RowCounts rows{}, base{};
  int64_t max_rows = 0;
  for (int d = 0; d < R; ++d) {
    rows.v[d] = d == me ? 0 : h.meta_host[m.chan_start(d, C)] - h.meta_host[m.chan_start(d, 0)];
    base.v[d] = h.meta_host[m.rank_prefix(d)];
    max_rows = std::max(max_rows, rows.v[d]);
  }
  const int num_chunks = copy_chunks(max_rows, config_.max_copy_chunks);
  ++ce_seq_;
  timeline_.mark("send", stream);
  start_side_streams(stream);
  // NOTE: the copies overwrite peers' staging: wait until they finished reading the previous operation.
  launch_wait_released(comm_, kSiteCopyCombineReleased, copy_stream_);
  timeline_.mark("released", copy_stream_);
  auto slot_at = [&](int d) { return comm_.peers[d] + comm_.off_ring + stage_slot(me, d, R) * slot_bytes; };
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
    signal_rows(end, j);
  }
}

Layout CudaBuffer::compute_layout(const TensorView& topk_idx, int64_t num_experts, Stream stream) {
  const int64_t T = topk_idx.shape[0];
  Layout layout;
  // One allocation for all three outputs; the one-cluster kernel (small T * K) stores the counts itself,
  // the many-block one adds into counts zeroed here.
  const int64_t count_bytes = align_up(4 * (num_ranks_ + num_experts), 256);
  const Tensor all = empty(DType::kUInt8, {count_bytes + T * num_ranks_}, stream);
  if (T * topk_idx.shape[1] > kLayoutClusterEntries) {
    check_cuda(cudaMemsetAsync(all.data(), 0, count_bytes, stream), "cudaMemsetAsync (layout counts)");
  }
  auto storage = std::make_shared<Tensor>(all);
  auto* counts = all.data_as<int32_t>();
  layout.num_tokens_per_rank =
      Tensor::wrap(TensorView::of(counts, DType::kInt32, {num_ranks_}, group_->device()), storage);
  layout.num_tokens_per_expert =
      Tensor::wrap(TensorView::of(counts + num_ranks_, DType::kInt32, {num_experts}, group_->device()), storage);
  layout.is_token_in_rank = Tensor::wrap(
      TensorView::of(all.data_as<uint8_t>() + count_bytes, DType::kBool, {T, num_ranks_}, group_->device()), storage);
  launch_layout(topk_idx.data, topk_idx.dtype == DType::kInt64, T, static_cast<int>(topk_idx.shape[1]), num_experts,
                num_ranks_, layout.num_tokens_per_rank.data_as<int32_t>(),
                layout.num_tokens_per_expert.data_as<int32_t>(), layout.is_token_in_rank.data_as<uint8_t>(),
                errors_device_ + 1, rank_, stream);
  check_cuda(cudaGetLastError(), "layout kernel launch");
  return layout;
}

DispatchResult CudaBuffer::run_dispatch(const DispatchArgs& args) {
  const ep::DispatchShape shape = ep::validate_dispatch(args, num_ranks_, group_->device());
  const int num_sms = ep::resolve_num_sms(args.num_sms, num_sms_);
  const int64_t T = shape.num_tokens, H = shape.hidden;
  const int64_t x_row_bytes = H * static_cast<int64_t>(dtype_size(args.x.dtype));
  EPX_CHECK_ARG(x_row_bytes % 16 == 0, "x rows must be a multiple of 16 bytes on the cuda backend, got hidden = {}", H);
  EPX_CHECK_ARG(shape.num_topk <= kNormalMaxTopk, "topk_idx has {} columns; the cuda backend allows <= {}",
                shape.num_topk, kNormalMaxTopk);
  std::shared_ptr<const CudaDispatchHandle> cached;
  if (shape.is_cached) {
    cached = std::dynamic_pointer_cast<const CudaDispatchHandle>(args.handle);
    EPX_CHECK_ARG(cached != nullptr && cached->owner == this, "handle was not made by this buffer");
  } else {
    EPX_CHECK_ARG(args.num_experts / num_ranks_ <= kNormalMaxLocalExperts,
                  "num_experts / num_ranks must be <= {} on the cuda backend, got {}", kNormalMaxLocalExperts,
                  args.num_experts / num_ranks_);
    EPX_CHECK_ARG(args.num_experts <= kNormalMaxExperts, "num_experts must be <= {} on the cuda backend, got {}",
                  kNormalMaxExperts, args.num_experts);
  }
  const int64_t scale_row_bytes = shape.scale_bytes;
  const int K = shape.is_cached ? 0 : static_cast<int>(shape.num_topk);
  const int64_t row_bytes = align_up(align_up(x_row_bytes + scale_row_bytes, 4) + 8 * K + 4, 16);
  const int64_t ring_rows = ring_rows_for(row_bytes);
  Stream stream = args.stream;
  DeviceGuard guard(device_);
  begin_collective(stream, /*keep_invalid_topk=*/cached == nullptr);
  timeline_.mark("call", stream);

  auto handle = std::make_shared<CudaDispatchHandle>();
  std::string value_error;
  if (cached) {
    *handle = *cached;
  } else {
    handle->owner = this;
    handle->num_channels = num_channels_;
    handle->num_tokens_ = T;
    handle->num_local_experts = static_cast<int>(args.num_experts / num_ranks_);
    Tensor per_expert_tensor;
    const int32_t* per_expert = nullptr;
    if (args.layout != nullptr) {
      const Layout& l = *args.layout;
      check_tensor(l.is_token_in_rank, "layout->is_token_in_rank", DType::kBool, {T, num_ranks_});
      check_device(l.is_token_in_rank, "layout->is_token_in_rank", group_->device());
      check_tensor(l.num_tokens_per_expert, "layout->num_tokens_per_expert", DType::kInt32, {args.num_experts});
      check_device(l.num_tokens_per_expert, "layout->num_tokens_per_expert", group_->device());
      // The handle outlives the caller's layout: keep a copy of the routing.
      handle->is_token_in_rank = empty(DType::kBool, {T, num_ranks_}, stream);
      check_cuda(cudaMemcpyAsync(handle->is_token_in_rank.data(), l.is_token_in_rank.data(), T * num_ranks_,
                                 cudaMemcpyDeviceToDevice, stream),
                 "cudaMemcpyAsync (is_token_in_rank)");
      per_expert = l.num_tokens_per_expert.data_as<const int32_t>();
    } else {
      Layout l = compute_layout(args.topk_idx, args.num_experts, stream);
      handle->is_token_in_rank = l.is_token_in_rank;
      per_expert_tensor = l.num_tokens_per_expert;
      per_expert = per_expert_tensor.data_as<const int32_t>();
    }
    const int R = num_ranks_, C = num_channels_;
    handle->excl_pos = empty(DType::kInt32, {R, T + 1}, stream);
    handle->list_tok = empty(DType::kInt32, {R, std::max<int64_t>(T, 1)}, stream);
    handle->chan_start = empty(DType::kInt32, {R, C + 1}, stream);
    launch_scan(handle->is_token_in_rank.data_as<uint8_t>(), T, R, C, handle->excl_pos.data_as<int32_t>(),
                handle->list_tok.data_as<int32_t>(), handle->chan_start.data_as<int32_t>(), stream);
    const RecvMetaLayout m{R, C, handle->num_local_experts};
    handle->recv_meta = empty(DType::kInt32, {m.size()}, stream);
    handle->recv_expert_counts = empty(DType::kInt32, {handle->num_local_experts}, stream);
    handle->rank_prefix = empty(DType::kInt32, {R, R}, stream);
    mark_enqueued();
    launch_advance_epoch(comm_, stream);
    launch_notify(comm_, handle->chan_start.data_as<int32_t>(), per_expert, handle->num_local_experts,
                  args.expert_alignment, T, config_.whole_copies && config_.copy_engines,
                  handle->recv_meta.data_as<int32_t>(), handle->recv_expert_counts.data_as<int32_t>(),
                  handle->rank_prefix.data_as<int32_t>(), stream);
    check_cuda(cudaGetLastError(), "notify launch");
    if (args.num_worst_tokens == 0) {
      check_cuda(cudaMemcpyAsync(meta_host_, handle->recv_meta.data(), m.size() * sizeof(int32_t),
                                 cudaMemcpyDeviceToHost, stream),
                 "cudaMemcpyAsync (receive counts)");
      check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (notify)");
      if (errors_[0].code != kErrNone) raise_recorded_errors();  // a timeout: no data kernel follows
      handle->num_recv_ = meta_host_[m.num_recv()];
      handle->expert_counts_host.assign(meta_host_ + m.expert_count(0),
                                        meta_host_ + m.expert_count(handle->num_local_experts));
      handle->meta_host.assign(meta_host_, meta_host_ + m.size());
    }
  }
  if (cached) {
    mark_enqueued();
    launch_advance_epoch(comm_, stream);
  }
  if (args.num_worst_tokens == 0 && handle->num_recv_ < 0) {
    // A cached dispatch without num_worst_tokens after a worst-token dispatch: learn the counts now.
    const RecvMetaLayout m{num_ranks_, num_channels_, handle->num_local_experts};
    check_cuda(cudaMemcpyAsync(meta_host_, handle->recv_meta.data(), m.size() * sizeof(int32_t), cudaMemcpyDeviceToHost,
                               stream),
               "cudaMemcpyAsync (receive counts)");
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (counts)");
    handle->num_recv_ = meta_host_[m.num_recv()];
    handle->expert_counts_host.assign(meta_host_ + m.expert_count(0),
                                      meta_host_ + m.expert_count(handle->num_local_experts));
    handle->meta_host.assign(meta_host_, meta_host_ + m.size());
  }
  const int64_t N = args.num_worst_tokens > 0 ? args.num_worst_tokens : handle->num_recv_;
  handle->num_rows = N;

  // Strided scales (e.g. column-major): one gather into a contiguous copy, which lives to the call's end
  // (its deleter frees on `stream` after the side streams joined it).
  Tensor scales_copy;
  const char* x_scales = static_cast<const char*>(args.x_scales.defined() ? args.x_scales.data : nullptr);
  if (args.x_scales.defined() && !args.x_scales.is_contiguous()) {
    const TensorView& s = args.x_scales;
    scales_copy = empty(s.dtype, {T, s.shape[1]}, stream);
    launch_gather_scales(s.data, s.strides[0], s.strides[1], static_cast<int>(dtype_size(s.dtype)), T, s.shape[1],
                         scales_copy.data(), stream);
    x_scales = static_cast<const char*>(scales_copy.data());
  }
  DispatchKernelArgs k{};
  k.x = static_cast<const char*>(args.x.data);
  k.x_scales = x_scales;
  k.topk_idx = shape.is_cached ? nullptr : args.topk_idx.data;
  k.topk_is_int64 = !shape.is_cached && args.topk_idx.dtype == DType::kInt64;
  k.topk_weights = args.topk_weights.defined() ? args.topk_weights.data_as<const float>() : nullptr;
  k.has_weights = K > 0 && args.topk_weights.defined();
  k.num_topk = K;
  k.num_local_experts = handle->num_local_experts;
  k.num_tokens = T;
  k.x_row_bytes = x_row_bytes;
  k.scale_row_bytes = scale_row_bytes;
  k.list_tok = handle->list_tok.data_as<const int32_t>();
  k.chan_start = handle->chan_start.data_as<const int32_t>();
  k.recv_meta = handle->recv_meta.data_as<const int32_t>();
  k.num_out_rows = N;
  k.worst_mode = args.num_worst_tokens > 0;
  k.ring_rows = ring_rows;
  k.row_bytes = row_bytes;
  // Copy-engine path: staging per source holds the fields of the largest transfer (StageFields). Its
  // send side is enqueued first: the transfers need no outputs, and the host's time before them counts.
  StageFields fields{};
  int64_t slot_bytes = 0;
  if (args.num_worst_tokens == 0 && !handle->meta_host.empty() && !capturing(stream)) {
    const RecvMetaLayout m{num_ranks_, num_channels_, handle->num_local_experts};
    fields = stage_fields(handle->meta_host[m.max_pair_rows()], k);
    slot_bytes = copy_slot_bytes(*handle, fields.end);
  }
  Tensor pack_stage;
  if (slot_bytes > 0) pack_stage = send_with_copy_engines(k, *handle, fields, slot_bytes, num_sms, stream);

  DispatchResult result;
  result.recv_x = empty(args.x.dtype, {N, H}, stream);
  if (args.x_scales.defined()) result.recv_x_scales = empty(args.x_scales.dtype, {N, args.x_scales.shape[1]}, stream);
  if (!shape.is_cached) {
    result.recv_topk_idx = empty(args.topk_idx.dtype, {N, K}, stream);
    if (args.topk_weights.defined()) result.recv_topk_weights = empty(DType::kFloat32, {N, K}, stream);
  }
  result.recv_src_idx = empty(DType::kInt32, {N}, stream);
  k.out_x = static_cast<char*>(result.recv_x.data());
  k.out_scales = static_cast<char*>(result.recv_x_scales.defined() ? result.recv_x_scales.data() : nullptr);
  k.out_topk_idx = result.recv_topk_idx.defined() ? result.recv_topk_idx.data() : nullptr;
  k.out_topk_weights = result.recv_topk_weights.defined() ? result.recv_topk_weights.data_as<float>() : nullptr;
  k.out_src_idx = result.recv_src_idx.data_as<int32_t>();
  if (slot_bytes > 0) {
    launch_unpack_fields(comm_, k, fields, slot_bytes, ce_tag(), num_sms, stream);
    timeline_.mark("unpack", stream);
    join_side_streams(stream);
    timeline_.mark("end", stream);
    timeline_.print(rank_, "dispatch");
  } else {
    timeline_.discard();
    launch_dispatch(comm_, k, num_sms, stream);
  }
  check_cuda(cudaGetLastError(), "dispatch launch");

  result.recv_expert_counts = handle->recv_expert_counts;
  result.rank_prefix_matrix = handle->rank_prefix;
  if (args.num_worst_tokens == 0) result.num_recv_tokens_per_expert = handle->expert_counts_host;
  result.handle = handle;
  // A bad topk_idx found by the layout kernel: raised after the data kernels, so that no peer is left
  // waiting. With the host synchronization (num_worst_tokens == 0) notify told every rank, so the whole
  // call fails on every rank: kInvalidArgument on the rank with the bad input, kPeerFailure on the others.
  // Without it (worst-token mode, graph capture) only this rank learns, here or on its next call.
  if (errors_[1].code != kErrNone) raise_recorded_errors();
  if (cached == nullptr && args.num_worst_tokens == 0) {
    const int32_t failed =
        handle->meta_host[RecvMetaLayout{num_ranks_, num_channels_, handle->num_local_experts}.failed_source()];
    EPX_CHECK(ErrorCode::kPeerFailure, failed < 0,
              "cuda rank {}: rank {} passed an invalid topk_idx entry to this dispatch (its bad entries were "
              "dropped); the dispatch failed on every rank, the buffer stays usable",
              rank_, failed);
  }
  return result;
}

CombineResult CudaBuffer::run_combine(const CombineArgs& args) {
  auto handle = std::dynamic_pointer_cast<const CudaDispatchHandle>(args.handle);
  EPX_CHECK_ARG(handle != nullptr && handle->owner == this, "handle was not made by this buffer's dispatch");
  ep::validate_combine(args, handle->num_tokens_, handle->num_rows, group_->device());
  const int num_sms = ep::resolve_num_sms(args.num_sms, num_sms_);
  const int64_t H = args.x.shape[1];
  EPX_CHECK_ARG(H % 8 == 0, "x hidden size must be a multiple of 8 on the cuda backend, got {}", H);
  const int K = args.topk_weights.defined() ? static_cast<int>(args.topk_weights.shape[1]) : 0;
  EPX_CHECK_ARG(K <= kNormalMaxTopk, "topk_weights has {} columns; the cuda backend allows <= {}", K, kNormalMaxTopk);
  const int64_t row_bytes = align_up(H * 2 + 4 * K, 16);
  const int64_t ring_rows = ring_rows_for(row_bytes);
  Stream stream = args.stream;
  DeviceGuard guard(device_);
  begin_collective(stream);
  timeline_.mark("call", stream);
  const int64_t T = handle->num_tokens_;
  CombineKernelArgs k{};
  k.x = args.x.data_as<const uint16_t>();
  k.topk_weights = K > 0 ? args.topk_weights.data_as<const float>() : nullptr;
  k.bias_0 = args.bias_0.defined() ? args.bias_0.data_as<const uint16_t>() : nullptr;
  k.bias_1 = args.bias_1.defined() ? args.bias_1.data_as<const uint16_t>() : nullptr;
  k.num_topk = K;
  k.hidden = H;
  k.num_tokens = T;
  k.is_token_in_rank = handle->is_token_in_rank.data_as<const uint8_t>();
  k.excl_pos = handle->excl_pos.data_as<const int32_t>();
  k.chan_start = handle->chan_start.data_as<const int32_t>();
  k.recv_meta = handle->recv_meta.data_as<const int32_t>();
  k.ring_rows = ring_rows;
  k.row_bytes = row_bytes;
  mark_enqueued();
  launch_advance_epoch(comm_, stream);
  // Copy-engine staging per source: x rows, then the top-k weights rows from weights_offset.
  int64_t slot_bytes = 0, weights_offset = 0;
  if (!handle->meta_host.empty() && !capturing(stream)) {
    const int64_t rows =
        handle->meta_host[RecvMetaLayout{num_ranks_, num_channels_, handle->num_local_experts}.max_pair_rows()];
    weights_offset = align_up(rows * H * 2, 256);
    slot_bytes = copy_slot_bytes(*handle, weights_offset + rows * K * 4);
  }
  // The copy-engine sends first: they need no outputs (as in dispatch).
  if (slot_bytes > 0) send_combine_with_copy_engines(k, *handle, slot_bytes, weights_offset, stream);
  CombineResult result;
  result.x = empty(DType::kBFloat16, {T, H}, stream);
  if (K > 0) result.topk_weights = empty(DType::kFloat32, {T, K}, stream);
  k.out = result.x.data_as<uint16_t>();
  k.out_topk_weights = K > 0 ? result.topk_weights.data_as<float>() : nullptr;
  if (slot_bytes > 0) {
    launch_combine_reduce(comm_, k, slot_bytes, weights_offset, ce_tag(), num_sms, stream);
    join_side_streams(stream);
    timeline_.mark("reduce", stream);
    timeline_.print(rank_, "combine");
  } else {
    timeline_.discard();
    launch_combine(comm_, k, num_sms, stream);
  }
  check_cuda(cudaGetLastError(), "combine launch");
  return result;
}

}  // namespace

std::unique_ptr<Buffer> create_cuda_buffer(std::shared_ptr<Group> group, const BufferOptions& options) {
  return std::make_unique<CudaBuffer>(std::move(group), options);
}

}  // namespace epx::cuda
