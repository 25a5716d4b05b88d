// Device side of merge_states.h: merging partial attention states (o, lse) inside kernels.
//
// This is the one device version of the formula in merge_states.h. It is split into two
// pieces so that any kernel layout can use it: LseAccumulator builds the merged lse from
// the parts' lse values (one at a time, or by combining partial accumulators across lanes
// and warps), and merge_weight gives each part's weight exp(lse_i - lse) in the result.
// Then o = sum_i merge_weight(lse_i, lse) * o_i over the parts whose weight is non-zero:
// an empty part (lse = -inf) must be skipped, not multiplied by 0, because its o may hold
// anything (NaN included).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace kvs::kernels {

// log(sum_i exp(lse_i)) kept as m + log(sum) with m the largest lse so far, so that adding
// parts in any order never overflows. Empty parts (lse = -inf) are the identity.
struct LseAccumulator {
  float m = -INFINITY;
  float sum = 0.f;

  __device__ __forceinline__ void add(float lse) {
    if (lse == -INFINITY) return;
    if (lse > m) {
      sum = sum * expf(m - lse) + 1.f;  // first part: sum is 0 and expf(-inf) is 0
      m = lse;
    } else {
      sum += expf(lse - m);
    }
  }

  __device__ __forceinline__ void add(const LseAccumulator& other) {
    if (other.m == -INFINITY) return;
    if (m == -INFINITY) {
      *this = other;
      return;
    }
    const float mm = fmaxf(m, other.m);
    sum = sum * expf(m - mm) + other.sum * expf(other.m - mm);
    m = mm;
  }

  // Merged lse; -inf when every part was empty.
  __device__ __forceinline__ float lse() const {
    return m == -INFINITY ? -INFINITY : m + logf(sum);
  }
};

// Combines the accumulators of the 32 lanes of a warp; every lane gets the total. All 32
// lanes must call it.
__device__ __forceinline__ LseAccumulator warp_merge_lse(LseAccumulator acc) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    LseAccumulator other;
    other.m = __shfl_xor_sync(0xffffffffu, acc.m, offset);
    other.sum = __shfl_xor_sync(0xffffffffu, acc.sum, offset);
    acc.add(other);
  }
  return acc;
}

// A merge of states (o_i, lse_i), N values of o each (a lane's dims), folded a batch at a
// time: the running sum of exp(lse_i - m) o_i against the running max m of the lse values,
// so a single pass over the states suffices (no lse pass first). Empty states add nothing.
template <int N>
struct StateAccumulator {
  LseAccumulator lse;
  float o[N] = {};

  // Folds in K states at once: the running sum is rescaled once for the batch's maximum, and
  // no state's exponential waits for another's (folding one state at a time chained them,
  // ~1 us for a dozen in one warp). Branch-free, so that the K exponentials can overlap: an empty
  // state (lse = -inf) gets weight exp(-inf) = 0 and its o is selected away, never multiplied (it
  // may hold NaN).
  template <int K>
  __device__ __forceinline__ void add_batch(const float (&lse_k)[K], const float (&o_k)[K][N]) {
    float mb = lse.m;
#pragma unroll
    for (int k = 0; k < K; ++k) mb = fmaxf(mb, lse_k[k]);
    if (mb == -INFINITY) return;
    const float s = expf(lse.m - mb);  // 0 while nothing was added (o and sum are 0 then)
    lse.sum *= s;
#pragma unroll
    for (int e = 0; e < N; ++e) o[e] *= s;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const bool empty = lse_k[k] == -INFINITY;
      const float w = expf(lse_k[k] - mb);
      lse.sum += w;
#pragma unroll
      for (int e = 0; e < N; ++e) o[e] = fmaf(w, empty ? 0.f : o_k[k][e], o[e]);
    }
    lse.m = mb;
  }

  // Folds in K other accumulators (partial merges of other states) at once, as if their
  // states had been folded here, with one rescale and independent exponentials. An empty
  // accumulator (m = -inf, sum 0, o 0) adds nothing.
  template <int K>
  __device__ __forceinline__ void add_batch(const StateAccumulator (&parts)[K]) {
    float mb = lse.m;
#pragma unroll
    for (int k = 0; k < K; ++k) mb = fmaxf(mb, parts[k].lse.m);
    if (mb == -INFINITY) return;
    const float s = expf(lse.m - mb);
    lse.sum *= s;
#pragma unroll
    for (int e = 0; e < N; ++e) o[e] *= s;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float w = expf(parts[k].lse.m - mb);
      lse.sum = fmaf(w, parts[k].lse.sum, lse.sum);
#pragma unroll
      for (int e = 0; e < N; ++e) o[e] = fmaf(w, parts[k].o[e], o[e]);
    }
    lse.m = mb;
  }

  // The merged normalized o (0 when every state was empty) into out.
  __device__ __forceinline__ void normalized(float (&out)[N]) const {
    const float inv = lse.sum > 0.f ? 1.f / lse.sum : 0.f;
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = o[k] * inv;
  }
};

