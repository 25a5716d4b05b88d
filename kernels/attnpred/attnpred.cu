// CUDA side of AttentionPredictor (attnpred.h).
//
//   cnn        one CTA per (input, 64-column tile) streams a band of rows through shared
//              memory (3 input rows, 3 conv1 rows of 16 channels); a thread computes 8 conv2
//              channels of one column (conv2's taps stored channel-minor in shared memory: two
//              float4 loads per tap), the row's 32 relu values go through shared memory and
//              one thread per column projects them onto conv3 (s). fp32 without FMA
//              contraction (__fmul_rn / __fadd_rn), in the CPU reference's order, so both
//              backends agree bit for bit.
//   predict    the same bands over the history, but incremental (CnnCache): the 4 edge rows
//              and the newly interior row per step, plus fix-up CTAs that recompute the
//              stored rows' columns next to a moved slice end; then a sum kernel adds the H
//              rows' s per column (and commits the cache's count and end).
//   select     one CTA per (sequence, query head): 4-pass 8-bit radix select of the k-th
//              largest score, then ties taken lowest index first (a block scan), flags OR-ed
//              per kv head (plain stores of 1: the group's heads may race, all write 1).
//   selection  one CTA per (sequence, kv head): attended-token counts per block, block scan,
//              scatter of token ids and rows into the sub-request page table.
//   row        scores q.k for the group's query heads (each K row read once per group), then
//              one CTA per (sequence, query head): log-sum-exp, and the max-pool by a warp
//              segmented max + one atomicMax per block run (probabilities are >= 0, so their
//              float bits order as ints).
//   resident   plan (one CTA per (sequence, kv head): free slots, assign missing blocks) and a
//              grid-stride copy kernel reading mapped pinned host memory: the block list never
//              leaves the GPU, so no host sync is needed to issue the copies.
#include <cuda_bf16.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cub/cub.cuh>
#include <stdexcept>
#include <string>

#include "kernels/attnpred/attnpred.h"

