// bf16 storage type shared by CPU and CUDA code.
//
// kvs::bf16 is layout-compatible with CUDA's __nv_bfloat16 (one 16-bit word: 1 sign, 8
// exponent, 7 mantissa bits), so device code reinterprets the same buffers. CPU code uses
// this type so that kernels/ and runtime/ compile without CUDA headers in their interfaces.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvs {

struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2, "bf16 must be 16 bits");

inline float bf16_to_float(bf16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as __float2bfloat16_rn does; NaN stays NaN (quiet bit forced so
// that rounding can never carry a NaN payload into infinity).
inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x0040u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}

}  // namespace kvs
