// rope_cuda against rope_cpu and its own inverse, on strided bf16 rows.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/common/rope.h"
#include "tests/cuda/cuda_test_util.h"

namespace kvs {
namespace {

using test::DeviceBuffer;

struct RopeData {
  int tokens, heads, dim;
  int64_t stride;
  std::vector<bf16> x;  // [tokens, stride], gaps past heads * dim hold a sentinel
  std::vector<int32_t> pos;
  std::vector<float> inv_freq;
};

constexpr uint16_t kSentinel = 0x1234;

RopeData make_rope_data(int tokens, int heads, int dim, int gap, std::mt19937_64& rng) {
  RopeData r{tokens, heads, dim, int64_t(heads) * dim + gap, {}, {}, {}};
  std::normal_distribution<float> normal(0.f, 2.f);
  std::uniform_int_distribution<int32_t> pos(0, 300000);
  r.x.assign(size_t(tokens) * r.stride, bf16{kSentinel});
  for (int t = 0; t < tokens; ++t)
    for (int i = 0; i < heads * dim; ++i)
      r.x[size_t(t) * r.stride + i] = float_to_bf16(normal(rng));
  for (int t = 0; t < tokens; ++t) r.pos.push_back(t < 3 ? t : pos(rng));
  for (int i = 0; i < dim / 2; ++i) r.inv_freq.push_back(float(std::pow(500000.0, -2.0 * i / dim)));
  return r;
}

class RopeCuda : public ::testing::TestWithParam<int> {};

TEST_P(RopeCuda, MatchesCpuAndInverts) {
  KVS_SKIP_WITHOUT_CUDA();
  const int dim = GetParam();
  const uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  RopeData r = make_rope_data(37, 5, dim, 24, rng);

  DeviceBuffer<bf16> dx(r.x);
  DeviceBuffer<int32_t> dpos(r.pos);
  DeviceBuffer<float> dfreq(r.inv_freq);
  ASSERT_EQ(kernels::rope_cuda(dx.get(), r.tokens, r.heads, dim, r.stride, dpos.get(), dfreq.get(),
                               false, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto rotated = dx.download();

  // CPU on the same bf16 inputs in fp32, with the same sin and cos (rope_sincos) and the same
  // separately rounded products; the GPU rounds once to bf16 at the end: every element equal
  // to bf16(CPU).
  std::vector<float> ref(size_t(r.tokens) * r.heads * dim);
  for (int t = 0; t < r.tokens; ++t)
    for (int i = 0; i < r.heads * dim; ++i)
      ref[size_t(t) * r.heads * dim + i] = bf16_to_float(r.x[size_t(t) * r.stride + i]);
  kernels::rope_cpu(ref.data(), r.tokens, r.heads, dim, r.pos.data(), r.inv_freq.data(), false);
  int exact = 0, total = 0;
  for (int t = 0; t < r.tokens; ++t) {
    for (int i = 0; i < r.stride; ++i) {
      const bf16 got = rotated[size_t(t) * r.stride + i];
      if (i >= r.heads * dim) {
        ASSERT_EQ(got.bits, kSentinel) << "token " << t << " wrote past its row at " << i;
        continue;
      }
      const float want = ref[size_t(t) * r.heads * dim + i];
      const float g = bf16_to_float(got);
      ASSERT_NEAR(g, want, std::abs(want) * 0x1p-8f + 1e-6f) << "token " << t << " elem " << i;
      exact += got.bits == float_to_bf16(want).bits;
      ++total;
    }
  }
  EXPECT_EQ(exact, total) << "bf16 results should equal bf16(CPU)";

  ASSERT_EQ(kernels::rope_cuda(dx.get(), r.tokens, r.heads, dim, r.stride, dpos.get(), dfreq.get(),
                               true, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto back = dx.download();
  for (int t = 0; t < r.tokens; ++t) {
    for (int h = 0; h < r.heads; ++h) {
      for (int i = 0; i < dim / 2; ++i) {
        const size_t base = size_t(t) * r.stride + size_t(h) * dim;
        const float a = bf16_to_float(r.x[base + i]), b = bf16_to_float(r.x[base + i + dim / 2]);
        const float tol = 0x1p-7f * std::hypot(a, b) + 1e-6f;  // two bf16 roundings
        ASSERT_NEAR(bf16_to_float(back[base + i]), a, tol) << "token " << t << " pair " << i;
        ASSERT_NEAR(bf16_to_float(back[base + i + dim / 2]), b, tol)
            << "token " << t << " pair " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(HeadDims, RopeCuda, ::testing::Values(64, 128));

TEST(RopeCudaArgs, RejectsBadShapes) {
  KVS_SKIP_WITHOUT_CUDA();
  DeviceBuffer<bf16> dx(64);
  DeviceBuffer<int32_t> dpos(1);
  DeviceBuffer<float> dfreq(32);
  EXPECT_EQ(kernels::rope_cuda(dx.get(), 1, 1, 63, 63, dpos.get(), dfreq.get(), false, nullptr),
            cudaErrorInvalidValue)
      << "odd head_dim";
  EXPECT_EQ(kernels::rope_cuda(dx.get(), 1, 2, 64, 64, dpos.get(), dfreq.get(), false, nullptr),
            cudaErrorInvalidValue)
      << "token_stride shorter than a token";
  EXPECT_EQ(kernels::rope_cuda(dx.get(), 0, 1, 64, 64, dpos.get(), dfreq.get(), false, nullptr),
            cudaSuccess)
      << "no tokens is a no-op";
}

}  // namespace
}  // namespace kvs
