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
#include "eplb/cuda/transport.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "comm/cuda/cuda_group.h"
#include "comm/cuda/peer_memory.h"
#include "core/check.h"
#include "core/cuda/cuda_util.h"

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
    const MessageTotals totals = gather_message_totals(group_, sends, recvs, "cuda transport");
    auto sent = [&](int from, int to) { return totals.sent(from, to); };
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
        cuda::check_cuda(
            cudaMemcpyAsync(regions_.ptrs[op.peer] + (from - lo), static_cast<const char*>(op.data) + (from - at),
                            to - from, cudaMemcpyDeviceToDevice, stream_),
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
        cuda::check_cuda(
            cudaMemcpyAsync(static_cast<char*>(op.data) + (from - at), static_cast<const char*>(staging_) + (from - lo),
                            to - from, cudaMemcpyDeviceToDevice, stream_),
            "cuda transport: copy out of the staging");
      }
      cuda::check_cuda(cudaStreamSynchronize(stream_), "cuda transport: receiving a window");
    }
  }

  void copy(void* dst, const void* src, size_t bytes) override {
    device_copy(device_, stream_, dst, src, bytes, "cuda transport");
  }
  void* allocate_temp(size_t bytes) override { return device_allocate_temp(device_, bytes, "cuda transport"); }
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

MessageTotals gather_message_totals(Group& group, std::span<const SendOp> sends, std::span<const RecvOp> recvs,
                                    const char* name) {
  const int R = group.num_ranks();
  // Per rank, six blocks of R + 1 columns (column R: peers outside [0, R), so that the error is raised after the
  // collective, on every rank): bytes sent to p, bytes expected from p, messages to p, messages from p, and the
  // hashes of the two size sequences.
  enum Block : size_t { kSentBytes, kRecvBytes, kSentCount, kRecvCount, kSentHash, kRecvHash, kNumBlocks };
  const size_t width = static_cast<size_t>(R) + 1, row = kNumBlocks * width;
  constexpr uint64_t kFnvBasis = 14695981039346656037ull, kFnvPrime = 1099511628211ull;
  std::vector<uint64_t> local(row, 0), all(row * R, 0);
  for (size_t p = 0; p < width; ++p) local[kSentHash * width + p] = local[kRecvHash * width + p] = kFnvBasis;
  auto add = [&](int peer, size_t bytes, Block total, Block count, Block hash) {
    const size_t col = (peer >= 0 && peer < R) ? static_cast<size_t>(peer) : static_cast<size_t>(R);
    local[total * width + col] += bytes;
    if (bytes == 0) return;
    ++local[count * width + col];
    uint64_t& h = local[hash * width + col];
    h = (h ^ bytes) * kFnvPrime;
  };
  for (const SendOp& op : sends) add(op.peer, op.bytes, kSentBytes, kSentCount, kSentHash);
  for (const RecvOp& op : recvs) add(op.peer, op.bytes, kRecvBytes, kRecvCount, kRecvHash);
  group.all_gather_bytes(local.data(), all.data(), row * sizeof(uint64_t));
  auto at = [&](int rank, Block block, int peer) { return all[rank * row + block * width + peer]; };
  MessageTotals out;
  out.num_ranks = R;
  out.bytes.resize(static_cast<size_t>(R) * R);
  for (int a = 0; a < R; ++a) {
    EPX_CHECK(ErrorCode::kInvalidArgument,
              at(a, kSentBytes, R) == 0 && at(a, kRecvBytes, R) == 0 && at(a, kSentCount, R) == 0 &&
                  at(a, kRecvCount, R) == 0,
              "{}: rank {} names a peer outside [0, {})", name, a, R);
  }
  for (int a = 0; a < R; ++a) {
    for (int b = 0; b < R; ++b) {
      EPX_CHECK(ErrorCode::kInternal, at(a, kSentBytes, b) == at(b, kRecvBytes, a),
                "{}: rank {} sends {} bytes to rank {}, which expects {}", name, a, at(a, kSentBytes, b), b,
                at(b, kRecvBytes, a));
      EPX_CHECK(ErrorCode::kInternal,
                at(a, kSentCount, b) == at(b, kRecvCount, a) && at(a, kSentHash, b) == at(b, kRecvHash, a),
                "{}: rank {} sends rank {} {} messages of {} bytes in all, which expects {} messages: their sizes "
                "differ in order (messages between two ranks match in order, sizes equal)",
                name, a, b, at(a, kSentCount, b), at(a, kSentBytes, b), at(b, kRecvCount, a));
      out.bytes[static_cast<size_t>(a) * R + b] = at(a, kSentBytes, b);
    }
  }
  return out;
}

void device_copy(int device, cudaStream_t stream, void* dst, const void* src, size_t bytes, const char* name) {
  if (bytes == 0 || dst == src) return;
  cuda::DeviceGuard guard(device);
  cuda::check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream),
                   fmt::format("{}: copy", name).c_str());
  cuda::check_cuda(cudaStreamSynchronize(stream), fmt::format("{}: copy", name).c_str());
}

void* device_allocate_temp(int device, size_t bytes, const char* name) {
  cuda::DeviceGuard guard(device);
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes > 0 ? bytes : 1);
  if (err != cudaSuccess) cudaGetLastError();
  EPX_CHECK(ErrorCode::kOutOfMemory, err == cudaSuccess, "{}: cannot allocate {} temporary bytes on cuda:{}", name,
            bytes, device);
  return p;
}

std::unique_ptr<WeightTransport> make_cuda_transport_impl(Group& group, size_t staging_bytes) {
  return std::make_unique<CudaTransport>(group, staging_bytes);
}

}  // namespace epx::eplb
