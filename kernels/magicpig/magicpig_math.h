// MagicPIG math shared by the host and the device (spec shared/specs/magicpig.md 2.5-2.6):
// SimHash codes and the sampling probability u of a key under the ">= 2 of L tables" rule.
//
// Written once for both sides, and in a way that gives the same bits on both: every
// projection is accumulated in fp32 by sequential fused multiply-adds over dims 0..d-1
// (fmaf is correctly rounded on the host and on the device), so a key hashed on the GPU
// lands in the same buckets as the same key hashed by the CPU reference, and the CPU and
// GPU modes retrieve the same candidates.
#pragma once

#include <math.h>
#include <stdint.h>

#include "kernels/common/host_device.h"

namespace kvs::kernels::magicpig {

constexpr int kMaxBits = 16;  ///< K <= 16: codes are uint16 and 2^K buckets per table

// x . w[:, col] for the [d, cols] row-major projection w: the sequential fp32 FMA chain
// over dims 0..d-1 that every hashing path uses (one column's chain, in this order).
KVS_HOST_DEVICE float simhash_projection(const float* x, const float* w, int d, int64_t cols,
                                         int64_t col) {
  float acc = 0.f;
  for (int i = 0; i < d; ++i) acc = fmaf(x[i], w[i * cols + col], acc);
  return acc;
}

// Code of `x` (d fp32 values) in table `table`: bit j is [x . w[:, table * K + j] > 0] with
// w the [d, K * L] row-major projection. An all-zero x gets code 0.
KVS_HOST_DEVICE uint32_t simhash_code(const float* x, const float* w, int d, int K, int L,
                                      int table) {
  const int64_t cols = int64_t(K) * L;
  uint32_t code = 0;
  for (int j = 0; j < K; ++j)
    code |= uint32_t(simhash_projection(x, w, d, cols, int64_t(table) * K + j) > 0.f) << j;
  return code;
}

KVS_HOST_DEVICE float mp_acos(float x) { return acosf(x); }
KVS_HOST_DEVICE double mp_acos(double x) { return acos(x); }
KVS_HOST_DEVICE float mp_log1p(float x) { return log1pf(x); }
KVS_HOST_DEVICE double mp_log1p(double x) { return log1p(x); }
KVS_HOST_DEVICE float mp_expm1(float x) { return expm1f(x); }
KVS_HOST_DEVICE double mp_expm1(double x) { return expm1(x); }

// Probability that one SimHash bit agrees for two vectors at cosine c: 1 - acos(c) / pi.
// c is clamped to [-1, 1] first: rounding can push |q.k| / (|q||k|) just past 1.
template <typename T>
KVS_HOST_DEVICE T bit_agreement(T c) {
  c = c > T(1) ? T(1) : (c < T(-1) ? T(-1) : c);
  return T(1) - mp_acos(c) / T(3.14159265358979323846);
}

// P[Binomial(L, P) >= 2] for the per-table collision probability P = p^K: the chance that
// a key at cosine c with the query is retrieved (spec Eq. 10). Evaluated as
// -expm1((L-1) log1p(-P) + log1p((L-1) P)), which is 1 - (1-P)^(L-1) (1 + (L-1) P) without
// the cancellation that makes the textbook form useless for small P (u ~ C(L,2) P^2).
template <typename T>
KVS_HOST_DEVICE T sampling_probability(T cos_angle, int K, int L) {
  const T p = bit_agreement(cos_angle);
  T P = T(1);
  for (int j = 0; j < K; ++j) P *= p;
  if (P >= T(1)) return T(1);
  if (L < 2) return T(0);
  const T a = T(L - 1) * mp_log1p(-P) + mp_log1p(T(L - 1) * P);
  return -mp_expm1(a);
}

}  // namespace kvs::kernels::magicpig
