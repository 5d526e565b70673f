// Host Group: barrier and all_gather_bytes on 1..16 thread ranks; a rank that never arrives makes the
// others throw kTimeout naming it; exchange(timed_out) reports the missing rank instead of throwing;
// skip does not wait; world_object is shared by all ranks.
#include "comm/host/host_group.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <random>
#include <string>

#include "epx/error.h"
#include "epx/group.h"

namespace epx {
namespace {

TEST(HostGroup, BarrierAndAllGather) {
  std::random_device seed_source;
  const unsigned seed = seed_source();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (int num_ranks = 1; num_ranks <= 16; ++num_ranks) {
    auto groups = create_host_groups(num_ranks);
    std::mt19937 rng(seed + num_ranks);
    constexpr int kRounds = 5;
    constexpr size_t kBytes = 24;
    // payload[round][rank] = kBytes random bytes.
    std::vector<std::vector<std::vector<uint8_t>>> payload(kRounds, std::vector<std::vector<uint8_t>>(num_ranks));
    for (auto& round : payload) {
      for (auto& p : round) {
        p.resize(kBytes);
        for (auto& b : p) b = static_cast<uint8_t>(rng());
      }
    }
    std::vector<std::vector<std::vector<uint8_t>>> gathered(num_ranks, std::vector<std::vector<uint8_t>>(kRounds));
    std::atomic<int> arrived{0};
    std::atomic<bool> barrier_broken{false};
    run_host_ranks(groups, [&](int rank, Group& group) {
      EXPECT_EQ(group.rank(), rank);
      EXPECT_EQ(group.num_ranks(), num_ranks);
      EXPECT_EQ(group.backend(), Backend::kHost);
      EXPECT_EQ(group.device(), Device::cpu());
      for (int round = 0; round < kRounds; ++round) {
        ++arrived;
        group.barrier();
        // Nobody leaves the barrier before everyone of this round arrived.
        if (arrived.load() < (round + 1) * num_ranks) barrier_broken = true;
        group.barrier();
        gathered[rank][round].resize(kBytes * num_ranks);
        group.all_gather_bytes(payload[round][rank].data(), gathered[rank][round].data(), kBytes);
      }
    });
    EXPECT_FALSE(barrier_broken) << num_ranks << " ranks";
    for (int rank = 0; rank < num_ranks; ++rank) {
      for (int round = 0; round < kRounds; ++round) {
        for (int src = 0; src < num_ranks; ++src) {
          ASSERT_EQ(std::memcmp(gathered[rank][round].data() + src * kBytes, payload[round][src].data(), kBytes), 0)
              << num_ranks << " ranks, rank " << rank << ", round " << round << ", from " << src;
        }
      }
    }
  }
}

TEST(HostGroup, TimeoutNamesTheMissingRank) {
  auto groups = create_host_groups(3, {.timeout_ms = 100});
  std::vector<std::string> messages(3);
  std::vector<int> codes(3, 0);
  run_host_ranks(groups, [&](int rank, Group& group) {
    if (rank == 2) return;  // never arrives
    try {
      group.barrier();
    } catch (const Error& e) {
      codes[rank] = static_cast<int>(e.code());
      messages[rank] = e.what();
    }
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(codes[rank], static_cast<int>(ErrorCode::kTimeout)) << messages[rank];
    EXPECT_NE(messages[rank].find("for ranks [2]"), std::string::npos) << messages[rank];
  }
}

TEST(HostGroup, AllGatherTimesOut) {
  auto groups = create_host_groups(2, {.timeout_ms = 50});
  int value = 7;
  std::vector<int> out(2);
  try {
    groups[0]->all_gather_bytes(&value, out.data(), sizeof(int));  // rank 1 never calls
    FAIL() << "expected a timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(e.what()).find("[1]"), std::string::npos) << e.what();
  }
}

TEST(HostGroup, ExchangeReportsTimedOutRanks) {
  auto groups = create_host_groups(3, {.timeout_ms = 100});
  std::vector<std::vector<int>> timed_out(3);
  std::vector<std::vector<const void*>> seen(3);
  std::vector<int> values = {10, 11, 12};
  run_host_ranks(groups, [&](int rank, Group& group) {
    if (rank == 2) return;
    auto& host = dynamic_cast<host::HostGroup&>(group);
    seen[rank] = host.exchange(&values[rank], nullptr, &timed_out[rank]);
    host.release(nullptr, &timed_out[rank]);
  });
  for (int rank = 0; rank < 2; ++rank) {
    // Rank 2 is missing in both phases.
    EXPECT_EQ(timed_out[rank], (std::vector<int>{2, 2}));
    ASSERT_EQ(seen[rank].size(), 3u);
    EXPECT_EQ(seen[rank][0], &values[0]);
    EXPECT_EQ(seen[rank][1], &values[1]);
    EXPECT_EQ(seen[rank][2], nullptr);
  }
}

TEST(HostGroup, SkipDoesNotWait) {
  // Timeout long enough that a wait for rank 1 would fail the test's time budget.
  auto groups = create_host_groups(2, {.timeout_ms = 60'000});
  auto& host = dynamic_cast<host::HostGroup&>(*groups[0]);
  const std::vector<bool> skip = {false, true};
  int value = 3;
  std::vector<int> timed_out;
  const auto ptrs = host.exchange(&value, &skip, &timed_out);
  host.release(&skip, &timed_out);
  EXPECT_TRUE(timed_out.empty());
  EXPECT_EQ(ptrs[0], &value);
  EXPECT_EQ(ptrs[1], nullptr);
}

TEST(HostGroup, WorldObjectIsShared) {
  auto groups = create_host_groups(4);
  std::vector<std::shared_ptr<void>> objects(4);
  std::atomic<int> made{0};
  run_host_ranks(groups, [&](int rank, Group& group) {
    objects[rank] = dynamic_cast<host::HostGroup&>(group).world_object("test", [&] {
      ++made;
      return std::make_shared<int>(42);
    });
  });
  EXPECT_EQ(made.load(), 1);
  for (const auto& o : objects) EXPECT_EQ(o, objects[0]);
  EXPECT_EQ(*std::static_pointer_cast<int>(objects[0]), 42);
}

TEST(HostGroup, RejectsBadOptions) {
  EXPECT_THROW(create_host_groups(0), Error);
  EXPECT_THROW(create_host_groups(1025), Error);
  EXPECT_THROW(create_host_groups(2, {.timeout_ms = 0}), Error);
}

}  // namespace
}  // namespace epx
