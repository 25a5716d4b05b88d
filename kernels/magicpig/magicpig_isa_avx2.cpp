// AVX2 + FMA set of magicpig_isa.h; this unit alone is compiled with -mavx2 -mfma.
#include "kernels/magicpig/magicpig_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>

namespace kvs::kernels::magicpig::isa {
namespace {

struct V {
  using reg = __m256;
  static constexpr int lanes = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static float sum(reg x) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
  }
};

#include "kernels/magicpig/magicpig_isa_body.h"

void dot(const float* q, const uint16_t* rows, const int32_t* ids, int n, int d, float* out) {
  gather_dot_impl<V>(q, rows, ids, n, d, out);
}
void axpy(const uint16_t* rows, const int32_t* ids, const float* w, int n, int d, float* acc) {
  gather_axpy_impl<V>(rows, ids, w, n, d, acc);
}

}  // namespace

extern const Kernels kAvx2 = {"avx2", dot, axpy, V::lanes};

}  // namespace kvs::kernels::magicpig::isa
#endif
