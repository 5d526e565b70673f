// The CUDA WeightTransport (issue 16, "EPLB on GPUs"): ranks of a cuda Group on one host whose GPUs have peer
// access. Each rank owns a staging region that every peer maps (open_peer_regions: plain pointers for ranks as
// threads, CUDA IPC for one process per GPU). A round moves as follows:
//   1. one all-gather of every rank's per-peer send and receive byte totals; every rank checks the whole matrix,
//      so a mismatch raises the same error on every rank and nobody is left waiting;
//   2. the bytes a rank receives form one stream (messages by source rank, then in order), moved through the
//      receiver's staging in windows of staging_bytes: per pass, the senders push their part of the window with
//      copy-engine copies (cudaMemcpyAsync peer to peer, no SMs), a barrier, then the receiver copies the window
//      out into place, a barrier before the next pass reuses it.
// Pushing means a sender's buffers are only read by its own copies, so the contract's "every peer has finished
// reading this rank's send buffers" holds when the rank's own stream is synchronized.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/check.h"
#include "comm/cuda/cuda_group.h"
#include "core/cuda/cuda_util.h"
#include "comm/cuda/peer_memory.h"
#include "eplb/cuda/transport.h"

namespace epx::eplb {

namespace {

class CudaTransport final : public WeightTransport {
 public:
  CudaTransport(Group& group, size_t staging_bytes) : group_(group), staging_bytes_(staging_bytes) {
    const Device dev = group.device();
    device_ = dev.index;
    cuda::DeviceGuard guard(device_);
    // NOTE: every rank allocates before the collective below, and a failure is raised only after it, so a rank
    // short of memory does not leave its peers waiting in open_peer_regions.
    const cudaError_t alloc = cudaMalloc(&staging_, staging_bytes_);
    std::vector<uint8_t> ok(static_cast<size_t>(group.num_ranks()));
    const uint8_t mine = alloc == cudaSuccess ? 1 : 0;
    group.all_gather_bytes(&mine, ok.data(), 1);
    for (int r = 0; r < group.num_ranks(); ++r) {
      if (ok[r] == 0) {
        if (staging_ != nullptr) cudaFree(staging_);
        cudaGetLastError();
        EPX_CHECK(ErrorCode::kOutOfMemory, false, "cuda transport: rank {} cannot allocate {} staging bytes", r,
                  staging_bytes_);
      }
    }
    auto* cuda_group = dynamic_cast<cuda::CudaGroup*>(&group);
    if (cuda_group == nullptr) cudaFree(staging_);
    EPX_CHECK_ARG(cuda_group != nullptr, "make_cuda_transport needs a group made by epx's cuda backend");
    try {
      regions_ = cuda::open_peer_regions(group, cuda_group->single_process(), static_cast<char*>(staging_), device_);
      cuda::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cuda transport: stream");
    } catch (...) {
      cuda::close_peer_regions(regions_);
      cudaFree(staging_);
      throw;
    }
  }

