// CUDA side of Tactic (see tactic.h for the state layout and the k-means definition).
//
// Prefill k-means, per batch of (sequence, kv head) problems, `iterations` times:
//   assign  fused bf16 tensor-core product keys x centroids (mma.m16n8k16, fp32
//           accumulate) with the argmin of ||mu||^2 - 2 k.mu in the epilogue: a 128-key tile
//           streams every centroid through a ring of two 64-centroid chunks, so the
//           n x C distance matrix never reaches memory. At n = 128K, C = 8192, d = 128 one
//           iteration is n*C*d = 1.37e11 MACs (2.75e11 FLOP) per kv head, 2.75 TFLOP for
//           10 iterations, while a materialised fp32 distance matrix would be 4 GiB per
//           head per iteration: a cuBLAS GEMM + argmin pass would be bound by that traffic
//           (2d / 4 = 64 FLOP per byte), the fused kernel only by the tensor cores.
//   csr     one device-wide radix sort of every problem's (problem, label) keys with the
//           token as value (stable, so members stay ascending within a cluster, exactly as on
//           the CPU), then a scatter kernel that writes the members and, at each change of
//           label, the offsets. One CTA per problem (a chain of 256 block sorts at 128K)
//           took 14 % of the k-means at 128K and 31 % at 32K on an H200 (docs/gpu.md).
//   update  one warp per cluster: fp32 mean of its members in member order, rounded to bf16;
//           an empty cluster keeps its centroid.
// Decode-time block re-clustering runs the same steps in a thread-block cluster per (sequence,
// kv head), sharing the assignment's device code; its update sums each cluster's members in
// the same order, 16 bytes a thread instead of a warp a cluster (see recluster_kernel).
//
// Decode selection (one launch each, no host sync, graph-safe):
//   score   q.centroid for the g query heads of a kv head, one CTA per 128-cluster tile that
//           stages the (contiguous) centroids through shared memory with coalesced loads and
//           scores them on the tensor cores (bf16 mma, fp32 accumulation)
//   order   descending, per (sequence, query head), with the sorted-position prefix of
//           cluster sizes and the token of every sampled position. Up to 8192 clusters (128K
//           tokens): a bucket histogram over the score range by one CTA per row, which ranks
//           only the buckets that hold what is read (the top of the order and the fit
//           windows; block radix sort of the row when the spread is degenerate). Longer
//           lists: one CUB radix sort of every row's (row, descending score) keys, then a
//           prefix kernel (a CTA per row: the prefix in shared memory a round at a time, each
//           sample's cluster searched there)
//   sample  logits of the exact and window positions: a group of d / 8 lanes per sampled
//           token (one coalesced key-row read, shuffle sum), several tokens per group
//   budget  max, exact prefix (in shared memory), window means (exponentials in fp32, their sums
//           and the prefix in fp64), fit, K (a block-parallel search), round up to clusters by a
//           block-wide count over the prefix (or, past the ranked top, the order kernel's bucket
//           group of token K - 1 and a rank of its clusters), bitmap OR (union), and the members
//           each newly set bit adds to its index chunk
//   index   compaction of the union's members + recent tokens into the sub-request page
//           table: a CTA per 256-cluster chunk (its start from the earlier chunks' counts),
//           a warp per flagged cluster
// The order, sample, budget and index kernels are launched programmatically behind the kernel
// before them: their CTAs get resident while it ends and issue the loads that do not depend on
// it (the CSR offsets, the query, the sorted prefix) before griddepcontrol.wait.
// Attention is then the dense split-KV kernel over the sub-request view (tactic.h).
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cub/cub.cuh>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/common/float_key.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/tactic/tactic.h"

namespace kvs::kernels::tactic {
namespace {

using bf = __nv_bfloat16;

constexpr int kCsrThreads = 256;    // threads of the prefill CSR scatter kernel
constexpr int kAssignMTiles = 2;    // 16-key m-tiles per assign warp: a B fragment serves each
constexpr int kTileRows = 4 * 16 * kAssignMTiles;  // keys per assign tile (4 warps)
constexpr int kTileCols = 64;       // centroids per assign chunk
constexpr int kAssignPad = 8;       // bf16 row padding: a fragment load's 8 rows on distinct banks
constexpr int kMaxGroup = 8;
constexpr int kBlockSmemLimit = 160 * 1024;

struct Problem {
  int b, h, start, n, C, c0;
  uint64_t stream;
  int64_t scratch;   // first label of this problem in the label scratch
  int64_t cscratch;  // first cluster of this problem in the per-cluster scratch
};

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

__device__ __forceinline__ const bf* key_row(const PagedKV& kv, int b, int t, int h) {
  return reinterpret_cast<const bf*>(kv.k) + kv.offset(b, t, h);
}

// ---- shared k-means pieces ----------------------------------------------------------------

// ||centroid||^2 of bf16 values by one warp (lane l sums dims [l D/32, (l + 1) D/32)).
template <int D>
__device__ __forceinline__ float warp_centroid_norm(const bf* centroid, int lane) {
  constexpr int kPer = D / 32;
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < kPer; ++e) {
    const float v = __bfloat162float(centroid[lane * kPer + e]);
    s += v * v;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  return s;
}

// One warp: centroid <- bf16(mean of keys of members[lo, hi)) unless empty; *norm <-
// ||centroid||^2 of the stored bf16 values. centroid may be global or shared memory.
template <int D>
__device__ void warp_update_centroid(const PagedKV& kv, int b, int h, const int32_t* members,
                                     int lo, int hi, bf* centroid, float* norm, int lane) {
  constexpr int kPer = D / 32;
  if (hi > lo) {
    float acc[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) acc[e] = 0.f;
    for (int m = lo; m < hi; ++m) {
      const bf* k = key_row(kv, b, members[m], h) + lane * kPer;
#pragma unroll
      for (int e = 0; e < kPer; ++e) acc[e] += __bfloat162float(k[e]);
    }
    const float count = float(hi - lo);
#pragma unroll
    for (int e = 0; e < kPer; ++e) centroid[lane * kPer + e] = __float2bfloat16_rn(acc[e] / count);
  }
  __syncwarp();
  const float s = warp_centroid_norm<D>(centroid, lane);
  if (lane == 0) *norm = s;
}

// One warp: centroid <- the key row `key` (the initialisation), and its norm.
template <int D>
__device__ void warp_init_centroid(const bf* key, bf* centroid, float* norm, int lane) {
  for (int e = lane; e < D; e += 32) centroid[e] = key[e];
  __syncwarp();
  const float s = warp_centroid_norm<D>(centroid, lane);
  if (lane == 0) *norm = s;
}

// ---- prefill k-means ------------------------------------------------------------------------

template <int D>
__global__ void __launch_bounds__(256)
    init_kernel(PagedKV kv, const Problem* probs, ClusterState st, float* norms) {
  const Problem p = probs[blockIdx.y];
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    st.num_clusters[st.slot(p.b, p.h)] = p.c0 + p.C;
    st.clustered_len[st.slot(p.b, p.h)] = p.start + p.n;
  }
  const int c = blockIdx.x * 8 + threadIdx.x / 32;
  if (c >= p.C) return;
  warp_init_centroid<D>(key_row(kv, p.b, p.start + kmeans_init_index(p.stream, c, p.n, p.C), p.h),
                        reinterpret_cast<bf*>(st.centroid(p.b, p.h, p.c0 + c)),
                        norms + p.cscratch + c, threadIdx.x % 32);
}

// ---- the assignment on the tensor cores, shared by the prefill and the block re-clustering ----
//
// A warp holds M m-tiles of 16 keys as bf16 A fragments (mma.m16n8k16) and runs them against
// centroids staged in shared memory (rows LD bf16 apart), keeping for each of its keys the
// smallest ||mu||^2 - 2 k.mu, ascending c, strict (ties to the lowest index, as on the CPU).

// The A fragments of the warp's M x 16 keys, rows [0, 16 M) of `rows`: of m-tile m, rows g and
// g + 8, dims 16k + 2cq (+1) and + 8 (+9).
template <int D, int M, int LD>
__device__ __forceinline__ void load_key_fragments(const bf* rows, uint32_t (&a)[M][D / 16][4],
                                                   int lane) {
  constexpr int kWords = LD / 2;  // 32-bit words a row
  const int g = lane / 4, cq = lane % 4;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const uint32_t* k0 = reinterpret_cast<const uint32_t*>(rows + (m * 16 + g) * LD) + cq;
    const uint32_t* k8 = k0 + 8 * kWords;
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      a[m][k][0] = k0[8 * k];
      a[m][k][1] = k8[8 * k];
      a[m][k][2] = k0[8 * k + 4];
      a[m][k][3] = k8[8 * k + 4];
    }
  }
}

template <int M>
__device__ __forceinline__ void clear_best(float (&best)[M][2], int (&arg)[M][2]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      best[m][r] = INFINITY;
      arg[m][r] = 0;
    }
}

// The keys against centroids [0, cols) of `chunk` (cols a multiple of 8; their norms in `cn`,
// INFINITY for padding rows so that those never win), numbered from c0. Each thread keeps the
// best of the columns it holds: key g (+ 8) of each m-tile against columns 2cq, 2cq + 1 of
// every 8.
template <int D, int M, int LD>
__device__ __forceinline__ void assign_chunk(const uint32_t (&a)[M][D / 16][4], const bf* chunk,
                                             const float* cn, int c0, int cols, float (&best)[M][2],
                                             int (&arg)[M][2], int lane) {
  static_assert(D % 32 == 0, "ldmatrix x4 covers 32 dims");
  const int cq = lane % 4;
  // B fragments by ldmatrix: lanes 8j..8j+7 address the 8 centroids' rows at dims 8j of a
  // 32-dim block, so one x4 load gives the fragments of two k-steps (b0, b1 of k-step 2kk:
  // registers 0, 1; of 2kk + 1: 2, 3), where 32-bit loads took 8.
  const uint32_t bbase = ptx::smem_addr(chunk + (lane % 8) * LD + (lane / 8) * 8);
#pragma unroll 2
  for (int n0 = 0; n0 < cols; n0 += 8) {
    float d[M][4];
#pragma unroll
    for (int m = 0; m < M; ++m) d[m][0] = d[m][1] = d[m][2] = d[m][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 32; ++kk) {
      uint32_t r[4];
      ptx::ldmatrix_x4(r, bbase + uint32_t((n0 * LD + 32 * kk) * sizeof(bf)));
      const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
#pragma unroll
      for (int m = 0; m < M; ++m) {
        ptx::mma_bf16_16816(d[m], a[m][2 * kk], b0, d[m]);
        ptx::mma_bf16_16816(d[m], a[m][2 * kk + 1], b1, d[m]);
      }
    }
    // d[m][0], d[m][1]: key g of m-tile m against centroids n0 + 2cq, + 1; d[m][2],
    // d[m][3]: key g + 8.
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float nc = cn[n0 + 2 * cq + e];
      const int c = c0 + n0 + 2 * cq + e;
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float dist = nc - 2.f * d[m][2 * r + e];
          if (dist < best[m][r]) {
            best[m][r] = dist;
            arg[m][r] = c;
          }
        }
    }
  }
}

// The 4 threads of a key row hold interleaved columns: after this each holds the row's best
// (the smaller distance, ties to the lower index).
template <int M>
__device__ __forceinline__ void settle_best(float (&best)[M][2], int (&arg)[M][2]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int o = 1; o < 4; o <<= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best[m][r], o);
        const int oa = __shfl_xor_sync(0xffffffffu, arg[m][r], o);
        if (ob < best[m][r] || (ob == best[m][r] && oa < arg[m][r])) {
          best[m][r] = ob;
          arg[m][r] = oa;
        }
      }
}

// The assignment of a tile of kTileRows keys (kAssignMTiles x 16 a warp) against every
// centroid of its problem, on the tensor cores (bf16 mma.m16n8k16, fp32 accumulation): the
// warp's keys are the A fragments, held in registers for the whole pass, and each B fragment
// is loaded once for all of them; the centroids stream through shared memory in chunks of
// kTileCols, two chunks in a ring (cp.async), so that the next chunk and its norms load while
// this one is multiplied; each thread keeps the best of its 2 kAssignMTiles keys from the
// accumulator fragments (||mu||^2 - 2 k.mu, ascending c, strict: ties to the lowest index) and
// the 4 threads of a key row settle it by shuffles at the end. The WMMA form (a chunk loaded,
// then multiplied, its scores stored to shared memory and scanned by one thread a key) ran the
// k-means at about 100 TFLOPS at 128K on an H200, 0.91 of torch SDPA's causal prefill
// attention over the same context (docs/gpu.md).
template <int D>
constexpr size_t assign_smem_bytes() {
  return size_t(kTileRows + 2 * kTileCols) * (D + kAssignPad) * sizeof(bf) +
         2 * size_t(kTileCols) * sizeof(float);
}

template <int D>
__global__ void __launch_bounds__(128)
    assign_kernel(PagedKV kv, const Problem* probs, ClusterState st, const float* norms, int cbits,
                  uint32_t* keys, int32_t* tokens) {
  constexpr int M = kAssignMTiles;
  static_assert(kTileRows == 4 * 16 * M && kTileCols % 8 == 0, "M 16-key m-tiles a warp of 4");
  constexpr int LD = D + kAssignPad, kChunks = D / 8;
  const Problem p = probs[blockIdx.y];
  const int i0 = blockIdx.x * kTileRows;
  if (i0 >= p.n) return;
  extern __shared__ __align__(128) unsigned char smem[];
  bf* ks = reinterpret_cast<bf*>(smem);
  bf* cs = ks + kTileRows * LD;                                    // [2][kTileCols][LD]
  float* nrm = reinterpret_cast<float*>(cs + 2 * kTileCols * LD);  // [2][kTileCols]
  const bf* cbase = reinterpret_cast<const bf*>(st.centroid(p.b, p.h, p.c0));
  const float* nbase = norms + p.cscratch;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, cq = lane % 4;
  // A chunk's centroids into ring slot `slot` (zeros past C) and its norms (INFINITY past C,
  // so that padding never wins), as cp.async groups of the calling thread.
  const auto stage = [&](int c0, int slot) {
    bf* dst = cs + slot * kTileCols * LD;
    for (int x = tid; x < kTileCols * kChunks; x += blockDim.x) {
      const int r = x / kChunks, ch = x % kChunks;
      const bool valid = c0 + r < p.C;
      ptx::cp_async_16(ptx::smem_addr(dst + r * LD + ch * 8),
                       cbase + int64_t(valid ? c0 + r : 0) * D + ch * 8, valid);
    }
  };
  const auto stage_norms = [&](int c0, int slot) {
    for (int r = tid; r < kTileCols; r += blockDim.x)
      nrm[slot * kTileCols + r] = c0 + r < p.C ? nbase[c0 + r] : INFINITY;
  };
  for (int x = tid; x < kTileRows * kChunks; x += blockDim.x) {
    const int r = x / kChunks, ch = x % kChunks;
    const bool valid = i0 + r < p.n;
    ptx::cp_async_16(ptx::smem_addr(ks + r * LD + ch * 8),
                     key_row(kv, p.b, p.start + i0 + (valid ? r : 0), p.h) + ch * 8, valid);
  }
  stage(0, 0);
  ptx::cp_async_commit();
  stage_norms(0, 0);
  ptx::cp_async_wait<0>();
  __syncthreads();
  uint32_t a[M][D / 16][4];
  load_key_fragments<D, M, LD>(ks + warp * M * 16 * LD, a, lane);
  float best[M][2];
  int arg[M][2];
  clear_best<M>(best, arg);
  const int num = (p.C + kTileCols - 1) / kTileCols;
  for (int it = 0; it < num; ++it) {
    const int slot = it % 2, c0 = it * kTileCols;
    if (it + 1 < num) stage(c0 + kTileCols, slot ^ 1);  // in flight during this chunk
    ptx::cp_async_commit();
    float next_norm = INFINITY;
    if (it + 1 < num && tid < kTileCols && c0 + kTileCols + tid < p.C)
      next_norm = nbase[c0 + kTileCols + tid];
    assign_chunk<D, M, LD>(a, cs + slot * kTileCols * LD, nrm + slot * kTileCols, c0, kTileCols,
                           best, arg, lane);
    ptx::cp_async_wait<0>();
    if (tid < kTileCols) nrm[(slot ^ 1) * kTileCols + tid] = next_norm;
    __syncthreads();  // the next chunk is in; this one may be overwritten after the next wait
  }
  settle_best<M>(best, arg);
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = (warp * M + m) * 16 + g + 8 * r;
      if (cq == 0 && i0 + row < p.n) {
        keys[p.scratch + i0 + row] = (uint32_t(blockIdx.y) << cbits) | uint32_t(arg[m][r]);
        tokens[p.scratch + i0 + row] = i0 + row;
      }
    }
}

