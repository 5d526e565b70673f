// `epx eplb` through the built CLI (EPX_CLI_PATH): JSON and CSV inputs, the printed JSON against the
// library, --current with moved_experts, simulate's summary, and exit code 2 with one stderr line for bad
// input.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "epx/eplb/placement.h"
#include "epx/eplb/synthetic.h"

namespace epx::eplb {
namespace {

struct CliRun {
  int code;
  std::string out, err;
};

std::filesystem::path temp_dir() {
  auto dir = std::filesystem::temp_directory_path() / ("epx_eplb_cli_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir;
}

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

CliRun run(const std::string& args) {
  const auto dir = temp_dir();
  const auto out = dir / "stdout", err = dir / "stderr";
  const std::string cmd = std::string(EPX_CLI_PATH) + " " + args + " >" + out.string() + " 2>" + err.string();
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
}

std::string write(const std::string& name, const std::string& text) {
  const auto p = temp_dir() / name;
  std::ofstream(p) << text;
  return p.string();
}

TEST(EplbCli, PlanJsonMatchesLibrary) {
  const auto w = zipf_loads(3, 16, 1.0, 1000, 4);
  nlohmann::json j;
  j["weights"] = w;
  const std::string file = write("w.json", j.dump());
  for (const char* policy : {"deepseek", "default"}) {
    const CliRun r =
        run("eplb plan --weights " + file + " --replicas 24 --groups 4 --nodes 2 --gpus 4 --policy " + policy);
    ASSERT_EQ(r.code, 0) << r.err;
    const auto out = nlohmann::json::parse(r.out);
    const Placement p = rebalance(w, {24, 4, 2, 4}, policy_from_string(policy));
    std::vector<int32_t> flat;
    for (const auto& row : out["phy2log"]) {
      for (int32_t v : row) flat.push_back(v);
    }
    EXPECT_EQ(flat, p.phy2log);
    ASSERT_EQ(out["log2phy"].size(), 3u);
    EXPECT_EQ(out["log2phy"][0].size(), 16u);
    EXPECT_EQ(out["log2phy"][0][0].size(), static_cast<size_t>(p.max_replicas));
    EXPECT_EQ(out["logcnt"][2][5].get<int>(), p.logcnt[2 * 16 + 5]);
    EXPECT_NEAR(out["balancedness_after"].get<double>(), balancedness(w, p.phy2log, 24, 4), 1e-12);
    EXPECT_NEAR(out["balancedness_before"].get<double>(), balancedness(w, trivial_phy2log(3, 16, 24), 24, 4), 1e-12);
    EXPECT_FALSE(out.contains("moved_experts"));
  }
}

TEST(EplbCli, PlanCsvAndCurrent) {
  const std::string csv = write("w.csv", "40,10,20,30\n1, 2, 3, 4\n");
  CliRun r = run("eplb plan --weights " + csv + " --replicas 6 --groups 1 --nodes 1 --gpus 2 --policy deepseek");
  ASSERT_EQ(r.code, 0) << r.err;
  auto out = nlohmann::json::parse(r.out);
  EXPECT_EQ(out["phy2log"][0], nlohmann::json::parse("[0, 0, 1, 2, 3, 3]"));
  const std::string cur = write("cur.json", "{\"phy2log\": [[0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 0, 1]]}");
  r = run("eplb plan --weights " + csv + " --replicas 6 --groups 1 --nodes 1 --gpus 2 --current " + cur);
  ASSERT_EQ(r.code, 0) << r.err;
  out = nlohmann::json::parse(r.out);
  EXPECT_EQ(out["mode"], "migration_aware");
  // Layer 0 is already perfectly balanced under the current placement: it stays.
  EXPECT_EQ(out["phy2log"][0], nlohmann::json::parse("[0, 0, 1, 2, 3, 3]"));
  std::vector<int32_t> before = {0, 0, 1, 2, 3, 3, 0, 1, 2, 3, 0, 1}, after;
  for (const auto& row : out["phy2log"]) {
    for (int32_t v : row) after.push_back(v);
  }
  EXPECT_EQ(out["moved_experts"].get<int64_t>(), count_moved_experts(before, after));
}

TEST(EplbCli, BadInputExitsTwo) {
  const std::string ok = write("ok.csv", "1,2,3,4\n");
  const std::string neg = write("neg.csv", "1,2,-3,4\n");
  const std::string ragged = write("ragged.json", "{\"weights\": [[1,2,3,4],[1,2]]}");
  const std::string junk = write("junk.csv", "1,2,x,4\n");
  const std::string empty = write("empty.csv", "");
  const struct {
    std::string args, needle;
  } cases[] = {
      {"--weights " + neg + " --replicas 4 --groups 1 --nodes 1 --gpus 1", "weight[0][2] must be finite and >= 0"},
      {"--weights " + ragged + " --replicas 4 --groups 1 --nodes 1 --gpus 1", "ragged"},
      {"--weights " + junk + " --replicas 4 --groups 1 --nodes 1 --gpus 1", "line 1 column 3"},
      {"--weights " + empty + " --replicas 4 --groups 1 --nodes 1 --gpus 1", "holds no layers"},
      {"--weights " + ok + " --replicas 3 --groups 1 --nodes 1 --gpus 1", "must be >= the 4 logical experts"},
      {"--weights " + ok + " --replicas 6 --groups 1 --nodes 1 --gpus 4", "--replicas 6 must be divisible by --gpus 4"},
      {"--weights " + ok + " --replicas 4 --groups 1 --nodes 1 --gpus 1 --policy fancy", "'fancy'"},
      {"--weights /nonexistent/w.csv --replicas 4 --groups 1 --nodes 1 --gpus 1", "cannot read"},
  };
  for (const auto& c : cases) {
    const CliRun r = run("eplb plan " + c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

// Each case exits 2 with one stderr line naming the flag, before any placement work. Before the fix: row sums of
// inf gave `balancedness: null`, ids beyond int32 were truncated, hex and trailing commas were read, a directory
// read as an empty file ("holds no layers").
TEST(EplbCli, HostileInputRejected) {
  const std::string huge = write("huge.csv", "1e308,1e308,1e308,1e308\n");
  const std::string hex = write("hex.csv", "0x10,2,3,4\n");
  const std::string trailing = write("trailing.csv", "1,2,3,4,\n");
  const std::string inf = write("inf.csv", "1,inf,3,4\n");
  const std::string ok = write("ok2.csv", "1,2,3,4\n");
  const std::string wide = write("wide.json", "{\"phy2log\": [[0, 1, 2, 4294967299]]}");
  const std::string negative = write("negative.json", "{\"phy2log\": [[0, 1, 2, -1]]}");
  const std::string missing = write("missing.json", "{\"phy2log\": [[0, 1, 2, 2]]}");
  const std::string dir = temp_dir().string();
  const std::string shape = " --replicas 4 --groups 1 --nodes 1 --gpus 1";
  const struct {
    std::string args, needle;
  } cases[] = {
      {"--weights " + huge + shape, "row 0 sums to more than the largest double"},
      {"--weights " + hex + shape, "line 1 column 1: '0x10' is not a number (plain decimal)"},
      {"--weights " + trailing + shape, "line 1 column 5: '' is not a number"},
      {"--weights " + inf + shape, "line 1 column 2: 'inf' is not a number"},
      {"--weights " + dir + shape, "--weights '" + dir + "' is a directory"},
      {"--weights " + ok + shape + " --current " + dir, "--current '" + dir + "' is a directory"},
      {"--weights " + ok + shape + " --current " + wide, "--current phy2log[0][3] = 4294967299 is outside [0, 4)"},
      {"--weights " + ok + shape + " --current " + negative, "--current phy2log[0][3] = -1 is outside [0, 4)"},
      {"--weights " + ok + shape + " --current " + missing, "row 0 holds no replica of logical expert 3"},
      {"--weights " + ok + shape + " --max-balance-loss nan", "--max-balance-loss: 'nan' is not a finite"},
  };
  for (const auto& c : cases) {
    const CliRun r = run("eplb plan " + c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
}

// SGLang's files (epx/eplb/sglang_format.h): its recorder's logical_count (3-D: passes x layers x experts) as
// --weights is planned on the summed passes; --format sglang prints only physical_to_logical_map, which --current
// reads back; broken fields exit 2 naming the flag and the field.
TEST(EplbCli, SglangFiles) {
  // 2 passes x 2 layers x 4 experts; the sums are the rows of `summed`.
  const std::string counts = write("sglang_count.json",
                                   R"({"rank": 0, "average_utilization_rate_over_window": null, "logical_count": [
                                       [[30, 5, 10, 15], [1, 1, 2, 2]],
                                       [[10, 5, 10, 15], [0, 1, 1, 2]]]})");
  const std::vector<std::vector<double>> summed{{40, 10, 20, 30}, {1, 2, 3, 4}};
  const std::string shape = " --replicas 6 --groups 1 --nodes 1 --gpus 2 --policy deepseek";
  CliRun r = run("eplb plan --weights " + counts + shape);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto out = nlohmann::json::parse(r.out);
  const Placement p = rebalance(summed, {6, 1, 1, 2}, Policy::kDeepSeek);
  std::vector<int32_t> flat;
  for (const auto& row : out["phy2log"]) {
    for (int32_t v : row) flat.push_back(v);
  }
  EXPECT_EQ(flat, p.phy2log);
  EXPECT_NEAR(out["balancedness_after"].get<double>(), balancedness(summed, p.phy2log, 6, 2), 1e-12);

  r = run("eplb plan --weights " + counts + shape + " --format sglang");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto sglang = nlohmann::json::parse(r.out);
  ASSERT_EQ(sglang.size(), 1u) << r.out;  // SGLang's init_by_mapping takes no other key
  EXPECT_EQ(sglang["physical_to_logical_map"], out["phy2log"]);

  const std::string current = write("sglang_location.json", r.out);
  r = run("eplb plan --weights " + counts + shape + " --current " + current);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["moved_experts"].get<int64_t>(), 0);
  EXPECT_NEAR(nlohmann::json::parse(r.out)["balancedness_current"].get<double>(), balancedness(summed, p.phy2log, 6, 2),
              1e-12);

  const std::string negative = write("sglang_negative.json", R"({"logical_count": [[1, -2, 3, 4]]})");
  const std::string ragged = write("sglang_ragged.json", R"({"logical_count": [[[1, 2, 3, 4]], [[1, 2, 3]]]})");
  const std::string short_map = write("sglang_short.json", R"({"physical_to_logical_map": [[0, 1, 2, 3, 0]]})");
  const std::string missing = write("sglang_missing.json", R"({"physical_to_logical_map": [[0, 1, 2, 2, 0, 1]]})");
  const std::string layers = write("sglang_layers.json", R"({"physical_to_logical_map": [[0, 1, 2, 3, 0, 1]]})");
  const std::string one = write("one.csv", "1,2,3,4\n");
  const struct {
    std::string args, needle;
  } cases[] = {
      {"--weights " + negative + shape, "(SGLang logical_count): logical_count[0][1] = -2 must be an integer"},
      {"--weights " + ragged + shape, "logical_count[1][0] holds 3 experts, the first row holds 4"},
      {"--weights " + one + shape + " --current " + short_map,
       "--current physical_to_logical_map rows have 5 slots, --replicas is 6"},
      {"--weights " + one + shape + " --current " + missing,
       "--current physical_to_logical_map row 0 holds no replica of logical expert 3"},
      {"--weights " + counts + shape + " --current " + layers,
       "--current physical_to_logical_map has 1 layers, --weights has 2"},
      {"--weights " + counts + shape + " --format deepep", "'deepep'"},
  };
  for (const auto& c : cases) {
    r = run("eplb plan " + c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
}

TEST(EplbCli, SimulateRejectsBadFlagsBeforeStepping) {
  // Before: nan passed until the first rebalance, after --every steps; -1 bytes printed negative moved_bytes.
  for (const char* args : {"--max-balance-loss nan", "--expert-bytes -1", "--expert-bytes nan"}) {
    const CliRun r = run(std::string("eplb simulate --steps 200 ") + args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(std::string(args).substr(0, std::string(args).find(' '))), std::string::npos) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
}

TEST(EplbCli, SimulateImprovesUtilization) {
  const CliRun r =
      run("eplb simulate --layers 4 --experts 32 --replicas 40 --groups 4 --nodes 2 --gpus 8 --exponent 1.0 --steps 60 "
          "--buffer 20 --every 20 --layers-per-step 2 --report-every 20 --expert-bytes 1000");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto out = nlohmann::json::parse(r.out);
  EXPECT_EQ(out["timeline"].size(), 3u);
  EXPECT_GE(out["rebalances_computed"].get<int>(), 1);
  EXPECT_GT(out["mean_utilization_rebalanced"].get<double>(), out["mean_utilization_static"].get<double>() + 0.05);
  EXPECT_GT(out["moved_experts"].get<int64_t>(), 0);
  EXPECT_DOUBLE_EQ(out["moved_bytes"].get<double>(), 1000.0 * out["moved_experts"].get<double>());
  const CliRun bad = run("eplb simulate --buffer 50 --every 10 --steps 5");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("--every 10 must be >= --buffer 50"), std::string::npos) << bad.err;
}

// --record-mode per_pass / per_token with --records: one record per simulated step, in SGLang's dump fields, whose
// counts (per_token: derived from the top-k ids) sum to what the pass routed.
TEST(EplbCli, SimulateWritesRecords) {
  const std::string shape =
      "eplb simulate --layers 3 --experts 16 --replicas 20 --groups 4 --nodes 1 --gpus 4 --steps 12 --tokens 50 "
      "--topk 4 --buffer 4 --every 4 --report-every 4 --seed 3";
  for (const char* mode : {"per_pass", "per_token"}) {
    SCOPED_TRACE(mode);
    const std::string file = (temp_dir() / (std::string(mode) + ".json")).string();
    const CliRun r = run(shape + " --record-mode " + mode + " --records " + file);
    ASSERT_EQ(r.code, 0) << r.err;
    const auto out = nlohmann::json::parse(r.out);
    EXPECT_EQ(out["settings"]["record_mode"], mode);
    EXPECT_EQ(out["records"]["kept"].get<int>(), 12);
    EXPECT_EQ(out["records"]["dropped_passes"].get<int>(), 0);
    EXPECT_EQ(out["records"]["file"], file);
    const auto dump = nlohmann::json::parse(slurp(file));
    EXPECT_EQ(dump["mode"], mode);
    ASSERT_EQ(dump["records"].size(), 12u);
    EXPECT_EQ(dump["last_physical_to_logical_map"].size(), 3u);
    for (size_t i = 0; i < dump["records"].size(); ++i) {
      const auto& rec = dump["records"][i];
      EXPECT_EQ(rec["forward_pass_id"].get<int64_t>(), static_cast<int64_t>(i) + 1);
      ASSERT_EQ(rec["global_physical_count"].size(), 3u);
      for (const auto& layer : rec["global_physical_count"]) {
        ASSERT_EQ(layer.size(), 20u);
        int64_t sum = 0;
        for (const auto& c : layer) sum += c.get<int64_t>();
        EXPECT_GT(sum, 0);  // ~ --tokens x --topk = 200, with noise
      }
      if (std::string(mode) == "per_token") {
        // The top-k ids give back the counts exactly.
        ASSERT_EQ(rec["topk_ids_of_layer"].size(), 3u);
        for (size_t l = 0; l < 3; ++l) {
          std::vector<int64_t> counts(20, 0);
          for (const auto& token : rec["topk_ids_of_layer"][l]) {
            ASSERT_EQ(token.size(), 4u);
            for (const auto& id : token) {
              if (id.get<int64_t>() >= 0) ++counts[id.get<int64_t>()];
            }
          }
          for (size_t p = 0; p < 20; ++p) EXPECT_EQ(counts[p], rec["global_physical_count"][l][p].get<int64_t>());
        }
      }
    }
  }
  // The cap: nothing kept, every pass counted as dropped.
  const CliRun capped = run(shape + " --record-mode per_pass --record-max-bytes 0");
  ASSERT_EQ(capped.code, 0) << capped.err;
  const auto out = nlohmann::json::parse(capped.out);
  EXPECT_EQ(out["records"]["kept"].get<int>(), 0);
  EXPECT_EQ(out["records"]["dropped_passes"].get<int>(), 12);
  EXPECT_TRUE(out["records"]["file"].is_null());
}

}  // namespace
}  // namespace epx::eplb
