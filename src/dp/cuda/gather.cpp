// dp_gather / dp_scatter and the batch-metadata all-gather on the CUDA backend: NCCL collectives on the
// group's DP communicator (dp/comm_cuda.h), enqueued on the caller's stream.
//
//   gather MAX_LEN: each rank writes its share of its DP rank's padded slot straight into `global` (the
//     slot is split over the attention-TP ranks, which hold the same batch), zeroes the padding, and an
//     in-place ncclAllGather fills in the rest.
//   gather SUM_LEN: `global` is zeroed, the DP leader writes 0 + x at its prefix offset (a plain copy for
//     int32/int64), and an in-place ncclAllReduce (sum) completes it.
//   Tensors: bf16, fp32, int32 or int64, [rows, hidden] or [rows] (one element per row); integers travel as
//   ncclInt32/ncclInt64 and are summed exactly by NCCL.
//   scatter kSlice: a device copy of this DP rank's rows; no communication.
//   attn_cp > 1: gathers in both modes take the SUM_LEN path (CP rank 0, or with cp_shard_counts every CP rank,
//     writes its rows); kSlice with shards copies this CP rank's shard.
//   scatter kReduceScatter: one ncclReduce per rank, rooted at that rank, over its DP rank's rows (any
//     counts, any attn_tp), fused in one NCCL group, straight into `local`.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <span>
#include <thread>
#include <utility>

#include "comm/cuda/nccl_loader.h"
#include "core/check.h"
#include "core/cuda/alloc.h"
#include "core/cuda/cuda_util.h"
#include "dp/backends.h"
#include "dp/cuda/comm.h"
#include "dp/cuda/gather_kernels.h"
#include "epx/log.h"

namespace epx::cuda {

namespace {

// The dtypes dp_gather validated: bf16, fp32, int32, int64.
ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kInt32:
      return ncclInt32;
    case DType::kInt64:
      return ncclInt64;
    default:
      detail::raise(ErrorCode::kInvalidArgument,
                    "dp_gather/dp_scatter (cuda): dtype {} is not supported; use bf16, fp32, int32 or int64",
                    to_string(dtype));
  }
}

char* row_ptr(const TensorView& t, int64_t row) {
  return static_cast<char*>(t.data) + row * detail::dp_row_elems(t) * static_cast<int64_t>(dtype_size(t.dtype));
}

// Zeroes local rows [count, rows): the CUDA-graph padding past this rank's tokens.
void zero_tail(const TensorView& local, int64_t count, cudaStream_t stream) {
  const int64_t rows = local.shape[0];
  const int64_t row_elems = detail::dp_row_elems(local);
  if (rows <= count || row_elems == 0) return;
  const size_t bytes = static_cast<size_t>((rows - count) * row_elems) * dtype_size(local.dtype);
  check_cuda(cudaMemsetAsync(row_ptr(local, count), 0, bytes, stream), "cudaMemsetAsync (dp_scatter padding)");
}

}  // namespace

