// SGLang's EPLB JSON files (epx/eplb/sglang_format.h): logical_count in 2-D and SGLang's dump shape 3-D (passes
// summed, as SGLang's init_by_eplb), physical_to_logical_map, round trips through the writers, and the error for
// each broken field or bound. Fixtures are small literals written here.
#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "epx/eplb/expert_location.h"
#include "epx/eplb/sglang_format.h"
#include "epx/error.h"
#include "test_util.h"

namespace epx::eplb {
namespace {

using epx::testing::expect_invalid;

TEST(SglangFormat, LogicalCountTwoDimensional) {
  const auto c = parse_sglang_logical_count(R"({"logical_count": [[1, 2, 3], [40, 0, 6]]})");
  EXPECT_EQ(c.num_passes, 1);
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.num_logical, 3);
  EXPECT_EQ(c.counts, (std::vector<int64_t>{1, 2, 3, 40, 0, 6}));
  EXPECT_FALSE(c.rank.has_value());
  EXPECT_FALSE(c.average_utilization_rate_over_window.has_value());
}

TEST(SglangFormat, LogicalCountDumpSumsPasses) {
  // SGLang's stat dump: [buffer_size, num_layers, num_logical], unfilled ring entries zero, plus its other keys.
  const std::string text = R"({"rank": 0, "average_utilization_rate_over_window": 0.75, "logical_count": [
      [[1, 2], [3, 4], [5, 6]],
      [[10, 20], [30, 40], [50, 60]],
      [[0, 0], [0, 0], [0, 0]]]})";
  const auto c = parse_sglang_logical_count(text);
  EXPECT_EQ(c.num_passes, 3);
  EXPECT_EQ(c.num_layers, 3);
  EXPECT_EQ(c.num_logical, 2);
  EXPECT_EQ(c.counts, (std::vector<int64_t>{11, 22, 33, 44, 55, 66}));
  EXPECT_EQ(c.rank.value_or(-1), 0);
  EXPECT_DOUBLE_EQ(*c.average_utilization_rate_over_window, 0.75);
  // SGLang writes None as null when the window statistic is off.
  const auto n =
      parse_sglang_logical_count(R"({"average_utilization_rate_over_window": null, "logical_count": [[7]]})");
  EXPECT_FALSE(n.average_utilization_rate_over_window.has_value());
  EXPECT_EQ(n.counts, (std::vector<int64_t>{7}));
}

TEST(SglangFormat, LogicalCountRoundTrip) {
  const std::vector<int64_t> counts{5, 0, 7, 1, 2, 3000000000};
  const std::string text = to_sglang_logical_count_json(counts, 2);
  EXPECT_EQ(text, R"({"logical_count":[[5,0,7],[1,2,3000000000]]})");
  const auto c = parse_sglang_logical_count(text);
  EXPECT_EQ(c.counts, counts);
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.num_logical, 3);
}

TEST(SglangFormat, ExpertLocationRoundTripAndExpertLocation) {
  const std::vector<int32_t> phy2log{0, 1, 2, 3, 0, 1, 3, 2, 1, 0, 0, 1};  // 2 layers x 6 slots, 4 experts
  const std::string text = to_sglang_expert_location_json(phy2log, 2);
  EXPECT_EQ(nlohmann::json::parse(text).size(), 1u);  // the only key, as SGLang's init_by_mapping needs
  const auto loc = parse_sglang_expert_location(text);
  EXPECT_EQ(loc.num_layers, 2);
  EXPECT_EQ(loc.num_physical, 6);
  EXPECT_EQ(loc.num_logical_seen, 4);
  EXPECT_EQ(loc.phy2log, phy2log);
  const ExpertLocation built(loc.num_layers, 4, loc.num_physical, 3, 1, loc.phy2log);
  EXPECT_EQ(built.replica_count(1, 0), 2);
  EXPECT_EQ(built.replica_count(1, 1), 2);
}