  ~CudaTransport() override {
    cuda::DeviceGuard guard(device_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    cuda::close_peer_regions(regions_);
    cudaFree(staging_);
  }

  int rank() const override { return group_.rank(); }
  int num_ranks() const override { return group_.num_ranks(); }

  void exchange(std::span<const SendOp> sends, std::span<const RecvOp> recvs) override {
    const int R = num_ranks(), me = rank();
    // [r][0][p]: bytes r sends to p; [r][1][p]: bytes r expects from p. Invalid peers count in column R (a
    // spare) so the error is raised after the collective, on every rank.
    const size_t row = 2 * static_cast<size_t>(R + 1);
    std::vector<uint64_t> local(row, 0), all(row * R, 0);
    for (const SendOp& op : sends) local[(op.peer >= 0 && op.peer < R) ? op.peer : R] += op.bytes;
    for (const RecvOp& op : recvs) local[R + 1 + ((op.peer >= 0 && op.peer < R) ? op.peer : R)] += op.bytes;
    group_.all_gather_bytes(local.data(), all.data(), row * sizeof(uint64_t));
    auto sent = [&](int from, int to) { return all[from * row + to]; };
    auto expected = [&](int at, int from) { return all[at * row + R + 1 + from]; };
    for (int a = 0; a < R; ++a) {
      EPX_CHECK(ErrorCode::kInvalidArgument, sent(a, R) == 0 && expected(a, R) == 0,
                "cuda transport: rank {} names a peer outside [0, {})", a, R);
      for (int b = 0; b < R; ++b) {
        EPX_CHECK(ErrorCode::kInternal, sent(a, b) == expected(b, a),
                  "cuda transport: rank {} sends {} bytes to rank {}, which expects {}", a, sent(a, b), b,
                  expected(b, a));
      }
    }
    // Where each source's messages start in a receiver's stream, and the longest stream (every rank agrees).
    auto stream_base = [&](int from, int to) {
      uint64_t base = 0;
      for (int a = 0; a < from; ++a) base += sent(a, to);
      return base;
    };
    uint64_t longest = 0;
    for (int b = 0; b < R; ++b) longest = std::max(longest, stream_base(R, b));
    const uint64_t window = staging_bytes_;
    cuda::DeviceGuard guard(device_);
    for (uint64_t lo = 0; lo < longest; lo += window) {
      const uint64_t hi = lo + window;
      group_.barrier();  // every receiver has copied the previous window out of its staging
      std::vector<uint64_t> cursor(R);
      for (int b = 0; b < R; ++b) cursor[b] = stream_base(me, b);
      for (const SendOp& op : sends) {
        const uint64_t at = cursor[op.peer];
        cursor[op.peer] += op.bytes;
        const uint64_t from = std::max(at, lo), to = std::min(at + op.bytes, hi);
        if (from >= to) continue;
        cuda::check_cuda(cudaMemcpyAsync(regions_.ptrs[op.peer] + (from - lo),
                                         static_cast<const char*>(op.data) + (from - at), to - from,
                                         cudaMemcpyDeviceToDevice, stream_),
                         "cuda transport: copy to a peer's staging");
      }
      cuda::check_cuda(cudaStreamSynchronize(stream_), "cuda transport: pushing a window");
      group_.barrier();  // every sender's part of this window has landed
      for (int a = 0; a < R; ++a) cursor[a] = stream_base(a, me);
      for (const RecvOp& op : recvs) {
        const uint64_t at = cursor[op.peer];
        cursor[op.peer] += op.bytes;
        const uint64_t from = std::max(at, lo), to = std::min(at + op.bytes, hi);
        if (from >= to) continue;
        cuda::check_cuda(cudaMemcpyAsync(static_cast<char*>(op.data) + (from - at),
                                         static_cast<const char*>(staging_) + (from - lo), to - from,
                                         cudaMemcpyDeviceToDevice, stream_),
                         "cuda transport: copy out of the staging");
      }
      cuda::check_cuda(cudaStreamSynchronize(stream_), "cuda transport: receiving a window");
    }
  }

  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0 || dst == src) return;
    cuda::DeviceGuard guard(device_);
    cuda::check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "cuda transport: copy");
    cuda::check_cuda(cudaStreamSynchronize(stream_), "cuda transport: copy");
  }

  void* allocate_temp(size_t bytes) override {
    cuda::DeviceGuard guard(device_);
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes > 0 ? bytes : 1);
    if (err != cudaSuccess) cudaGetLastError();
    EPX_CHECK(ErrorCode::kOutOfMemory, err == cudaSuccess, "cuda transport: cannot allocate {} temporary bytes on cuda:{}",
              bytes, device_);
    return p;
  }
  void free_temp(void* ptr) noexcept override {
    cuda::DeviceGuard guard(device_);
    cudaFree(ptr);
  }

 private:
  Group& group_;
  size_t staging_bytes_;
  int device_ = 0;
  void* staging_ = nullptr;
  cuda::PeerRegions regions_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::unique_ptr<WeightTransport> make_cuda_transport_impl(Group& group, size_t staging_bytes) {
  return std::make_unique<CudaTransport>(group, staging_bytes);
}

}  // namespace epx::eplb
