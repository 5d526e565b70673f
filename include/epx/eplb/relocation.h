// Weight relocation: moving expert weights between GPUs (ranks) so that each physical slot holds what a
// new placement says, while serving.
//
// Plan, then run: plan_relocation() is pure host work on two phy2log rows of one layer; relocate_weights()
// executes a plan on one rank over a WeightTransport: host threads, CUDA copy engines between the GPUs of one
// host, or NCCL send/recv between processes on any hosts (make_transport_for picks one; docs/eplb.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "epx/group.h"

namespace epx::eplb {

// How a destination slot gets its weights.
enum class SlotAction : uint8_t {
  kUnchanged,      // the slot (same rank, same local index) already holds the expert
  kLocalCopy,      // copy from another old slot of the same rank
  kSameRoundCopy,  // copy from a slot of the same rank that receives the same expert in this relocation
  kPeerIntraNode,  // receive from a rank of the same node
  kPeerInterNode,  // receive from a rank of another node
  kLost,           // every old replica of the expert sat on a failed rank: the caller must reload it
  kDeadRank,       // the destination rank itself failed: nothing is done for it
};
const char* to_string(SlotAction action) noexcept;

struct SlotPlan {
  SlotAction action = SlotAction::kUnchanged;
  int32_t expert = -1;    // logical expert the slot must hold
  int32_t src_rank = -1;  // rank read from (kLocalCopy / kSameRoundCopy: the destination's own rank)
  int32_t src_slot = -1;  // local slot index on src_rank: an old slot, or for kSameRoundCopy a new slot
};

struct RelocationPlan {
  int num_ranks = 0;
  int num_nodes = 0;
  int old_slots_per_rank = 0;
  int new_slots_per_rank = 0;
  std::vector<SlotPlan> slots;        // [num_ranks * new_slots_per_rank], by destination slot
  std::vector<int32_t> lost_experts;  // ascending, each once