// Bits that hold every value in [0, v) (at least one).
int bits_for(int64_t v) {
  int b = 1;
  while ((int64_t(1) << b) < v) ++b;
  return b;
}

// The CSR of every problem from its tokens sorted by (problem, label): sorted position j holds
// token tokens[j] of problem keys[j] >> cbits, label keys[j] & mask. Problem q's tokens are
// positions [q.scratch, q.scratch + q.n), so position j is its member j - q.scratch; the
// thread at a change of label writes the offsets of the labels it passes over (empty
// clusters included), and the problem's last token those up to C. With `rows` (the last
// iteration, where the state keeps them) also each member's page row.
__global__ void __launch_bounds__(kCsrThreads)
    csr_scatter_kernel(const Problem* probs, ClusterState st, const uint32_t* keys,
                       const int32_t* tokens, int64_t total, int cbits, PagedKV kv, bool rows) {
  const int64_t j = int64_t(blockIdx.x) * kCsrThreads + threadIdx.x;
  if (j >= total) return;
  const uint32_t mask = (1u << cbits) - 1u;
  const uint32_t key = keys[j];
  const Problem p = probs[key >> cbits];
  const int c = int(key & mask);
  const int local = int(j - p.scratch);
  const int t = p.start + tokens[j];
  st.members_of(p.b, p.h)[p.start + local] = t;
  if (rows) st.member_rows_of(p.b, p.h)[p.start + local] = kv.page_row_of(p.b, t);
  int32_t* off = st.offsets_of(p.b, p.h) + p.c0;
  const int prev = local > 0 ? int(keys[j - 1] & mask) : -1;
  for (int x = prev + 1; x <= c; ++x) off[x] = p.start + local;
  if (local == p.n - 1)
    for (int x = c + 1; x <= p.C; ++x) off[x] = p.start + p.n;
}

template <int D>
__global__ void __launch_bounds__(256)
    update_kernel(PagedKV kv, const Problem* probs, ClusterState st, float* norms) {
  const Problem p = probs[blockIdx.y];
  const int c = blockIdx.x * 8 + threadIdx.x / 32;
  if (c >= p.C) return;
  const int32_t* off = st.offsets_of(p.b, p.h) + p.c0;
  warp_update_centroid<D>(kv, p.b, p.h, st.members_of(p.b, p.h), off[c], off[c + 1],
                          reinterpret_cast<bf*>(st.centroid(p.b, p.h, p.c0 + c)),
                          norms + p.cscratch + c, threadIdx.x % 32);
}

// The sort's bits: the problem above the label.
struct SortBits {
  int cbits, total;
};

SortBits sort_bits(int num_problems, int max_clusters) {
  const int cbits = bits_for(max_clusters), pbits = bits_for(num_problems);
  return SortBits{cbits, cbits + pbits};
}

struct PrefillLayout {
  size_t problems, keys_a, keys_b, tokens_a, tokens_b, norms, sort_temp, sort_bytes, total;
  int64_t max_items;
};

size_t prefill_sort_bytes(int64_t items, int end_bit) {
  size_t bytes = 0;
  cub::DoubleBuffer<uint32_t> keys(nullptr, nullptr);
  cub::DoubleBuffer<int32_t> tokens(nullptr, nullptr);
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, keys, tokens, items, 0, end_bit);
  return bytes;
}

PrefillLayout prefill_layout(int batch, int num_kv_heads, int max_len, int cluster_size) {
  auto up = [](size_t x) { return (x + 255) / 256 * 256; };
  const size_t P = size_t(batch) * num_kv_heads;
  const int C = kmeans_num_clusters(max_len, cluster_size);
  const size_t items = P * size_t(max_len);
  PrefillLayout l;
  l.max_items = int64_t(items);
  l.problems = 0;
  l.keys_a = up(P * sizeof(Problem));
  l.keys_b = l.keys_a + up(items * sizeof(uint32_t));
  l.tokens_a = l.keys_b + up(items * sizeof(uint32_t));
  l.tokens_b = l.tokens_a + up(items * sizeof(int32_t));
  l.norms = l.tokens_b + up(items * sizeof(int32_t));
  l.sort_temp = l.norms + up(P * size_t(C) * sizeof(float));
  l.sort_bytes = prefill_sort_bytes(l.max_items, sort_bits(int(P), C).total);
  l.total = l.sort_temp + up(l.sort_bytes);
  return l;
}

template <int D>
cudaError_t launch_prefill(const PagedKV& kv, const std::vector<Problem>& probs, int max_n,
                           int max_c, int iterations, const ClusterState& st, char* ws,
                           const PrefillLayout& l, cudaStream_t stream) {
  cudaError_t err = prepare_cuda(D);
  if (err != cudaSuccess) return err;
  const int P = int(probs.size());
  auto* d_probs = reinterpret_cast<Problem*>(ws + l.problems);
  auto* norms = reinterpret_cast<float*>(ws + l.norms);
  if (probs.empty()) return cudaErrorInvalidValue;
  const int64_t items = probs.back().scratch + probs.back().n;  // problems are contiguous
  const SortBits bits = sort_bits(P, max_c);
  if (bits.total > 32 || items > l.max_items ||
      prefill_sort_bytes(items, bits.total) > l.sort_bytes)
    return cudaErrorInvalidValue;
  err = cudaMemcpyAsync(d_probs, probs.data(), probs.size() * sizeof(Problem),
                        cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess) return err;
  // probs must outlive the copy: the caller synchronizes before it goes away.
  const dim3 per_cluster(unsigned(std::max(1, (max_c + 7) / 8)), unsigned(P));
  init_kernel<D><<<per_cluster, 256, 0, stream>>>(kv, d_probs, st, norms);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if (max_n == 0) return cudaSuccess;
  const dim3 tiles(unsigned((max_n + kTileRows - 1) / kTileRows), unsigned(P));
  const unsigned scatter_ctas = unsigned((items + kCsrThreads - 1) / kCsrThreads);
  for (int it = 0; it < iterations; ++it) {
    // The sort ping-pongs between the two buffers; the assignment always writes the first.
    cub::DoubleBuffer<uint32_t> keys(reinterpret_cast<uint32_t*>(ws + l.keys_a),
                                     reinterpret_cast<uint32_t*>(ws + l.keys_b));
    cub::DoubleBuffer<int32_t> tokens(reinterpret_cast<int32_t*>(ws + l.tokens_a),
                                      reinterpret_cast<int32_t*>(ws + l.tokens_b));
    assign_kernel<D><<<tiles, 128, assign_smem_bytes<D>(), stream>>>(
        kv, d_probs, st, norms, bits.cbits, keys.Current(), tokens.Current());
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    size_t temp_bytes = l.sort_bytes;
    err = cub::DeviceRadixSort::SortPairs(ws + l.sort_temp, temp_bytes, keys, tokens, items, 0,
                                          bits.total, stream);
    if (err != cudaSuccess) return err;
    csr_scatter_kernel<<<scatter_ctas, kCsrThreads, 0, stream>>>(
        d_probs, st, keys.Current(), tokens.Current(), items, bits.cbits, kv,
        st.member_rows != nullptr && it + 1 == iterations);
    update_kernel<D><<<per_cluster, 256, 0, stream>>>(kv, d_probs, st, norms);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// ---- decode-time block re-clustering ---------------------------------------------------------
//
// A thread-block cluster of Q CTAs per (sequence, kv head), Q = the block's tokens / 256
// rounded up to a power of two, at most 8 (8 at the default 2048). In pass p, CTA k assigns
// tokens [256 (p Q + k), + 256) of the block (a warp's 32 keys as two m-tiles of A fragments,
// read from the KV cache through the block's row table). Every CTA keeps a copy of every
// centroid in shared memory; one iteration is:
//   assign  each CTA its keys against all centroids (assign_chunk, as the prefill), the labels
//           written into every CTA of the cluster (distributed shared memory); cluster barrier
//   csr     each CTA builds the whole block's CSR from the labels in its shared memory: per
//           warp a contiguous run of tokens, counted and then placed by __match_any_sync, so
//           members stay ascending within a cluster without a sort
//   update  CTA k owns clusters [k Cq, (k + 1) Cq): D / 8 threads a cluster, each summing its
//           16 bytes of every member key in member order (fp32, as warp_update_centroid) and
//           writing the bf16 mean into every CTA's copy; cluster barrier; each CTA recomputes
//           the norms
// The last iteration's CSR and centroids go to the state. The kernel is launched on every
// decode step and returns at once unless the block is due (one load); a single CTA per
// (sequence, kv head) on SIMT distances took 6.9 ms a layer at 128K on an H200 (docs/gpu.md).
constexpr int kReclusterThreads = 256;
constexpr int kReclusterWarps = kReclusterThreads / 32;
constexpr int kReclusterRows = kReclusterWarps * 32;  // block tokens a CTA a pass: 2 m-tiles a warp
constexpr int kReclusterMaxCtas = 8;                  // the portable cluster size

// CTAs in the cluster of a block of T tokens: enough for one pass, a power of two up to 8.
int recluster_ctas(int T) {
  int q = 1;
  while (q < kReclusterMaxCtas && q * kReclusterRows < T) q *= 2;
  return q;
}

// Shared memory of one CTA (16-byte aligned pieces): centroids padded to a multiple of 8 rows,
// their norms, the block's labels and CSR, per-warp counts, and the block tokens' KV rows.
struct ReclusterLayout {
  size_t mu, norm, labels, members, offsets, wcount, krow, total;
};

template <int D>
KVS_HOST_DEVICE ReclusterLayout recluster_layout(int T, int cluster_size) {
  auto up = [](size_t x) { return (x + 15) / 16 * 16; };
  const size_t C = size_t(T / cluster_size), C8 = (C + 7) / 8 * 8;
  ReclusterLayout l;
  l.mu = 0;
  l.norm = l.mu + up(C8 * (D + kAssignPad) * sizeof(bf));
  l.labels = l.norm + up(C8 * sizeof(float));
  l.members = l.labels + up(size_t(T) * sizeof(int32_t));
  l.offsets = l.members + up(size_t(T) * sizeof(int32_t));
  l.wcount = l.offsets + up((C + 1) * sizeof(int32_t));
  l.krow = l.wcount + up(size_t(kReclusterWarps) * C * sizeof(int32_t));
  l.total = l.krow + up(size_t(T) * sizeof(int32_t));
  return l;
}

template <int D>
__global__ void __launch_bounds__(kReclusterThreads, 2)
    recluster_kernel(PagedKV kv, int layer, int T, int cluster_size, int iterations, uint64_t seed,
                     ClusterState st) {
  namespace cg = cooperative_groups;
  constexpr int LD = D + kAssignPad, M = 2, kPieces = D / 8;
  const int b = blockIdx.y / kv.num_kv_heads, h = blockIdx.y % kv.num_kv_heads;
  const int64_t s = st.slot(b, h);
  const int start = st.clustered_len[s], c0 = st.num_clusters[s];
  const int C = T / cluster_size, C8 = (C + 7) / 8 * 8;
  // The same for every CTA of the cluster, so they leave together.
  if (kv.seq_lens[b] - start < T) return;  // nothing due: the common case, one load
  if (start + T > st.max_tokens || c0 + C > st.max_clusters) return;
  cg::cluster_group cluster = cg::this_cluster();
  const int Q = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const ReclusterLayout lay = recluster_layout<D>(T, cluster_size);
  extern __shared__ __align__(16) unsigned char recluster_smem[];
  bf* mu = reinterpret_cast<bf*>(recluster_smem + lay.mu);  // [C8][LD]
  float* norm = reinterpret_cast<float*>(recluster_smem + lay.norm);
  int32_t* labels = reinterpret_cast<int32_t*>(recluster_smem + lay.labels);    // [T]
  int32_t* members = reinterpret_cast<int32_t*>(recluster_smem + lay.members);  // [T]
  int32_t* offsets = reinterpret_cast<int32_t*>(recluster_smem + lay.offsets);  // [C + 1]
  int32_t* wcount = reinterpret_cast<int32_t*>(recluster_smem + lay.wcount);    // [warps][C]
  int32_t* krow = reinterpret_cast<int32_t*>(recluster_smem + lay.krow);        // [T]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, cq = lane % 4;
  // Each block token's KV row, once: every later key load is then one round trip.
  for (int i = tid; i < T; i += kReclusterThreads) {
    const int t = start + i;
    krow[i] = kv.page_table[int64_t(b) * kv.max_pages_per_seq + t / kv.page_size] * kv.page_size +
              t % kv.page_size;
  }
  __syncthreads();
  const auto key_at = [&](int i) {  // block token i's key
    return reinterpret_cast<const bf*>(kv.k) +
           (int64_t(krow[i]) * kv.num_kv_heads + h) * int64_t(D);
  };
  // Every CTA starts from the same centroids (kmeans_init_index, as the CPU): all rows'
  // pieces in flight at once, padding rows zero with an infinite norm.
  const uint64_t stream = kmeans_stream(seed, layer, h, start);
  for (int x0 = tid; x0 < C8 * kPieces; x0 += 8 * kReclusterThreads) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int x = x0 + u * kReclusterThreads, c = x / kPieces;
      v[u] = make_uint4(0u, 0u, 0u, 0u);
      if (c < C)
        v[u] =
            reinterpret_cast<const uint4*>(key_at(kmeans_init_index(stream, c, T, C)))[x % kPieces];
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int x = x0 + u * kReclusterThreads;
      if (x < C8 * kPieces) reinterpret_cast<uint4*>(mu + (x / kPieces) * LD)[x % kPieces] = v[u];
    }
  }
  __syncthreads();
  for (int c = warp; c < C8; c += kReclusterWarps) {
    const float nrm = warp_centroid_norm<D>(mu + c * LD, lane);
    if (lane == 0) norm[c] = c < C ? nrm : INFINITY;
  }
  // The warp's 32 keys of a pass as A fragments, straight from the KV cache (zeros past the
  // block), loaded again each iteration: held across the update they cost the registers of a
  // second CTA on the SM, which the check on every decode step needs more (docs/gpu.md).
  const int passes = (T + Q * kReclusterRows - 1) / (Q * kReclusterRows);
  uint32_t a[M][D / 16][4];
  const auto load_keys = [&](int row0) {
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = row0 + m * 16 + g + 8 * r;
        const uint32_t* k = i < T ? reinterpret_cast<const uint32_t*>(key_at(i)) + cq : nullptr;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          a[m][kk][r] = k ? k[8 * kk] : 0u;
          a[m][kk][r + 2] = k ? k[8 * kk + 4] : 0u;
        }
      }
  };
  const auto first_row = [&](int pass) { return (pass * Q + rank) * kReclusterRows + warp * 32; };
  // Token runs of the CSR build, one a warp, and the clusters this CTA updates.
  const int run = (T + kReclusterWarps - 1) / kReclusterWarps;
  const int run_lo = min(T, warp * run), run_hi = min(T, run_lo + run);
  const int per = (C + Q - 1) / Q, own_lo = min(C, rank * per), own_hi = min(C, own_lo + per);
  // Every CTA of the cluster running, its centroids in, before any remote write.
  cluster.sync();
  for (int it = 0; it < iterations; ++it) {
    for (int pass = 0; pass < passes; ++pass) {
      const int row0 = first_row(pass);
      if (row0 >= T) break;  // uniform over the warp
      load_keys(row0);
      float best[M][2];
      int arg[M][2];
      clear_best<M>(best, arg);
      assign_chunk<D, M, LD>(a, mu, norm, 0, C8, best, arg, lane);
      settle_best<M>(best, arg);
#pragma unroll
      for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = row0 + m * 16 + g + 8 * r;
          if (cq == 0 && i < T)
            for (int q = 0; q < Q; ++q) cluster.map_shared_rank(labels, q)[i] = arg[m][r];
        }
    }
    cluster.sync();  // every label everywhere; every CTA done reading this iteration's mu
    // The CSR of the block: counts per (warp, cluster), then bases, then placement, each
    // warp over its run in token order.
    for (int x = tid; x < kReclusterWarps * C; x += kReclusterThreads) wcount[x] = 0;
    __syncthreads();
    for (int j0 = run_lo; j0 < run_hi; j0 += 32) {
      const int j = j0 + lane;
      const int c = j < run_hi ? labels[j] : -1;
      const unsigned peers = __match_any_sync(0xffffffffu, c);
      if (c >= 0 && lane == __ffs(peers) - 1) wcount[warp * C + c] += __popc(peers);
      __syncwarp();
    }
    __syncthreads();
    for (int c = tid; c < C; c += kReclusterThreads) {
      int total = 0;
      for (int w = 0; w < kReclusterWarps; ++w) {
        const int n = wcount[w * C + c];
        wcount[w * C + c] = total;  // members of c in earlier warps' runs
        total += n;
      }
      offsets[c + 1] = total;  // sizes for now
    }
    __syncthreads();
    if (warp == 0) {  // sizes -> offsets: a warp scan, 32 clusters a round
      int carry = 0;
      for (int c = lane; c - lane < C; c += 32) {
        int v = c < C ? offsets[c + 1] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int n = __shfl_up_sync(0xffffffffu, v, o);
          if (lane >= o) v += n;
        }
        if (c < C) offsets[c + 1] = carry + v;
        carry += __shfl_sync(0xffffffffu, v, 31);
      }
      if (lane == 0) offsets[0] = 0;
    }
    __syncthreads();
    for (int j0 = run_lo; j0 < run_hi; j0 += 32) {
      const int j = j0 + lane;
      const int c = j < run_hi ? labels[j] : -1;
      const unsigned peers = __match_any_sync(0xffffffffu, c);
      if (c >= 0) {
        const int rank_in = __popc(peers & ((1u << lane) - 1u));
        members[offsets[c] + wcount[warp * C + c] + rank_in] = j;
      }
      __syncwarp();
      if (c >= 0 && lane == __ffs(peers) - 1) wcount[warp * C + c] += __popc(peers);
      __syncwarp();
    }
    __syncthreads();
    // The update of this CTA's clusters: kPieces threads a cluster, 8 dims each, members in
    // order (8 loads in flight: the largest cluster's chain is the update's time), the mean
    // into every CTA's centroid copy. Empty clusters keep their centroid.
    constexpr int kGroups = kReclusterThreads / kPieces;
    const int piece = tid % kPieces;
    for (int c = own_lo + tid / kPieces; c < own_hi; c += kGroups) {
      const int lo = offsets[c], hi = offsets[c + 1];
      if (hi == lo) continue;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int x = lo; x < hi; x += 8) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u)
          if (x + u < hi) v[u] = reinterpret_cast<const uint4*>(key_at(members[x + u]))[piece];
