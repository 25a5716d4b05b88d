// Floats as unsigned keys in the same order, the one place of that mapping on the GPU: for
// radix selects over scores (AttentionPredictor's top-K) and for warp maxima of floats by
// redux.sync, which reduces only integers (SAAP's route). -0 maps as +0, as the CPU
// comparators rank it.
#pragma once

namespace kvs::kernels {

__device__ __forceinline__ unsigned float_order_key(float f) {
  const unsigned u = f == 0.f ? 0u : __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The float of a key of float_order_key (+0 for either zero).
__device__ __forceinline__ float float_from_order_key(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

}  // namespace kvs::kernels
