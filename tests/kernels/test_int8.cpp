// Int8 inference primitives (include/dtrain/kernels/int8.h) against a reference of the same
// quantized arithmetic: int32 accumulation, f32 (acc + bias) * scale, ReLU, round to nearest even,
// saturate. Integer outputs may differ by 1 LSB where oneDNN's f32 multiply rounds differently.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <string>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "dtrain/core/error.h"
#include "dtrain/core/rng.h"
#include "dtrain/kernels/int8.h"

using namespace dtrain;
using int8::ConvShape;
using int8::QType;

namespace {

// x (N, H, W, C) as ints; w (K, C, R, S); `add` empty or (N, P, Q, K) as ints, times add_scale.
// Returns y (N, P, Q, K) as floats holding the output values.
std::vector<float> reference_conv(const ConvShape& g, int64_t n, const std::vector<int>& x, const std::vector<int8_t>& w,
                                  const std::vector<float>& bias, const std::vector<float>& scales, bool relu,
                                  QType out, const std::vector<int>& add = {}, float add_scale = 0.f) {
  const int64_t P = g.out_h(), Q = g.out_w();
  std::vector<float> y(static_cast<size_t>(n * P * Q * g.k));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t q = 0; q < Q; ++q)
        for (int64_t k = 0; k < g.k; ++k) {
          int32_t acc = 0;
          for (int64_t c = 0; c < g.c; ++c)
            for (int64_t r = 0; r < g.r; ++r)
              for (int64_t s = 0; s < g.s; ++s) {
                const int64_t h = p * g.stride - g.pad + r, ww = q * g.stride - g.pad + s;
                if (h < 0 || h >= g.h || ww < 0 || ww >= g.w) continue;
                acc += x[((i * g.h + h) * g.w + ww) * g.c + c] * w[((k * g.c + c) * g.r + r) * g.s + s];
              }
          const size_t at = static_cast<size_t>(((i * P + p) * Q + q) * g.k + k);
          float v = scales[k] * (static_cast<float>(acc) + bias[k]);
          if (!add.empty()) v += add_scale * static_cast<float>(add[at]);
          if (relu) v = std::max(v, 0.f);
          if (out != QType::F32) {
            v = std::nearbyint(v);
            v = out == QType::U8 ? std::clamp(v, 0.f, 255.f) : std::clamp(v, -128.f, 127.f);
          }
          y[at] = v;
        }
  return y;
}

float value_at(const std::vector<uint8_t>& buf, QType t, size_t i) {
  if (t == QType::U8) return buf[i];
  if (t == QType::S8) return static_cast<int8_t>(buf[i]);
  float f;
  std::memcpy(&f, buf.data() + 4 * i, 4);
  return f;
}

struct Case {
  const char* name;
  ConvShape g;
};

class Int8ConvTest : public ::testing::TestWithParam<std::tuple<Case, QType, QType, bool>> {};

TEST_P(Int8ConvTest, MatchesTheQuantizedArithmetic) {
  const auto [cs, in, out, relu] = GetParam();
  const ConvShape g = cs.g;
  const int64_t n = 3;
  Rng rng(17);
  std::vector<int> x(static_cast<size_t>(n * g.h * g.w * g.c));
  std::vector<uint8_t> xb(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = in == QType::U8 ? static_cast<int>(rng.below(256)) : static_cast<int>(rng.below(256)) - 128;
    xb[i] = static_cast<uint8_t>(x[i]);
  }
  // Weights over the whole 7-bit range: 2 x 255 x 63 is the largest pair sum a kernel without VNNI
  // holds in 16 bits (int8.h), so every case would overflow there with 8-bit weights.
  std::vector<int8_t> w(static_cast<size_t>(g.k * g.c * g.r * g.s));
  for (auto& v : w) v = static_cast<int8_t>(static_cast<int>(rng.below(127)) - 63);
  std::vector<float> bias(g.k), scales(g.k);
  // Accumulators spread about sd = sqrt(C*R*S) * rms(x) * rms(w) (rms 147 for u8, 74 for s8, 37 for
  // the weights); scales put them about 50 output steps wide, the bias shifts by up to half of that.
  const float sd = std::sqrt(static_cast<float>(g.c * g.r * g.s)) * (in == QType::U8 ? 147.f : 74.f) * 37.f;
  for (int64_t k = 0; k < g.k; ++k) {
    bias[k] = rng.uniform(-0.5f, 0.5f) * sd;
    scales[k] = rng.uniform(0.5f, 2.f) * 50.f / sd;
  }
  std::vector<float> want = reference_conv(g, n, x, w, bias, scales, relu, out);
  int8::Int8Conv2d conv(g, in, out, relu, w, bias, scales);
  std::vector<uint8_t> y(want.size() * int8::qtype_size(out));
  conv.forward(n, xb.data(), y.data());
  int64_t off_by_one = 0, inside = 0;  // inside: neither saturated nor cut by the ReLU
  for (size_t i = 0; i < want.size(); ++i) {
    const float got = value_at(y, out, i);
    if (out == QType::F32) {
      ASSERT_NEAR(got, want[i], 1e-5f * std::max(1.f, std::fabs(want[i]))) << cs.name << " at " << i;
    } else {
      ASSERT_LE(std::fabs(got - want[i]), 1.f) << cs.name << " at " << i;
      off_by_one += got != want[i];
    }
    const float lo = out == QType::U8 || relu ? 0.f : out == QType::S8 ? -128.f : -1e30f;
    const float hi = out == QType::U8 ? 255.f : out == QType::S8 ? 127.f : 1e30f;
    inside += want[i] > lo && want[i] < hi;
  }
  EXPECT_LE(off_by_one, static_cast<int64_t>(want.size() / 100)) << "more than 1 % of the outputs 1 LSB off";
  EXPECT_GT(inside, static_cast<int64_t>(want.size() / 4)) << "most outputs saturate: the case tests little";
  // A second batch size builds another primitive; the first stays right.
  std::vector<uint8_t> y1(y.size() / n);
  conv.forward(1, xb.data(), y1.data());
  EXPECT_EQ(0, std::memcmp(y1.data(), y.data(), y1.size()));
}