namespace kvs::kernels::attnpred {
namespace {

using bf = __nv_bfloat16;

constexpr int kCnnThreads = 256;
constexpr int kTile = 64;                             // output columns per CNN CTA
constexpr int kGroups = kCnnThreads / kTile;          // conv2 channel groups per column
constexpr int kPerThread = kConv2Channels / kGroups;  // 8 conv2 channels per thread
constexpr int kThreads = 256;
constexpr int kRowChunk = 1024;  // list positions per CTA of the score kernel
constexpr int kMaxGroup = 8;

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

__device__ __forceinline__ float madd(float acc, float w, float v) {
  return __fadd_rn(acc, __fmul_rn(w, v));
}

constexpr int kEdgeRows = 4;  // rows 0, 1, H-2, H-1 depend on the zero padding in time
constexpr int kFixRows = 8;   // stored rows per fix-up CTA
constexpr int kFixCols = 4;   // columns a fix-up recomputes at most: [old end - 2, new end)
constexpr int kMaxEndMove = kFixCols - 2;

// Shared-memory weights: PyTorch's packing (attnpred.h kParam*), except that conv2's taps are
// stored [ci][dy][dx][co], so one tap of a thread's 8 output channels is two float4 loads.
__device__ __forceinline__ int w2t_index(int co, int ci, int dy, int dx) {
  return kParamW2 + ((ci * 3 + dy) * 3 + dx) * kConv2Channels + co;
}

__device__ void load_weights(const float* __restrict__ params, float* w) {
  for (int i = threadIdx.x; i < kParamCount; i += blockDim.x) {
    int dst = i;
    if (i >= kParamW2 && i < kParamB2) {
      const int j = i - kParamW2, co = j / (kConv1Channels * 9), tap = j % (kConv1Channels * 9);
      dst = w2t_index(co, tap / 9, tap % 9 / 3, tap % 3);
    }
    w[dst] = params[i];
  }
}

__device__ __forceinline__ float relu(float x) { return x > 0.f ? x : 0.f; }

// relu(conv1) of channel ci at one position; r0, r1, r2: its 3 input rows, each at the
// position's left neighbour (3 values).
__device__ __forceinline__ float conv1_at(const float* w, int ci, const float* r0, const float* r1,
                                          const float* r2) {
  const float* rows[3] = {r0, r1, r2};
  float acc = w[kParamB1 + ci];
#pragma unroll
  for (int dy = 0; dy < 3; ++dy)
#pragma unroll
    for (int dx = 0; dx < 3; ++dx) acc = madd(acc, w[kParamW1 + ci * 9 + dy * 3 + dx], rows[dy][dx]);
  return relu(acc);
}

// conv2 pre-activations of channels [grp * 8, grp * 8 + 8) at one position; taps(ci, dy): the
// 3 relu(conv1) values of channel ci, row dy - 1, columns -1 .. +1 around the position.
template <class Taps>
__device__ __forceinline__ void conv2_group(const float* w, int grp, Taps taps,
                                            float (&acc)[kPerThread]) {
  static_assert(kPerThread == 8, "two float4 weight loads per tap");
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) acc[k] = w[kParamB2 + grp * kPerThread + k];
  for (int ci = 0; ci < kConv1Channels; ++ci) {
#pragma unroll
    for (int dy = 0; dy < 3; ++dy) {
      const float* v = taps(ci, dy);
      const float v3[3] = {v[0], v[1], v[2]};
#pragma unroll
      for (int dx = 0; dx < 3; ++dx) {
        const float4* wq =
            reinterpret_cast<const float4*>(w + w2t_index(grp * kPerThread, ci, dy, dx));
        const float4 a = wq[0], c = wq[1];
        acc[0] = madd(acc[0], a.x, v3[dx]);
        acc[1] = madd(acc[1], a.y, v3[dx]);
        acc[2] = madd(acc[2], a.z, v3[dx]);
        acc[3] = madd(acc[3], a.w, v3[dx]);
        acc[4] = madd(acc[4], c.x, v3[dx]);
        acc[5] = madd(acc[5], c.y, v3[dx]);
        acc[6] = madd(acc[6], c.z, v3[dx]);
        acc[7] = madd(acc[7], c.w, v3[dx]);
      }
    }
  }
}

// s = sum over conv2 channels of w3[c] * relu[c] (relu values `stride` apart), channel order.
__device__ __forceinline__ float project(const float* w, const float* relu_values, int stride) {
  float s = 0.f;
  for (int co = 0; co < kConv2Channels; ++co)
    s = madd(s, w[kParamW3 + co], relu_values[co * stride]);
  return s;
}

struct BandSmem {
  float xin[3][kTile + 4];                    // input rows, ring of 3; columns x0-2 .. x0+kTile+1
  float c1[3][kConv1Channels][kTile + 2];     // relu(conv1) rows, ring of 3; x0-1 .. x0+kTile
  float relu[kConv2Channels][kTile];          // relu(conv2) of the current row
};

struct FixSmem {
  float xin[kFixRows + 4][kFixCols + 4];
  float c1[kConv1Channels][kFixRows + 2][kFixCols + 2];
  float relu[kConv2Channels][kFixRows * kFixCols];
};

// s of conv2 rows [ra, rb) over the columns [x0, x0 + kTile) of one CNN input of H rows and W
// columns (row(r): the row's column 0, or nullptr for a row of zeros). sink(r, x, s) is
// called by thread x - x0 for every x < W, rows in order. Every thread of the CTA calls this.
template <class Row, class Sink>
__device__ void conv_band(const float* w, BandSmem& sm, Row row, int H, int W, int x0, int ra,
                          int rb, Sink sink) {
  constexpr int C1 = kConv1Channels;
  const int tid = threadIdx.x, col = tid % kTile, grp = tid / kTile;
  auto load_input = [&](int r) {  // input row r (r >= -2) into its ring slot
    float* dst = sm.xin[(r + 3) % 3];
    const float* src = (r >= 0 && r < H) ? row(r) : nullptr;
    for (int i = tid; i < kTile + 4; i += kCnnThreads) {
      const int c = x0 - 2 + i;
      dst[i] = (src && c >= 0 && c < W) ? src[c] : 0.f;
    }
  };
  auto conv1_row = [&](int r) {  // relu(conv1) row r (r >= -1) from input rows r-1 .. r+1
    float(*dst)[kTile + 2] = sm.c1[(r + 3) % 3];
    const float* i0 = sm.xin[(r + 2) % 3];
    const float* i1 = sm.xin[(r + 3) % 3];
    const float* i2 = sm.xin[(r + 4) % 3];
    for (int i = tid; i < C1 * (kTile + 2); i += kCnnThreads) {
      const int ci = i / (kTile + 2), j = i % (kTile + 2), c = x0 - 1 + j;
      // conv2's zero padding outside the rows or the slice (not relu(bias)).
      dst[ci][j] = (r >= 0 && r < H && c >= 0 && c < W) ? conv1_at(w, ci, i0 + j, i1 + j, i2 + j)
                                                         : 0.f;
    }
  };
  load_input(ra - 2);
  load_input(ra - 1);
  load_input(ra);
  __syncthreads();
  conv1_row(ra - 1);
  for (int j = ra; j <= rb; ++j) {
    __syncthreads();  // the slots about to be overwritten have been read
    load_input(j + 1);
    __syncthreads();
    conv1_row(j);
    __syncthreads();
    if (j > ra) {  // conv2 row j - 1 from relu(conv1) rows j - 2 .. j
      const int r = j - 1;
      if (x0 + col < W) {
        float acc[kPerThread];
        conv2_group(
            w, grp, [&](int ci, int dy) { return &sm.c1[(r + dy + 2) % 3][ci][col]; }, acc);
#pragma unroll
        for (int k = 0; k < kPerThread; ++k) sm.relu[grp * kPerThread + k][col] = relu(acc[k]);
      }
      __syncthreads();
      if (tid < kTile && x0 + tid < W) sink(r, x0 + tid, project(w, &sm.relu[0][tid], kTile));
    }
  }
  __syncthreads();  // shared memory free for the caller
}

// s of conv2 rows [ra, rb) (at most kFixRows) x columns [xa, xb) (at most kFixCols) of one
// CNN input (as conv_band); sink(r, x, s) once per position. Every thread calls this.
template <class Row, class Sink>
__device__ void conv_points(const float* w, FixSmem& sm, Row row, int H, int W, int ra, int rb,
                            int xa, int xb, Sink sink) {
  constexpr int C1 = kConv1Channels, IR = kFixRows + 4, IC = kFixCols + 4;
  constexpr int CR = kFixRows + 2, CC = kFixCols + 2, P = kFixRows * kFixCols;
  const int tid = threadIdx.x, nr = rb - ra, nc = xb - xa;
  for (int i = tid; i < IR * IC; i += kCnnThreads) {  // inputs ra-2 .. rb+1, xa-2 .. xb+1
    const int lr = i / IC, lc = i % IC, r = ra - 2 + lr, c = xa - 2 + lc;
    const float* src = (r >= 0 && r < H && lr < nr + 4) ? row(r) : nullptr;
    sm.xin[lr][lc] = (src && c >= 0 && c < W && lc < nc + 4) ? src[c] : 0.f;
  }
  __syncthreads();
  for (int i = tid; i < C1 * CR * CC; i += kCnnThreads) {  // relu(conv1) ra-1 .. rb, xa-1 .. xb
    const int ci = i / (CR * CC), lr = i % (CR * CC) / CC, lc = i % CC;
    const int r = ra - 1 + lr, c = xa - 1 + lc;
    sm.c1[ci][lr][lc] = (r >= 0 && r < H && c >= 0 && c < W && lr < nr + 2 && lc < nc + 2)
                            ? conv1_at(w, ci, &sm.xin[lr][lc], &sm.xin[lr + 1][lc],
                                       &sm.xin[lr + 2][lc])
                            : 0.f;
  }
  __syncthreads();
  const int p = tid % P, grp = tid / P, lr = p / kFixCols, lc = p % kFixCols;
  if (grp < kGroups && lr < nr && lc < nc) {
    float acc[kPerThread];
    conv2_group(w, grp, [&](int ci, int dy) { return &sm.c1[ci][lr + dy][lc]; }, acc);
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) sm.relu[grp * kPerThread + k][p] = relu(acc[k]);
  }
  __syncthreads();
  if (tid < P && lr < nr && lc < nc) sink(ra + lr, xa + lc, project(w, &sm.relu[0][tid], P));
  __syncthreads();
}