#pragma unroll
        for (int u = 0; u < 8; ++u)
          if (x + u < hi) {
            const bf* e = reinterpret_cast<const bf*>(&v[u]);
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[q] += __bfloat162float(e[q]);
          }
      }
      const float count = float(hi - lo);
      uint4 out;
      bf* o = reinterpret_cast<bf*>(&out);
#pragma unroll
      for (int q = 0; q < 8; ++q) o[q] = __float2bfloat16_rn(acc[q] / count);
      for (int q = 0; q < Q; ++q)
        reinterpret_cast<uint4*>(cluster.map_shared_rank(mu, q) + c * LD)[piece] = out;
    }
    cluster.sync();  // every centroid everywhere; no CTA reads another's memory after this
    for (int c = warp; c < C; c += kReclusterWarps) {
      const float nrm = warp_centroid_norm<D>(mu + c * LD, lane);
      if (lane == 0) norm[c] = nrm;
    }
    __syncthreads();
  }
  // The state: this CTA's centroids, a share of the members, and (CTA 0) the offsets and the
  // counts. A decode reads them only after this kernel.
  bf* dst = reinterpret_cast<bf*>(st.centroid(b, h, c0));
  for (int x = own_lo * kPieces + tid; x < own_hi * kPieces; x += kReclusterThreads)
    reinterpret_cast<uint4*>(dst)[x] =
        reinterpret_cast<const uint4*>(mu + (x / kPieces) * LD)[x % kPieces];
  int32_t* mem_out = st.members_of(b, h) + start;
  int32_t* rows_out = st.member_rows ? st.member_rows_of(b, h) + start : nullptr;
  const int share = (T + Q - 1) / Q;
  for (int x = rank * share + tid; x < min(T, (rank + 1) * share); x += kReclusterThreads) {
    mem_out[x] = start + members[x];
    if (rows_out) rows_out[x] = krow[members[x]];  // the block token's page row
  }
  if (rank == 0) {
    int32_t* off_out = st.offsets_of(b, h) + c0;
    for (int c = tid; c <= C; c += kReclusterThreads) off_out[c] = start + offsets[c];
    if (tid == 0) {
      st.num_clusters[s] = c0 + C;
      st.clustered_len[s] = start + T;
    }
  }
}

// ---- decode selection ------------------------------------------------------------------------

constexpr int kIndexThreads = 256;
constexpr int kIndexChunk = kIndexThreads;  // clusters per index CTA (and per member count)

// The order kernel's lists (below): up to kOrderMax clusters, kOrderItems per thread. Longer
// lists (contexts above 128K at cluster size 16) are ordered by one radix sort of every row.
constexpr int kOrderThreads = 1024;
constexpr int kOrderItems = 8;
constexpr int kOrderMax = kOrderThreads * kOrderItems;  // clusters per list
// The order kernel's score buckets: two clusters a bucket on average at 128K. 8192 (one cluster
// a bucket) cost more in the scan and the zeroing than it saved in the ranking; on an H200 the
// 128K step at batch 1 took 48.2-48.3 us with 8192 against 47.8 with 4096 or 2048, batch 8
// 160.9 / 161.6 against 159.0 / 159.8 (docs/gpu.md).
constexpr int kOrderBuckets = 4096;
constexpr int kOrderCounts = kOrderBuckets / kOrderThreads;  // buckets a thread scans: a group
// A row's first sorted token of every group of kOrderCounts buckets, and one past the last (the
// row's tokens), padded to 16 bytes: written by the order kernel (a word a thread), read by the
// budget kernel when its cut falls past the ranked top (budget_cut_in_group).
constexpr int kGroupFirstStride = kOrderThreads + 4;

// What the order kernel leaves a row for the budget kernel: the top of the order whose sorted
// ids and prefix it wrote (clusters, tokens; all of them after the long lists' sort), and its
// buckets' scale (order_bucket).
struct OrderTop {
  int clusters, tokens;
  float hi, inv;
};

// A score's bucket in the order kernel's bucket sort over [lo, hi]: kOrderBuckets equal-width
// buckets, the index nonincreasing in the score ((hi - s) and the product are monotone in s
// under rounding). inv = kOrderBuckets / (hi - lo).
__device__ __forceinline__ int order_bucket(float hi, float inv, float s) {
  return min(kOrderBuckets - 1, int((hi - s) * inv));
}

struct SelectLayout {
  size_t keys_a, keys_b, vals_a, vals_b, prefix, top, group_first, sample_keys, logits, exact,
      bitmap, chunk_members, temp, temp_bytes, total;
  int smax, words, chunks;
};

// max_samples scans every length up to max_tokens; decode calls must not pay that each step.
int cached_max_samples(int max_tokens, const FitParams& f) {
  static std::mutex mu;
  static std::map<std::tuple<int, double, double, double, double, int, double>, int> cache;
  const auto key = std::make_tuple(max_tokens, f.target, f.exact_fraction, f.centre1, f.centre2,
                                   f.window_min, f.window_fraction);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, std::max(1, max_samples(max_tokens, f))).first;
  return it->second;
}

// Long lists: every row's clusters in one ascending radix sort of 64-bit keys, the row above
// the score's descending order (sort_key). Each row holds max_clusters keys, those past its
// count last, so the sorted rows keep their places. A segmented sort (a CTA a row, a pass a
// digit) took more than half of the selection's kernel time at 256K (docs/gpu.md).
__device__ __forceinline__ unsigned long long sort_key(int row, float score) {
  return (static_cast<unsigned long long>(row) << 32) | unsigned(~float_order_key(score));
}
__device__ __forceinline__ unsigned long long sort_key_past_count(int row) {
  return (static_cast<unsigned long long>(row) << 32) | 0xffffffffu;
}

int sort_end_bit(int rows) { return 32 + bits_for(rows); }

size_t sort_temp_bytes(int rows, int max_clusters) {
  size_t bytes = 0;
  cub::DoubleBuffer<unsigned long long> keys(nullptr, nullptr);
  cub::DoubleBuffer<int> vals(nullptr, nullptr);
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, keys, vals, int64_t(rows) * max_clusters, 0,
                                  sort_end_bit(rows));
  return bytes;
}

SelectLayout select_layout(int max_batch, int Hq, int Hkv, int max_clusters, int max_tokens,
                           const FitParams& fit) {
  auto up = [](size_t x) { return (x + 255) / 256 * 256; };
  SelectLayout l;
  const size_t rows = size_t(max_batch) * Hq;
  const size_t items = rows * size_t(max_clusters);
  l.smax = cached_max_samples(max_tokens, fit);
  l.words = (max_clusters + 31) / 32;
  l.chunks = (max_clusters + kIndexChunk - 1) / kIndexChunk;
  // Scores (float) for the order kernel, or the long lists' sort keys, double-buffered.
  const bool long_lists = max_clusters > kOrderMax;
  const size_t key_bytes = long_lists ? sizeof(unsigned long long) : sizeof(float);
  size_t o = 0;
  l.keys_a = o;
  o += up(items * key_bytes);
  l.keys_b = o;
  o += long_lists ? up(items * key_bytes) : 0;
  l.vals_a = o;
  o += up(items * sizeof(int));
  l.vals_b = o;
  o += up(items * sizeof(int));
  l.prefix = o;
  o += up(rows * (size_t(max_clusters) + 1) * sizeof(int));
  l.top = o;
  o += up(rows * sizeof(OrderTop));
  l.group_first = o;
  o += long_lists ? 0 : up(rows * size_t(kGroupFirstStride) * sizeof(int));
  l.sample_keys = o;
  o += up(rows * size_t(l.smax) * sizeof(int));
  l.logits = o;
  o += up(rows * size_t(l.smax) * sizeof(float));
  l.exact = o;
  o += up(rows * size_t(l.smax) * sizeof(double));
  l.bitmap = o;
  o += up(size_t(max_batch) * Hkv * size_t(l.words) * sizeof(uint32_t));
  l.chunk_members = o;
  o += up(size_t(max_batch) * Hkv * size_t(l.chunks) * sizeof(int));
  l.temp_bytes = long_lists ? sort_temp_bytes(int(rows), max_clusters) : 0;
  l.temp = o;
  o += up(l.temp_bytes);
  l.total = o;
  return l;
}

struct SelectParams {
  const bf* q;
  PagedKV kv;
  ClusterState st;
  Selection sel;
  FitParams fit;
  float scale;
  int num_q_heads, group, smax, words, chunks;
  float* keys;                    // unsorted scores [rows, max_clusters] (order kernel)
  unsigned long long* sort_keys;  // or the long lists' sort keys (sort_key), null otherwise
  int* vals;                      // unsorted ids
  const int* sorted;              // sorted ids (the sort's current buffer)
  int* prefix;
  OrderTop* top;     // [rows]
  int* group_first;  // [rows, kGroupFirstStride] (short lists only)
  // [rows, smax] the key of each sampled sorted position: its page row where the state keeps
  // member rows, its token id otherwise (sampled_key)
  int* sample_keys;
  float* logits;
  double* exact;
  uint32_t* bitmap;
  int* chunk_members;  // [subs, chunks] members of the union's clusters in each index chunk
  unsigned long long* counters;
};

// Where a member's entry of sample_keys comes from: the state's page rows when it keeps them,
// else its token ids.
__device__ __forceinline__ const int32_t* sample_key_source(const ClusterState& st, int b, int h) {
  return st.member_rows ? st.member_rows_of(b, h) : st.members_of(b, h);
}

// The key row of a sample_keys entry v of sequence b, kv head h.
__device__ __forceinline__ const bf* sampled_key(const SelectParams& p, int b, int h, int v) {
  return p.st.member_rows ? reinterpret_cast<const bf*>(p.kv.k) + p.kv.row_offset(v, h)
                          : key_row(p.kv, b, v, h);
}

// One CTA per (sequence, kv head, tile of kScoreTile clusters). The tile's centroids are
// contiguous in memory, so the CTA stages them through shared memory with coalesced 16-byte
// loads (a thread reading its own 256-byte row directly would touch 32 rows per warp load);
// its warps then score them against the group's g queries on the tensor cores.
constexpr int kScoreTile = 128;

