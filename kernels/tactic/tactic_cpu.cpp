// CPU reference of Tactic: exact and simple (fp64 distances, scores and exponentials). The
// oracle of the CUDA kernels and the CPU backend of TacticEngine.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/tactic/tactic.h"

namespace kvs::kernels::tactic {
namespace {

std::string str(int64_t x) { return std::to_string(x); }

// Stable counting sort of 0..n-1 by label: offsets [C + 1], members ascending per cluster.
void build_csr(const std::vector<int32_t>& labels, int C, int32_t* offsets, int32_t* members) {
  std::vector<int32_t> cursor(static_cast<size_t>(C) + 1, 0);
  for (int32_t l : labels) ++cursor[size_t(l) + 1];
  for (int c = 0; c < C; ++c) cursor[size_t(c) + 1] += cursor[size_t(c)];
  std::copy(cursor.begin(), cursor.end(), offsets);
  for (size_t i = 0; i < labels.size(); ++i) members[cursor[size_t(labels[i])]++] = int32_t(i);
}

// fp64 dot product with four independent partial sums: the assignment is the CPU
// reference's O(n * C * d) hot loop, and one serial chain of dependent adds would be ~4x slower.
double dot4(const float* a, const float* b, int d) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  int j = 0;
  for (; j + 4 <= d; j += 4)
    for (int u = 0; u < 4; ++u) s[u] += double(a[j + u]) * b[j + u];
  for (; j < d; ++j) s[0] += double(a[j]) * b[j];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

float bf16_round(double x) { return bf16_to_float(float_to_bf16(float(x))); }

std::vector<float> gather_keys(const PagedKV& kv, int b, int h, int start, int n) {
  const int d = kv.head_dim;
  std::vector<float> keys(static_cast<size_t>(n) * d);
  for (int i = 0; i < n; ++i) {
    const bf16* k = kv.k + kv.offset(b, start + i, h);
    for (int j = 0; j < d; ++j) keys[size_t(i) * d + j] = bf16_to_float(k[j]);
  }
  return keys;
}

}  // namespace

int max_clusters_for(int max_tokens, int cluster_size) {
  if (max_tokens < 0 || cluster_size < 1)
    throw std::invalid_argument("max_clusters_for: max_tokens " + str(max_tokens) +
                                " and cluster_size " + str(cluster_size) +
                                " must be >= 0 and >= 1");
  return kmeans_num_clusters(max_tokens, cluster_size);
}

void kmeans_cpu(const float* keys, int n, int d, int C, int iterations, uint64_t stream,
                bf16* centroids, int32_t* offsets, int32_t* members) {
  if (n < 1 || d < 1 || C < 1 || C > n || iterations < 1)
    throw std::invalid_argument(
        "kmeans_cpu: need n >= 1, d >= 1, 1 <= C <= n and iterations "
        ">= 1; got n " +
        str(n) + ", d " + str(d) + ", C " + str(C) + ", iterations " + str(iterations));
  std::vector<float> mu(static_cast<size_t>(C) * d);  // bf16 values
  for (int c = 0; c < C; ++c) {
    const int i = kmeans_init_index(stream, c, n, C);
    std::copy(keys + size_t(i) * d, keys + size_t(i + 1) * d, mu.begin() + size_t(c) * d);
  }
  std::vector<int32_t> labels(static_cast<size_t>(n));
  std::vector<double> norm(static_cast<size_t>(C)), sum(static_cast<size_t>(d));
  for (int it = 0; it < iterations; ++it) {
    for (int c = 0; c < C; ++c) {
      double s = 0.0;
      for (int j = 0; j < d; ++j) s += double(mu[size_t(c) * d + j]) * mu[size_t(c) * d + j];
      norm[size_t(c)] = s;
    }
    for (int i = 0; i < n; ++i) {
      const float* k = keys + size_t(i) * d;
      double best = std::numeric_limits<double>::infinity();
      int arg = 0;
      for (int c = 0; c < C; ++c) {
        const double dist = norm[size_t(c)] - 2.0 * dot4(k, mu.data() + size_t(c) * d, d);
        if (dist < best) {  // strict: ties go to the lowest c
          best = dist;
          arg = c;
        }
      }
      labels[size_t(i)] = arg;
    }
    build_csr(labels, C, offsets, members);
    for (int c = 0; c < C; ++c) {
      const int lo = offsets[c], hi = offsets[c + 1];
      if (lo == hi) continue;  // empty: keep the previous centroid
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int m = lo; m < hi; ++m)
        for (int j = 0; j < d; ++j) sum[size_t(j)] += keys[size_t(members[m]) * d + j];
      for (int j = 0; j < d; ++j) mu[size_t(c) * d + j] = bf16_round(sum[size_t(j)] / (hi - lo));
    }
  }
  for (size_t i = 0; i < mu.size(); ++i) centroids[i] = float_to_bf16(mu[i]);
}

double kmeans_wcss_cpu(const float* keys, int n, int d, int C, const bf16* centroids,
                       const int32_t* offsets, const int32_t* members) {
  double wcss = 0.0;
  for (int c = 0; c < C; ++c)
    for (int m = offsets[c]; m < offsets[c + 1]; ++m)
      for (int j = 0; j < d; ++j) {
        const double diff =
            double(keys[size_t(members[m]) * d + j]) - bf16_to_float(centroids[size_t(c) * d + j]);
        wcss += diff * diff;
      }
  (void)n;
  return wcss;
}

