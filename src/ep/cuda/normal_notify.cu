// Normal path: the epoch step and notify (every rank's counts to every rank, the receive layout).
// Protocol: docs/normal-kernels.md.
#include "core/cuda/cuda_util.h"
#include "ep/cuda/normal_device.cuh"

namespace epx::cuda {
namespace {

__global__ void advance_epoch_kernel(CommArgs comm, uint64_t handle_id, uint64_t shape_word) {
  auto* p = reinterpret_cast<volatile uint64_t*>(comm.peers[comm.rank] + comm.off_epoch);
  const uint64_t epoch = *p + 1;
  // NOTE: the slot of this parity at a peer was last read in operation epoch - 2, which the peer finished before it
  // released ours in epoch - 1 (our previous operation waited on that, notify's argument); the id lands before the
  // rows of this operation (their signals are released by later kernels or stream writes of this stream).
  const int R = comm.num_ranks, me = comm.rank;
  // Every peer's slot [parity][me], and this rank's own (its waits compare a peer's shape word with it).
  for (int d = static_cast<int>(threadIdx.x); d < R; d += blockDim.x) {
    uint64_t* words = sig(comm, d, comm.off_handle_id, kCallWords * (static_cast<int>(epoch & 1) * R + me));
    words[0] = handle_id;
    words[1] = shape_word;
    st_release_sys(words + 2, epoch);
  }
  __syncthreads();
  if (threadIdx.x == 0) *p = epoch;
}

// ---- notify: one block -----------------------------------------------------------------------

__global__ void __launch_bounds__(256)
    notify_kernel(CommArgs comm, const int32_t* chan_start, const int32_t* per_expert, int num_local_experts,
                  int expert_alignment, int64_t num_tokens, bool whole, unsigned early_mask, uint64_t shape_word,
                  int32_t* recv_meta, int32_t* recv_expert_counts, int32_t* rank_prefix_matrix) {
  __shared__ bool s_abort;
  const uint64_t epoch = read_epoch(comm);
  const int parity = static_cast<int>(epoch & 1);
  const int R = comm.num_ranks, C = comm.num_channels, me = comm.rank;
  // NOTE: slot [parity][me] at each destination was last read in operation epoch - 2, which every
  // destination finished before it released our rings in epoch - 1 (we waited on that), so it is free.
  // Whole x goes to r by the counts' rule, or because its copy started before notify (early_mask).
  auto sends_whole = [&](int r, int32_t n) {
    return ((early_mask >> r) & 1u) != 0 || whole_copy(n, num_tokens, whole);
  };
  int32_t max_rows = 0;  // staging rows at one remote destination
  for (int r = 0; r < R; ++r) {
    const int32_t n = chan_start[r * (C + 1) + C] - chan_start[r * (C + 1)];
    const int32_t need = sends_whole(r, n) ? static_cast<int32_t>(num_tokens) : n;
    if (r != me && need > max_rows) max_rows = need;
  }
  const int64_t ring_kib = comm.ring_bytes >> 10;
  // NOTE: the layout kernel ran before us on this stream; its record is in comm.error[1].
  const bool input_invalid = reinterpret_cast<volatile const ErrorRecord*>(comm.error)[1].code == kErrInvalidTopk;
  for (int r = 0; r < R; ++r) {
    int32_t* slot = reinterpret_cast<int32_t*>(comm.peers[r] + comm.off_notify) + (parity * R + me) * kNotifyInts;
    if (threadIdx.x == 0) {
      slot[0] = input_invalid ? -1 - max_rows : max_rows;  // sign bit: this rank's topk_idx was invalid
      slot[C + 2 + num_local_experts] = static_cast<int32_t>(ring_kib < 0x7fffffff ? ring_kib : 0x7fffffff);
      const int32_t n = chan_start[r * (C + 1) + C] - chan_start[r * (C + 1)];
      slot[C + 3 + num_local_experts] = sends_whole(r, n) ? static_cast<int32_t>(num_tokens) : 0;
      slot[C + 4 + num_local_experts + R] = static_cast<int32_t>((early_mask >> r) & 1u);
    }
    for (int i = threadIdx.x; i < C + 1; i += blockDim.x) slot[1 + i] = chan_start[r * (C + 1) + i];
    for (int d = threadIdx.x; d < R; d += blockDim.x) {
      slot[C + 4 + num_local_experts + d] = chan_start[d * (C + 1) + C] - chan_start[d * (C + 1)];
    }
    for (int j = threadIdx.x; j < num_local_experts; j += blockDim.x) {
      slot[C + 2 + j] = per_expert[r * num_local_experts + j];
    }
  }
  if (threadIdx.x == 0) s_abort = false;
  __syncthreads();
  if (threadIdx.x < R) {
    const int r = threadIdx.x;
    st_release_sys(sig(comm, r, comm.off_notify_flag, parity * R + me), epoch);
    // NOTE: no abort of the peers on a shape mismatch: each rank compares with every source, so each finds it; a peer
    // in another kind of call never posts its flag, and the wait finds its words instead (peer_in_other_call).
    if (!wait_geq(comm, sig(comm, me, comm.off_notify_flag, parity * R + r), epoch, kSiteNotify, r, -1) ||
        (r != me && !same_shape(comm, epoch, r, shape_word, kSiteNotify, -1))) {
      s_abort = true;
    }
  }
  __syncthreads();
  const RecvMetaLayout m{R, C, num_local_experts};
  if (s_abort) {
    // NOTE: without the host's wait for these counts (num_worst_tokens, capture) the data kernels still run, and their
    // waits give up only where they wait: an empty layout keeps the receivers from reading an unwritten one.
    for (int i = threadIdx.x; i < m.size(); i += blockDim.x) recv_meta[i] = i == m.failed_source() ? -1 : 0;
    for (int i = threadIdx.x; i < R * R; i += blockDim.x) rank_prefix_matrix[i] = 0;
    for (int j = threadIdx.x; j < num_local_experts; j += blockDim.x) recv_expert_counts[j] = 0;
    return;
  }
  const int32_t* mine = reinterpret_cast<const int32_t*>(comm.peers[me] + comm.off_notify) + parity * R * kNotifyInts;
  if (threadIdx.x == 0) {
    int32_t prefix = 0;
    for (int s = 0; s < R; ++s) {
      recv_meta[m.rank_prefix(s)] = prefix;
      prefix += mine[s * kNotifyInts + 1 + C];
    }
    recv_meta[m.num_recv()] = prefix;
    int32_t pair_rows = 0, ring = 0x7fffffff, failed = -1;
    for (int s = 0; s < R; ++s) {
      const int32_t rows = mine[s * kNotifyInts];
      if (rows < 0 && failed < 0) failed = s;
      pair_rows = max(pair_rows, rows < 0 ? -1 - rows : rows);
      ring = min(ring, mine[s * kNotifyInts + C + 2 + num_local_experts]);
    }
    recv_meta[m.max_pair_rows()] = pair_rows;
    recv_meta[m.min_ring_kib()] = ring;
    recv_meta[m.failed_source()] = failed;
    int32_t early = 0;
    for (int s = 0; s < R; ++s) early |= mine[s * kNotifyInts + C + 4 + num_local_experts + R] != 0 ? 1 << s : 0;
    recv_meta[m.early_sources()] = early;
  }
  for (int s = threadIdx.x; s < R; s += blockDim.x) {
    recv_meta[m.whole_tokens(s)] = mine[s * kNotifyInts + C + 3 + num_local_experts];
  }
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    recv_meta[m.send_count(r)] = chan_start[r * (C + 1) + C] - chan_start[r * (C + 1)];
  }
  for (int j = threadIdx.x; j < R; j += blockDim.x) {
    int32_t prefix = 0;
    for (int i = 0; i < R; ++i) {
      prefix += mine[i * kNotifyInts + C + 4 + num_local_experts + j];
      rank_prefix_matrix[i * R + j] = prefix;
    }
  }
  for (int i = threadIdx.x; i < R * (C + 1); i += blockDim.x) {
    const int s = i / (C + 1), c = i % (C + 1);
    recv_meta[m.chan_start(s, c)] = mine[s * kNotifyInts + 1 + c];
  }
  for (int j = threadIdx.x; j < num_local_experts; j += blockDim.x) {
    int32_t sum = 0;
    for (int s = 0; s < R; ++s) sum += mine[s * kNotifyInts + C + 2 + j];
    sum = (sum + expert_alignment - 1) / expert_alignment * expert_alignment;
    recv_meta[m.expert_count(j)] = sum;
    recv_expert_counts[j] = sum;
  }
}

}  // namespace

cudaError_t preload_notify_kernels() {
  return preload_kernels(
      {reinterpret_cast<const void*>(&advance_epoch_kernel), reinterpret_cast<const void*>(&notify_kernel)});
}

void launch_advance_epoch(const CommArgs& comm, uint64_t handle_id, uint64_t shape_word, cudaStream_t stream) {
  advance_epoch_kernel<<<1, 32, 0, stream>>>(comm, handle_id, shape_word);
}

void launch_notify(const CommArgs& comm, const int32_t* chan_start, const int32_t* num_tokens_per_expert,
                   int num_local_experts, int expert_alignment, int64_t num_tokens, bool whole, unsigned early_mask,
                   uint64_t shape_word, int32_t* recv_meta, int32_t* recv_expert_counts, int32_t* rank_prefix_matrix,
                   cudaStream_t stream) {
  notify_kernel<<<1, 256, 0, stream>>>(comm, chan_start, num_tokens_per_expert, num_local_experts, expert_alignment,
                                       num_tokens, whole, early_mask, shape_word, recv_meta, recv_expert_counts,
                                       rank_prefix_matrix);
}

}  // namespace epx::cuda