template <int D>
__global__ void __launch_bounds__(kScoreTile) score_kernel(SelectParams p) {
  constexpr int LD = D + 8;  // bf16 row pitch: 16-byte pad keeps fragment reads conflict-free
  __shared__ __align__(16) bf cs[kScoreTile * LD];
  const int Hkv = p.kv.num_kv_heads;
  const int b = blockIdx.y / Hkv, h = blockIdx.y % Hkv;
  const int64_t slot = p.st.slot(b, h);
  const int row0 = b * p.num_q_heads + h * p.group;
  const int c0 = blockIdx.x * kScoreTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, cq = lane % 4;
  // The order kernel may get resident as this grid's CTAs end; it reads nothing this kernel
  // writes before its wait.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // Every load of the CTA in one round trip: the cluster count, the group's queries (as mma A
  // fragments: row g of the M = 16 rows is query head g, rows past the group zero) and the
  // tile's centroids, read up to the state's capacity (allocated; rows past the count are
  // never scored), so that no load waits for another (a chain of three before).
  const int cap = min(kScoreTile, p.st.max_clusters - c0);
  const uint4* src = reinterpret_cast<const uint4*>(p.st.centroid(b, h, c0));
  constexpr int kLoads = D / 8;  // 16-byte pieces per thread: the tile's rows / kScoreTile
  uint4 r[kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int x = int(threadIdx.x) + i * kScoreTile;
    if (x < cap * (D / 8)) r[i] = src[x];
  }
  uint32_t qa[D / 16][2];  // head g's dims 16k + 2cq, +1 and 16k + 2cq + 8, +9
  const uint32_t* qrow = reinterpret_cast<const uint32_t*>(p.q + int64_t(row0 + g) * D) + cq;
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
    qa[k][0] = g < p.group ? qrow[8 * k] : 0u;
    qa[k][1] = g < p.group ? qrow[8 * k + 4] : 0u;
  }
  const int C = p.st.num_clusters[slot];
  if (blockIdx.x == 0 && threadIdx.x == 0 && p.counters)
    atomicAdd(&p.counters[1], (unsigned long long)C * D * sizeof(bf));
  if (p.sort_keys) {  // long lists: the tile's places past the count sort after the row's clusters
    for (int x = threadIdx.x; x < p.group * cap; x += kScoreTile) {
      const int c = c0 + x % cap, row = row0 + x / cap;
      if (c < C) continue;
      const int64_t at = int64_t(row) * p.st.max_clusters + c;
      p.sort_keys[at] = sort_key_past_count(row);
      p.vals[at] = c;
    }
  }
  if (c0 >= C) return;
  const int tile = min(kScoreTile, C - c0);
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int x = int(threadIdx.x) + i * kScoreTile;
    if (x < tile * (D / 8))
      *reinterpret_cast<uint4*>(cs + (x / (D / 8)) * LD + (x % (D / 8)) * 8) = r[i];
  }
  if (int(threadIdx.x) < tile && (c0 + threadIdx.x) % 32 == 0)
    p.bitmap[slot * p.words + (c0 + threadIdx.x) / 32] = 0u;
  if (threadIdx.x == 0 && c0 % kIndexChunk == 0)
    p.chunk_members[slot * p.chunks + c0 / kIndexChunk] = 0;
  __syncthreads();
  // Scores on the tensor cores: the queries as A, 8 centroids a tile as B (rows of cs are
  // B's columns), a warp per tile of 8. The per-thread FMA form (each centroid against the
  // group's queries from shared memory) left its arithmetic after the whole stream had
  // arrived: the kernel was 13 us inside the graph at 128K for 16.8 MB (docs/gpu.md).
  for (int n0 = warp * 8; n0 < tile; n0 += kScoreTile / 4) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    const uint32_t* crow = reinterpret_cast<const uint32_t*>(cs + (n0 + g) * LD) + cq;
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      const uint32_t a[4] = {qa[k][0], 0u, qa[k][1], 0u};
      const uint32_t bb[2] = {crow[8 * k], crow[8 * k + 4]};
      ptx::mma_bf16_16816(d, a, bb, d);
    }
    // d[0], d[1]: head g against centroids n0 + 2cq, n0 + 2cq + 1 (rows 8..15 are unused).
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = c0 + n0 + 2 * cq + e;
      if (g < p.group && c < C) {
        const int64_t at = int64_t(row0 + g) * p.st.max_clusters + c;
        if (p.sort_keys)
          p.sort_keys[at] = sort_key(row0 + g, d[e]);
        else
          p.keys[at] = d[e];
        p.vals[at] = c;
      }
    }
  }
}

constexpr int kRowThreads = 256;

// Sorted order, prefix and sample keys per (sequence, query head) when every cluster list fits
// a CTA (max_clusters <= 8192, i.e. contexts up to 128K at cluster size 16), one CTA a row. The
// order is the CPU's: descending score, ties to the lower cluster id.
//
// A bucket sort over the score range: kOrderBuckets equal-width buckets of [min, max] (bucket
// index nonincreasing in the score) hold two clusters or so each, and a cluster's rank is its
// bucket's first rank plus the number of bucket mates that precede it. Each bucket counts its
// clusters and their tokens, so after one scan every bucket knows both its first rank and its
// first sorted token position. When the spread is degenerate (non-finite scores, all equal,
// or a bucket above kOrderMaxBucket, where ranking by comparison costs more than sorting) the
// CTA sorts the row with a block radix sort instead; both give the same order.
//
// Only the buckets that hold a position somebody reads are ranked (OrderRuns): the top of the order
// (the exact samples' tokens, and at least ranked_min clusters: the budget's cut in the common
// case) and the two fit windows, a few hundred clusters of 8192 at 128K. The budget kernel finds
// its cut itself when it falls past the ranked top, from the first sorted token of every group of a
// thread's buckets, which this kernel writes (group_first; budget_cut_in_group). Every position had
// been ranked, prefixed and written before, by four CTAs a row that each repeated the histogram and
// the scan: on an H200 the 128K step at batch 1 took 52.7 us against 49.8 now, 182 against 162 at
// batch 8, at P 0.9 (docs/gpu.md). This kernel is bound by instruction issue (32 warps on one SM),
// so what it does not execute is what it saves.
//
// The list's CSR offsets are staged into shared memory with the scores (one coalesced round
// trip). With the prefix of the ranked positions and their first members in shared memory the
// CTA also maps every sampled position to its key, so the sample kernel is left with the key
// rows.
constexpr int kOrderMaxBucket = 128;
constexpr int kOrderRankedMin = 512;  // clusters ranked at the top at least (the default)
// A bucket's clusters and their tokens are counted in two 32-bit arrays: shared memory has no
// 64-bit atomic add (one packed counter, a compare-and-swap loop, made the step 3.6 us slower on
// an H200). Padded by one word per 32: a thread's blocked run of 8 (the scan's arrangement)
// then starts on a different bank in every lane.
constexpr int kOrderCountWords = kOrderBuckets + kOrderBuckets / 32;
__device__ __forceinline__ int padded(int i) { return i + (i >> 5); }

using OrderSort = cub::BlockRadixSort<float, kOrderThreads, kOrderItems, int>;
using OrderReduce = cub::BlockReduce<float2, kOrderThreads>;
// (min, max) of a score range, reduced together: one block reduction instead of two.
struct RangeOp {
  __device__ __forceinline__ float2 operator()(float2 a, float2 b) const {
    return make_float2(fminf(a.x, b.x), fmaxf(a.y, b.y));
  }
};
struct SumD2Op {
  __device__ __forceinline__ double2 operator()(double2 a, double2 b) const {
    return make_double2(a.x + b.x, a.y + b.y);
  }
};

// The sorted positions a row ranks: up to three runs of whole buckets, in ascending order and
// disjoint, run i holding buckets [ba, be), ranks [ra, rb) and sorted tokens [ta, tb), stored
// one after another from flat position fb. Run 0 is the top of the order (from bucket, rank and
// token 0).
struct OrderRuns {
  int count;
  int ba[3], be[3], ra[3], rb[3], ta[3], tb[3], fb[3];
  __device__ int flat() const { return fb[count - 1] + rb[count - 1] - ra[count - 1]; }
  __device__ int of_flat(int f) const {
    int i = 0;
    while (i + 1 < count && f >= fb[i + 1]) ++i;
    return i;
  }
  // The run that holds sorted token x, or -1.
  __device__ int of_token(int x) const {
    for (int i = 0; i < count; ++i)
      if (x >= ta[i] && x < tb[i]) return i;
    return -1;
  }
};

// Where the runs come from: the bucket that holds each of these positions writes its bounds
// (bucket, rank, token: the first ones for a window's start, one past the last ones for an
// end). Not written, they stay 0: an empty run at the top.
struct OrderBound {
  int bucket, rank, token;
};
enum OrderCand {
  kTopTokens,  // the end of the bucket of the last exact token
  kTopRanks,   // the end of the bucket of rank ranked_min - 1
  kWindow1,    // the first window's start, then its end
  kWindow2 = kWindow1 + 2,
  kCands = kWindow2 + 2
};

// The runs from the candidates: the top, then each window, merged into the run before where
// they touch or overlap.
__device__ void make_order_runs(const OrderBound* cand, bool fitted, OrderRuns& r) {
  const OrderBound& top =
      cand[kTopTokens].rank >= cand[kTopRanks].rank ? cand[kTopTokens] : cand[kTopRanks];
  r.count = 1;
  r.ba[0] = r.ra[0] = r.ta[0] = r.fb[0] = 0;
  r.be[0] = top.bucket;
  r.rb[0] = top.rank;
  r.tb[0] = top.token;
  if (!fitted) return;
  for (int w = kWindow1; w <= kWindow2; w += 2) {
    const OrderBound &lo = cand[w], &hi = cand[w + 1];
    const int last = r.count - 1;
    if (lo.rank <= r.rb[last]) {
      r.be[last] = max(r.be[last], hi.bucket);
      r.rb[last] = max(r.rb[last], hi.rank);
      r.tb[last] = max(r.tb[last], hi.token);
    } else {
      const int n = r.count++;
      r.ba[n] = lo.bucket, r.ra[n] = lo.rank, r.ta[n] = lo.token;
      r.be[n] = hi.bucket, r.rb[n] = hi.rank, r.tb[n] = hi.token;
      r.fb[n] = r.fb[last] + r.rb[last] - r.ra[last];
    }
  }
}

struct OrderBuckets {
  int count[kOrderCountWords];   // clusters per bucket, then (scanned) each bucket's first rank
  int tokens[kOrderCountWords];  // their tokens
  float key[kOrderMax];  // the ranked buckets' scores by flat position; then each position's
                         // first sorted token (as int: first_token)
  int id[kOrderMax];     // their cluster ids; then each position's first member
};

struct OrderSmem {
  union {
    typename OrderSort::TempStorage sort;
    OrderBuckets buckets;
  } u;
  typename OrderReduce::TempStorage reduce;
  // The staged scores (as bits), then the cluster id at each flat position.
  alignas(16) int ranked[kOrderMax];
  // The list's CSR offsets (16-byte aligned: read as int4).
  alignas(16) int offsets[kOrderMax + 1];
  float lo, hi;
  int max_bucket;
  OrderBound cand[kCands];
  OrderRuns runs;
  int2 warp_sums[kOrderThreads / 32];  // order_block_scan's
};

__device__ __forceinline__ int* first_token(OrderSmem& sm) {
  return reinterpret_cast<int*>(sm.u.buckets.key);
}

// Sorted position x (0-based, prefix[lo] <= x < the end of position hi - 1) -> index j in
// [lo, hi) of the sorted cluster holding it: the largest j with prefix[j] <= x (the CPU's
// upper_bound - 1; empty clusters are skipped).
__device__ __forceinline__ int sorted_cluster_at(const int* prefix, int lo, int hi, int x) {
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (prefix[mid] <= x)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// Exclusive scan over the block of a pair of sums a thread (a bucket run's clusters and
// tokens, or sizes): warp shuffles, the warp totals scanned by warp 0, two barriers. cub's
// warp-scans block scan has every warp add up all 32 warp aggregates instead (about 130
// instructions a warp for a pair), and this kernel is bound by instruction issue: 32 warps on
// one SM, 0.56 instructions a cycle per scheduler (ncu, docs/gpu.md).
__device__ __forceinline__ int2 order_block_scan(int2 v, int2* warp_sums) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const auto warp_scan = [&](int2 x) {  // inclusive
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int a = __shfl_up_sync(0xffffffffu, x.x, o), b = __shfl_up_sync(0xffffffffu, x.y, o);
      if (lane >= o) x.x += a, x.y += b;
    }
    return x;
  };
  const int2 incl = warp_scan(v);
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int2 w = warp_sums[lane], wi = warp_scan(w);
    warp_sums[lane] = make_int2(wi.x - w.x, wi.y - w.y);
  }
  __syncthreads();
  const int2 base = warp_sums[warp];
  return make_int2(base.x + incl.x - v.x, base.y + incl.y - v.y);
}

// Each flat position's first sorted token and first member, ITEMS consecutive positions a
// thread: one scan of the ranked clusters' sizes, restarted at each run's first token.
template <int ITEMS>
__device__ __forceinline__ void order_prefix(OrderSmem& sm, const OrderRuns& r) {
  const int tid = threadIdx.x, F = r.flat();
  int fm[ITEMS], size[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int f = tid * ITEMS + i;
    const int c = f < F ? sm.ranked[f] : 0;
    fm[i] = f < F ? sm.offsets[c] : 0;
    size[i] = f < F ? sm.offsets[c + 1] - fm[i] : 0;
  }
  int sum = 0;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) sum += size[i];
  int before = order_block_scan(make_int2(sum, 0), sm.warp_sums).x;
  int* tok = first_token(sm);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int f = tid * ITEMS + i;
    if (f >= F) continue;
    // The runs before run i hold (tb - ta) tokens each, all of them in the scan.
    const int ri = r.of_flat(f);
    int skipped = 0;
    for (int j = 0; j < ri; ++j) skipped += r.tb[j] - r.ta[j];
    tok[f] = r.ta[ri] + before - skipped;
    sm.u.buckets.id[f] = fm[i];
    before += size[i];
  }
}

// The whole row by the block radix sort (degenerate spreads), from the staged scores, into one
// run. Out of line: its registers would otherwise spill into the bucket sort's code.
__device__ __noinline__ void order_sort_row(OrderSmem& sm, int C) {
  const int c0 = int(threadIdx.x) * kOrderItems;
  float k[kOrderItems];
  int v[kOrderItems];
#pragma unroll
  for (int i = 0; i < kOrderItems; ++i) {
    k[i] = __int_as_float(sm.ranked[c0 + i]);
    v[i] = c0 + i;
  }
  __syncthreads();  // the sort's storage overlays the buckets
  OrderSort(sm.u.sort).SortDescending(k, v);
#pragma unroll
  for (int i = 0; i < kOrderItems; ++i) sm.ranked[c0 + i] = v[i];
  if (threadIdx.x == 0)
    sm.runs = OrderRuns{1, {0}, {kOrderBuckets}, {0}, {C}, {0}, {sm.offsets[C]}, {0}};
}

