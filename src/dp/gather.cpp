// Padding-mode choice, the gather plan, and the validated entry points of dp_gather / dp_scatter.
#include <algorithm>
#include <numeric>
#include <string>

#include "core/check.h"
#include "core/limits.h"
#include "dp/backends.h"
#include "epx/dp.h"

namespace epx {

namespace {

void check_counts(std::span<const int64_t> num_tokens, const char* what) {
  EPX_CHECK_ARG(!num_tokens.empty() && num_tokens.size() <= static_cast<size_t>(kMaxDpWorldSize),
                "{}: num_tokens_per_dp_rank must name 1 to {} DP ranks, got {}", what, kMaxDpWorldSize,
                num_tokens.size());
  for (size_t d = 0; d < num_tokens.size(); ++d) {
    EPX_CHECK_ARG(num_tokens[d] >= 0 && num_tokens[d] <= kMaxDpBufferRows,
                  "{}: num_tokens_per_dp_rank[{}] must be in [0, 2^40], got {}", what, d, num_tokens[d]);
  }
}

}  // namespace

const char* to_string(DpPaddingMode mode) noexcept { return mode == DpPaddingMode::kMaxLen ? "MAX_LEN" : "SUM_LEN"; }

DpPaddingMode choose_padding_mode(std::span<const int64_t> num_tokens_per_dp_rank, const PaddingModeOptions& options) {
  check_counts(num_tokens_per_dp_rank, "choose_padding_mode");
  if (options.symmetric_a2a || options.in_cuda_graph) return DpPaddingMode::kMaxLen;
  const int64_t width = static_cast<int64_t>(num_tokens_per_dp_rank.size());
  if (options.is_extend_in_batch && width > 1) return DpPaddingMode::kSumLen;
  const int64_t sum = std::accumulate(num_tokens_per_dp_rank.begin(), num_tokens_per_dp_rank.end(), int64_t{0});
  const int64_t max = *std::max_element(num_tokens_per_dp_rank.begin(), num_tokens_per_dp_rank.end());
  // Padding to the max moves max * width rows; summing moves sum rows but as an all-reduce (about twice
  // the bytes of an all-gather), so MAX_LEN wins while 2 * sum >= max * width.
  return 2 * sum >= max * width ? DpPaddingMode::kMaxLen : DpPaddingMode::kSumLen;
}

DpGatherPlan plan_dp_gather(std::span<const int64_t> num_tokens_per_dp_rank, DpPaddingMode mode, int attn_tp_size) {
  check_counts(num_tokens_per_dp_rank, "plan_dp_gather");
  EPX_CHECK_ARG(attn_tp_size >= 1 && attn_tp_size <= kMaxDpWorldSize,
                "plan_dp_gather: attn_tp_size must be in [1, {}], got {}", kMaxDpWorldSize, attn_tp_size);
  EPX_CHECK_ARG(mode == DpPaddingMode::kMaxLen || mode == DpPaddingMode::kSumLen,
                "plan_dp_gather: mode must be MAX_LEN or SUM_LEN, got {}", static_cast<int>(mode));
  const int64_t width = static_cast<int64_t>(num_tokens_per_dp_rank.size());
  DpGatherPlan plan;
  plan.mode = mode;
  plan.num_tokens.assign(num_tokens_per_dp_rank.begin(), num_tokens_per_dp_rank.end());
  plan.offsets.resize(width);
  if (mode == DpPaddingMode::kMaxLen) {
    const int64_t max = *std::max_element(plan.num_tokens.begin(), plan.num_tokens.end());
    plan.slot_len = (max + attn_tp_size - 1) / attn_tp_size * attn_tp_size;
    EPX_CHECK_ARG(plan.slot_len <= kMaxDpBufferRows / width,
                  "plan_dp_gather: buffer of {} DP ranks x {} rows exceeds 2^40 rows", width, plan.slot_len);
    for (int64_t d = 0; d < width; ++d) plan.offsets[d] = d * plan.slot_len;
    plan.buffer_len = plan.slot_len * width;
  } else {
    int64_t offset = 0;
    for (int64_t d = 0; d < width; ++d) {
      plan.offsets[d] = offset;
      offset += plan.num_tokens[d];
      EPX_CHECK_ARG(offset <= kMaxDpBufferRows, "plan_dp_gather: the sum of the counts exceeds 2^40 rows");
    }
    plan.buffer_len = offset;
  }
  return plan;
}

namespace {

constexpr std::initializer_list<DType> kDpDtypes = {DType::kBFloat16, DType::kFloat32, DType::kInt32, DType::kInt64};

// A plan must have the shape plan_dp_gather gives it (callers may build or edit one by hand).
void check_plan(const DpGatherPlan& plan, const ParallelLayout& layout, const char* what) {
  const size_t width = static_cast<size_t>(layout.attn_dp_size());
  EPX_CHECK_ARG(plan.num_tokens.size() == width && plan.offsets.size() == width,
                "{}: plan must have attn_dp_size = {} counts and offsets, got {} and {}", what, width,
                plan.num_tokens.size(), plan.offsets.size());
  check_counts(plan.num_tokens, what);
  EPX_CHECK_ARG(plan.buffer_len >= 0 && plan.buffer_len <= kMaxDpBufferRows,
                "{}: plan.buffer_len must be in [0, 2^40], got {}", what, plan.buffer_len);
  // NOTE: MAX_LEN splits each slot over the attention-TP ranks (the cuda path's in-place all-gather gives rank i of a
  // TP group rows [i * slot_len / tp, ...) of its slot), so the slot must divide evenly; a plan made with the default
  // attn_tp_size = 1 for a layout with TP passed before and moved the wrong rows on the cuda backend.
  EPX_CHECK_ARG(plan.mode != DpPaddingMode::kMaxLen || plan.slot_len % layout.attn_tp_size() == 0,
                "{}: plan.slot_len = {} must be a multiple of layout.attn_tp_size() = {} for MAX_LEN: make the plan "
                "with plan_dp_gather(counts, mode, layout.attn_tp_size())",
                what, plan.slot_len, layout.attn_tp_size());
  int64_t expected = 0;
  for (size_t d = 0; d < width; ++d) {
    if (plan.mode == DpPaddingMode::kMaxLen) {
      EPX_CHECK_ARG(plan.num_tokens[d] <= plan.slot_len, "{}: plan.num_tokens[{}] = {} exceeds plan.slot_len {}", what,
                    d, plan.num_tokens[d], plan.slot_len);
      expected = static_cast<int64_t>(d) * plan.slot_len;
    }
    EPX_CHECK_ARG(plan.offsets[d] == expected, "{}: plan.offsets[{}] must be {} for {}, got {}", what, d, expected,
                  to_string(plan.mode), plan.offsets[d]);
    if (plan.mode == DpPaddingMode::kSumLen) expected += plan.num_tokens[d];
  }
  const int64_t expected_len =
      plan.mode == DpPaddingMode::kMaxLen ? plan.slot_len * static_cast<int64_t>(width) : expected;
  EPX_CHECK_ARG(plan.buffer_len == expected_len, "{}: plan.buffer_len must be {} for {}, got {}", what, expected_len,
                to_string(plan.mode), plan.buffer_len);
}

// What fixes the collective every rank makes (NCCL call, count, dtype): the layout, the plan and `global`. A rank
// whose other arguments fail can still make it (dp_gather_fail, dp_scatter_fail).
void check_shape(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& global,
                 const char* what) {
  EPX_CHECK_ARG(layout.world_size() == group.num_ranks(), "{}: layout.world_size() {} must equal group.num_ranks() {}",
                what, layout.world_size(), group.num_ranks());
  check_plan(plan, layout, what);
  // NOTE: a 1-D tensor [rows] is a 2-D one [rows, 1] (input ids, positions); local and global have the same rank.
  EPX_CHECK_ARG(global.defined() && (global.ndim == 1 || global.ndim == 2),
                "{}: global must be [buffer_len] or [buffer_len, hidden], got {}", what, global.describe());
  if (global.ndim == 2) {
    check_tensor(global, "global", kDpDtypes, {plan.buffer_len, -1});
  } else {
    check_tensor(global, "global", kDpDtypes, {plan.buffer_len});
  }
  check_device(global, "global", group.device());
}

void check_source(DpGatherSource source) {
  EPX_CHECK_ARG(source == DpGatherSource::kLeader || source == DpGatherSource::kPartialSums,
                "dp_gather: source must be kLeader or kPartialSums, got {}", static_cast<int>(source));
}

void check_kind(DpScatterKind kind) {
  EPX_CHECK_ARG(kind == DpScatterKind::kSlice || kind == DpScatterKind::kReduceScatter,
                "dp_scatter: kind must be kSlice or kReduceScatter, got {}", static_cast<int>(kind));
}

// The rest: this rank's own rows (a shape-checked global).
void check_local(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& local,
                 const TensorView& global, std::span<const int64_t> cp_shard_counts, const char* what) {
  if (global.ndim == 2) {
    check_tensor(local, "local", kDpDtypes, {-1, global.shape[1]});
  } else {
    check_tensor(local, "local", kDpDtypes, {-1});
  }
  EPX_CHECK_ARG(local.dtype == global.dtype, "{}: local and global must have the same dtype, got {} and {}", what,
                local.describe(), global.describe());
  check_device(local, "local", group.device());
  const RankCoords me = layout.coords(group.rank());
  if (cp_shard_counts.empty()) {
    EPX_CHECK_ARG(local.shape[0] >= plan.num_tokens[me.attn_dp_rank],
                  "{}: local must have at least plan.num_tokens[{}] = {} rows (this rank's DP rank), got {}", what,
                  me.attn_dp_rank, plan.num_tokens[me.attn_dp_rank], local.describe());
    return;
  }
  EPX_CHECK_ARG(cp_shard_counts.size() == static_cast<size_t>(layout.attn_cp_size()),
                "{}: cp_shard_counts must hold attn_cp_size = {} counts, got {}", what, layout.attn_cp_size(),
                cp_shard_counts.size());
  int64_t sum = 0;
  for (size_t c = 0; c < cp_shard_counts.size(); ++c) {
    EPX_CHECK_ARG(cp_shard_counts[c] >= 0 && cp_shard_counts[c] <= kMaxDpBufferRows,
                  "{}: cp_shard_counts[{}] must be in [0, 2^40], got {}", what, c, cp_shard_counts[c]);
    sum += cp_shard_counts[c];
  }
  EPX_CHECK_ARG(sum == plan.num_tokens[me.attn_dp_rank],
                "{}: cp_shard_counts must sum to plan.num_tokens[{}] = {} (this rank's DP rank), got {}", what,
                me.attn_dp_rank, plan.num_tokens[me.attn_dp_rank], sum);
  EPX_CHECK_ARG(local.shape[0] >= cp_shard_counts[me.attn_cp_rank],
                "{}: local must have at least cp_shard_counts[{}] = {} rows (this rank's CP shard), got {}", what,
                me.attn_cp_rank, cp_shard_counts[me.attn_cp_rank], local.describe());
}

// The message of the exception in flight (inside a catch block).
std::string current_reason() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

#ifdef EPX_WITH_CUDA
// Whether `call` fixes the collective of a gather (with_source) or scatter (!with_source), without throwing.
bool shape_known(Group& group, const DpFailedCall& call, bool with_source, const char* what) noexcept {
  if (call.layout == nullptr || call.plan == nullptr || (with_source ? !call.source : !call.kind)) return false;
  try {
    check_shape(group, *call.layout, *call.plan, call.global, what);
    if (with_source) {
      check_source(*call.source);
    } else {
      check_kind(*call.kind);
    }
    return true;
  } catch (...) {
    return false;
  }
}
#endif

}  // namespace

void dp_gather(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& local,
               const TensorView& global, Stream stream, DpGatherSource source,
               std::span<const int64_t> cp_shard_counts) {
  try {
    check_shape(group, layout, plan, global, "dp_gather");
    check_source(source);
    check_local(group, layout, plan, local, global, cp_shard_counts, "dp_gather");
  } catch (...) {
    // NOTE: a rank that skipped the collective would leave its peers waiting, or paired with its next call.
    dp_gather_fail(group, current_reason(), {&layout, &plan, global, stream, source, std::nullopt});
    throw;
  }
  switch (group.backend()) {
    case Backend::kHost:
      return host::dp_gather_host(group, layout, plan, local, global, source, cp_shard_counts);
    case Backend::kCuda:
#ifdef EPX_WITH_CUDA
      return cuda::dp_gather_cuda(group, layout, plan, local, global, stream, source, cp_shard_counts);
#else
      break;
#endif
  }
  detail::raise(ErrorCode::kUnsupported, "dp_gather: the {} backend has no implementation in this build",
                to_string(group.backend()));
}

void dp_scatter(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& global,
                const TensorView& local, DpScatterKind kind, Stream stream, std::span<const int64_t> cp_shard_counts) {
  try {
    check_shape(group, layout, plan, global, "dp_scatter");
    check_kind(kind);
    check_local(group, layout, plan, local, global, cp_shard_counts, "dp_scatter");
    EPX_CHECK_ARG(kind == DpScatterKind::kSlice || cp_shard_counts.empty(),
                  "dp_scatter: kReduceScatter takes no cp_shard_counts (every CP rank receives its DP rank's rows, as "
                  "SGLang's dp_reduce_scatter_tensor); take the shard with kSlice or zigzag_local_rows");
  } catch (...) {
    dp_scatter_fail(group, current_reason(), {&layout, &plan, global, stream, std::nullopt, kind});
    throw;
  }
  switch (group.backend()) {
    case Backend::kHost:
      return host::dp_scatter_host(group, layout, plan, global, local, kind, cp_shard_counts);
    case Backend::kCuda:
#ifdef EPX_WITH_CUDA
      return cuda::dp_scatter_cuda(group, layout, plan, global, local, kind, stream, cp_shard_counts);
#else
      break;
#endif
  }
  detail::raise(ErrorCode::kUnsupported, "dp_scatter: the {} backend has no implementation in this build",
                to_string(group.backend()));
}

void dp_gather_fail(Group& group, const std::string& reason, const DpFailedCall& call) noexcept {
  switch (group.backend()) {
    case Backend::kHost:
      return host::dp_fail_host(group, reason);
    case Backend::kCuda:
#ifdef EPX_WITH_CUDA
      if (!shape_known(group, call, /*with_source=*/true, "dp_gather")) {
        return cuda::dp_abandon_cuda(group, fmt::format("dp_gather failed before its collective: {}", reason));
      }
      try {
        // An undefined local: the backend contributes zero rows of this rank's.
        cuda::dp_gather_cuda(group, *call.layout, *call.plan, TensorView{}, call.global, call.stream, *call.source, {});
        cuda::dp_note_joined_failure_cuda(group);
      } catch (const std::exception& e) {
        cuda::dp_abandon_cuda(
            group, fmt::format("dp_gather failed ({}) and could not join its collective: {}", reason, e.what()));
      } catch (...) {
        cuda::dp_abandon_cuda(group, "dp_gather failed and could not join its collective");
      }
#endif
      return;
  }
}

void dp_scatter_fail(Group& group, const std::string& reason, const DpFailedCall& call) noexcept {
  // NOTE: kSlice has no collective; with the kind unknown (or invalid) this rank cannot tell whether the peers'
  // call has one, so it joins none.
  if (call.kind != DpScatterKind::kReduceScatter) return;
  switch (group.backend()) {
    case Backend::kHost:
      return host::dp_fail_host(group, reason);
    case Backend::kCuda:
#ifdef EPX_WITH_CUDA
      if (!shape_known(group, call, /*with_source=*/false, "dp_scatter")) {
        return cuda::dp_abandon_cuda(group, fmt::format("dp_scatter failed before its collective: {}", reason));
      }
      try {
        // An undefined local: the backend sends this rank's rows of global and keeps nothing.
        cuda::dp_scatter_cuda(group, *call.layout, *call.plan, call.global, TensorView{}, *call.kind, call.stream, {});
        cuda::dp_note_joined_failure_cuda(group);
      } catch (const std::exception& e) {
        cuda::dp_abandon_cuda(
            group, fmt::format("dp_scatter failed ({}) and could not join its collective: {}", reason, e.what()));
      } catch (...) {
        cuda::dp_abandon_cuda(group, "dp_scatter failed and could not join its collective");
      }
#endif
      return;
  }
}

}  // namespace epx
