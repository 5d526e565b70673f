// `epx bench --dp`, `--tbo` and `--eplb` (CUDA builds only; tools/cuda/bench_dp.cpp, tools/cuda/bench_tbo.cpp,
// tools/cuda/bench_eplb.cpp).
#pragma once

#include <nlohmann/json.hpp>

#include "bench.h"

namespace epx::cli {

#ifdef EPX_WITH_CUDA
// DP-attention gather/scatter (both padding modes, 1 to 8192 tokens per rank) beside plain NCCL
// collectives of the same bytes, and the per-step batch-metadata sync; one rank per visible GPU.
// Uses config.hidden, num_warmup, num_iters, progress, seed. Report: {"backend", "device", "settings",
// "phases", "metadata_sync", "check"}.
nlohmann::json run_cuda_dp_bench(const BenchConfig& config);
// Two-batch overlap of an MoE step (dispatch -> expert GEMMs -> combine) on two micro-batches, with and
// without overlap; one rank per visible GPU (at least 2). Uses config.num_tokens (per rank, both
// micro-batches), hidden, num_topk, num_experts, num_sms[0] (SMs of the communication kernels),
// num_warmup, num_iters, progress, seed.
nlohmann::json run_cuda_tbo_bench(const BenchConfig& config);
// EPLB live (tools/cuda/bench_eplb.cpp): low-latency decode steps on Zipf routing with device replica choice, one
// rebalance from the recorded counts and the relocation of one layer's DeepSeek-V3-sized expert weights over the
// cuda transport, then the steps again. num_ranks ranks (0: one per visible GPU; more ranks than GPUs share
// them). Uses config.num_ranks, num_ll_tokens, hidden, num_topk, num_experts, seed. Report adds "eplb":
// {"utilization_before", "utilization_after", "slots_moved", "bytes_moved", "relocation_ms"}.
nlohmann::json run_cuda_eplb_bench(const BenchConfig& config);
#endif

}  // namespace epx::cli
