// A small SAAP scene shared by the CPU and CUDA tests: a model shape, random trained parts
// (unit-norm centroids, random MLPs with non-trivial batch norm statistics) and clustered
// pre-RoPE keys, RoPE'd into bf16 rows [T, Hkv, d] as a KV cache holds them.
#pragma once

#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "artifacts/model_shape.h"
#include "kernels/common/bf16.h"
#include "kernels/common/rope.h"
#include "runtime/saap_parts.h"

namespace kvs::saap_test {

inline ModelShape scene_shape(int layers = 3, int hq = 8, int hkv = 2, int d = 128) {
  ModelShape s;
  s.name = "saap-scene";
  s.num_layers = layers;
  s.num_q_heads = hq;
  s.num_kv_heads = hkv;
  s.head_dim = d;
  s.max_position = 4096;
  s.rope.theta = 10000.0;
  return s;
}

// Parts for layers 1 .. num_layers - 1 (layer 0 dense).
inline SaapParts random_parts(const ModelShape& s, int C, int hidden, uint64_t seed) {
  SaapParts p;
  p.num_clusters = C;
  p.hidden_dim = hidden;
  p.head_dim = s.head_dim;
  p.num_q_heads = s.num_q_heads;
  p.num_kv_heads = s.num_kv_heads;
  p.probes = std::min(4, C);
  p.sink_tokens = 1;
  p.recent_tokens = 64;
  p.dense_layers = {0};
  for (int l = 1; l < s.num_layers; ++l) p.layers.push_back(l);
  p.allocate();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uni(0.5f, 1.5f);
  const int d = s.head_dim;
  for (SaapLayerParts& l : p.per_layer) {
    for (size_t c = 0; c < l.centroids.size() / size_t(d); ++c) {
      double n2 = 0.0;
      for (int j = 0; j < d; ++j) {
        l.centroids[c * d + j] = normal(rng);
        n2 += double(l.centroids[c * d + j]) * l.centroids[c * d + j];
      }
      for (int j = 0; j < d; ++j)
        l.centroids[c * d + j] = float(l.centroids[c * d + j] / std::sqrt(n2));
    }
    for (float& w : l.w1) w = normal(rng) / std::sqrt(float(d));
    for (float& w : l.w2) w = 2.f * normal(rng) / std::sqrt(float(hidden));
    for (float& b : l.b1) b = 0.1f * normal(rng);
    for (float& b : l.b2) b = 0.1f * normal(rng);
    for (float& m : l.bn_mean) m = 0.2f * normal(rng);
    for (float& v : l.bn_var) v = uni(rng);
    for (float& w : l.bn_weight) w = uni(rng);
    for (float& b : l.bn_bias) b = 0.1f * normal(rng);
  }
  return p;
}

// Post-RoPE bf16 keys [T, Hkv, d] of pre-RoPE keys 3 c_z + N(0, 0.3^2) around the parts'
// centroids of layer slot `slot`, and random values.
inline void clustered_kv(const ModelShape& s, const SaapParts& p, int slot, int T, uint64_t seed,
                         std::vector<bf16>& k, std::vector<bf16>& v) {
  const int hkv = s.num_kv_heads, d = s.head_dim, C = p.num_clusters;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> kf(size_t(T) * hkv * d);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < hkv; ++h) {
      const int z = int(rng() % uint64_t(C));
      const float* c = p.per_layer[size_t(slot)].centroids.data() + (size_t(h) * C + z) * d;
      for (int j = 0; j < d; ++j)
        kf[(size_t(t) * hkv + h) * d + j] = 3.f * c[j] + 0.3f * normal(rng);
    }
  std::vector<int32_t> pos(static_cast<size_t>(T));
  std::iota(pos.begin(), pos.end(), 0);
  const std::vector<float> inv = rope_inv_freq(s.rope, d);
  kernels::rope_cpu(kf.data(), T, hkv, d, pos.data(), inv.data(), false);
  k.resize(kf.size());
  v.resize(kf.size());
  for (size_t i = 0; i < kf.size(); ++i) {
    k[i] = float_to_bf16(kf[i]);
    v[i] = float_to_bf16(normal(rng));
  }
}

inline std::vector<bf16> random_bf16(size_t n, uint64_t seed, float sd = 1.f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, sd);
  std::vector<bf16> x(n);
  for (bf16& e : x) e = float_to_bf16(normal(rng));
  return x;
}

// The cluster index a prefill builds from the assignments a[sink, end) of C clusters: offsets
// [C + 1] and members, a stable counting sort (members ascending within a cluster), keys with
// no cluster (-1) left out.
struct Csr {
  std::vector<int32_t> offsets, members;
};
inline Csr csr_of(const int32_t* a, int sink, int end, int C) {
  Csr r;
  r.offsets.assign(size_t(C) + 1, 0);
  for (int t = sink; t < end; ++t)
    if (a[t] >= 0) ++r.offsets[size_t(a[t]) + 1];
  for (int c = 0; c < C; ++c) r.offsets[size_t(c) + 1] += r.offsets[size_t(c)];
  r.members.resize(size_t(r.offsets[size_t(C)]));
  std::vector<int32_t> next(r.offsets.begin(), r.offsets.end() - 1);
  for (int t = sink; t < end; ++t)
    if (a[t] >= 0) r.members[size_t(next[size_t(a[t])]++)] = t;
  return r;
}

// The tokens past the recent window that a layer whose index steps have phase `phase`
// (index_step_count) has indexed once m tokens have left the window, m0 at its prefill: up to
// the last m' <= m where m' + phase is a multiple of index_every.
inline int indexed_after(int m0, int m, int index_every, int phase) {
  return std::max(m0, m - (m + phase) % index_every);
}

}  // namespace kvs::saap_test