const Case kCases[] = {
    {"conv3x3 pad1", {3, 9, 9, 16, 3, 3, 1, 1}},
    {"conv3x3 stride2", {16, 8, 8, 32, 3, 3, 2, 1}},
    {"linear over a 32x7x7 image", {32, 7, 7, 10, 7, 7, 1, 0}},
    {"linear over a vector", {64, 1, 1, 24, 1, 1, 1, 0}},
};

std::string case_name(const ::testing::TestParamInfo<Int8ConvTest::ParamType>& info) {
  const auto& [cs, in, out, relu] = info.param;
  std::string name = std::string(cs.name) + "_" + int8::qtype_name(in) + "_to_" + int8::qtype_name(out) +
                     (relu ? "_relu" : "");
  for (char& ch : name)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return name;
}

INSTANTIATE_TEST_SUITE_P(Int8, Int8ConvTest,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Values(QType::U8, QType::S8),
                                            ::testing::Values(QType::U8, QType::S8, QType::F32),
                                            ::testing::Values(false, true)),
                         case_name);

// The convolution that ends a residual block: the shortcut held in y (u8 or s8, as its own type
// under a u8 or s8 output) is scaled and added before the ReLU.
TEST(Int8Conv2d, AddsTheShortcutHeldInItsOutput) {
  const ConvShape g{8, 6, 6, 8, 3, 3, 1, 1};
  const int64_t n = 2, out_elems = n * 6 * 6 * 8;
  Rng rng(23);
  std::vector<int> x(static_cast<size_t>(n * 6 * 6 * 8));
  std::vector<uint8_t> xb(x.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i] = static_cast<uint8_t>(x[i] = static_cast<int>(rng.below(256)));
  std::vector<int8_t> w(static_cast<size_t>(8 * 8 * 9));
  for (auto& v : w) v = static_cast<int8_t>(static_cast<int>(rng.below(127)) - 63);
  const float sd = std::sqrt(72.f) * 147.f * 37.f;
  std::vector<float> bias(8), scales(8);
  for (int k = 0; k < 8; ++k) {
    bias[k] = rng.uniform(-0.5f, 0.5f) * sd;
    scales[k] = rng.uniform(0.5f, 2.f) * 40.f / sd;
  }
  for (QType add_type : {QType::U8, QType::S8})
    for (QType out : {QType::U8, QType::S8})
      for (bool relu : {false, true}) {
        std::vector<int> a(static_cast<size_t>(out_elems));
        std::vector<uint8_t> y(a.size());
        for (size_t i = 0; i < a.size(); ++i) {
          a[i] = add_type == QType::U8 ? static_cast<int>(rng.below(256)) : static_cast<int>(rng.below(256)) - 128;
          y[i] = static_cast<uint8_t>(a[i]);
        }
        const float add_scale = 0.3f;
        const std::vector<float> want = reference_conv(g, n, x, w, bias, scales, relu, out, a, add_scale);
        int8::Int8Conv2d conv(g, QType::U8, out, relu, w, bias, scales, {add_type, add_scale});
        conv.forward(n, xb.data(), y.data());
        int64_t off_by_one = 0;
        for (size_t i = 0; i < want.size(); ++i) {
          const float got = value_at(y, out, i);
          ASSERT_LE(std::fabs(got - want[i]), 1.f) << int8::qtype_name(add_type) << " into " << int8::qtype_name(out)
                                                   << (relu ? " relu" : "") << " at " << i;
          off_by_one += got != want[i];
        }
        EXPECT_LE(off_by_one, static_cast<int64_t>(want.size() / 100)) << "more than 1 % of the outputs 1 LSB off";
      }
}

