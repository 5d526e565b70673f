// The one device error record of epx's kernels (normal and low-latency paths): written by the device into mapped
// pinned host memory, read by the host after the kernels (plain C++: host code includes this header). Times and
// budgets are on one clock, %globaltimer nanoseconds (global_ns, device/ordering.cuh).
//
// Writer protocol (record_error, device/error.cuh): fields first, __threadfence_system(), then `code`; the first
// failure wins (a benign race between simultaneous failures may mix two records' fields). The reader sees
// code != kErrNone, copies the record, and zeroes `code` before the next call.
#pragma once

#include <cstdint>

namespace epx::cuda {

// The first failure of an operation. Normal path: code != 0 in record [0] also tells every other wait of the
// buffer to give up (abort). NOTE: the normal path's host code (src/ep/cuda/cuda_buffer.cpp) decodes this layout and
// these field meanings; the low-latency path reuses them (its own codes and sites below).
struct ErrorRecord {
  int32_t code;     // ErrorKind
  int32_t where;    // WaitSite for timeouts
  int32_t rank;     // the rank that recorded it
  int32_t peer;     // the peer waited for (timeouts); the token (invalid topk_idx); the destination (expert overflow)
  int32_t channel;  // the channel (timeouts); the slot (invalid topk_idx); the expert (low-latency)
  int32_t reserved;
  int64_t expected;  // the counter value or tag waited for (timeouts); num_worst_tokens (overflow); the row bound
  int64_t observed;  // the value seen last (timeouts); the bad value (topk_idx) or rows received (overflow)
};

// Normal path: kErrTimeout, kErrPeerAborted, kErrHandleMismatch and kErrShapeMismatch go to record [0] (they abort
// every other wait of the rank), the others to [1]. Low-latency path: one record per buffer, kErrTimeout (the peer is
// masked, nothing aborts) or kErrExpertOverflow.
enum ErrorKind : int32_t {
  kErrNone = 0,
  kErrTimeout = 1,
  kErrInvalidTopk = 2,
  kErrWorstOverflow = 3,
  kErrPeerAborted = 4,     // a peer left the call before it started (its abort word); `peer` names it
  kErrExpertOverflow = 5,  // low-latency dispatch: more than max_tokens_per_rank pairs chose `channel` (expected)
  // A peer's operation reverses another dispatch than this rank's (handles of different dispatches): `peer` names
  // it, expected/observed are the two handle ids. Normal path: record [0] (aborts the rank's waits, and the peers'
  // through their abort words); low-latency combine: the buffer's record (the expert's rows are left out).
  kErrHandleMismatch = 6,
  // Normal path: a peer's operation has another shape word (ep/call_shape.h: call kind, dtypes, hidden size, scales,
  // top-k, weights, num_experts, worst-token mode, capture) than this rank's; `peer` names it, expected/observed are
  // this rank's word and the peer's. Record [0], as kErrHandleMismatch.
  kErrShapeMismatch = 7,
};

enum WaitSite : int32_t {
  kSiteNotify = 1,
  kSiteDispatchSendDone = 2,
  kSiteDispatchSendHead = 3,
  kSiteDispatchRecvTail = 4,
  kSiteCombineSendDone = 5,
  kSiteCombineSendHead = 6,
  kSiteCombineRecvTail = 7,
  kSiteCopyDispatchReleased = 8,
  kSiteCopyDispatchRows = 9,
  kSiteCopyCombineReleased = 10,
  kSiteCopyCombineRows = 11,
  kSiteLowLatencyDispatchRecv = 12,  // a low-latency dispatch receive waiting for a source's count signal
  kSiteLowLatencyCombineRecv = 13,   // a low-latency combine receive waiting for an expert's rows
  kSiteCopyDispatchEarly = 14,       // SM rings after a peer's early whole-x copy (waiting for it to land)
  kSiteReceiveEnd = 15,              // a normal receive's end: a peer's abort word came while it read (staging_kept)
};
const char* wait_site_name(int32_t site);  // normal_kernels.cu

}  // namespace epx::cuda
