// Integer rows with a scale per row: the rounding rule of AttentionPredictor's int4 key copy
// (a key: int4) and of the queries its rows score against it (a query head: int8), on the
// host and the device alike.
//
// A row of values x becomes q = clamp(rint(x / s), -L, L) with s = max |x| / L (L = 7 for
// int4, 127 for int8; a row of zeros gets s = 1): symmetric, so a row's largest value maps to
// +-L and 0 stays 0. rint rounds to nearest even in float, as the device does; x / s is an IEEE
// division on both (no fast-math). The value a kernel multiplies with is s * q.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/common/host_device.h"

namespace kvs::kernels {

constexpr int kInt4Max = 7, kInt8Max = 127;

KVS_HOST_DEVICE float int_row_scale(float amax, int levels) {
  return amax > 0.f ? amax / float(levels) : 1.f;
}

KVS_HOST_DEVICE int to_int_level(float x, float row_scale, int levels) {
  const float r = rintf(x / row_scale);
  return int(fminf(fmaxf(r, -float(levels)), float(levels)));
}

}  // namespace kvs::kernels
