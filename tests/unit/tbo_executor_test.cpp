// The TBO stage executor: stages from yield points, the A-ahead / alternate / B-tail order for every
// delta, one operation list shared by both micro-batches, errors, and SGLang's DeepSeek strategy presets.
#include <fmt/format.h>
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

// ---- strategy presets --------------------------------------------------------------------------------
// SGLang's DeepSeek operation lists (operations_strategy.py: _compute_moe_deepseek_blog_prefill / _decode),
// run on the executor with recording operations. The trace is cut back into stages ("A2" = child A's stage 2)
// to check the timeline, and each stage's operations are checked by name.

struct Recorded {
  int batch;
  int layer;
  TboLayerOp op;
};

// The stage index of every (layer, op) in the strategy's list.
int stage_of(const TboStrategy& s, int layer, TboLayerOp op) {
  const auto stages = split_tbo_stages(s.operations);
  const std::string name = fmt::format("L{}.{}", layer, to_string(op));  // NOTE: GCC 12 -O3 -Wrestrict on "L" + ...
  for (size_t i = 0; i < stages.size(); ++i) {
    for (const auto& o : stages[i]) {
      if (o.name == name) return static_cast<int>(i);
    }
  }
  return -1;
}

struct PresetRun {
  std::vector<std::string> timeline;  // "A0", "B0", ...: one entry per stage run
  std::vector<Recorded> trace;
};

PresetRun run_preset(TboPreset preset, int num_layers) {
  PresetRun run;
  const TboStrategy s = make_tbo_strategy(preset, num_layers, [&run](TboLayerOp op, int layer, int batch) {
    run.trace.push_back({batch, layer, op});
  });
  execute_two_batch_overlap(s.operations, s.operations, s.delta_stages);
  for (const auto& r : run.trace) {
    // A stage's ops run back to back, and no stage runs twice: a new tag starts a new entry.
    const std::string tag = fmt::format("{}{}", r.batch == 0 ? "A" : "B", stage_of(s, r.layer, r.op));
    if (run.timeline.empty() || run.timeline.back() != tag) run.timeline.push_back(tag);
  }
  return run;
}

std::vector<std::string> stage_names(const TboStrategy& s, size_t stage) {
  std::vector<std::string> names;
  const auto stages = split_tbo_stages(s.operations);  // NOTE: named: a range-for over .at() of a temporary dangles
  for (const auto& o : stages.at(stage)) names.push_back(o.name);
  return names;
}

// Position in the trace of child `batch`'s (layer, op).
size_t at(const PresetRun& run, int batch, int layer, TboLayerOp op) {
  for (size_t i = 0; i < run.trace.size(); ++i) {
    if (run.trace[i].batch == batch && run.trace[i].layer == layer && run.trace[i].op == op) return i;
  }
  ADD_FAILURE() << "not run: batch " << batch << " layer " << layer << " " << to_string(op);
  return 0;
}

TEST(TboPreset, DeepSeekPrefillStagesAndTimeline) {
  const auto noop = [](TboLayerOp, int, int) {};
  const TboStrategy s = make_tbo_strategy(TboPreset::kDeepSeekPrefill, 1, noop);
  EXPECT_EQ(s.delta_stages, 0);
  EXPECT_TRUE(s.reserve_comm_sms);
  ASSERT_EQ(split_tbo_stages(s.operations).size(), 3u);
  EXPECT_EQ(stage_names(s, 0), (Trace{"L0.comm_prepare_attn", "L0.attn_prepare", "L0.attn_core", "L0.comm_prepare_mlp",
                                      "L0.gate", "L0.select_experts", "L0.dispatch_a"}));
  EXPECT_EQ(stage_names(s, 1), (Trace{"L0.dispatch_b", "L0.experts", "L0.combine_a"}));
  EXPECT_EQ(stage_names(s, 2), (Trace{"L0.shared_experts", "L0.combine_b", "L0.output", "L0.comm_postprocess_layer"}));

  const PresetRun run = run_preset(TboPreset::kDeepSeekPrefill, 1);
  EXPECT_EQ(run.timeline, (Trace{"A0", "B0", "A1", "B1", "A2", "B2"}));
  EXPECT_EQ(run.trace.size(), 2u * 14u);  // every op once per child
  // A's dispatch is in flight while B runs attention; A's combine while B runs its dispatch_b and experts.
  using Op = TboLayerOp;
  EXPECT_LT(at(run, 0, 0, Op::kDispatchA), at(run, 1, 0, Op::kAttnCore));
  EXPECT_LT(at(run, 1, 0, Op::kAttnCore), at(run, 0, 0, Op::kDispatchB));
  EXPECT_LT(at(run, 0, 0, Op::kCombineA), at(run, 1, 0, Op::kExperts));
  EXPECT_LT(at(run, 1, 0, Op::kExperts), at(run, 0, 0, Op::kCombineB));

  // Two layers: layer 0's last stage and layer 1's first run as one stage (no yield between layers).
  const TboStrategy two = make_tbo_strategy(TboPreset::kDeepSeekPrefill, 2, noop);
  ASSERT_EQ(split_tbo_stages(two.operations).size(), 5u);
  EXPECT_EQ(stage_names(two, 2), (Trace{"L0.shared_experts", "L0.combine_b", "L0.output", "L0.comm_postprocess_layer",
                                        "L1.comm_prepare_attn", "L1.attn_prepare", "L1.attn_core",
                                        "L1.comm_prepare_mlp", "L1.gate", "L1.select_experts", "L1.dispatch_a"}));
  EXPECT_EQ(run_preset(TboPreset::kDeepSeekPrefill, 2).timeline,
            (Trace{"A0", "B0", "A1", "B1", "A2", "B2", "A3", "B3", "A4", "B4"}));
}

