// MagicPIG CUDA kernels: prefill (centre, hashing, row gathers), decode (query codes, the
// dense part's sub-request rows, the GPU-only sampled attention) and the final merge.
// Simple kernels on purpose: hashing must give the CPU reference's bits exactly
// (magicpig_math.h), and the decode kernels are small next to the dense split-KV pass.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/common/merge_states.cuh"
#include "kernels/magicpig/magicpig.h"
#include "kernels/magicpig/magicpig_math.h"

namespace kvs::kernels::magicpig {
namespace {

__device__ __forceinline__ float to_float(bf16 x) {
  return __uint_as_float(uint32_t(x.bits) << 16);
}

// ---- prefill --------------------------------------------------------------------------------

// partial[(bh * chunks + c) * d + i]: fp64 sum of dim i over chunk c of (b, h)'s range,
// tokens in order (centre_cpu's order).
__global__ void centre_partial_kernel(PagedKV kv, const int32_t* starts, const int32_t* lens,
                                      int chunks, double* partial) {
  const int bh = blockIdx.x, c = blockIdx.y, i = threadIdx.x;
  const int b = bh / kv.num_kv_heads, h = bh % kv.num_kv_heads;
  const int n = lens[b], start = starts[b];
  double s = 0.0;
  for (int t = c * kCentreChunk; t < min(n, (c + 1) * kCentreChunk); ++t)
    s += double(to_float(kv.k[kv.offset(b, start + t, h) + i]));
  partial[(int64_t(bh) * chunks + c) * kv.head_dim + i] = s;
}

__global__ void centre_final_kernel(int head_dim, int num_kv_heads, const int32_t* lens, int chunks,
                                    const double* partial, float* centre) {
  const int bh = blockIdx.x, i = threadIdx.x;
  const int n = lens[bh / num_kv_heads];
  double s = 0.0;
  for (int c = 0; c < chunks; ++c) s += partial[(int64_t(bh) * chunks + c) * head_dim + i];
  centre[int64_t(bh) * head_dim + i] = n > 0 ? float(s / n) : 0.f;
}

constexpr int kHashTile = 16;  // keys per CTA of the key hashing

// One CTA per (tile of kHashTile keys, h): the [tile, d] x [d, K L] product on CUDA cores in
// fp32. Each thread owns a pair of projection columns and keeps 2 x kHashTile accumulators
// in registers (keys transposed in shared memory, so a step reads them as float4
// broadcasts); every accumulator is the sequential fmaf chain of simhash_code, so the bits
// equal the CPU reference's. Bits are OR-ed into the codes in shared memory.
template <int D>
__global__ void __launch_bounds__(256)
    hash_keys_kernel(PagedKV kv, int b, int start, int len, const float* centre_b, const float* w,
                     int K, int L, int capacity, uint16_t* codes, float* norms) {
  __shared__ __align__(16) float xt[D][kHashTile];  // transposed tile
  extern __shared__ uint32_t code_s[];              // [kHashTile][L]
  const int h = blockIdx.y, t0 = blockIdx.x * kHashTile;
  const int tiles = min(kHashTile, len - t0);
  for (int e = threadIdx.x; e < kHashTile * L; e += blockDim.x) code_s[e] = 0u;
  for (int e = threadIdx.x; e < kHashTile * D; e += blockDim.x) {
    const int t = e / D, i = e % D;
    xt[i][t] = t < tiles ? to_float(kv.k[kv.offset(b, start + t0 + t, h) + i]) -
                               centre_b[int64_t(h) * D + i]
                         : 0.f;
  }
  __syncthreads();
  if (threadIdx.x < tiles) {
    double s = 0.0;
    for (int i = 0; i < D; ++i) s += double(xt[i][threadIdx.x]) * double(xt[i][threadIdx.x]);
    norms[int64_t(h) * capacity + t0 + threadIdx.x] = float(sqrt(s));
  }
  const int cols = K * L;
  for (int c0 = 2 * threadIdx.x; c0 < cols; c0 += 2 * blockDim.x) {
    const bool two = c0 + 1 < cols;
    float a0[kHashTile], a1[kHashTile];
#pragma unroll
    for (int t = 0; t < kHashTile; ++t) a0[t] = a1[t] = 0.f;
    for (int i = 0; i < D; ++i) {
      const float w0 = w[int64_t(i) * cols + c0];
      const float w1 = two ? w[int64_t(i) * cols + c0 + 1] : 0.f;
      const float4* xr = reinterpret_cast<const float4*>(xt[i]);
#pragma unroll
      for (int q4 = 0; q4 < kHashTile / 4; ++q4) {
        const float4 x = xr[q4];
        a0[4 * q4] = fmaf(x.x, w0, a0[4 * q4]);
        a0[4 * q4 + 1] = fmaf(x.y, w0, a0[4 * q4 + 1]);
        a0[4 * q4 + 2] = fmaf(x.z, w0, a0[4 * q4 + 2]);
        a0[4 * q4 + 3] = fmaf(x.w, w0, a0[4 * q4 + 3]);
        a1[4 * q4] = fmaf(x.x, w1, a1[4 * q4]);
        a1[4 * q4 + 1] = fmaf(x.y, w1, a1[4 * q4 + 1]);
        a1[4 * q4 + 2] = fmaf(x.z, w1, a1[4 * q4 + 2]);
        a1[4 * q4 + 3] = fmaf(x.w, w1, a1[4 * q4 + 3]);
      }
    }
    const int l0 = c0 / K, j0 = c0 % K, l1 = (c0 + 1) / K, j1 = (c0 + 1) % K;
#pragma unroll
    for (int t = 0; t < kHashTile; ++t) {
      if (a0[t] > 0.f) atomicOr(&code_s[t * L + l0], 1u << j0);
      if (two && a1[t] > 0.f) atomicOr(&code_s[t * L + l1], 1u << j1);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < tiles * L; e += blockDim.x) {
    const int l = e / tiles, t = e % tiles;
    codes[(int64_t(h) * L + l) * capacity + t0 + t] = uint16_t(code_s[t * L + l]);
  }
}

__global__ void gather_rows_kernel(PagedKV kv, int b, int start, int len, int capacity, bf16* k_out,
                                   bf16* v_out) {
  const int h = blockIdx.y;
  const int words = kv.head_dim / 8;  // 16-byte words per row
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < int64_t(len) * words;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int t = int(e / words), c = int(e % words);
    const int64_t src = kv.offset(b, start + t, h) + c * 8;
    const int64_t dst = (int64_t(h) * capacity + t) * kv.head_dim + c * 8;
    *reinterpret_cast<uint4*>(k_out + dst) = *reinterpret_cast<const uint4*>(kv.k + src);
    *reinterpret_cast<uint4*>(v_out + dst) = *reinterpret_cast<const uint4*>(kv.v + src);
  }
}

// ---- decode ---------------------------------------------------------------------------------

// One CTA per query, one thread per projection column (coalesced reads of w, one FMA chain
// each: simhash_projection, so the bits equal simhash_code's); bits OR-ed into the codes.
__global__ void hash_queries_kernel(const bf16* q, int head_dim, const float* w, int K, int L,
                                    uint16_t* codes) {
  extern __shared__ float qs[];  // [head_dim], then the codes [L] as uint32
  uint32_t* code_s = reinterpret_cast<uint32_t*>(qs + head_dim);
  const int64_t row = blockIdx.x;
  for (int i = threadIdx.x; i < head_dim; i += blockDim.x) qs[i] = to_float(q[row * head_dim + i]);
  for (int l = threadIdx.x; l < L; l += blockDim.x) code_s[l] = 0u;
  __syncthreads();
  const int cols = K * L;
  for (int c = threadIdx.x; c < cols; c += blockDim.x)
    if (simhash_projection(qs, w, head_dim, cols, c) > 0.f) atomicOr(&code_s[c / K], 1u << (c % K));
  __syncthreads();
  for (int l = threadIdx.x; l < L; l += blockDim.x) codes[row * L + l] = uint16_t(code_s[l]);
}

__global__ void dense_rows_kernel(PagedKV kv, const int32_t* starts, const int32_t* lens,
                                  int max_tokens, int32_t* rows, int32_t* counts,
                                  unsigned long long* counter) {
  const int bh = blockIdx.x;
  const int b = bh / kv.num_kv_heads, h = bh % kv.num_kv_heads;
  const int seq = kv.seq_lens[b], start = starts[b], skip_end = start + lens[b];
  // seq >= skip_end holds for a prefilled sequence; the guards keep a broken caller from
  // writing outside the rows of this (b, h).
  const int count = min(max_tokens, max(0, min(seq, start) + max(0, seq - skip_end)));
  for (int i = threadIdx.x; i < count; i += blockDim.x) {
    const int t = i < start ? i : skip_end + (i - start);
    const int64_t page = kv.page_table[int64_t(b) * kv.max_pages_per_seq + t / kv.page_size];
    rows[int64_t(bh) * max_tokens + i] =
        int32_t((page * kv.page_size + t % kv.page_size) * kv.num_kv_heads + h);
  }
  if (threadIdx.x == 0) {
    counts[bh] = count;
    if (counter) atomicAdd(counter, (unsigned long long)count);
  }
}

// GPU-only sampled attention. One CTA per (b, query head, split), kWarps warps; the split
// owns the hashed ids of bitmap words [split * chunk_words, + chunk_words). Retrieval: warps
// take tables; a warp finds the part of its bucket inside the split's id range (ids ascend
// within a bucket) and each entry there sets its bit in `once`, or in `twice` when already
// in `once` (atomicOr returns the old word). Attention: warps take words of `twice`; within
// a warp, 4 groups of 8 lanes take the set bits round-robin and run an online softmax each
// (D / 8 dims per lane); groups, then warps, merge through merge_states.cuh into the
// split's partial state.
constexpr int kWarps = 16;
constexpr int kGroup = 8;
constexpr int kScanUnroll = 4;  // bucket entries in flight per lane

// First j in [lo, hi) with ids[j] >= key, or hi; ids ascending. All 32 lanes call it with the
// same arguments and get the answer: 32 probes per step shrink the range 32-fold.
__device__ __forceinline__ int32_t warp_lower_bound(const int32_t* ids, int32_t lo, int32_t hi,
                                                    int32_t key, int lane) {
  while (lo < hi) {
    const int32_t step = (hi - lo + 31) / 32;
    const int32_t pos = lo + lane * step;
    const bool less = pos < hi && __ldg(ids + pos) < key;
    const int c = __popc(__ballot_sync(0xffffffffu, less));
    if (c == 0) return lo;
    // ids[lo + (c-1) step] < key <= ids[lo + c step] (or the end): the answer lies between.
    const int32_t next_lo = lo + (c - 1) * step + 1;
    hi = min(hi, lo + c * step);
    lo = next_lo;
  }
  return lo;
}

size_t smem_for_words(int words) {
  return 2 * size_t(words) * sizeof(uint32_t) + (128 + kWarps * 128 + kWarps) * sizeof(float);
}

template <int D>
__global__ void __launch_bounds__(kWarps * 32)
    sampled_attention_kernel(const bf16* q, const uint16_t* q_codes, int num_q_heads, PagedKV kv,
                             DeviceTables t, int K, int L, float epsilon, float scale,
                             int chunk_words, float* o, float* lse, uint32_t* bitmap,
                             unsigned long long* counters) {
  constexpr int E = D / kGroup;  // dims per lane
  extern __shared__ uint32_t smem[];
  const int words_cap = (max(t.capacity, 1) + 31) / 32;  // bitmap_words(), on the device
  uint32_t* once = smem;
  uint32_t* twice = smem + chunk_words;
  float* qs = reinterpret_cast<float*>(twice + chunk_words);
  float* part_o = qs + D;                 // [kWarps][D]
  float* part_lse = part_o + kWarps * D;  // [kWarps]
  __shared__ float q_norm, q_centre;
  __shared__ unsigned long long scanned_total, found_total;

  const int row = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  const int b = row / num_q_heads, qh = row % num_q_heads;
  const int group = num_q_heads / kv.num_kv_heads, h = qh / group;
  const int bh = b * kv.num_kv_heads + h;
  const int n = t.lens[b], start = t.starts[b];
  // This split's words of the hit maps that hold ids < n, and its id range [id_lo, id_hi).
  const int w0 = split * chunk_words;
  const int words = max(0, min((n + 31) / 32, w0 + chunk_words) - w0);
  const int id_lo = w0 * 32, id_hi = min(n, (w0 + words) * 32);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  for (int i = threadIdx.x; i < words; i += blockDim.x) once[i] = twice[i] = 0u;
  for (int i = threadIdx.x; i < D; i += blockDim.x) qs[i] = to_float(q[int64_t(row) * D + i]);
  if (threadIdx.x == 0) scanned_total = found_total = 0ull;
  __syncthreads();
  if (warp == 0) {
    float s2 = 0.f, sc = 0.f;
    for (int i = lane; i < D; i += 32) {
      s2 += qs[i] * qs[i];
      sc += qs[i] * t.centre[int64_t(bh) * D + i];
    }
    for (int off = 16; off > 0; off >>= 1) {
      s2 += __shfl_xor_sync(0xffffffffu, s2, off);
      sc += __shfl_xor_sync(0xffffffffu, sc, off);
    }
    if (lane == 0) {
      q_norm = sqrtf(s2);
      q_centre = sc;
    }
  }

  const int64_t per_table = (int64_t(1) << K) + 1;
  unsigned long long scanned = 0;
  for (int l = warp; words > 0 && l < L; l += kWarps) {
    const uint16_t code = q_codes[int64_t(row) * L + l];
    const int32_t* off = t.offsets + (int64_t(bh) * L + l) * per_table;
    const int32_t* ids = t.ids + (int64_t(bh) * L + l) * t.capacity;
    int32_t s = off[code], e = off[code + 1];
    if (id_lo > 0) s = warp_lower_bound(ids, s, e, id_lo, lane);
    if (id_hi < n) e = warp_lower_bound(ids, s, e, id_hi, lane);
    scanned += e - s;
    for (int32_t j = s + lane; j < e; j += kScanUnroll * 32) {
      int32_t id[kScanUnroll];  // loads first, so kScanUnroll of them are in flight
#pragma unroll
      for (int u = 0; u < kScanUnroll; ++u)
        id[u] = j + 32 * u < e ? __ldg(ids + j + 32 * u) - id_lo : -1;
#pragma unroll
      for (int u = 0; u < kScanUnroll; ++u) {
        if (id[u] < 0) continue;
        const uint32_t bit = 1u << (id[u] & 31);
        if (atomicOr(&once[id[u] >> 5], bit) & bit) atomicOr(&twice[id[u] >> 5], bit);
      }
    }
  }
  if (lane == 0 && scanned) atomicAdd(&scanned_total, scanned);
  __syncthreads();

  const int g = lane / kGroup, gl = lane % kGroup;
  float m = -INFINITY, sum = 0.f, acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  unsigned long long found = 0;
  const float qn = q_norm, qc = q_centre;
  for (int wd = warp; wd < words; wd += kWarps) {
    uint32_t bits = twice[wd];
    if (counters && lane == 0) found += __popc(bits);
    for (int r = 0; bits; ++r) {
      const int pos = __ffs(bits) - 1;
      bits &= bits - 1;
      if (r % 4 != g) continue;
      const int id = id_lo + wd * 32 + pos;
      const int64_t base = kv.offset(b, start + id, h) + gl * E;
      float kf[E], vf[E];
#pragma unroll
      for (int c = 0; c < E; c += 8) {
        const uint4 kw = *reinterpret_cast<const uint4*>(kv.k + base + c);
        const uint4 vw = *reinterpret_cast<const uint4*>(kv.v + base + c);
        const uint32_t ku[4] = {kw.x, kw.y, kw.z, kw.w}, vu[4] = {vw.x, vw.y, vw.z, vw.w};
#pragma unroll
        for (int z = 0; z < 4; ++z) {
          kf[c + 2 * z] = __uint_as_float(ku[z] << 16);
          kf[c + 2 * z + 1] = __uint_as_float(ku[z] & 0xffff0000u);
          vf[c + 2 * z] = __uint_as_float(vu[z] << 16);
          vf[c + 2 * z + 1] = __uint_as_float(vu[z] & 0xffff0000u);
        }
      }
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) dot += qs[gl * E + e] * kf[e];
      // Only the 8 lanes of this group are here (the others skipped this bit): reduce
      // with their own mask.
      const unsigned mask = 0xffu << (g * kGroup);
      for (int off = kGroup / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(mask, dot, off);
      const float denom = qn * t.norms[int64_t(bh) * t.capacity + id];
      const float u = sampling_probability(denom > 0.f ? (dot - qc) / denom : 0.f, K, L);
      const float logit = dot * scale - logf(u + epsilon);
      const float m_new = fmaxf(m, logit);
      const float corr = expf(m - m_new), p = expf(logit - m_new);
      sum = sum * corr + p;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] = acc[e] * corr + p * vf[e];
      m = m_new;
    }
  }
  if (counters && lane == 0 && found) atomicAdd(&found_total, found);

