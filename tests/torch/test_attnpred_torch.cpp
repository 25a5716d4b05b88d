// The CNN of the runtime (kernels/attnpred, CPU reference; the CUDA kernels match it to fp32
// rounding, tests/cuda) against libtorch's Conv2d / mean / Conv1d on the same packed weights,
// with the convs' operands rounded to fp16 as the runtime defines it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <random>

#include "kernels/attnpred/attnpred.h"

namespace kvs {
namespace {

namespace ap = kernels::attnpred;

torch::Tensor torch_cnn(const std::vector<float>& p, const torch::Tensor& x) {
  auto t = [&](int off, std::vector<int64_t> shape) {
    return torch::from_blob(const_cast<float*>(p.data()) + off, shape, torch::kFloat32).clone();
  };
  // The convs' operands in fp16 (attnpred.h numerics), their sums in fp32.
  auto fp16 = [](const torch::Tensor& v) { return v.to(torch::kHalf).to(torch::kFloat32); };
  torch::Tensor h = torch::conv2d(fp16(x.unsqueeze(1)), fp16(t(ap::kParamW1, {16, 1, 3, 3})),
                                  t(ap::kParamB1, {16}), 1, 1);
  h = fp16(torch::relu(h));
  h = torch::relu(
      torch::conv2d(h, fp16(t(ap::kParamW2, {32, 16, 3, 3})), t(ap::kParamB2, {32}), 1, 1));
  h = h.mean(2);
  return torch::conv1d(h, t(ap::kParamW3, {1, 32, 1}), t(ap::kParamB3, {1})).squeeze(1);
}

TEST(AttnPredTorch, CnnMatchesLibtorchOnTheSameWeights) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 0.3f);
  std::uniform_real_distribution<float> u(0.f, 0.2f);
  std::vector<float> p(ap::kParamCount);
  for (auto& w : p) w = nd(rng);
  for (int W : {1, 3, 17, 64, 130}) {
    const int n = 3, H = 64;
    std::vector<float> x(size_t(n) * H * W);
    for (auto& v : x) v = u(rng);
    std::vector<float> y(size_t(n) * W);
    ap::cnn_forward_cpu(p.data(), x.data(), n, H, W, y.data());
    const torch::Tensor ref =
        torch_cnn(p, torch::from_blob(x.data(), {n, H, W}, torch::kFloat32)).contiguous();
    ASSERT_EQ(ref.numel(), int64_t(y.size()));
    const float* r = ref.data_ptr<float>();
    for (size_t i = 0; i < y.size(); ++i)
      ASSERT_NEAR(y[i], r[i], 1e-5f + 1e-5f * std::abs(r[i])) << "W " << W << " at " << i;
  }
}

TEST(AttnPredTorch, ShortHistoryIsZeroPaddedInTime) {
  // H = 5 rows of which the first 2 are zero is what the runtime feeds early on: the CNN
  // definition must not special-case them (same as libtorch on the zero rows).
  std::vector<float> p(ap::kParamCount, 0.05f);
  std::vector<float> x(5 * 4, 0.f);
  for (int i = 8; i < 20; ++i) x[size_t(i)] = 0.01f * float(i);
  std::vector<float> y(4);
  ap::cnn_forward_cpu(p.data(), x.data(), 1, 5, 4, y.data());
  const torch::Tensor ref = torch_cnn(p, torch::from_blob(x.data(), {1, 5, 4}, torch::kFloat32));
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(y[size_t(i)], ref[0][i].item<float>(), 1e-6f);
}

}  // namespace
}  // namespace kvs
