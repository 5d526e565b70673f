// `epx bench`'s random inputs, one set per rank: what the plain host run (bench_host.cpp) and the nodes runs
// (bench_nodes.cpp, tools/cuda/bench_nodes.cpp) draw from the same generator.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace epx::cli {

// One rank's inputs. x holds small integers in [-8, 8] and the weights are eighths in [1/8, 1/2], so every sum a
// combine of identity experts makes (up to 2^8 copies of a row) is exact in fp32 and bf16.
struct RankInputs {
  int64_t num_tokens = 0;
  std::vector<uint16_t> x;      // [T, H] bf16
  std::vector<uint8_t> x_fp8;   // [T, H] e4m3, x quantized
  std::vector<float> x_scales;  // [T, H / 128] fp32 scales of x_fp8
  std::vector<int64_t> topk;    // [T, K] distinct experts in [0, num_experts)
  std::vector<float> weights;   // [T, K]
};

// num_ranks ranks' inputs in rank order, drawn from rng (per rank: x, top-k, weights; the same generator state
// gives the same inputs). hidden: a multiple of 128.
std::vector<RankInputs> make_rank_inputs(std::mt19937_64& rng, int num_ranks, int64_t num_tokens, int64_t hidden,
                                         int num_topk, int64_t num_experts);

// Elements of a normal combine of identity experts (out: [T, H] bf16 of in's rank) that differ from x times the
// number of ranks the token visited (exact: x holds small integers). An output of another size counts T * H.
int64_t count_identity_combine_mismatches(const RankInputs& in, const std::vector<uint16_t>& out, int64_t hidden,
                                          int num_topk, int64_t num_experts, int num_ranks);

}  // namespace epx::cli
