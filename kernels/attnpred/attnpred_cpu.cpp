// CPU reference of AttentionPredictor's kernels (attnpred.h). This file is compiled with
// -ffp-contract=off. The CNN follows attnpred.h's numerics; the CUDA kernels sum the convs on
// the tensor cores, in another order, so the two agree to fp32 rounding.
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

#include "kernels/attnpred/attnpred.h"
#include "kernels/common/e4m3.h"
#include "kernels/common/int_rows.h"

namespace kvs::kernels::attnpred {

void validate(const Geometry& g) {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("attnpred geometry: " + what);
  };
  need(g.history >= 1, "history must be >= 1, got " + std::to_string(g.history));
  need(g.block >= 1, "block must be >= 1, got " + std::to_string(g.block));
  need(g.sink >= 0 && g.sink % g.block == 0, "sink must be a non-negative multiple of block " +
                                                 std::to_string(g.block) + ", got " +
                                                 std::to_string(g.sink));
  need(g.recent >= 0 && g.recent % g.block == 0,
       "recent must be a non-negative multiple of block " + std::to_string(g.block) + ", got " +
           std::to_string(g.recent));
}

namespace {
// x rounded to fp16 (nearest even), as a float.
float to_half(float x) { return __half2float(__float2half_rn(x)); }
constexpr double kFixed = 4294967296.0;  // 2^32: the time sum's fixed point
}  // namespace

void cnn_forward_cpu(const float* p, const float* x, int n, int H, int W, float* y) {
  if (n < 0 || H < 1 || W < 0)
    throw std::invalid_argument("cnn_forward_cpu: bad input shape [" + std::to_string(n) + ", " +
                                std::to_string(H) + ", " + std::to_string(W) + "]");
  constexpr int C1 = kConv1Channels, C2 = kConv2Channels;
  std::vector<float> w1(p + kParamW1, p + kParamB1), w2(p + kParamW2, p + kParamB2);
  for (float& v : w1) v = to_half(v);
  for (float& v : w2) v = to_half(v);
  // The input and relu(conv1) with a border of zeros (the convs' padding), so that every
  // output column runs the same branch-free loop. Each output element still sums its terms
  // in the order attnpred.h defines (bias, then input channel, dy, dx); the loops over
  // columns are innermost only so that the compiler can vectorize across columns.
  const int PW = W + 2;
  std::vector<float> in_pad(size_t(H + 2) * PW, 0.f), c1(size_t(C1) * (H + 2) * PW, 0.f);
  std::vector<float> acc(static_cast<size_t>(W)), s_r(static_cast<size_t>(W));
  std::vector<long long> time_sum(static_cast<size_t>(W));
  for (int s = 0; s < n; ++s) {
    const float* in = x + int64_t(s) * H * W;
    for (int r = 0; r < H; ++r)
      for (int c = 0; c < W; ++c) in_pad[size_t(r + 1) * PW + c + 1] = to_half(in[r * W + c]);
    for (int ci = 0; ci < C1; ++ci)
      for (int r = 0; r < H; ++r) {
        std::fill(acc.begin(), acc.end(), p[kParamB1 + ci]);
        for (int dy = 0; dy < 3; ++dy)
          for (int dx = 0; dx < 3; ++dx) {
            const float w = w1[size_t(ci * 9 + dy * 3 + dx)];
            const float* src = in_pad.data() + size_t(r + dy) * PW + dx;
            for (int c = 0; c < W; ++c) acc[size_t(c)] = acc[size_t(c)] + w * src[c];
          }
        float* dst = c1.data() + (size_t(ci) * (H + 2) + r + 1) * PW + 1;
        for (int c = 0; c < W; ++c) dst[c] = to_half(acc[size_t(c)] > 0.f ? acc[size_t(c)] : 0.f);
      }
    // Row r's projection s_r = sum_co w3[co] relu(conv2[co, r]), then the exact fixed-point
    // time sum (attnpred.h numerics).
    std::fill(time_sum.begin(), time_sum.end(), 0ll);
    for (int r = 0; r < H; ++r) {
      std::fill(s_r.begin(), s_r.end(), 0.f);
      for (int co = 0; co < C2; ++co) {
        std::fill(acc.begin(), acc.end(), p[kParamB2 + co]);
        for (int ci = 0; ci < C1; ++ci)
          for (int dy = 0; dy < 3; ++dy)
            for (int dx = 0; dx < 3; ++dx) {
              const float w = w2[size_t((co * C1 + ci) * 9 + dy * 3 + dx)];
              const float* src = c1.data() + (size_t(ci) * (H + 2) + r + dy) * PW + dx;
              for (int c = 0; c < W; ++c) acc[size_t(c)] = acc[size_t(c)] + w * src[c];
            }
        const float w3 = p[kParamW3 + co];
        for (int c = 0; c < W; ++c)
          s_r[size_t(c)] = s_r[size_t(c)] + w3 * (acc[size_t(c)] > 0.f ? acc[size_t(c)] : 0.f);
      }
      for (int c = 0; c < W; ++c)
        time_sum[size_t(c)] +=
            static_cast<long long>(std::nearbyint(double(s_r[size_t(c)]) * kFixed));
    }
    for (int c = 0; c < W; ++c)
      y[int64_t(s) * W + c] =
          p[kParamB3] + static_cast<float>(double(time_sum[size_t(c)]) / kFixed / double(H));
  }
}

