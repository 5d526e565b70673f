// Host-side pieces of the normal path's copy-engine transfers (NormalCopyEngines::send_dispatch and
// send_combine): batched copies, stream-written signals, chunking, the staging slot's fields
// and the stage timeline (a debug aid). Protocol: docs/normal-kernels.md, "copy engines".
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/cuda/cuda_util.h"
#include "ep/cuda/normal_kernels.h"

namespace epx::cuda {

// Copies that one call enqueues together: one cudaMemcpyBatchAsync where the runtime has it. Measured on
// 2x H200 while the receive kernels run (docs/perf-notes.md): a chunk to a peer by cudaMemcpyAsync or
// cudaMemcpyPeerAsync moves at ~180 GB/s, the same chunk in a batch at ~335 GB/s (also alone in a batch).
struct CopyBatch {
  std::vector<void*> dst;
  std::vector<const void*> src;
  std::vector<size_t> bytes;
  void add(void* d, const void* s, int64_t n) {
    if (n <= 0) return;
    dst.push_back(d);
    src.push_back(s);
    bytes.push_back(static_cast<size_t>(n));
  }
  void issue(cudaStream_t stream) {
    if (dst.empty()) return;
    bool done = false;
#if CUDART_VERSION >= 12080
    // NOTE: a runtime or driver that refuses batches (seen as an error at the first call) gets single copies.
    static std::atomic<bool> batches{true};
    if (batches.load()) {
      cudaMemcpyAttributes attr{};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      size_t attr_index = 0;
      const cudaError_t err =
          cudaMemcpyBatchAsync(dst.data(), src.data(), bytes.data(), dst.size(), &attr, &attr_index, 1, stream);
      if (err == cudaSuccess) {
        done = true;
      } else if (err == cudaErrorInvalidValue || err == cudaErrorNotSupported) {
        cudaGetLastError();
        batches = false;
      } else {
        check_cuda(err, "cudaMemcpyBatchAsync");
      }
    }
#endif
    for (size_t i = 0; i < dst.size() && !done; ++i) {
      check_cuda(cudaMemcpyAsync(dst[i], src[i], bytes[i], cudaMemcpyDefault, stream), "cudaMemcpyAsync");
    }
    dst.clear();
    src.clear();
    bytes.clear();
  }
};

// cuStreamWriteValue64 from the driver (no link to libcuda): the signal stream writes a chunk's count into
// the destination's memory once the chunk's copy is done, with no kernel launch. Null when the driver does
// not offer it (then a one-block kernel signals, as with NormalConfig::stream_signals off).
using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
inline WriteValue64 stream_write_value() {
  static const WriteValue64 fn = []() -> WriteValue64 {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &p, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<WriteValue64>(p);
  }();
  return fn;
}

// NormalConfig::stage_timeline (a debug aid, docs/perf-notes.md): the copy-engine calls record timing events at
// their stages; each call prints, to stderr, the stages of the call kLag calls before it (done by then, so
// nothing waits and back-to-back calls keep their overlap): times from that call's first mark, and the gap
// since the end of the call before it.
class StageTimeline {
 public:
  explicit StageTimeline(bool on) : on_(on) {}
  ~StageTimeline() {
    for (auto& c : calls_) {
      for (cudaEvent_t e : c.events) cudaEventDestroy(e);
    }
  }
  void mark(const char* name, cudaStream_t stream) {
    if (!on_) return;
    Call& c = calls_[next_ % kSlots];
    if (c.names.size() == c.events.size()) {
      cudaEvent_t e;
      check_cuda(cudaEventCreate(&e), "cudaEventCreate (timeline)");
      c.events.push_back(e);
    }
    check_cuda(cudaEventRecord(c.events[c.names.size()], stream), "cudaEventRecord (timeline)");
    c.names.push_back(name);
  }
  // This call takes another path: forget its marks.
  void discard() {
    if (on_) calls_[next_ % kSlots].names.clear();
  }
  // Ends this call's marks; prints an earlier call's.
  void print(int rank, const char* what) {
    if (!on_) return;
    calls_[next_ % kSlots].what = what;
    ++next_;
    if (next_ <= kLag) return;
    const Call& c = calls_[(next_ - 1 - kLag) % kSlots];
    const Call& before = calls_[(next_ - 2 - kLag) % kSlots];
    std::string line = fmt::format("timeline rank {} {}:", rank, c.what);
    float ms = 0;
    if (next_ > kLag + 1 && !before.names.empty()) {
      check_cuda(cudaEventSynchronize(c.events[0]), "cudaEventSynchronize (timeline)");
      check_cuda(cudaEventElapsedTime(&ms, before.events[before.names.size() - 1], c.events[0]),
                 "cudaEventElapsedTime");
      line += fmt::format(" gap={:.1f} |", ms * 1e3);
    }
    for (size_t i = 0; i < c.names.size(); ++i) {
      check_cuda(cudaEventSynchronize(c.events[i]), "cudaEventSynchronize (timeline)");
      check_cuda(cudaEventElapsedTime(&ms, c.events[0], c.events[i]), "cudaEventElapsedTime (timeline)");
      line += fmt::format(" {}={:.1f}", c.names[i], ms * 1e3);
    }
    std::fprintf(stderr, "%s\n", line.c_str());
    // The slot is reused next; the one printed keeps its marks until then (it is `before` next time).
    calls_[next_ % kSlots].names.clear();
  }