TEST(TboPreset, DeepSeekDecodeStagesAndTimeline) {
  const auto noop = [](TboLayerOp, int, int) {};
  const TboStrategy s = make_tbo_strategy(TboPreset::kDeepSeekDecode, 1, noop);
  EXPECT_EQ(s.delta_stages, 2);
  EXPECT_FALSE(s.reserve_comm_sms);
  ASSERT_EQ(split_tbo_stages(s.operations).size(), 6u);
  EXPECT_EQ(stage_names(s, 0), (Trace{"L0.comm_prepare_attn", "L0.attn_prepare"}));
  EXPECT_EQ(stage_names(s, 1), (Trace{"L0.attn_core", "L0.comm_prepare_mlp", "L0.gate", "L0.select_experts"}));
  EXPECT_EQ(stage_names(s, 2), (Trace{"L0.dispatch_a", "L0.shared_experts"}));
  EXPECT_EQ(stage_names(s, 3), (Trace{"L0.dispatch_b", "L0.experts", "L0.combine_a"}));
  EXPECT_EQ(stage_names(s, 4), (Trace{"L0.combine_b"}));
  EXPECT_EQ(stage_names(s, 5), (Trace{"L0.output", "L0.comm_postprocess_layer"}));

  const PresetRun run = run_preset(TboPreset::kDeepSeekDecode, 1);
  EXPECT_EQ(run.timeline, (Trace{"A0", "A1", "A2", "B0", "A3", "B1", "A4", "B2", "A5", "B3", "B4", "B5"}));
  EXPECT_EQ(run.trace.size(), 2u * 14u);
  // A's dispatch is in flight while B prepares attention; A's combine while B runs attention and the gate;
  // B's dispatch while A finishes the layer.
  using Op = TboLayerOp;
  EXPECT_LT(at(run, 0, 0, Op::kDispatchA), at(run, 1, 0, Op::kAttnPrepare));
  EXPECT_LT(at(run, 1, 0, Op::kAttnPrepare), at(run, 0, 0, Op::kDispatchB));
  EXPECT_LT(at(run, 0, 0, Op::kCombineA), at(run, 1, 0, Op::kAttnCore));
  EXPECT_LT(at(run, 1, 0, Op::kSelectExperts), at(run, 0, 0, Op::kCombineB));
  EXPECT_LT(at(run, 1, 0, Op::kDispatchA), at(run, 0, 0, Op::kOutput));
  EXPECT_LT(at(run, 0, 0, Op::kOutput), at(run, 1, 0, Op::kDispatchB));

  // Two layers: 11 stages; stage 5 is layer 0's output with layer 1's attention prepare.
  const TboStrategy two = make_tbo_strategy(TboPreset::kDeepSeekDecode, 2, noop);
  ASSERT_EQ(split_tbo_stages(two.operations).size(), 11u);
  EXPECT_EQ(stage_names(two, 5),
            (Trace{"L0.output", "L0.comm_postprocess_layer", "L1.comm_prepare_attn", "L1.attn_prepare"}));
  EXPECT_EQ(run_preset(TboPreset::kDeepSeekDecode, 2).timeline,
            (Trace{"A0", "A1", "A2", "B0", "A3", "B1", "A4", "B2",  "A5", "B3", "A6",
                   "B4", "A7", "B5", "A8", "B6", "A9", "B7", "A10", "B8", "B9", "B10"}));
}

TEST(TboPreset, ByForwardModeAndBadInput) {
  EXPECT_EQ(tbo_preset_for(ForwardMode::kExtend), TboPreset::kDeepSeekPrefill);
  EXPECT_EQ(tbo_preset_for(ForwardMode::kMixed), TboPreset::kDeepSeekPrefill);
  EXPECT_EQ(tbo_preset_for(ForwardMode::kDecode), TboPreset::kDeepSeekDecode);
  EXPECT_EQ(tbo_preset_for(ForwardMode::kTargetVerify), TboPreset::kDeepSeekDecode);
  EXPECT_EQ(tbo_preset_for(ForwardMode::kPrebuilt), TboPreset::kDeepSeekDecode);
  EXPECT_FALSE(tbo_preset_for(ForwardMode::kIdle).has_value());
  EXPECT_FALSE(tbo_preset_for(ForwardMode::kDraftExtend).has_value());
  EXPECT_EQ(tbo_preset_delta_stages(TboPreset::kDeepSeekPrefill), 0);
  EXPECT_EQ(tbo_preset_delta_stages(TboPreset::kDeepSeekDecode), 2);
  EXPECT_STREQ(to_string(TboPreset::kDeepSeekDecode), "deepseek-decode");
  EXPECT_STREQ(to_string(TboLayerOp::kCommPostprocessLayer), "comm_postprocess_layer");
  EXPECT_EQ(tbo_preset_layer_ops(TboPreset::kDeepSeekDecode).size(), 19u);   // 14 ops + 5 yields
  EXPECT_EQ(tbo_preset_layer_ops(TboPreset::kDeepSeekPrefill).size(), 16u);  // 14 ops + 2 yields
  const auto noop = [](TboLayerOp, int, int) {};
  EXPECT_THROW(make_tbo_strategy(TboPreset::kDeepSeekDecode, 0, noop), Error);
  EXPECT_THROW(make_tbo_strategy(TboPreset::kDeepSeekDecode, kMaxTboLayers + 1, noop), Error);
  EXPECT_THROW(make_tbo_strategy(TboPreset::kDeepSeekDecode, 1, TboLayerOpFn{}), Error);
  EXPECT_THROW(make_tbo_strategy(static_cast<TboPreset>(7), 1, noop), Error);
  EXPECT_THROW(tbo_preset_delta_stages(static_cast<TboPreset>(7)), Error);
}

}  // namespace
}  // namespace epx
