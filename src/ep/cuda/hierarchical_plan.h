// The plan of a hierarchical normal call (hierarchical_engine.cpp): the routes a fresh dispatch records, the header
// every rank publishes at the start of a call, the checks every rank runs on the headers, and the sizes of both
// legs. Host only; private to the CUDA backend.
#pragma once

#include <cstdint>
#include <exception>
#include <vector>

#include "core/limits.h"
#include "ep/cuda/hierarchical_kernels.h"
#include "epx/buffer.h"

namespace epx::cuda {

// The routes of one fresh dispatch, shared by the handles of its cached dispatches. P = per_rank, Q = per_node.
struct HierarchicalRoutes {
  uint64_t id = 0;  // HierarchicalEngine::call_seq_ of the fresh dispatch: the same on every rank
  int64_t num_tokens = 0;
  int64_t num_recv = 0;
  int64_t num_experts = 0;
  std::vector<int32_t> per_rank;            // [R, R]: tokens rank s sends to rank d
  std::vector<int32_t> per_node;            // [R, N]: records rank s sends to node n
  std::vector<int32_t> expert_counts_host;  // [E_local], rounded to the fresh dispatch's alignment
  Tensor is_token_in_rank;                  // bool [T, R]: the records' local-rank masks
  Tensor node_slot;                         // int32 [T, N]
  Tensor node_tok;                          // int32 [N, T]
  Tensor fwd_pos;             // int32 [G, M]: as forwarder, each received record's position per local rank
  Tensor rank_prefix;         // int32 [R, R]
  Tensor recv_expert_counts;  // int32 [E_local]
};

enum CallKind : int32_t { kFreshDispatch = 1, kCachedDispatch = 2, kCombine = 3 };

// What every rank publishes at the start of a call (all_gather_bytes), so that every rank checks every peer.
struct Header {
  int32_t failed = 0;  // this rank's local checks threw (its own error says why)
  int32_t kind = 0;
  int32_t x_dtype = 0, scales_dtype = 0, topk_dtype = 0;
  int32_t num_topk = 0, has_weights = 0;
  int32_t invalid_topk = 0;  // fresh: the layout kernel found an entry outside [-1, num_experts)
  int64_t hidden = 0, num_experts = 0;
  uint64_t handle_id = 0;
  int32_t per_rank[kHierarchicalMaxRanks] = {};  // fresh: num_tokens_per_rank
  int32_t per_node[kHierarchicalMaxRanks] = {};  // fresh: num_tokens_per_node
};

// The sizes of both legs, from the routes (the same numbers on every rank). Record counts.
struct Legs {
  std::vector<int> net_peers, node_peers;   // (n, l) for every n; (node, g) for every g
  std::vector<int64_t> net_send, net_recv;  // [N]: records to node n's forwarder / from source node m
  std::vector<int64_t> fwd_send, fwd_recv;  // [G]: records forwarded to local rank g / from forwarder l
  hier::Parts net_msgs, relay_msgs, fwd_msgs, blocks;
  int64_t row_base[hier::kMaxParts] = {};  // blocks (l, m): first output row
  int64_t num_relay = 0;

  Legs(const HierarchicalRoutes& r, const Topology& topo, int rank);
  static hier::Parts parts(const std::vector<int64_t>& counts);
  static std::vector<int64_t> bytes(const std::vector<int64_t>& records, int64_t record_bytes);
};

// Every rank runs the same checks on the same headers, so they raise alike: a rank whose local checks failed
// rethrows its own error (local_error), its peers raise kPeerFailure; arguments that differ raise kInvalidArgument
// on every rank. `call` names the call in messages.
void check_headers(const std::vector<Header>& all, const Header& mine, int rank, const char* call,
                   const std::exception_ptr& local_error);

}  // namespace epx::cuda
