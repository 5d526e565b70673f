// EPLB at run time: ExpertLocation (trivial start, validation, JSON round trip, set_layer), replica choice
// (static locality and fairness, dynamic uniformity, rank invariance), the load recorder (hand-computed
// utilization, windows, ring eviction, logical mapping across a placement change, per_pass/per_token) and
// the rebalance manager (N >= buffer check, threshold skip, chunked application, placement from loads), and
// SGLang's rebalance gate (issue 16): skip only strictly above the threshold (default 1: never), on the mean
// of per-step utilizations since the last due rebalance, with SGLang's balancedness log line and JSON.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "epx/eplb/expert_location.h"
#include "epx/eplb/manager.h"
#include "epx/eplb/recorder.h"
#include "epx/eplb/synthetic.h"
#include "epx/error.h"
#include "test_util.h"

namespace epx::eplb {
namespace {

using epx::testing::expect_invalid;

TEST(EplbLocation, TrivialJsonAndValidation) {
  const auto loc = ExpertLocation::trivial(2, 4, 6, 3, 1);
  EXPECT_EQ(loc.slots_per_gpu(), 2);
  const auto row = loc.phy2log(1);
  EXPECT_EQ(std::vector<int32_t>(row.begin(), row.end()), (std::vector<int32_t>{0, 1, 2, 3, 0, 1}));
  const auto reps = loc.replicas(0, 1);
  EXPECT_EQ(std::vector<int32_t>(reps.begin(), reps.end()), (std::vector<int32_t>{1, 5}));
  EXPECT_EQ(loc.replica_count(0, 3), 1);
  EXPECT_EQ(loc.max_replicas(), 2);
  const auto back = ExpertLocation::from_json(loc.to_json());
  EXPECT_TRUE(back == loc);

  auto copy = loc;
  const std::vector<int32_t> next = {3, 2, 1, 0, 3, 3};
  copy.set_layer(0, next);
  EXPECT_EQ(copy.replica_count(0, 3), 3);
  EXPECT_EQ(loc.replica_count(0, 3), 1);  // the original is untouched
  expect_invalid(
      [&] {
        copy.set_layer(0, std::vector<int32_t>{0, 0, 1, 1, 2, 2});
      },
      "logical expert 3 has no replica in layer 0");
  EXPECT_EQ(copy.replica_count(0, 3), 3);  // unchanged after a failed set_layer
  expect_invalid([] { ExpertLocation(1, 4, 6, 4, 1, {0, 1, 2, 3, 0, 1}); }, "divisible by num_gpus (4)");
  expect_invalid([] { ExpertLocation(1, 4, 4, 2, 1, {0, 1, 2, 4}); }, "phy2log[0][3] must be in [0, 4)");
  expect_invalid([] { ExpertLocation::from_json("{\"num_layers\": 1}"); }, "'num_logical'");
  expect_invalid([] { ExpertLocation::from_json("nope"); }, "does not parse");
}

TEST(EplbLocation, StaticChoicePrefersLocalAndSpreadsFairly) {
  // 2 layers, 4 experts, 8 slots on 8 GPUs (one slot each): layer 0 expert 0 on slots 0, 3, 6.
  const std::vector<int32_t> map = {0, 1, 2, 0, 3, 1, 0, 2, 0, 1, 2, 3, 0, 1, 2, 3};
  const ExpertLocation loc(2, 4, 8, 8, 2, map);
  std::vector<int64_t> topk = {0, 1, -1, 0};
  std::vector<int64_t> out(4);
  choose_replicas(loc, 0, topk, 2, out, 3, {ReplicaChoice::kStatic, 5, false});
  EXPECT_EQ(out[0], 3);  // local replica on GPU 3
  EXPECT_EQ(out[2], -1);
  EXPECT_EQ(out[3], 3);
  // Non-local sources: GPUs 1, 2, 4, 5, 7 spread over the 3 replicas of expert 0 within 1 of each other.
  std::map<int64_t, int> per_replica;
  for (int gpu : {1, 2, 4, 5, 7}) {
    std::vector<int64_t> one = {0}, got(1);
    choose_replicas(loc, 0, one, 1, got, gpu, {ReplicaChoice::kStatic, 5, false});
    ++per_replica[got[0]];
  }
  int lo = 100, hi = 0;
  for (int64_t s : {0, 3, 6}) lo = std::min(lo, per_replica[s]), hi = std::max(hi, per_replica[s]);
  EXPECT_LE(hi - lo, 1);
}

TEST(EplbLocation, DynamicUniformAndRankInvariant) {
  const std::vector<int32_t> map = {0, 1, 0, 2, 0, 3, 0, 1};  // expert 0: 4 replicas
  const ExpertLocation loc(1, 4, 8, 4, 1, map);
  const int T = 40000;
  std::vector<int64_t> topk(T, 0), out(T), out2(T);
  choose_replicas(loc, 0, topk, 1, out, 0, {ReplicaChoice::kDynamic, 9, false});
  std::map<int64_t, int> hist;
  for (int64_t s : out) ++hist[s];
  ASSERT_EQ(hist.size(), 4u);
  for (auto [slot, n] : hist) {
    EXPECT_EQ(map[slot], 0);
    EXPECT_NEAR(n, T / 4, 5 * std::sqrt(T * 0.25 * 0.75)) << "slot " << slot;
  }
  for (ReplicaChoice mode : {ReplicaChoice::kStatic, ReplicaChoice::kDynamic}) {
    choose_replicas(loc, 0, topk, 1, out, 0, {mode, 9, true}, 100);
    choose_replicas(loc, 0, topk, 1, out2, 3, {mode, 9, true}, 100);
    EXPECT_EQ(out, out2) << to_string(mode);
  }
  // Rank-invariant static round-robins tokens: exactly T/4 each.
  choose_replicas(loc, 0, topk, 1, out, 0, {ReplicaChoice::kStatic, 9, true});
  hist.clear();
  for (int64_t s : out) ++hist[s];
  for (auto [slot, n] : hist) EXPECT_EQ(n, T / 4);
  std::vector<int64_t> bad = {4}, bad_out(1);
  expect_invalid([&] { choose_replicas(loc, 0, bad, 1, bad_out, 0, {}); }, "topk_logical[0] must be in [-1, 4)");
  expect_invalid([&] { choose_replicas(loc, 0, topk, 1, out, 4, {}); }, "gpu must be in [0, 4)");
}

TEST(EplbRecorder, UtilizationWindowsAndLogicalMapping) {
  // 1 layer, 2 experts, 4 slots on 2 GPUs.
  const ExpertLocation a(1, 2, 4, 2, 1, {0, 1, 0, 1});
  const ExpertLocation b(1, 2, 4, 2, 1, {0, 0, 1, 1});
  LoadRecorder rec(1, 2, 4, 2, {3, RecordMode::kStat});
  rec.record_pass(a, std::vector<int64_t>{1, 2, 3, 4});
  rec.end_step();
  // GPU loads 3 and 7: (5 + 1e-5) / (7 + 1e-5)
  EXPECT_NEAR(rec.utilization(10), (5 + 1e-5) / (7 + 1e-5), 1e-12);
  rec.record_pass(b, std::vector<int64_t>{5, 0, 0, 1});
  rec.end_step();
  EXPECT_EQ(rec.logical_loads(10), (std::vector<int64_t>{1 + 3 + 5, 2 + 4 + 1}));
  EXPECT_EQ(rec.logical_loads(1), (std::vector<int64_t>{5, 1}));
  EXPECT_EQ(rec.physical_loads(10), (std::vector<int64_t>{6, 2, 3, 5}));
  rec.record_pass(b, std::vector<int64_t>{1, 1, 1, 1});
  rec.end_step();
  rec.record_pass(b, std::vector<int64_t>{0, 0, 0, 2});
  rec.end_step();  // evicts step 0
  EXPECT_EQ(rec.steps_in_buffer(), 3);
  EXPECT_EQ(rec.num_steps(), 4);
  EXPECT_EQ(rec.physical_loads(100), (std::vector<int64_t>{6, 1, 1, 4}));
  EXPECT_EQ(rec.physical_loads(2), (std::vector<int64_t>{1, 1, 1, 3}));
  EXPECT_EQ(rec.logical_loads(3), (std::vector<int64_t>{7, 5}));
  EXPECT_NEAR(rec.utilization(3), (6 + 1e-5) / (7 + 1e-5), 1e-12);
  EXPECT_TRUE(rec.records().empty());
  expect_invalid([&] { rec.record_pass(a, std::vector<int64_t>{1, 2}); }, "must have num_layers * num_physical = 4");
  expect_invalid([&] { rec.record_pass(a, std::vector<int64_t>{-1, 0, 0, 0}); }, "physical_counts[0]");
  expect_invalid([&] { rec.utilization(0); }, "window must be >= 1");
  expect_invalid([] { LoadRecorder(1, 2, 4, 2, {0}); }, "buffer_steps must be >= 1");
}

// SGLang's per_pass records (expert_distribution.py, _DetailAccumulator): one per forward pass with its id, the
// rank and this rank's global physical counts; kept past the ring (until clear(), as SGLang keeps them until dump).
TEST(EplbRecorder, PerPassRecordsIdRankModeAndCounts) {
  const auto loc = ExpertLocation::trivial(2, 3, 4, 2);  // slot 3 holds expert 0
  LoadRecorder rec(2, 3, 4, 2, {.buffer_steps = 1, .mode = RecordMode::kPerPass, .rank = 5});
  rec.record_pass(loc, std::vector<int64_t>{1, 0, 0, 2, 0, 1, 1, 0}, {.forward_mode = ForwardMode::kExtend});
  rec.record_pass(loc, std::vector<int64_t>{0, 0, 3, 0, 4, 0, 0, 0},
                  {.forward_pass_id = 42, .forward_mode = ForwardMode::kDecode});
  rec.end_step();
  rec.record_pass(loc, std::vector<int64_t>{0, 0, 0, 7, 0, 0, 0, 0});
  rec.end_step();  // the ring holds one step; the records stay
  EXPECT_EQ(rec.physical_loads(10), (std::vector<int64_t>{0, 0, 0, 7, 0, 0, 0, 0}));
  const auto& records = rec.records();
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[0].forward_pass_id, 1);  // SGLang's first forward pass id
  EXPECT_EQ(records[1].forward_pass_id, 42);
  EXPECT_EQ(records[2].forward_pass_id, 43);
  EXPECT_EQ(records[0].step, 0);
  EXPECT_EQ(records[1].step, 0);
  EXPECT_EQ(records[2].step, 1);
  EXPECT_EQ(records[2].rank, 5);
  EXPECT_EQ(records[1].forward_mode, ForwardMode::kDecode);
  EXPECT_FALSE(records[2].forward_mode.has_value());
  EXPECT_EQ(records[1].global_physical_count, (std::vector<int32_t>{0, 0, 3, 0, 4, 0, 0, 0}));
  EXPECT_EQ(rec.dropped_passes(), 0);