__global__ void __launch_bounds__(kCnnThreads)
    cnn_dense_kernel(const float* __restrict__ params, const float* __restrict__ x, int H, int W,
                     float* __restrict__ y) {
  __shared__ __align__(16) float w[kParamCount];
  __shared__ BandSmem sm;
  const int n = blockIdx.y, x0 = blockIdx.x * kTile;
  load_weights(params, w);
  __syncthreads();
  float t = 0.f;  // thread x - x0's time sum of s, rows in order
  conv_band(
      w, sm, [&](int r) { return x + (int64_t(n) * H + r) * W; }, H, W, x0, 0, H,
      [&](int, int, float s) { t = __fadd_rn(t, s); });
  if (threadIdx.x < kTile && x0 + threadIdx.x < W)
    y[int64_t(n) * W + x0 + threadIdx.x] = __fadd_rn(w[kParamB3], __fdiv_rn(t, float(H)));
}

__device__ __forceinline__ int edge_index(int r, int H) { return r < 2 ? r : kEdgeRows - (H - r); }
__device__ __forceinline__ bool edge_row(int r, int H) { return r < 2 || r > H - 3; }

// The CNN input of history (b, h) = sample s: the candidate slice of its H logical rows, and
// where each row's s lives (edge rows: cache.edge; interior rows: cache.s at the row's slot).
struct PredictSample {
  HistoryState hist;
  CnnCache cache;
  int s, b, h, H, c0, W, count;
  __device__ PredictSample(const HistoryState& hs, const CnnCache& cc, const Geometry& g, int s_)
      : hist(hs), cache(cc), s(s_), b(s_ / hs.num_q_heads), h(s_ % hs.num_q_heads),
        H(hs.history), c0(g.candidate_begin()), W(g.candidate_end(hs.tokens[b]) - c0),
        count(hs.count[b]) {}
  __device__ const float* row(int r) const {
    const float* p = hist.logical_row(b, h, r, count);
    return p ? p + c0 : nullptr;
  }
  // Ring slot of logical row r, also for the zero rows of a short history (slots not yet
  // appended to: their s describes a zero row).
  __device__ int slot(int r) const { return ((count - H + r) % H + H) % H; }
  __device__ float* s_of(int r) const {
    return edge_row(r, H)
               ? cache.edge + (int64_t(s) * kEdgeRows + edge_index(r, H)) * hist.max_blocks + c0
               : cache.s + (int64_t(s) * H + slot(r)) * hist.max_blocks + c0;
  }
};

