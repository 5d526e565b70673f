// What the two files of `epx eplb` share: cmd_eplb.cpp (the flags and `epx eplb plan`) and eplb_simulate.cpp
// (`epx eplb simulate`).
#pragma once

#include <cstdint>
#include <string>

#include "epx/eplb/recorder.h"

namespace epx::cli::eplb_cmd {

// Bounds of the flags (--help shows them). Sizes up to 2^20 keep every index product of the library in
// int64 and far from int32 per layer; the memory a run needs is checked separately (check_fits_in_memory).
inline constexpr int64_t kMaxSize = int64_t{1} << 20;
inline constexpr int64_t kMaxInt = INT32_MAX;
inline constexpr double kMaxExpertBytes = 1e15;            // moved_bytes = moved_experts x this stays far from overflow
inline constexpr int64_t kMaxStepLoad = int64_t{1} << 30;  // --tokens x --topk
inline constexpr int64_t kMaxRecordBytes = int64_t{1} << 40;  // --record-max-bytes

// The placement shape's rules (the library's make_layout), naming the flags. `logical` names where the
// logical expert count comes from ("columns of --weights", "--experts").
void check_shape(int64_t num_logical, const char* logical, int64_t replicas, int64_t groups, int64_t nodes,
                 int64_t gpus);

struct SimArgs {
  int layers = 61, experts = 256, replicas = 288, groups = 8, nodes = 4, gpus = 32;
  double exponent = 1.0, drift = 0.01;
  int steps = 1000, tokens = 4096, topk = 8, buffer = 100, every = 100, layers_per_step = 8, report_every = 50;
  double threshold = 1.0, max_balance_loss = 0.01;  // threshold: SGLang's default, never skip
  std::string gate = "mean_step";
  std::string policy = "default";
  std::string plot;  // PNG path: drawn by the Python package's epx.plot (matplotlib)
  bool no_migration = false;
  uint64_t seed = 1;
  double expert_bytes = 3.0 * 7168 * 2048;  // DeepSeek-V3 expert: three 7168 x 2048 fp8 matrices
  std::string record_mode = "stat";
  std::string records;  // per_pass / per_token records as JSON (LoadRecorder::records_json)
  int64_t record_max_bytes = eplb::RecorderOptions{}.max_record_bytes;
};

// `epx eplb simulate`: the flags' joint rules and the memory the run needs checked (BadInput), then the run; prints
// JSON on stdout (and draws --plot).
void run_simulate(const SimArgs& a);

}  // namespace epx::cli::eplb_cmd