  const auto dump = nlohmann::json::parse(rec.records_json(loc));
  EXPECT_EQ(dump["mode"], "per_pass");
  EXPECT_EQ(dump["rank"], 5);
  EXPECT_EQ(dump["dropped_passes"], 0);
  EXPECT_EQ(dump["last_physical_to_logical_map"], nlohmann::json::parse("[[0,1,2,0],[0,1,2,0]]"));
  ASSERT_EQ(dump["records"].size(), 3u);
  const auto& r0 = dump["records"][0];
  EXPECT_EQ(r0["forward_pass_id"], 1);
  EXPECT_EQ(r0["rank"], 5);
  EXPECT_EQ(r0["gatherer_key"], "primary");
  EXPECT_EQ(r0["forward_mode"], 1);  // SGLang's ForwardMode.EXTEND
  EXPECT_EQ(r0["forward_mode_name"], "EXTEND");
  EXPECT_EQ(r0["global_physical_count"], nlohmann::json::parse("[[1,0,0,2],[0,1,1,0]]"));
  EXPECT_EQ(r0["logical_count"], nlohmann::json::parse("[[3,0,0],[0,1,1]]"));
  EXPECT_FALSE(r0.contains("topk_ids_of_layer"));
  EXPECT_EQ(dump["records"][1]["forward_mode"], 2);  // DECODE
  EXPECT_TRUE(dump["records"][2]["forward_mode"].is_null());