// Grid (n_tiles + fix-up CTAs, batch * Hq): tiles compute rows, fix-up CTA f recomputes the
// stored rows [2 + f * kFixRows, ...) in the columns next to a moved slice end.
__global__ void __launch_bounds__(kCnnThreads)
    predict_rows_kernel(const float* __restrict__ params, HistoryState hist, CnnCache cache,
                        Geometry g, int n_tiles) {
  __shared__ __align__(16) float w[kParamCount];
  __shared__ union {
    BandSmem band;
    FixSmem fix;
  } sm;
  const PredictSample ps(hist, cache, g, blockIdx.y);
  const int H = ps.H, W = ps.W;
  if (W <= 0) return;
  const int seen = cache.count[ps.b], end = cache.end[ps.b], c1 = ps.c0 + W;
  const bool incremental = H >= 5 && (seen == ps.count || seen + 1 == ps.count) && end <= c1 &&
                           c1 - end <= kMaxEndMove;
  auto row = [&](int r) { return ps.row(r); };
  auto store = [&](int r, int x, float v) { ps.s_of(r)[x] = v; };
  if (blockIdx.x < n_tiles) {
    const int x0 = blockIdx.x * kTile;
    if (x0 >= W) return;
    load_weights(params, w);
    __syncthreads();
    if (incremental) {
      conv_band(w, sm.band, row, H, W, x0, 0, 2, store);
      conv_band(w, sm.band, row, H, W, x0, H - 3, H, store);
    } else {
      conv_band(w, sm.band, row, H, W, x0, 0, H, store);
    }
    return;
  }
  if (!incremental || end == c1) return;
  const int ra = 2 + (blockIdx.x - n_tiles) * kFixRows, rb = min(ra + kFixRows, H - 3);
  if (ra >= rb) return;
  load_weights(params, w);
  __syncthreads();
  conv_points(w, sm.fix, row, H, W, ra, rb, max(0, end - 2 - ps.c0), W, store);
}

// scores of sample (b, h) = b3 + (its H rows' s summed in row order) / H; commits the cache.
__global__ void __launch_bounds__(kThreads)
    predict_sum_kernel(const float* __restrict__ params, HistoryState hist, CnnCache cache,
                       Geometry g, float* __restrict__ scores) {
  const PredictSample ps(hist, cache, g, blockIdx.y);
  if (blockIdx.x == 0 && ps.h == 0 && threadIdx.x == 0) {
    cache.count[ps.b] = ps.count;
    cache.end[ps.b] = ps.c0 + ps.W;
  }
  const int x = blockIdx.x * kThreads + threadIdx.x;
  if (x >= ps.W) return;
  float t = 0.f;
  for (int r = 0; r < ps.H; ++r) t = __fadd_rn(t, ps.s_of(r)[x]);
  scores[int64_t(ps.s) * hist.max_blocks + ps.c0 + x] =
      __fadd_rn(__ldg(params + kParamB3), __fdiv_rn(t, float(ps.H)));
}

__global__ void reset_cnn_cache_kernel(CnnCache cache, int batch) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < batch) cache.count[b] = -1;
}

__device__ __forceinline__ unsigned order_key(float f) {
  unsigned u = f == 0.f ? 0u : __float_as_uint(f);  // -0 ranks as +0, as in the CPU comparator
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kThreads)
    select_kernel(const float* __restrict__ scores, HistoryState hist, int num_kv_heads, Geometry g,
                  int k, uint8_t* flags) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int hist_bins[256];
  __shared__ unsigned s_prefix;
  __shared__ int s_remaining;
  const int s = blockIdx.x, tid = threadIdx.x;
  const int b = s / hist.num_q_heads, h = s % hist.num_q_heads;
  const int group = hist.num_q_heads / num_kv_heads;
  const int c0 = g.candidate_begin(), c1 = g.candidate_end(hist.tokens[b]);
  const int count = c1 - c0;
  if (count <= 0) return;
  const float* sc = scores + int64_t(s) * hist.max_blocks + c0;
  uint8_t* fl = flags + (int64_t(b) * num_kv_heads + h / group) * hist.max_blocks + c0;
  if (k >= count) {
    for (int j = tid; j < count; j += kThreads) fl[j] = 1;
    return;
  }
  if (k <= 0) return;
  unsigned prefix = 0, mask = 0;
  int remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += kThreads) hist_bins[i] = 0;
    __syncthreads();
    for (int j = tid; j < count; j += kThreads) {
      const unsigned key = order_key(sc[j]);
      if ((key & mask) == prefix) atomicAdd(&hist_bins[(key >> shift) & 255u], 1);
    }
    __syncthreads();
    if (tid == 0) {
      int acc = 0, d = 255;
      for (; d > 0; --d) {
        if (acc + hist_bins[d] >= remaining) break;
        acc += hist_bins[d];
      }
      s_prefix = prefix | (unsigned(d) << shift);
      s_remaining = remaining - acc;
    }
    __syncthreads();
    prefix = s_prefix;
    remaining = s_remaining;
    mask |= 255u << shift;
    __syncthreads();
  }
  // prefix is the k-th largest key; `remaining` of the keys equal to it are taken, by index.
  int taken = 0;
  for (int base = 0; base < count; base += kThreads) {
    const int j = base + tid;
    const unsigned key = j < count ? order_key(sc[j]) : 0u;
    const int tie = (j < count && key == prefix) ? 1 : 0;
    int before, total;
    Scan(scan).ExclusiveSum(tie, before, total);
    if (j < count && (key > prefix || (tie && taken + before < remaining))) fl[j] = 1;
    taken += total;
    __syncthreads();
  }
}

