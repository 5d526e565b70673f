// Low-latency combine with the expert-side reduction (LowLatencyConfig::expert_side_reduction, flat routing; included
// by low_latency_combine.cu, whose ll::combine runs these halves in place of the per-expert ones).
//
// Send half (the expert's rank): block 0 first writes this rank's topk_weights [T][K] into every open rank's
// combine_weights[this rank] and releases that rank's weights signal; then every block takes units (source r, token t)
// of r's possible tokens: the dispatch receive's pair_map names the packed rows of r's pairs (t, k) here (stamped with
// the dispatch's tag); a unit with pairs waits (once per block and source) for r's weights, sums w_k * y_k in fp32 over
// its pairs in ascending k and stores the bf16 partial row into r's combine_data at [t][this rank]. Per destination r,
// the last block done with r (a monotonic counter per destination over a power-of-two grid) releases r's combine signal
// [this rank]; a block takes the sources whose weights are there first (partial_send_block's NOTE).
// Receive half (the token's rank): per token slice, wait for the signal of every open rank a token's experts live on,
// then out = bf16(0 + p_q over those ranks in ascending q) in fp32; the completion rule covers every open rank.
// The arithmetic is the host backend's (host_low_latency_routing.cpp) bit for bit. Protocol: docs/low-latency.md.
#pragma once

#include "ep/cuda/low_latency_device.cuh"

