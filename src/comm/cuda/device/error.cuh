// Recording a failure into the device error record (device/error_record.h), for both kernel paths.
#pragma once

#include <cstdint>

#include "comm/cuda/device/error_record.h"

namespace epx::cuda {
namespace {

// Writes one failure into *e unless it already holds one (first wins). Ordering: the fields, then a system-scope
// fence, then `code`, then a fence again, so a host (or another block) that reads code != kErrNone reads the
// fields of a complete record, and other waits polling `code` see it promptly. One thread calls it.
__device__ __forceinline__ void record_error(volatile ErrorRecord* e, int32_t code, int32_t where, int32_t rank,
                                             int32_t peer, int32_t channel, int64_t expected, int64_t observed) {
  if (e->code != kErrNone) return;  // first failure wins (a benign race between simultaneous failures)
  e->where = where;
  e->rank = rank;
  e->peer = peer;
  e->channel = channel;
  e->expected = expected;
  e->observed = observed;
  __threadfence_system();
  e->code = code;
  __threadfence_system();
}

}  // namespace
}  // namespace epx::cuda
