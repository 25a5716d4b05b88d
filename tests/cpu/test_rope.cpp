#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "artifacts/model_shape.h"
#include "kernels/common/rope.h"
#include "kernels/common/rope_math.h"

namespace kvs {
namespace {

std::vector<float> random_vec(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

TEST(Rope, InverseUndoesApply) {
  const int T = 37, H = 3, D = 128;
  RopeParams rope;
  rope.theta = 500000.0;
  const auto inv = rope_inv_freq(rope, D);
  std::vector<int32_t> pos(T);
  for (int t = 0; t < T; ++t) pos[t] = t * 977 + 3;  // large positions, not only small ones
  auto x = random_vec(size_t(T) * H * D, 1);
  const auto orig = x;
  kernels::rope_cpu(x.data(), T, H, D, pos.data(), inv.data(), false);
  double moved = 0;
  for (size_t i = 0; i < x.size(); ++i) moved = std::max(moved, double(std::abs(x[i] - orig[i])));
  EXPECT_GT(moved, 0.1);  // it did rotate
  kernels::rope_cpu(x.data(), T, H, D, pos.data(), inv.data(), true);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(x[i], orig[i], 1e-5f) << "element " << i;
}

TEST(Rope, DotProductDependsOnlyOnRelativePosition) {
  const int D = 64;
  RopeParams rope;
  const auto inv = rope_inv_freq(rope, D);
  const auto q0 = random_vec(D, 2), k0 = random_vec(D, 3);
  auto dot_at = [&](int pq, int pk) {
    auto q = q0, k = k0;
    kernels::rope_cpu(q.data(), 1, 1, D, &pq, inv.data(), false);
    kernels::rope_cpu(k.data(), 1, 1, D, &pk, inv.data(), false);
    double s = 0;
    for (int i = 0; i < D; ++i) s += double(q[i]) * k[i];
    return s;
  };
  EXPECT_NEAR(dot_at(10, 3), dot_at(107, 100), 1e-3);
  EXPECT_NEAR(dot_at(50, 50), dot_at(0, 0), 1e-3);
}

// rope_sincos against the exactly rounded fp32 values (long double sinl / cosl of the fp32
// angle) at the angles of positions up to 2M, pairs of theta 1e4 and 5e5 at d 128: equal but
// for rare double roundings, never more than one fp32 ulp away. The C library's sinf / cosf
// miss about 1.3 % of them.
TEST(Rope, SinCosAreTheExactlyRoundedValuesNearlyAlways) {
  long total = 0, off = 0;
  for (const double theta : {1e4, 5e5}) {
    RopeParams rope;
    rope.theta = theta;
    const auto inv = rope_inv_freq(rope, 128);
    for (int32_t p = 0; p < 2000000; p += 97) {
      for (size_t i = 0; i < inv.size(); i += 3) {
        const float angle = float(p) * inv[i];
        float s, c;
        kernels::rope_sincos(angle, s, c);
        const float es = float(sinl((long double)angle)), ec = float(cosl((long double)angle));
        for (const auto& [got, want] : {std::pair{s, es}, std::pair{c, ec}}) {
          ++total;
          if (got == want) continue;
          ++off;
          ASSERT_TRUE(got == std::nextafter(want, 2.f) || got == std::nextafter(want, -2.f))
              << "angle " << angle << ": " << got << " against " << want;
        }
      }
    }
  }
  float s0, c0;
  kernels::rope_sincos(0.f, s0, c0);
  EXPECT_EQ(s0, 0.f);
  EXPECT_EQ(c0, 1.f);
  EXPECT_LT(off, total / 10000) << off << " of " << total << " values off by one ulp";
}

TEST(Rope, DefaultFrequencies) {
  RopeParams rope;
  rope.theta = 10000.0;
  const auto inv = rope_inv_freq(rope, 128);
  ASSERT_EQ(inv.size(), 64u);
  EXPECT_FLOAT_EQ(inv[0], 1.0f);
  EXPECT_NEAR(inv[32], 1.0 / std::pow(10000.0, 0.5), 1e-7);
  for (size_t i = 1; i < inv.size(); ++i) EXPECT_LT(inv[i], inv[i - 1]);
}

TEST(Rope, Llama3ScalingBands) {
  // Llama-3.1-8B's rope_scaling: factor 8, low 1, high 4, original context 8192.
  RopeParams base;
  base.theta = 500000.0;
  RopeParams l3 = base;
  l3.type = RopeType::Llama3;
  l3.factor = 8.0;
  l3.low_freq_factor = 1.0;
  l3.high_freq_factor = 4.0;
  l3.original_max_position = 8192;
  const auto a = rope_inv_freq(base, 128), b = rope_inv_freq(l3, 128);
  const double pi = 3.14159265358979323846;
  int unchanged = 0, divided = 0, blended = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double wavelen = 2 * pi / a[i];
    if (wavelen < 8192.0 / 4) {
      EXPECT_FLOAT_EQ(b[i], a[i]) << i;
      ++unchanged;
    } else if (wavelen > 8192.0) {
      EXPECT_FLOAT_EQ(b[i], a[i] / 8.0f) << i;
      ++divided;
    } else {
      EXPECT_LT(b[i], a[i]) << i;
      EXPECT_GT(b[i], a[i] / 8.0f) << i;
      ++blended;
    }
  }
  EXPECT_GT(unchanged, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
}

TEST(Rope, LinearScalingDividesFrequencies) {
  RopeParams lin;
  lin.type = RopeType::Linear;
  lin.factor = 4.0;
  const auto a = rope_inv_freq(RopeParams{}, 64), b = rope_inv_freq(lin, 64);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_FLOAT_EQ(b[i], a[i] / 4.0f);
}

TEST(ModelShape, ValidateNamesTheBadField) {
  ModelShape s;
  s.num_layers = 4;
  s.num_q_heads = 8;
  s.num_kv_heads = 3;
  s.head_dim = 128;
  s.max_position = 4096;
  try {
    s.validate();
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("num_kv_heads"), std::string::npos) << e.what();
  }
  s.num_kv_heads = 2;
  EXPECT_NO_THROW(s.validate());
  EXPECT_THROW(rope_type_from_string("yarn"), std::invalid_argument);
}

TEST(ModelShape, FingerprintTracksAttentionFields) {
  ModelShape a;
  a.num_layers = 4;
  a.num_q_heads = 8;
  a.num_kv_heads = 2;
  a.head_dim = 128;
  a.max_position = 32768;
  a.rope.theta = 500000;
  ModelShape b = a;
  b.name = "another name";
  EXPECT_EQ(a.fingerprint(), b.fingerprint());
  EXPECT_TRUE(a.diff(b).empty());
  b.rope.theta = 10000;
  EXPECT_NE(a.fingerprint(), b.fingerprint());
  EXPECT_NE(a.diff(b).find("theta"), std::string::npos) << a.diff(b);
}

}  // namespace
}  // namespace kvs
