// Every size bound the contract states, once. Plain constants (no CUDA needed): the checks, the CUDA kernels
// that size arrays by them and the size hints all include this header, so a layout cannot drift from the check
// that guards it. Bounds that are part of the public contract and that user code needs as constants stay in
// include/epx/: kMaxDims (epx/tensor.h), kMaxTimeoutMs (epx/group.h), kFp8BlockSize (epx/quant.h). The values
// below are stated to users in include/epx/*.h and docs/ (host-backend.md, normal-kernels.md, dp-attention.md);
// change both together.
#pragma once

#include <cstdint>

namespace epx {

// ---- groups and buffers, every backend --------------------------------------------------------------

// create_host_groups: one thread per rank in one process; far above any real world, low enough that a typo
// fails as kInvalidArgument instead of as thread creation.
inline constexpr int kMaxHostGroupRanks = 1024;
// BufferOptions::num_sms: above any GPU's SM count. The CUDA backend allows only 2 * kNormalMaxChannels.
inline constexpr int kMaxNumSms = 1024;

// ---- expert parallelism, every backend (src/ep/validate.*) -------------------------------------------

// Normal path: expert ids and per-expert counts are int32.
inline constexpr int64_t kMaxExperts = INT32_MAX;
// Normal path: the row indices of a worst-token dispatch (recv_src_idx, the kernels' row counters) are int32.
// num_worst_tokens * (the bytes of one received row) must also fit in int64 (checked separately).
inline constexpr int64_t kMaxWorstTokens = INT32_MAX;
// Low-latency path, checked by every backend so that a program that runs on the host backend runs on the GPU.
inline constexpr int kLowLatencyMaxHidden = 16384;  // the contract's bound; the kernels loop over a row
inline constexpr int kLowLatencyMaxTopk = 16;       // combine staging holds this many rows per token
inline constexpr int kLowLatencyMaxExperts = 1024;  // LowLatencyControl keeps one counter per local expert

// ---- CUDA backend, normal path (src/ep/cuda/normal_kernels.*) --------------------------------------------

// Ranks: the dispatch and combine blocks split their 24 warps into one group per peer (3 warps each at 8), and
// CommArgs carries one peer pointer per rank by value; 8 is the GPUs of one NVLink host. It is lower than
// kLowLatencyMaxRanks because the low-latency kernels split work by expert, not by peer.
inline constexpr int kNormalMaxRanks = 8;
// Ranks of the hierarchical normal routing on the cuda backend (src/ep/cuda/hierarchical_*): nodes x GPUs per node,
// at most 32 GPUs per node (hier::kMaxGpusPerNode: a record's local-rank mask). Bounded by the layout kernel's 64-bit
// destination mask, the call header's per-rank counts and hier::kMaxParts (the (local rank, node) receive blocks).
// Above kNormalMaxRanks a cuda buffer has no flat normal engine: it needs NormalRouting::kHierarchical (or kAuto on
// more than one node).
inline constexpr int kHierarchicalMaxRanks = 64;
// Ranks of a cuda group of threads (create_cuda_groups) and of its single-process exchange: the larger of the
// hierarchical normal routing's and the low-latency path's caps (kLowLatencyMaxRanks, below).
inline constexpr int kCudaMaxRanks = 128;
// Channels (num_sms / 2): each notify slot carries one prefix per channel; num_sms <= 128 fits an H200 (132 SMs).
inline constexpr int kNormalMaxChannels = 64;
// Local experts: each notify slot carries one count per local expert.
inline constexpr int kNormalMaxLocalExperts = 1024;
// Top-k: the layout kernel holds a token's ids in registers, and a ring row reserves room for this many.
inline constexpr int kNormalMaxTopk = 16;
// Experts: the layout kernel counts them in shared memory (8192 int32 = 32 KiB, under the 48 KiB default).
inline constexpr int kNormalMaxExperts = 8192;
// Signals and notify slots at the head of every rank's normal region; the ring area follows. The constructor
// checks that the signal layout of kNormalMaxRanks x kNormalMaxChannels fits.
inline constexpr int64_t kNormalSignalBytes = int64_t{1} << 20;
// Ring rows per (source rank, channel): ring bytes / row bytes, at least the minimum (fewer cannot pipeline:
// kInvalidArgument naming num_normal_bytes), at most the maximum (the rest of the ring area stays unused).
inline constexpr int64_t kNormalMinRingRows = 4;
inline constexpr int64_t kNormalMaxRingRows = 1024;
// The ring rows normal_buffer_size_hint reserves per (source rank, channel).
inline constexpr int64_t kNormalHintRingRows = 256;
// Copy-engine path: copies per destination and call (NormalConfig::max_copy_chunks; one event pair each).
inline constexpr int kNormalMaxCopyChunks = 8;

// ---- CUDA backend, low-latency path (src/ep/cuda/low_latency.*) --------------------------------------------

// Ranks: sizes the rank mask in LowLatencyControl, LowLatencyPeers::bases (a kernel parameter: 8 bytes a rank) and the
// kernels' per-source shared arrays (one thread per source: at most the kernels' 256 threads). Reached only with the
// hierarchical routing (LowLatencyRouting::kHierarchical, e.g. EP72 decode as 9 x 8); the flat routing and the
// hierarchical routing's node legs stop at kLowLatencyFlatMaxRanks.
inline constexpr int kLowLatencyMaxRanks = 128;
// Ranks of the flat low-latency routing, and GPUs per node of the hierarchical one (its node legs are flat): the
// expert-side reduction's per-rank partial rows share combine_data's kLowLatencyMaxTopk rows per token, and 16 covers
// every NVLink host (ranks as threads of one GPU too).
inline constexpr int kLowLatencyFlatMaxRanks = 16;
// max_tokens_per_rank (M) of a CUDA low-latency buffer (the host backend has no such bound): the combine staging
// alone is M x kLowLatencyMaxTopk rows of H bf16 per buffer set, 0.9 GB at M = 4096 and H = 7168.
inline constexpr int kLowLatencyMaxTokens = 4096;

// ---- data-parallel attention and two-batch overlap ---------------------------------------------------

// world_size of a ParallelLayout, the DP ranks of a gather plan and attn_tp_size (each at most the world).
inline constexpr int kMaxDpWorldSize = 1024;
// Rows of a DP gather buffer (and each rank's count): row offsets stay far from int64 overflow once multiplied
// by hidden and the element size.
inline constexpr int64_t kMaxDpBufferRows = int64_t{1} << 40;
// Token counts of a TBO split (each extend length, prefix length and their sum): sums stay far from overflow.
inline constexpr int64_t kMaxTboTokens = int64_t{1} << 40;

}  // namespace epx