// A CTA's per-warp accumulators (D dims, D / 32 per lane) staged in shared memory, so that
// one warp can fold them: every warp put()s its own, the CTA syncs, then one warp fold()s
// them in warp order, so the result does not depend on which warp finished first.
template <int Warps, int D>
struct WarpAccumulators {
  static constexpr int kPer = D / 32;
  float o[Warps][D];
  float m[Warps], sum[Warps];

  __device__ __forceinline__ void put(const StateAccumulator<kPer>& acc, int warp, int lane) {
#pragma unroll
    for (int k = 0; k < kPer; ++k) o[warp][lane * kPer + k] = acc.o[k];
    if (lane == 0) {
      m[warp] = acc.lse.m;
      sum[warp] = acc.lse.sum;
    }
  }

  // All Warps accumulators folded in one batch; all 32 lanes of the folding warp call it.
  __device__ __forceinline__ StateAccumulator<kPer> fold(int lane) const {
    StateAccumulator<kPer> parts[Warps], total;
#pragma unroll
    for (int w = 0; w < Warps; ++w) {
      parts[w].lse.m = m[w];
      parts[w].lse.sum = sum[w];
#pragma unroll
      for (int k = 0; k < kPer; ++k) parts[w].o[k] = o[w][lane * kPer + k];
    }
    total.add_batch(parts);
    return total;
  }
};

// One output row's merge of num_items states by a CTA of Warps warps, every thread of which
// calls it: state i's lse is partial_lse[first + i * stride] and its o (D floats) starts at
// partial_o[(first + i * stride) * D]. Warp w takes states w, w + Warps, ..., loading up to
// kBatch of them (lse and o together) before it folds them in one batch, so the row costs one
// memory round trip, not one per state; the warps' accumulators then fold in warp order
// through warp_acc (the result does not depend on which warp finished first). Warp 0 writes
// o_row (bf16) and *lse_out (when not null).
template <int D, int Warps>
__device__ __forceinline__ void merge_row_states(const float* partial_lse, const float* partial_o,
                                                 int64_t first, int64_t stride, int num_items,
                                                 WarpAccumulators<Warps, D>& warp_acc,
                                                 __nv_bfloat16* o_row, float* lse_out) {
  constexpr int kPer = D / 32;  // dims per lane: one 16-byte (D 128) or 8-byte load
  constexpr int kBatch = 8;
  using Vec = typename std::conditional<kPer == 4, float4, float2>::type;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  StateAccumulator<kPer> acc;
  for (int i0 = warp; i0 < num_items; i0 += Warps * kBatch) {
    float lse_i[kBatch], o_i[kBatch][kPer];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = i0 + k * Warps;
      lse_i[k] = -INFINITY;  // past the row's states: empty, its o never read
      if (i < num_items) {
        const int64_t prow = first + int64_t(i) * stride;
        lse_i[k] = partial_lse[prow];
        const Vec v = *reinterpret_cast<const Vec*>(partial_o + prow * D + lane * kPer);
        const float* vs = reinterpret_cast<const float*>(&v);
#pragma unroll
        for (int j = 0; j < kPer; ++j) o_i[k][j] = vs[j];
      }
    }
    acc.add_batch(lse_i, o_i);
  }
  warp_acc.put(acc, warp, lane);
  __syncthreads();
  if (warp != 0) return;
  const StateAccumulator<kPer> total = warp_acc.fold(lane);
  float o[kPer];
  total.normalized(o);
  __nv_bfloat16* dst = o_row + lane * kPer;
#pragma unroll
  for (int j = 0; j < kPer; j += 2)
    *reinterpret_cast<__nv_bfloat162*>(dst + j) = __floats2bfloat162_rn(o[j], o[j + 1]);
  if (lane == 0 && lse_out) *lse_out = total.lse.lse();
}

// Weight of a part with log-sum-exp lse in a merge whose merged log-sum-exp is lse_merged.
// 0 for an empty part; callers skip parts of weight 0 (see the file comment).
__device__ __forceinline__ float merge_weight(float lse, float lse_merged) {
  return lse == -INFINITY ? 0.f : expf(lse - lse_merged);
}

}  // namespace kvs::kernels