__device__ __forceinline__ int block_attended(const Geometry& g, int j, int n, const uint8_t* fl) {
  const int lo = j * g.block, hi = min(lo + g.block, n);
  if (lo >= n) return 0;
  if (lo < g.sink || fl[j]) return hi - lo;
  return max(0, hi - max(lo, n - g.recent));
}

__global__ void __launch_bounds__(kThreads)
    build_selection_kernel(PagedKV kv, const uint8_t* __restrict__ flags, int max_blocks,
                           Geometry g, const int32_t* __restrict__ block_slot,
                           tactic::Selection sel, unsigned long long* counters) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int bh = blockIdx.x, tid = threadIdx.x;
  const int b = bh / kv.num_kv_heads, h = bh % kv.num_kv_heads;
  const int n = kv.seq_lens[b];
  const uint8_t* fl = flags + int64_t(bh) * max_blocks;
  const int32_t* slots = block_slot ? block_slot + int64_t(bh) * max_blocks : nullptr;
  int32_t* rows = sel.rows + int64_t(bh) * sel.max_tokens;
  int32_t* toks = sel.tokens + int64_t(bh) * sel.max_tokens;
  const int nb = g.num_blocks(n);
  int written = 0;
  unsigned long long missing = 0;
  for (int base = 0; base < nb; base += kThreads) {
    const int j = base + tid;
    const int cnt = j < nb ? block_attended(g, j, n, fl) : 0;
    int pos, total;
    Scan(scan).ExclusiveSum(cnt, pos, total);
    if (cnt > 0) {
      const int lo = j * g.block, hi = min(lo + g.block, n);
      int p = written + pos;
      const int slot = slots ? slots[j] : 0;
      if (slots && slot < 0) missing += cnt;
      for (int t = hi - cnt; t < hi; ++t, ++p) {
        if (p >= sel.max_tokens) break;
        toks[p] = t;
        rows[p] = slots ? max(slot, 0) * g.block + t % g.block
                        : int32_t(kv.offset(b, t, h) / kv.head_dim);
      }
      (void)lo;
    }
    written += total;
    __syncthreads();
  }
  if (tid == 0) {
    sel.counts[bh] = min(written, sel.max_tokens);
    if (counters) atomicAdd(counters, (unsigned long long)min(written, sel.max_tokens));
    if (counters && written > sel.max_tokens)
      atomicAdd(counters + 1, (unsigned long long)(written - sel.max_tokens));
  }
  if (counters && missing) atomicAdd(counters + 1, missing);
}

// Scores of the list positions [i0, i0 + kRowChunk) of (b, kv head h) for its query heads.
__global__ void __launch_bounds__(kThreads)
    row_scores_kernel(const bf16* __restrict__ q_raw, int num_q_heads, PagedKV view, bool sub,
                      int num_kv_heads, float scale, float* scores, int max_tokens) {
  extern __shared__ float qs[];  // [group, d]
  const int bh = blockIdx.x, tid = threadIdx.x;
  const int b = bh / num_kv_heads, h = bh % num_kv_heads;
  const int g = num_q_heads / num_kv_heads, d = view.head_dim;
  const int seq = sub ? bh : b, kvh = sub ? 0 : h;
  const int n = view.seq_lens[seq];
  const int i0 = blockIdx.y * kRowChunk;
  if (i0 >= n) return;
  const bf* q = reinterpret_cast<const bf*>(q_raw) + (int64_t(b) * num_q_heads + h * g) * d;
  for (int i = tid; i < g * d; i += kThreads) qs[i] = __bfloat162float(q[i]);
  __syncthreads();
  const int lane = tid & 31, warp = tid >> 5;
  const int per_lane = d / 32;  // 4 (d = 128) or 2 (d = 64)
  const int i1 = min(n, i0 + kRowChunk);
  for (int i = i0 + warp; i < i1; i += kThreads / 32) {
    const bf* k = reinterpret_cast<const bf*>(view.k) + view.offset(seq, i, kvh);
    float kf[4];
    for (int e = 0; e < per_lane; ++e) kf[e] = __bfloat162float(k[lane * per_lane + e]);
    for (int j = 0; j < g; ++j) {
      float dot = 0.f;
      for (int e = 0; e < per_lane; ++e) dot += qs[j * d + lane * per_lane + e] * kf[e];
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (lane == 0) scores[(int64_t(b) * num_q_heads + h * g + j) * max_tokens + i] = dot * scale;
    }
  }
}

