// dp_gather / dp_scatter on the host backend: ranks are threads, so every rank reads the published
// buffers of its peers directly between HostGroup::exchange and release.
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/host/host_group.h"
#include "core/bf16.h"
#include "core/check.h"
#include "dp/backends.h"
#include "epx/quant.h"

namespace epx::host {

namespace {

// What each rank publishes for one collective.
struct Contribution {
  const DpGatherPlan* plan;
  const void* data;  // local (gather) or global (reduce-scatter)
  DType dtype;
  int64_t hidden;
  DpGatherSource source = DpGatherSource::kLeader;  // gather only
  std::span<const int64_t> cp_shard_counts;         // empty: the CP ranks hold the same rows
};

HostGroup& as_host(Group& group) {
  auto* host_group = dynamic_cast<HostGroup*>(&group);
  EPX_CHECK(ErrorCode::kInternal, host_group != nullptr, "a group with the host backend is not a HostGroup");
  return *host_group;
}

bool same_plan(const DpGatherPlan& a, const DpGatherPlan& b) {
  return a.mode == b.mode && a.buffer_len == b.buffer_len && a.slot_len == b.slot_len && a.num_tokens == b.num_tokens &&
         a.offsets == b.offsets;
}

// Empty when every rank passed the same plan, dtype and hidden size as rank 0, and the same CP shard counts as its
// DP leader; else a message.
std::string find_mismatch(const ParallelLayout& layout, const std::vector<const void*>& ptrs) {
  const auto& first = *static_cast<const Contribution*>(ptrs[0]);
  for (size_t r = 1; r < ptrs.size(); ++r) {
    const auto& c = *static_cast<const Contribution*>(ptrs[r]);
    if (!same_plan(*c.plan, *first.plan)) return fmt::format("rank {} passed a different plan than rank 0", r);
    if (c.source != first.source) {
      auto name = [](DpGatherSource s) {
        return s == DpGatherSource::kPartialSums ? "partial sums" : "the leader's rows";
      };
      return fmt::format("rank {} passed source {}, rank 0 {}", r, name(c.source), name(first.source));
    }
    if (c.dtype != first.dtype || c.hidden != first.hidden) {
      return fmt::format("rank {} passed {} hidden {}, rank 0 {} hidden {}", r, to_string(c.dtype), c.hidden,
                         to_string(first.dtype), first.hidden);
    }
    const int leader = layout.dp_leader(layout.coords(static_cast<int>(r)).attn_dp_rank);
    const auto& lead = *static_cast<const Contribution*>(ptrs[leader]);
    if (!std::equal(c.cp_shard_counts.begin(), c.cp_shard_counts.end(), lead.cp_shard_counts.begin(),
                    lead.cp_shard_counts.end())) {
      return fmt::format("rank {} passed cp_shard_counts [{}], its DP leader rank {} [{}]", r,
                         fmt::join(c.cp_shard_counts, ", "), leader, fmt::join(lead.cp_shard_counts, ", "));
    }
  }
  return {};
}

// out = 0 + x in the element type: what an all-reduce computes when one rank contributes x and the
// others zeros (for bf16 on the bits, core/bf16.h).
inline float add_to_zero(float x) { return 0.f + x; }
inline uint16_t add_to_zero(uint16_t x) { return detail::bf16_add_zero(x); }
inline int32_t add_to_zero(int32_t x) { return x; }
inline int64_t add_to_zero(int64_t x) { return x; }

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) { return detail::bf16_to_float(x); }
inline void from_float(float x, float& out) { out = x; }
inline void from_float(float x, uint16_t& out) { out = float_to_bf16(x); }

template <typename T>
void reduce_rows(const std::vector<const void*>& ptrs, int64_t first_row, int64_t num_rows, T* local, int64_t hidden);

template <typename T>
void gather_rows(const ParallelLayout& layout, const DpGatherPlan& plan, const std::vector<const void*>& ptrs,
                 T* global, int64_t hidden) {
  if (plan.buffer_len == 0 || hidden == 0) return;  // nothing to write; global may be a null empty view
  std::memset(global, 0, static_cast<size_t>(plan.buffer_len * hidden) * sizeof(T));
  const bool partial = static_cast<const Contribution*>(ptrs[0])->source == DpGatherSource::kPartialSums;
  // NOTE: with attn_cp > 1 both modes are all-reduces (as the cuda backend runs them), so MAX_LEN rows are 0 + x.
  const bool copy = plan.mode == DpPaddingMode::kMaxLen && layout.attn_cp_size() == 1;
  for (int d = 0; d < layout.attn_dp_size(); ++d) {
    const auto shards = static_cast<const Contribution*>(ptrs[layout.dp_leader(d)])->cp_shard_counts;
    const int num_shards = shards.empty() ? 1 : layout.attn_cp_size();
    for (int c = 0; c < num_shards; ++c) {
      const auto [first, rows] = shards.empty() ? std::pair<int64_t, int64_t>{plan.offsets[d], plan.num_tokens[d]}
                                                : detail::dp_cp_shard_rows(shards, c, plan.offsets[d]);
      T* dst = global + first * hidden;
      if (partial) {
        // The shard's attention-TP ranks in TP-rank order (the documented summation order), summed as reduce_rows does.
        std::vector<const void*> group_ptrs;
        for (int t = 0; t < layout.attn_tp_size(); ++t) group_ptrs.push_back(ptrs[layout.attn_rank(d, c, t)]);
        reduce_rows(group_ptrs, 0, rows, dst, hidden);
        continue;
      }
      const T* src = static_cast<const T*>(static_cast<const Contribution*>(ptrs[layout.attn_rank(d, c, 0)])->data);
      const int64_t n = rows * hidden;
      if (copy) {
        if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(T));
      } else {
        for (int64_t i = 0; i < n; ++i) dst[i] = add_to_zero(src[i]);
      }
    }
  }
}

