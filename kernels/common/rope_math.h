// The sine and cosine of a RoPE angle, the one place of that arithmetic for the CPU
// (rope_cpu) and the GPU (rope_rotate_pair, rope.cuh), so the two agree bit for bit.
#pragma once

#include <math.h>

#include "kernels/common/host_device.h"

namespace kvs::kernels {

// sin and cos of an fp32 angle with |angle| < 2^31, from double arithmetic rounded to fp32.
// The angle less k pi/2 (k the nearest integer to angle / (pi/2)) by two fused multiply-adds
// with pi/2 split in two doubles is exact to about 1e-16 for any such angle; the Taylor
// series of sin and cos on |r| <= pi/4 to degree 11 and 12 truncate below 1e-11. Against the
// exactly rounded fp32 values over 3.7M angles of positions up to 2M (theta 1e4, d 128) it
// differed in 24 results, the C library's sinf / cosf in 96,505. Every step is an explicit
// fma or a single product, so that no compiler contracts it differently on host and device.
// About 30 FP64 instructions without a branch, a table or a slow path: CUDA's sincosf reduces
// angles past 105615 rad by a loop of table loads through local memory, and its double sincos
// is several KB of code, which a step that de-RoPEs keys inside a larger kernel pays for
// (docs/gpu.md).
KVS_HOST_DEVICE void rope_sincos(float angle, float& s, float& c) {
  constexpr double kTwoOverPi = 0.63661977236758134308;
  constexpr double kHalfPiHi = 1.5707963267948966;     // pi/2 rounded to double
  constexpr double kHalfPiLo = 6.123233995736766e-17;  // pi/2 - kHalfPiHi
  const double x = angle;
  const double k = rint(x * kTwoOverPi);
  const double r = fma(-k, kHalfPiLo, fma(-k, kHalfPiHi, x));
  const double r2 = r * r;
  double ps = fma(r2, -1.0 / 39916800, 1.0 / 362880);
  ps = fma(r2, ps, -1.0 / 5040);
  ps = fma(r2, ps, 1.0 / 120);
  ps = fma(r2, ps, -1.0 / 6);
  const double sr = fma(r * r2, ps, r);
  double pc = fma(r2, 1.0 / 479001600, -1.0 / 3628800);
  pc = fma(r2, pc, 1.0 / 40320);
  pc = fma(r2, pc, -1.0 / 720);
  pc = fma(r2, pc, 1.0 / 24);
  pc = fma(r2, pc, -0.5);
  const double cr = fma(r2, pc, 1.0);
  // angle = k pi/2 + r, in quadrant k mod 4 (& 3 is that for a negative k too).
  const int q = int(k) & 3;
  const double sq = (q & 1) ? cr : sr, cq = (q & 1) ? sr : cr;
  s = float((q & 2) ? -sq : sq);
  c = float(((q + 1) & 2) ? -cq : cq);
}

}  // namespace kvs::kernels