// Softmax over the list of (b, query head) and its max-pool into the history row.
__global__ void __launch_bounds__(kThreads)
    row_pool_kernel(int num_q_heads, PagedKV view, bool sub, const int32_t* __restrict__ ids,
                    int ids_stride, const int32_t* __restrict__ kv_lens, int num_kv_heads,
                    const float* __restrict__ scores, int max_tokens, Geometry geo,
                    HistoryState hist) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage red;
  __shared__ float s_val;
  const int s = blockIdx.x, tid = threadIdx.x;
  const int b = s / num_q_heads, qh = s % num_q_heads;
  const int g = num_q_heads / num_kv_heads, h = qh / g;
  const int seq = sub ? b * num_kv_heads + h : b;
  const int n = view.seq_lens[seq];
  const float* sc = scores + int64_t(s) * max_tokens;
  const int32_t* id = ids ? ids + int64_t(seq) * ids_stride : nullptr;
  float* row = hist.slot(b, qh, hist.count[b] % hist.history);
  for (int j = tid; j < hist.max_blocks; j += kThreads) row[j] = 0.f;
  float m = -INFINITY;
  for (int i = tid; i < n; i += kThreads) m = fmaxf(m, sc[i]);
  m = Reduce(red).Reduce(m, MaxOp());
  if (tid == 0) s_val = m;
  __syncthreads();
  m = s_val;
  float z = 0.f;
  for (int i = tid; i < n; i += kThreads) z += expf(sc[i] - m);
  __syncthreads();
  z = Reduce(red).Sum(z);
  if (tid == 0) s_val = m + logf(z);
  __syncthreads();
  const float lse = s_val;
  (void)kv_lens;
  const int lane = tid & 31;
  for (int base = (tid & ~31); base < n; base += kThreads) {
    const int i = base + lane;
    const bool ok = i < n;
    float p = ok ? expf(sc[i] - lse) : 0.f;
    const int blk = ok ? (id ? id[i] : i) / geo.block : -1;
    for (int o = 1; o < 32; o <<= 1) {
      const float pv = __shfl_down_sync(0xffffffffu, p, o);
      const int bv = __shfl_down_sync(0xffffffffu, blk, o);
      if (lane + o < 32 && bv == blk) p = fmaxf(p, pv);
    }
    const int prev = __shfl_up_sync(0xffffffffu, blk, 1);
    if (ok && (lane == 0 || prev != blk))
      atomicMax(reinterpret_cast<int*>(row + blk), __float_as_int(p));
  }
}

__global__ void advance_history_kernel(HistoryState hist, const int32_t* kv_lens, int batch) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  hist.count[b] += 1;
  hist.tokens[b] = kv_lens[b];
}

__device__ __forceinline__ bool wanted(const Geometry& g, int j, int n_next, const uint8_t* fl,
                                       bool skip_tail) {
  const int nb = g.num_blocks(n_next);
  if (j >= nb) return false;
  if (skip_tail && j == nb - 1) return false;
  return j * g.block < g.sink || fl[j] || (j + 1) * g.block > n_next - g.recent;
}

__global__ void __launch_bounds__(kThreads)
    plan_resident_kernel(const int32_t* __restrict__ kv_lens, const uint8_t* __restrict__ flags,
                         Geometry g, int len_delta, bool skip_tail,
                         const int32_t* __restrict__ copied_lens, BlockCache cache,
                         unsigned long long* counters) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan;
  extern __shared__ int free_slots[];
  const int bh = blockIdx.x, tid = threadIdx.x;
  const int b = bh / cache.num_kv_heads;
  const int n_next = kv_lens[b] + len_delta;
  // Resident blocks reaching this token were copied before it existed (copied again).
  const int stale_from = copied_lens ? copied_lens[b] : INT_MAX;
  const uint8_t* fl = flags + int64_t(bh) * cache.max_blocks;
  int32_t* block_slot = cache.block_slot + int64_t(bh) * cache.max_blocks;
  int32_t* slot_block = cache.slot_block + int64_t(bh) * cache.slots_per_head;
  int32_t* list = cache.copy_list + int64_t(bh) * cache.slots_per_head * 2;
  const int slot0 = bh * cache.slots_per_head;
  for (int s = tid; s < cache.slots_per_head; s += kThreads) {
    const int blk = slot_block[s];
    if (blk >= 0 && !wanted(g, blk, n_next, fl, skip_tail)) {
      slot_block[s] = -1;
      block_slot[blk] = -1;
    }
  }
  __syncthreads();
  int nfree = 0;
  for (int base = 0; base < cache.slots_per_head; base += kThreads) {
    const int s = base + tid;
    const int f = (s < cache.slots_per_head && slot_block[s] < 0) ? 1 : 0;
    int pos, total;
    Scan(scan).ExclusiveSum(f, pos, total);
    if (f) free_slots[nfree + pos] = s;
    nfree += total;
    __syncthreads();
  }
  const int nb = g.num_blocks(n_next);
  int used = 0, copies = 0;
  unsigned long long overflow = 0;
  for (int base = 0; base < nb; base += kThreads) {
    const int j = base + tid;
    const bool want = j < nb && wanted(g, j, n_next, fl, skip_tail);
    const int have = want ? block_slot[j] : -1;
    const int need_slot = (want && have < 0) ? 1 : 0;
    const bool stale = want && (int64_t(j) + 1) * g.block > stale_from;
    const int need_copy = (need_slot || stale) ? 1 : 0;
    int spos, stotal, cpos, ctotal;
    Scan(scan).ExclusiveSum(need_slot, spos, stotal);
    __syncthreads();
    Scan(scan).ExclusiveSum(need_copy, cpos, ctotal);
    int slot = have;
    if (need_slot) {
      if (used + spos < nfree) {
        const int local = free_slots[used + spos];
        slot = slot0 + local;
        block_slot[j] = slot;
        slot_block[local] = j;
      } else {
        slot = -1;
        ++overflow;
      }
    }
    if (need_copy && slot >= 0) {
      list[2 * (copies + cpos)] = j;
      list[2 * (copies + cpos) + 1] = slot;
    }
    used += stotal;
    copies += ctotal;
    __syncthreads();
  }
  if (tid == 0) cache.copy_count[bh] = min(copies, cache.slots_per_head);
  if (counters && overflow) atomicAdd(counters + 1, overflow);
}

