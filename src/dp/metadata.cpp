// The per-step batch-metadata sync of DP attention: one all-gather of a fixed record (the 11 fields and a status word).
#include <algorithm>
#include <array>
#include <chrono>
#include <string>
#include <vector>

#include "core/check.h"
#include "dp/backends.h"
#include "epx/dp.h"
#include "comm/host/host_group.h"

namespace epx {

namespace {

// The wire record: kBatchMetadataFields fields, then the sender's status word: its rejected DP calls that joined their
// peers' collective since its previous sync (cuda: dp_take_joined_failures_cuda; the peers' outputs lacked its rows),
// and kSyncFailedBit when it could not make this sync (fail()).
constexpr size_t kWireWords = kBatchMetadataFields + 1;
constexpr size_t kStatusWord = kBatchMetadataFields;
constexpr int64_t kSyncFailedBit = int64_t{1} << 62;
using Packed = std::array<int64_t, kWireWords>;

constexpr int64_t kMaxForwardMode = static_cast<int64_t>(ForwardMode::kPrebuilt);

void check_record(const BatchMetadata& m, const char* where) {
  EPX_CHECK_ARG(m.num_tokens >= 0, "{}: num_tokens must be >= 0, got {}", where, m.num_tokens);
  EPX_CHECK_ARG(m.num_tokens_for_logprob >= 0, "{}: num_tokens_for_logprob must be >= 0, got {}", where,
                m.num_tokens_for_logprob);
  EPX_CHECK_ARG(static_cast<int64_t>(m.forward_mode) <= kMaxForwardMode, "{}: forward_mode {} is not a ForwardMode",
                where, static_cast<int>(m.forward_mode));
  EPX_CHECK_ARG(m.forward_mode != ForwardMode::kIdle || m.num_tokens == 0,
                "{}: an IDLE record must have num_tokens 0, got {}", where, m.num_tokens);
  // NOTE: SGLang sends 0 tokens for a PREBUILT batch: it runs no forward pass this step.
  EPX_CHECK_ARG(m.forward_mode != ForwardMode::kPrebuilt || (m.num_tokens == 0 && m.num_tokens_for_logprob == 0),
                "{}: a PREBUILT record must have num_tokens and num_tokens_for_logprob 0, got {} and {}", where,
                m.num_tokens, m.num_tokens_for_logprob);
  EPX_CHECK_ARG(m.prefill_graph_max_prefix_len >= 0, "{}: prefill_graph_max_prefix_len must be >= 0, got {}", where,
                m.prefill_graph_max_prefix_len);
  EPX_CHECK_ARG(m.attention_pairs >= 0, "{}: attention_pairs must be >= 0, got {}", where, m.attention_pairs);
}

// NOTE: the field order is the wire format; the CUDA path copies the gathered block to the host as is.
Packed pack(const BatchMetadata& m) {
  return {m.num_tokens,
          m.num_tokens_for_logprob,
          m.can_run_decode_graph,
          m.is_extend_in_batch,
          m.can_run_tbo,
          static_cast<int64_t>(m.forward_mode),
          m.can_run_prefill_graph,
          m.prefill_graph_max_prefix_len,
          m.can_run_draft_graph,
          m.is_health_check,
          m.attention_pairs,
          0};
}

// This rank's status word (kStatusWord); takes the count of its joined failures (sent once).
int64_t take_status_word(Group& group) {
#ifdef EPX_WITH_CUDA
  if (group.backend() == Backend::kCuda) return cuda::dp_take_joined_failures_cuda(group);
#endif
  (void)group;
  return 0;  // the host backend's peers learn of a rejected call in that call
}

BatchMetadata unpack(const Packed& p, int dp_rank) {
  BatchMetadata m;
  m.num_tokens = p[0];
  m.num_tokens_for_logprob = p[1];
  m.can_run_decode_graph = p[2] != 0;
  m.is_extend_in_batch = p[3] != 0;
  m.can_run_tbo = p[4] != 0;
  EPX_CHECK(ErrorCode::kInternal, p[5] >= 0 && p[5] <= kMaxForwardMode, "DP rank {} sent forward_mode {}", dp_rank,
            p[5]);
  m.forward_mode = static_cast<ForwardMode>(p[5]);
  m.can_run_prefill_graph = p[6] != 0;
  m.prefill_graph_max_prefix_len = p[7];
  m.can_run_draft_graph = p[8] != 0;
  m.is_health_check = p[9] != 0;
  m.attention_pairs = p[10];
  return m;
}

// Words of one published slot of the host exchange that leaves inactive ranks out: the record, then the
// inactive-rank mask, one bit per rank.
size_t host_slot_words(int num_ranks) { return kWireWords + (static_cast<size_t>(num_ranks) + 63) / 64; }

// The all-gather of the host backend without the inactive ranks: they are skipped (not waited for), so a
// dead rank costs nothing; the live ones wait for each other with the group's usual bounded wait.
// Their slots of `gathered` are left as they are. Every participant must name the same inactive ranks:
// a mismatch raises kInvalidArgument on every rank that sees it (a rank that waits for a rank another
// left out times out as any collective does).
// NOTE: what this rank publishes is a copy the group owns (HostGroup::publish_copy), not memory of the caller:
// with mismatched lists a peer this rank skips may still read it after this rank's release() returned (release
// only waits for the ranks it does not skip), and by then the caller's sync object may be gone (ASan found that
// in CI when the slots belonged to the sync object).
void host_gather_records(Group& group, const Packed& mine, const std::vector<bool>& inactive,
                         std::vector<Packed>& gathered) {
  auto* host_group = dynamic_cast<host::HostGroup*>(&group);
  EPX_CHECK(ErrorCode::kInternal, host_group != nullptr, "a group with the host backend is not a HostGroup");
  const int num_ranks = group.num_ranks();
  const size_t words = host_slot_words(num_ranks);
  std::vector<int64_t> slot(words, 0);
  std::copy(mine.begin(), mine.end(), slot.begin());
  for (int r = 0; r < num_ranks; ++r) {
    if (inactive[r]) slot[kWireWords + r / 64] |= int64_t{1} << (r % 64);
  }
  const auto ptrs = host_group->exchange(host_group->publish_copy(slot.data(), words * sizeof(int64_t)), &inactive);
  std::string mismatch;
  for (int r = 0; r < num_ranks; ++r) {
    if (inactive[r]) continue;
    const auto* theirs = static_cast<const int64_t*>(ptrs[r]);
    if (mismatch.empty() && !std::equal(slot.begin() + kWireWords, slot.end(), theirs + kWireWords)) {
      mismatch = fmt::format("rank {} named other inactive ranks than rank {}", r, group.rank());
    }
    std::copy(theirs, theirs + kWireWords, gathered[r].begin());
  }
  // NOTE: release before raising, so no peer waits on a rank that left.
  host_group->release(&inactive);
  EPX_CHECK_ARG(mismatch.empty(), "BatchMetadataSync::sync: {}", mismatch);
}

// Raises kPeerFailure for a peer whose status word says it could not make this sync or rejected dp_gather /
// dp_scatter calls since its previous sync that joined this rank's collectives (cuda backend).
void check_peer_status(const Group& group, const std::vector<int64_t>& status, const std::vector<bool>& inactive) {
  std::string failed;
  for (int r = 0; r < group.num_ranks(); ++r) {
    if (r == group.rank() || inactive[r]) continue;
    const int64_t word = status[r];
    if ((word & kSyncFailedBit) != 0) {
      failed += fmt::format("{}rank {} could not make this sync", failed.empty() ? "" : "; ", r);
    }
    const int64_t joined = word & ~kSyncFailedBit;
    if (joined > 0) {
      failed += fmt::format(
          "{}rank {} rejected {} dp_gather / dp_scatter call(s) since its previous sync (it raised; "
          "this rank's outputs of those calls lack its rows)",
          failed.empty() ? "" : "; ", r, joined);
    }
  }
  EPX_CHECK(ErrorCode::kPeerFailure, failed.empty(), "BatchMetadataSync::sync on rank {}: {}", group.rank(), failed);
}

}  // namespace

GlobalBatchInfo reduce_batch_metadata(std::span<const BatchMetadata> records) {
  EPX_CHECK_ARG(!records.empty(), "reduce_batch_metadata: records must hold at least one DP rank");
  GlobalBatchInfo g;
  bool all_vote_tbo = true;
  std::optional<ForwardMode> common;
  bool agree = true;
  for (size_t d = 0; d < records.size(); ++d) {
    const BatchMetadata& m = records[d];
    check_record(m, "reduce_batch_metadata");
    g.num_tokens.push_back(m.num_tokens);
    g.num_tokens_for_logprob.push_back(m.num_tokens_for_logprob);
    g.attention_pairs.push_back(m.attention_pairs);
    g.can_run_decode_graph = g.can_run_decode_graph && m.can_run_decode_graph;
    g.can_run_prefill_graph = g.can_run_prefill_graph && m.can_run_prefill_graph;
    g.can_run_draft_graph = g.can_run_draft_graph && m.can_run_draft_graph;
    g.is_extend_in_batch = g.is_extend_in_batch || m.is_extend_in_batch;
    g.is_health_check = g.is_health_check || m.is_health_check;
    g.prefill_graph_max_prefix_len = std::max(g.prefill_graph_max_prefix_len, m.prefill_graph_max_prefix_len);
    all_vote_tbo = all_vote_tbo && m.can_run_tbo;
    g.any_tokens = g.any_tokens || m.num_tokens > 0;
    if (m.forward_mode == ForwardMode::kIdle) continue;
    if (!common) {
      common = m.forward_mode;
    } else if (*common != m.forward_mode) {
      agree = false;
    }
  }
  if (!common) {
    g.forward_mode = ForwardMode::kIdle;  // every rank idle: nothing to overlap
    g.can_run_tbo = false;
  } else {
    g.forward_mode = agree ? common : std::nullopt;
    g.can_run_tbo = all_vote_tbo && agree;
  }
  return g;
}

BatchMetadataSync::BatchMetadataSync(Group& group, const ParallelLayout& layout) : group_(group), layout_(layout) {
  EPX_CHECK_ARG(layout.world_size() == group.num_ranks(),
                "BatchMetadataSync: layout.world_size() {} must equal group.num_ranks() {}", layout.world_size(),
                group.num_ranks());
}

BatchSyncResult BatchMetadataSync::sync(const std::optional<BatchMetadata>& local) { return sync(local, {}); }

BatchSyncResult BatchMetadataSync::sync(const std::optional<BatchMetadata>& local,
                                        std::span<const int> inactive_ranks) {
  const BatchMetadata mine = local.value_or(BatchMetadata::idle());
  check_record(mine, "BatchMetadataSync::sync");
  const int num_ranks = group_.num_ranks();
  std::vector<bool> inactive(static_cast<size_t>(num_ranks), false);
  for (const int r : inactive_ranks) {
    EPX_CHECK_ARG(r >= 0 && r < num_ranks, "BatchMetadataSync::sync: inactive rank {} is not in [0, {})", r, num_ranks);
    EPX_CHECK_ARG(r != group_.rank(),
                  "BatchMetadataSync::sync: rank {} names itself inactive; an inactive rank does "
                  "not call",
                  r);
    inactive[r] = true;
  }
  if (!inactive_ranks.empty() && group_.backend() != Backend::kHost) {
    detail::raise(ErrorCode::kUnsupported,
                  "BatchMetadataSync::sync: inactive ranks need a transport that can leave ranks out; the {} "
                  "backend's all-gather (NCCL) needs every rank",
                  to_string(group_.backend()));
  }
  BatchSyncResult result;
  const int num_dp = layout_.attn_dp_size();
  if (num_dp == 1) {
    // One DP rank: its attention-TP/CP ranks hold the same batch, so there is nothing to agree on.
    result.global = reduce_batch_metadata(std::span<const BatchMetadata>(&mine, 1));
  } else {
    Packed packed = pack(mine);
    packed[kStatusWord] = take_status_word(group_);
    std::vector<Packed> gathered(static_cast<size_t>(num_ranks));
    const auto start = std::chrono::steady_clock::now();
    if (!inactive_ranks.empty()) {
      host_gather_records(group_, packed, inactive, gathered);
    } else {
#ifdef EPX_WITH_CUDA
      if (group_.backend() == Backend::kCuda) {
        cuda::dp_all_gather_records_cuda(group_, packed.data(), gathered.data(), sizeof(Packed));
      } else {
        group_.all_gather_bytes(packed.data(), gathered.data(), sizeof(Packed));
      }
#else
      group_.all_gather_bytes(packed.data(), gathered.data(), sizeof(Packed));
#endif
    }
    result.step_wait_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::vector<int64_t> status(static_cast<size_t>(num_ranks));
    for (int r = 0; r < num_ranks; ++r) status[r] = gathered[r][kStatusWord];
    check_peer_status(group_, status, inactive);
    std::vector<BatchMetadata> records;
    records.reserve(num_dp);
    for (int d = 0; d < num_dp; ++d) {
      // NOTE: as SGLang, a DP rank whose leader is inactive counts as the fallback (idle) record.
      const int leader = layout_.dp_leader(d);
      records.push_back(inactive[leader] ? BatchMetadata::idle() : unpack(gathered[leader], d));
    }
    result.global = reduce_batch_metadata(records);
  }
  // A PREBUILT batch runs no forward pass: like an idle rank, it joins the step with an idle batch.
  const bool has_batch =
      local.has_value() && mine.forward_mode != ForwardMode::kIdle && mine.forward_mode != ForwardMode::kPrebuilt;
  result.run_idle_batch = !has_batch && result.global.any_tokens;
  result.runs_batch = has_batch || result.run_idle_batch;
  if (result.runs_batch) {
    result.wait_s = carried_wait_s_ + result.step_wait_s;
    carried_wait_s_ = 0.0;
  } else {
    carried_wait_s_ += result.step_wait_s;
  }
  return result;
}

void BatchMetadataSync::fail(const std::string& reason, std::span<const int> inactive_ranks) noexcept {
  if (layout_.attn_dp_size() == 1) return;
  auto* host_group = dynamic_cast<host::HostGroup*>(&group_);
  if (host_group == nullptr) {
#ifdef EPX_WITH_CUDA
    // The NCCL all-gather has no error flag: an idle record whose status word says this rank failed, so every peer's
    // sync raises kPeerFailure naming it (check_peer_status) instead of going on without its batch.
    if (group_.backend() == Backend::kCuda) {
      try {
        Packed packed = pack(BatchMetadata::idle());
        packed[kStatusWord] = take_status_word(group_) | kSyncFailedBit;
        std::vector<Packed> gathered(static_cast<size_t>(group_.num_ranks()));
        cuda::dp_all_gather_records_cuda(group_, packed.data(), gathered.data(), sizeof(Packed));
      } catch (...) {  // a timeout or a failed communicator: the peers' sync fails on its own
      }
    }
#endif
    return;
  }
  try {
    const int num_ranks = group_.num_ranks();
    std::vector<bool> inactive(static_cast<size_t>(num_ranks), false);
    for (const int r : inactive_ranks) {
      if (r >= 0 && r < num_ranks && r != group_.rank()) inactive[r] = true;
    }
    host_group->fail(fmt::format("BatchMetadataSync::sync: {}", reason), &inactive);
  } catch (...) {  // out of memory for the mask: peers still learn that this rank failed
    host_group->fail("BatchMetadataSync::sync failed on this rank");
  }
}

}  // namespace epx