namespace epx::cuda {
namespace {

// Send blocks of the expert-side reduction: a power of two (the completion counter wraps in phase), one unit of
// (source, token) per block at least, at most 128.
__host__ __device__ inline int partial_send_blocks(const LowLatencyLayout& layout) {
  const int64_t units = static_cast<int64_t>(layout.num_ranks) * layout.max_tokens_per_rank;
  int blocks = 1;
  while (blocks < 128 && blocks < units) blocks *= 2;
  return blocks;
}

// How partial_send_source looks for a source's weights: once (the first pass), once more (the deferred passes: the
// wait since waited_since counts in wait_recv_cost_ns once they are there), by a bounded wait for what is left of the
// timeout since waited_since (the only late source: nothing else to do meanwhile, and a spin wakes up soonest), or a
// last time before it gives up (that timeout expired). Expiry masks the source and records the timeout, as any
// bounded wait's.
enum class WeightsLook { kFirst, kAgain, kWait, kLast };

// One source r's units (r, t) among this block's (t = block mod num_blocks and up), from shared resume[r]: sums and
// stores each unit's partial row into r's combine_data at [t][this rank]. r's weights are looked for at the first unit
// with pairs (WeightsLook); when they are not there yet, resume[r] keeps the unit and false is returned (the block
// comes back to r later). True: r is done in this block. Every thread calls it.
__device__ bool partial_send_source(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                    const LowLatencyCombineLaunch& args, int r, int num_blocks, WeightsLook look,
                                    uint64_t waited_since, uint64_t tag, uint64_t stamp, int64_t* resume,
                                    int* weights_state) {
  __shared__ int64_t rows[kLowLatencyMaxTopk];  // the unit's packed row per k, -1 without a pair
  __shared__ float weights[kLowLatencyMaxTopk];
  __shared__ bool any;
  const int64_t M = layout.max_tokens_per_rank, H = layout.hidden;
  char* base = peers.bases[peers.rank];
  LowLatencyControl* ctrl = control_of(peers, layout);
  const LowLatencySet& c = layout.sets[set];
  const int64_t* map = at<const int64_t>(base, layout.sets[args.dispatch_set].pair_map);
  const auto* x = static_cast<const uint4*>(args.x);
  const int64_t row_vecs = H / 8;
  for (int64_t u = resume[r]; u < (r + 1) * M; u += num_blocks) {
    const int64_t t = u - r * M;
    __syncthreads();  // rows[], weights[] and `any` of the previous unit are no longer read
    if (threadIdx.x == 0) any = false;
    __syncthreads();
    if (threadIdx.x < kLowLatencyMaxTopk) {
      const int64_t entry = map[u * kLowLatencyMaxTopk + threadIdx.x];
      const bool hit = (static_cast<uint64_t>(entry) >> 32) == stamp;
      rows[threadIdx.x] = hit ? (entry & 0xffffffff) : -1;
      if (hit) any = true;
    }
    __syncthreads();
    if (!any) continue;  // uniform: no pair of (r, t) here
    if (threadIdx.x == 0 && weights_state[r] == 0) {
      const uint64_t* signal = at<const uint64_t>(base, c.weights_signals) + r;
      auto expire = [&](uint64_t v) {
        atomicExch(&ctrl->mask[r], 1);
        record_failure(peers, kErrTimeout, kSiteLowLatencyCombineRecv, r, r, static_cast<int64_t>(tag),
                       static_cast<int64_t>(v));
      };
      if (look == WeightsLook::kWait) {
        const uint64_t spent = global_ns() - waited_since;
        weights_state[r] =
            bounded_wait<1>(
                signal, spent < peers.timeout_ns ? peers.timeout_ns - spent : 0, [&](uint64_t v) { return v == tag; },
                [&] { return ld_volatile_global(&ctrl->mask[r]) != 0; }, expire)
                ? 1
                : -1;
      } else {
        const uint64_t v = ld_acquire_sys(signal);
        if (ld_volatile_global(&ctrl->mask[r]) != 0) {
          weights_state[r] = -1;  // masked meanwhile (another block's give-up, or a receive's timeout)
        } else if (v == tag) {
          weights_state[r] = 1;
        } else if (look == WeightsLook::kLast) {
          expire(v);
          weights_state[r] = -1;
        }
      }
      if (look != WeightsLook::kFirst && weights_state[r] != 0 && args.wait_cost != nullptr) {
        atomicAdd(args.wait_cost + r, static_cast<unsigned long long>(global_ns() - waited_since));
      }
    }
    __syncthreads();
    if (weights_state[r] == 0) {  // uniform: not there yet
      resume[r] = u;
      return false;
    }
    if (weights_state[r] < 0) return true;  // uniform: r's weights never came (r is masked now)
    if (threadIdx.x < kLowLatencyMaxTopk) {
      weights[threadIdx.x] =
          rows[threadIdx.x] >= 0
              ? __ldcg(at<const float>(base, c.combine_weights) + u * kLowLatencyMaxTopk + threadIdx.x)
              : 0.f;
    }
    __syncthreads();
    uint4* dst = at<uint4>(peers.bases[r], c.combine_data + (t * kLowLatencyMaxTopk + peers.rank) * H * 2);
    for (int64_t v = threadIdx.x; v < row_vecs; v += kThreads) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      sum_slots<8>(
          acc, kLowLatencyMaxTopk, [&](int k) { return rows[k] >= 0; },
          [&](int k) { return __ldg(x + rows[k] * row_vecs + v); },
          [&](float* a, int k, uint4 raw) { add_weighted(a, raw, weights[k]); });
      dst[v] = pack_bf16x8(acc);
    }
  }
  return true;
}

// NOTE: per destination, not per grid: a block finishes every source whose weights are there before it waits, then
// looks at the late sources in turn until each is there or the timeout since the first look expired, and each
// destination's signal goes out once every block is done with that destination. So a source that never sends its
// weights (it masked this rank in the dispatch after this rank had received its pairs) delays only its own units, by
// one timeout, and not this rank's partials for everyone else (which would make every other rank time out on this one
// too).
__device__ void partial_send_block(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                   const LowLatencyCombineLaunch& args, int block, int num_blocks) {
  // NOTE: the expert-side reduction runs on the flat routing only (R <= kLowLatencyFlatMaxRanks).
  __shared__ bool open[kLowLatencyFlatMaxRanks];          // the mask when the block started (uniform decisions)
  __shared__ int weights_state[kLowLatencyFlatMaxRanks];  // per source: 0 not yet there, 1 there, -1 lost
  __shared__ int64_t resume[kLowLatencyFlatMaxRanks];     // per source: the block's next unit
  const int R = peers.num_ranks;
  const int64_t M = layout.max_tokens_per_rank;
  LowLatencyControl* ctrl = control_of(peers, layout);
  const uint64_t tag = ctrl->combine_seq[set] + 1;
  const uint64_t stamp = dispatch_tag(ctrl->dispatch_seq[args.dispatch_set]);  // the dispatch's stamp
  const LowLatencySet& c = layout.sets[set];
  if (threadIdx.x < R) {
    const int r = threadIdx.x;
    open[r] = ld_volatile_global(&ctrl->mask[r]) == 0;
    weights_state[r] = 0;
    // The block's first unit of source r: the first u >= r * M with u % num_blocks == block.
    const int64_t first = r * M;
    resume[r] = first + ((block - first % num_blocks) % num_blocks + num_blocks) % num_blocks;
  }
  __syncthreads();
  if (block == 0) {
    const int K = args.num_topk;
    const int64_t per_rank = args.num_tokens * K;
    for (int64_t i = threadIdx.x; i < R * per_rank; i += kThreads) {
      const int q = static_cast<int>(i / per_rank);
      if (!open[q]) continue;
      const int64_t j = i - q * per_rank, t = j / K, k = j - t * K;
      at<float>(peers.bases[q], c.combine_weights)[(peers.rank * M + t) * kLowLatencyMaxTopk + k] =
          args.topk_weights[j];
    }
    __syncthreads();  // every thread's stores before the releases (cumulativity)
    if (threadIdx.x < R && open[threadIdx.x]) {
      st_release_sys(at<uint64_t>(peers.bases[threadIdx.x], c.weights_signals) + peers.rank, tag);
    }
  }
  // A source whose pairs this rank's dispatch receive missed (in part or whole) gets no rows: its signal says so.
  auto no_rows = [&](int r) { return dispatch_missed(ctrl, args.dispatch_set, r); };
  // Every thread calls it, once per destination r, after the block's last store to r. The counter's phase as in
  // last_of_parts; the system fence only after rows were stored (the rows stored since the last finish are all r's: a
  // source is deferred only before its first stored unit), so that finishing a destination without rows costs an
  // atomic, not a fence.
  auto finish = [&](int r, bool stored) {
    __syncthreads();  // every thread's stores to r before thread 0's fence (cumulativity)
    if (threadIdx.x != 0) return;
    if (stored) __threadfence_system();
    const unsigned int done = atomicAdd(&ctrl->partial_sends_done[set][r], 1u) + 1;
    if (done % static_cast<unsigned>(num_blocks) != 0) return;
    __threadfence();  // acquire: the other blocks' rows for r, fenced before their increments
    if (open[r] && ld_volatile_global(&ctrl->mask[r]) == 0) {
      st_release_sys(at<uint64_t>(peers.bases[r], c.combine_signals) + peers.rank,
                     (tag << kCombineIdBits) | (no_rows(r) ? kCombineNoRows : 0) | (args.dispatch_id & kCombineIdMask));
    }
  };
  // Own rank first (its weights are local), then the others in turn; then the sources whose weights were late.
  __shared__ bool give_up;
  unsigned deferred = 0;  // uniform
  for (int i = 0; i < R; ++i) {
    const int r = (peers.rank + i) % R;
    if (!open[r] || no_rows(r) ||
        partial_send_source(peers, layout, set, args, r, num_blocks, WeightsLook::kFirst, 0, tag, stamp, resume,
                            weights_state)) {
      finish(r, weights_state[r] == 1);
    } else {
      deferred |= 1u << r;
    }
  }
  const uint64_t since = deferred != 0 ? global_ns() : 0;  // read by thread 0 only below
  while (deferred != 0) {
    __syncthreads();
    if (threadIdx.x == 0) give_up = global_ns() - since > peers.timeout_ns;
    __syncthreads();
    const WeightsLook look = give_up                 ? WeightsLook::kLast
                             : __popc(deferred) == 1 ? WeightsLook::kWait
                                                     : WeightsLook::kAgain;
    for (int i = 0; i < R; ++i) {
      const int r = (peers.rank + i) % R;
      if ((deferred >> r & 1) != 0 && partial_send_source(peers, layout, set, args, r, num_blocks, look, since, tag,
                                                          stamp, resume, weights_state)) {
        finish(r, weights_state[r] == 1);
        deferred &= ~(1u << r);
      }
    }
  }
}

// Blocks first_block, first_block + num_blocks, ... of the receive: units of combine_recv_parts(T) slices per token.
template <typename TopkT>
__device__ void partial_recv_blocks(const LowLatencyPeers& peers, const LowLatencyLayout& layout, int set,
                                    const LowLatencyCombineLaunch& args, int64_t first_block, int64_t num_blocks) {
  __shared__ bool valid[kLowLatencyFlatMaxRanks];  // rank q's partial of the token counts (flat routing only)
  const int R = peers.num_ranks;
  const int64_t H = layout.hidden, E_local = layout.num_local_experts;
  const int K = args.num_topk;
  char* base = peers.bases[peers.rank];
  LowLatencyControl* ctrl = control_of(peers, layout);
  const uint64_t tag = ctrl->combine_seq[set] + 1;
  const LowLatencySet& c = layout.sets[set];
  const auto* topk = static_cast<const TopkT*>(args.topk);
  auto* out = static_cast<uint4*>(args.out);
  const int64_t row_vecs = H / 8;
  for_each_recv_unit(
      args.num_tokens, row_vecs, first_block, num_blocks,
      [&](int64_t t) {
        if (threadIdx.x >= R) return;
        const int q = threadIdx.x;
        bool chosen = false;
        for (int k = 0; k < K; ++k) {
          // NOTE: an id outside [0, num_experts) was sent to no expert by dispatch: as -1.
          const int64_t e = static_cast<int64_t>(topk[t * K + k]);
          chosen |= e >= 0 && e < layout.num_experts && e / E_local == q;
        }
        bool ok = false;
        uint64_t v = 0;
        if (chosen && ld_volatile_global(&ctrl->mask[q]) == 0 &&
            wait_tag(peers, ctrl, at<uint64_t>(base, c.combine_signals) + q, tag, kCombineIdBits, q, q,
                     kSiteLowLatencyCombineRecv, &v, args.wait_cost != nullptr ? args.wait_cost + q : nullptr)) {
          // Else its partial is left out (reported); kCombineNoRows: q wrote no row for this rank this call.
          ok = signal_counts(peers, v, args.dispatch_id, q, q);
        }
        valid[q] = ok;
      },
      [&](int64_t t, int64_t v) {
        const auto* rows = at<const uint4>(base, c.combine_data + t * kLowLatencyMaxTopk * H * 2);
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        sum_slots<4>(
            acc, R, [&](int q) { return valid[q]; }, [&](int q) { return __ldcg(rows + q * row_vecs + v); },
            [](float* a, int, uint4 raw) { add_bf16x8(a, raw); });
        out[t * row_vecs + v] = pack_bf16x8(acc);
      });
}

}  // namespace
}  // namespace epx::cuda