__global__ void __launch_bounds__(kThreads)
    copy_blocks_kernel(PagedKV host_kv, Geometry g, BlockCache cache, unsigned long long* counters,
                       unsigned int* done) {
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * kThreads + threadIdx.x) >> 5;
  const int nwarps = gridDim.x * kThreads / 32;
  const int d = cache.head_dim;
  const int vec_per_row = d * 2 / 16;  // uint4 per row: 16 (d = 128) or 8 (d = 64)
  unsigned long long copied = 0;
  const int bhs = cache.max_batch * cache.num_kv_heads;
  for (int bh = 0; bh < bhs; ++bh) {
    const int b = bh / cache.num_kv_heads, h = bh % cache.num_kv_heads;
    if (b >= host_kv.batch) break;
    const int count = cache.copy_count[bh];
    const int n = host_kv.seq_lens[b];
    const int32_t* list = cache.copy_list + int64_t(bh) * cache.slots_per_head * 2;
    for (int e = warp; e < count; e += nwarps) {
      const int j = list[2 * e], slot = list[2 * e + 1];
      const int t0 = j * g.block, t1 = min(t0 + g.block, n);
      for (int idx = lane; idx < (t1 - t0) * vec_per_row; idx += 32) {
        const int t = t0 + idx / vec_per_row, v = idx % vec_per_row;
        const int64_t src = host_kv.offset(b, t, h);
        const int64_t dst = (int64_t(slot) * g.block + t % g.block) * d;
        reinterpret_cast<uint4*>(cache.k + dst)[v] =
            reinterpret_cast<const uint4*>(host_kv.k + src)[v];
        reinterpret_cast<uint4*>(cache.v + dst)[v] =
            reinterpret_cast<const uint4*>(host_kv.v + src)[v];
      }
      if (lane == 0) ++copied;
    }
  }
  if (counters && copied) atomicAdd(counters, copied);
  __syncthreads();
  if (done && threadIdx.x == 0) {
    __threadfence();
    atomicAdd(done, 1u);
  }
}

__global__ void probe_kernel(const unsigned int* done, unsigned int expected,
                             unsigned long long* counter) {
  if (*reinterpret_cast<const volatile unsigned int*>(done) < expected) atomicAdd(counter, 1ull);
}

}  // namespace

PagedKV BlockCache::as_view(int block) const {
  PagedKV v;
  v.k = k;
  v.v = this->v;
  v.batch = max_batch * num_kv_heads;
  v.num_pages = max_batch * num_kv_heads * slots_per_head;
  v.page_size = block;
  v.num_kv_heads = 1;
  v.head_dim = head_dim;
  return v;
}

cudaError_t cnn_forward_cuda(const float* params, const float* x, int n, int H, int W, float* y,
                             cudaStream_t stream) {
  if (n <= 0 || W <= 0) return cudaSuccess;
  if (H < 1) return cudaErrorInvalidValue;
  const dim3 grid((W + kTile - 1) / kTile, n);
  cnn_dense_kernel<<<grid, kCnnThreads, 0, stream>>>(params, x, H, W, y);
  return cudaGetLastError();
}

cudaError_t reset_cnn_cache_cuda(const CnnCache& cache, int batch, cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  if (!cache.count) return cudaErrorInvalidValue;
  reset_cnn_cache_kernel<<<(batch + 127) / 128, 128, 0, stream>>>(cache, batch);
  return cudaGetLastError();
}

cudaError_t predict_cuda(const float* params, const HistoryState& hist, const CnnCache& cache,
                         int batch, const Geometry& g, float* scores, cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  if (!cache.s || !cache.edge || !cache.count || !cache.end || hist.history < 1)
    return cudaErrorInvalidValue;
  const int n_tiles = (hist.max_blocks + kTile - 1) / kTile;
  const int n_fix = (std::max(0, hist.history - 5) + kFixRows - 1) / kFixRows;
  const int samples = batch * hist.num_q_heads;
  predict_rows_kernel<<<dim3(n_tiles + n_fix, samples), kCnnThreads, 0, stream>>>(params, hist,
                                                                                 cache, g, n_tiles);
  const dim3 sum_grid((hist.max_blocks + kThreads - 1) / kThreads, samples);
  predict_sum_kernel<<<sum_grid, kThreads, 0, stream>>>(params, hist, cache, g, scores);
  return cudaGetLastError();
}