void dp_gather_cuda(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& local,
                    const TensorView& global, Stream stream, DpGatherSource source,
                    std::span<const int64_t> cp_shard_counts) {
  const int64_t hidden = detail::dp_row_elems(global);
  if (plan.buffer_len == 0 || hidden == 0) return;  // the same plan everywhere: every rank skips
  DpComm& dp = dp_comm(group);
  DeviceGuard guard(dp.device);
  const RankCoords me = layout.coords(group.rank());
  // NOTE: an undefined local (a rejected call joining its peers' collective, dp_gather_fail) contributes no rows:
  // the MAX_LEN path zeroes this rank's share, the all-reduce path writes nothing into the zeroed buffer.
  const int64_t count = local.defined() ? plan.num_tokens[me.attn_dp_rank] : 0;
  const size_t elem = dtype_size(global.dtype);
  const size_t row_bytes = static_cast<size_t>(hidden) * elem;
  // MAX_LEN partial sums and attention CP (SGLang: an all-gather would take a block from every rank, CP ranks
  // included) take the all-reduce below (on the padded buffer, at the MAX_LEN offsets).
  if (plan.mode == DpPaddingMode::kMaxLen && source == DpGatherSource::kLeader && layout.attn_cp_size() == 1) {
    // NOTE: rank = attn_dp_rank * attn_tp + attn_tp_rank (attn_cp is 1 here), so this rank's share
    // [attn_tp_rank * chunk, + chunk) of its slot sits at rank * chunk: exactly where an in-place
    // all-gather expects its send buffer.
    const int64_t chunk = plan.slot_len / layout.attn_tp_size();
    if (chunk == 0) return;
    const int64_t first = static_cast<int64_t>(me.attn_tp_rank) * chunk;
    const int64_t valid = std::clamp<int64_t>(count - first, 0, chunk);
    char* mine = row_ptr(global, plan.offsets[me.attn_dp_rank] + first);
    if (valid > 0) {
      check_cuda(cudaMemcpyAsync(mine, row_ptr(local, first), static_cast<size_t>(valid) * row_bytes,
                                 cudaMemcpyDeviceToDevice, stream),
                 "cudaMemcpyAsync (dp_gather)");
    }
    if (valid < chunk) {
      check_cuda(cudaMemsetAsync(mine + valid * row_bytes, 0, static_cast<size_t>(chunk - valid) * row_bytes, stream),
                 "cudaMemsetAsync (dp_gather padding)");
    }
    nccl_wait(dp,
              nccl().AllGather(mine, global.data, static_cast<size_t>(chunk * hidden), nccl_type(global.dtype), dp.comm,
                               stream),
              "ncclAllGather (dp_gather)");
    return;
  }
  check_cuda(cudaMemsetAsync(global.data, 0, static_cast<size_t>(plan.buffer_len) * row_bytes, stream),
             "cudaMemsetAsync (dp_gather)");
  // Partial sums: every attention-TP rank writes its rows, so the all-reduce sums them (reduce + gather at once).
  // CP: CP rank 0 writes the DP rank's rows, or with shards every CP rank its own shard.
  const bool contributes = (source == DpGatherSource::kPartialSums || me.attn_tp_rank == 0) &&
                           (!cp_shard_counts.empty() || me.attn_cp_rank == 0);
  const std::pair<int64_t, int64_t> rows =
      cp_shard_counts.empty()
          ? std::pair<int64_t, int64_t>{plan.offsets[me.attn_dp_rank], count}
          : detail::dp_cp_shard_rows(cp_shard_counts, me.attn_cp_rank, plan.offsets[me.attn_dp_rank]);
  if (contributes && rows.second > 0) {
    char* dst = row_ptr(global, rows.first);
    if (global.dtype == DType::kInt32 || global.dtype == DType::kInt64) {
      // 0 + x == x for integers: a plain copy.
      check_cuda(cudaMemcpyAsync(dst, local.data, static_cast<size_t>(rows.second) * row_bytes,
                                 cudaMemcpyDeviceToDevice, stream),
                 "cudaMemcpyAsync (dp_gather)");
    } else {
      check_cuda(launch_add_zero_copy(local.data, dst, rows.second * hidden, global.dtype == DType::kBFloat16, stream),
                 "add_zero_copy (dp_gather)");
    }
  }
  nccl_wait(dp,
            nccl().AllReduce(global.data, global.data, static_cast<size_t>(plan.buffer_len * hidden),
                             nccl_type(global.dtype), ncclSum, dp.comm, stream),
            "ncclAllReduce (dp_gather)");
}

void dp_scatter_cuda(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& global,
                     const TensorView& local, DpScatterKind kind, Stream stream,
                     std::span<const int64_t> cp_shard_counts) {
  const int64_t hidden = detail::dp_row_elems(global);
  const RankCoords me = layout.coords(group.rank());
  const int64_t count = plan.num_tokens[me.attn_dp_rank];
  const size_t row_bytes = static_cast<size_t>(hidden) * dtype_size(global.dtype);
  DeviceGuard guard(group.device().index);
  // An undefined local: a rejected call joining its peers' reduces (dp_scatter_fail); kSlice has none to join.
  const bool joins_only = !local.defined();
  if (kind == DpScatterKind::kSlice) {
    if (joins_only) return;
    // With shards (kSlice only, checked by dp_scatter): this CP rank's shard.
    const std::pair<int64_t, int64_t> rows =
        cp_shard_counts.empty()
            ? std::pair<int64_t, int64_t>{plan.offsets[me.attn_dp_rank], count}
            : detail::dp_cp_shard_rows(cp_shard_counts, me.attn_cp_rank, plan.offsets[me.attn_dp_rank]);
    if (rows.second > 0 && hidden > 0) {
      check_cuda(cudaMemcpyAsync(local.data, row_ptr(global, rows.first), static_cast<size_t>(rows.second) * row_bytes,
                                 cudaMemcpyDeviceToDevice, stream),
                 "cudaMemcpyAsync (dp_scatter)");
    }
    zero_tail(local, rows.second, stream);
    return;
  }
  if (plan.buffer_len == 0 || hidden == 0) {  // nothing to reduce on any rank
    if (!joins_only) zero_tail(local, count, stream);
    return;
  }
  DpComm& dp = dp_comm(group);
  const ncclDataType_t type = nccl_type(global.dtype);
  // NOTE: stream-ordered scratch for this rank's own reduce, freed on `stream` after it (error path only).
  std::shared_ptr<void> scratch;
  void* recv = local.data;
  if (joins_only) {
    scratch = detail::cuda_allocate(static_cast<size_t>(count) * row_bytes, group.device(), stream);
    recv = scratch.get();
  }
  // NOTE: one ncclReduce per root in every mode. The path must not depend on anything but the plan
  // (a reduce-scatter straight into `local` would need slot_len rows there, which differs by rank), and
  // on 2x H200 the grouped reduces beat ncclReduceScatter of the same bytes at 4096 and 8192 tokens per
  // rank (8192 x 7168 bf16: 405 vs 540 us), tie at 1024 and are up to 9 us slower below.
  nccl_wait(dp, nccl().GroupStart(), "ncclGroupStart (dp_scatter)");
  ncclResult_t first_error = ncclSuccess;
  for (int root = 0; root < group.num_ranks(); ++root) {
    const int dp_rank = layout.coords(root).attn_dp_rank;
    const int64_t n = plan.num_tokens[dp_rank] * hidden;
    if (n == 0) continue;
    // NOTE: recvbuff matters on the root only; the others pass their own local (possibly empty).
    const ncclResult_t res = nccl().Reduce(row_ptr(global, plan.offsets[dp_rank]), recv, static_cast<size_t>(n), type,
                                           ncclSum, root, dp.comm, stream);
    if (res != ncclSuccess && res != ncclInProgress && first_error == ncclSuccess) first_error = res;
  }
  const ncclResult_t end = nccl().GroupEnd();
  nccl_wait(dp, first_error, "ncclReduce (dp_scatter)");
  nccl_wait(dp, end, "ncclGroupEnd (dp_scatter)");
  if (!joins_only) zero_tail(local, count, stream);
}