void gather_input_cpu(const HistoryState& hist, int b, int h, int c0, int c1, float* x) {
  const int w = c1 - c0;
  const int appended = hist.count[b];
  for (int i = 0; i < hist.history; ++i) {
    const float* row = hist.logical_row(b, h, i, appended);
    for (int c = 0; c < w; ++c) x[size_t(i) * w + c] = row ? row[c0 + c] : 0.f;
  }
}

void append_row_cpu(const HistoryState& hist, int b, int h, const float* pooled, int num_blocks) {
  if (num_blocks > hist.max_blocks)
    throw std::out_of_range("attnpred history: a row of " + std::to_string(num_blocks) +
                            " blocks exceeds max_blocks " + std::to_string(hist.max_blocks));
  float* row = hist.slot(b, h, hist.count[b] % hist.history);
  std::copy(pooled, pooled + num_blocks, row);
  std::fill(row + num_blocks, row + hist.max_blocks, 0.f);
}

void select_top_blocks_cpu(const float* scores, int count, int k, int offset, uint8_t* flags) {
  if (count <= 0 || k <= 0) return;
  std::vector<int> idx(static_cast<size_t>(count));
  std::iota(idx.begin(), idx.end(), 0);
  const int take = std::min(k, count);
  std::partial_sort(idx.begin(), idx.begin() + take, idx.end(), [&](int a, int c) {
    return scores[a] > scores[c] || (scores[a] == scores[c] && a < c);
  });
  for (int i = 0; i < take; ++i) flags[offset + idx[size_t(i)]] = 1;
}

void round_key_cpu(KeyFormat f, const bf16* k, int d, float* out) {
  float amax = 0.f;
  for (int e = 0; e < d; ++e) amax = std::max(amax, std::fabs(bf16_to_float(k[e])));
  if (f == KeyFormat::E4m3) {
    const float s = e4m3_row_scale(amax);
    for (int e = 0; e < d; ++e) out[e] = s * from_e4m3(to_e4m3(bf16_to_float(k[e]), s));
  } else {
    const float s = int_row_scale(amax, kInt4Max);
    for (int e = 0; e < d; ++e) out[e] = s * float(to_int_level(bf16_to_float(k[e]), s, kInt4Max));
  }
}

void round_query_cpu(KeyFormat f, const float* q, int d, float* out) {
  if (f == KeyFormat::E4m3) {
    std::copy(q, q + d, out);
    return;
  }
  float amax = 0.f;
  for (int e = 0; e < d; ++e) amax = std::max(amax, std::fabs(q[e]));
  const float s = int_row_scale(amax, kInt8Max);
  for (int e = 0; e < d; ++e) out[e] = s * float(to_int_level(q[e], s, kInt8Max));
}

std::vector<int32_t> selected_tokens_cpu(const Geometry& g, int n, const uint8_t* block_flags) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i)
    if (g.attended_token(i, n, block_flags)) t.push_back(i);
  return t;
}

}  // namespace kvs::kernels::attnpred
