// Host backend, normal mode (private): what the flat routing (host_buffer.cpp) and the hierarchical routing
// (host_hierarchical.cpp, docs/internode.md) share: the routes a handle records, what ranks publish, and the
// checks and bookkeeping both run, so that the two give the same rows, metadata and errors.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <vector>

#include "core/bf16.h"
#include "ep/validate.h"
#include "epx/buffer.h"
#include "epx/routing.h"
#include "comm/host/host_group.h"

namespace epx::host {

class HostBuffer;

// The routes of one fresh dispatch, shared by the handles of the cached dispatches that reuse them.
struct Routes {
  int64_t num_tokens = 0;  // T on this rank
  int64_t num_recv = 0;    // rows received (exact)
  int64_t num_experts = 0;
  uint64_t dispatch_id = 0;                  // HostGroup::seq() of the fresh dispatch: the same on every rank
  std::vector<uint8_t> is_token_in_rank;     // [T, R]
  std::vector<int32_t> num_tokens_per_rank;  // [R]
  std::vector<int32_t> send_row;             // [T, R]: the token's row on each destination, -1 if not sent
  std::vector<int32_t> recv_per_expert;      // [E_local], rounded up to the fresh dispatch's alignment
  Tensor rank_prefix_matrix;                 // int32 [R, R]: tokens ranks 0..i send to rank j
  // Hierarchical routing only. N nodes of G ranks; this rank is (node n, local rank l).
  std::vector<int32_t> node_slot;  // [T, N]: the token's record in this rank's message to each node, -1 if none
  // As the forwarder of node n for local index l: [source node m] -> [records of rank (m, l)'s message to n, G]:
  // the row each record landed in on local rank g of node n, -1 if it was not forwarded there.
  std::vector<std::vector<int32_t>> forward_rows;
};

class HostDispatchHandle final : public DispatchHandle {
 public:
  HostDispatchHandle(const HostBuffer* owner, std::shared_ptr<const Routes> routes, int64_t num_rows)
      : owner(owner), routes(std::move(routes)), num_rows(num_rows) {}
  int64_t num_tokens() const override { return routes->num_tokens; }
  int64_t num_recv_tokens() const override { return routes->num_recv; }
  const Tensor& rank_prefix_matrix() const override { return routes->rank_prefix_matrix; }

  const HostBuffer* owner;
  std::shared_ptr<const Routes> routes;
  int64_t num_rows;  // rows of the outputs: num_recv, or num_worst_tokens
};

// Hierarchical routing, network leg: one rank's tokens for one destination node, by ascending token index.
// Self-contained (contiguous rows and scales), as it would travel over the network.
struct NodeMessage {
  int64_t num_records = 0;
  std::vector<int32_t> src_idx;     // [n]: the token's index on its rank
  std::vector<uint8_t> in_rank;     // [n, G]: 1 where the token goes to local rank g of the node
  std::vector<uint8_t> x;           // [n, row bytes]
  std::vector<uint8_t> scales;      // [n, scale row bytes]; fp8 only
  std::vector<int64_t> topk_idx;    // [n, K]: global expert ids; fresh mode only
  std::vector<float> topk_weights;  // [n, K]; fresh mode with weights only
};

// What a rank publishes for a normal dispatch. Read-only for peers between exchange and release.
struct DispatchPost {
  ep::DispatchShape shape;
  DType x_dtype = DType::kBFloat16;
  DType scales_dtype = DType::kFloat32;
  const uint8_t* x = nullptr;
  const uint8_t* scales = nullptr;
  int64_t scale_strides[2] = {0, 0};  // in elements (any strides)
  TensorView topk_idx;
  const float* topk_weights = nullptr;
  bool has_weights = false;  // the pointer alone is null for T = 0
  int64_t num_experts = 0;
  uint64_t dispatch_id = 0;                        // cached mode: Routes::dispatch_id of the handle
  const uint8_t* is_token_in_rank = nullptr;       // [T, R]
  const int32_t* num_tokens_per_rank = nullptr;    // [R]
  const int32_t* num_tokens_per_expert = nullptr;  // [num_experts]; fresh mode only
  const NodeMessage* node_messages = nullptr;      // [N]; hierarchical routing only
};

struct CombinePost {
  uint64_t dispatch_id = 0;     // Routes::dispatch_id of the handle: every rank must reverse the same dispatch
  int64_t num_rows = 0;         // rows of x
  const uint16_t* x = nullptr;  // [rows, H]
  int64_t hidden = 0;
  const float* topk_weights = nullptr;  // [rows, K]
  bool has_weights = false;
  int64_t num_topk = 0;
};

// Runs body() between exchange and release; release happens even when body throws, so the peers
// are not left waiting. Errors are rethrown after the release.
template <typename Body>
void with_release(HostGroup& group, Body&& body) {
  std::exception_ptr error;
  try {
    body();
  } catch (...) {
    error = std::current_exception();
  }
  group.release();
  if (error) std::rethrow_exception(error);
}

// Runs prepare(), the work of a collective call before its rendezvous (validation). If it throws, this
// rank still takes part in the rendezvous with an error flag (HostGroup::fail), so that every peer
// raises Error(kPeerFailure) at once instead of timing out, and the ranks stay in step.
template <typename Prepare>
void prepare_or_fail(HostGroup& group, Prepare&& prepare) {
  try {
    prepare();
  } catch (const std::exception& e) {
    group.fail(e.what());
    throw;
  } catch (...) {
    group.fail("unknown error");
    throw;
  }
}

inline int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// Raises kPeerFailure if a peer's pointer is missing (it made a different sequence of collective calls).
void check_peers_present(const std::vector<const void*>& ptrs, int rank, const char* what);

// Checks that every peer's dispatch arguments agree with this rank's (`mine`; `cached`: the handle's routes in
// cached mode, else null). Every rank compares every peer, so a mismatch is raised on all ranks alike. Returns
// the rows this rank receives.
int64_t check_dispatch_posts(const std::vector<const DispatchPost*>& peers, const DispatchPost& mine,
                             const Routes* cached, DType topk_dtype, int rank);

// kInvalidArgument unless a worst-token dispatch has room for the num_recv rows rank `rank` receives.
void check_worst_tokens(int64_t num_worst_tokens, int64_t num_recv, int rank);

// The routes of a fresh dispatch from the peers' posts: counts, rank prefix matrix, per-expert counts
// (rounded up to expert_alignment) and each of this rank's tokens' row on every destination.
std::shared_ptr<Routes> make_routes(const std::vector<const DispatchPost*>& peers, const HostLayout& layout,
                                    int64_t num_tokens, int64_t num_recv, int64_t num_experts, int expert_alignment,
                                    uint64_t dispatch_id, int rank, const Tensor& rank_prefix_matrix);

// Allocates a normal dispatch's outputs and writes the received rows into them: one writer for both routings, so
// their rows are alike bit for bit.
class RecvWriter {
 public:
  RecvWriter(DispatchResult& result, const DispatchArgs& args, const ep::DispatchShape& shape, DType scales_dtype,
             int64_t num_rows, int64_t num_local_experts, int rank, const HostBuffer& buffer);
  size_t row_bytes() const { return row_bytes_; }
  // Row `row`: the token's x bytes, its scales (fp8: scale j at scales + j * scale_stride elements) and its index
  // on its source rank.
  void write(int64_t row, const uint8_t* x, const uint8_t* scales, int64_t scale_stride, int32_t src_idx);
  // Slot k of row `row` (fresh mode): the token's global expert id (-1: none) and weight, kept where local.
  void write_topk(int64_t row, int64_t k, int64_t expert, float weight);
  // Worst-token padding of rows [first, num_rows).
  void pad(int64_t first);