  rec.clear();
  EXPECT_TRUE(rec.records().empty());
  EXPECT_EQ(rec.record_bytes(), 0);
  rec.record_pass(loc, std::vector<int64_t>(8, 1));
  EXPECT_EQ(rec.records().at(0).forward_pass_id, 44);  // ids keep counting, as num_steps
  expect_invalid([&] { rec.record_pass(loc, std::vector<int64_t>(8, 0), {.forward_pass_id = -2}); },
                 "forward_pass_id must be >= 0");
  expect_invalid([&] { rec.record_pass(loc, std::vector<int64_t>(8, 0), {.input_ids = {1}}); }, "per_token fields");
  expect_invalid([&] { rec.record_token_pass(loc, std::vector<int64_t>(2, 0), 1, 1); }, "needs per_token mode");
  expect_invalid([] { LoadRecorder(1, 2, 4, 2, {.rank = -1}); }, "rank must be >= 0");
  expect_invalid([] { LoadRecorder(1, 2, 4, 2, {.max_record_bytes = -1}); }, "max_record_bytes must be >= 0");
  LoadRecorder stat(2, 3, 4, 2, {});
  expect_invalid([&] { (void)stat.records_json(loc); }, "needs per_pass or per_token mode");
  expect_invalid([&] { (void)rec.records_json(ExpertLocation::trivial(1, 3, 4, 2)); }, "location shape");
}

// SGLang's per_token records (_DetailSinglePassGatherer): per pass the top-k physical ids of every layer
// [layers, tokens, top-k] (-1 where no expert), input ids, positions, extend lengths, forward mode, and the
// global physical counts derived from the ids (-1 not counted).
TEST(EplbRecorder, PerTokenRecordsTopkIdsAndDerivesCounts) {
  const auto loc = ExpertLocation::trivial(2, 3, 4, 2);
  LoadRecorder rec(2, 3, 4, 2, {.buffer_steps = 4, .mode = RecordMode::kPerToken, .rank = 1});
  // layer 0: token 0 -> {0, 3}, token 1 -> {3, -1}; layer 1: token 0 -> {1, 2}, token 1 -> {-1, -1}
  const std::vector<int64_t> topk = {0, 3, 3, -1, 1, 2, -1, -1};
  rec.record_token_pass(
      loc, topk, 2, 2,
      {.forward_mode = ForwardMode::kExtend, .input_ids = {11, 12}, .positions = {0, 1}, .extend_seq_lens = {2}});
  rec.end_step();
  EXPECT_EQ(rec.physical_loads(1), (std::vector<int64_t>{1, 0, 0, 2, 0, 1, 1, 0}));
  EXPECT_EQ(rec.logical_loads(1), (std::vector<int64_t>{3, 0, 0, 0, 1, 1}));
  ASSERT_EQ(rec.records().size(), 1u);
  EXPECT_EQ(rec.records()[0].topk_ids, (std::vector<int32_t>{0, 3, 3, -1, 1, 2, -1, -1}));
  const auto dump = nlohmann::json::parse(rec.records_json(loc));
  EXPECT_EQ(dump["mode"], "per_token");
  const auto& r = dump["records"][0];
  EXPECT_EQ(r["forward_pass_id"], 1);
  EXPECT_EQ(r["rank"], 1);
  EXPECT_EQ(r["forward_mode"], 1);
  EXPECT_EQ(r["topk_ids_of_layer"], nlohmann::json::parse("[[[0,3],[3,-1]],[[1,2],[-1,-1]]]"));
  EXPECT_EQ(r["input_ids"], nlohmann::json::parse("[11,12]"));
  EXPECT_EQ(r["positions"], nlohmann::json::parse("[0,1]"));
  EXPECT_EQ(r["extend_seq_lens"], nlohmann::json::parse("[2]"));
  EXPECT_EQ(r["global_physical_count"], nlohmann::json::parse("[[1,0,0,2],[0,1,1,0]]"));
  EXPECT_EQ(r["logical_count"], nlohmann::json::parse("[[3,0,0],[0,1,1]]"));
  EXPECT_EQ(r["misc_objects"], nlohmann::json::array());

  // A decode pass without metadata, and a pass of no tokens.
  rec.record_token_pass(loc, std::vector<int64_t>{2, 2}, 1, 1, {.forward_mode = ForwardMode::kDecode});
  rec.record_token_pass(loc, {}, 0, 8);
  rec.end_step();
  EXPECT_EQ(rec.physical_loads(1), (std::vector<int64_t>{0, 0, 1, 0, 0, 0, 1, 0}));
  ASSERT_EQ(rec.records().size(), 3u);
  EXPECT_EQ(rec.records()[2].forward_pass_id, 3);
  EXPECT_EQ(nlohmann::json::parse(rec.records_json(loc))["records"][2]["topk_ids_of_layer"],
            nlohmann::json::parse("[[],[]]"));

  // Bad input records nothing.
  const auto before = rec.physical_loads(100);
  expect_invalid(
      [&] {
        rec.record_token_pass(loc, std::vector<int64_t>{0, 4}, 1, 1);
      },
      "topk_physical[1] must be in [-1, 4)");
  expect_invalid([&] { rec.record_token_pass(loc, std::vector<int64_t>{0, 1, 2}, 1, 1); }, "= 2 entries, got 3");
  expect_invalid(
      [&] {
        rec.record_token_pass(loc, std::vector<int64_t>{0, 1}, 1, 1, {.input_ids = {1, 2}});
      },
      "info.input_ids");
  expect_invalid(
      [&] {
        rec.record_token_pass(loc, std::vector<int64_t>{0, 1}, 1, 1, {.extend_seq_lens = {2}});
      },
      "extend_seq_lens[0]");
  expect_invalid([&] { rec.record_token_pass(loc, {}, 0, 0); }, "num_topk");
  expect_invalid([&] { rec.record_pass(loc, std::vector<int64_t>(8, 0)); }, "not allowed in per_token");
  rec.end_step();
  EXPECT_EQ(rec.records().size(), 3u);
  EXPECT_EQ(rec.physical_loads(100), before);
}

// The records' memory is capped: a pass whose record does not fit is dropped and counted; its counts still count.
TEST(EplbRecorder, RecordCapDropsPassesAndCountsThem) {
  const auto loc = ExpertLocation::trivial(2, 3, 4, 2);
  const int64_t pass_bytes = static_cast<int64_t>(sizeof(PassRecord)) + 8 * 4;  // 2 layers x 4 slots of int32
  LoadRecorder rec(2, 3, 4, 2, {.mode = RecordMode::kPerPass, .max_record_bytes = 3 * pass_bytes - 1});
  for (int i = 0; i < 4; ++i) rec.record_pass(loc, std::vector<int64_t>(8, 1));
  rec.end_step();
  EXPECT_EQ(rec.records().size(), 2u);
  EXPECT_EQ(rec.dropped_passes(), 2);
  EXPECT_EQ(rec.record_bytes(), 2 * pass_bytes);
  EXPECT_EQ(rec.physical_loads(1), std::vector<int64_t>(8, 4));
  EXPECT_EQ(nlohmann::json::parse(rec.records_json(loc))["dropped_passes"], 2);
  rec.record_pass(loc, std::vector<int64_t>(8, 1));
  EXPECT_EQ(rec.dropped_passes(), 3);
  rec.clear();
  EXPECT_EQ(rec.dropped_passes(), 0);
  rec.record_pass(loc, std::vector<int64_t>(8, 1));
  EXPECT_EQ(rec.records().back().forward_pass_id, 6);  // dropped passes used their ids

  // per_token: one token of top-2 fits, 100 tokens do not.
  const int64_t token_bytes = static_cast<int64_t>(sizeof(PassRecord)) + (8 + 2 * 2) * 4;
  LoadRecorder pt(2, 3, 4, 2, {.mode = RecordMode::kPerToken, .max_record_bytes = token_bytes});
  pt.record_token_pass(loc, std::vector<int64_t>(2 * 100 * 2, 0), 100, 2);
  pt.record_token_pass(loc, std::vector<int64_t>{0, 1, 2, 3}, 1, 2);
  EXPECT_EQ(pt.dropped_passes(), 1);
  ASSERT_EQ(pt.records().size(), 1u);
  EXPECT_EQ(pt.records()[0].num_tokens, 1);
  EXPECT_EQ(pt.record_bytes(), token_bytes);
  pt.end_step();
  EXPECT_EQ(pt.physical_loads(1), (std::vector<int64_t>{201, 1, 0, 0, 200, 0, 1, 1}));
  // ...and 0 keeps none.
  LoadRecorder none(2, 3, 4, 2, {.mode = RecordMode::kPerPass, .max_record_bytes = 0});
  none.record_pass(loc, std::vector<int64_t>(8, 0));
  EXPECT_TRUE(none.records().empty());
  EXPECT_EQ(none.dropped_passes(), 1);
}

TEST(EplbRecorder, SglangForwardModeValues) {
  EXPECT_EQ(sglang_forward_mode_value(ForwardMode::kExtend), 1);
  EXPECT_EQ(sglang_forward_mode_value(ForwardMode::kDecode), 2);
  EXPECT_EQ(sglang_forward_mode_value(ForwardMode::kMixed), 3);
  EXPECT_EQ(sglang_forward_mode_value(ForwardMode::kIdle), 4);
  EXPECT_EQ(sglang_forward_mode_value(ForwardMode::kTargetVerify), 5);
  EXPECT_EQ(sglang_forward_mode_value(ForwardMode::kDraftExtend), 6);
  EXPECT_EQ(sglang_forward_mode_value(ForwardMode::kPrebuilt), 7);
}

TEST(EplbManager, RebalancesInChunksFromRecordedLoads) {
  const int L = 6, E = 16, P = 20, R = 4;
  const auto initial = ExpertLocation::trivial(L, E, P, R, 2);
  ManagerOptions too_often;
  too_often.rebalance_every_steps = 5;
  expect_invalid([&] { RebalanceManager(initial, {10}, too_often); },
                 "rebalance_every_steps (5) must be >= the recorder buffer size (10 steps)");
  ManagerOptions opt;
  opt.num_groups = 4;
  opt.rebalance_every_steps = 10;
  opt.utilization_threshold = 0.99;
  opt.layers_per_step = 4;
  opt.migration_aware = false;
  RebalanceManager m(initial, {10}, opt);
  const auto weight = zipf_loads(L, E, 1.2, 1000, 3);
  std::vector<int64_t> counts(static_cast<size_t>(L) * P);
  auto fill = [&] {  // the expected load, split evenly over the current replicas
    for (int l = 0; l < L; ++l) {
      for (int e = 0; e < E; ++e) {
        const auto reps = m.location().replicas(l, e);
        for (int32_t s : reps) counts[l * P + s] = std::llround(weight[l][e]) / static_cast<int64_t>(reps.size());
      }
    }
  };
  for (int step = 0; step < 9; ++step) {
    fill();
    const auto r = m.step(counts);
    EXPECT_FALSE(r.rebalance_computed);
    EXPECT_TRUE(r.updates.empty());
  }
  fill();
  const double before = m.recorder().utilization(10);
  auto r = m.step(counts);
  ASSERT_TRUE(r.rebalance_computed);
  EXPECT_EQ(r.updates.size(), 4u);  // K = 4 layers now, the rest next step
  EXPECT_EQ(m.num_pending_layers(), L - 4);
  for (const auto& u : r.updates) {
    const auto now = m.location().phy2log(u.layer);
    EXPECT_EQ(std::vector<int32_t>(now.begin(), now.end()), u.new_phy2log);
  }
  fill();
  r = m.step(counts);
  EXPECT_EQ(r.updates.size(), 2u);
  EXPECT_EQ(m.num_pending_layers(), 0);
  // The applied placement is the policy's placement of the recorded logical loads.
  std::vector<std::vector<double>> recorded(L, std::vector<double>(E));
  {
    LoadRecorder probe(L, E, P, R, {10});
    const auto trivial = ExpertLocation::trivial(L, E, P, R, 2);
    for (int step = 0; step < 10; ++step) {
      std::vector<int64_t> c(static_cast<size_t>(L) * P);
      for (int l = 0; l < L; ++l) {
        for (int e = 0; e < E; ++e) {
          const auto reps = trivial.replicas(l, e);
          for (int32_t s : reps) c[l * P + s] = std::llround(weight[l][e]) / static_cast<int64_t>(reps.size());
        }
      }
      probe.record_pass(trivial, c);
      probe.end_step();
    }
    const auto loads = probe.logical_loads(10);
    for (int l = 0; l < L; ++l) {
      for (int e = 0; e < E; ++e) recorded[l][e] = static_cast<double>(loads[l * E + e]);
    }
  }
  EXPECT_EQ(*m.location().phy2log_table(), rebalance(recorded, {P, 4, 2, R}).phy2log);
  for (int step = 0; step < 10; ++step) {
    fill();
    m.step(counts);
  }
  EXPECT_GT(m.recorder().utilization(10), before + 0.1);
  // Balanced now: the next due rebalance is skipped with a threshold below the utilization.
  ManagerOptions lax = opt;
  lax.utilization_threshold = 0.0;
  RebalanceManager skip(initial, {10}, lax);
  for (int step = 0; step < 10; ++step) {
    fill();
    r = skip.step(counts);
  }
  EXPECT_TRUE(r.rebalance_skipped);
  EXPECT_FALSE(r.rebalance_computed);
}

TEST(EplbRecorder, PerStepUtilizationAsSglangPerPass) {
  // 1 layer, 2 experts, 4 slots on 2 GPUs. SGLang's per-pass rate: (mean + 1e-5) / (max + 1e-5) of the
  // pass's GPU counts; its windows average those rates.
  const ExpertLocation a(1, 2, 4, 2, 1, {0, 1, 0, 1});
  LoadRecorder rec(1, 2, 4, 2, {2, RecordMode::kStat});
  EXPECT_EQ(rec.mean_step_utilization(10), 1.0);  // nothing recorded
  EXPECT_EQ(rec.last_step_count_sum(), 0);
  rec.record_pass(a, std::vector<int64_t>{4, 0, 0, 0});  // GPU loads 4, 0
  rec.end_step();
  rec.record_pass(a, std::vector<int64_t>{0, 0, 1, 3});  // GPU loads 0, 4
  rec.end_step();
  const double half = (2 + 1e-5) / (4 + 1e-5);
  EXPECT_EQ(rec.step_utilizations(10), (std::vector<double>{half, half}));
  EXPECT_EQ(rec.mean_step_utilization(10), half);
  EXPECT_EQ(rec.utilization(10), 1.0);  // one ratio of the summed counts (4, 4) sees no imbalance
  EXPECT_EQ(rec.last_step_count_sum(), 4);
  rec.end_step();  // an empty step: rate 1, as SGLang's (0 + 1e-5) / (0 + 1e-5)
  EXPECT_EQ(rec.step_utilizations(2), (std::vector<double>{half, 1.0}));
  EXPECT_EQ(rec.mean_step_utilization(1), 1.0);
  // The per-step values outlive the 2-step count ring: the last max(1000, buffer_steps) are kept.
  for (int i = 0; i < 1000; ++i) rec.end_step();
  EXPECT_EQ(rec.step_utilizations(5000).size(), 1000u);
  expect_invalid([&] { rec.step_utilizations(0); }, "window must be >= 1");
  rec.clear();
  EXPECT_TRUE(rec.step_utilizations(10).empty());
  EXPECT_EQ(record_mode_from_string("stat_approx"), RecordMode::kStatApprox);
  EXPECT_STREQ(to_string(RecordMode::kStatApprox), "stat_approx");
  expect_invalid([] { record_mode_from_string("approx"); }, "'stat', 'stat_approx', 'per_pass' or 'per_token'");
}

// Counts for the gate tests: 1 layer, 2 experts, 4 slots on 2 GPUs (slots 0, 1 on GPU 0).
const ExpertLocation& gate_location() {
  static const ExpertLocation loc(1, 2, 4, 2, 1, {0, 1, 0, 1});
  return loc;
}

TEST(EplbManager, GateDefaultsAreSglangs) {
  const ManagerOptions defaults;
  EXPECT_EQ(defaults.utilization_threshold, 1.0);  // eplb_min_rebalancing_utilization_threshold
  EXPECT_EQ(defaults.gate_statistic, GateStatistic::kMeanStepUtilization);
  // Perfectly balanced steps have utilization exactly 1: SGLang skips only when strictly above the threshold,
  // so the default still rebalances (epx skipped at >= 0.9 before).
  ManagerOptions opt;
  opt.rebalance_every_steps = 2;
  RebalanceManager m(gate_location(), {2}, opt);
  const std::vector<int64_t> balanced{1, 1, 1, 1};
  EXPECT_FALSE(m.step(balanced).rebalance_due);
  const StepReport r = m.step(balanced);
  ASSERT_TRUE(r.rebalance_due);
  EXPECT_EQ(r.rebalance.gate_utilization, 1.0);
  EXPECT_TRUE(r.rebalance_computed);
  EXPECT_FALSE(r.rebalance.skipped);
  // A threshold equal to the statistic does not skip either; one below it does.
  for (const auto& [threshold, skipped] : {std::pair{1.0, false}, std::pair{0.999, true}}) {
    opt.utilization_threshold = threshold;
    RebalanceManager g(gate_location(), {2}, opt);
    g.step(balanced);
    EXPECT_EQ(g.step(balanced).rebalance_skipped, skipped) << threshold;
  }
  for (double bad : {1.5, -0.1, std::numeric_limits<double>::quiet_NaN()}) {
    opt.utilization_threshold = bad;
    expect_invalid([&] { RebalanceManager(gate_location(), {2}, opt); },
                   "utilization_threshold must be in [0, 1] (1 = never skip, SGLang's default)");
  }
  EXPECT_EQ(gate_statistic_from_string("buffer"), GateStatistic::kBufferUtilization);
  expect_invalid([] { gate_statistic_from_string("sum"); }, "'mean_step' or 'buffer'");
}

TEST(EplbManager, GateAveragesPerStepUtilizationSinceTheLastDueRebalance) {
  // Alternating hot GPUs: every step has rate (2 + 1e-5) / (4 + 1e-5) ~ 0.5, the buffer's summed counts are
  // balanced (1.0). With threshold 0.9, SGLang's statistic (0.5) rebalances; the old summed-count ratio skipped.
  const std::vector<int64_t> left{4, 0, 0, 0}, right{0, 0, 0, 4};
  const double half = (2 + 1e-5) / (4 + 1e-5);
  ManagerOptions opt;
  opt.rebalance_every_steps = 4;
  opt.utilization_threshold = 0.9;
  opt.migration_aware = false;
  RebalanceManager sglang(gate_location(), {2}, opt);
  opt.gate_statistic = GateStatistic::kBufferUtilization;
  RebalanceManager buffer(gate_location(), {2}, opt);
  StepReport a, b;
  for (int step = 0; step < 4; ++step) {
    a = sglang.step(step % 2 == 0 ? left : right);
    b = buffer.step(step % 2 == 0 ? left : right);
  }
  ASSERT_TRUE(a.rebalance_due && b.rebalance_due);
  EXPECT_EQ(a.rebalance.gate_window_steps, 4);  // the steps since the start
  EXPECT_DOUBLE_EQ(a.rebalance.gate_utilization, half);
  EXPECT_TRUE(a.rebalance_computed);
  EXPECT_EQ(b.rebalance.gate_window_steps, 2);  // the recorder buffer
  EXPECT_EQ(b.rebalance.gate_utilization, 1.0);
  EXPECT_TRUE(b.rebalance_skipped);
  EXPECT_FALSE(b.rebalance_computed);

  // The window restarts at every due rebalance (SGLang clears its history when it dumps the record): four
  // balanced steps now give exactly 1, although the two half steps are still among the last 10.
  opt.gate_statistic = GateStatistic::kMeanStepUtilization;
  opt.utilization_threshold = 0.99;
  RebalanceManager m(gate_location(), {2}, opt);
  const std::vector<int64_t> balanced{1, 1, 1, 1};
  for (int step = 0; step < 4; ++step) m.step(step < 2 ? left : balanced);
  StepReport r;
  for (int step = 0; step < 4; ++step) r = m.step(balanced);
  ASSERT_TRUE(r.rebalance_due);
  EXPECT_EQ(r.rebalance.gate_window_steps, 4);
  EXPECT_EQ(r.rebalance.gate_utilization, 1.0);
  EXPECT_TRUE(r.rebalance_skipped);
  EXPECT_DOUBLE_EQ(r.rebalance.last_10_average_balancedness, (2 * half + 6) / 8);
}

TEST(EplbManager, ReportsBalancednessPerRebalanceAsSglangLogsIt) {
  const std::vector<int64_t> hot{6, 0, 2, 0};  // expert 0 hot: GPU loads 6, 2
  ManagerOptions opt;
  opt.rebalance_every_steps = 2;
  opt.migration_aware = false;
  RebalanceManager m(gate_location(), {2}, opt);
  m.step(hot);
  const StepReport r = m.step(hot);
  ASSERT_TRUE(r.rebalance_computed);
  const RebalanceReport& rb = r.rebalance;
  const double rate = (4 + 1e-5) / (6 + 1e-5);
  EXPECT_EQ(rb.step, 1);
  EXPECT_DOUBLE_EQ(rb.current_step_balancedness, rate);
  EXPECT_DOUBLE_EQ(rb.last_10_average_balancedness, rate);
  EXPECT_DOUBLE_EQ(rb.last_1000_average_balancedness, rate);
  EXPECT_EQ(rb.gpu_physical_count_sum, 8);
  // Logical loads 16 (expert 0) and 0: the trivial placement puts 8 + 8 on GPU 0's slot 0 and GPU 1's slot 2,
  // i.e. balanced already by replica splitting: 1.0 before; the new placement is never worse here.
  EXPECT_DOUBLE_EQ(rb.placement_balancedness_before, 1.0);
  EXPECT_GE(rb.placement_balancedness_after, rb.placement_balancedness_before - 1e-12);
  EXPECT_EQ(to_log_line(rb).rfind("[Expert Balancedness] forward_pass_id=1 current_pass_balancedness=0.667 "
                                  "last_10_average_balancedness=0.667 last_100_average_balancedness=0.667 "
                                  "last_1000_average_balancedness=0.667 gpu_physical_count_sum=8 "
                                  "[EPLBManager] rebalance computed: GPU utilization 0.667 (mean_step over 2 steps, "
                                  "threshold 1.00) placement_balancedness 1.000 -> ",
                                  0),
            0u)
      << to_log_line(rb);
  const auto j = nlohmann::json::parse(to_json(rb));
  EXPECT_EQ(j["step"], 1);
  EXPECT_EQ(j["gpu_physical_count_sum"], 8);
  EXPECT_EQ(j["gate_statistic"], "mean_step");
  EXPECT_EQ(j["skipped"], false);
  EXPECT_DOUBLE_EQ(j["current_step_balancedness"].get<double>(), rate);
  EXPECT_EQ(j.size(), 15u);

  RebalanceReport skipped = rb;
  skipped.skipped = true;
  skipped.gate_utilization = 0.95;
  skipped.threshold = 0.9;
  EXPECT_NE(to_log_line(skipped).find("[EPLBManager] Skipped ep rebalancing: current GPU utilization 0.95 > minimum "
                                      "rebalance threshold 0.90 (mean_step over 2 steps)"),
            std::string::npos)
      << to_log_line(skipped);
}

}  // namespace
}  // namespace epx::eplb
