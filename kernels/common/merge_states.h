// Merging partial attention results.
//
// A partial result over a set of keys is a state (o, lse): o is the softmax-normalized
// output over that set (head_dim values) and lse = log(sum(exp(score))) over the same set,
// natural log, -inf for an empty set. Two states over disjoint sets merge exactly:
//   lse = log(exp(lse_a) + exp(lse_b)),  o = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse).
// This is the only place that formula is written for the CPU; merge_states.cuh holds the
// device version. Split-KV, MAC, MagicPIG and SAAP all combine their parts through it.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <limits>

namespace kvs::kernels {

// Merges state (o_b, lse_b) into (o_a, lse_a) in place. An empty state (lse = -inf) is the
// identity on either side; merging two empty states stays empty (o untouched, no NaN).
template <typename T>
inline void merge_state_cpu(T* o_a, T* lse_a, const T* o_b, T lse_b, int head_dim) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  if (lse_b == neg_inf) return;
  if (*lse_a == neg_inf) {
    for (int i = 0; i < head_dim; ++i) o_a[i] = o_b[i];
    *lse_a = lse_b;
    return;
  }
  const T m = std::max(*lse_a, lse_b);
  const T wa = std::exp(*lse_a - m), wb = std::exp(lse_b - m);
  const T inv = T(1) / (wa + wb);
  for (int i = 0; i < head_dim; ++i) o_a[i] = (o_a[i] * wa + o_b[i] * wb) * inv;
  *lse_a = m + std::log(wa + wb);
}

// CUDA: merges num_states partial states for each of `rows` rows.
//   v [num_states, rows, head_dim] fp32, s [num_states, rows] fp32 (lse, -inf = empty)
//   v_out [rows, head_dim] fp32, s_out [rows] fp32 (s_out may be null)
// Rows whose states are all empty get o = 0 and lse = -inf.
cudaError_t merge_states_cuda(const float* v, const float* s, int num_states, int rows,
                              int head_dim, float* v_out, float* s_out, cudaStream_t stream);

// CUDA: merges (v_other, s_other) into (v, s) in place, row by row; both [rows, head_dim].
cudaError_t merge_state_in_place_cuda(float* v, float* s, const float* v_other,
                                      const float* s_other, int rows, int head_dim,
                                      cudaStream_t stream);

}  // namespace kvs::kernels
