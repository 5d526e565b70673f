// The cuda backend's Buffer: a facade over the two engines (NormalEngine, LowLatencyEngine) that keeps the
// normal path's collective error protocol: the joined calls, abort_call, the reset after a timeout
// (docs/reliability.md).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "comm/cuda/cuda_group.h"
#include "core/check.h"
#include "core/cuda/cuda_util.h"
#include "core/limits.h"
#include "core/timeout.h"
#include "ep/backends.h"
#include "ep/call_shape.h"
#include "ep/cuda/hierarchical_engine.h"
#include "ep/cuda/low_latency_engine.h"
#include "ep/cuda/normal_engine.h"
#include "ep/validate.h"
#include "epx/log.h"

namespace epx::cuda {
namespace {

// The public statement of the caps (epx/buffer.h) and the ones the engines size by (core/limits.h) agree.
static_assert(kCudaFlatNormalMaxRanks == kNormalMaxRanks && kCudaNormalMaxRanks == kHierarchicalMaxRanks &&
              kCudaFlatLowLatencyMaxRanks == kLowLatencyFlatMaxRanks && kCudaLowLatencyMaxRanks == kLowLatencyMaxRanks);

class CudaBuffer final : public Buffer, private NormalCallHooks {
 public:
  CudaBuffer(std::shared_ptr<Group> group, const BufferOptions& options)
      : group_(std::move(group)), allocator_(options.allocator ? options.allocator : default_allocator()) {
    ep::agree_on_options(*group_, options);  // first: every rank fails alike, before any local check
    cgroup_ = dynamic_cast<CudaGroup*>(group_.get());
    EPX_CHECK_ARG(cgroup_ != nullptr, "group must be a cuda group (see epx/cuda.h)");
    rank_ = group_->rank();
    num_ranks_ = group_->num_ranks();
    low_latency_hierarchical_ = ep::low_latency_hierarchical(options, group_->topology());
    device_ = group_->device().index;
    const bool hierarchical = ep::normal_hierarchical(options, group_->topology(), kNormalMaxRanks);
    normal_hierarchical_ = hierarchical;
    // NOTE: above kNormalMaxRanks there is no flat normal engine (its region and kernels split work per peer): the
    // hierarchical engine does every normal call, the layout included (core/limits.h, kHierarchicalMaxRanks). Above
    // kHierarchicalMaxRanks there is no normal engine at all: the buffer is low-latency only (EP72 decode).
    const bool normal_path = num_ranks_ <= kHierarchicalMaxRanks;
    EPX_CHECK(ErrorCode::kUnsupported, normal_path || options.num_normal_bytes == 0,
              "the cuda backend's normal path supports up to {} ranks (hierarchical routing), got {}: a buffer on "
              "more ranks is low-latency only: num_normal_bytes must be 0, got {} (the low-latency path takes up to "
              "{} ranks with the hierarchical routing)",
              kHierarchicalMaxRanks, num_ranks_, options.num_normal_bytes, kLowLatencyMaxRanks);
    EPX_CHECK(
        ErrorCode::kUnsupported, num_ranks_ <= kNormalMaxRanks || hierarchical || !normal_path,
        "the cuda backend's flat normal routing supports up to {} ranks, got {}: use normal_routing kHierarchical "
        "or kAuto (hierarchical above {} ranks), up to {} ranks",
        kNormalMaxRanks, num_ranks_, kNormalMaxRanks, kHierarchicalMaxRanks);
    if (num_ranks_ <= kNormalMaxRanks) {
      normal_ = std::make_unique<NormalEngine>(*group_, options.num_sms, options.num_normal_bytes, allocator_,
                                               options.normal);
    }
    if (hierarchical && normal_path) {
      hierarchical_ =
          std::make_unique<HierarchicalEngine>(*cgroup_, allocator_, options.num_sms, options.node_partials);
    }

    DeviceGuard guard(device_);
    if (!normal_) check_cuda(preload_normal_kernels(), "cudaFuncGetAttributes (preload normal kernels)");  // layout
    // NOTE: load the low-latency kernels too (NormalEngine loaded the normal ones) before the barrier below:
    // with lazy loading a kernel's first launch waits for the device to drain, which deadlocks against a peer's
    // spinning kernel when ranks share a process and a GPU (see preload_normal_kernels).
    check_cuda(preload_low_latency_kernels(), "cudaFuncGetAttributes (preload low-latency kernels)");
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    // The flat engine's reset after a timeout meets in the world (shared memory); without it there is none to reset.
    if (normal_) world_ = share_world(*cgroup_);  // collective (alike on every rank: num_ranks decides)
    if (normal_ && world_ == nullptr) {
      log(LogLevel::kWarn, fmt::format("epx cuda rank {}: no shared memory with the other ranks' processes (ranks "
                                       "on several hosts, or no /dev/shm): after a timeout of the normal path "
                                       "this buffer must be destroyed and made again on every rank",
                                       rank_));
    }
    // NOTE: with the hierarchical routing the flat normal kernels never run: only this node's regions are mapped, so
    // that ranks on several hosts (reached over the network leg only) can make a buffer.
    if (normal_) {  // collective
      normal_->open_peers(cgroup_->single_process(), hierarchical_ ? group_->topology().gpus_per_node : 0);
    }
    if (world_ != nullptr) seen_generation_ = world_->reset_generation.load();
    group_->barrier();
    if (options.num_low_latency_bytes > 0) {
      low_latency_ = std::make_unique<LowLatencyEngine>(
          *group_, cgroup_->single_process(), device_, options.num_low_latency_bytes, allocator_, options.low_latency,
          low_latency_hierarchical_ ? cgroup_ : nullptr, options.node_partials);
    }
    // Last: a constructor that throws runs no destructor, so nothing after this may throw.
    check_cuda(cudaStreamCreateWithFlags(&abort_stream_, cudaStreamNonBlocking), "cudaStreamCreate (abort)");
  }

