// AVX-512 set of magicpig_isa.h; this unit alone is compiled with -mavx512f.
#include "kernels/magicpig/magicpig_isa.h"

#if defined(__x86_64__)
// GCC 12 reports its own _mm512_undefined_* placeholders inside avx512fintrin.h as
// "may be used uninitialized" once they are inlined here (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

namespace kvs::kernels::magicpig::isa {
namespace {

struct V {
  using reg = __m512;
  static constexpr int lanes = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  // bf16 -> fp32 is a 16-bit left shift of the word.
  static reg load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static float sum(reg x) { return _mm512_reduce_add_ps(x); }
};

#include "kernels/magicpig/magicpig_isa_body.h"

void dot(const float* q, const uint16_t* rows, const int32_t* ids, int n, int d, float* out) {
  gather_dot_impl<V>(q, rows, ids, n, d, out);
}
void axpy(const uint16_t* rows, const int32_t* ids, const float* w, int n, int d, float* acc) {
  gather_axpy_impl<V>(rows, ids, w, n, d, acc);
}

}  // namespace

extern const Kernels kAvx512 = {"avx512", dot, axpy, V::lanes};

}  // namespace kvs::kernels::magicpig::isa
#endif
