// e4m3 with a scale per row: the one rounding rule of every fp8 copy kvsparse keeps (SAAP's
// router weights, AttentionPredictor's calibration keys), on the host and the device alike.
//
// A row of values x becomes e4m3(x / s) with s = max |x| / 448, so that the row's largest value
// maps to e4m3's largest finite value (a row of zeros gets s = 1), rounded to nearest even by
// CUDA's own conversion, saturating: x / s may round just above 448 in float. The value a
// kernel multiplies with is s * e4m3 (e4m3 -> fp16 is exact).
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/common/host_device.h"

namespace kvs::kernels {

constexpr float kE4m3Max = 448.f;

KVS_HOST_DEVICE float e4m3_row_scale(float amax) { return amax > 0.f ? amax / kE4m3Max : 1.f; }

KVS_HOST_DEVICE uint8_t to_e4m3(float x, float row_scale) {
  return __nv_cvt_float_to_fp8(x / row_scale, __NV_SATFINITE, __NV_E4M3);
}

KVS_HOST_DEVICE float from_e4m3(uint8_t v) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(v, __NV_E4M3)));
}

}  // namespace kvs::kernels
