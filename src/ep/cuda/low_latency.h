// Low-latency dispatch/combine kernels (private to the CUDA backend).
//
// Every rank owns one peer-visible region laid out identically on all ranks (LowLatencyLayout). Two buffer
// sets alternate between calls of the same kind, so two results can be alive at once. Senders write each
// (token, expert) pair into the receiver's staging slot for (local expert, source rank), at s * M, which
// needs no agreement between senders; the receive half waits on the signals, which carry the counts, and
// copies the staged blocks into the packed output rows (source order, no gaps; see buffer.h). That copy is
// local (HBM), runs once the last count is known and never touches rows a peer may still write.
//
// Signals carry a tag instead of being reset: each set has a device-side sequence number `seq`; the
// sender tags with seq + 1 and the receive kernel advances seq when it completes. Because seq lives in
// device memory, graph replays see fresh tags. All ranks make the same calls, so tags agree.
//
// Token-staged dispatch (LowLatencyDispatchLaunch::token_staged, the flat routing): a token's row crosses to a
// rank once however many of its experts live there (top-8 of 256 on 2 ranks: ~4 pairs per token and rank), written
// by the block of its first expert there into the rows [s * M, (s + 1) * M) of the set's dispatch_data, indexed by
// token; the per-pair (src_info, slot_k) entries stay per expert, so the receive finds a pair's row by its token.
//
// Memory ordering: a sending block writes its data with plain stores, then __syncthreads(), then one thread
// issues a st.release.sys of the tagged signal (the barrier puts the block's stores in the release's past).
// The combine send splits an expert over several blocks: each fences (sys) and bumps a per-expert counter,
// and the last one signals. The receiver polls with ld.acquire.sys, so data written before the release is
// visible after the acquire.
//
// One kernel function per direction (ll::dispatch, ll::combine) with a runtime phase: the hook split launches it
// twice (send, then receive), a call without a hook once with both halves (one launch less on the critical
// path). Profiler-based tools find the kernels by name; see docs/low-latency.md.
//
// Programmatic launches (programmatic_launch in the launch structs): each launch may then be scheduled while the
// kernel before it on the stream finishes (comm/cuda/device/pdl.cuh); the kernels touch no global memory before
// griddepcontrol.wait, and a block lets the next kernel in only once it waits for no other grid (the NOTE at
// ll::dispatch). Without it the same kernels run in plain stream order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "comm/cuda/device/error_record.h"
#include "ep/low_latency_layout.h"