  // Merge the 4 groups of the warp (lanes gl, gl + 8, gl + 16, gl + 24 hold the same dims).
  LseAccumulator a;
  const float my_lse = sum > 0.f ? m + logf(sum) : -INFINITY;
  a.add(my_lse);
  for (int off = kGroup; off < 32; off <<= 1) {
    LseAccumulator other;
    other.m = __shfl_xor_sync(0xffffffffu, a.m, off);
    other.sum = __shfl_xor_sync(0xffffffffu, a.sum, off);
    a.add(other);
  }
  const float warp_lse = a.lse();
  const float wgt =
      warp_lse == -INFINITY ? 0.f : merge_weight(my_lse, warp_lse) / fmaxf(sum, 1e-30f);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    float x = sum > 0.f ? acc[e] * wgt : 0.f;
    x += __shfl_xor_sync(0xffffffffu, x, 8);
    x += __shfl_xor_sync(0xffffffffu, x, 16);
    if (g == 0) part_o[warp * D + gl * E + e] = x;
  }
  if (lane == 0) part_lse[warp] = warp_lse;
  __syncthreads();

  const int64_t part = int64_t(row) * splits + split;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    LseAccumulator all;
    for (int w = 0; w < kWarps; ++w) all.add(part_lse[w]);
    const float total = all.lse();
    float x = 0.f;
    if (total != -INFINITY)
      for (int w = 0; w < kWarps; ++w) {
        const float ww = merge_weight(part_lse[w], total);
        if (ww > 0.f) x += ww * part_o[w * D + i];
      }
    o[part * D + i] = x;
    if (i == 0) lse[part] = total;
  }
  for (int i = threadIdx.x; i < chunk_words && w0 + i < words_cap; i += blockDim.x)
    bitmap[int64_t(row) * words_cap + w0 + i] = i < words ? twice[i] : 0u;
  if (counters && threadIdx.x == 0) {
    atomicAdd(&counters[0], found_total);
    atomicAdd(&counters[1], scanned_total);
  }
}

