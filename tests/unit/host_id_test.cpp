// core/host_id.h: where a rank runs, and which peer a rank could not map through peer memory.
#include "core/host_id.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

namespace epx::detail {
namespace {

HostId host_named(const char* text) {
  HostId id;
  std::strncpy(id.text, text, sizeof(id.text) - 1);
  return id;
}

TEST(HostId, NamesThisHostTheSameEveryTime) {
  const HostId a = this_host(), b = this_host();
  EXPECT_TRUE(same_host(a, b));
  char name[64] = {};
  ASSERT_EQ(gethostname(name, sizeof(name) - 1), 0);
  const std::string text(a.text);
  EXPECT_EQ(text.rfind(std::string(name) + "/", 0), 0u) << text;  // "hostname/boot id"
  EXPECT_LT(text.size(), sizeof(a.text));
  for (size_t i = text.size(); i < sizeof(a.text); ++i) ASSERT_EQ(a.text[i], '\0') << i;  // zero-padded
}

TEST(HostId, FirstPeerOnAnotherHostAmongTheMappedRanks) {
  // 6 ranks: 0-2 on host a, 3-5 on host b (the same hostname with another boot id counts as another host).
  std::vector<HostId> hosts = {host_named("n/a"), host_named("n/a"), host_named("n/a"),
                               host_named("n/b"), host_named("n/b"), host_named("n/b")};
  const auto all = [](int) { return true; };
  const auto node_of_3 = [](int rank) { return [rank](int r) { return r / 3 == rank / 3; }; };
  EXPECT_EQ(first_peer_on_other_host(hosts, 0, all), 3);
  EXPECT_EQ(first_peer_on_other_host(hosts, 4, all), 0);
  EXPECT_EQ(first_peer_on_other_host(hosts, 1, node_of_3(1)), -1);  // nodes of 3 = hosts: nothing remote to map
  EXPECT_EQ(first_peer_on_other_host(hosts, 5, node_of_3(5)), -1);
  // Nodes of 2 straddle the hosts: rank 2's node is {2, 3}.
  const auto node_of_2 = [](int r) { return r / 2 == 1; };
  EXPECT_EQ(first_peer_on_other_host(hosts, 2, node_of_2), 3);
  EXPECT_EQ(first_peer_on_other_host(hosts, 3, node_of_2), 2);
  // One host: nothing.
  std::vector<HostId> one(4, host_named("h/x"));
  EXPECT_EQ(first_peer_on_other_host(one, 2, all), -1);
}

}  // namespace
}  // namespace epx::detail
