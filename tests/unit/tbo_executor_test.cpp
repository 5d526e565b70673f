// The TBO stage executor: stages from yield points, the A-ahead / alternate / B-tail order for every
// delta, one operation list shared by both micro-batches, and errors.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "epx/error.h"
#include "epx/tbo.h"

namespace epx {
namespace {

using Trace = std::vector<std::string>;

// ops "x0 | x1 | x2": names separated by yields; each op appends "<name>" to the trace.
std::vector<TboOperation> make_ops(const std::vector<std::vector<std::string>>& stages, Trace& trace,
                                   bool trailing_yield = false) {
  std::vector<TboOperation> ops;
  for (size_t s = 0; s < stages.size(); ++s) {
    if (s > 0) ops.push_back(TboOperation::yield_point());
    for (const auto& name : stages[s]) ops.push_back({name, [&trace, name](int) { trace.push_back(name); }});
  }
  if (trailing_yield) ops.push_back(TboOperation::yield_point());
  return ops;
}

TEST(TboStages, SplitAtYieldPoints) {
  Trace t;
  auto ops = make_ops({{"p", "q"}, {"r"}, {}, {"s"}}, t, /*trailing_yield=*/true);
  const auto stages = split_tbo_stages(ops);
  ASSERT_EQ(stages.size(), 4u);  // the trailing yield adds no empty stage; the inner empty one stays
  EXPECT_EQ(stages[0].size(), 2u);
  EXPECT_EQ(stages[0][1].name, "q");
  EXPECT_EQ(stages[1].size(), 1u);
  EXPECT_TRUE(stages[2].empty());
  EXPECT_EQ(stages[3][0].name, "s");
  EXPECT_TRUE(split_tbo_stages({}).empty());
  EXPECT_EQ(split_tbo_stages({TboOperation::yield_point()}).size(), 1u);  // one empty stage
}

TEST(TboExecutor, OrderForEveryDelta) {
  const std::vector<Trace> expected = {
      {"a0", "a0'", "b0", "a1", "b1", "a2", "b2"},  // delta 0: alternate
      {"a0", "a0'", "a1", "b0", "a2", "b1", "b2"},  // delta 1: A one stage ahead
      {"a0", "a0'", "a1", "a2", "b0", "b1", "b2"},  // delta 2
      {"a0", "a0'", "a1", "a2", "b0", "b1", "b2"},  // delta 3: A, then B
  };
  for (int delta = 0; delta <= 3; ++delta) {
    Trace t;
    execute_two_batch_overlap(make_ops({{"a0", "a0'"}, {"a1"}, {"a2"}}, t), make_ops({{"b0"}, {"b1"}, {"b2"}}, t),
                              delta);
    EXPECT_EQ(t, expected[delta]) << "delta " << delta;
  }
}

TEST(TboExecutor, OneListServesBothBatches) {
  // A MoE layer cut where the all-to-all would be in flight: attention+gate | dispatch | experts | combine.
  Trace t;
  std::vector<TboOperation> layer;
  for (const char* name : {"attn", "gate", "|", "dispatch", "|", "experts", "|", "combine"}) {
    if (std::string(name) == "|") {
      layer.push_back(TboOperation::yield_point());
    } else {
      layer.push_back({name, [&t, name](int batch) { t.push_back(std::string(name) + (batch ? ".B" : ".A")); }});
    }
  }
  execute_two_batch_overlap(layer, layer, 1);
  EXPECT_EQ(t, (Trace{"attn.A", "gate.A", "dispatch.A", "attn.B", "gate.B", "experts.A", "dispatch.B", "combine.A",
                      "experts.B", "combine.B"}));
}

TEST(TboExecutor, RejectsMismatchedStagesAndBadDelta) {
  Trace t;
  const auto three = make_ops({{"x"}, {"y"}, {"z"}}, t);
  const auto two = make_ops({{"x"}, {"y"}}, t);
  EXPECT_THROW(execute_two_batch_overlap(three, two, 0), Error);
  EXPECT_THROW(execute_two_batch_overlap(three, three, 4), Error);
  EXPECT_THROW(execute_two_batch_overlap(three, three, -1), Error);
  EXPECT_TRUE(t.empty());  // nothing ran
  try {
    execute_two_batch_overlap(three, two, 0);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("same number of stages, got 3 and 2"), std::string::npos) << e.what();
  }
  execute_two_batch_overlap({}, {}, 0);  // no stages: nothing to do
}

TEST(TboExecutor, ExceptionStopsTheRun) {
  Trace t;
  auto a = make_ops({{"a0"}, {"a1"}}, t);
  auto b = make_ops({{"b0"}, {"b1"}}, t);
  b[0].fn = [](int) { throw std::runtime_error("b0 failed"); };
  EXPECT_THROW(execute_two_batch_overlap(a, b, 0), std::runtime_error);
  EXPECT_EQ(t, (Trace{"a0"}));
}

}  // namespace
}  // namespace epx