// One CTA per row (sequence, query head). ranked_min: clusters ranked at the top at least.
__global__ void __launch_bounds__(kOrderThreads)
    order_kernel(SelectParams p, int* sorted, int ranked_min) {
  extern __shared__ __align__(16) char order_smem[];
  OrderSmem& sm = *reinterpret_cast<OrderSmem*>(order_smem);
  const int row = blockIdx.x, tid = threadIdx.x;
  // The sample kernel's CTAs may get resident as this grid's CTAs end (they wait for all of it).
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int b = row / p.num_q_heads, h = (row % p.num_q_heads) / p.group;
  const int64_t slot = p.st.slot(b, h);
  const float* keys = p.keys + int64_t(row) * p.st.max_clusters;
  const int32_t* off = p.st.offsets_of(b, h);
  // The CSR offsets, the cluster count and the list length are read (the offsets up to the
  // state's capacity, allocated, then cut at the count) and the bucket counters zeroed before
  // griddepcontrol.wait: launched programmatically behind the score kernel, the CTA does that
  // while the scores are still being written. The scores go out right after the wait, so both
  // loads are in flight together either way.
  const int M = p.st.max_clusters;
  constexpr int kOffLoads = kOrderMax / kOrderThreads + 1;
  int o[kOffLoads];
#pragma unroll
  for (int i = 0; i < kOffLoads; ++i) {
    const int x = tid + i * kOrderThreads;
    o[i] = x <= M ? off[x] : 0;
  }
  const int C = p.st.num_clusters[slot];
  const int clustered = p.st.clustered_len[slot];  // for the sample positions
  for (int x = tid; x < kOrderCountWords; x += kOrderThreads) {
    sm.u.buckets.count[x] = 0;
    sm.u.buckets.tokens[x] = 0;
  }
  if (tid < kCands) sm.cand[tid] = OrderBound{0, 0, 0};
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // A thread's 8 scores (blocked: the radix sort's input order is id order) as two 16-byte
  // loads where the rows are 16-byte aligned: as 8 scalar loads a warp's requests touched
  // each 32-byte sector 8 times.
  float k[kOrderItems];
  const int c0 = tid * kOrderItems;
  if (M % 4 == 0 && c0 + kOrderItems <= M) {  // uniform but for the last thread of a short row
    const float4 u = reinterpret_cast<const float4*>(keys + c0)[0];
    const float4 v = reinterpret_cast<const float4*>(keys + c0)[1];
    k[0] = u.x, k[1] = u.y, k[2] = u.z, k[3] = u.w, k[4] = v.x, k[5] = v.y, k[6] = v.z, k[7] = v.w;
  } else {
#pragma unroll
    for (int i = 0; i < kOrderItems; ++i) k[i] = c0 + i < M ? keys[c0 + i] : -INFINITY;
  }
#pragma unroll
  for (int i = 0; i < kOrderItems; ++i)
    if (c0 + i >= C) k[i] = -INFINITY;
#pragma unroll
  for (int i = 0; i < kOffLoads; ++i) {
    const int x = tid + i * kOrderThreads;
    if (x <= C) sm.offsets[x] = o[i];
  }
  // Range of the valid scores; NaN or infinite scores make it non-finite.
  float lo = INFINITY, hi = -INFINITY;
#pragma unroll
  for (int i = 0; i < kOrderItems; ++i)
    if (c0 + i < C) {
      lo = fminf(lo, k[i]);
      hi = fmaxf(hi, k[i]);
      if (!isfinite(k[i])) hi = INFINITY;
    }
  // The scores wait for the scatter (or the sort) where the order goes later, each thread its
  // own, not in registers through the scan: the kernel is held to 64.
  reinterpret_cast<float4*>(sm.ranked + c0)[0] = make_float4(k[0], k[1], k[2], k[3]);
  reinterpret_cast<float4*>(sm.ranked + c0)[1] = make_float4(k[4], k[5], k[6], k[7]);
  const float2 range = OrderReduce(sm.reduce).Reduce(make_float2(lo, hi), RangeOp());
  if (tid == 0) {
    sm.lo = range.x;
    sm.hi = range.y;
    sm.max_bucket = 0;
  }
  __syncthreads();  // the range, and the offsets of every thread
  lo = sm.lo;
  hi = sm.hi;
  const float span = hi - lo;
  bool bucketed = C > 0 && isfinite(span) && span > 0.f;
  const float inv = bucketed ? float(kOrderBuckets) / span : 0.f;
  // Each cluster's bucket (low 16 bits) and its place among the bucket's clusters (high).
  int place[kOrderItems];
  if (bucketed) {
    // The thread's clusters' sizes from two 16-byte loads of their offsets (scalar loads at a
    // stride of 8 words hit 4 banks).
    static_assert(kOrderItems == 8, "two int4 loads per thread");
    int e[kOrderItems + 1];
    {
      const int4* o4 = reinterpret_cast<const int4*>(sm.offsets + c0);
      const int4 u = o4[0], v = o4[1];
      e[0] = u.x, e[1] = u.y, e[2] = u.z, e[3] = u.w;
      e[4] = v.x, e[5] = v.y, e[6] = v.z, e[7] = v.w;
      e[8] = sm.offsets[c0 + kOrderItems];
    }
#pragma unroll
    for (int i = 0; i < kOrderItems; ++i) {
      const bool valid = c0 + i < C;
      const int bucket = valid ? order_bucket(hi, inv, k[i]) : 0;
      int slot_in = 0;
      if (valid) {
        slot_in = atomicAdd(&sm.u.buckets.count[padded(bucket)], 1);
        atomicAdd(&sm.u.buckets.tokens[padded(bucket)], e[i + 1] - e[i]);
      }
      if (valid && slot_in == kOrderMaxBucket) sm.max_bucket = kOrderMaxBucket + 1;
      place[i] = bucket | slot_in << 16;
    }
    __syncthreads();
    bucketed = sm.max_bucket <= kOrderMaxBucket;  // uniform
  }
  if (bucketed) {
    // Each bucket's first rank and first token; the buckets that hold the runs' bounds write
    // them (OrderCand). The thread's buckets are read twice (their sums, then the walk below)
    // rather than held in registers through the scan.
    int2 sum = make_int2(0, 0);
#pragma unroll
    for (int i = 0; i < kOrderCounts; ++i) {
      const int x = padded(tid * kOrderCounts + i);
      sum.x += sm.u.buckets.count[x], sum.y += sm.u.buckets.tokens[x];
    }
    const int2 first = order_block_scan(sum, sm.warp_sums);  // the thread's first rank, token
    const FitPlan plan = make_fit_plan(clustered, p.fit);
    // The positions whose buckets bound the runs: the last exact token, rank ranked_min - 1
    // (a rank), and each window's first and last token (-1: none).
    const int top_rank = min(ranked_min, C) - 1;
    int at[4] = {-1, -1, -1, -1};
    if (plan.fitted) {
      at[0] = plan.lo1 - 1, at[1] = plan.lo1 + plan.w - 2;
      at[2] = plan.lo2 - 1, at[3] = plan.lo2 + plan.w - 2;
    }
    const int top_token = plan.num_exact - 1;
    const auto holds = [](int x, int lo, int n) { return x >= lo && x < lo + n; };
    // Most threads' buckets hold none of them: one test of the thread's whole range first.
    bool mine = holds(top_token, first.y, sum.y) || holds(top_rank, first.x, sum.x);
#pragma unroll
    for (int w = 0; w < 4; ++w) mine = mine || holds(at[w], first.y, sum.y);
    // Its group's first token, for a budget whose cut falls past the ranked top. (Every
    // bucket's, as two int4 stores a thread, made the 128K step 0.9 us slower on an H200.)
    int* group_first = p.group_first + int64_t(row) * kGroupFirstStride;
    group_first[tid] = first.y;
    if (tid == kOrderThreads - 1) group_first[kOrderThreads] = first.y + sum.y;
    int rn = first.x, rt = first.y;
#pragma unroll
    for (int i = 0; i < kOrderCounts; ++i) {
      const int bkt = tid * kOrderCounts + i;
      const int cn = sm.u.buckets.count[padded(bkt)], ct = sm.u.buckets.tokens[padded(bkt)];
      sm.u.buckets.count[padded(bkt)] = rn;
      if (mine) {
        const OrderBound start{bkt, rn, rt}, stop{bkt + 1, rn + cn, rt + ct};
        if (holds(top_token, rt, ct)) sm.cand[kTopTokens] = stop;
        if (holds(top_rank, rn, cn)) sm.cand[kTopRanks] = stop;
#pragma unroll
        for (int w = 0; w < 4; ++w)
          if (holds(at[w], rt, ct)) sm.cand[kWindow1 + w] = w % 2 == 0 ? start : stop;
      }
      rn += cn, rt += ct;
    }
    __syncthreads();
    if (tid == 0) make_order_runs(sm.cand, plan.fitted, sm.runs);  // the windows: fitted only
    __syncthreads();
    // Scatter the runs' clusters into bucket order, by flat position.
    const OrderRuns& runs = sm.runs;
    const int nr = runs.count;
    const int ba0 = runs.ba[0], be0 = runs.be[0], ba1 = runs.ba[1], be1 = runs.be[1],
              ba2 = runs.ba[2], be2 = runs.be[2];
#pragma unroll
    for (int i = 0; i < kOrderItems; ++i) {
      const int bkt = place[i] & 0xffff;
      const int ri = c0 + i >= C                         ? -1
                     : bkt >= ba0 && bkt < be0           ? 0
                     : nr > 1 && bkt >= ba1 && bkt < be1 ? 1
                     : nr > 2 && bkt >= ba2 && bkt < be2 ? 2
                                                         : -1;
      if (ri < 0) continue;
      const int rs = sm.u.buckets.count[padded(bkt)];
      const int f = runs.fb[ri] + rs - runs.ra[ri] + (place[i] >> 16);
      sm.u.buckets.key[f] = __int_as_float(sm.ranked[c0 + i]);
      sm.u.buckets.id[f] = c0 + i;
    }
    __syncthreads();
    // Each cluster's rank among its bucket mates. A warp's lanes hold neighbouring positions, so
    // they walk the same bucket together (the same trip count, every mate read once for all).
    const int F = runs.flat();
    for (int f = tid; f < F; f += kOrderThreads) {
      const float ka = sm.u.buckets.key[f];
      const int ca = sm.u.buckets.id[f];
      const int bk = order_bucket(hi, inv, ka);  // the scatter's bucket
      const int rs = sm.u.buckets.count[padded(bk)];
      const int re = bk + 1 < kOrderBuckets ? sm.u.buckets.count[padded(bk + 1)] : C;
      const int ri = runs.of_flat(f);
      const int bf = runs.fb[ri] + rs - runs.ra[ri];
      int rank = bf;
#pragma unroll 4
      for (int j = bf; j < bf + (re - rs); ++j) {
        const float kj = sm.u.buckets.key[j];
        rank += (kj > ka || (kj == ka && sm.u.buckets.id[j] < ca)) ? 1 : 0;
      }
      sm.ranked[rank] = ca;
    }
  } else if (C > 0) {  // uniform: the whole row by the block radix sort
    order_sort_row(sm, C);
  } else if (tid == 0) {
    sm.runs = OrderRuns{1, {0}, {0}, {0}, {0}, {0}, {0}, {0}};
  }
  __syncthreads();
  const OrderRuns& runs = sm.runs;
  // The ranked positions' first tokens and members: 1 position a thread when the runs are
  // short (the common case), 3 or 8 when they are not.
  const int F = runs.flat();
  if (F <= kOrderThreads)
    order_prefix<1>(sm, runs);
  else if (F <= 3 * kOrderThreads)
    order_prefix<3>(sm, runs);
  else
    order_prefix<kOrderItems>(sm, runs);
  __syncthreads();
  // The top run's sorted ids and prefix for the budget kernel, and what they cover.
  const int* tok = first_token(sm);
  const int R = runs.rb[0], T = runs.tb[0];
  int* ids = sorted + int64_t(row) * M;
  int* prefix = p.prefix + int64_t(row) * (M + 1);
  for (int x = tid; x < R; x += kOrderThreads) {
    ids[x] = sm.ranked[x];
    prefix[x] = tok[x];
  }
  if (tid == 0) {
    prefix[R] = T;
    p.top[row] = OrderTop{R, T, hi, inv};
  }
  // Sample keys: kOrderRun consecutive samples per thread (consecutive sorted positions within
  // a run), one binary search per run of samples and a forward walk, then the run's member (or
  // member row) loads together.
  const FitPlan plan = make_fit_plan(clustered, p.fit);
  const int S = plan.num_samples();
  const int32_t* source = sample_key_source(p.st, b, h);
  int* keys_out = p.sample_keys + int64_t(row) * p.smax;
  const int* base = sm.u.buckets.id;
  constexpr int kOrderRun = 4;
  for (int s0 = tid * kOrderRun; s0 < S; s0 += kOrderThreads * kOrderRun) {
    int at[kOrderRun];
    int j = 0, end = 0, last_x = -2, run_tb = 0;
#pragma unroll
    for (int u = 0; u < kOrderRun; ++u) {
      at[u] = -1;
      if (s0 + u >= S) continue;
      const int x = plan.position(s0 + u) - 1;
      if (x == last_x + 1 && x < run_tb) {
        while (j + 1 < end && tok[j + 1] <= x) ++j;
      } else {
        const int ri = runs.of_token(x);
        if (ri < 0) continue;  // not in a run: a state whose offsets disagree with its length
        const int lo_f = runs.fb[ri];
        end = lo_f + runs.rb[ri] - runs.ra[ri];
        run_tb = runs.tb[ri];
        j = sorted_cluster_at(tok, lo_f, end, x);
      }
      last_x = x;
      at[u] = base[j] + (x - tok[j]);
    }
    int t[kOrderRun];
#pragma unroll
    for (int u = 0; u < kOrderRun; ++u) t[u] = at[u] >= 0 ? source[at[u]] : 0;
#pragma unroll
    for (int u = 0; u < kOrderRun; ++u)
      if (at[u] >= 0) keys_out[s0 + u] = t[u];
  }
}

// Long lists (after the radix sort): the prefix of sorted cluster sizes and every sample's key,
// one CTA per (sequence, query head). A round takes kPrefixRound sorted clusters: two dependent
// rounds of loads (the sorted ids, then their offsets), one block scan, the round's prefix and
// first members kept in shared memory; then each sample whose position falls in the round finds
// its cluster there (sorted_cluster_at) and its key is loaded, kPrefixBatch samples a thread at
// a time. Before, rounds of 256 clusters each waited for the last (64 of them at 256K), and a
// kernel of its own searched the prefix in global memory for every sample, a chain of seven
// loads in 12 waves of CTAs (docs/gpu.md).
constexpr int kPrefixThreads = 1024;
constexpr int kPrefixItems = 16;
constexpr int kPrefixRound = kPrefixThreads * kPrefixItems;
constexpr int kPrefixBatch = 8;

struct PrefixSmem {
  int prefix[kPrefixRound + 1];  // the round's prefix, from the members of earlier rounds
  int base[kPrefixRound];        // each sorted cluster's first member
  cub::BlockScan<int, kPrefixThreads, cub::BLOCK_SCAN_WARP_SCANS>::TempStorage scan;
};