TEST(Int8Conv2d, RefusesWeightsBeyondSevenBits) {
  const ConvShape g{1, 3, 3, 1, 3, 3, 1, 1};
  std::vector<int8_t> w(9, 63);
  EXPECT_NO_THROW(int8::Int8Conv2d(g, QType::U8, QType::F32, false, w, {0.f}, {1.f}));
  w[4] = -64;
  EXPECT_THROW(int8::Int8Conv2d(g, QType::U8, QType::F32, false, w, {0.f}, {1.f}), Error);
}

TEST(Int8MaxPool, IsTheMaximumOfEachWindow) {
  const int64_t n = 2, c = 5, h = 6, w = 6;
  Rng rng(3);
  std::vector<int8_t> x(static_cast<size_t>(n * h * w * c));
  for (auto& v : x) v = static_cast<int8_t>(static_cast<int>(rng.below(256)) - 128);
  int8::Int8MaxPool pool(c, h, w, 2, 2, QType::S8);
  std::vector<int8_t> y(static_cast<size_t>(n * 3 * 3 * c));
  pool.forward(n, x.data(), y.data());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t p = 0; p < 3; ++p)
      for (int64_t q = 0; q < 3; ++q)
        for (int64_t ch = 0; ch < c; ++ch) {
          int m = -128;
          for (int64_t r = 0; r < 2; ++r)
            for (int64_t s = 0; s < 2; ++s) m = std::max<int>(m, x[((i * h + 2 * p + r) * w + 2 * q + s) * c + ch]);
          ASSERT_EQ(m, y[((i * 3 + p) * 3 + q) * c + ch]);
        }
}

TEST(Int8Quantize, RoundsToEvenSaturatesAndMovesChannelsLast) {
  // x (1, 2, 1, 3) with inv_scale 2: 0.25 -> 0.5 -> 0 (even), 0.75 -> 1.5 -> 2, 1.25 -> 2.5 -> 2.
  const std::vector<float> x = {0.25f, 0.75f, 1.25f, -100.f, 100.f, -0.75f};
  std::vector<int8_t> s8(6);
  int8::quantize_nchw_to_nhwc(x.data(), 1, 2, 1, 3, 2.f, QType::S8, s8.data());
  EXPECT_EQ(s8, (std::vector<int8_t>{0, -128, 2, 127, 2, -2}));
  std::vector<uint8_t> u8(6);
  int8::quantize_nchw_to_nhwc(x.data(), 1, 2, 1, 3, 2.f, QType::U8, u8.data());
  EXPECT_EQ(u8, (std::vector<uint8_t>{0, 0, 2, 200, 2, 0}));
}

}  // namespace

// Weight-only int8: rows quantized symmetrically, and the GEMM against the same dequantized weights
// multiplied in one reference loop (double), and against the f32 weights within the rounding bound:
// panel by panel for 5 rows of x (over panel boundaries: n not a multiple of the panel's rows), the
// whole matrix at once for 70.
class WeightOnlyInt8Rows : public testing::TestWithParam<int64_t> {};
INSTANTIATE_TEST_SUITE_P(FewAndMany, WeightOnlyInt8Rows, testing::Values(5, 70));
TEST_P(WeightOnlyInt8Rows, QuantizesRowsAndMultiplies) {
  const int64_t m = GetParam(), k = 1000, n = 70;  // 1000 columns: 32 rows a panel, so 3 panels (32, 32, 6)
  Rng rng(7);
  std::vector<float> w(static_cast<size_t>(n * k)), x(static_cast<size_t>(m * k));
  for (float& v : w) v = rng.uniform(-0.5f, 0.5f);
  for (float& v : x) v = rng.uniform(-1.f, 1.f);
  std::fill(w.begin() + 3 * k, w.begin() + 4 * k, 0.f);  // a zero row
  const int8::WeightOnlyInt8 q = int8::WeightOnlyInt8::from(w.data(), n, k);
  EXPECT_EQ(q.scale[3], 1.f);
  for (int64_t r = 0; r < n; ++r) {
    if (r == 3) continue;
    const auto row = q.q.begin() + r * k;
    EXPECT_EQ(std::max(std::abs(*std::max_element(row, row + k)), std::abs(*std::min_element(row, row + k))), 127) << r;
  }
  std::vector<float> y(static_cast<size_t>(m * n), -1.f);
  int8::gemm_weight_only_int8(x.data(), m, q, y.data());
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double dq = 0, f32 = 0, bound = 0;
      for (int64_t c = 0; c < k; ++c) {
        const double xv = x[static_cast<size_t>(i * k + c)];
        dq += xv * q.scale[static_cast<size_t>(j)] * q.q[static_cast<size_t>(j * k + c)];
        f32 += xv * w[static_cast<size_t>(j * k + c)];
        bound += std::fabs(xv) * q.scale[static_cast<size_t>(j)] / 2;
      }
      const float got = y[static_cast<size_t>(i * n + j)];
      ASSERT_NEAR(got, dq, 1e-4) << i << "," << j;
      ASSERT_NEAR(got, f32, bound + 1e-4) << i << "," << j;
    }
}

