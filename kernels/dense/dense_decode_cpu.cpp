#include <cmath>
#include <limits>
#include <vector>

#include "kernels/dense/dense_decode.h"

namespace kvs::kernels {

void attend_cpu(const float* q, const PagedKV& kv, int b, int kv_head, const int32_t* tokens,
                int num_tokens, double scale, double* o, double* lse) {
  attend_cpu_shifted(q, kv, b, kv_head, tokens, num_tokens, scale, nullptr, o, lse);
}

void attend_cpu_shifted(const float* q, const PagedKV& kv, int b, int kv_head,
                        const int32_t* tokens, int num_tokens, double scale,
                        const double* logit_offset, double* o, double* lse) {
  const int d = kv.head_dim;
  const int n = tokens ? num_tokens : kv.seq_lens[b];
  for (int i = 0; i < d; ++i) o[i] = 0.0;
  if (n == 0) {
    *lse = -std::numeric_limits<double>::infinity();
    return;
  }
  // Two passes (max, then exp-sum) keep fp64 exact enough to serve as the oracle.
  std::vector<double> score(n);
  double m = -std::numeric_limits<double>::infinity();
  for (int j = 0; j < n; ++j) {
    const int t = tokens ? tokens[j] : j;
    const bf16* k = kv.k + kv.offset(b, t, kv_head);
    double dot = 0.0;
    for (int i = 0; i < d; ++i) dot += double(q[i]) * double(bf16_to_float(k[i]));
    score[j] = dot * scale + (logit_offset ? logit_offset[j] : 0.0);
    m = std::max(m, score[j]);
  }
  double sum = 0.0;
  for (int j = 0; j < n; ++j) {
    const int t = tokens ? tokens[j] : j;
    const double p = std::exp(score[j] - m);
    sum += p;
    const bf16* v = kv.v + kv.offset(b, t, kv_head);
    for (int i = 0; i < d; ++i) o[i] += p * double(bf16_to_float(v[i]));
  }
  for (int i = 0; i < d; ++i) o[i] /= sum;
  *lse = m + std::log(sum);
}

void dense_decode_cpu(const bf16* q, int num_q_heads, const PagedKV& kv, float scale,
                      float* o, float* lse) {
  const int d = kv.head_dim;
  const int group = num_q_heads / kv.num_kv_heads;
  std::vector<float> qf(d);
  std::vector<double> od(d);
  for (int b = 0; b < kv.batch; ++b) {
    for (int h = 0; h < num_q_heads; ++h) {
      const int64_t row = int64_t(b) * num_q_heads + h;
      for (int i = 0; i < d; ++i) qf[i] = bf16_to_float(q[row * d + i]);
      double l;
      attend_cpu(qf.data(), kv, b, h / group, nullptr, 0, scale, od.data(), &l);
      for (int i = 0; i < d; ++i) o[row * d + i] = float(od[i]);
      if (lse) lse[row] = float(l);
    }
  }
}

}  // namespace kvs::kernels