void cluster_range_cpu(const PagedKV& kv, int layer, int b, int h, int n, const KMeansParams& km,
                       const ClusterState& st) {
  const int64_t s = st.slot(b, h);
  const int start = st.clustered_len[s], c0 = st.num_clusters[s];
  const int C = kmeans_num_clusters(n, km.cluster_size);
  if (n < 1 || start + n > kv.seq_lens[b] || start + n > st.max_tokens || c0 + C > st.max_clusters)
    throw std::out_of_range("cluster_range_cpu: tokens [" + str(start) + ", " + str(start + n) +
                            ") of sequence " + str(b) + " (length " + str(kv.seq_lens[b]) +
                            ") into clusters [" + str(c0) + ", " + str(c0 + C) +
                            ") exceed the state (max_tokens " + str(st.max_tokens) +
                            ", max_clusters " + str(st.max_clusters) + ")");
  const std::vector<float> keys = gather_keys(kv, b, h, start, n);
  std::vector<int32_t> offsets(static_cast<size_t>(C) + 1), members(static_cast<size_t>(n));
  kmeans_cpu(keys.data(), n, kv.head_dim, C, km.iterations, kmeans_stream(km.seed, layer, h, start),
             st.centroid(b, h, c0), offsets.data(), members.data());
  int32_t* off = st.offsets_of(b, h);
  int32_t* mem = st.members_of(b, h);
  for (int c = 0; c <= C; ++c) off[c0 + c] = start + offsets[size_t(c)];
  for (int i = 0; i < n; ++i) mem[start + i] = start + members[size_t(i)];
  st.num_clusters[s] = c0 + C;
  st.clustered_len[s] = start + n;
}

int select_clusters_cpu(const float* q, const PagedKV& kv, int b, int h, double scale,
                        const FitParams& fit, const ClusterState& st, uint8_t* flags, int* budget) {
  const int64_t s = st.slot(b, h);
  const int C = st.num_clusters[s], n = st.clustered_len[s], d = kv.head_dim;
  const int32_t* off = st.offsets_of(b, h);
  const int32_t* mem = st.members_of(b, h);
  if (budget) *budget = 0;
  if (C == 0 || n == 0) return 0;
  // Stage 2A: clusters in descending q.centroid; ties keep the lower id first.
  std::vector<double> score(static_cast<size_t>(C));
  for (int c = 0; c < C; ++c) {
    const bf16* mu = st.centroid(b, h, c);
    double dot = 0.0;
    for (int j = 0; j < d; ++j) dot += double(q[j]) * bf16_to_float(mu[j]);
    score[size_t(c)] = dot;
  }
  std::vector<int32_t> order(static_cast<size_t>(C));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t x, int32_t y) { return score[size_t(x)] > score[size_t(y)]; });
  std::vector<int32_t> prefix(static_cast<size_t>(C) + 1, 0);  // sorted positions before cluster j
  for (int j = 0; j < C; ++j)
    prefix[size_t(j) + 1] = prefix[size_t(j)] + off[order[size_t(j)] + 1] - off[order[size_t(j)]];

  // Stage 2B: exact and windowed exponentials along the sorted list.
  const FitPlan plan = make_fit_plan(n, fit);
  const int S = plan.num_samples();
  std::vector<double> logit(static_cast<size_t>(S));
  double m = -std::numeric_limits<double>::infinity();
  for (int i = 0; i < S; ++i) {
    const int x = plan.position(i) - 1;  // 0-based sorted position
    const int j = int(std::upper_bound(prefix.begin(), prefix.end(), x) - prefix.begin()) - 1;
    const int c = order[size_t(j)];
    const int t = mem[off[c] + (x - prefix[size_t(j)])];
    const bf16* k = kv.k + kv.offset(b, t, h);
    double dot = 0.0;
    for (int e = 0; e < d; ++e) dot += double(q[e]) * bf16_to_float(k[e]);
    logit[size_t(i)] = dot * scale;
    m = std::max(m, logit[size_t(i)]);
  }
  std::vector<double> exact(static_cast<size_t>(plan.num_exact) + 1, 0.0);
  for (int i = 0; i < plan.num_exact; ++i)
    exact[size_t(i) + 1] = exact[size_t(i)] + std::exp(logit[size_t(i)] - m);
  TailModel tail;
  if (plan.fitted) {
    double mu1 = 0.0, mu2 = 0.0;
    for (int i = 0; i < plan.w; ++i) {
      mu1 += std::exp(logit[size_t(plan.num_exact + i)] - m);
      mu2 += std::exp(logit[size_t(plan.num_exact + plan.w + i)] - m);
    }
    tail = fit_tail(mu1 / plan.w, mu2 / plan.w, plan.x1(), plan.x2(), n);
  }
  const int K = budget_tokens(plan, tail, fit.target, [&](int k) { return exact[size_t(k)]; });
  if (budget) *budget = K;
  // Round up to whole clusters (spec 8.2).
  const int J = int(std::lower_bound(prefix.begin() + 1, prefix.end(), K) - prefix.begin());
  for (int j = 0; j < J; ++j) flags[order[size_t(j)]] = 1;
  return prefix[size_t(J)];
}

std::vector<int32_t> selected_tokens_cpu(const PagedKV& kv, int b, int h, const ClusterState& st,
                                         const uint8_t* flags) {
  const int64_t s = st.slot(b, h);
  const int32_t* off = st.offsets_of(b, h);
  const int32_t* mem = st.members_of(b, h);
  std::vector<int32_t> tokens;
  for (int c = 0; c < st.num_clusters[s]; ++c)
    if (flags[c]) tokens.insert(tokens.end(), mem + off[c], mem + off[c + 1]);
  for (int t = st.clustered_len[s]; t < kv.seq_lens[b]; ++t) tokens.push_back(t);
  return tokens;
}

int max_samples(int max_tokens, const FitParams& fit) {
  int best = 0;
  for (int n = 1; n <= max_tokens; ++n) best = std::max(best, make_fit_plan(n, fit).num_samples());
  return best;
}

}  // namespace kvs::kernels::tactic