__global__ void __launch_bounds__(kPrefixThreads) prefix_kernel(SelectParams p) {
  using Scan = cub::BlockScan<int, kPrefixThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  extern __shared__ __align__(16) char prefix_smem[];
  PrefixSmem& sm = *reinterpret_cast<PrefixSmem*>(prefix_smem);
  const int row = blockIdx.x, tid = threadIdx.x;
  const int b = row / p.num_q_heads, h = (row % p.num_q_heads) / p.group;
  const int64_t slot = p.st.slot(b, h);
  const int C = p.st.num_clusters[slot];
  const int* ids = p.sorted + int64_t(row) * p.st.max_clusters;
  const int32_t* off = p.st.offsets_of(b, h);
  int* prefix = p.prefix + int64_t(row) * (p.st.max_clusters + 1);
  const FitPlan plan = make_fit_plan(p.st.clustered_len[slot], p.fit);
  const int S = plan.num_samples();
  const int32_t* source = sample_key_source(p.st, b, h);
  int* keys_out = p.sample_keys + int64_t(row) * p.smax;
  if (tid == 0) prefix[0] = 0;
  int carry = 0;  // members of the clusters of earlier rounds
  for (int j0 = 0; j0 < C; j0 += kPrefixRound) {
    const int first = tid * kPrefixItems;  // a blocked run of the round's sorted clusters
    int id[kPrefixItems], size[kPrefixItems];
#pragma unroll
    for (int i = 0; i < kPrefixItems; ++i) id[i] = j0 + first + i < C ? ids[j0 + first + i] : -1;
#pragma unroll
    for (int i = 0; i < kPrefixItems; ++i) {
      const int lo = id[i] >= 0 ? off[id[i]] : 0;
      size[i] = id[i] >= 0 ? off[id[i] + 1] - lo : 0;
      sm.base[first + i] = lo;  // read only after the barrier below
    }
    int total;
    Scan(sm.scan).InclusiveSum(size, size, total);
#pragma unroll
    for (int i = 0; i < kPrefixItems; ++i) {
      if (j0 + first + i >= C) continue;
      prefix[j0 + first + i + 1] = carry + size[i];
      sm.prefix[first + i + 1] = carry + size[i];
    }
    if (tid == 0) sm.prefix[0] = carry;
    __syncthreads();
    const int n = min(kPrefixRound, C - j0);
    for (int s0 = tid; s0 < S; s0 += kPrefixThreads * kPrefixBatch) {
      int at[kPrefixBatch];
#pragma unroll
      for (int u = 0; u < kPrefixBatch; ++u) {
        const int s = s0 + u * kPrefixThreads;
        const int x = s < S ? plan.position(s) - 1 : -1;
        at[u] = -1;
        if (x >= carry && x < carry + total) {
          const int k = sorted_cluster_at(sm.prefix, 0, n, x);
          at[u] = sm.base[k] + (x - sm.prefix[k]);
        }
      }
      int v[kPrefixBatch];
#pragma unroll
      for (int u = 0; u < kPrefixBatch; ++u) v[u] = at[u] >= 0 ? source[at[u]] : 0;
#pragma unroll
      for (int u = 0; u < kPrefixBatch; ++u)
        if (at[u] >= 0) keys_out[s0 + u * kPrefixThreads] = v[u];
    }
    carry += total;
    __syncthreads();  // the round's shared memory is rewritten by the next
  }
}

// Logits of the sampled tokens. One group of D / 8 lanes per sampled token (16 for d = 128)
// reads the key row as one coalesced segment and reduces by shuffles; each group takes
// kSampleIlp samples with their loads issued together, so a CTA's dependent loads (sample
// key, then the key row; with the page table between them where the state keeps no member
// rows) cover kSampleIlp times as many samples. At 128K batch 1 that is 1,664 CTAs, 6 resident
// an SM (40 registers): three rounds of residency, the last small; held to 32 registers for 8
// an SM, the step was 0.3-0.5 us slower (docs/gpu.md).
constexpr int kSampleThreads = 256;
constexpr int kSampleIlp = 4;

template <int D>
constexpr int samples_per_cta() {
  return kSampleThreads / (D / 8) * kSampleIlp;
}

template <int D>
__global__ void __launch_bounds__(kSampleThreads) sample_kernel(SelectParams p) {
  constexpr int L = D / 8, kGroups = kSampleThreads / L, kPerCta = samples_per_cta<D>();
  __shared__ float qs[D];
  const int row = blockIdx.y;
  const int b = row / p.num_q_heads, h = (row % p.num_q_heads) / p.group;
  const int64_t slot = p.st.slot(b, h);
  const int s0 = int(blockIdx.x) * kPerCta + int(threadIdx.x) / L;
  // Launched programmatically behind the order kernel: the query and the length were written
  // before it, so they load (and the query is staged) while it ends; the sample keys are
  // its output. Then the key rows.
  const bf qv = int(threadIdx.x) < D ? p.q[int64_t(row) * D + threadIdx.x] : bf();
  const FitPlan plan = make_fit_plan(p.st.clustered_len[slot], p.fit);
  const int S = plan.num_samples();
  if (int(blockIdx.x) * kPerCta >= S) return;
  if (int(threadIdx.x) < D) qs[threadIdx.x] = __bfloat162float(qv);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // Only now may the budget kernel get resident: before its own wait it reads the order
  // kernel's prefix and ids, which are complete once every CTA of this grid has passed its
  // wait (triggering at this kernel's start let the budget read them mid-sort).
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int* keys = p.sample_keys + int64_t(row) * p.smax;
  int t[kSampleIlp];
#pragma unroll
  for (int i = 0; i < kSampleIlp; ++i) {
    const int s = s0 + i * kGroups;
    t[i] = s < p.smax ? keys[s] : -1;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 && p.counters)
    atomicAdd(&p.counters[1], (unsigned long long)S * D * sizeof(bf));
#pragma unroll
  for (int i = 0; i < kSampleIlp; ++i)
    if (s0 + i * kGroups >= S) t[i] = -1;
  const int sub = threadIdx.x % L;
  uint4 v[kSampleIlp];
#pragma unroll
  for (int i = 0; i < kSampleIlp; ++i)
    v[i] = t[i] >= 0 ? reinterpret_cast<const uint4*>(sampled_key(p, b, h, t[i]))[sub]
                     : make_uint4(0u, 0u, 0u, 0u);
  __syncthreads();  // qs
#pragma unroll
  for (int i = 0; i < kSampleIlp; ++i) {
    const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&v[i]);
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(v2[e]);
      dot = fmaf(f.x, qs[sub * 8 + 2 * e], dot);
      dot = fmaf(f.y, qs[sub * 8 + 2 * e + 1], dot);
    }
    // Every lane takes part (xor offsets below L stay inside the group).
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const int s = s0 + i * kGroups;
    if (sub == 0 && s < S) p.logits[int64_t(row) * p.smax + s] = dot * p.scale;
  }
}

// Exact prefix sums kept in shared memory for the budget's serial search (thread 0): enough
// for n up to 136K at the default exact_fraction; longer lists spill the rest to global.
constexpr int kExactSmem = 2048;
constexpr int kBudgetItems = 8;    // exact exponentials per thread and scan
constexpr int kBudgetPrefix = 4;   // sorted-prefix entries per thread loaded at the start
constexpr int kBudgetStage = 16;   // logits per thread staged in shared memory (4096 a row)
constexpr int kLogitSmem = kBudgetStage * kRowThreads;

// The shared-memory slot of exact prefix s (< kExactSmem). A thread's kBudgetItems blocked
// prefixes, stored in place, are 64 bytes apart across the warp: 16 wavefronts a store where 2
// are ideal (ncu), about 0.1 us of the budget kernel at 128K on an H200. The low 3 bits xor-ed
// with bits 4-6 (the thread's bits 1-3) put each store instruction's 32 lanes on every bank
// twice.
__device__ __forceinline__ int exact_slot(int s) { return s ^ ((s >> 4) & 7); }

// budget_tokens (tactic_fit.h) with its search spread over the block: the same problem
// (BudgetSearch), so the same K. Each round every thread tests one of blockDim.x evenly
// spaced candidates of [lo, hi] and one barrier counts the failures (the predicate is
// monotone, so they are the first ones): 3 rounds at n = 128K instead of 17 serial steps of
// double-precision logs and divisions on one thread (about 13K cycles in all on an H100).
template <typename ExactPrefix>
__device__ int block_budget_tokens(const FitPlan& f, const TailModel& t, double target,
                                   ExactPrefix exact_prefix, double h_exact, double h_n) {
  const BudgetSearch<ExactPrefix> s = budget_search(f, t, target, exact_prefix, h_exact, h_n);
  int lo = s.lo, hi = s.hi;
  constexpr int T = kRowThreads;  // the budget kernel's block (the rounds' divisions are shifts)
  while (lo < hi) {  // lo and hi are the same in every thread
    const int step = (hi - lo + T) / T;  // ceil((hi - lo + 1) / T)
    const int m = min(hi, lo + (int(threadIdx.x) + 1) * step - 1);
    const int fails = __syncthreads_count(!s.reaches(m));
    if (fails == T) {  // not even hi (a NaN goal): bisection also ends at hi
      lo = hi;
    } else {
      const int next_hi = min(hi, lo + (fails + 1) * step - 1);
      if (fails > 0) lo = min(hi, lo + fails * step - 1) + 1;
      hi = next_hi;
    }
  }
  return lo;
}

// The budget's cut when K falls past the top of the order that the order kernel ranked
// (OrderRuns): B, the first cluster in the CPU's order at which the prefix of cluster sizes
// reaches K, from the order kernel's bucket groups. The group that holds sorted token K - 1 is
// the one whose first token (group_first) is at most K - 1 and whose successor's is past it;
// every cluster of an earlier group is selected, and the group's own clusters (at most
// kOrderCounts * kOrderMaxBucket: a larger bucket sends the row to the radix sort, which ranks
// it whole) are ranked among themselves. Each thread holds kCutItems clusters (c = tid + j *
// kRowThreads), so a warp's item j is the 32 clusters of one bitmap word: the union is joined
// a word at a time, lane j's word in one atomic (join_words). Returns the tokens up to B's end,
// the row's selection. Rows get here when their heads are flat (K past about 6 % of the tokens
// at the defaults, or P near 1). A radix select over the scores instead (three rounds of a
// histogram in shared memory, whose atomics pile onto a few bins of a flat row, then a join a
// cluster at a time, each waiting on its atomic's return) took a 128K step at P 0.99 on an H200
// 102.6 us against 88.6 (docs/gpu.md).
constexpr int kCutItems = kOrderMax / kRowThreads;  // clusters a thread (C <= kOrderMax)
static_assert(kCutItems == 32 && kRowThreads % 32 == 0, "a warp's item is a bitmap word");
constexpr int kCutGroups = kOrderThreads / kRowThreads;  // groups' first tokens a thread
static_assert(kCutGroups == 4, "a thread's first tokens as one int4 load");
constexpr int kCutMax = kOrderCounts * kOrderMaxBucket;  // candidates: a group's clusters

// The chosen clusters of a warp's items (bit j of chosen: item j, cluster tid + j *
// kRowThreads): lane j sets item j's bitmap word in one atomic, then each word's newly set
// clusters add their sizes to its index chunk (the row that sets a cluster's bit first adds its
// size). Called by the whole block. The sizes' loads are all issued before the barrier: left
// to itself the compiler issued them two at a time between the sums below, waiting a round
// trip each (16 of them, about 13 us of a 128K step on an H200; ncu, docs/gpu.md).
__device__ __forceinline__ void join_words(uint32_t* bitmap, int* chunk_members, unsigned chosen,
                                           const int32_t* off) {
  static_assert(kIndexChunk % 32 == 0, "a word's clusters lie in one chunk");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int size[kCutItems];
#pragma unroll
  for (int j = 0; j < kCutItems; ++j) {
    const int c = int(threadIdx.x) + j * kRowThreads;
    size[j] = chosen >> j & 1u ? off[c + 1] - off[c] : 0;
  }
  unsigned word = 0;  // lane j: the chosen clusters of item j
#pragma unroll
  for (int j = 0; j < kCutItems; ++j) {
    const unsigned m = __ballot_sync(0xffffffffu, chosen >> j & 1u);
    if (lane == j) word = m;
  }
  const int c0 = lane * kRowThreads + warp * 32;  // lane j's word's first cluster
  const unsigned was = word ? atomicOr(&bitmap[c0 / 32], word) : 0u;
  __syncthreads();
  const unsigned added = word & ~was;
  int tokens = 0;  // lane j: what item j's newly set clusters add
#pragma unroll
  for (int j = 0; j < kCutItems; ++j) {
    const unsigned a = __shfl_sync(0xffffffffu, added, j);
    const int t = __reduce_add_sync(0xffffffffu, a >> lane & 1u ? size[j] : 0);
    if (lane == j) tokens = t;
  }
  if (tokens > 0) atomicAdd(&chunk_members[c0 / kIndexChunk], tokens);
}

// cand: shared memory for kCutSmem words: kCutMax candidates (3 words each), 4 words of picks,
// a word of marks a thread. Out of line: inlined, it changed how the budget kernel's common
// path (a cut within the ranked top) was compiled, and batch 8 at P 0.9 took 164.5 us against
// 162.7 (H200).
constexpr int kCutSmem = 3 * kCutMax + 4 + kRowThreads;
__device__ __noinline__ int budget_cut_in_group(const float* scores, const int32_t* off,
                                                const int* first, const OrderTop& top, int C, int K,
                                                int* cand, uint32_t* bitmap, int* chunk_members) {
  const int tid = threadIdx.x;
  // The candidates' scores (as bits), ids and sizes.
  int *cs = cand, *cc = cand + kCutMax, *cw = cand + 2 * kCutMax;
  int* pick = cand + 3 * kCutMax;  // group, its first token, count, cut index
  unsigned* mark = reinterpret_cast<unsigned*>(pick + 4);  // chosen candidates by owner
  // One round of loads: the thread's groups' first tokens (with the next thread's first) and
  // its clusters' scores.
  int f[kCutGroups + 1];
  {
    const int4 v = reinterpret_cast<const int4*>(first)[tid];
    f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
    f[kCutGroups] = first[(tid + 1) * kCutGroups];
  }
  float sc[kCutItems];
#pragma unroll
  for (int j = 0; j < kCutItems; ++j) {
    const int c = tid + j * kRowThreads;
    sc[j] = c < C ? scores[c] : 0.f;
  }
  if (tid == 0) pick[0] = -1, pick[2] = 0, pick[3] = -1;
  mark[tid] = 0;
  __syncthreads();
  const int x = K - 1;  // the last selected token
#pragma unroll
  for (int i = 0; i < kCutGroups; ++i)
    if (f[i] <= x && x < f[i + 1]) pick[0] = tid * kCutGroups + i, pick[1] = f[i];
  __syncthreads();
  const int G = pick[0];
  unsigned chosen = 0;
  if (G < 0) {  // K past the row's tokens (a state whose offsets disagree with its length)
#pragma unroll
    for (int j = 0; j < kCutItems; ++j) chosen |= (tid + j * kRowThreads < C ? 1u : 0u) << j;
    join_words(bitmap, chunk_members, chosen, off);
    return off[C] - off[0];
  }
  const int need = K - pick[1];  // tokens still to select within group G
  // Earlier groups' clusters are chosen; G's are the candidates, a few a thread at most: they
  // are listed by a loop that is not unrolled (a copy for each of 32 items was 17 KB of code,
  // run once, cold in the instruction cache).
  unsigned in_g = 0;
#pragma unroll
  for (int j = 0; j < kCutItems; ++j) {
    const int g =
        tid + j * kRowThreads < C ? order_bucket(top.hi, top.inv, sc[j]) / kOrderCounts : G + 1;
    chosen |= (g < G ? 1u : 0u) << j;
    in_g |= (g == G ? 1u : 0u) << j;
  }
  for (unsigned m = in_g; m != 0; m &= m - 1) {
    const int c = tid + (__ffs(m) - 1) * kRowThreads;
    const int n = atomicAdd(&pick[2], 1);  // < kCutMax: the order kernel's bound
    cs[n] = __float_as_int(scores[c]), cc[n] = c, cw[n] = off[c + 1] - off[c];
  }
  __syncthreads();
  const int n = pick[2];
  // The candidate whose span in G's order holds the need-th token is the cut; G's order is the
  // CPU's (descending score, ties to the lower id; the bucket is monotone in the score).
  const auto precedes = [&](int i, float s, int c) {  // candidate i before (s, c)
    const float si = __int_as_float(cs[i]);
    return si > s || (si == s && cc[i] < c);
  };
  for (int t = tid; t < n; t += kRowThreads) {
    const float s = __int_as_float(cs[t]);
    const int c = cc[t];
    int before = 0;
    for (int i = 0; i < n; ++i) before += precedes(i, s, c) ? cw[i] : 0;
    if (before < need && need <= before + cw[t]) pick[3] = t, pick[1] += before + cw[t];
  }
  __syncthreads();
  // The candidates up to the cut are chosen: each marks its owner's item.
  const int cut = pick[3];  // found: G's tokens, the candidates' sizes, reach need
  for (int t = tid; t < n && cut >= 0; t += kRowThreads)
    if (t == cut || precedes(t, __int_as_float(cs[cut]), cc[cut]))
      atomicOr(&mark[cc[t] % kRowThreads], 1u << (cc[t] / kRowThreads));
  __syncthreads();
  chosen |= mark[tid];
  join_words(bitmap, chunk_members, chosen, off);  // a barrier: pick[1] is visible after it
  return pick[1];
}

