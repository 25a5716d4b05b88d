// Synthetic decode scenes for the MAC tests (CPU and CUDA): keys, values and pre-RoPE queries
// of every position of a small batch, with controlled query repeats so that matches are
// known in advance. "Captured-like" scenes add what real heads have: a large mean query per
// head, an attention sink at token 0 and keys that drift along the sequence.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "artifacts/model_shape.h"
#include "kernels/common/bf16.h"
#include "kernels/common/rope.h"
#include "runtime/kv_cache.h"

namespace kvs::test {

struct MacSceneConfig {
  int hq = 8, hkv = 2, d = 64;
  std::vector<int> prompt{300};  ///< prompt length per sequence
  int steps = 40;                ///< decode steps (positions prompt .. prompt + steps - 1)
  int page_size = 16;
  float q_scale = 1.f;       ///< per-component std of a fresh query around the head mean
  float q_mean = 0.f;        ///< norm of the head's mean query, in units of q_scale * sqrt(d)
  double repeat = 0.5;       ///< probability that a position repeats an earlier query
  int max_lag = 16;          ///< repeats copy position p - lag, lag in [1, max_lag]
  float repeat_noise = 0.02f;  ///< per-component noise on a repeat, in units of q_scale
  float k_scale = 1.f;       ///< per-component std of the pre-RoPE keys
  bool sink = false;         ///< token 0: a large key along the mean query
  int old_keys_until = 0;    ///< keys of positions below it are scaled by old_key_scale
  float old_key_scale = 1.f;
  uint32_t seed = 1;
};

struct MacScene {
  MacSceneConfig c;
  ModelShape shape;
  std::vector<float> inv_freq;
  std::vector<std::vector<bf16>> k, v;      ///< per sequence [T, Hkv, d], post-RoPE keys
  std::vector<std::vector<bf16>> q_pre, q;  ///< per sequence [T, Hq, d], pre- and post-RoPE
  std::vector<std::vector<int>> lag;        ///< per sequence [T * Hq]: repeat lag, 0 = fresh

  explicit MacScene(const MacSceneConfig& cfg) : c(cfg) {
    shape.num_layers = 2;
    shape.num_q_heads = c.hq;
    shape.num_kv_heads = c.hkv;
    shape.head_dim = c.d;
    shape.max_position = 1 << 20;
    inv_freq = rope_inv_freq(shape.rope, c.d);
    std::mt19937 gen(c.seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::uniform_real_distribution<float> uni(-1.f, 1.f), u01(0.f, 1.f);
    std::vector<float> mean(size_t(c.hq) * c.d);
    for (int h = 0; h < c.hq; ++h) {
      float n2 = 0.f;
      for (int i = 0; i < c.d; ++i) n2 += (mean[size_t(h) * c.d + i] = normal(gen)) * mean[size_t(h) * c.d + i];
      const float f = c.q_mean * c.q_scale * std::sqrt(float(c.d)) / std::sqrt(n2);
      for (int i = 0; i < c.d; ++i) mean[size_t(h) * c.d + i] *= f;
    }
    for (size_t b = 0; b < c.prompt.size(); ++b) {
      const int T = c.prompt[b] + c.steps;
      std::vector<int32_t> pos(static_cast<size_t>(T));
      for (int t = 0; t < T; ++t) pos[size_t(t)] = t;
      std::vector<float> kf(size_t(T) * c.hkv * c.d), qf(size_t(T) * c.hq * c.d);
      std::vector<bf16> vb(kf.size());
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < c.hkv; ++h)
          for (int i = 0; i < c.d; ++i) {
            const size_t at = (size_t(t) * c.hkv + h) * c.d + i;
            // Keys drift slowly (a walk) so that nearby tokens resemble each other.
            const float prev = t > 0 ? kf[at - size_t(c.hkv) * c.d] : 0.f;
            kf[at] = 0.9f * prev + 0.44f * c.k_scale * normal(gen);
            vb[at] = float_to_bf16(uni(gen));
          }
      for (int t = 0; t < std::min(T, c.old_keys_until); ++t)
        for (int i = 0; i < c.hkv * c.d; ++i) kf[size_t(t) * c.hkv * c.d + i] *= c.old_key_scale;
      if (c.sink)
        for (int h = 0; h < c.hkv; ++h)
          for (int i = 0; i < c.d; ++i)
            kf[size_t(h) * c.d + i] = 4.f * mean[size_t(h * (c.hq / c.hkv)) * c.d + i] /
                                      (c.q_scale * std::sqrt(float(c.d)));
      std::vector<int> lags(size_t(T) * c.hq, 0);
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < c.hq; ++h) {
          float* row = qf.data() + (size_t(t) * c.hq + h) * c.d;
          const int lag = u01(gen) < c.repeat ? 1 + int(gen() % unsigned(c.max_lag)) : 0;
          if (lag > 0 && t - lag >= 0) {
            lags[size_t(t) * c.hq + h] = lag;
            const float* src = qf.data() + (size_t(t - lag) * c.hq + h) * c.d;
            for (int i = 0; i < c.d; ++i) row[i] = src[i] + c.repeat_noise * c.q_scale * normal(gen);
          } else {
            for (int i = 0; i < c.d; ++i) row[i] = mean[size_t(h) * c.d + i] + c.q_scale * normal(gen);
          }
        }
      std::vector<bf16> qp = round(qf);
      std::vector<float> qr = to_float(qp);
      kernels::rope_cpu(qr.data(), T, c.hq, c.d, pos.data(), inv_freq.data(), false);
      kernels::rope_cpu(kf.data(), T, c.hkv, c.d, pos.data(), inv_freq.data(), false);
      k.push_back(round(kf));
      v.push_back(vb);
      q_pre.push_back(qp);
      q.push_back(round(qr));
      lag.push_back(lags);
    }
  }

