// Core: errors, tensor views and validation, bf16/fp8 conversion, fp8 quantization round trips.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "epx/error.h"
#include "epx/quant.h"
#include "epx/tensor.h"
#include "test_util.h"

namespace epx {
namespace {

TEST(Error, CarriesCodeAndMessage) {
  const Error e(ErrorCode::kTimeout, "rank 3 waited");
  EXPECT_EQ(e.code(), ErrorCode::kTimeout);
  EXPECT_STREQ(e.what(), "epx timeout: rank 3 waited");
}

TEST(Tensor, ViewsAndValidation) {
  std::vector<float> buf(24);
  const auto v = TensorView::of(buf.data(), DType::kFloat32, {2, 3, 4});
  EXPECT_EQ(v.numel(), 24);
  EXPECT_EQ(v.nbytes(), 96u);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.strides[0], 12);
  EXPECT_EQ(v.describe(), "fp32[2, 3, 4] on cpu");
  TensorView strided = v;  // [2, 3, 4] with a gap between rows
  strided.strides[0] = 13;
  EXPECT_FALSE(strided.is_contiguous());
  TensorView empty = TensorView::of(buf.data(), DType::kFloat32, {0, 4});
  empty.strides[0] = empty.strides[1] = 0;  // what numpy reports for np.empty((0, 4))
  EXPECT_TRUE(empty.is_contiguous());
  EXPECT_NO_THROW(check_tensor(v, "x", DType::kFloat32, {2, -1, 4}));
  EXPECT_THROW(check_tensor(v, "x", DType::kFloat32, {2, 3}), Error);
  EXPECT_THROW(check_tensor(v, "x", DType::kBFloat16, {2, 3, 4}), Error);
  EXPECT_THROW(check_tensor(TensorView{}, "x", DType::kFloat32, {}), Error);
  try {
    check_tensor(v, "topk_weights", DType::kFloat32, {2, 5, 4});
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("topk_weights dim 1 must be 5"), std::string::npos) << e.what();
  }
  const Tensor t = Tensor::empty(DType::kInt64, {5, 7});
  EXPECT_EQ(t.numel(), 35);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 256, 0u);
  EXPECT_THROW(Tensor::empty(DType::kInt64, {-1}), Error);
}

TEST(Tensor, MoreDimsThanTheLimit) {
  // A hand-built view with ndim above kMaxDims: is_contiguous and sizes read shape[4] and beyond (undefined
  // behaviour, found by tests/fuzz/tensor_view_fuzz.cpp); now they stay within shape[] and numel throws.
  std::vector<float> buf(4);
  TensorView v = TensorView::of(buf.data(), DType::kFloat32, {1, 1, 2, 2});
  v.ndim = kMaxDims + 1;
  EXPECT_FALSE(v.is_contiguous());
  EXPECT_EQ(v.sizes(), (std::vector<int64_t>{1, 1, 2, 2}));
  EXPECT_THROW(v.numel(), Error);
  EXPECT_THROW(check_tensor(v, "x", DType::kFloat32, {1, 1, 2, 2}), Error);
  v.ndim = 1000;
  EXPECT_FALSE(v.is_contiguous());
  EXPECT_EQ(v.describe(), "fp32[1000 dims] on cpu");
}

TEST(Tensor, EmptyShapeWithHugeDims) {
  // A zero dim makes the view empty whatever the others are; the row-major strides of the others used to be
  // multiplied past int64 (signed overflow, reported by UBSan; found by tests/fuzz/tensor_view_fuzz.cpp).
  const int64_t huge = INT64_MAX;
  const TensorView v = TensorView::of(nullptr, DType::kBFloat16, {0, huge, int64_t{1} << 24});
  EXPECT_EQ(v.numel(), 0);
  EXPECT_EQ(v.nbytes(), 0u);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.strides[2], 1);
  EXPECT_EQ(v.strides[1], int64_t{1} << 24);
  const Tensor t = Tensor::empty(DType::kFloat32, {huge, 3, 0});
  EXPECT_EQ(t.numel(), 0);
  EXPECT_THROW(TensorView::of(nullptr, DType::kBFloat16, {1, huge, 2}), Error);  // not empty: too many bytes
}

