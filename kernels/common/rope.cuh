// Device side of rope.h: the rotation of one dimension pair, the one place of its arithmetic
// on the GPU (rope_kernel and the kernels that de-RoPE a key inside a larger step use it).
// Same arithmetic as rope_cpu: fp32 angle float(p) * inv_freq, its cos and sin, and products
// rounded separately (no FMA contraction) as the CPU computes them, so the two differ only by
// the last-ulp differences of the cos/sin implementations. The cos and sin are the double
// sincos of the fp32 angle rounded to fp32 (not __sinf/__cosf, whose error grows with the
// angle): positions reach 1e5+ radians, and past 105615 sincosf takes a slow path (a loop of
// table loads through local memory), where double sincos reduces in a few FP64 FMAs up to 2^31
// radians. In SAAP's step that indexes, which de-RoPEs 4 keys inside the attention, that took
// the 128K batch-1 step from 38.5-38.8 us to 37.7-37.9 on an H200 (docs/gpu.md). Rounded from
// double, they are also nearer the C library's.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace kvs::kernels {

// Rotates the pair (x[i], x[i + half]) = (a, b) of a token at `position` by its angle for
// pair i (inv_freq = inv_freq[i]); inverse rotates back. Returns the pair rounded to bf16.
__device__ __forceinline__ __nv_bfloat162 rope_rotate_pair(float a, float b, int32_t position,
                                                           float inv_freq, bool inverse) {
  const float angle = __fmul_rn(float(position), inv_freq);
  double sd, cd;
  sincos(double(angle), &sd, &cd);
  const float c = float(cd), s = inverse ? -float(sd) : float(sd);
  __nv_bfloat162 out;
  out.x = __float2bfloat16_rn(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
  out.y = __float2bfloat16_rn(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
  return out;
}

}  // namespace kvs::kernels
