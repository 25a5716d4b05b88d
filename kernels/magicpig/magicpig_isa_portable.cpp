// Portable (scalar) set of magicpig_isa.h: any CPU, default flags.
#include <string.h>

#include "kernels/magicpig/magicpig_isa.h"

namespace kvs::kernels::magicpig::isa {
namespace {

struct V {
  using reg = float;
  static constexpr int lanes = 1;
  static reg zero() { return 0.f; }
  static reg load(const float* p) { return *p; }
  static reg load_bf16(const uint16_t* p) {
    const uint32_t u = uint32_t(*p) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
  }
  static reg set1(float x) { return x; }
  static reg fma(reg a, reg b, reg c) { return a * b + c; }
  static void store(float* p, reg x) { *p = x; }
  static float sum(reg x) { return x; }
};

#include "kernels/magicpig/magicpig_isa_body.h"

void dot(const float* q, const uint16_t* rows, const int32_t* ids, int n, int d, float* out) {
  gather_dot_impl<V>(q, rows, ids, n, d, out);
}
void axpy(const uint16_t* rows, const int32_t* ids, const float* w, int n, int d, float* acc) {
  gather_axpy_impl<V>(rows, ids, w, n, d, acc);
}

}  // namespace

extern const Kernels kPortable = {"portable", dot, axpy, V::lanes};

}  // namespace kvs::kernels::magicpig::isa