__global__ void __launch_bounds__(kRowThreads) budget_kernel(SelectParams p) {
  using ScanD = cub::BlockScan<double, kRowThreads>;
  using ReduceF = cub::BlockReduce<float, kRowThreads>;
  using ReduceD2 = cub::BlockReduce<double2, kRowThreads>;
  using ReduceI = cub::BlockReduce<int, kRowThreads>;
  __shared__ union {
    typename ScanD::TempStorage scan;
    typename ReduceF::TempStorage rf;
    typename ReduceD2::TempStorage rd2;
    typename ReduceI::TempStorage ri;
  } tmp;
  __shared__ double s_exact[kExactSmem];
  __shared__ __align__(16) float s_logit[kLogitSmem];  // logits [0, kLogitSmem): one read each
  __shared__ float s_max;
  __shared__ double s_windows[2];
  __shared__ int s_clusters;
  __shared__ int s_prefix[kRowThreads + 1];  // the sorted prefix's first kRowThreads + 1 entries
  const int row = blockIdx.x;
  const int b = row / p.num_q_heads, h = (row % p.num_q_heads) / p.group;
  const int64_t slot = p.st.slot(b, h);
  const float* logits = p.logits + int64_t(row) * p.smax;
  double* exact = p.exact + int64_t(row) * p.smax;
  const int* prefix = p.prefix + int64_t(row) * (p.st.max_clusters + 1);
  const int* ids = p.sorted + int64_t(row) * p.st.max_clusters;
  // What the row's last phases read does not depend on the fit: the first kBudgetPrefix *
  // kRowThreads entries of the sorted prefix and the first kRowThreads sorted ids are loaded
  // now, with the first round of logits and the lengths (all read up to the buffers' widths and
  // cut below), so that the phases after the search do not wait on memory (three round trips
  // before).
  const int M = p.st.max_clusters;
  int pre[kBudgetPrefix];
#pragma unroll
  for (int i = 0; i < kBudgetPrefix; ++i) {
    const int j = 1 + int(threadIdx.x) + i * kRowThreads;
    pre[i] = j < M ? prefix[j] : 0;
  }
  const int first_id = int(threadIdx.x) < M ? ids[threadIdx.x] : 0;
  // The sizes of the first kRowThreads ranked clusters and the selection's tokens come from
  // here after the search, not from two more round trips to L2.
  s_prefix[threadIdx.x + 1] = pre[0];
  if (threadIdx.x == 0) s_prefix[0] = prefix[0];
  const int C = p.st.num_clusters[slot];
  // The top of the order whose ids and prefix are written; all of it after the long lists' sort.
  const OrderTop top = p.sort_keys ? OrderTop{M, INT_MAX, 0.f, 0.f} : p.top[row];
  const FitPlan plan = make_fit_plan(p.st.clustered_len[slot], p.fit);
  const int S = plan.num_samples();
  // The fit's abscissae and H(num_exact) do not depend on the logits either: their logs and
  // divisions (a dependent chain of double-precision sequences) run here too.
  const double x1 = plan.fitted ? plan.x1() : 0.0, x2 = plan.fitted ? plan.x2() : 0.0;
  const double span = plan.fitted ? fit_span(x1, x2) : 0.0;
  const double h_exact = harmonic(plan.num_exact), h_n = plan.fitted ? harmonic(plan.n) : 0.0;
  // Launched programmatically behind the sample kernel, which lets it get resident only after
  // the order kernel has ended: everything above was written by then, so those loads and that
  // arithmetic overlap the sample kernel's end; the logits are its output.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // The first kLogitSmem logits in one round of loads, kept in shared memory for the max, the
  // exact prefix and the windows (three rounds of L2 reads before).
  float v0[kBudgetStage];
#pragma unroll
  for (int i = 0; i < kBudgetStage; ++i) {
    const int s = int(threadIdx.x) + i * kRowThreads;
    v0[i] = s < p.smax ? logits[s] : -INFINITY;
  }
  if (S == 0 || C == 0) {
    if (threadIdx.x == 0) p.sel.selected[row] = 0;
    return;
  }
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kBudgetStage; ++i) {
    const int s = int(threadIdx.x) + i * kRowThreads;
    if (s < S) m = fmaxf(m, v0[i]);
    s_logit[s] = v0[i];
  }
  auto logit = [&](int s) { return s < kLogitSmem ? s_logit[s] : logits[s]; };
  // Longer lists: strided loops of kBudgetItems independent loads per round.
  for (int s0 = threadIdx.x + kLogitSmem; s0 < S; s0 += kRowThreads * kBudgetItems) {
    float v[kBudgetItems];
#pragma unroll
    for (int i = 0; i < kBudgetItems; ++i) {
      const int s = s0 + i * kRowThreads;
      v[i] = s < S ? logits[s] : -INFINITY;
    }
#pragma unroll
    for (int i = 0; i < kBudgetItems; ++i) m = fmaxf(m, v[i]);
  }
  m = ReduceF(tmp.rf).Reduce(m, MaxOp());
  if (threadIdx.x == 0) s_max = m;
  __syncthreads();
  // The exponentials in fp32 (expf, a few FP32 instructions and one MUFU), their sums in fp64.
  // With exp in fp64 (tens of FP64 instructions each, 3,279 a row at 128K on one SM) the exact
  // prefix and the windows took 3.4 us of the budget's 6.4 on an H200, with expf 2.1 (docs/
  // gpu.md). expf is within 2 ulp; the logits themselves are fp32 dot products of bf16 rows,
  // so the CPU's fp64 budget is matched up to near-ties either way (test_tactic_cuda's
  // tolerance).
  const float mx = s_max;
  double carry = 0.0;
  for (int s0 = 0; s0 < plan.num_exact; s0 += kRowThreads * kBudgetItems) {
    // Blocked: a thread's kBudgetItems logits as two 16-byte shared loads where staged (scalar
    // loads at a stride of 8 words conflict 8 ways).
    static_assert(kBudgetItems == 8 && kLogitSmem % (kRowThreads * kBudgetItems) == 0, "");
    float l[kBudgetItems];
    if (s0 < kLogitSmem) {  // uniform: the whole round is staged
      const float4* l4 = reinterpret_cast<const float4*>(s_logit + s0) + 2 * threadIdx.x;
      const float4 u = l4[0], v = l4[1];
      l[0] = u.x, l[1] = u.y, l[2] = u.z, l[3] = u.w, l[4] = v.x, l[5] = v.y, l[6] = v.z;
      l[7] = v.w;
    } else {
#pragma unroll
      for (int i = 0; i < kBudgetItems; ++i) {
        const int s = s0 + int(threadIdx.x) * kBudgetItems + i;
        l[i] = s < plan.num_exact ? logits[s] : 0.f;
      }
    }
    double e[kBudgetItems];
#pragma unroll
    for (int i = 0; i < kBudgetItems; ++i) {
      const int s = s0 + int(threadIdx.x) * kBudgetItems + i;
      e[i] = s < plan.num_exact ? double(expf(l[i] - mx)) : 0.0;
    }
    double total;
    ScanD(tmp.scan).InclusiveSum(e, e, total);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kBudgetItems; ++i) {
      const int s = s0 + int(threadIdx.x) * kBudgetItems + i;
      if (s < kExactSmem)
        s_exact[exact_slot(s)] = carry + e[i];
      else if (s < plan.num_exact)
        exact[s] = carry + e[i];
    }
    carry += total;
  }
  // Both windows' sums in one reduction.
  double2 w = make_double2(0.0, 0.0);
#pragma unroll 4
  for (int i = threadIdx.x; i < plan.w; i += kRowThreads) {
    w.x += double(expf(logit(plan.num_exact + i) - mx));
    w.y += double(expf(logit(plan.num_exact + plan.w + i) - mx));
  }
  w = ReduceD2(tmp.rd2).Reduce(w, SumD2Op());
  if (threadIdx.x == 0) {
    s_windows[0] = w.x;
    s_windows[1] = w.y;
  }
  __syncthreads();  // the window sums and the whole exact prefix are visible to every thread
  TailModel tail;
  if (plan.fitted)
    tail = fit_tail_span(s_windows[0] / plan.w, s_windows[1] / plan.w, x1, span, plan.n);
  const int K = block_budget_tokens(
      plan, tail, p.fit.target,
      [&](int k) { return k - 1 < kExactSmem ? s_exact[exact_slot(k - 1)] : exact[k - 1]; },
      h_exact, h_n);
  // The union, and the members it adds to each index chunk: the row that sets a cluster's bit
  // first adds its size, so a cluster chosen by several heads of the group counts once.
  const auto join = [&](int c, int size) {
    const uint32_t bit = 1u << (c % 32);
    if (!(atomicOr(&p.bitmap[slot * p.words + c / 32], bit) & bit))
      atomicAdd(&p.chunk_members[slot * p.chunks + c / kIndexChunk], size);
  };
  // The cut past the ranked top (uniform): s_logit holds its candidates now.
  if (K > top.tokens) {
    __syncthreads();
    static_assert(kCutSmem <= kLogitSmem, "the candidates fit s_logit");
    const int selected =
        budget_cut_in_group(p.keys + int64_t(row) * M, p.st.offsets_of(b, h),
                            p.group_first + int64_t(row) * kGroupFirstStride, top, C, K,
                            reinterpret_cast<int*>(s_logit), p.bitmap + slot * p.words,
                            p.chunk_members + slot * p.chunks);
    if (threadIdx.x == 0) p.sel.selected[row] = selected;
    return;
  }
  // Whole clusters (spec 8.2): the smallest J in [1, C] with prefix[J] >= K. prefix is
  // nondecreasing, so J = 1 + #{j in [1, C) : prefix[j] < K}: one coalesced pass of the block
  // instead of a serial binary search of dependent loads. prefix[top.clusters] >= K, so the
  // count stops at the top's end.
  const int R = min(C, top.clusters);
  int below = 0;
#pragma unroll
  for (int i = 0; i < kBudgetPrefix; ++i)
    below += 1 + int(threadIdx.x) + i * kRowThreads < R && pre[i] < K ? 1 : 0;
  for (int j0 = 1 + int(threadIdx.x) + kBudgetPrefix * kRowThreads; j0 < R;
       j0 += kRowThreads * kBudgetItems) {
    int v[kBudgetItems];
#pragma unroll
    for (int i = 0; i < kBudgetItems; ++i) {
      const int j = j0 + i * kRowThreads;
      v[i] = j < R ? prefix[j] : K;
    }
#pragma unroll
    for (int i = 0; i < kBudgetItems; ++i) below += v[i] < K ? 1 : 0;
  }
  below = ReduceI(tmp.ri).Sum(below);
  if (threadIdx.x == 0) s_clusters = 1 + below;
  __syncthreads();
  const int J = s_clusters;
  if (threadIdx.x == 0) p.sel.selected[row] = J <= kRowThreads ? s_prefix[J] : prefix[J];
  for (int j = threadIdx.x; j < J; j += kRowThreads)
    join(j < kRowThreads ? first_id : ids[j],
         j < kRowThreads ? s_prefix[j + 1] - s_prefix[j] : prefix[j + 1] - prefix[j]);
}

// Compaction of the union into the sub-request page table: one CTA per (chunk of
// kIndexChunk clusters, sequence, kv head). A CTA sums the union's members in the chunks
// before its own (the budget counted them per chunk as it set the bits: one load per earlier
// chunk, where a pass over the earlier clusters' bits and offsets took several rounds of
// loads), scans its own chunk, and its warps copy the flagged clusters' members, a lane per
// member. The CTA of the last chunk also appends the recent tokens and writes the count.
// Output order: flagged clusters ascending, members in CSR order, then the recent tokens.

