// Rank arithmetic of DP attention and the MoE over the same ranks.
#include <algorithm>

#include "core/check.h"
#include "core/limits.h"
#include "epx/dp.h"

namespace epx {

const char* to_string(ParallelGroupKind kind) noexcept {
  switch (kind) {
    case ParallelGroupKind::kAttnTp:
      return "attn_tp";
    case ParallelGroupKind::kAttnCp:
      return "attn_cp";
    case ParallelGroupKind::kAttnDp:
      return "attn_dp";
    case ParallelGroupKind::kMoeTp:
      return "moe_tp";
    case ParallelGroupKind::kMoeEp:
      return "moe_ep";
    case ParallelGroupKind::kMoeDp:
      return "moe_dp";
  }
  return "unknown";
}

namespace {

// Fills a 0 entry of {a, b, c} so that a * b * c == world; checks the product otherwise.
void derive_triple(int world, int& a, const char* a_name, int& b, const char* b_name, int& c, const char* c_name) {
  int* sizes[3] = {&a, &b, &c};
  const char* names[3] = {a_name, b_name, c_name};
  int num_zero = 0;
  for (int i = 0; i < 3; ++i) {
    EPX_CHECK_ARG(*sizes[i] >= 0 && *sizes[i] <= world, "{} must be in [1, world_size {}] (0: derive), got {}",
                  names[i], world, *sizes[i]);
    num_zero += *sizes[i] == 0;
  }
  EPX_CHECK_ARG(num_zero <= 1, "at most one of {}, {}, {} may be 0 (derived), got {}, {}, {}", a_name, b_name, c_name,
                a, b, c);
  for (int i = 0; i < 3; ++i) {
    if (*sizes[i] != 0) continue;
    const int other = *sizes[(i + 1) % 3] * *sizes[(i + 2) % 3];
    EPX_CHECK_ARG(world % other == 0, "world_size {} must be divisible by {} * {} = {} to derive {}", world,
                  names[(i + 1) % 3], names[(i + 2) % 3], other, names[i]);
    *sizes[i] = world / other;
  }
  EPX_CHECK_ARG(static_cast<int64_t>(a) * b * c == world, "{} {} * {} {} * {} {} must equal world_size {}", a_name, a,
                b_name, b, c_name, c, world);
}

}  // namespace

ParallelLayout ParallelLayout::create(const ParallelSizes& sizes) {
  EPX_CHECK_ARG(sizes.world_size >= 1 && sizes.world_size <= kMaxDpWorldSize, "world_size must be in [1, {}], got {}",
                kMaxDpWorldSize, sizes.world_size);
  EPX_CHECK_ARG(sizes.attn_dp_size >= 1, "attn_dp_size must be >= 1, got {}", sizes.attn_dp_size);
  EPX_CHECK_ARG(sizes.attn_cp_size >= 1, "attn_cp_size must be >= 1, got {}", sizes.attn_cp_size);
  EPX_CHECK_ARG(sizes.moe_dp_size >= 1, "moe_dp_size must be >= 1, got {}", sizes.moe_dp_size);
  ParallelLayout layout;
  layout.sizes_ = sizes;
  ParallelSizes& s = layout.sizes_;
  derive_triple(s.world_size, s.attn_tp_size, "attn_tp_size", s.attn_cp_size, "attn_cp_size", s.attn_dp_size,
                "attn_dp_size");
  // Default MoE: every rank one EP rank (moe_tp 1) unless the caller gave moe_tp.
  if (s.moe_ep_size == 0 && s.moe_tp_size == 0) s.moe_tp_size = 1;
  derive_triple(s.world_size, s.moe_tp_size, "moe_tp_size", s.moe_ep_size, "moe_ep_size", s.moe_dp_size, "moe_dp_size");
  return layout;
}

ParallelLayout ParallelLayout::pure_dp(int world_size) {
  return create({.world_size = world_size, .attn_dp_size = world_size});
}

RankCoords ParallelLayout::coords(int rank) const {
  EPX_CHECK_ARG(rank >= 0 && rank < sizes_.world_size, "rank must be in [0, {}), got {}", sizes_.world_size, rank);
  const ParallelSizes& s = sizes_;
  RankCoords c;
  c.attn_tp_rank = rank % s.attn_tp_size;
  c.attn_cp_rank = (rank / s.attn_tp_size) % s.attn_cp_size;
  c.attn_dp_rank = rank / (s.attn_tp_size * s.attn_cp_size);
  c.moe_tp_rank = rank % s.moe_tp_size;
  c.moe_ep_rank = (rank / s.moe_tp_size) % s.moe_ep_size;
  c.moe_dp_rank = rank / (s.moe_tp_size * s.moe_ep_size);
  return c;
}

int ParallelLayout::attn_rank(int attn_dp_rank, int attn_cp_rank, int attn_tp_rank) const {
  const ParallelSizes& s = sizes_;
  EPX_CHECK_ARG(attn_dp_rank >= 0 && attn_dp_rank < s.attn_dp_size, "attn_dp_rank must be in [0, {}), got {}",
                s.attn_dp_size, attn_dp_rank);
  EPX_CHECK_ARG(attn_cp_rank >= 0 && attn_cp_rank < s.attn_cp_size, "attn_cp_rank must be in [0, {}), got {}",
                s.attn_cp_size, attn_cp_rank);
  EPX_CHECK_ARG(attn_tp_rank >= 0 && attn_tp_rank < s.attn_tp_size, "attn_tp_rank must be in [0, {}), got {}",
                s.attn_tp_size, attn_tp_rank);
  return (attn_dp_rank * s.attn_cp_size + attn_cp_rank) * s.attn_tp_size + attn_tp_rank;
}

bool ParallelLayout::is_dp_leader(int rank) const {
  const RankCoords c = coords(rank);
  return c.attn_tp_rank == 0 && c.attn_cp_rank == 0;
}

namespace {

// The coordinate a group of `kind` varies along, and the key that names the group (the other coordinates).
int varying(ParallelGroupKind kind, const RankCoords& c) {
  switch (kind) {
    case ParallelGroupKind::kAttnTp:
      return c.attn_tp_rank;
    case ParallelGroupKind::kAttnCp:
      return c.attn_cp_rank;
    case ParallelGroupKind::kAttnDp:
      return c.attn_dp_rank;
    case ParallelGroupKind::kMoeTp:
      return c.moe_tp_rank;
    case ParallelGroupKind::kMoeEp:
      return c.moe_ep_rank;
    case ParallelGroupKind::kMoeDp:
      return c.moe_dp_rank;
  }
  return 0;
}

}  // namespace

std::vector<std::vector<int>> ParallelLayout::groups(ParallelGroupKind kind) const {
  // Ranks with equal coordinates except along `kind` form one group: rank - varying * stride is the same.
  std::vector<std::vector<int>> result;
  std::vector<int> group_idx(sizes_.world_size, -1);
  for (int r = 0; r < sizes_.world_size; ++r) {
    if (group_idx[r] >= 0) continue;
    result.push_back(group_of(kind, r));
    for (int m : result.back()) group_idx[m] = static_cast<int>(result.size()) - 1;
  }
  return result;
}

std::vector<int> ParallelLayout::group_of(ParallelGroupKind kind, int rank) const {
  const RankCoords c = coords(rank);
  const ParallelSizes& s = sizes_;
  int size = 1, stride = 1;
  switch (kind) {
    case ParallelGroupKind::kAttnTp:
      size = s.attn_tp_size, stride = 1;
      break;
    case ParallelGroupKind::kAttnCp:
      size = s.attn_cp_size, stride = s.attn_tp_size;
      break;
    case ParallelGroupKind::kAttnDp:
      size = s.attn_dp_size, stride = s.attn_tp_size * s.attn_cp_size;
      break;
    case ParallelGroupKind::kMoeTp:
      size = s.moe_tp_size, stride = 1;
      break;
    case ParallelGroupKind::kMoeEp:
      size = s.moe_ep_size, stride = s.moe_tp_size;
      break;
    case ParallelGroupKind::kMoeDp:
      size = s.moe_dp_size, stride = s.moe_tp_size * s.moe_ep_size;
      break;
  }
  const int base = rank - varying(kind, c) * stride;
  std::vector<int> members(size);
  for (int i = 0; i < size; ++i) members[i] = base + i * stride;
  return members;
}

}  // namespace epx