 private:
  static constexpr int kSlots = 8, kLag = 4;
  struct Call {
    std::vector<cudaEvent_t> events;
    std::vector<const char*> names;
    const char* what = "";
  };
  bool on_ = false;
  Call calls_[kSlots];
  uint64_t next_ = 0;
};

// Chunks per destination: about kCopyChunkRows rows each, at most `limit` (NormalConfig::max_copy_chunks,
// <= kMaxCopyChunks).
inline int copy_chunks(int64_t max_rows, int limit) {
  return static_cast<int>(std::clamp<int64_t>((max_rows + kCopyChunkRows - 1) / kCopyChunkRows, 1, limit));
}

// Offsets of the fields of `cap` rows in a staging slot (StageFields).
inline StageFields stage_fields(int64_t cap, const DispatchKernelArgs& k) {
  StageFields f{};
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    const int64_t o = off;
    off = align_up(off + bytes, 256);
    return o;
  };
  const int64_t topk_bytes = (k.topk_is_int64 ? 8 : 4) * k.num_topk;
  f.x = take(cap * k.x_row_bytes);
  f.scales = take(cap * k.scale_row_bytes);
  f.topk = take(cap * topk_bytes);
  f.weights = take(k.has_weights ? cap * 4 * k.num_topk : 0);
  f.src = take(cap * 4);
  f.end = off;
  return f;
}

// The most rows whose fields (stage_fields) fit a slot of slot_bytes. A dispatch lays its staging out for this
// many rows, so both sides know the offsets from the buffer's size and the call's row shapes alone, before
// notify (an early copy) as after it.
inline int64_t slot_rows(int64_t slot_bytes, const DispatchKernelArgs& k) {
  const int64_t row = k.x_row_bytes + k.scale_row_bytes +
                      ((k.topk_is_int64 ? 8 : 4) + (k.has_weights ? 4 : 0)) * int64_t{k.num_topk} + 4;
  int64_t rows = std::max<int64_t>(0, (slot_bytes - 5 * 256) / row);  // 5 fields, each padded to 256 bytes
  while (stage_fields(rows + 1, k).end <= slot_bytes) ++rows;
  while (rows > 0 && stage_fields(rows, k).end > slot_bytes) --rows;
  return rows;
}

// The bytes of each of the R - 1 staging slots in a ring area of ring_kib KiB (0 with one rank).
inline int64_t slot_capacity_bytes(int64_t ring_kib, int num_ranks) {
  return num_ranks >= 2 ? (ring_kib << 10) / (num_ranks - 1) / 256 * 256 : 0;
}

}  // namespace epx::cuda
