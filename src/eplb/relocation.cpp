#include "epx/eplb/relocation.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/check.h"

namespace epx::eplb {

const char* to_string(SlotAction action) noexcept {
  switch (action) {
    case SlotAction::kUnchanged:
      return "unchanged";
    case SlotAction::kLocalCopy:
      return "local_copy";
    case SlotAction::kSameRoundCopy:
      return "same_round_copy";
    case SlotAction::kPeerIntraNode:
      return "peer_intra_node";
    case SlotAction::kPeerInterNode:
      return "peer_inter_node";
    case SlotAction::kLost:
      return "lost";
    case SlotAction::kDeadRank:
      return "dead_rank";
  }
  return "?";
}

int64_t RelocationPlan::count(SlotAction action) const {
  return std::count_if(slots.begin(), slots.end(), [&](const SlotPlan& s) { return s.action == action; });
}

RelocationPlan plan_relocation(std::span<const int32_t> old_phy2log, std::span<const int32_t> new_phy2log,
                               int num_ranks, int num_nodes, const std::vector<bool>& failed_ranks) {
  EPX_CHECK_ARG(num_ranks >= 1, "num_ranks must be >= 1, got {}", num_ranks);
  EPX_CHECK_ARG(num_nodes >= 1 && num_ranks % num_nodes == 0, "num_ranks ({}) must be divisible by num_nodes ({})",
                num_ranks, num_nodes);
  EPX_CHECK_ARG(!old_phy2log.empty() && old_phy2log.size() % num_ranks == 0,
                "old phy2log size ({}) must be a positive multiple of num_ranks ({})", old_phy2log.size(), num_ranks);
  EPX_CHECK_ARG(!new_phy2log.empty() && new_phy2log.size() % num_ranks == 0,
                "new phy2log size ({}) must be a positive multiple of num_ranks ({})", new_phy2log.size(), num_ranks);
  EPX_CHECK_ARG(failed_ranks.empty() || failed_ranks.size() == static_cast<size_t>(num_ranks),
                "failed_ranks must be empty or have num_ranks = {} entries, got {}", num_ranks, failed_ranks.size());
  int32_t num_experts = 0;
  for (size_t i = 0; i < old_phy2log.size(); ++i) {
    EPX_CHECK_ARG(old_phy2log[i] >= 0, "old phy2log[{}] must be >= 0, got {}", i, old_phy2log[i]);
    num_experts = std::max(num_experts, old_phy2log[i] + 1);
  }
  for (size_t i = 0; i < new_phy2log.size(); ++i) {
    EPX_CHECK_ARG(new_phy2log[i] >= 0, "new phy2log[{}] must be >= 0, got {}", i, new_phy2log[i]);
    num_experts = std::max(num_experts, new_phy2log[i] + 1);
  }
  auto failed = [&](int r) { return !failed_ranks.empty() && failed_ranks[r]; };

  RelocationPlan plan;
  plan.num_ranks = num_ranks;
  plan.num_nodes = num_nodes;
  plan.old_slots_per_rank = static_cast<int>(old_phy2log.size() / num_ranks);
  plan.new_slots_per_rank = static_cast<int>(new_phy2log.size() / num_ranks);
  const int ospr = plan.old_slots_per_rank, nspr = plan.new_slots_per_rank;
  const int ranks_per_node = num_ranks / num_nodes;

  // Live old replicas of each expert, as global old slot indices (ascending).
  std::vector<std::vector<int32_t>> holders(num_experts);
  for (int s = 0; s < static_cast<int>(old_phy2log.size()); ++s) {
    if (!failed(s / ospr)) holders[old_phy2log[s]].push_back(s);
  }
  std::vector<int64_t> sends(num_ranks, 0);
  std::vector<char> lost(num_experts, 0);
  plan.slots.resize(new_phy2log.size());
  for (int r = 0; r < num_ranks; ++r) {
    for (int i = 0; i < nspr; ++i) {
      SlotPlan& sp = plan.slots[r * nspr + i];
      const int32_t e = new_phy2log[r * nspr + i];
      sp.expert = e;
      if (failed(r)) {
        sp.action = SlotAction::kDeadRank;
        continue;
      }
      if (i < ospr && old_phy2log[r * ospr + i] == e) {
        sp.action = SlotAction::kUnchanged;
        sp.src_rank = r;
        sp.src_slot = i;
        continue;
      }
      // A local old replica.
      int local = -1;
      for (int32_t s : holders[e]) {
        if (s / ospr == r) {
          local = s % ospr;
          break;
        }
      }
      if (local >= 0) {
        sp.action = SlotAction::kLocalCopy;
        sp.src_rank = r;
        sp.src_slot = local;
        continue;
      }
      // A slot of this rank that already receives e from a peer.
      int twin = -1;
      for (int j = 0; j < i && twin < 0; ++j) {
        const SlotPlan& other = plan.slots[r * nspr + j];
        if (other.expert == e &&
            (other.action == SlotAction::kPeerIntraNode || other.action == SlotAction::kPeerInterNode)) {
          twin = j;
        }
      }
      if (twin >= 0) {
        sp.action = SlotAction::kSameRoundCopy;
        sp.src_rank = r;
        sp.src_slot = twin;
        continue;
      }
      // A peer: same node first, then the least loaded sender.
      int best = -1;
      bool best_local_node = false;
      for (int32_t s : holders[e]) {
        const int q = s / ospr;
        const bool same_node = q / ranks_per_node == r / ranks_per_node;
        if (best < 0 || (same_node && !best_local_node) ||
            (same_node == best_local_node && sends[q] < sends[best / ospr])) {
          best = s;
          best_local_node = same_node;
        }
      }
      if (best < 0) {
        sp.action = SlotAction::kLost;
        lost[e] = 1;
        continue;
      }
      sp.action = best_local_node ? SlotAction::kPeerIntraNode : SlotAction::kPeerInterNode;
      sp.src_rank = best / ospr;
      sp.src_slot = best % ospr;
      ++sends[sp.src_rank];
    }
  }
  for (int32_t e = 0; e < num_experts; ++e) {
    if (lost[e]) plan.lost_experts.push_back(e);
  }
  return plan;
}

namespace {

bool is_peer(SlotAction a) { return a == SlotAction::kPeerIntraNode || a == SlotAction::kPeerInterNode; }

// RAII temporary buffer from the transport.
class TempBuffer {
 public:
  TempBuffer(WeightTransport& transport, size_t bytes)
      : transport_(transport), ptr_(bytes ? static_cast<char*>(transport.allocate_temp(bytes)) : nullptr) {}
  ~TempBuffer() {
    if (ptr_) transport_.free_temp(ptr_);
  }
  TempBuffer(const TempBuffer&) = delete;
  TempBuffer& operator=(const TempBuffer&) = delete;
  char* get() const { return ptr_; }

