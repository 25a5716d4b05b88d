// The CPU dense reference on hand-made cases with known answers, and its agreement with
// splitting the keys and merging the parts.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/common/merge_states.h"
#include "kernels/dense/dense_decode.h"

namespace kvs {
namespace {

// A contiguous one-sequence cache (page_size = capacity) filled from float values.
struct SmallCache {
  std::vector<bf16> k, v;
  std::vector<int32_t> table{0}, lens;
  PagedKV view(int len, int heads, int d) {
    lens = {len};
    PagedKV kv;
    kv.k = k.data();
    kv.v = v.data();
    kv.page_table = table.data();
    kv.seq_lens = lens.data();
    kv.batch = 1;
    kv.num_pages = 1;
    kv.page_size = len;
    kv.num_kv_heads = heads;
    kv.head_dim = d;
    kv.max_pages_per_seq = 1;
    return kv;
  }
};

TEST(DenseCpu, SingleTokenReturnsItsValue) {
  const int d = 4;
  SmallCache c;
  for (float x : {1.f, 2.f, 0.f, -1.f}) c.k.push_back(float_to_bf16(x));
  for (float x : {0.5f, -2.f, 3.f, 8.f}) c.v.push_back(float_to_bf16(x));
  const auto kv = c.view(1, 1, d);
  const float q[4] = {1.f, 1.f, 1.f, 1.f};
  double o[4], lse;
  kernels::attend_cpu(q, kv, 0, 0, nullptr, 0, 0.5, o, &lse);
  EXPECT_DOUBLE_EQ(lse, 0.5 * (1 + 2 + 0 - 1));
  EXPECT_DOUBLE_EQ(o[0], 0.5);
  EXPECT_DOUBLE_EQ(o[3], 8.0);
}

TEST(DenseCpu, EqualScoresAverageValues) {
  const int d = 2, n = 4;
  SmallCache c;
  for (int t = 0; t < n; ++t) {
    c.k.push_back(float_to_bf16(1.f));
    c.k.push_back(float_to_bf16(0.f));
    c.v.push_back(float_to_bf16(float(t)));
    c.v.push_back(float_to_bf16(1.f));
  }
  const auto kv = c.view(n, 1, d);
  const float q[2] = {3.f, 5.f};
  double o[2], lse;
  kernels::attend_cpu(q, kv, 0, 0, nullptr, 0, 1.0, o, &lse);
  EXPECT_NEAR(lse, 3.0 + std::log(4.0), 1e-12);
  EXPECT_NEAR(o[0], 1.5, 1e-12);
  EXPECT_NEAR(o[1], 1.0, 1e-12);
}

TEST(DenseCpu, EmptySetHasMinusInfinityLse) {
  SmallCache c;
  c.k.resize(8, float_to_bf16(1.f));
  c.v.resize(8, float_to_bf16(1.f));
  const auto kv = c.view(1, 1, 8);
  const float q[8] = {};
  double o[8], lse;
  kernels::attend_cpu(q, kv, 0, 0, c.table.data(), 0, 1.0, o, &lse);
  EXPECT_EQ(lse, -std::numeric_limits<double>::infinity());
  for (double x : o) EXPECT_EQ(x, 0.0);
}

TEST(DenseCpu, SplitAndMergeEqualsWhole) {
  const int d = 64, n = 301;
  std::mt19937 gen(7);
  std::normal_distribution<float> dist(0.f, 1.f);
  SmallCache c;
  for (int i = 0; i < n * d; ++i) {
    c.k.push_back(float_to_bf16(dist(gen)));
    c.v.push_back(float_to_bf16(dist(gen)));
  }
  const auto kv = c.view(n, 1, d);
  std::vector<float> q(d);
  for (auto& x : q) x = dist(gen);
  std::vector<double> whole(d), part(d);
  double lse_whole, lse_part;
  kernels::attend_cpu(q.data(), kv, 0, 0, nullptr, 0, 0.125, whole.data(), &lse_whole);

  std::vector<int32_t> even, odd;
  for (int t = 0; t < n; ++t) (t % 3 == 0 ? even : odd).push_back(t);
  std::vector<double> acc(d);
  double lse_acc;
  kernels::attend_cpu(q.data(), kv, 0, 0, even.data(), int(even.size()), 0.125, acc.data(), &lse_acc);
  kernels::attend_cpu(q.data(), kv, 0, 0, odd.data(), int(odd.size()), 0.125, part.data(), &lse_part);
  kernels::merge_state_cpu(acc.data(), &lse_acc, part.data(), lse_part, d);
  // Merging with an empty state changes nothing.
  kernels::merge_state_cpu(acc.data(), &lse_acc, part.data(),
                           -std::numeric_limits<double>::infinity(), d);
  EXPECT_NEAR(lse_acc, lse_whole, 1e-12);
  for (int i = 0; i < d; ++i) EXPECT_NEAR(acc[i], whole[i], 1e-12) << i;
}

TEST(DenseCpu, GroupedQueryHeadsReadTheirKvHead) {
  // Two kv heads with different values; query heads 0,1 -> kv 0 and 2,3 -> kv 1.
  const int d = 2, hkv = 2, hq = 4;
  SmallCache c;
  for (int h = 0; h < hkv; ++h) {
    c.k.push_back(float_to_bf16(0.f));
    c.k.push_back(float_to_bf16(0.f));
    c.v.push_back(float_to_bf16(float(h + 1)));
    c.v.push_back(float_to_bf16(float(10 * (h + 1))));
  }
  const auto kv = c.view(1, hkv, d);
  std::vector<bf16> q(hq * d, float_to_bf16(1.f));
  std::vector<float> o(hq * d), lse(hq);
  kernels::dense_decode_cpu(q.data(), hq, kv, 1.f, o.data(), lse.data());
  EXPECT_EQ(o[0 * d], 1.f);
  EXPECT_EQ(o[1 * d + 1], 10.f);
  EXPECT_EQ(o[2 * d], 2.f);
  EXPECT_EQ(o[3 * d + 1], 20.f);
  EXPECT_EQ(lse[3], 0.f);
}

}  // namespace
}  // namespace kvs