template <typename T>
void reduce_rows(const std::vector<const void*>& ptrs, int64_t first_row, int64_t num_rows, T* local, int64_t hidden) {
  if constexpr (std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t>) {  // not uint16_t: bf16 bits
    // NOTE: integers sum exactly in two's complement, wrapping modulo 2^bits on overflow (NCCL's integer
    // sum does the same); modular addition does not depend on the order, so every backend agrees bit-exactly.
    using U = std::make_unsigned_t<T>;
    std::vector<U> acc(static_cast<size_t>(num_rows * hidden), 0);
    for (const void* p : ptrs) {
      const T* src = static_cast<const T*>(static_cast<const Contribution*>(p)->data) + first_row * hidden;
      for (size_t i = 0; i < acc.size(); ++i) acc[i] = static_cast<U>(acc[i] + static_cast<U>(src[i]));
    }
    for (size_t i = 0; i < acc.size(); ++i) local[i] = static_cast<T>(acc[i]);
  } else {
    std::vector<float> acc(static_cast<size_t>(num_rows * hidden), 0.f);
    for (const void* p : ptrs) {  // rank order: the documented summation order
      const T* src = static_cast<const T*>(static_cast<const Contribution*>(p)->data) + first_row * hidden;
      for (size_t i = 0; i < acc.size(); ++i) acc[i] += to_float(src[i]);
    }
    for (size_t i = 0; i < acc.size(); ++i) from_float(acc[i], local[i]);
  }
}

// Calls fn(T{}) with T the element type of `dtype` (validated: bf16, fp32, int32 or int64).
template <typename Fn>
void visit_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32:
      return fn(float{});
    case DType::kBFloat16:
      return fn(uint16_t{});
    case DType::kInt32:
      return fn(int32_t{});
    case DType::kInt64:
      return fn(int64_t{});
    default:
      detail::raise(ErrorCode::kInternal, "dp gather/scatter: unexpected dtype {}", to_string(dtype));
  }
}

}  // namespace

void dp_gather_host(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& local,
                    const TensorView& global, DpGatherSource source, std::span<const int64_t> cp_shard_counts) {
  HostGroup& host_group = as_host(group);
  const int64_t hidden = detail::dp_row_elems(global);
  const Contribution mine{&plan, local.data, local.dtype, hidden, source, cp_shard_counts};
  const auto ptrs = host_group.exchange(&mine);
  const std::string mismatch = find_mismatch(layout, ptrs);
  if (mismatch.empty()) {
    visit_dtype(global.dtype,
                [&](auto zero) { gather_rows(layout, plan, ptrs, static_cast<decltype(zero)*>(global.data), hidden); });
  }
  // NOTE: release before raising, so no peer waits on a rank that left; every rank sees the same
  // mismatch and raises the same error.
  host_group.release();
  EPX_CHECK_ARG(mismatch.empty(), "dp_gather: {}", mismatch);
}

void dp_scatter_host(Group& group, const ParallelLayout& layout, const DpGatherPlan& plan, const TensorView& global,
                     const TensorView& local, DpScatterKind kind, std::span<const int64_t> cp_shard_counts) {
  const int64_t hidden = detail::dp_row_elems(global);
  const RankCoords me = layout.coords(group.rank());
  const int dp_rank = me.attn_dp_rank;
  // kSlice with shards: this CP rank's shard only (kReduceScatter takes no shards: checked by dp_scatter).
  const std::pair<int64_t, int64_t> rows =
      cp_shard_counts.empty() ? std::pair<int64_t, int64_t>{plan.offsets[dp_rank], plan.num_tokens[dp_rank]}
                              : detail::dp_cp_shard_rows(cp_shard_counts, me.attn_cp_rank, plan.offsets[dp_rank]);
  const int64_t first_row = rows.first, count = rows.second;
  const size_t elem = dtype_size(local.dtype);
  auto* out = static_cast<char*>(local.data);
  // Rows past the count (CUDA-graph padding) are zeroed.
  if (local.shape[0] > count && hidden > 0) {
    std::memset(out + count * hidden * elem, 0, static_cast<size_t>((local.shape[0] - count) * hidden) * elem);
  }
  if (kind == DpScatterKind::kSlice) {
    // A slice of this rank's own buffer: no communication.
    const auto* src = static_cast<const char*>(global.data) + first_row * hidden * elem;
    if (count > 0) std::memcpy(out, src, static_cast<size_t>(count * hidden) * elem);
    return;
  }
  HostGroup& host_group = as_host(group);
  const Contribution mine{&plan, global.data, global.dtype, hidden, DpGatherSource::kLeader, {}};
  const auto ptrs = host_group.exchange(&mine);
  const std::string mismatch = find_mismatch(layout, ptrs);
  if (mismatch.empty()) {
    visit_dtype(local.dtype, [&](auto zero) {
      reduce_rows(ptrs, plan.offsets[dp_rank], count, static_cast<decltype(zero)*>(local.data), hidden);
    });
  }
  host_group.release();
  EPX_CHECK_ARG(mismatch.empty(), "dp_scatter: {}", mismatch);
}

void dp_fail_host(Group& group, const std::string& reason) noexcept {
  auto* host_group = dynamic_cast<HostGroup*>(&group);
  if (host_group != nullptr) host_group->fail(reason);
}

}  // namespace epx::host