namespace epx::cuda {

// What the kernels need about the peers. Trivially copyable; passed by value.
struct LowLatencyPeers {
  char* bases[kLowLatencyMaxRanks];  // each rank's region, addressable from this rank's device
  int rank = 0;
  int num_ranks = 0;
  // Host-mapped: a wait that expired (kErrTimeout, the peer is masked) or an expert that overflowed its slots
  // (kErrExpertOverflow); the host reports it after the call and zeroes `code`.
  ErrorRecord* error = nullptr;
  uint64_t timeout_ns = 0;  // the budget of every wait (%globaltimer)
  // Hierarchical routing (hierarchical_low_latency_kernels.h): ranks per node; 0 = one node of every rank (flat). A
  // source on another node reaches this rank through its forwarder here (path_peer), whose bases[] entry is the only
  // one mapped there: bases[] is null for the ranks of other nodes.
  int gpus_per_node = 0;
};

// The rank that writes src's dispatch signals on `rank` (and that a timeout there masks): src itself on the same
// node (always, in the flat routing), else src's forwarder on rank's node, the rank with src's local index.
__host__ __device__ inline int path_peer(int rank, int src, int gpus_per_node) {
  if (gpus_per_node == 0 || rank / gpus_per_node == src / gpus_per_node) return src;
  return rank / gpus_per_node * gpus_per_node + src % gpus_per_node;
}

struct LowLatencyDispatchLaunch {
  const void* x;     // [T, H] bf16
  const void* topk;  // [T, K] int32 or int64
  bool topk_int64;
  int64_t num_tokens;
  int num_topk;
  bool use_fp8;
  bool ue8m0;                   // quantize with power-of-two scales; the staged scales are exponent bytes
  bool scales_fp32;             // received scales as fp32 (2^(e - 127) when ue8m0: round_scale), else exponents
  bool scales_column_major;     // received scales [E_local][units][R * M] (DeepGEMM), else [E_local][R * M][units]
  int* cumulative_recv_counts;  // [E_local] or null
  // Token-staged rows (the flat routing): a source writes each token's row once per destination rank, at that
  // rank's staging row source * M + token, by the block of the token's first expert there (lowest k); every pair
  // still writes its (src_info, slot_k) entry in the expert's staging and names the local expert whose block wrote the
  // row (dispatch_owner). The receive then also waits for each pair's owner signal and copies from the token rows.
  // False: rows per pair in the expert's staging block (what the hierarchical forward writes, and below
  // LowLatencyConfig::token_rows_min_tokens).
  bool token_staged = false;
  // A programmatic dependent launch (LowLatencyConfig::programmatic_launch; see "Programmatic launches" above).
  bool programmatic_launch = false;
  // The receive also writes the set's pair_map (LowLatencyConfig::expert_side_reduction: the combine send finds
  // each (source, token)'s pairs here through it).
  bool pair_map = false;
  // LowLatencyDispatchArgs::wait_recv_cost_ns ([R] int64) or null: each receive wait adds its nanoseconds to the
  // entry of the source it waited for.
  unsigned long long* wait_cost = nullptr;
};

struct LowLatencyCombineLaunch {
  const void* x;     // [E_local, R * M, H] bf16 expert outputs, in the dispatch's packed rows
  const void* topk;  // [T, K]
  bool topk_int64;
  const float* topk_weights;  // [T, K]
  int64_t num_tokens;
  int num_topk;
  void* out;         // [T, H] bf16
  int dispatch_set;  // the set of the dispatch whose slots x follows
  int send_parts;    // blocks per local expert in the send half: 1, 2, 4 or 8 (LowLatencyConfig; every rank alike)
  // The handle's dispatch number (LowLatencyEngine, alike on every rank for the same dispatch), low
  // kCombineIdBits bits: the signals carry the sender's, the receive compares it with its own.
  uint32_t dispatch_id;
  bool programmatic_launch = false;  // as LowLatencyDispatchLaunch::programmatic_launch
  // LowLatencyConfig::expert_side_reduction (the dispatch wrote its pair_map): the send half writes this rank's
  // weights to every open rank, then one bf16 partial row per (source, token) with pairs here; the receive sums one
  // row per chosen rank (low_latency_partials.cuh).
  bool expert_side = false;
  // Its send blocks (a power of two; 0: partial_send_blocks(layout), up to 128).
  int partial_send_blocks = 0;
  // A cap on the receive blocks of either combine (0: none): ranks sharing a GPU pass shared_gpu_combine_grid's.
  int recv_blocks = 0;
  unsigned long long* wait_cost = nullptr;  // LowLatencyCombineArgs::wait_recv_cost_ns: per expert rank, as dispatch's
  // LowLatencyConfig::combine_solo_max_rows: an expert with at most this many received rows is sent by its first part
  // alone, without the parts' counter (the counter of each expert stays a multiple of send_parts).
  int solo_max_rows = 0;
};

// The combine grids of ranks that share one GPU (`sharing` of them, counted by the GPU's UUID; this device current).
// Receiving blocks spin until the peers' rows are there, so they must leave room for the peers' sending blocks: with
// the full grid (up to 264 receive blocks), one rank's receive took nearly every resident slot of an H200 and its
// peer's sends trickled through the rest (a 128-token combine 165 us against 38.8 on two GPUs). Of each rank's
// 1/sharing of the GPU's resident ll::combine blocks a quarter receives and a quarter (a power of two) runs the
// expert-side reduction's sends (they wait for the peers' weights, so every rank's must be resident at once); the rest
// stays free. sharing <= 1: {0, 0} (the full grids).
struct SharedGpuCombineGrid {
  int send_blocks = 0;  // LowLatencyCombineLaunch::partial_send_blocks
  int recv_blocks = 0;  // LowLatencyCombineLaunch::recv_blocks
};
SharedGpuCombineGrid shared_gpu_combine_grid(int sharing);

// A combine signal is (tag << kCombineIdBits) | kCombineNoRows or not | the sender's dispatch id (low kCombineIdWidth
// bits). kCombineNoRows: the expert's rank missed this source's pairs in the dispatch (its receive timed out on the
// source, or found it masked), wrote none of its rows this call, and the source counts its experts as zero instead of
// reading rows of an earlier call (reachable when the mask is lifted between the dispatch and the combine).
inline constexpr int kCombineIdBits = 24;
inline constexpr int kCombineIdWidth = 23;
inline constexpr uint32_t kCombineIdMask = (1u << kCombineIdWidth) - 1;
inline constexpr uint64_t kCombineNoRows = uint64_t{1} << kCombineIdWidth;

// Loads the low-latency kernels into the current device's context; see preload_normal_kernels.
cudaError_t preload_low_latency_kernels();
namespace ll {
// Which half of a call a launch runs: with a receive hook, the send half now and the receive half when the hook
// runs; without one, both in one launch.
enum class Phase : int {
  kSend = 1,  // the hook's first half
  kRecv = 2,  // the hook's second half
  kBoth = 3,  // no hook: both halves in one launch
};
}  // namespace ll

// Dispatch. Send half: quantize (optionally) and write every (token, expert) pair into the receiver's slot. Receive
// half: wait for every unmasked source rank, copy the staged rows into the packed output, write counts, ranges
// (begin = prefix of the counts) and src_info (-1 past the count).
void launch_low_latency_dispatch(ll::Phase phase, const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                 const LowLatencyDispatchLaunch& args, cudaStream_t stream);
// Combine. Send half: each local expert's rows go back to their (token, k) row on the source rank. Receive half:
// wait for the experts each token chose, then the weighted sum in fp32 (ascending k).
void launch_low_latency_combine(ll::Phase phase, const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                const LowLatencyCombineLaunch& args, cudaStream_t stream);

}  // namespace epx::cuda
