#include "ep/validate.h"

#include <exception>
#include <iterator>
#include <vector>

#include "core/check.h"
#include "epx/routing.h"

namespace epx::ep {

namespace {

void check_optional(const TensorView& t, const char* name, DType dtype, std::initializer_list<int64_t> shape,
                    Device device) {
  if (!t.defined()) return;
  check_tensor(t, name, dtype, shape);
  check_device(t, name, device);
}

void check_topk_idx(const TensorView& topk_idx, int64_t num_tokens, Device device) {
  check_tensor(topk_idx, "topk_idx", {DType::kInt64, DType::kInt32}, {num_tokens, -1});
  check_device(topk_idx, "topk_idx", device);
  EPX_CHECK_ARG(topk_idx.shape[1] >= 1, "topk_idx must have >= 1 column (num_topk), got {}", topk_idx.describe());
}

// NOTE: expert ids and the per-expert counts of the layout are int32.
void check_num_experts(int64_t num_experts) {
  EPX_CHECK_ARG(num_experts <= kMaxExperts, "num_experts must be <= 2^31 - 1 (int32 expert ids and counts), got {}",
                num_experts);
}

// Bytes of one received row of a normal dispatch: data, scales, top-k ids (at most 8 bytes each) and weights,
// and the int32 source index. Checked, so that rows * row bytes below can be checked too.
int64_t received_row_bytes(const DispatchShape& shape, const TensorView& x) {
  int64_t bytes = detail::checked_mul(shape.hidden, static_cast<int64_t>(dtype_size(x.dtype)), "x row bytes");
  bytes = detail::checked_add(bytes, shape.scale_bytes, "x row bytes + x_scales row bytes");
  const int64_t topk_bytes = detail::checked_mul(shape.num_topk, 8 + 4, "num_topk * 12 bytes");
  return detail::checked_add(detail::checked_add(bytes, topk_bytes, "received row bytes"), 4, "received row bytes");
}

// Worst-token mode allocates num_worst_tokens rows whatever arrives: their bytes must be representable.
// NOTE: checks the row bytes in every mode: x [0, 2^62] has 0 bytes here but not on the receivers.
void check_received_rows(const DispatchArgs& args, const DispatchShape& shape) {
  const int64_t row_bytes = received_row_bytes(shape, args.x);
  if (args.num_worst_tokens > 0) {
    detail::checked_mul(args.num_worst_tokens, row_bytes, "num_worst_tokens * received row bytes");
  }
}

}  // namespace

void validate_layout_args(const TensorView& topk_idx, int64_t num_experts, int num_ranks, Device device) {
  check_expert_split(num_experts, num_ranks);
  check_num_experts(num_experts);
  check_topk_idx(topk_idx, -1, device);
}

DispatchShape validate_dispatch(const DispatchArgs& args, int num_ranks, Device device) {
  DispatchShape shape;
  check_tensor(args.x, "x", {DType::kBFloat16, DType::kFloat8E4M3}, {-1, -1});
  check_device(args.x, "x", device);
  shape.num_tokens = args.x.shape[0];
  shape.hidden = args.x.shape[1];
  shape.is_fp8 = args.x.dtype == DType::kFloat8E4M3;
  EPX_CHECK_ARG(shape.hidden >= 1, "x hidden size must be >= 1, got {}", args.x.describe());
  if (shape.is_fp8) {
    EPX_CHECK_ARG(shape.hidden % kFp8BlockSize == 0, "x hidden size must be a multiple of {} with fp8 x, got {}",
                  kFp8BlockSize, shape.hidden);
    EPX_CHECK_ARG(args.x_scales.defined(), "x_scales is required with fp8 x");
    // Any strides (check_tensor would demand a contiguous view).
    const TensorView& s = args.x_scales;
    const bool packed = s.dtype == DType::kInt32;
    const int64_t num_scales = packed ? (shape.hidden / kFp8BlockSize + 3) / 4 : shape.hidden / kFp8BlockSize;
    EPX_CHECK_ARG(s.dtype == DType::kFloat32 || s.dtype == DType::kUInt8 || packed,
                  "x_scales must be fp32, uint8 (UE8M0) or int32 (packed UE8M0), got {}", s.describe());
    EPX_CHECK_ARG(s.ndim == 2 && s.shape[0] == shape.num_tokens && s.shape[1] == num_scales,
                  "x_scales must be [{}, {}] ({}), got {}", shape.num_tokens, num_scales,
                  packed ? "int32: ceil(H / 512) packed UE8M0" : "H / 128 blocks", s.describe());
    EPX_CHECK_ARG(s.data != nullptr || detail::checked_numel(s, "x_scales") == 0, "x_scales has a null data pointer");
    detail::checked_span_bytes(s, "x_scales");  // kernels index t * strides[0] + j * strides[1]
    check_device(s, "x_scales", device);
    shape.scale_bytes = num_scales * static_cast<int64_t>(dtype_size(s.dtype));
  } else {
    EPX_CHECK_ARG(!args.x_scales.defined(), "x_scales must be absent with bf16 x, got {}", args.x_scales.describe());
  }
  EPX_CHECK_ARG(args.expert_alignment >= 1, "expert_alignment must be >= 1, got {}", args.expert_alignment);
  EPX_CHECK_ARG(args.num_worst_tokens >= 0 && args.num_worst_tokens <= kMaxWorstTokens,
                "num_worst_tokens must be in [0, 2^31 - 1] (0: off; int32 row indices), got {}", args.num_worst_tokens);
  shape.is_cached = args.handle != nullptr;
  if (shape.is_cached) {
    EPX_CHECK_ARG(!args.topk_idx.defined(), "topk_idx must be absent in cached mode (handle given), got {}",
                  args.topk_idx.describe());
    EPX_CHECK_ARG(!args.topk_weights.defined(), "topk_weights must be absent in cached mode (handle given), got {}",
                  args.topk_weights.describe());
    EPX_CHECK_ARG(args.layout == nullptr, "layout must be absent in cached mode (handle given)");
    EPX_CHECK_ARG(args.handle->num_tokens() == shape.num_tokens,
                  "x has {} tokens but the cached handle was made for {} tokens", shape.num_tokens,
                  args.handle->num_tokens());
    check_received_rows(args, shape);
    return shape;
  }
  check_expert_split(args.num_experts, num_ranks);
  check_num_experts(args.num_experts);
  EPX_CHECK_ARG(args.topk_idx.defined(), "topk_idx is required unless a handle is given (cached mode)");
  check_topk_idx(args.topk_idx, shape.num_tokens, device);
  shape.num_topk = args.topk_idx.shape[1];
  check_received_rows(args, shape);
  check_optional(args.topk_weights, "topk_weights", DType::kFloat32, {shape.num_tokens, shape.num_topk}, device);
  if (args.layout != nullptr) {
    check_tensor(args.layout->num_tokens_per_rank, "layout.num_tokens_per_rank", DType::kInt32, {num_ranks});
    check_device(args.layout->num_tokens_per_rank, "layout.num_tokens_per_rank", device);
    check_tensor(args.layout->num_tokens_per_expert, "layout.num_tokens_per_expert", DType::kInt32, {args.num_experts});
    check_device(args.layout->num_tokens_per_expert, "layout.num_tokens_per_expert", device);
    check_tensor(args.layout->is_token_in_rank, "layout.is_token_in_rank", DType::kBool, {shape.num_tokens, num_ranks});
    check_device(args.layout->is_token_in_rank, "layout.is_token_in_rank", device);
  }
  return shape;
}

int resolve_num_sms(int num_sms, int buffer_num_sms) {
  EPX_CHECK_ARG(num_sms >= 0 && num_sms <= buffer_num_sms,
                "num_sms must be in [0, {}] (0: the buffer's BufferOptions::num_sms = {}), got {}", buffer_num_sms,
                buffer_num_sms, num_sms);
  return num_sms == 0 ? buffer_num_sms : num_sms;
}

void validate_combine(const CombineArgs& args, int64_t num_tokens, int64_t num_rows, Device device) {
  EPX_CHECK_ARG(args.handle != nullptr, "handle is required (from the dispatch being reversed)");
  check_tensor(args.x, "x", DType::kBFloat16, {num_rows, -1});
  check_device(args.x, "x", device);
  const int64_t hidden = args.x.shape[1];
  EPX_CHECK_ARG(hidden >= 1, "x hidden size must be >= 1, got {}", args.x.describe());
  if (args.topk_weights.defined()) {
    check_tensor(args.topk_weights, "topk_weights", DType::kFloat32, {num_rows, -1});
    check_device(args.topk_weights, "topk_weights", device);
  }
  check_optional(args.bias_0, "bias_0", DType::kBFloat16, {num_tokens, hidden}, device);
  check_optional(args.bias_1, "bias_1", DType::kBFloat16, {num_tokens, hidden}, device);
  if (args.order_topk_idx.defined()) {
    check_tensor(args.order_topk_idx, "order_topk_idx", {DType::kInt64, DType::kInt32}, {num_tokens, -1});
    check_device(args.order_topk_idx, "order_topk_idx", device);
    EPX_CHECK_ARG(args.order_topk_idx.shape[1] >= 1 && args.order_topk_idx.shape[1] <= (int64_t{1} << 20),
                  "order_topk_idx must have 1 to 2^20 columns, got {}", args.order_topk_idx.describe());
  }
}

void refuse_combine_order_on_hierarchical(const CombineArgs& args) {
  EPX_CHECK(ErrorCode::kUnsupported, !args.order_topk_idx.defined(),
            "order_topk_idx (DeepEP V2's summation order) needs the flat routing; this buffer routes hierarchically");
}

LowLatencyShape validate_low_latency_dispatch(const LowLatencyDispatchArgs& args, int num_ranks, Device device) {
  LowLatencyShape shape;
  const int64_t max_tokens = args.max_tokens_per_rank;
  EPX_CHECK_ARG(max_tokens >= 1, "max_tokens_per_rank must be >= 1, got {}", max_tokens);
  EPX_CHECK_ARG(detail::checked_mul(num_ranks, max_tokens, "num_ranks * max_tokens_per_rank") < (int64_t{1} << 31),
                "num_ranks * max_tokens_per_rank must be < 2^31 (slot indices are 32-bit), got {} * {}", num_ranks,
                max_tokens);
  check_tensor(args.x, "x", DType::kBFloat16, {-1, -1});
  check_device(args.x, "x", device);
  shape.num_tokens = args.x.shape[0];
  shape.hidden = args.x.shape[1];
  EPX_CHECK_ARG(shape.num_tokens <= max_tokens, "x has {} tokens, more than max_tokens_per_rank = {}", shape.num_tokens,
                max_tokens);
  EPX_CHECK_ARG(
      shape.hidden >= kFp8BlockSize && shape.hidden <= kLowLatencyMaxHidden && shape.hidden % kFp8BlockSize == 0,
      "x hidden size must be a multiple of {} in [{}, {}], got {}", kFp8BlockSize, kFp8BlockSize, kLowLatencyMaxHidden,
      shape.hidden);
  check_topk_idx(args.topk_idx, shape.num_tokens, device);
  shape.num_topk = args.topk_idx.shape[1];
  EPX_CHECK_ARG(shape.num_topk <= kLowLatencyMaxTopk, "topk_idx has {} columns, more than the low-latency limit {}",
                shape.num_topk, kLowLatencyMaxTopk);
  check_expert_split(args.num_experts, num_ranks);
  EPX_CHECK_ARG(args.num_experts <= kLowLatencyMaxExperts, "num_experts must be <= {} for low-latency, got {}",
                kLowLatencyMaxExperts, args.num_experts);
  EPX_CHECK_ARG(args.scale_format == ScaleFormat::kFloat32 || args.scale_format == ScaleFormat::kUE8M0,
                "scale_format {} is not a ScaleFormat", static_cast<int>(args.scale_format));
  EPX_CHECK_ARG(args.scale_layout == ScaleLayout::kRowMajor || args.scale_layout == ScaleLayout::kColumnMajor,
                "scale_layout {} is not a ScaleLayout", static_cast<int>(args.scale_layout));
  EPX_CHECK_ARG(
      !args.use_fp8 || args.scale_format != ScaleFormat::kUE8M0 || args.scale_layout != ScaleLayout::kColumnMajor ||
          shape.hidden % (4 * kFp8BlockSize) == 0,
      "column-major UE8M0 scales pack four exponents per int32: x hidden size must be a multiple of {}, got {}",
      4 * kFp8BlockSize, shape.hidden);
  shape.num_local_experts = args.num_experts / num_ranks;
  check_optional(args.cumulative_recv_counts, "cumulative_recv_counts", DType::kInt32, {shape.num_local_experts},
                 device);
  check_optional(args.wait_recv_cost_ns, "wait_recv_cost_ns", DType::kInt64, {num_ranks}, device);
  return shape;
}

void validate_low_latency_combine(const LowLatencyCombineArgs& args, const LowLatencyShape& dispatch_shape,
                                  int64_t max_tokens_per_rank, int num_ranks, Device device) {
  check_tensor(
      args.x, "x", DType::kBFloat16,
      {dispatch_shape.num_local_experts,
       detail::checked_mul(num_ranks, max_tokens_per_rank, "num_ranks * max_tokens_per_rank"), dispatch_shape.hidden});
  check_device(args.x, "x", device);
  check_tensor(args.topk_idx, "topk_idx", {DType::kInt64, DType::kInt32},
               {dispatch_shape.num_tokens, dispatch_shape.num_topk});
  check_device(args.topk_idx, "topk_idx", device);
  check_tensor(args.topk_weights, "topk_weights", DType::kFloat32,
               {dispatch_shape.num_tokens, dispatch_shape.num_topk});
  check_device(args.topk_weights, "topk_weights", device);
  check_optional(args.out, "out", DType::kBFloat16, {dispatch_shape.num_tokens, dispatch_shape.hidden}, device);
  check_optional(args.wait_recv_cost_ns, "wait_recv_cost_ns", DType::kInt64, {num_ranks}, device);
}

void validate_options(const BufferOptions& options) {
  EPX_CHECK_ARG(options.num_normal_bytes >= 0, "num_normal_bytes must be >= 0, got {}", options.num_normal_bytes);
  EPX_CHECK_ARG(options.num_low_latency_bytes >= 0, "num_low_latency_bytes must be >= 0, got {}",
                options.num_low_latency_bytes);
  EPX_CHECK_ARG(options.num_sms >= 1 && options.num_sms <= kMaxNumSms, "num_sms must be in [1, {}], got {}", kMaxNumSms,
                options.num_sms);
  EPX_CHECK_ARG(options.normal.max_copy_chunks >= 1 && options.normal.max_copy_chunks <= kNormalMaxCopyChunks,
                "normal.max_copy_chunks must be in [1, {}], got {}", kNormalMaxCopyChunks,
                options.normal.max_copy_chunks);
  const auto early = static_cast<int>(options.normal.early_copies);
  EPX_CHECK_ARG(early >= static_cast<int>(EarlyCopies::kAuto) && early <= static_cast<int>(EarlyCopies::kNever),
                "normal.early_copies must be kAuto, kAlways or kNever, got {}", early);
  const auto routing = static_cast<int>(options.normal_routing);
  EPX_CHECK_ARG(
      routing >= static_cast<int>(NormalRouting::kAuto) && routing <= static_cast<int>(NormalRouting::kHierarchical),
      "normal_routing must be kAuto, kFlat or kHierarchical, got {}", routing);
  const auto ll_routing = static_cast<int>(options.low_latency_routing);
  EPX_CHECK_ARG(ll_routing >= static_cast<int>(LowLatencyRouting::kAuto) &&
                    ll_routing <= static_cast<int>(LowLatencyRouting::kHierarchical),
                "low_latency_routing must be kAuto, kFlat or kHierarchical, got {}", ll_routing);
  const auto partials = static_cast<int>(options.node_partials);
  EPX_CHECK_ARG(
      partials == static_cast<int>(NodePartials::kFloat32) || partials == static_cast<int>(NodePartials::kBFloat16),
      "node_partials must be kFloat32 or kBFloat16, got {}", partials);
  const int parts = options.low_latency.combine_send_parts;
  EPX_CHECK_ARG(parts == 1 || parts == 2 || parts == 4 || parts == 8,
                "low_latency.combine_send_parts must be 1, 2, 4 or 8, got {}", parts);
  EPX_CHECK_ARG(options.low_latency.combine_solo_max_rows >= 0,
                "low_latency.combine_solo_max_rows must be >= 0, got {}", options.low_latency.combine_solo_max_rows);
  EPX_CHECK_ARG(options.low_latency.token_rows_min_tokens >= 0,
                "low_latency.token_rows_min_tokens must be >= 0, got {}", options.low_latency.token_rows_min_tokens);
}

namespace {

// The options every rank must pass alike (they size and lay out memory the peers index, or pick the protocol),
// as words, so no padding byte goes over the wire.
struct AgreedOption {
  const char* name;
  int64_t (*get)(const BufferOptions&);
};
constexpr AgreedOption kAgreed[] = {
    {"num_normal_bytes", [](const BufferOptions& o) { return o.num_normal_bytes; }},
    {"num_low_latency_bytes", [](const BufferOptions& o) { return o.num_low_latency_bytes; }},
    {"num_sms", [](const BufferOptions& o) { return int64_t{o.num_sms}; }},
    {"normal.copy_engines", [](const BufferOptions& o) { return int64_t{o.normal.copy_engines}; }},
    {"normal.whole_copies", [](const BufferOptions& o) { return int64_t{o.normal.whole_copies}; }},
    {"normal.stream_signals", [](const BufferOptions& o) { return int64_t{o.normal.stream_signals}; }},
    {"normal.max_copy_chunks", [](const BufferOptions& o) { return int64_t{o.normal.max_copy_chunks}; }},
    {"low_latency.combine_send_parts",
     [](const BufferOptions& o) { return int64_t{o.low_latency.combine_send_parts}; }},
    {"low_latency.combine_solo_max_rows",
     [](const BufferOptions& o) { return int64_t{o.low_latency.combine_solo_max_rows}; }},
    {"low_latency.token_rows_min_tokens",
     [](const BufferOptions& o) { return int64_t{o.low_latency.token_rows_min_tokens}; }},
    {"low_latency.programmatic_launch",
     [](const BufferOptions& o) { return int64_t{o.low_latency.programmatic_launch}; }},
    {"low_latency.expert_side_reduction",
     [](const BufferOptions& o) { return int64_t{o.low_latency.expert_side_reduction}; }},
    {"normal_routing", [](const BufferOptions& o) { return static_cast<int64_t>(o.normal_routing); }},
    {"low_latency_routing", [](const BufferOptions& o) { return static_cast<int64_t>(o.low_latency_routing); }},
    {"node_partials", [](const BufferOptions& o) { return static_cast<int64_t>(o.node_partials); }},
};
constexpr size_t kWords = 1 + std::size(kAgreed);  // word 0: this rank's options are valid

}  // namespace

void agree_on_options(Group& group, const BufferOptions& options) {
  std::exception_ptr invalid;
  try {
    validate_options(options);
  } catch (const Error&) {
    invalid = std::current_exception();
  }
  std::vector<int64_t> mine(kWords);
  mine[0] = invalid == nullptr;
  for (size_t i = 0; i < std::size(kAgreed); ++i) mine[1 + i] = kAgreed[i].get(options);
  const int R = group.num_ranks();
  std::vector<int64_t> all(kWords * static_cast<size_t>(R));
  group.all_gather_bytes(mine.data(), all.data(), kWords * sizeof(int64_t));
  if (invalid != nullptr) std::rethrow_exception(invalid);
  for (int r = 0; r < R; ++r) {
    EPX_CHECK(ErrorCode::kPeerFailure, all[r * kWords] != 0,
              "rank {} passed invalid BufferOptions (its error names them); no rank made the buffer", r);
  }
  for (int r = 0; r < R; ++r) {
    for (size_t i = 0; i < std::size(kAgreed); ++i) {
      const int64_t theirs = all[r * kWords + 1 + i];
      EPX_CHECK_ARG(theirs == mine[1 + i],
                    "BufferOptions.{} must be the same on every rank: rank {} passed {}, rank {} passed {}",
                    kAgreed[i].name, r, theirs, group.rank(), mine[1 + i]);
    }
  }
}

}  // namespace epx::ep