  ~CudaBuffer() override {
    DeviceGuard guard(device_);
    // NOTE: peers may still write into our region until they finished their last call: wait for them. Our own
    // writes into theirs finish first, abort_call's included (abort_stream_ writes their abort words; its bounded
    // wait may have given up): a peer frees its region once it passed the barrier.
    try {
      if (hierarchical_) hierarchical_->wait_exchanges();
      if (last_stream_ != nullptr) cudaStreamSynchronize(last_stream_);
      cudaStreamSynchronize(abort_stream_);
      group_->barrier();
    } catch (...) {
    }
    hierarchical_.reset();
    normal_.reset();
    cudaStreamDestroy(abort_stream_);
  }

  Group& group() override { return *group_; }

  Layout get_dispatch_layout(const TensorView& topk_idx, int64_t num_experts, Stream stream) override {
    require_normal_path("get_dispatch_layout");
    if (!normal_) return hierarchical_->get_dispatch_layout(topk_idx, num_experts, stream);
    Layout layout = normal_->get_dispatch_layout(topk_idx, num_experts, stream, *this);
    if (hierarchical_) hierarchical_->add_tokens_per_node(layout, stream);
    return layout;
  }

  // NOTE: the hierarchical engine keeps its own error protocol (a header rendezvous at the start of each call, no
  // device-side waits on peers), so it bypasses joined() and the signal reset.
  DispatchResult dispatch(const DispatchArgs& args) override {
    require_normal_path("dispatch");
    if (hierarchical_) {
      last_stream_ = args.stream;
      return hierarchical_->dispatch(args);
    }
    return joined([&] { return normal_->dispatch(args, *this); });
  }
  CombineResult combine(const CombineArgs& args) override {
    require_normal_path("combine");
    if (hierarchical_) {
      last_stream_ = args.stream;
      return hierarchical_->combine(args);
    }
    return joined([&] { return normal_->combine(args, *this); });
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
  NormalRouting normal_routing() const override {
    return normal_hierarchical_ ? NormalRouting::kHierarchical : NormalRouting::kFlat;
  }
  LowLatencyRouting low_latency_routing() const override {
    return low_latency_hierarchical_ ? LowLatencyRouting::kHierarchical : LowLatencyRouting::kFlat;
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
  // Above kHierarchicalMaxRanks a buffer has no normal engine (low-latency only).
  void require_normal_path(const char* what) const {
    EPX_CHECK(ErrorCode::kUnsupported, normal_ != nullptr || hierarchical_ != nullptr,
              "{}: this buffer of {} ranks is low-latency only: the cuda backend's normal path supports up to {} "
              "ranks",
              what, num_ranks_, kHierarchicalMaxRanks);
  }
  LowLatencyEngine& low_latency() const {
    EPX_CHECK_ARG(low_latency_ != nullptr,
                  "this buffer has no low-latency memory: create it with BufferOptions::num_low_latency_bytes = "
                  "low_latency_buffer_size_hint(...)");
    return *low_latency_;
  }
  // NormalCallHooks: the engine calls these at fixed points of a normal call.
  void begin_collective(Stream stream, bool keep_invalid_topk) override;
  void mark_enqueued() override { enqueued_ = true; }
  void raise_recorded_errors() override { raise_recorded_errors(/*keep_invalid_topk=*/false); }
  uint64_t call_id() const override { return (seen_generation_ << 32) | (call_seq_ & 0xffffffffu); }
  // Raises (once) what the device recorded since the last call. A timeout also asks every rank of
  // this process to reset its signals on its next call. keep_invalid_topk: leave an invalid-topk record
  // for this dispatch's notify to carry to the peers (it is raised at the end of the dispatch).
  void raise_recorded_errors(bool keep_invalid_topk);
  void request_reset();
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
  // Waits until every rank's reset_step reaches `step` (CudaWorld); kTimeout at the group's timeout.
  void wait_reset_step(uint64_t step, const char* what);

  std::shared_ptr<Group> group_;
  CudaGroup* cgroup_ = nullptr;
  std::shared_ptr<Allocator> allocator_;
  int rank_ = 0;
  int num_ranks_ = 0;
  int device_ = 0;
  std::unique_ptr<NormalEngine> normal_;
  std::unique_ptr<HierarchicalEngine> hierarchical_;  // normal dispatch/combine with hierarchical routing
  std::unique_ptr<LowLatencyEngine> low_latency_;
  bool low_latency_hierarchical_ = false;  // BufferOptions::low_latency_routing resolved (LowLatencyRelay)
  bool normal_hierarchical_ = false;       // BufferOptions::normal_routing resolved
  // Reset requests, shared with the other ranks' buffers (see CudaWorld); null when the processes share no
  // memory (then a timeout cannot be recovered from in place).
  std::shared_ptr<CudaWorld> world_;
  uint64_t seen_generation_ = 0;
  Stream last_stream_ = nullptr;
  uint64_t call_seq_ = 0;                // collective calls so far, failed ones included (joined); restarts at a reset
  bool enqueued_ = false;                // the current call enqueued a protocol kernel
  cudaStream_t abort_stream_ = nullptr;  // abort_call's writes (idle otherwise, so they never wait)
};

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
  if (!normal_) return;  // the hierarchical engine raises its own errors
  ErrorRecord* errors = normal_->error_records();
  ErrorRecord rec[2];
  std::memcpy(rec, errors, sizeof(rec));
  if (rec[0].code == kErrNone && rec[1].code == kErrNone) return;
  if (keep_invalid_topk && rec[0].code == kErrNone && rec[1].code == kErrInvalidTopk) return;
  std::memset(errors, 0, sizeof(rec));
  const char* const reset_note = world_ != nullptr ? "the buffer resets on the next call of every rank"
                                                   : "this buffer cannot reset (no memory shared with the other ranks' "
                                                     "processes): destroy it and make a new one on every rank";
  if (rec[0].code == kErrHandleMismatch) {
    request_reset();
    const auto& e = rec[0];
    detail::raise(ErrorCode::kInvalidArgument,
                  "cuda rank {}: the handles of rank {} and rank {} come from different dispatches (handle ids {:#x} "
                  "and {:#x}, seen in {}): every rank must pass the handle of the same dispatch to a cached dispatch "
                  "or a combine; the call's outputs are invalid; {}",
                  e.rank, e.rank, e.peer, e.expected, e.observed, wait_site_name(e.where), reset_note);
  }
  if (rec[0].code == kErrShapeMismatch) {
    request_reset();
    const auto& e = rec[0];
    detail::raise(ErrorCode::kInvalidArgument,
                  "cuda rank {}: rank {} and rank {} passed arguments of different kinds to the same normal call (seen "
                  "in {}): rank {}: {}; rank {}: {}. Every rank must make the same call (fresh dispatch, cached "
                  "dispatch or combine) with the same dtypes, hidden size, x_scales width, topk_idx width and dtype, "
                  "topk_weights presence, num_experts and num_worst_tokens mode, idle ranks too (pass empty tensors "
                  "of those shapes); the call's outputs are invalid; {}",
                  e.rank, e.rank, e.peer, wait_site_name(e.where), e.rank,
                  ep::describe_call_shape(static_cast<uint64_t>(e.expected)), e.peer,
                  ep::describe_call_shape(static_cast<uint64_t>(e.observed)), reset_note);
  }
  if (rec[0].code == kErrPeerAborted) {
    request_reset();  // the leaving rank asked for it already; the same generation
    detail::raise(ErrorCode::kPeerFailure,
                  "cuda rank {}: peer rank {} left the call (before it started, on finding mismatched "
                  "handles or call shapes, or when its wait for this rank's release gave up; its own error says why; "
                  "{} waited in {}); {}",
                  rank_, rec[0].peer, rank_, wait_site_name(rec[0].where), reset_note);
  }
  if (rec[0].code == kErrTimeout) {
    request_reset();
    const auto& e = rec[0];
    detail::raise(ErrorCode::kTimeout,
                  "cuda rank {} timed out after {} ms in {}: peer rank {}, channel {}, expected counter {:#x}, "
                  "observed {:#x}; {}",
                  e.rank, group_->timeout_ms(), wait_site_name(e.where), e.peer, e.channel, e.expected, e.observed,
                  reset_note);
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
    normal_->reset_signals(stream);  // also restarts the copy-engine tags and clears the error records
    mine.store(zeroed);
  }
  wait_reset_step(zeroed, "its signals are zeroed");
  seen_generation_ = generation;
  call_seq_ = 1;  // every rank restarts its numbering with the call that completes the reset
}

void CudaBuffer::abort_call() noexcept {
  // NOTE: first let this rank's earlier operations finish on its GPU: the abort word makes the peers' release waits
  // give up at once, and a copy-engine send behind such a wait still copies into this rank's staging
  // (docs/reliability.md), which an earlier operation may still be reading (e.g. a worst-token dispatch whose recorded
  // overflow this call raised before it enqueued anything). Bounded by the group's timeout: an operation stuck longer
  // records its own error. Not under stream capture (a query would end the capture).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (last_stream_ != nullptr && cudaStreamIsCapturing(last_stream_, &capture) == cudaSuccess &&
      capture == cudaStreamCaptureStatusNone) {
    stream_idle_by(last_stream_, detail::deadline_after_ms(group_->timeout_ms()));
  }
  cudaGetLastError();
  // Peers' kernels of this call poll their abort word with their timeout checks; it is zeroed by the reset.
  const uint8_t who = static_cast<uint8_t>(rank_ + 1);  // little-endian: the word reads rank + 1
  for (int r = 0; r < num_ranks_; ++r) {
    if (r != rank_ && normal_ && normal_->abort_word(r) != nullptr) {
      cudaMemsetAsync(normal_->abort_word(r), who, 1, abort_stream_);
    }
  }
  CudaWorld* world = world_.get();
  if (world != nullptr) {
    world->abort_rank.store(rank_);
    world->aborted_call.store((seen_generation_ << 32) | (call_seq_ & 0xffffffffu));
    request_reset();
  }
  // Bounded: the stream has nothing else to do, so the writes finish in microseconds.
  stream_idle_by(abort_stream_, std::chrono::steady_clock::now() + std::chrono::seconds(1));
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

}  // namespace

std::unique_ptr<Buffer> create_cuda_buffer(std::shared_ptr<Group> group, const BufferOptions& options) {
  return std::make_unique<CudaBuffer>(std::move(group), options);
}

}  // namespace epx::cuda