  // Makes position dst of sequence b (query head h, or every head when h < 0) ask exactly
  // what position src asked (pre-RoPE), rotated at dst.
  void copy_query(int b, int dst, int src, int h = -1) {
    for (int hh = 0; hh < c.hq; ++hh) {
      if (h >= 0 && hh != h) continue;
      std::vector<float> row(size_t(c.d));
      for (int i = 0; i < c.d; ++i) {
        q_pre[size_t(b)][(size_t(dst) * c.hq + hh) * c.d + i] = q_pre[size_t(b)][(size_t(src) * c.hq + hh) * c.d + i];
        row[size_t(i)] = bf16_to_float(q_pre[size_t(b)][(size_t(src) * c.hq + hh) * c.d + i]);
      }
      const int32_t p = dst;
      kernels::rope_cpu(row.data(), 1, 1, c.d, &p, inv_freq.data(), false);
      for (int i = 0; i < c.d; ++i) q[size_t(b)][(size_t(dst) * c.hq + hh) * c.d + i] = float_to_bf16(row[size_t(i)]);
      lag[size_t(b)][size_t(dst) * c.hq + hh] = dst - src;
    }
  }

  int batch() const { return int(c.prompt.size()); }
  int len(int b, int step) const { return c.prompt[size_t(b)] + step + 1; }

  KVCacheConfig cache_config(Device dev) const {
    KVCacheConfig cc;
    cc.num_layers = shape.num_layers;
    cc.num_kv_heads = c.hkv;
    cc.head_dim = c.d;
    cc.page_size = c.page_size;
    cc.max_batch = batch();
    cc.max_seq_len = *std::max_element(c.prompt.begin(), c.prompt.end()) + c.steps;
    cc.device = dev;
    return cc;
  }

  // Reserves and writes every position of every sequence into a cache of cache_config().
  void fill_cache(KVCache& cache) const {
    const KVCacheConfig& cc = cache.config();
    const Device dev = cc.device;
    // Interleaved reservations: page tables are not contiguous.
    const int chunk = 64;
    for (int done = 0; done < cc.max_seq_len; done += chunk)
      for (int b = 0; b < batch(); ++b)
        cache.reserve(b, std::min(done + chunk, c.prompt[size_t(b)] + c.steps));
    for (int layer = 0; layer < shape.num_layers; ++layer)
      for (int b = 0; b < batch(); ++b) {
        const int T = c.prompt[size_t(b)] + c.steps;
        if (dev == Device::Cpu) {
          cache.write(layer, b, 0, T, k[size_t(b)].data(), v[size_t(b)].data());
        } else {
          void *dk = nullptr, *dv = nullptr;
          const size_t bytes = k[size_t(b)].size() * sizeof(bf16);
          cudaMalloc(&dk, bytes);
          cudaMalloc(&dv, bytes);
          cudaMemcpy(dk, k[size_t(b)].data(), bytes, cudaMemcpyHostToDevice);
          cudaMemcpy(dv, v[size_t(b)].data(), bytes, cudaMemcpyHostToDevice);
          cache.write(layer, b, 0, T, static_cast<const bf16*>(dk), static_cast<const bf16*>(dv));
          cudaFree(dk);
          cudaFree(dv);
        }
      }
  }

  // Lengths of decode step `step` (the step's token included).
  std::vector<int> lengths(int step) const {
    std::vector<int> l;
    for (int b = 0; b < batch(); ++b) l.push_back(len(b, step));
    return l;
  }

  // [batch, Hq, d] queries of decode step `step` (position len - 1 of each sequence).
  std::vector<bf16> step_queries(int step, bool pre) const {
    std::vector<bf16> out;
    for (int b = 0; b < batch(); ++b) {
      const auto& src = pre ? q_pre[size_t(b)] : q[size_t(b)];
      const size_t row = size_t(len(b, step) - 1) * c.hq * c.d;
      out.insert(out.end(), src.begin() + long(row), src.begin() + long(row + size_t(c.hq) * c.d));
    }
    return out;
  }

  // [n, Hq, d] queries of the last n prompt positions of sequence b.
  std::vector<bf16> prompt_queries(int b, int n, bool pre) const {
    const auto& src = pre ? q_pre[size_t(b)] : q[size_t(b)];
    const size_t row = size_t(c.prompt[size_t(b)] - n) * c.hq * c.d;
    return std::vector<bf16>(src.begin() + long(row), src.begin() + long(row + size_t(n) * c.hq * c.d));
  }

  static std::vector<bf16> round(const std::vector<float>& x) {
    std::vector<bf16> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) r[i] = float_to_bf16(x[i]);
    return r;
  }
  static std::vector<float> to_float(const std::vector<bf16>& x) {
    std::vector<float> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) r[i] = bf16_to_float(x[i]);
    return r;
  }
};

}  // namespace kvs::test