TEST(Quant, Bf16RoundTrip) {
  EXPECT_EQ(float_to_bf16(1.f), 0x3f80);
  EXPECT_EQ(bf16_to_float(0x3f80), 1.f);
  EXPECT_EQ(float_to_bf16(1.00390625f), 0x3f80);  // exactly halfway: ties to even
  EXPECT_EQ(float_to_bf16(1.01171875f), 0x3f82);  // halfway above odd: up
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
}

TEST(Quant, Fp8E4M3AllCodes) {
  // Every finite code decodes and re-encodes to itself.
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    const float v = fp8_e4m3_to_float(static_cast<uint8_t>(code));
    EXPECT_EQ(float_to_fp8_e4m3(v), code == 0x80 ? 0x80 : code) << code;
  }
  EXPECT_EQ(fp8_e4m3_to_float(0x7e), 448.f);
  EXPECT_EQ(fp8_e4m3_to_float(0x01), std::ldexp(1.f, -9));
  EXPECT_EQ(float_to_fp8_e4m3(1000.f), 0x7e);  // saturates
  EXPECT_EQ(float_to_fp8_e4m3(-1000.f), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3(1.0625f), 0x38);  // halfway between 1 and 1.125: ties to even
  EXPECT_EQ(float_to_fp8_e4m3(1.1875f), 0x3a);  // halfway between 1.125 and 1.25: to even (1.25)
}

TEST(Quant, Ue8m0) {
  EXPECT_EQ(float_to_ue8m0(1.f), 127);
  EXPECT_EQ(float_to_ue8m0(1.5f), 128);
  EXPECT_EQ(float_to_ue8m0(0.25f), 125);
  EXPECT_EQ(ue8m0_to_float(130), 8.f);
}

TEST(Quant, RoundTripWithinBound) {
  std::mt19937 rng(7);
  const int64_t tokens = 33, hidden = 512;
  auto x = testing::random_bf16(rng, tokens * hidden, 30.f);
  x[5] = float_to_bf16(0.f);
  for (ScaleFormat format : {ScaleFormat::kFloat32, ScaleFormat::kUE8M0}) {
    std::vector<uint8_t> q(tokens * hidden);
    std::vector<float> scales_f(tokens * hidden / 128);
    std::vector<uint8_t> scales_u(tokens * hidden / 128);
    const auto scales = format == ScaleFormat::kFloat32
                            ? TensorView::of(scales_f.data(), DType::kFloat32, {tokens, hidden / 128})
                            : TensorView::of(scales_u.data(), DType::kUInt8, {tokens, hidden / 128});
    quantize_fp8_host(TensorView::of(x.data(), DType::kBFloat16, {tokens, hidden}),
                      TensorView::of(q.data(), DType::kFloat8E4M3, {tokens, hidden}), scales, format);
    std::vector<float> back(tokens * hidden);
    dequantize_fp8_host(TensorView::of(q.data(), DType::kFloat8E4M3, {tokens, hidden}), scales,
                        TensorView::of(back.data(), DType::kFloat32, {tokens, hidden}));
    const float bound = format == ScaleFormat::kFloat32 ? kFp8RoundTripRelError : 2 * kFp8RoundTripRelError;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t b = 0; b < hidden / 128; ++b) {
        float amax = 0;
        for (int i = 0; i < 128; ++i) amax = std::max(amax, std::fabs(bf16_to_float(x[t * hidden + b * 128 + i])));
        for (int i = 0; i < 128; ++i) {
          const int64_t j = t * hidden + b * 128 + i;
          ASSERT_LE(std::fabs(back[j] - bf16_to_float(x[j])), bound * amax) << "token " << t << " ch " << b * 128 + i;
        }
      }
    }
  }
  std::vector<uint8_t> q(4 * 100);
  std::vector<float> s(4);
  EXPECT_THROW(quantize_fp8_host(TensorView::of(x.data(), DType::kBFloat16, {4, 100}),
                                 TensorView::of(q.data(), DType::kFloat8E4M3, {4, 100}),
                                 TensorView::of(s.data(), DType::kFloat32, {4, 1}), ScaleFormat::kFloat32),
               Error);
}

}  // namespace
}  // namespace epx