void dp_all_gather_records_cuda(Group& group, const void* send, void* recv, size_t bytes) {
  DpComm& dp = dp_comm(group);
  DeviceGuard guard(dp.device);
  const size_t num_ranks = static_cast<size_t>(group.num_ranks());
  if (dp.meta_record_bytes != bytes) {
    if (dp.meta_host != nullptr) {
      check_cuda(cudaStreamSynchronize(dp.meta_stream), "cudaStreamSynchronize");
      cudaFree(dp.meta_device);
      cudaFreeHost(dp.meta_host);
      dp.meta_device = dp.meta_host = nullptr;
    }
    check_cuda(cudaHostAlloc(&dp.meta_host, (num_ranks + 1) * bytes, cudaHostAllocMapped | cudaHostAllocPortable),
               "cudaHostAlloc (metadata)");
    dp.meta_record_bytes = bytes;
  }
  char* host = static_cast<char*>(dp.meta_host);
  std::memcpy(host + num_ranks * bytes, send, bytes);
  bool done = false;
  if (dp.meta_mapped) {
    void* mapped = nullptr;
    check_cuda(cudaHostGetDevicePointer(&mapped, dp.meta_host, 0), "cudaHostGetDevicePointer (metadata)");
    char* m = static_cast<char*>(mapped);
    const ncclResult_t res = nccl().AllGather(m + num_ranks * bytes, m, bytes, ncclChar, dp.comm, dp.meta_stream);
    // NOTE: every rank sees the same NCCL build and memory kind, so all fall back together.
    if (res == ncclSuccess || res == ncclInProgress) {
      nccl_wait(dp, res, "ncclAllGather (metadata)");
      done = true;
    } else {
      dp.meta_mapped = false;
      log(LogLevel::kWarn, fmt::format("epx cuda rank {}: NCCL refused mapped host memory for the batch-metadata "
                                       "all-gather ({}); using device copies from now on",
                                       group.rank(), nccl().GetErrorString(res)));
    }
  }
  if (!done) {
    if (dp.meta_device == nullptr) {
      check_cuda(cudaMalloc(&dp.meta_device, (num_ranks + 1) * bytes), "cudaMalloc (metadata)");
    }
    char* dev = static_cast<char*>(dp.meta_device);
    check_cuda(cudaMemcpyAsync(dev + num_ranks * bytes, host + num_ranks * bytes, bytes, cudaMemcpyHostToDevice,
                               dp.meta_stream),
               "cudaMemcpyAsync (metadata)");
    nccl_wait(dp, nccl().AllGather(dev + num_ranks * bytes, dev, bytes, ncclChar, dp.comm, dp.meta_stream),
              "ncclAllGather (metadata)");
    check_cuda(cudaMemcpyAsync(host, dev, num_ranks * bytes, cudaMemcpyDeviceToHost, dp.meta_stream),
               "cudaMemcpyAsync (metadata)");
  }
  // NOTE: spin on the stream instead of sleeping (a sleep costs tens of microseconds, over the step
  // budget); bounded by the group's timeout. After a timeout the all-gather is still queued, so the
  // DP communicator of this group is unusable.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(dp.timeout_ms);
  while (true) {
    const cudaError_t status = cudaStreamQuery(dp.meta_stream);
    if (status == cudaSuccess) break;
    if (status != cudaErrorNotReady) check_cuda(status, "batch-metadata all-gather");
    if (std::chrono::steady_clock::now() > deadline) {
      dp.failed = fmt::format("a batch-metadata all-gather timed out after {} ms", dp.timeout_ms);
      detail::raise(ErrorCode::kTimeout,
                    "cuda rank {} waited {} ms in the batch-metadata all-gather for its peers; the DP communicator "
                    "of this group cannot be used again (its all-gather stays queued): destroy the group and create "
                    "a new one on every rank",
                    group.rank(), dp.timeout_ms);
    }
    std::this_thread::yield();
  }
  std::memcpy(recv, host, num_ranks * bytes);
}

}  // namespace epx::cuda