 private:
  void set_topk(int64_t i, int64_t value);

  DispatchResult& result_;
  int64_t num_rows_, num_topk_;
  size_t row_bytes_;
  int64_t num_scales_;
  size_t scale_size_;
  int64_t first_local_, num_local_experts_;
  bool idx64_;
  uint8_t* recv_x_;
  uint8_t* recv_scales_;
  int32_t* recv_src_;
  float* recv_w_;
};

// Tokens per node of `topology` from is_token_in_rank [T, R]: a token counts once per node with a destination.
std::vector<int32_t> count_tokens_per_node(const uint8_t* is_token_in_rank, int64_t num_tokens,
                                           const Topology& topology);

// Checks that every peer's combine arguments agree with this rank's and reverse the same dispatch.
void check_combine_posts(const std::vector<const CombinePost*>& peers, const CombinePost& mine, int rank);

// A combine's outputs on this rank: x [T, H] bf16 and, when the ranks passed weights, topk_weights [T, K] float32
// (zeroed). finish(t, acc) adds the biases to token t's fp32 sum in the contract's fixed order (bias_0, then
// bias_1) and writes it as bf16; the flat and the hierarchical combine sum their partials, then call it.
struct CombineOutput {
  CombineOutput(Tensor x, Tensor topk_weights, const CombineArgs& args)
      : x(std::move(x)), topk_weights(std::move(topk_weights)), hidden(this->x.view().shape[1]) {
    out = this->x.data_as<uint16_t>();
    bias_0 = args.bias_0.defined() ? args.bias_0.data_as<const uint16_t>() : nullptr;
    bias_1 = args.bias_1.defined() ? args.bias_1.data_as<const uint16_t>() : nullptr;
    out_w = this->topk_weights.defined() ? this->topk_weights.data_as<float>() : nullptr;
  }
  // acc += bias_0[t], then += bias_1[t] (those given).
  void add_biases(int64_t t, std::vector<float>& acc) const {
    for (int64_t h = 0; h < hidden && bias_0 != nullptr; ++h) acc[h] += detail::bf16_to_float(bias_0[t * hidden + h]);
    for (int64_t h = 0; h < hidden && bias_1 != nullptr; ++h) acc[h] += detail::bf16_to_float(bias_1[t * hidden + h]);
  }
  // out[t] = bf16(acc): the one rounding.
  void store(int64_t t, const std::vector<float>& acc) const {
    for (int64_t h = 0; h < hidden; ++h) out[t * hidden + h] = detail::float_to_bf16(acc[h]);
  }
  void finish(int64_t t, std::vector<float>& acc) const {
    add_biases(t, acc);
    store(t, acc);
  }
  CombineResult result() && { return CombineResult{std::move(x), std::move(topk_weights)}; }

  Tensor x, topk_weights;
  int64_t hidden;
  uint16_t* out = nullptr;
  const uint16_t* bias_0 = nullptr;
  const uint16_t* bias_1 = nullptr;
  float* out_w = nullptr;  // null without weights
};

}  // namespace epx::host