TEST(SglangFormat, BadLogicalCountNamesTheField) {
  expect_invalid([] { parse_sglang_logical_count("{"); }, "does not parse");
  expect_invalid([] { parse_sglang_logical_count(R"({"counts": []})"); }, "with field 'logical_count'");
  expect_invalid([] { parse_sglang_logical_count(R"([1, 2])"); }, "with field 'logical_count'");
  expect_invalid([] { parse_sglang_logical_count(R"({"logical_count": []})"); }, "logical_count holds no rows");
  expect_invalid([] { parse_sglang_logical_count(R"({"logical_count": 3})"); }, "logical_count must be an array");
  expect_invalid([] { parse_sglang_logical_count(R"({"logical_count": [[1, 2], [3]]})"); },
                 "logical_count[1] holds 1 experts, the first row holds 2");
  expect_invalid([] { parse_sglang_logical_count(R"({"logical_count": [[1, -2]]})"); },
                 "logical_count[0][1] = -2 must be an integer");
  expect_invalid([] { parse_sglang_logical_count(R"({"logical_count": [[1, 2.5]]})"); },
                 "logical_count[0][1] = 2.5 must be an integer");
  expect_invalid([] { parse_sglang_logical_count(R"({"logical_count": [[[1, 2]], [[3, 4], [5, 6]]]})"); },
                 "logical_count[1] holds 2 layers, the first row holds 1");
  expect_invalid([] { parse_sglang_logical_count(R"({"logical_count": [[[1, 2]], [[3, "x"]]]})"); },
                 "logical_count[1][0][1] = \"x\"");
  expect_invalid([] { parse_sglang_logical_count(R"({"logical_count": [[[]]]})"); }, "holds no experts");
  expect_invalid([] { parse_sglang_logical_count(R"({"logical_count": [[[9223372036854775807]], [[1]]]})"); },
                 "sum over passes of [0][0] exceeds INT64_MAX");
  expect_invalid([] { parse_sglang_logical_count(R"({"rank": "0", "logical_count": [[1]]})"); },
                 "field 'rank' must be an integer");
  expect_invalid(
      [] { parse_sglang_logical_count(R"({"average_utilization_rate_over_window": "x", "logical_count": [[1]]})"); },
      "'average_utilization_rate_over_window' must be a number or null");
  // The experts bound, without a large file: one row one past the bound.
  std::string row(static_cast<size_t>(kMaxSglangExperts + 1) * 2 - 1, ',');
  for (size_t i = 0; i < row.size(); i += 2) row[i] = '0';
  expect_invalid([&] { parse_sglang_logical_count(R"({"logical_count": [[)" + row + "]]}"); },
                 "more than the bound 1048576");
}

TEST(SglangFormat, BadExpertLocationNamesTheField) {
  expect_invalid([] { parse_sglang_expert_location(R"({"phy2log": [[0]]})"); }, "with field 'physical_to_logical_map'");
  expect_invalid([] { parse_sglang_expert_location(R"({"physical_to_logical_map": [[0, 1], [1]]})"); },
                 "physical_to_logical_map[1] holds 1 slots, the first row holds 2");
  expect_invalid([] { parse_sglang_expert_location(R"({"physical_to_logical_map": [[0, -1]]})"); },
                 "physical_to_logical_map[0][1] = -1 must be an integer logical expert id in [0, 1048576)");
  expect_invalid([] { parse_sglang_expert_location(R"({"physical_to_logical_map": [[0, 1048576]]})"); },
                 "physical_to_logical_map[0][1] = 1048576");
  expect_invalid([] { parse_sglang_expert_location(R"({"physical_to_logical_map": [[0, 1.0]]})"); },
                 "physical_to_logical_map[0][1] = 1.0");
  expect_invalid([] { parse_sglang_expert_location(R"({"physical_to_logical_map": []})"); }, "holds no layers");
}

TEST(SglangFormat, WritersRejectBadShapes) {
  const std::vector<int64_t> counts{1, 2, 3};
  expect_invalid([&] { to_sglang_logical_count_json(counts, 2); }, "3 values do not divide into num_layers = 2");
  expect_invalid([&] { to_sglang_logical_count_json(counts, 0); }, "num_layers must be >= 1");
  const std::vector<int64_t> negative{1, -2};
  expect_invalid([&] { to_sglang_logical_count_json(negative, 1); }, "logical_count[0][1] = -2 must be >= 0");
  const std::vector<int32_t> phy2log{0, -1};
  expect_invalid([&] { to_sglang_expert_location_json(phy2log, 1); }, "physical_to_logical_map[0][1] = -1");
}

}  // namespace
}  // namespace epx::eplb