__global__ void __launch_bounds__(kIndexThreads) index_kernel(SelectParams p) {
  using Scan = cub::BlockScan<int, kIndexThreads>;
  using Reduce = cub::BlockReduce<int, kIndexThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  __shared__ int s_first[kIndexChunk], s_size[kIndexChunk], s_pos[kIndexChunk];
  __shared__ int s_before;
  const int Hkv = p.kv.num_kv_heads;
  const int sub = blockIdx.y;
  const int b = sub / Hkv, h = sub % Hkv;
  const int64_t slot = p.st.slot(b, h);
  const int M = p.st.max_clusters;
  const int32_t* off = p.st.offsets_of(b, h);
  const uint32_t* bits = p.bitmap + slot * p.words;
  const int c0 = blockIdx.x * kIndexChunk, c = c0 + int(threadIdx.x);
  // The chunk's offsets go out with the cluster count and the lengths (loaded to the state's
  // capacity, allocated, and cut at the count below). Launched programmatically behind the
  // budget kernel, the CTA issues them before waiting for the budget's bitmap and counts.
  const int own_lo = c < M ? off[c] : 0, own_hi = c < M ? off[c + 1] : 0;
  const int C = p.st.num_clusters[slot], clen = p.st.clustered_len[slot];
  const int len = p.kv.seq_lens[b];
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // The chunk's own bitmap word and the members of the earlier chunks, a chunk per thread
  // (one round up to 256 chunks: 1M tokens at cluster size 16).
  const uint32_t own_word = c < M ? bits[c / 32] : 0u;
  const int* counted = p.chunk_members + slot * p.chunks;
  int before = int(threadIdx.x) < int(blockIdx.x) ? counted[threadIdx.x] : 0;
  const int last = C > 0 ? (C - 1) / kIndexChunk : 0;
  if (int(blockIdx.x) > last) return;  // uniform: a chunk past the list
  for (int x = int(threadIdx.x) + kIndexThreads; x < int(blockIdx.x); x += kIndexThreads)
    before += counted[x];
  const int32_t* members = p.st.members_of(b, h);
  const int32_t* member_rows = p.st.member_rows ? p.st.member_rows_of(b, h) : nullptr;
  int32_t* tokens = p.sel.tokens + sub * int64_t(p.sel.max_tokens);
  int32_t* rows = p.sel.rows + sub * int64_t(p.sel.max_tokens);
  // Entry i: token t on page row r (the sub-request's row: the page row times Hkv plus h).
  auto put = [&](int i, int t, int32_t r) {
    tokens[i] = t;
    rows[i] = r * Hkv + h;
  };
  before = Reduce(tmp.reduce).Sum(before);
  if (threadIdx.x == 0) s_before = before;  // thread 0 holds the block sum
  __syncthreads();
  before = s_before;
  const bool mine = c < C && ((own_word >> (c % 32)) & 1u);
  int pos, total;
  Scan(tmp.scan).ExclusiveSum(mine ? own_hi - own_lo : 0, pos, total);
  __syncthreads();
  int k, count;
  Scan(tmp.scan).ExclusiveSum(mine ? 1 : 0, k, count);
  if (mine) {
    s_first[k] = own_lo;
    s_size[k] = own_hi - own_lo;
    s_pos[k] = before + pos;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int f = warp; f < count; f += kIndexThreads / 32) {
    const int lo = s_first[f], n = s_size[f], at = s_pos[f];
    // The members' page rows where the state keeps them (loaded beside the tokens), else
    // through the page table, a round trip after the token's.
    for (int i = lane; i < n; i += 32) {
      const int t = members[lo + i];
      put(at + i, t, member_rows ? member_rows[lo + i] : p.kv.page_row_of(b, t));
    }
  }
  if (int(blockIdx.x) == last) {
    const int base = before + total;
    for (int t = clen + threadIdx.x; t < len; t += kIndexThreads)
      put(base + (t - clen), t, p.kv.page_row_of(b, t));
    if (threadIdx.x == 0) {
      const int n = base + max(0, len - clen);
      p.sel.counts[sub] = n;
      if (p.counters) atomicAdd(&p.counters[0], (unsigned long long)n);
    }
  }
}

template <int D>
cudaError_t launch_select(SelectParams& p, const SelectLayout& l, char* ws, int batch,
                          int ranked_min, cudaStream_t stream) {
  const int rows = batch * p.num_q_heads;
  const int subs = batch * p.kv.num_kv_heads;
  const int M = p.st.max_clusters;
  score_kernel<D><<<dim3(unsigned((M + kScoreTile - 1) / kScoreTile), unsigned(subs)), kScoreTile,
                    0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (M <= kOrderMax) {
    int* sorted = reinterpret_cast<int*>(ws + l.vals_b);
    err = launch_programmatic(order_kernel, dim3(unsigned(rows)), dim3(kOrderThreads),
                              sizeof(OrderSmem), stream, p, sorted, ranked_min);
    if (err != cudaSuccess) return err;
    p.sorted = sorted;
  } else {
    // Every row at once (sort_key): stable, so equal scores keep the lower cluster id first.
    cub::DoubleBuffer<unsigned long long> keys(
        p.sort_keys, reinterpret_cast<unsigned long long*>(ws + l.keys_b));
    cub::DoubleBuffer<int> vals(p.vals, reinterpret_cast<int*>(ws + l.vals_b));
    size_t temp_bytes = 0;
    err = cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys, vals, int64_t(rows) * M, 0,
                                          sort_end_bit(rows), stream);
    if (err != cudaSuccess) return err;
    if (temp_bytes > l.temp_bytes) return cudaErrorInvalidValue;
    err = cub::DeviceRadixSort::SortPairs(ws + l.temp, temp_bytes, keys, vals, int64_t(rows) * M, 0,
                                          sort_end_bit(rows), stream);
    if (err != cudaSuccess) return err;
    p.sorted = vals.Current();
    prefix_kernel<<<rows, kPrefixThreads, sizeof(PrefixSmem), stream>>>(p);
  }
  constexpr int kSamplesPerCta = samples_per_cta<D>();
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = launch_programmatic(
      sample_kernel<D>,
      dim3(unsigned((p.smax + kSamplesPerCta - 1) / kSamplesPerCta), unsigned(rows)),
      dim3(kSampleThreads), 0, stream, p);
  if (err != cudaSuccess) return err;
  err = launch_programmatic(budget_kernel, dim3(unsigned(rows)), dim3(kRowThreads), 0, stream, p);
  if (err != cudaSuccess) return err;
  return launch_programmatic(index_kernel,
                             dim3(unsigned((M + kIndexChunk - 1) / kIndexChunk), unsigned(subs)),
                             dim3(kIndexThreads), 0, stream, p);
}

}  // namespace

cudaError_t prepare_cuda(int head_dim) {
  if (head_dim != 64 && head_dim != 128) return cudaErrorInvalidValue;
  static std::once_flag once[2];
  static cudaError_t result[2] = {cudaSuccess, cudaSuccess};
  const int i = head_dim == 64 ? 0 : 1;
  std::call_once(once[i], [&] {
    auto set = [](const void* f, int bytes) {
      return cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    };
    cudaError_t e =
        i == 0
            ? set(reinterpret_cast<const void*>(assign_kernel<64>), int(assign_smem_bytes<64>()))
            : set(reinterpret_cast<const void*>(assign_kernel<128>), int(assign_smem_bytes<128>()));
    const void* recluster = i == 0 ? reinterpret_cast<const void*>(recluster_kernel<64>)
                                   : reinterpret_cast<const void*>(recluster_kernel<128>);
    if (e == cudaSuccess) e = set(recluster, kBlockSmemLimit);
    if (e == cudaSuccess) e = set(reinterpret_cast<const void*>(order_kernel), sizeof(OrderSmem));
    if (e == cudaSuccess) e = set(reinterpret_cast<const void*>(prefix_kernel), sizeof(PrefixSmem));
    result[i] = e;
  });
  return result[i];
}

size_t cluster_prefill_workspace_bytes(int batch, int num_kv_heads, int max_len, int cluster_size) {
  if (batch < 1 || num_kv_heads < 1 || max_len < 0 || cluster_size < 1)
    throw std::invalid_argument("cluster_prefill_workspace_bytes: batch " + std::to_string(batch) +
                                ", num_kv_heads " + std::to_string(num_kv_heads) + ", max_len " +
                                std::to_string(max_len) + ", cluster_size " +
                                std::to_string(cluster_size) + " out of range");
  return prefill_layout(batch, num_kv_heads, max_len, cluster_size).total;
}

cudaError_t cluster_prefill_cuda(const PagedKV& kv, const int32_t* seq_lens_host, int layer,
                                 const KMeansParams& km, const ClusterState& st, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream) {
  const int d = kv.head_dim;
  if ((d != 64 && d != 128) || st.head_dim != d || kv.batch < 1 || kv.batch > st.max_batch ||
      kv.num_kv_heads != st.num_kv_heads || km.cluster_size < 1 || km.iterations < 1 ||
      !seq_lens_host || !workspace)
    return cudaErrorInvalidValue;
  int max_n = 0, max_c = 0;
  std::vector<Problem> probs;
  int64_t scratch = 0, cscratch = 0;
  for (int b = 0; b < kv.batch; ++b) {
    const int n = seq_lens_host[b];
    const int C = kmeans_num_clusters(n, km.cluster_size);
    if (n < 0 || n > st.max_tokens || C > st.max_clusters) return cudaErrorInvalidValue;
    max_n = std::max(max_n, n);
    max_c = std::max(max_c, C);
    for (int h = 0; h < kv.num_kv_heads; ++h) {
      probs.push_back(
          Problem{b, h, 0, n, C, 0, kmeans_stream(km.seed, layer, h, 0), scratch, cscratch});
      scratch += n;
      cscratch += C;
    }
  }
  const PrefillLayout l = prefill_layout(kv.batch, kv.num_kv_heads, max_n, km.cluster_size);
  if (workspace_bytes < l.total) return cudaErrorInvalidValue;
  char* ws = static_cast<char*>(workspace);
  const cudaError_t err =
      d == 64 ? launch_prefill<64>(kv, probs, max_n, max_c, km.iterations, st, ws, l, stream)
              : launch_prefill<128>(kv, probs, max_n, max_c, km.iterations, st, ws, l, stream);
  if (err != cudaSuccess) return err;
  return cudaStreamSynchronize(stream);  // probs (host) is read by the async copy
}

int recluster_block_max_tokens(int head_dim, int cluster_size) {
  int best = 0;
  for (int t = cluster_size; t <= (1 << 16); t += cluster_size) {
    const size_t bytes = head_dim == 64 ? recluster_layout<64>(t, cluster_size).total
                                        : recluster_layout<128>(t, cluster_size).total;
    if (bytes > size_t(kBlockSmemLimit)) break;
    best = t;
  }
  return best;
}

cudaError_t recluster_blocks_cuda(const PagedKV& kv, int layer, int block_tokens,
                                  const KMeansParams& km, const ClusterState& st,
                                  cudaStream_t stream) {
  const int d = kv.head_dim;
  if ((d != 64 && d != 128) || st.head_dim != d || kv.batch > st.max_batch ||
      kv.num_kv_heads != st.num_kv_heads || km.cluster_size < 1 || km.iterations < 1 ||
      block_tokens < km.cluster_size || block_tokens % km.cluster_size != 0 ||
      block_tokens > recluster_block_max_tokens(d, km.cluster_size))
    return cudaErrorInvalidValue;
  if (kv.batch <= 0) return cudaSuccess;
  const cudaError_t err = prepare_cuda(d);
  if (err != cudaSuccess) return err;
  // A cluster of Q CTAs per (sequence, kv head): grid (Q, batch x kv heads).
  const int Q = recluster_ctas(block_tokens);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(Q), unsigned(kv.batch * kv.num_kv_heads));
  cfg.blockDim = dim3(kReclusterThreads);
  cfg.dynamicSmemBytes = d == 64 ? recluster_layout<64>(block_tokens, km.cluster_size).total
                                 : recluster_layout<128>(block_tokens, km.cluster_size).total;
  cfg.stream = stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = unsigned(Q);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return d == 64 ? cudaLaunchKernelEx(&cfg, recluster_kernel<64>, kv, layer, block_tokens,
                                      km.cluster_size, km.iterations, km.seed, st)
                 : cudaLaunchKernelEx(&cfg, recluster_kernel<128>, kv, layer, block_tokens,
                                      km.cluster_size, km.iterations, km.seed, st);
}

PagedKV subrequest_view(const PagedKV& kv, const Selection& sel) {
  PagedKV v = kv;
  v.page_table = sel.rows;
  v.seq_lens = sel.counts;
  v.batch = kv.batch * kv.num_kv_heads;
  v.num_pages = kv.num_pages * kv.page_size * kv.num_kv_heads;
  v.page_size = 1;
  v.num_kv_heads = 1;
  v.max_pages_per_seq = sel.max_tokens;
  return v;
}

size_t select_workspace_bytes(int max_batch, int num_q_heads, int num_kv_heads, int head_dim,
                              int max_clusters, int max_tokens, const FitParams& fit) {
  if (max_batch < 1 || num_q_heads < 1 || num_kv_heads < 1 || head_dim < 1 || max_clusters < 1 ||
      max_tokens < 1)
    throw std::invalid_argument("select_workspace_bytes: every size must be >= 1 (max_batch " +
                                std::to_string(max_batch) + ", max_clusters " +
                                std::to_string(max_clusters) + ", max_tokens " +
                                std::to_string(max_tokens) + ")");
  return select_layout(max_batch, num_q_heads, num_kv_heads, max_clusters, max_tokens, fit).total;
}

cudaError_t select_tokens_cuda(const bf16* q, int num_q_heads, const PagedKV& kv, float scale,
                               const FitParams& fit, const ClusterState& st, const Selection& sel,
                               unsigned long long* counters, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream, int ranked_min) {
  const int d = kv.head_dim;
  if ((d != 64 && d != 128) || st.head_dim != d || kv.num_kv_heads != st.num_kv_heads ||
      kv.batch > st.max_batch || num_q_heads % kv.num_kv_heads != 0 ||
      num_q_heads / kv.num_kv_heads > kMaxGroup || !q || !workspace || !sel.rows || !sel.tokens ||
      !sel.counts || !sel.selected || sel.max_tokens < st.max_tokens || ranked_min < -1)
    return cudaErrorInvalidValue;
  if (kv.batch <= 0) return cudaSuccess;
  const cudaError_t prepared = prepare_cuda(d);  // order_kernel's shared memory
  if (prepared != cudaSuccess) return prepared;
  if (ranked_min < 0) ranked_min = kOrderRankedMin;
  const SelectLayout l = select_layout(st.max_batch, num_q_heads, st.num_kv_heads, st.max_clusters,
                                       st.max_tokens, fit);
  if (workspace_bytes < l.total) return cudaErrorInvalidValue;
  char* ws = static_cast<char*>(workspace);
  SelectParams p;
  p.q = reinterpret_cast<const bf*>(q);
  p.kv = kv;
  p.st = st;
  p.sel = sel;
  p.fit = fit;
  p.scale = scale;
  p.num_q_heads = num_q_heads;
  p.group = num_q_heads / kv.num_kv_heads;
  p.smax = l.smax;
  p.words = l.words;
  const bool long_lists = st.max_clusters > kOrderMax;
  p.keys = long_lists ? nullptr : reinterpret_cast<float*>(ws + l.keys_a);
  p.sort_keys = long_lists ? reinterpret_cast<unsigned long long*>(ws + l.keys_a) : nullptr;
  p.vals = reinterpret_cast<int*>(ws + l.vals_a);
  p.sorted = nullptr;
  p.prefix = reinterpret_cast<int*>(ws + l.prefix);
  p.top = reinterpret_cast<OrderTop*>(ws + l.top);
  p.group_first = reinterpret_cast<int*>(ws + l.group_first);
  p.sample_keys = reinterpret_cast<int*>(ws + l.sample_keys);
  p.logits = reinterpret_cast<float*>(ws + l.logits);
  p.exact = reinterpret_cast<double*>(ws + l.exact);
  p.bitmap = reinterpret_cast<uint32_t*>(ws + l.bitmap);
  p.chunk_members = reinterpret_cast<int*>(ws + l.chunk_members);
  p.chunks = l.chunks;
  p.counters = counters;
  return d == 64 ? launch_select<64>(p, l, ws, kv.batch, ranked_min, stream)
                 : launch_select<128>(p, l, ws, kv.batch, ranked_min, stream);
}

}  // namespace kvs::kernels::tactic
