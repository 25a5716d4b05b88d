// Device side of rope.h: the rotation of one dimension pair, the one place of its arithmetic
// on the GPU (rope_kernel and the kernels that de-RoPE a key inside a larger step use it).
// Same arithmetic as rope_cpu: fp32 angle float(p) * inv_freq, its sin and cos by rope_sincos
// (rope_math.h, shared with the CPU), and products rounded separately (no FMA contraction) as
// the CPU computes them.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/rope_math.h"

namespace kvs::kernels {

// Rotates the pair (x[i], x[i + half]) = (a, b) of a token at `position` by its angle for
// pair i (inv_freq = inv_freq[i]); inverse rotates back. Returns the pair rounded to bf16.
__device__ __forceinline__ __nv_bfloat162 rope_rotate_pair(float a, float b, int32_t position,
                                                           float inv_freq, bool inverse) {
  const float angle = __fmul_rn(float(position), inv_freq);
  float s, c;
  rope_sincos(angle, s, c);
  if (inverse) s = -s;
  __nv_bfloat162 out;
  out.x = __float2bfloat16_rn(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
  out.y = __float2bfloat16_rn(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
  return out;
}

}  // namespace kvs::kernels
