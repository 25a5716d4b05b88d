// The CPU dense reference on hand-made cases with known answers, and its agreement with
// splitting the keys and merging the parts.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/common/merge_states.h"
#include "kernels/dense/dense_decode.h"
#include "kernels/dense/dense_plan.h"

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
  kernels::attend_cpu(q.data(), kv, 0, 0, even.data(), int(even.size()), 0.125, acc.data(),
                      &lse_acc);
  kernels::attend_cpu(q.data(), kv, 0, 0, odd.data(), int(odd.size()), 0.125, part.data(),
                      &lse_part);
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
// The plan's 32-bit rounds against the 64-bit tokens they replace (dense_plan.h): equal below
// 2^31 rounds, never smaller above (the item bound needs the chunk at least that large).
namespace {

namespace dense_plan = kernels::dense_plan;

// The former plan_chunk arithmetic: ceil(tokens / per_head) rounded up to align, in
// [align, 2^30].
int64_t chunk_tokens_64(int64_t tokens, int per_head, int align) {
  const int64_t q = (tokens + per_head - 1) / per_head;
  const int64_t c = (q + align - 1) / align * align;
  return c < align ? align : c > dense_plan::kMaxChunkTokens ? dense_plan::kMaxChunkTokens : c;
}

void check_plan(int64_t tokens, int per_head, int shift) {
  const int align = 1 << shift, cap = dense_plan::kMaxChunkTokens >> shift;
  const int64_t rounds = (tokens + align - 1) >> shift;
  const int64_t ours = int64_t(dense_plan::rounds_per_chunk(rounds, per_head, cap)) << shift;
  const int64_t exact = chunk_tokens_64(tokens, per_head, align);
  if (rounds < (int64_t(1) << 31))
    ASSERT_EQ(ours, exact) << tokens << " tokens, " << per_head << " per head, align " << align;
  else
    ASSERT_GE(ours, exact) << tokens << " tokens, " << per_head << " per head, align " << align;
}

}  // namespace

TEST(DensePlan, RoundsMatchTheSixtyFourBitChunk) {
  std::mt19937_64 rng(5);
  for (const int shift : {6, 7}) {
    for (int per_head = 1; per_head <= 512; ++per_head) {
      const int64_t align = int64_t(1) << shift;
      // Small totals, totals around multiples of per_head x align, the 2^31-round edge, the
      // cap's edge and random ones up to 2^40 (shared pages).
      for (int64_t t = 0; t <= 300; ++t) check_plan(t, per_head, shift);
      for (int64_t k = 1; k <= 40; ++k)
        for (int64_t d = -1; d <= 1; ++d) check_plan(k * per_head * align + d, per_head, shift);
      for (int64_t d = -2; d <= 2; ++d) {
        check_plan(((int64_t(1) << 31) << shift) + d, per_head, shift);
        check_plan(int64_t(dense_plan::kMaxChunkTokens) * per_head + d, per_head, shift);
      }
      std::uniform_int_distribution<int64_t> any(0, int64_t(1) << 40);
      for (int i = 0; i < 200; ++i) check_plan(any(rng), per_head, shift);
    }
  }
}

// The growth step: chunk x items tokens over the heads' chunks, the same way.
TEST(DensePlan, GrowthMatchesTheSixtyFourBitChunk) {
  std::mt19937_64 rng(9);
  for (const int shift : {6, 7}) {
    const int cap = dense_plan::kMaxChunkTokens >> shift;
    std::uniform_int_distribution<int> chunks(1, cap), items(1, 1 << 16), heads(1, 512);
    for (int i = 0; i < 200000; ++i) {
      const int chunk = i % 3 == 0 ? 1 + i % 4096 : chunks(rng), n = items(rng), h = heads(rng);
      check_plan((int64_t(chunk) << shift) * n, h, shift);
    }
  }
}

}  // namespace kvs
