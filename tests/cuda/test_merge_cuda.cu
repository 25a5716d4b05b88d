// merge_states_cuda, merge_state_in_place_cuda and the device StateAccumulator's batched
// folds against merge_state_cpu on random states, empty (lse = -inf) ones included, whose o
// is NaN so that weighting them by 0 would show.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/common/merge_states.cuh"
#include "kernels/common/merge_states.h"
#include "tests/cuda/cuda_test_util.h"

namespace kvs {
namespace {

using test::DeviceBuffer;
constexpr float kInf = std::numeric_limits<float>::infinity();

// Random states [num_states, rows, head_dim]: lse in [-8, 25], ~25% empty, and rows 0 and
// 1 entirely empty / entirely one non-empty state.
void random_states(int num_states, int rows, int head_dim, std::mt19937_64& rng,
                   std::vector<float>* v, std::vector<float>* s) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> lse_dist(-8.f, 25.f), uni(0.f, 1.f);
  v->resize(size_t(num_states) * rows * head_dim);
  s->resize(size_t(num_states) * rows);
  for (int i = 0; i < num_states; ++i) {
    for (int r = 0; r < rows; ++r) {
      bool empty = uni(rng) < 0.25f;
      if (r == 0) empty = true;
      if (r == 1) empty = i != num_states / 2;
      const size_t sr = size_t(i) * rows + r;
      (*s)[sr] = empty ? -kInf : lse_dist(rng);
      for (int d = 0; d < head_dim; ++d)
        (*v)[sr * head_dim + d] = empty ? std::nanf("") : normal(rng);
    }
  }
}

struct MergeCase {
  int num_states, rows, head_dim;
};

class MergeStatesCuda : public ::testing::TestWithParam<MergeCase> {};

TEST_P(MergeStatesCuda, MatchesCpuMerge) {
  KVS_SKIP_WITHOUT_CUDA();
  const MergeCase mc = GetParam();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<float> v, s;
  random_states(mc.num_states, mc.rows, mc.head_dim, rng, &v, &s);

  DeviceBuffer<float> dv(v), ds(s), dv_out(size_t(mc.rows) * mc.head_dim), ds_out(mc.rows);
  dv_out.poison();
  ds_out.poison();
  ASSERT_EQ(kernels::merge_states_cuda(dv.get(), ds.get(), mc.num_states, mc.rows, mc.head_dim,
                                       dv_out.get(), ds_out.get(), nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto v_out = dv_out.download();
  const auto s_out = ds_out.download();

  for (int r = 0; r < mc.rows; ++r) {
    std::vector<double> o(mc.head_dim, 0.0);
    double lse = -std::numeric_limits<double>::infinity();
    for (int i = 0; i < mc.num_states; ++i) {
      const size_t sr = size_t(i) * mc.rows + r;
      std::vector<double> ob(v.begin() + sr * mc.head_dim, v.begin() + (sr + 1) * mc.head_dim);
      kernels::merge_state_cpu<double>(o.data(), &lse, ob.data(), s[sr], mc.head_dim);
    }
    if (std::isinf(lse)) {
      EXPECT_EQ(s_out[r], -kInf) << "row " << r;
      for (int d = 0; d < mc.head_dim; ++d)
        ASSERT_EQ(v_out[size_t(r) * mc.head_dim + d], 0.f) << "row " << r << " dim " << d;
      continue;
    }
    EXPECT_NEAR(s_out[r], lse, 1e-5 * std::max(1.0, std::abs(lse))) << "row " << r;
    for (int d = 0; d < mc.head_dim; ++d)
      ASSERT_NEAR(v_out[size_t(r) * mc.head_dim + d], o[d], 1e-5 * (1.0 + std::abs(o[d])))
          << "row " << r << " dim " << d;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, MergeStatesCuda,
                         ::testing::Values(MergeCase{1, 9, 64}, MergeCase{2, 33, 128},
                                           MergeCase{7, 50, 128}, MergeCase{40, 17, 64},
                                           MergeCase{5, 6, 100}),
                         [](const ::testing::TestParamInfo<MergeCase>& info) {
                           return "states" + std::to_string(info.param.num_states) + "_rows" +
                                  std::to_string(info.param.rows) + "_d" +
                                  std::to_string(info.param.head_dim);
                         });

// One warp per row, 4 dims per lane (head_dim 128). Fold A: the row's states in batches of
// 8 (StateAccumulator::add_batch over states, the last batch padded with empty states).
// Fold B: the even and the odd states into two accumulators, then both (and an empty one)
// through add_batch over accumulators. Both write the normalized o and the lse.
constexpr int kAccPer = 4, kAccBatch = 8;

__global__ void batched_fold_kernel(const float* v, const float* s, int num_states, int rows,
                                    float* v_a, float* s_a, float* v_b, float* s_b) {
  const int row = blockIdx.x, lane = threadIdx.x;
  const int head_dim = 32 * kAccPer;
  auto load = [&](int i, float(&x)[kAccPer]) {
    for (int k = 0; k < kAccPer; ++k)
      x[k] = v[(int64_t(i) * rows + row) * head_dim + lane * kAccPer + k];
  };
  kernels::StateAccumulator<kAccPer> a;
  for (int i0 = 0; i0 < num_states; i0 += kAccBatch) {
    float lse[kAccBatch], o[kAccBatch][kAccPer];
    for (int k = 0; k < kAccBatch; ++k) {
      const int i = i0 + k;
      lse[k] = -INFINITY;
      for (int e = 0; e < kAccPer; ++e) o[k][e] = NAN;  // a padding state's o: never used
      if (i < num_states) {
        lse[k] = s[int64_t(i) * rows + row];
        load(i, o[k]);
      }
    }
    a.add_batch(lse, o);
  }
  kernels::StateAccumulator<kAccPer> parts[3];  // even, odd, and one left empty
  for (int i = 0; i < num_states; ++i) {
    float lse[1] = {s[int64_t(i) * rows + row]}, o[1][kAccPer];
    load(i, o[0]);
    parts[i % 2].add_batch(lse, o);
  }
  kernels::StateAccumulator<kAccPer> b;
  b.add_batch(parts);
  float oa[kAccPer], ob[kAccPer];
  a.normalized(oa);
  b.normalized(ob);
  for (int k = 0; k < kAccPer; ++k) {
    v_a[int64_t(row) * head_dim + lane * kAccPer + k] = oa[k];
    v_b[int64_t(row) * head_dim + lane * kAccPer + k] = ob[k];
  }
  if (lane == 0) {
    s_a[row] = a.lse.lse();
    s_b[row] = b.lse.lse();
  }
}

TEST(StateAccumulatorCuda, BatchedFoldsMatchCpuMerge) {
  KVS_SKIP_WITHOUT_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int num_states = 21, rows = 40, head_dim = 32 * kAccPer;
  std::vector<float> v, s;
  random_states(num_states, rows, head_dim, rng, &v, &s);
  DeviceBuffer<float> dv(v), ds(s);
  DeviceBuffer<float> va(size_t(rows) * head_dim), sa(rows), vb(size_t(rows) * head_dim), sb(rows);
  for (auto* buf : {&va, &sa, &vb, &sb}) buf->poison();
  batched_fold_kernel<<<rows, 32>>>(dv.get(), ds.get(), num_states, rows, va.get(), sa.get(),
                                    vb.get(), sb.get());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto v_a = va.download(), s_a = sa.download(), v_b = vb.download(), s_b = sb.download();
  for (int r = 0; r < rows; ++r) {
    std::vector<double> o(head_dim, 0.0);
    double lse = -std::numeric_limits<double>::infinity();
    for (int i = 0; i < num_states; ++i) {
      const size_t sr = size_t(i) * rows + r;
      std::vector<double> ob(v.begin() + sr * head_dim, v.begin() + (sr + 1) * head_dim);
      kernels::merge_state_cpu<double>(o.data(), &lse, ob.data(), s[sr], head_dim);
    }
    for (const auto& [name, v_out, s_out] :
         {std::tuple{"batches of states", &v_a, &s_a}, std::tuple{"accumulators", &v_b, &s_b}}) {
      SCOPED_TRACE(std::string(name) + ", row " + std::to_string(r));
      if (std::isinf(lse)) {
        EXPECT_EQ((*s_out)[r], -kInf);
        for (int d = 0; d < head_dim; ++d) ASSERT_EQ((*v_out)[size_t(r) * head_dim + d], 0.f);
        continue;
      }
      EXPECT_NEAR((*s_out)[r], lse, 1e-5 * std::max(1.0, std::abs(lse)));
      for (int d = 0; d < head_dim; ++d)
        ASSERT_NEAR((*v_out)[size_t(r) * head_dim + d], o[d], 1e-5 * (1.0 + std::abs(o[d])))
            << "dim " << d;
    }
  }
}

TEST(MergeStatesCuda, NoStatesGiveEmptyRows) {
  KVS_SKIP_WITHOUT_CUDA();
  DeviceBuffer<float> dv_out(3 * 64), ds_out(3);
  dv_out.poison();
  ds_out.poison();
  ASSERT_EQ(
      kernels::merge_states_cuda(nullptr, nullptr, 0, 3, 64, dv_out.get(), ds_out.get(), nullptr),
      cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (float x : dv_out.download()) ASSERT_EQ(x, 0.f);
  for (float x : ds_out.download()) ASSERT_EQ(x, -kInf);
  EXPECT_EQ(kernels::merge_states_cuda(nullptr, nullptr, 1, 3, 64, dv_out.get(), nullptr, nullptr),
            cudaErrorInvalidValue);
}

TEST(MergeStateInPlaceCuda, MatchesCpuMerge) {
  KVS_SKIP_WITHOUT_CUDA();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int rows = 71, head_dim = 128;
  std::vector<float> v, s;
  random_states(2, rows, head_dim, rng, &v, &s);
  // State a empty with a finite, recognisable o on row 2 (both empty there: o untouched).
  for (int d = 0; d < head_dim; ++d) v[size_t(2) * head_dim + d] = float(d);
  std::vector<float> va(v.begin(), v.begin() + size_t(rows) * head_dim),
      sa(s.begin(), s.begin() + rows);
  std::vector<float> vb(v.begin() + size_t(rows) * head_dim, v.end()),
      sb(s.begin() + rows, s.end());
  s[2] = sa[2] = sb[2] = -kInf;

  DeviceBuffer<float> dva(va), dsa(sa), dvb(vb), dsb(sb);
  ASSERT_EQ(kernels::merge_state_in_place_cuda(dva.get(), dsa.get(), dvb.get(), dsb.get(), rows,
                                               head_dim, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto v_out = dva.download();
  const auto s_out = dsa.download();
  for (int r = 0; r < rows; ++r) {
    float* o = va.data() + size_t(r) * head_dim;
    kernels::merge_state_cpu<float>(o, &sa[r], vb.data() + size_t(r) * head_dim, sb[r], head_dim);
    if (std::isinf(sa[r])) {
      EXPECT_EQ(s_out[r], -kInf) << "row " << r;
    } else {
      EXPECT_NEAR(s_out[r], sa[r], 1e-5f * std::max(1.f, std::abs(sa[r]))) << "row " << r;
    }
    for (int d = 0; d < head_dim; ++d) {
      const float got = v_out[size_t(r) * head_dim + d];
      if (std::isnan(o[d])) {  // both empty and a's o was NaN: untouched
        ASSERT_TRUE(std::isnan(got)) << "row " << r << " dim " << d;
      } else {
        ASSERT_NEAR(got, o[d], 1e-5f * (1.f + std::abs(o[d]))) << "row " << r << " dim " << d;
      }
    }
  }
}

}  // namespace
}  // namespace kvs
