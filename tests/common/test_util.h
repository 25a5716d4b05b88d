// Helpers the CPU and CUDA tests share: random bf16 data and KV cache configs.
#pragma once

#include <cstddef>
#include <random>
#include <vector>

#include "artifacts/model_shape.h"
#include "kernels/common/bf16.h"
#include "runtime/kv_cache.h"

namespace kvs::test {

// n values from N(0, 1), rounded to bf16.
inline std::vector<bf16> random_bf16(size_t n, std::mt19937& gen) {
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<bf16> v(n);
  for (auto& x : v) x = float_to_bf16(dist(gen));
  return v;
}

// A cache for every layer and kv head of s.
inline KVCacheConfig cache_config(const ModelShape& s, int page_size, int max_batch,
                                  int max_seq_len, Device device) {
  KVCacheConfig c;
  c.num_layers = s.num_layers;
  c.num_kv_heads = s.num_kv_heads;
  c.head_dim = s.head_dim;
  c.page_size = page_size;
  c.max_batch = max_batch;
  c.max_seq_len = max_seq_len;
  c.device = device;
  return c;
}

}  // namespace kvs::test
