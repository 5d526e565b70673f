// The flat normal path's per-call shape word (src/ep/call_shape.h): what the cuda kernels compare across ranks.
#include "ep/call_shape.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace epx::ep {
namespace {

NormalCallShape fp8_dispatch() {
  NormalCallShape s;
  s.kind = NormalCallKind::kFreshDispatch;
  s.x_dtype = DType::kFloat8E4M3;
  s.hidden = 7168;
  s.scales_dtype = DType::kFloat32;
  s.scale_columns = 56;
  s.num_topk = 8;
  s.topk_int64 = true;
  s.has_weights = true;
  s.num_experts = 256;
  return s;
}

TEST(CallShape, DescribesWhatItEncodes) {
  EXPECT_EQ(describe_call_shape(encode_call_shape(fp8_dispatch())),
            "fresh dispatch: x fp8_e4m3 [*, 7168], x_scales fp32 [*, 56], topk_idx int64 [*, 8], topk_weights [*, 8], "
            "256 experts");
  NormalCallShape cached;
  cached.kind = NormalCallKind::kCachedDispatch;
  cached.hidden = 4096;
  cached.fixed_rows = true;
  cached.captured = true;
  EXPECT_EQ(describe_call_shape(encode_call_shape(cached)),
            "cached dispatch: x bf16 [*, 4096], num_worst_tokens > 0, captured");
  NormalCallShape combine;
  combine.kind = NormalCallKind::kCombine;
  combine.hidden = 7168;
  combine.num_topk = 8;
  combine.has_weights = true;
  EXPECT_EQ(describe_call_shape(encode_call_shape(combine)), "combine: x bf16 [*, 7168], topk_weights [*, 8]");
  combine.num_topk = 0;
  combine.has_weights = false;
  EXPECT_EQ(describe_call_shape(encode_call_shape(combine)), "combine: x bf16 [*, 7168]");
}

TEST(CallShape, EveryFieldChangesTheWord) {
  const NormalCallShape base = fp8_dispatch();
  const uint64_t word = encode_call_shape(base);
  std::vector<NormalCallShape> changed(12, base);
  changed[0].kind = NormalCallKind::kCachedDispatch;
  changed[1].x_dtype = DType::kBFloat16;
  changed[2].hidden = 7680;
  changed[3].scales_dtype = DType::kInt32;  // packed UE8M0 scales: same bytes, other meaning
  changed[4].scales_dtype.reset();
  changed[5].scale_columns = 14;
  changed[6].num_topk = 6;
  changed[7].topk_int64 = false;
  changed[8].has_weights = false;  // an idle rank that passes no topk_weights
  changed[9].num_experts = 288;
  changed[10].fixed_rows = true;
  changed[11].captured = true;
  for (size_t i = 0; i < changed.size(); ++i) {
    EXPECT_NE(encode_call_shape(changed[i]), word) << "field " << i << ": " << describe_call_shape(word);
  }
}

TEST(CallShape, FieldsSaturateAtTheirWidth) {
  NormalCallShape a = fp8_dispatch(), b = fp8_dispatch();
  a.hidden = (int64_t{1} << 17) - 1;
  b.hidden = int64_t{1} << 20;
  EXPECT_EQ(encode_call_shape(a), encode_call_shape(b)) << "documented: hiddens from 2^17 - 1 up compare equal";
  b.hidden = a.hidden - 1;
  EXPECT_NE(encode_call_shape(a), encode_call_shape(b));
  // The largest values the cuda backend accepts fit: num_experts 8192, top-k 16.
  a = fp8_dispatch();
  a.num_experts = 8192;
  a.num_topk = 16;
  b = a;
  b.num_experts = 8191;
  EXPECT_NE(encode_call_shape(a), encode_call_shape(b));
  EXPECT_NE(describe_call_shape(encode_call_shape(a)).find("topk_idx int64 [*, 16]"), std::string::npos);
  EXPECT_NE(describe_call_shape(encode_call_shape(a)).find("8192 experts"), std::string::npos);
}

}  // namespace
}  // namespace epx::ep
