// Weight relocation: the planner on a hand-made example (every action kind, sender spreading, lost
// experts) and the executor over the host transport (ranks as threads): each expert's weights encode its
// logical id; after random remaps (incl. 256 -> 288 experts on 32 ranks, 1, 2 and 4 nodes; in place and
// double-buffered; several tensors; small rounds) every slot must hold what the new map says.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "epx/eplb/placement.h"
#include "epx/eplb/relocation.h"
#include "epx/error.h"
#include "epx/group.h"

namespace epx::eplb {
namespace {

TEST(EplbRelocation, PlanHandExample) {
  // 4 ranks, 2 nodes (ranks 0-1, 2-3), 2 slots per rank.
  //   old: r0 {0,1} r1 {2,3} r2 {4,5} r3 {6,7}
  //   new: r0 {0,2} r1 {3,1} r2 {7,7} r3 {6,0}
  const std::vector<int32_t> old_map = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<int32_t> new_map = {0, 2, 3, 1, 7, 7, 6, 0};
  const RelocationPlan p = plan_relocation(old_map, new_map, 4, 2);
  ASSERT_EQ(p.slots.size(), 8u);
  EXPECT_EQ(p.slots[0].action, SlotAction::kUnchanged);
  EXPECT_EQ(p.slots[1].action, SlotAction::kPeerIntraNode);  // expert 2 from rank 1 slot 0
  EXPECT_EQ(p.slots[1].src_rank, 1);
  EXPECT_EQ(p.slots[1].src_slot, 0);
  EXPECT_EQ(p.slots[2].action, SlotAction::kLocalCopy);  // expert 3 already on rank 1, slot 1
  EXPECT_EQ(p.slots[2].src_slot, 1);
  EXPECT_EQ(p.slots[3].action, SlotAction::kPeerIntraNode);  // expert 1 from rank 0 slot 1
  EXPECT_EQ(p.slots[4].action, SlotAction::kPeerIntraNode);  // expert 7 from rank 3 slot 1
  EXPECT_EQ(p.slots[4].src_rank, 3);
  EXPECT_EQ(p.slots[5].action, SlotAction::kSameRoundCopy);  // second copy of 7 on rank 2
  EXPECT_EQ(p.slots[5].src_slot, 0);
  EXPECT_EQ(p.slots[6].action, SlotAction::kUnchanged);
  EXPECT_EQ(p.slots[7].action, SlotAction::kPeerInterNode);  // expert 0 only on rank 0 (other node)
  EXPECT_EQ(p.slots[7].src_rank, 0);
  EXPECT_EQ(p.num_transfers(), 4);
  EXPECT_TRUE(p.lost_experts.empty());

  // Rank 3 failed: expert 6 and 7 only lived there.
  const RelocationPlan f = plan_relocation(old_map, new_map, 4, 2, {false, false, false, true});
  EXPECT_EQ(f.slots[4].action, SlotAction::kLost);
  EXPECT_EQ(f.slots[6].action, SlotAction::kDeadRank);
  EXPECT_EQ(f.lost_experts, (std::vector<int32_t>{7}));
}

TEST(EplbRelocation, PlanSpreadsSenders) {
  // Expert 0 has 4 replicas (ranks 0-3); 8 ranks need it: each source sends twice.
  std::vector<int32_t> old_map = {0, 1, 0, 2, 0, 3, 0, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  std::vector<int32_t> new_map(16);
  for (int r = 0; r < 8; ++r) new_map[2 * r] = 0, new_map[2 * r + 1] = old_map[2 * r + 1];
  new_map[0] = 0;
  const RelocationPlan p = plan_relocation(old_map, new_map, 8, 1);
  std::vector<int> sends(8, 0);
  for (const auto& s : p.slots) {
    if (s.action == SlotAction::kPeerIntraNode) ++sends[s.src_rank];
  }
  EXPECT_EQ(sends, (std::vector<int>{1, 1, 1, 1, 0, 0, 0, 0}));  // 4 receivers, 4 distinct senders
}

TEST(EplbRelocation, RejectsBadInput) {
  const std::vector<int32_t> m = {0, 1, 2, 3};
  EXPECT_THROW(plan_relocation(m, m, 3, 1), Error);
  EXPECT_THROW(plan_relocation(m, m, 4, 3), Error);
  EXPECT_THROW(plan_relocation(m, std::vector<int32_t>{0, -1, 2, 3}, 4, 1), Error);
  EXPECT_THROW(plan_relocation(m, m, 4, 1, {true}), Error);
  try {
    plan_relocation(m, std::vector<int32_t>{0, 1, 2}, 2, 1);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("new phy2log size (3)"), std::string::npos) << e.what();
  }
}

TEST(EplbRelocation, CudaTransportNeedsACudaGroup) {
  auto groups = create_host_groups(1);
  try {
    make_cuda_transport(*groups[0]);
    FAIL() << "a host group was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("needs a cuda group, got a host group"), std::string::npos) << e.what();
  }
}

TEST(EplbRelocation, TransportChoiceOnHostGroups) {
  auto groups = create_host_groups(1);
  EXPECT_EQ(choose_transport(*groups[0]), TransportKind::kHost);
  for (TransportKind kind : {TransportKind::kAuto, TransportKind::kHost}) {
    const auto transport = make_transport_for(*groups[0], kind);
    EXPECT_EQ(transport->num_ranks(), 1);
  }
  for (TransportKind kind : {TransportKind::kCuda, TransportKind::kNccl}) {
    EXPECT_EQ(transport_kind_from_string(to_string(kind)), kind);
    try {
      make_transport_for(*groups[0], kind);
      ADD_FAILURE() << to_string(kind) << " accepted a host group";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("got a host group"), std::string::npos) << e.what();
    }
  }
  try {
    make_nccl_transport(*groups[0]);
    ADD_FAILURE() << "make_nccl_transport accepted a host group";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("needs a cuda group of one process per GPU, got a host group (rank 0 of 1)"),
              std::string::npos)
        << e.what();
  }
  try {
    transport_kind_from_string("pigeon");
    ADD_FAILURE() << "'pigeon' accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("got 'pigeon'"), std::string::npos) << e.what();
  }
}

