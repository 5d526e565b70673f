// TBO strategy presets: SGLang's DeepSeek prefill and decode operation lists (operations_strategy.py).
#include <fmt/format.h>

#include <string>

#include "core/check.h"
#include "epx/tbo.h"

namespace epx {

namespace {

using Op = TboLayerOp;

// nullopt: a yield point.
const std::vector<std::optional<TboLayerOp>>& layer_ops(TboPreset preset) {
  // NOTE: one stage per line; std::nullopt is the yield that ends it.
  // clang-format off
  // _compute_moe_deepseek_blog_prefill.
  static const std::vector<std::optional<TboLayerOp>> kPrefill = {
      Op::kCommPrepareAttn, Op::kAttnPrepare, Op::kAttnCore, Op::kCommPrepareMlp, Op::kGate, Op::kSelectExperts,
          Op::kDispatchA, std::nullopt,
      Op::kDispatchB, Op::kExperts, Op::kCombineA, std::nullopt,
      Op::kSharedExperts, Op::kCombineB, Op::kOutput, Op::kCommPostprocessLayer,
  };
  // _compute_moe_deepseek_blog_decode.
  static const std::vector<std::optional<TboLayerOp>> kDecode = {
      Op::kCommPrepareAttn, Op::kAttnPrepare, std::nullopt,
      Op::kAttnCore, Op::kCommPrepareMlp, Op::kGate, Op::kSelectExperts, std::nullopt,
      Op::kDispatchA, Op::kSharedExperts, std::nullopt,
      Op::kDispatchB, Op::kExperts, Op::kCombineA, std::nullopt,
      Op::kCombineB, std::nullopt,
      Op::kOutput, Op::kCommPostprocessLayer,
  };
  // clang-format on
  return preset == TboPreset::kDeepSeekDecode ? kDecode : kPrefill;
}

void check_preset(TboPreset preset) {
  EPX_CHECK_ARG(preset == TboPreset::kDeepSeekPrefill || preset == TboPreset::kDeepSeekDecode,
                "preset {} is not a TboPreset", static_cast<int>(preset));
}

}  // namespace

const char* to_string(TboLayerOp op) noexcept {
  switch (op) {
    case Op::kCommPrepareAttn:
      return "comm_prepare_attn";
    case Op::kAttnPrepare:
      return "attn_prepare";
    case Op::kAttnCore:
      return "attn_core";
    case Op::kCommPrepareMlp:
      return "comm_prepare_mlp";
    case Op::kGate:
      return "gate";
    case Op::kSelectExperts:
      return "select_experts";
    case Op::kDispatchA:
      return "dispatch_a";
    case Op::kDispatchB:
      return "dispatch_b";
    case Op::kExperts:
      return "experts";
    case Op::kCombineA:
      return "combine_a";
    case Op::kCombineB:
      return "combine_b";
    case Op::kSharedExperts:
      return "shared_experts";
    case Op::kOutput:
      return "output";
    case Op::kCommPostprocessLayer:
      return "comm_postprocess_layer";
  }
  return "unknown";
}

const char* to_string(TboPreset preset) noexcept {
  switch (preset) {
    case TboPreset::kDeepSeekPrefill:
      return "deepseek-prefill";
    case TboPreset::kDeepSeekDecode:
      return "deepseek-decode";
  }
  return "unknown";
}

std::vector<std::optional<TboLayerOp>> tbo_preset_layer_ops(TboPreset preset) {
  check_preset(preset);
  return layer_ops(preset);
}

int tbo_preset_delta_stages(TboPreset preset) {
  check_preset(preset);
  return preset == TboPreset::kDeepSeekDecode ? 2 : 0;
}

std::optional<TboPreset> tbo_preset_for(ForwardMode global_mode) noexcept {
  switch (global_mode) {
    case ForwardMode::kExtend:
    case ForwardMode::kMixed:
      return TboPreset::kDeepSeekPrefill;
    case ForwardMode::kDecode:
    case ForwardMode::kTargetVerify:
    case ForwardMode::kPrebuilt:
      return TboPreset::kDeepSeekDecode;
    case ForwardMode::kIdle:
    case ForwardMode::kDraftExtend:
      return std::nullopt;
  }
  return std::nullopt;
}

TboStrategy make_tbo_strategy(TboPreset preset, int num_layers, const TboLayerOpFn& fn) {
  check_preset(preset);
  EPX_CHECK_ARG(num_layers >= 1 && num_layers <= kMaxTboLayers, "num_layers must be in [1, {}], got {}", kMaxTboLayers,
                num_layers);
  EPX_CHECK_ARG(static_cast<bool>(fn), "fn must be a callable, got an empty function");
  const auto& ops = layer_ops(preset);
  TboStrategy s;
  s.delta_stages = tbo_preset_delta_stages(preset);
  s.reserve_comm_sms = preset == TboPreset::kDeepSeekPrefill;
  s.operations.reserve(ops.size() * static_cast<size_t>(num_layers));
  for (int layer = 0; layer < num_layers; ++layer) {
    for (const auto& op : ops) {
      if (!op) {
        s.operations.push_back(TboOperation::yield_point());
        continue;
      }
      const TboLayerOp o = *op;
      // NOTE: fmt, not "L" + std::to_string(...): GCC 12 at -O3 flags that chain with a false -Wrestrict.
      s.operations.push_back({fmt::format("L{}.{}", layer, to_string(o)),
                              [fn, o, layer](int batch_idx) { fn(o, layer, batch_idx); }});
    }
  }
  return s;
}

}  // namespace epx
