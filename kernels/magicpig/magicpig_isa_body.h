// The one body of the ISA-specific loops (magicpig_isa.h), instantiated by each ISA unit
// with its vector type V. Included only by those units, inside their anonymous namespace.
//
// V provides: reg, lanes, zero(), load(const float*), load_bf16(const uint16_t*),
// set1(float), fma(a, b, c) = a * b + c, store(float*, reg), sum(reg).
//
// Rows are gathered by id, so both loops are bound by memory latency: they walk several
// rows at once and prefetch the rows kPrefetch candidates ahead.

constexpr int kPrefetch = 8;

inline void prefetch_row(const uint16_t* row, int bytes) {
  for (int c = 0; c < bytes; c += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + c);
}

template <class V>
void gather_dot_impl(const float* q, const uint16_t* rows, const int32_t* ids, int n, int d,
                     float* out) {
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int p = i + kPrefetch; p < i + kPrefetch + 4 && p < n; ++p)
      prefetch_row(rows + int64_t(ids[p]) * d, d * 2);
    const uint16_t* r0 = rows + int64_t(ids[i]) * d;
    const uint16_t* r1 = rows + int64_t(ids[i + 1]) * d;
    const uint16_t* r2 = rows + int64_t(ids[i + 2]) * d;
    const uint16_t* r3 = rows + int64_t(ids[i + 3]) * d;
    typename V::reg a0 = V::zero(), a1 = V::zero(), a2 = V::zero(), a3 = V::zero();
    for (int j = 0; j < d; j += V::lanes) {
      const typename V::reg qv = V::load(q + j);
      a0 = V::fma(qv, V::load_bf16(r0 + j), a0);
      a1 = V::fma(qv, V::load_bf16(r1 + j), a1);
      a2 = V::fma(qv, V::load_bf16(r2 + j), a2);
      a3 = V::fma(qv, V::load_bf16(r3 + j), a3);
    }
    out[i] = V::sum(a0);
    out[i + 1] = V::sum(a1);
    out[i + 2] = V::sum(a2);
    out[i + 3] = V::sum(a3);
  }
  for (; i < n; ++i) {
    const uint16_t* r = rows + int64_t(ids[i]) * d;
    typename V::reg a = V::zero();
    for (int j = 0; j < d; j += V::lanes) a = V::fma(V::load(q + j), V::load_bf16(r + j), a);
    out[i] = V::sum(a);
  }
}

// acc[j0 .. j0 + NV * lanes) += sum_i w[i] rows[ids[i]][...]: the block stays in registers
// for the whole candidate list.
template <class V, int NV>
void axpy_block(const uint16_t* rows, const int32_t* ids, const float* w, int n, int d, int j0,
                float* acc) {
  typename V::reg a[NV];
  for (int v = 0; v < NV; ++v) a[v] = V::load(acc + j0 + v * V::lanes);
  for (int i = 0; i < n; ++i) {
    if (i + kPrefetch < n)
      prefetch_row(rows + int64_t(ids[i + kPrefetch]) * d + j0, NV * V::lanes * 2);
    const uint16_t* r = rows + int64_t(ids[i]) * d + j0;
    const typename V::reg wi = V::set1(w[i]);
    for (int v = 0; v < NV; ++v) a[v] = V::fma(V::load_bf16(r + v * V::lanes), wi, a[v]);
  }
  for (int v = 0; v < NV; ++v) V::store(acc + j0 + v * V::lanes, a[v]);
}

template <class V>
void gather_axpy_impl(const uint16_t* rows, const int32_t* ids, const float* w, int n, int d,
                      float* acc) {
  int j = 0;
  for (; j + 8 * V::lanes <= d; j += 8 * V::lanes) axpy_block<V, 8>(rows, ids, w, n, d, j, acc);
  for (; j + 4 * V::lanes <= d; j += 4 * V::lanes) axpy_block<V, 4>(rows, ids, w, n, d, j, acc);
  for (; j < d; j += V::lanes) axpy_block<V, 1>(rows, ids, w, n, d, j, acc);
}