  int64_t count(SlotAction action) const;
  // Destination slots whose weights cross ranks (kPeerIntraNode + kPeerInterNode).
  int64_t num_transfers() const { return count(SlotAction::kPeerIntraNode) + count(SlotAction::kPeerInterNode); }
};

// Plans one layer. old_phy2log: [num_ranks * old_slots_per_rank], new_phy2log: [num_ranks * new_slots_per_rank]
// (slot counts may differ, e.g. 256 -> 288 experts on 32 ranks). failed_ranks: empty or [num_ranks].
// Sources are spread: among the live ranks holding the expert (same node first, then any node), the one
// with the fewest sends so far (then the lowest rank and slot) sends.
// Throws Error(kInvalidArgument) for sizes not divisible by num_ranks, num_ranks % num_nodes != 0, negative
// ids, or failed_ranks of the wrong size.
RelocationPlan plan_relocation(std::span<const int32_t> old_phy2log, std::span<const int32_t> new_phy2log,
                               int num_ranks, int num_nodes, const std::vector<bool>& failed_ranks = {});

// One point-to-point message of a transport round.
struct SendOp {
  int peer;
  const void* data;
  size_t bytes;
};
struct RecvOp {
  int peer;
  void* data;
  size_t bytes;
};

// Moves bytes between ranks. Memory lives wherever the transport says (host memory for the host
// transport, device memory for a CUDA one).
class WeightTransport {
 public:
  virtual ~WeightTransport() = default;
  virtual int rank() const = 0;
  virtual int num_ranks() const = 0;
  // Collective over the live ranks: each calls it the same number of times. Messages between two ranks
  // match in order (the i-th send from a to b lands in b's i-th receive from a, sizes equal), as NCCL
  // send/recv inside one group call. Returns when this rank's receives are complete and every peer has
  // finished reading this rank's send buffers. Throws Error(kTimeout) / kInternal on a peer failure or
  // mismatched messages.
  virtual void exchange(std::span<const SendOp> sends, std::span<const RecvOp> recvs) = 0;
  // A local copy (may overlap neither way).
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void* allocate_temp(size_t bytes) = 0;
  virtual void free_temp(void* ptr) noexcept = 0;
};

// The host transport: ranks are threads (create_host_groups); group must be a host Group. failed_ranks
// (empty or [num_ranks]) are neither waited for nor read from. The transport keeps a reference to group.
std::unique_ptr<WeightTransport> make_host_transport(Group& group, std::vector<bool> failed_ranks = {});

// The CUDA transport: ranks of a cuda Group on one host whose GPUs have peer access (create_cuda_groups or
// one process per GPU). Buffers are device memory of the rank's GPU. Each rank holds a staging region of
// staging_bytes that its peers map; senders push with copy-engine copies (no SMs) and receivers copy out of
// the staging, a round larger than it moving in several passes (so staging_bytes bounds the extra memory,
// not the round). Collective (all ranks create it together). Throws Error(kInvalidArgument) for a group of
// another backend or staging_bytes 0, kOutOfMemory on every rank when one rank cannot allocate the staging,
// kUnsupported without a CUDA backend or between GPUs without peer access (e.g. on different hosts).
std::unique_ptr<WeightTransport> make_cuda_transport(Group& group, size_t staging_bytes = size_t{64} << 20);

// The NCCL transport: ranks of a cuda Group of one process per GPU (create_cuda_group: its NCCL communicator), on
// one host or several. Buffers are device memory of the rank's GPU; no staging (NCCL moves between any device
// buffers). exchange(): one all-gather of every rank's per-peer byte totals and message-size sequences (a
// mismatch raises the same Error(kInternal) on every rank before any data moves), then one ncclGroupStart /
// ncclSend per SendOp, ncclRecv per RecvOp in order / ncclGroupEnd on the transport's own stream (a rank's
// messages to itself are device-to-device copies, in order), and a wait on that stream polled with
// ncclCommGetAsyncError against group.timeout_ms(). NCCL runs the transfer with a few SMs (copy engines do not:
// the CUDA transport leaves every SM to serving). No other thread may issue NCCL calls on the group's
// communicator during exchange (NCCL's rule for one communicator). Throws Error(kTimeout) when the transfer
// did not finish within the timeout and kPeerFailure when NCCL reports an error: the communicator may then still
// run the transfer and must be aborted (destroy the group, which aborts a communicator it created; ncclCommAbort
// one passed to create_cuda_group(comm)) before the weight buffers are freed, and this transport's free_temp
// leaks from then on (cudaFree would wait for the transfer). A communicator passed in as blocking may block in
// ncclGroupEnd while NCCL connects to a new peer; epx's own are non-blocking, so every wait is bounded.
// The transport keeps a reference to group. Throws Error(kInvalidArgument) naming the group for a group of
// another backend or one without a communicator (ranks as threads: create_cuda_groups), kUnsupported without a
// CUDA backend.
std::unique_ptr<WeightTransport> make_nccl_transport(Group& group);

// Which transport make_transport_for builds.
enum class TransportKind : uint8_t { kAuto, kHost, kCuda, kNccl };
const char* to_string(TransportKind kind) noexcept;
// "auto", "host", "cuda" or "nccl"; throws Error(kInvalidArgument) otherwise.
TransportKind transport_kind_from_string(const std::string& name);

// What kAuto means for `group`:
//   host group                                     -> kHost
//   cuda group, ranks as threads (create_cuda_groups) -> kCuda (copy engines; the only cuda choice there)
//   cuda group, one process per GPU                -> kCuda when every rank is on the same host (hostname and boot
//                                                     id) and its GPU has peer access to every other rank's GPU
//                                                     (as this process sees them: a peer's GPU hidden by
//                                                     CUDA_VISIBLE_DEVICES counts as no access), else kNccl.
// Copy engines first because they leave the SMs to serving; NCCL where peer access is missing (other hosts).
// Collective for a group of one process per GPU (two all-gathers; every rank gets the same answer); local
// otherwise. Throws as the group's all-gather does.
TransportKind choose_transport(Group& group);

// make_host_transport(group), make_cuda_transport(group, staging_bytes) or make_nccl_transport(group) for `kind`,
// kAuto as choose_transport(group) says (collective then). staging_bytes is used by kCuda only. Throws as the
// chosen factory does; kHost for a cuda group, or kCuda / kNccl for a host group, is kInvalidArgument.
std::unique_ptr<WeightTransport> make_transport_for(Group& group, TransportKind kind = TransportKind::kAuto,
                                                    size_t staging_bytes = size_t{64} << 20);

// This rank's expert weights: one entry per weight tensor (e.g. w13, w2, scales).
struct ExpertWeights {
  std::vector<const void*> old_slots;  // per tensor: [old_slots_per_rank, bytes_per_slot]
  std::vector<void*> new_slots;        // per tensor: [new_slots_per_rank, bytes_per_slot]
  std::vector<size_t> bytes_per_slot;  // per tensor
};

struct RelocationOptions {
  // Receives per round per rank (bounds the temporary buffers). In-place relocation (old_slots ==
  // new_slots for every tensor) stages every changed slot in one round and ignores this.
  int max_slots_per_round = 8;
};

struct RelocationStats {
  int num_rounds = 0;
  int64_t slots_received = 0;
  int64_t slots_sent = 0;
  int64_t local_copies = 0;  // kLocalCopy + kSameRoundCopy (+ kUnchanged when old and new buffers differ)
  int64_t bytes_received = 0;
  int64_t bytes_sent = 0;
};

// Executes `plan` for transport.rank(); every live rank calls it with the same plan. The cuda and NCCL transports
// copy on streams of their own: the work that wrote the buffers (old and new) must be finished when it is called
// (synchronize those streams first); the new slots are in place when it returns. Old buffers must not
// be modified until it returns. Buffers are either disjoint or identical (in place, which needs equal
// slot counts). Slots marked kLost are left untouched. Throws Error(kInvalidArgument) for a plan/transport
// rank mismatch, mismatched tensor lists, null buffers, partial overlap or max_slots_per_round < 1.
RelocationStats relocate_weights(const RelocationPlan& plan, const ExpertWeights& weights, WeightTransport& transport,
                                 const RelocationOptions& options = {});

}  // namespace epx::eplb