// One CTA per row: the dense part and the row's `splits` sampled parts.
__global__ void merge_parts_kernel(const bf16* o_dense, const float* lse_dense,
                                   const float* o_sampled, const float* lse_sampled, int splits,
                                   int head_dim, bf16* out, float* lse_out) {
  const int64_t row = blockIdx.x;
  const float* ls = lse_sampled + row * splits;
  LseAccumulator a;
  a.add(lse_dense[row]);
  for (int s = 0; s < splits; ++s) a.add(ls[s]);
  const float total = a.lse();
  const float wd = total == -INFINITY ? 0.f : merge_weight(lse_dense[row], total);
  for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
    float x = 0.f;
    if (wd > 0.f) x += wd * to_float(o_dense[row * head_dim + i]);
    if (total != -INFINITY)
      for (int s = 0; s < splits; ++s) {
        const float ws = merge_weight(ls[s], total);
        if (ws > 0.f) x += ws * o_sampled[(row * splits + s) * head_dim + i];
      }
    reinterpret_cast<__nv_bfloat16*>(out)[row * head_dim + i] = __float2bfloat16_rn(x);
  }
  if (lse_out && threadIdx.x == 0) lse_out[row] = total;
}

}  // namespace

int64_t centre_partial_elems(int batch, int num_kv_heads, int head_dim, int capacity) {
  const int chunks = std::max(1, (capacity + kCentreChunk - 1) / kCentreChunk);
  return int64_t(batch) * num_kv_heads * chunks * head_dim;
}