 private:
  WeightTransport& transport_;
  char* ptr_;
};

}  // namespace

RelocationStats relocate_weights(const RelocationPlan& plan, const ExpertWeights& weights, WeightTransport& transport,
                                 const RelocationOptions& options) {
  EPX_CHECK_ARG(options.max_slots_per_round >= 1, "max_slots_per_round must be >= 1, got {}",
                options.max_slots_per_round);
  EPX_CHECK_ARG(transport.num_ranks() == plan.num_ranks, "transport has {} ranks, the plan {}", transport.num_ranks(),
                plan.num_ranks);
  const size_t num_tensors = weights.bytes_per_slot.size();
  EPX_CHECK_ARG(num_tensors >= 1 && weights.old_slots.size() == num_tensors && weights.new_slots.size() == num_tensors,
                "old_slots ({}), new_slots ({}) and bytes_per_slot ({}) must have the same number (>= 1) of tensors",
                weights.old_slots.size(), weights.new_slots.size(), num_tensors);
  const int r = transport.rank();
  const int ospr = plan.old_slots_per_rank, nspr = plan.new_slots_per_rank;
  EPX_CHECK_ARG(plan.slots.size() == static_cast<size_t>(plan.num_ranks) * nspr,
                "plan has {} slots, expected num_ranks * new_slots_per_rank = {}", plan.slots.size(),
                static_cast<int64_t>(plan.num_ranks) * nspr);
  bool in_place = true;
  for (size_t t = 0; t < num_tensors; ++t) {
    const auto* o = static_cast<const char*>(weights.old_slots[t]);
    const auto* n = static_cast<const char*>(weights.new_slots[t]);
    const size_t b = weights.bytes_per_slot[t];
    EPX_CHECK_ARG(b >= 1 && o != nullptr && n != nullptr, "tensor {}: null buffer or bytes_per_slot 0", t);
    const bool same = o == n;
    const bool disjoint = o + b * ospr <= n || n + b * nspr <= o;
    EPX_CHECK_ARG(same || disjoint, "tensor {}: old and new slot buffers must be identical or disjoint", t);
    in_place = in_place && same;
    EPX_CHECK_ARG(!same || ospr == nspr, "tensor {}: in-place relocation needs equal slot counts, got {} and {}", t,
                  ospr, nspr);
  }
  const bool all_in_place = in_place;
  for (size_t t = 0; t < num_tensors && !all_in_place; ++t) {
    EPX_CHECK_ARG(weights.old_slots[t] != weights.new_slots[t],
                  "tensor {}: either every tensor is relocated in place or none", t);
  }

  // Receives of each rank in destination order; their round is index / per_round.
  const int per_round = all_in_place ? std::max(1, nspr) : options.max_slots_per_round;
  std::vector<int> recv_index(plan.slots.size(), -1);
  int num_rounds = 0;
  for (int q = 0; q < plan.num_ranks; ++q) {
    int n = 0;
    for (int i = 0; i < nspr; ++i) {
      if (is_peer(plan.slots[q * nspr + i].action)) recv_index[q * nspr + i] = n++;
    }
    num_rounds = std::max(num_rounds, (n + per_round - 1) / per_round);
  }
  RelocationStats stats;
  stats.num_rounds = num_rounds;
  if (plan.slots[r * nspr].action == SlotAction::kDeadRank) return stats;

  auto old_ptr = [&](size_t t, int slot) {
    return static_cast<const char*>(weights.old_slots[t]) + weights.bytes_per_slot[t] * slot;
  };
  auto new_ptr = [&](size_t t, int slot) {
    return static_cast<char*>(weights.new_slots[t]) + weights.bytes_per_slot[t] * slot;
  };
  size_t slot_bytes = 0;
  for (size_t b : weights.bytes_per_slot) slot_bytes += b;

  // In place, local sources are staged before any slot is overwritten.
  std::vector<int> local_sources;  // destination local indices with kLocalCopy
  for (int i = 0; i < nspr; ++i) {
    const SlotPlan& sp = plan.slots[r * nspr + i];
    if (sp.action == SlotAction::kLocalCopy) local_sources.push_back(i);
    if (sp.action == SlotAction::kUnchanged && !all_in_place) {
      for (size_t t = 0; t < num_tensors; ++t)
        transport.copy(new_ptr(t, i), old_ptr(t, sp.src_slot), weights.bytes_per_slot[t]);
      ++stats.local_copies;
    }
  }
  TempBuffer local_temp(transport, all_in_place ? slot_bytes * local_sources.size() : 0);
  for (size_t k = 0; k < local_sources.size(); ++k) {
    const SlotPlan& sp = plan.slots[r * nspr + local_sources[k]];
    size_t offset = 0;
    for (size_t t = 0; t < num_tensors; ++t) {
      void* dst = all_in_place ? static_cast<void*>(local_temp.get() + k * slot_bytes + offset)
                               : static_cast<void*>(new_ptr(t, local_sources[k]));
      transport.copy(dst, old_ptr(t, sp.src_slot), weights.bytes_per_slot[t]);
      offset += weights.bytes_per_slot[t];
    }
    ++stats.local_copies;
  }

  TempBuffer recv_temp(transport, slot_bytes * per_round);
  std::vector<SendOp> send_ops;
  std::vector<RecvOp> recv_ops;
  std::vector<int> round_dst;
  for (int round = 0; round < num_rounds; ++round) {
    send_ops.clear();
    recv_ops.clear();
    round_dst.clear();
    // Sends in global destination order, so each peer's receives from us match in order.
    for (size_t d = 0; d < plan.slots.size(); ++d) {
      const SlotPlan& sp = plan.slots[d];
      if (!is_peer(sp.action) || sp.src_rank != r || recv_index[d] / per_round != round) continue;
      const int q = static_cast<int>(d / nspr);
      for (size_t t = 0; t < num_tensors; ++t)
        send_ops.push_back({q, old_ptr(t, sp.src_slot), weights.bytes_per_slot[t]});
      ++stats.slots_sent;
      stats.bytes_sent += static_cast<int64_t>(slot_bytes);
    }
    for (int i = 0; i < nspr; ++i) {
      const int d = r * nspr + i;
      const SlotPlan& sp = plan.slots[d];
      if (!is_peer(sp.action) || recv_index[d] / per_round != round) continue;
      char* base = recv_temp.get() + (recv_index[d] % per_round) * slot_bytes;
      size_t offset = 0;
      for (size_t t = 0; t < num_tensors; ++t) {
        recv_ops.push_back({sp.src_rank, base + offset, weights.bytes_per_slot[t]});
        offset += weights.bytes_per_slot[t];
      }
      round_dst.push_back(i);
      ++stats.slots_received;
      stats.bytes_received += static_cast<int64_t>(slot_bytes);
    }
    transport.exchange(send_ops, recv_ops);
    if (all_in_place && round == 0) {
      for (size_t k = 0; k < local_sources.size(); ++k) {
        size_t offset = 0;
        for (size_t t = 0; t < num_tensors; ++t) {
          transport.copy(new_ptr(t, local_sources[k]), local_temp.get() + k * slot_bytes + offset,
                         weights.bytes_per_slot[t]);
          offset += weights.bytes_per_slot[t];
        }
      }
    }
    for (int i : round_dst) {
      const char* base = recv_temp.get() + (recv_index[r * nspr + i] % per_round) * slot_bytes;
      size_t offset = 0;
      for (size_t t = 0; t < num_tensors; ++t) {
        transport.copy(new_ptr(t, i), base + offset, weights.bytes_per_slot[t]);
        offset += weights.bytes_per_slot[t];
      }
    }
  }
  if (all_in_place && num_rounds == 0) {
    for (size_t k = 0; k < local_sources.size(); ++k) {
      size_t offset = 0;
      for (size_t t = 0; t < num_tensors; ++t) {
        transport.copy(new_ptr(t, local_sources[k]), local_temp.get() + k * slot_bytes + offset,
                       weights.bytes_per_slot[t]);
        offset += weights.bytes_per_slot[t];
      }
    }
  }
  for (int i = 0; i < nspr; ++i) {
    const SlotPlan& sp = plan.slots[r * nspr + i];
    if (sp.action != SlotAction::kSameRoundCopy) continue;
    for (size_t t = 0; t < num_tensors; ++t)
      transport.copy(new_ptr(t, i), new_ptr(t, sp.src_slot), weights.bytes_per_slot[t]);
    ++stats.local_copies;
  }
  return stats;
}

}  // namespace epx::eplb