cudaError_t select_blocks_cuda(const float* scores, const HistoryState& hist, int batch,
                               int num_kv_heads, const Geometry& g, int k_blocks,
                               uint8_t* block_flags, cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(block_flags, 0,
                                  size_t(hist.max_batch) * num_kv_heads * hist.max_blocks, stream);
  if (e != cudaSuccess || batch <= 0) return e;
  select_kernel<<<batch * hist.num_q_heads, kThreads, 0, stream>>>(scores, hist, num_kv_heads, g,
                                                                   k_blocks, block_flags);
  return cudaGetLastError();
}

cudaError_t build_selection_cuda(const PagedKV& kv, const uint8_t* block_flags, int max_blocks,
                                 const Geometry& g, const int32_t* block_slot,
                                 const tactic::Selection& sel, unsigned long long* counters,
                                 cudaStream_t stream) {
  if (kv.batch <= 0) return cudaSuccess;
  build_selection_kernel<<<kv.batch * kv.num_kv_heads, kThreads, 0, stream>>>(
      kv, block_flags, max_blocks, g, block_slot, sel, counters);
  return cudaGetLastError();
}

size_t row_scratch_bytes(int max_batch, int num_q_heads, int max_tokens) {
  return size_t(max_batch) * num_q_heads * size_t(max_tokens) * sizeof(float);
}

cudaError_t append_row_cuda(const bf16* q, int num_q_heads, const PagedKV& view,
                            const int32_t* token_ids, int ids_stride, const int32_t* kv_lens,
                            int batch, int num_kv_heads, float scale, const Geometry& g,
                            const HistoryState& hist, void* scratch, size_t scratch_bytes,
                            cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  const int group = num_q_heads / num_kv_heads;
  if (group > kMaxGroup || (view.head_dim != 64 && view.head_dim != 128))
    return cudaErrorInvalidValue;
  const bool sub = token_ids != nullptr;
  // List length bound: the sub-request stride, or the longest context the history holds.
  const int max_tokens = sub ? ids_stride : hist.max_blocks * g.block;
  if (scratch_bytes < row_scratch_bytes(batch, num_q_heads, max_tokens))
    return cudaErrorInvalidValue;
  float* scores = static_cast<float*>(scratch);
  const dim3 grid(batch * num_kv_heads, (max_tokens + kRowChunk - 1) / kRowChunk);
  row_scores_kernel<<<grid, kThreads, size_t(group) * view.head_dim * sizeof(float), stream>>>(
      q, num_q_heads, view, sub, num_kv_heads, scale, scores, max_tokens);
  row_pool_kernel<<<batch * num_q_heads, kThreads, 0, stream>>>(num_q_heads, view, sub, token_ids,
                                                                ids_stride, kv_lens, num_kv_heads,
                                                                scores, max_tokens, g, hist);
  advance_history_kernel<<<(batch + 127) / 128, 128, 0, stream>>>(hist, kv_lens, batch);
  return cudaGetLastError();
}

int default_copy_ctas() { return 64; }

cudaError_t make_resident_cuda(const PagedKV& host_kv, const uint8_t* block_flags,
                               const Geometry& g, int len_delta, bool skip_tail,
                               const int32_t* copied_lens, const BlockCache& cache,
                               unsigned long long* counters, unsigned int* done, int copy_ctas,
                               cudaStream_t stream) {
  if (host_kv.batch <= 0) return cudaSuccess;
  const size_t smem = size_t(cache.slots_per_head) * sizeof(int);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;
  plan_resident_kernel<<<host_kv.batch * cache.num_kv_heads, kThreads, smem, stream>>>(
      host_kv.seq_lens, block_flags, g, len_delta, skip_tail, copied_lens, cache, counters);
  copy_blocks_kernel<<<copy_ctas, kThreads, 0, stream>>>(host_kv, g, cache, counters, done);
  return cudaGetLastError();
}

cudaError_t reset_block_cache_cuda(const BlockCache& cache, int batch, cudaStream_t stream) {
  const size_t heads = size_t(batch) * cache.num_kv_heads;
  cudaError_t e =
      cudaMemsetAsync(cache.block_slot, 0xff, heads * cache.max_blocks * sizeof(int32_t), stream);
  if (e != cudaSuccess) return e;
  e = cudaMemsetAsync(cache.slot_block, 0xff, heads * cache.slots_per_head * sizeof(int32_t),
                      stream);
  if (e != cudaSuccess) return e;
  return cudaMemsetAsync(cache.copy_count, 0, heads * sizeof(int32_t), stream);
}

cudaError_t prefetch_probe_cuda(const unsigned int* done, unsigned int expected,
                                unsigned long long* counter, cudaStream_t stream) {
  probe_kernel<<<1, 1, 0, stream>>>(done, expected, counter);
  return cudaGetLastError();
}

}  // namespace kvs::kernels::attnpred