cudaError_t centre_cuda(const PagedKV& kv, const int32_t* starts, const int32_t* lens, int capacity,
                        double* partial, float* centre, cudaStream_t stream) {
  if (kv.head_dim > 1024 || capacity < 0) return cudaErrorInvalidValue;
  const int chunks = std::max(1, (capacity + kCentreChunk - 1) / kCentreChunk);
  const int bh = kv.batch * kv.num_kv_heads;
  centre_partial_kernel<<<dim3(bh, chunks), kv.head_dim, 0, stream>>>(kv, starts, lens, chunks,
                                                                      partial);
  centre_final_kernel<<<bh, kv.head_dim, 0, stream>>>(kv.head_dim, kv.num_kv_heads, lens, chunks,
                                                      partial, centre);
  return cudaGetLastError();
}

cudaError_t hash_keys_cuda(const PagedKV& kv, int b, int start, int len, const float* centre_b,
                           const float* w, const Params& p, int capacity, uint16_t* codes,
                           float* norms, cudaStream_t stream) {
  if (len <= 0) return cudaSuccess;
  if (len > capacity) return cudaErrorInvalidValue;
  const dim3 grid((len + kHashTile - 1) / kHashTile, kv.num_kv_heads);
  const size_t smem = size_t(kHashTile) * p.tables * sizeof(uint32_t);  // the codes
  if (smem > 48 * 1024) return cudaErrorInvalidValue;                   // L <= 768
  if (kv.head_dim == 128)
    hash_keys_kernel<128><<<grid, 256, smem, stream>>>(kv, b, start, len, centre_b, w, p.bits,
                                                       p.tables, capacity, codes, norms);
  else if (kv.head_dim == 64)
    hash_keys_kernel<64><<<grid, 256, smem, stream>>>(kv, b, start, len, centre_b, w, p.bits,
                                                      p.tables, capacity, codes, norms);
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

cudaError_t gather_rows_cuda(const PagedKV& kv, int b, int start, int len, int capacity,
                             bf16* k_out, bf16* v_out, cudaStream_t stream) {
  if (len <= 0) return cudaSuccess;
  if (kv.head_dim % 8 != 0 || len > capacity) return cudaErrorInvalidValue;
  const int64_t work = int64_t(len) * (kv.head_dim / 8);
  const int blocks = int(std::min<int64_t>((work + 255) / 256, 4096));
  gather_rows_kernel<<<dim3(blocks, kv.num_kv_heads), 256, 0, stream>>>(kv, b, start, len, capacity,
                                                                        k_out, v_out);
  return cudaGetLastError();
}

cudaError_t hash_queries_cuda(const bf16* q, int rows, int head_dim, const float* w,
                              const Params& p, uint16_t* codes, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  const size_t smem = (size_t(head_dim) + size_t(p.tables)) * sizeof(float);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;
  hash_queries_kernel<<<rows, 512, smem, stream>>>(q, head_dim, w, p.bits, p.tables, codes);
  return cudaGetLastError();
}

cudaError_t dense_rows_cuda(const PagedKV& kv, const int32_t* starts, const int32_t* lens,
                            int max_tokens, int32_t* rows, int32_t* counts,
                            unsigned long long* counter, cudaStream_t stream) {
  dense_rows_kernel<<<kv.batch * kv.num_kv_heads, 256, 0, stream>>>(kv, starts, lens, max_tokens,
                                                                    rows, counts, counter);
  return cudaGetLastError();
}

PagedKV dense_view(const PagedKV& kv, int32_t* rows, int32_t* counts, int max_tokens) {
  PagedKV v = kv;
  v.page_table = rows;
  v.seq_lens = counts;
  v.batch = kv.batch * kv.num_kv_heads;
  v.num_pages = kv.num_pages * kv.page_size * kv.num_kv_heads;
  v.page_size = 1;
  v.num_kv_heads = 1;
  v.max_pages_per_seq = max_tokens;
  return v;
}

int bitmap_words(int capacity) { return (std::max(capacity, 1) + 31) / 32; }

int sampled_attention_splits(int rows, int capacity, int sm_count) {
  const int words = bitmap_words(capacity);
  const int want = (4 * std::max(sm_count, 1) + std::max(rows, 1) - 1) / std::max(rows, 1);
  const int splits = std::max(1, std::min({want, kMaxSplits, words}));
  // Drop the splits that whole-word chunks would leave empty.
  const int chunk_words = (words + splits - 1) / splits;
  return (words + chunk_words - 1) / chunk_words;
}

size_t sampled_attention_smem_bytes(int capacity) { return smem_for_words(bitmap_words(capacity)); }

cudaError_t prepare_sampled_attention_cuda(int head_dim, int capacity) {
  const size_t smem = sampled_attention_smem_bytes(capacity);
  if (head_dim == 128)
    return cudaFuncSetAttribute(sampled_attention_kernel<128>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (head_dim == 64)
    return cudaFuncSetAttribute(sampled_attention_kernel<64>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  return cudaErrorInvalidValue;
}

cudaError_t sampled_attention_cuda(const bf16* q, const uint16_t* q_codes, int num_q_heads,
                                   const PagedKV& kv, const DeviceTables& t, const Params& p,
                                   float scale, int splits, float* o, float* lse, uint32_t* bitmap,
                                   unsigned long long* counters, cudaStream_t stream) {
  const int rows = kv.batch * num_q_heads;
  if (rows <= 0) return cudaSuccess;
  if (splits < 1 || splits > kMaxSplits) return cudaErrorInvalidValue;
  const int words = bitmap_words(t.capacity);
  const int chunk_words = (words + splits - 1) / splits;
  const size_t smem = smem_for_words(chunk_words);
  const dim3 grid(rows, splits);
  const float eps = float(p.epsilon);
  if (kv.head_dim == 128)
    sampled_attention_kernel<128>
        <<<grid, kWarps * 32, smem, stream>>>(q, q_codes, num_q_heads, kv, t, p.bits, p.tables, eps,
                                              scale, chunk_words, o, lse, bitmap, counters);
  else if (kv.head_dim == 64)
    sampled_attention_kernel<64>
        <<<grid, kWarps * 32, smem, stream>>>(q, q_codes, num_q_heads, kv, t, p.bits, p.tables, eps,
                                              scale, chunk_words, o, lse, bitmap, counters);
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

cudaError_t merge_parts_cuda(const bf16* o_dense, const float* lse_dense, const float* o_sampled,
                             const float* lse_sampled, int splits, int rows, int head_dim,
                             bf16* out, float* lse_out, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (splits < 1) return cudaErrorInvalidValue;
  merge_parts_kernel<<<rows, 128, 0, stream>>>(o_dense, lse_dense, o_sampled, lse_sampled, splits,
                                               head_dim, out, lse_out);
  return cudaGetLastError();
}

}  // namespace kvs::kernels::magicpig