// The byte pattern of one slot of expert `e` in tensor t.
uint8_t pattern(int e, size_t t, size_t i) { return static_cast<uint8_t>(e * 31 + t * 7 + i * 13 + 1); }

// Runs a relocation of old -> new on num_ranks host threads and checks every slot.
void run_relocation(const std::vector<int32_t>& old_map, const std::vector<int32_t>& new_map, int num_ranks,
                    int num_nodes, bool in_place, int per_round, const std::vector<bool>& failed = {}) {
  const int ospr = static_cast<int>(old_map.size()) / num_ranks, nspr = static_cast<int>(new_map.size()) / num_ranks;
  const std::vector<size_t> bytes = {96, 40};  // two tensors per expert, e.g. weights and scales
  const RelocationPlan plan = plan_relocation(old_map, new_map, num_ranks, num_nodes, failed);
  std::vector<std::vector<std::vector<uint8_t>>> old_buf(num_ranks), new_buf(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    for (size_t t = 0; t < bytes.size(); ++t) {
      std::vector<uint8_t> o(bytes[t] * std::max(ospr, nspr), 0xEE);
      for (int i = 0; i < ospr; ++i) {
        for (size_t b = 0; b < bytes[t]; ++b) o[i * bytes[t] + b] = pattern(old_map[r * ospr + i], t, b);
      }
      old_buf[r].push_back(o);
      new_buf[r].push_back(std::vector<uint8_t>(bytes[t] * nspr, 0xEE));  // poison
    }
  }
  auto groups = create_host_groups(num_ranks, {20'000});
  std::vector<RelocationStats> stats(num_ranks);
  run_host_ranks(groups, [&](int r, Group& g) {
    if (!failed.empty() && failed[r]) return;
    auto transport = make_host_transport(g, failed);
    ExpertWeights w;
    for (size_t t = 0; t < bytes.size(); ++t) {
      w.old_slots.push_back(old_buf[r][t].data());
      w.new_slots.push_back(in_place ? old_buf[r][t].data() : new_buf[r][t].data());
      w.bytes_per_slot.push_back(bytes[t]);
    }
    stats[r] = relocate_weights(plan, w, *transport, {per_round});
  });
  int64_t received = 0, sent = 0;
  for (int r = 0; r < num_ranks; ++r) {
    if (!failed.empty() && failed[r]) continue;
    received += stats[r].slots_received;
    sent += stats[r].slots_sent;
    for (int i = 0; i < nspr; ++i) {
      const SlotPlan& sp = plan.slots[r * nspr + i];
      if (sp.action == SlotAction::kLost) continue;
      for (size_t t = 0; t < bytes.size(); ++t) {
        const auto& buf = in_place ? old_buf[r][t] : new_buf[r][t];
        for (size_t b = 0; b < bytes[t]; ++b) {
          ASSERT_EQ(buf[i * bytes[t] + b], pattern(new_map[r * nspr + i], t, b))
              << "rank " << r << " slot " << i << " tensor " << t << " byte " << b;
        }
      }
    }
  }
  EXPECT_EQ(received, plan.num_transfers());
  EXPECT_EQ(sent, plan.num_transfers());
}

// A random placement of num_logical experts on num_slots slots (every expert at least once).
std::vector<int32_t> random_map(std::mt19937& rng, int num_logical, int num_slots) {
  std::vector<int32_t> m(num_slots);
  for (int s = 0; s < num_slots; ++s) m[s] = s < num_logical ? s : static_cast<int32_t>(rng() % num_logical);
  std::shuffle(m.begin(), m.end(), rng);
  return m;
}

TEST(EplbRelocation, HostRandomRemaps) {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 4; ++trial) {
    for (bool in_place : {false, true}) {
      const auto a = random_map(rng, 24, 32), b = random_map(rng, 24, 32);
      run_relocation(a, b, 8, trial % 2 ? 2 : 1, in_place, 1 + trial);
    }
  }
}

TEST(EplbRelocation, Host256To288On32Ranks) {
  std::mt19937 rng(23);
  for (int num_nodes : {1, 2, 4}) {
    const auto old_map = trivial_phy2log(1, 256, 256);  // 8 slots per rank
    std::vector<int32_t> shuffled = old_map;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    const auto new_map = random_map(rng, 256, 288);  // 9 slots per rank
    run_relocation(shuffled, new_map, 32, num_nodes, false, 4);
    // And a placement computed by the default policy on a skewed load, 288 -> 288 in place.
    std::vector<std::vector<double>> w(1, std::vector<double>(256));
    for (auto& v : w[0]) v = std::exp(std::uniform_real_distribution<>(0, 5)(rng));
    const Placement p = rebalance(w, {288, 8, num_nodes, 32});
    run_relocation(random_map(rng, 256, 288), p.phy2log, 32, num_nodes, true, 8);
  }
}

TEST(EplbRelocation, HostFailedRank) {
  std::mt19937 rng(29);
  const auto a = random_map(rng, 12, 16), b = random_map(rng, 12, 16);
  run_relocation(a, b, 4, 2, false, 2, {false, true, false, false});
}

}  // namespace
}  // namespace epx::eplb
