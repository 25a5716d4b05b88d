// CUDA side of AttentionPredictor (attnpred.h).
//
//   cnn        one CTA per (input, 64-column tile) takes the rows in bands of up to 3 conv2
//              rows, two bands per pass: their input rows are loaded together into
//              registers, stored as fp16 in shared memory, convolved by conv1 on the fp16
//              tensor cores (one k16 step over the 9 taps, both N tiles per A fragment) into
//              relu(conv1) rows in shared memory, then by conv2 (one k16 step per tap, A
//              fragments by ldmatrix, 2 of the 4 N tiles per warp), and each position's conv3
//              projection s is summed from the two warp groups' shares in a fixed order.
//   predict    the same bands over the history, but incremental (CnnCache): the 4 edge rows
//              and the rows that became interior since the last prediction (one per step
//              when it predicts every step), plus fix-up CTAs that recompute the
//              stored rows' columns next to a moved slice end; then a sum kernel adds the H
//              rows' s per column (and commits the cache's count and end).
//   select     one CTA per (sequence, query head): 4-pass 8-bit radix select of the k-th
//              largest score (one block scan per pass finds the digit), then ties taken lowest
//              index first (one block scan over per-thread runs), flags OR-ed per kv head
//              (plain stores of 1: the group's heads may race, all write 1).
//   sparse     GPU-resident decode's sparse step: CTAs of (sequence, kv head) rank the
//              flagged blocks from the flags themselves, attend their share through the shared
//              tile loop, and keep each (head, block) largest score; a merge kernel per
//              (sequence, query head) combines the states and writes the history row.
//   selection  (offload) parts of 256 blocks per (sequence, kv head), a block per thread: the
//              tokens before the part by one reduction over the flags, attended-token counts,
//              one block scan, scatter of token ids and rows into the sub-request page table.
//   row        scores q.k for the group's query heads, each K row read once per group: on
//              the bf16 tensor cores (the group's heads as M rows, 32 keys of a warp in
//              flight at once) for keys in device memory, by 16-byte lanes per key for mapped
//              host memory; per-chunk softmax partials; then one CTA per (sequence, query
//              head, 1024-position chunk): log-sum-exp from the partials and the chunk's
//              max-pool by a warp segmented max + one atomicMax per block run. A full row
//              from device memory (blocks of 8-32) keeps only each block's largest score, and
//              the pool is exp(block max - lse) (128K: full row 142 -> 116-119 us, H100)
//   resident   plan (one CTA per (sequence, kv head), runs of slots and blocks per thread: free
//              slots, assign missing blocks) and a copy kernel with one warp per (head, list
//              entry) reading mapped pinned host memory: the block list never leaves the GPU,
//              so no host sync is needed to issue the copies.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cub/cub.cuh>
#include <stdexcept>
#include <string>

#include "kernels/attnpred/attnpred.h"
#include "kernels/common/attend_tiles.cuh"
#include "kernels/common/e4m3.h"
#include "kernels/common/float_key.cuh"
#include "kernels/common/int_rows.h"
#include "kernels/common/launch.cuh"
#include "kernels/common/ptx.cuh"

namespace kvs::kernels::attnpred {
namespace {

using bf = __nv_bfloat16;

constexpr int kCnnThreads = 256;
constexpr int kTile = 64;  // output columns per CNN CTA
constexpr int kThreads = 256;
constexpr int kScoreChunk = 256;  // list positions per CTA of the row score kernel
constexpr int kRowChunk = 1024;   // list positions per CTA of the row pool kernel
constexpr int kSelThreads = 1024;
constexpr int kSelCached = 8;  // candidate scores per select thread kept in registers
constexpr int kMaxGroup = 8;

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

constexpr int kEdgeRows = 4;  // rows 0, 1, H-2, H-1 depend on the zero padding in time
constexpr int kFixRows = 8;   // stored rows per fix-up CTA
constexpr int kFixCols = 4;   // columns a fix-up recomputes at most: [old end - 2, new end)
constexpr int kMaxEndMove = kFixCols - 2;
constexpr int kTaps = 9;
constexpr int kMaxRows = 3;                   // conv2 rows per conv_rows call
constexpr double kFixedScale = 4294967296.0;  // 2^32: the time sum's fixed point
// fp16 relu(conv1) tiles hold 16 channels per position in a stride of 24 halves (48 bytes):
// the 8 rows of an ldmatrix phase (8 positions, 16 bytes each) then hit 8 different 16-byte
// bank groups.
constexpr int kC1Stride = 24;
static_assert(kCnnThreads == 256 && kTile == 64,
              "8 warps over a row's 4 M tiles x 4 N tiles of 16 x 8");
static_assert(kFixRows * kFixCols == 32, "a fix-up CTA is 2 M tiles x 4 N tiles");

// The CNN's fp32 biases and conv3 in shared memory; conv1's and conv2's weights are fp16 MMA
// B fragments in registers.
struct CnnWeights {
  float b1[kConv1Channels];
  float b2[kConv2Channels];
  float w3[kConv2Channels];
  float b3;
};

// conv2 N tiles (8 output channels each) one warp computes from each A fragment it reads.
// The A fragments are the predictor's largest shared-memory traffic, and each N tile costs 18
// registers of B fragments: 2 (80 registers, 3 CTAs per SM) measured 92.6 us cold at 128K
// against 97.8 for 1 (64 registers, 4 CTAs) and 118.5 for 4 (128 registers, 2 CTAs).
constexpr int kWarpNTiles = 2;
constexpr int kNGroups = 4 / kWarpNTiles;  // warps that split the N tiles of one M tile
static_assert(kWarpNTiles == 1 || kWarpNTiles == 2 || kWarpNTiles == 4, "N tiles per warp");

// The B fragments of one conv2 N tile and lane, as CnnCache::frags stores them.
struct PackedFrags {
  uint32_t w1[2][2];      // conv1, N tiles 0 and 1 (channels 0-7, 8-15): k = tap (9, padded)
  uint32_t w2[kTaps][2];  // conv2, one N tile (8 output channels): k = input channel
};

// A thread's B fragments: conv1's, and conv2's of N tiles ng * kWarpNTiles + j, ng = the
// warp's index % kNGroups.
struct CnnFrags {
  uint32_t w1[2][2];
  uint32_t w2[kWarpNTiles][kTaps][2];
};

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Lane `lane`'s B fragments of conv1 and of conv2's N tile nt2, from the parameters.
__device__ __forceinline__ void make_frags(const float* __restrict__ params, int lane, int nt2,
                                           PackedFrags& f) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const float* w1 = params + kParamW1 + (nt * 8 + g) * 9;  // [tap] of channel nt * 8 + g
    f.w1[nt][0] = pack_half2(w1[2 * t], w1[2 * t + 1]);
    f.w1[nt][1] = pack_half2(t == 0 ? w1[8] : 0.f, 0.f);
  }
  const float* w2 = params + kParamW2 + (nt2 * 8 + g) * kConv1Channels * 9;  // [ci][tap]
#pragma unroll
  for (int tap = 0; tap < kTaps; ++tap) {
    f.w2[tap][0] = pack_half2(w2[(2 * t) * 9 + tap], w2[(2 * t + 1) * 9 + tap]);
    f.w2[tap][1] = pack_half2(w2[(2 * t + 8) * 9 + tap], w2[(2 * t + 9) * 9 + tap]);
  }
}

// CnnCache::frags: every (conv2 N tile, lane)'s PackedFrags as 8-byte words, word i of an N
// tile's 32 lanes contiguous ([N tile][word][lane]), so a thread loads its own with 8-byte
// loads instead of gathering 78 scattered parameters, and a warp's load of word i is one
// 256-byte run. (Contiguous per lane, 88 bytes apart, the loads were 73 % of the rows kernel's
// L1 sectors at 128K on an H200: ncu, docs/gpu.md.)
constexpr int kFragWords = sizeof(PackedFrags) / 4;
static_assert(kFragWords % 2 == 0 && 4 * 32 * kFragWords == kCnnFragWords, "frags layout");

__global__ void pack_frags_kernel(const float* __restrict__ params, uint32_t* frags) {
  PackedFrags f;
  const int lane = threadIdx.x % 32, nt2 = threadIdx.x / 32;
  make_frags(params, lane, nt2, f);
  const uint2* w = reinterpret_cast<const uint2*>(&f);
  uint2* dst = reinterpret_cast<uint2*>(frags);
  for (int i = 0; i < kFragWords / 2; ++i) dst[(nt2 * (kFragWords / 2) + i) * 32 + lane] = w[i];
}

// Every thread calls this: the shared parameters, and the thread's B fragments (from the
// packed copy when there is one).
__device__ __forceinline__ void load_weights(const float* __restrict__ params,
                                             const uint32_t* __restrict__ frags, CnnWeights& cw,
                                             CnnFrags& f) {
  for (int i = threadIdx.x; i < kConv1Channels; i += blockDim.x) cw.b1[i] = params[kParamB1 + i];
  for (int i = threadIdx.x; i < kConv2Channels; i += blockDim.x) {
    cw.b2[i] = params[kParamB2 + i];
    cw.w3[i] = params[kParamW3 + i];
  }
  if (threadIdx.x == 0) cw.b3 = params[kParamB3];
  const int lane = threadIdx.x & 31, ng = threadIdx.x / 32 % kNGroups;
#pragma unroll
  for (int j = 0; j < kWarpNTiles; ++j) {
    const int nt2 = ng * kWarpNTiles + j;
    PackedFrags p;
    if (frags) {
      const uint2* src = reinterpret_cast<const uint2*>(frags) + nt2 * (kFragWords / 2) * 32 + lane;
      uint2* dst = reinterpret_cast<uint2*>(&p);
#pragma unroll
      for (int i = j ? 2 : 0; i < kFragWords / 2; ++i) dst[i] = src[i * 32];  // w1: from j = 0
    } else {
      make_frags(params, lane, nt2, p);
    }
    if (j == 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) f.w1[i / 2][i % 2] = p.w1[i / 2][i % 2];
    }
#pragma unroll
    for (int tap = 0; tap < kTaps; ++tap) {
      f.w2[j][tap][0] = p.w2[tap][0];
      f.w2[j][tap][1] = p.w2[tap][1];
    }
  }
}

__device__ __forceinline__ float relu(float x) { return x > 0.f ? x : 0.f; }

// One warp: relu(conv1) of 16 positions x the 16 channels (N tiles 0 and 1, one A fragment
// for both) on the tensor cores, one k16 step (k = tap dy * 3 + dx, taps 9-15 zero).
// x(m, dy, dx): the fp16 input of position m's tap (m in 0..15). keep(m): whether position m is
// inside the rows and the slice (else its value is conv2's zero padding, not relu(bias)).
// store(m, nt, word): the fp16 pair of channels nt * 8 + 2t, + 1 of position m.
template <class X, class Keep, class Store>
__device__ __forceinline__ void conv1_tile(const CnnWeights& cw, const CnnFrags& f, X x, Keep keep,
                                           Store store) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int k0 = 2 * t, k1 = 2 * t + 1;  // this lane's taps (< 9); tap 8 only for t = 0
  auto pair = [](__half lo, __half hi) {
    const __half2 v = __halves2half2(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  };
  const __half zero = __float2half_rn(0.f);
  const uint32_t a[4] = {
      pair(x(g, k0 / 3, k0 % 3), x(g, k1 / 3, k1 % 3)),
      pair(x(g + 8, k0 / 3, k0 % 3), x(g + 8, k1 / 3, k1 % 3)),
      pair(t == 0 ? x(g, 2, 2) : zero, zero),
      pair(t == 0 ? x(g + 8, 2, 2) : zero, zero),
  };
  const bool keep0 = keep(g), keep1 = keep(g + 8);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const float b0 = cw.b1[nt * 8 + 2 * t], b1 = cw.b1[nt * 8 + 2 * t + 1];
    float acc[4] = {b0, b1, b0, b1};
    ptx::mma_f16_16816(acc, a, f.w1[nt], acc);
    store(g, nt, keep0 ? pack_half2(relu(acc[0]), relu(acc[1])) : 0u);
    store(g + 8, nt, keep1 ? pack_half2(relu(acc[2]), relu(acc[3])) : 0u);
  }
}

// One warp: conv2 of 16 positions x the warp's kWarpNTiles N tiles of 8 output channels on
// the tensor cores, one k16 step per tap (k = input channel). a(dy, dx): this lane's ldmatrix
// row at tap (dy, dx), the 8 fp16 relu(conv1) channels (lane / 16) * 8 .. + 7 of position
// lane % 16 (16-byte aligned), so that one ldmatrix.x4 gives the A fragment (positions g,
// g + 8 x channel pairs 2t, 2t + 8) for all the warp's N tiles. Then each position's share of
// s from the warp's channels, sum_c w3[c] relu(conv2[c]) over its N tiles (added in a lane
// before the quad's shuffles, which then run once for all of them), written to
// part[ng][m0 + position], ng = the warp's group of N tiles.
template <class A>
__device__ __forceinline__ void conv2_tile(const CnnWeights& cw, const CnnFrags& f, A a,
                                           float* part, int part_stride, int m0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int ng = threadIdx.x / 32 % kNGroups, nt0 = ng * kWarpNTiles;
  float acc[kWarpNTiles][4];
#pragma unroll
  for (int j = 0; j < kWarpNTiles; ++j) {
    const int n0 = (nt0 + j) * 8 + 2 * t;
    acc[j][0] = acc[j][2] = cw.b2[n0];
    acc[j][1] = acc[j][3] = cw.b2[n0 + 1];
  }
#pragma unroll
  for (int tap = 0; tap < kTaps; ++tap) {
    uint32_t frag[4];
    ptx::ldmatrix_x4(frag, ptx::smem_addr(a(tap / 3, tap % 3)));
#pragma unroll
    for (int j = 0; j < kWarpNTiles; ++j) ptx::mma_f16_16816(acc[j], frag, f.w2[j][tap], acc[j]);
  }
  float v0 = 0.f, v1 = 0.f;
#pragma unroll
  for (int j = 0; j < kWarpNTiles; ++j) {
    const int n0 = (nt0 + j) * 8 + 2 * t;
    v0 += relu(acc[j][0]) * cw.w3[n0] + relu(acc[j][1]) * cw.w3[n0 + 1];
    v1 += relu(acc[j][2]) * cw.w3[n0] + relu(acc[j][3]) * cw.w3[n0 + 1];
  }
  v0 += __shfl_xor_sync(0xffffffffu, v0, 1);
  v1 += __shfl_xor_sync(0xffffffffu, v1, 1);
  v0 += __shfl_xor_sync(0xffffffffu, v0, 2);
  v1 += __shfl_xor_sync(0xffffffffu, v1, 2);
  if (t == 0) {
    part[ng * part_stride + m0 + g] = v0;
    part[ng * part_stride + m0 + g + 8] = v1;
  }
}

// s of one position from the N-tile groups' shares, in a fixed order.
__device__ __forceinline__ float sum_parts(const float* part, int stride, int p) {
  float s = part[p];
#pragma unroll
  for (int i = 1; i < kNGroups; ++i) s += part[i * stride + p];
  return s;
}

constexpr int kC1Tiles = (kTile + 2 + 15) / 16;  // conv1 M tiles of a band row (66 positions)
constexpr int kXinW = kC1Tiles * 16 + 2;         // input columns the conv1 tiles read

// Two bands of at most kMaxRows conv2 rows each, computed in one pass.
struct BandSmem {
  __half xin[2][kMaxRows + 4][kXinW];  // fp16 input rows ra-2 .. rb+1; columns from x0 - 2
  __align__(16) __half c1[2][kMaxRows + 2][kTile + 2][kC1Stride];  // relu(conv1) ra-1 .. rb
  float part[2][kMaxRows][kNGroups][kTile];                        // s shares of the N-tile groups
};

constexpr int kFixC1 = (kFixRows + 2) * (kFixCols + 2);  // conv1 positions of a fix-up
struct FixSmem {
  __half xin[kFixRows + 4][kFixCols + 4];
  __align__(16) __half c1[kFixRows + 2][kFixCols + 2][kC1Stride];
  float part[kNGroups][kFixRows * kFixCols];
};

// The fp32 inputs of conv_rows' two bands of conv2 rows [ra0, rb0) and [ra1, rb1) over the
// columns [x0, x0 + kTile) of one CNN input of H rows and W columns (row(r): the row's column
// 0, or nullptr for a row of zeros): rows ra - 2 .. rb + 1 of each band, columns x0 - 2 ..,
// zero outside the input. Warp w holds the bands' rows w, w + 8, ... (band 0's first), its
// lanes the row's kXinW columns, so a row's pointer is worked out once per warp, not per
// element: the per-element form (a division by kXinW and the row's ring slot for each of a
// thread's values) was 15 % of the rows kernel's instructions (ncu, docs/gpu.md). All are
// requested before any is used: the CTA waits for one round trip, and a caller can issue its
// own loads (the weights) while these are in flight.
constexpr int kBandRowsPerWarp = (2 * (kMaxRows + 4) + kCnnThreads / 32 - 1) / (kCnnThreads / 32);
constexpr int kBandColsPerLane = (kXinW + 31) / 32;
struct BandInputs {
  float v[kBandRowsPerWarp][kBandColsPerLane];
};

__device__ __forceinline__ int band_rows(int ra, int rb) { return rb > ra ? rb - ra + 4 : 0; }

// Band row k of this warp as (band q, local row lr), or false past the bands' rows.
__device__ __forceinline__ bool band_row(int k, int ra0, int rb0, int ra1, int rb1, int& q,
                                         int& lr) {
  const int R = threadIdx.x / 32 + k * (kCnnThreads / 32), n0 = band_rows(ra0, rb0);
  q = R >= n0;
  lr = q ? R - n0 : R;
  return R < n0 + band_rows(ra1, rb1);
}

template <class Row>
__device__ __forceinline__ BandInputs load_band_inputs(Row row, int H, int W, int x0, int ra0,
                                                       int rb0, int ra1, int rb1) {
  const int lane = threadIdx.x & 31;
  BandInputs in;
#pragma unroll
  for (int k = 0; k < kBandRowsPerWarp; ++k) {
    int q, lr;
    const bool any = band_row(k, ra0, rb0, ra1, rb1, q, lr);
    const int r = (q ? ra1 : ra0) - 2 + lr;
    const float* src = any && r >= 0 && r < H ? row(r) : nullptr;
#pragma unroll
    for (int u = 0; u < kBandColsPerLane; ++u) {
      const int e = lane + 32 * u, c = x0 - 2 + e;
      in.v[k][u] = src && e < kXinW && c >= 0 && c < W ? __ldg(src + c) : 0.f;
    }
  }
  return in;
}

// s of the conv2 rows [ra0, rb0) and [ra1, rb1) (each at most kMaxRows, ascending, the second
// possibly empty) over the columns [x0, x0 + kTile) of one CNN input of H rows and W columns,
// from `in` = load_band_inputs of the same arguments. sink(r, x, s) is called by thread x - x0
// for every x < W, rows in order. Both bands are convolved together: four barriers per call.
// Every thread of the CTA calls this.
template <class Sink>
__device__ __forceinline__ void conv_rows(const CnnWeights& cw, const CnnFrags& f, BandSmem& sm,
                                          const BandInputs& in, int H, int W, int x0, int ra0,
                                          int rb0, int ra1, int rb1, Sink sink) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31;
  const int t = lane & 3;
#pragma unroll
  for (int k = 0; k < kBandRowsPerWarp; ++k) {
    int q, lr;
    if (!band_row(k, ra0, rb0, ra1, rb1, q, lr)) continue;
#pragma unroll
    for (int u = 0; u < kBandColsPerLane; ++u)
      if (lane + 32 * u < kXinW) sm.xin[q][lr][lane + 32 * u] = __float2half_rn(in.v[k][u]);
  }
  __syncthreads();
  // relu(conv1) rows ra-1 .. rb (local lr), positions j = column x0 - 1 + j: task = (lr, M
  // tile), both N tiles.
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int ra = q ? ra1 : ra0, nr = q ? rb1 - ra1 : rb0 - ra0;
    if (nr <= 0) continue;
    for (int task = warp; task < (nr + 2) * kC1Tiles; task += kCnnThreads / 32) {
      const int mt = task % kC1Tiles, lr = task / kC1Tiles;
      const int r = ra - 1 + lr, m0 = mt * 16;
      conv1_tile(
          cw, f, [&](int m, int dy, int dx) { return sm.xin[q][lr + dy][m0 + m + dx]; },
          [&](int m) {
            const int c = x0 - 1 + m0 + m;
            return r >= 0 && r < H && c >= 0 && c < W;
          },
          [&](int m, int nt, uint32_t word) {
            if (m0 + m < kTile + 2)
              *reinterpret_cast<uint32_t*>(&sm.c1[q][lr][m0 + m][nt * 8 + 2 * t]) = word;
          });
    }
  }
  __syncthreads();
  {  // conv2 rows of both bands: task = (row, M tile), a group of kNGroups warps each
    const int nr0 = max(0, rb0 - ra0), tasks = (nr0 + max(0, rb1 - ra1)) * (kTile / 16);
    for (int task = warp / kNGroups; task < tasks; task += kCnnThreads / 32 / kNGroups) {
      const int rr = task / (kTile / 16), m0 = task % (kTile / 16) * 16;
      const int q = rr >= nr0, lr = q ? rr - nr0 : rr;  // conv2 row from c1 rows lr .. lr + 2
      conv2_tile(
          cw, f,
          [&](int dy, int dx) {
            return &sm.c1[q][lr + dy][m0 + (lane & 15) + dx][(lane >> 4) * 8];
          },
          &sm.part[q][lr][0][0], kTile, m0);
    }
  }
  __syncthreads();
  if (tid < kTile && x0 + tid < W) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int ra = q ? ra1 : ra0, nr = q ? rb1 - ra1 : rb0 - ra0;
      for (int lr = 0; lr < nr; ++lr)
        sink(ra + lr, x0 + tid, sum_parts(&sm.part[q][lr][0][0], kTile, tid));
    }
  }
  __syncthreads();  // shared memory free for the next call
}

// conv_rows over all H rows, two bands of kMaxRows at a time.
template <class Row, class Sink>
__device__ __forceinline__ void conv_all_rows(const CnnWeights& cw, const CnnFrags& f, BandSmem& sm,
                                              Row row, int H, int W, int x0, Sink sink) {
  for (int ra = 0; ra < H; ra += 2 * kMaxRows) {
    const int mid = min(H, ra + kMaxRows), end = min(H, mid + kMaxRows);
    conv_rows(cw, f, sm, load_band_inputs(row, H, W, x0, ra, mid, mid, end), H, W, x0, ra, mid, mid,
              end, sink);
  }
}

// s of conv2 rows [ra, rb) (at most kFixRows) x columns [xa, xb) (at most kFixCols) of one
// CNN input (as conv_rows, with the same per-position arithmetic); sink(r, x, s) once per
// position. Every thread calls this.
template <class Row, class Sink>
__device__ __forceinline__ void conv_points(const CnnWeights& cw, const CnnFrags& f, FixSmem& sm,
                                            Row row, int H, int W, int ra, int rb, int xa, int xb,
                                            Sink sink) {
  constexpr int IR = kFixRows + 4, IC = kFixCols + 4, CC = kFixCols + 2, P = kFixRows * kFixCols;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31, nr = rb - ra, nc = xb - xa;
  const int t = lane & 3;
  for (int i = tid; i < IR * IC; i += kCnnThreads) {  // inputs ra-2 .. rb+1, xa-2 .. xb+1
    const int lr = i / IC, lc = i % IC, r = ra - 2 + lr, c = xa - 2 + lc;
    const float* src = (r >= 0 && r < H && lr < nr + 4) ? row(r) : nullptr;
    sm.xin[lr][lc] = __float2half_rn((src && c >= 0 && c < W && lc < nc + 4) ? src[c] : 0.f);
  }
  __syncthreads();
  if (warp < 4) {  // relu(conv1) ra-1 .. rb x xa-1 .. xb: 4 M tiles, one per warp
    const int m0 = warp * 16;
    const __half zero = __float2half_rn(0.f);
    conv1_tile(
        cw, f,
        [&](int m, int dy, int dx) {
          const int p = m0 + m;
          return p < kFixC1 ? sm.xin[p / CC + dy][p % CC + dx] : zero;
        },
        [&](int m) {
          const int p = m0 + m, lr = p / CC, lc = p % CC, r = ra - 1 + lr, c = xa - 1 + lc;
          return p < kFixC1 && lr < nr + 2 && lc < nc + 2 && r >= 0 && r < H && c >= 0 && c < W;
        },
        [&](int m, int nt, uint32_t word) {
          const int p = m0 + m;
          if (p < kFixC1)
            *reinterpret_cast<uint32_t*>(&sm.c1[p / CC][p % CC][nt * 8 + 2 * t]) = word;
        });
  }
  __syncthreads();
  if (warp / kNGroups < P / 16) {  // P / 16 M tiles
    const int m0 = warp / kNGroups * 16, p = m0 + (lane & 15), lr = p / kFixCols;
    const int lc = p % kFixCols;
    conv2_tile(
        cw, f, [&](int dy, int dx) { return &sm.c1[lr + dy][lc + dx][(lane >> 4) * 8]; },
        &sm.part[0][0], P, m0);
  }
  __syncthreads();
  const int lr = tid / kFixCols, lc = tid % kFixCols;
  if (tid < P && lr < nr && lc < nc) sink(ra + lr, xa + lc, sum_parts(&sm.part[0][0], P, tid));
  __syncthreads();
}

// A row's s as a 64-bit multiple of 2^-32 (attnpred.h numerics: the exact time sum).
__device__ __forceinline__ long long fixed(float s) {
  return __double2ll_rn(double(s) * kFixedScale);
}

// y = b3 + (the fixed-point time sum) / H.
__device__ __forceinline__ float cnn_output(float b3, long long sum, int H) {
  return __fadd_rn(b3, __double2float_rn(__ddiv_rn(double(sum) / kFixedScale, double(H))));
}

__global__ void __launch_bounds__(kCnnThreads)
    cnn_dense_kernel(const float* __restrict__ params, const float* __restrict__ x, int H, int W,
                     float* __restrict__ y) {
  __shared__ CnnWeights cw;
  __shared__ BandSmem sm;
  CnnFrags f;
  const int n = blockIdx.y, x0 = blockIdx.x * kTile;
  load_weights(params, nullptr, cw, f);
  __syncthreads();
  long long sum = 0;  // thread x - x0's time sum
  conv_all_rows(
      cw, f, sm, [&](int r) { return x + (int64_t(n) * H + r) * W; }, H, W, x0,
      [&](int, int, float s) { sum += fixed(s); });
  if (threadIdx.x < kTile && x0 + threadIdx.x < W)
    y[int64_t(n) * W + x0 + threadIdx.x] = cnn_output(cw.b3, sum, H);
}

__device__ __forceinline__ int edge_index(int r, int H) { return r < 2 ? r : kEdgeRows - (H - r); }
__device__ __forceinline__ bool edge_row(int r, int H) { return r < 2 || r > H - 3; }

// The CNN input of history (b, h) = sample s: the candidate slice of its H logical rows, and
// where each row's s lives (edge rows: cache.edge; interior rows: cache.s at the row's slot).
// Built from the grid's (h, b) = (blockIdx.y, blockIdx.z), so that no CTA divides by the head
// count; the ring's start is one modulo (count - H and count are the same slot). Runtime
// divisions were most of the rows kernel's 184-instruction prologue a warp (docs/gpu.md).
struct PredictSample {
  HistoryState hist;
  CnnCache cache;
  int s, b, h, H, c0, W, count, slot0;  // slot0: the ring slot of logical row 0
  __device__ PredictSample(const HistoryState& hs, const CnnCache& cc, const Geometry& g)
      : hist(hs),
        cache(cc),
        s(int(blockIdx.z) * hs.num_heads + int(blockIdx.y)),
        b(int(blockIdx.z)),
        h(int(blockIdx.y)),
        H(hs.history),
        c0(g.candidate_begin()),
        W(g.candidate_end(hs.tokens[b]) - c0),
        count(hs.count[b]),
        slot0(count % H < 0 ? count % H + H : count % H) {}
  // Logical row r (0 <= r < H) as HistoryState::logical_row, without its division.
  __device__ const float* row(int r) const {
    return count - H + r < 0 ? nullptr : hist.slot(b, h, slot(r)) + c0;
  }
  // Ring slot of logical row r (-H <= r < H; r < 0: rows that have left the history since
  // the last prediction), also for the zero rows of a short history (slots not yet appended
  // to: their s describes a zero row).
  __device__ int slot(int r) const {
    const int i = slot0 + r;
    return i < 0 ? i + H : (i < H ? i : i - H);
  }
  // The stored s of logical row r's ring slot (what it held while interior).
  __device__ float* ring(int r) const {
    return cache.s + (int64_t(s) * H + slot(r)) * hist.max_blocks + c0;
  }
  __device__ float* s_of(int r) const {
    return edge_row(r, H)
               ? cache.edge + (int64_t(s) * kEdgeRows + edge_index(r, H)) * hist.max_blocks + c0
               : ring(r);
  }
  __device__ unsigned long long* sum() const {
    return reinterpret_cast<unsigned long long*>(cache.sum + int64_t(s) * hist.max_blocks + c0);
  }
};

// Grid (n_tiles + fix-up CTAs, Hq, batch): tiles compute rows, fix-up CTA f recomputes the
// stored rows [2 + f * kFixRows, ...) in the columns next to a moved slice end. The interior
// rows' fixed-point sum (cache.sum) is rewritten by a full recompute and otherwise adjusted by
// integer atomics (exact, so the order of the CTAs' updates does not matter).
// kSeveralRows: the form for predictions every few steps, whose bands are a loop of passes;
// without it a step with more than one row appended recomputes every row (predicting every
// step, the one pass has constant bounds: 10 us less at 128K on an H200 than the loop).
template <bool kSeveralRows>
__global__ void __launch_bounds__(kCnnThreads, 3)
    predict_rows_kernel(const float* __restrict__ params, HistoryState hist, CnnCache cache,
                        Geometry g, int n_tiles) {
  __shared__ CnnWeights cw;
  __shared__ union {
    BandSmem band;
    FixSmem fix;
  } sm;
  CnnFrags f;
  const PredictSample ps(hist, cache, g);
  const int H = ps.H, W = ps.W;
  if (W <= 0) return;
  const int seen = cache.count[ps.b], end = cache.end[ps.b], c1 = ps.c0 + W;
  // k rows appended since the last prediction make rows s0 = H-2-k .. H-3 interior and take
  // as many out; the other interior rows keep their s. The tiles recompute [first, H), k + 2
  // rows rounded up to whole bands, which must leave the edge rows 0 and 1 out.
  const int k = ps.count - seen, s0 = H - 2 - k;
  const int bands = kSeveralRows ? (k + 2 + kMaxRows - 1) / kMaxRows : 1;
  const int first = H - bands * kMaxRows;
  const bool incremental = H >= 5 && seen >= 0 && k >= 0 && (kSeveralRows || k <= 1) &&
                           first >= 2 && end <= c1 && c1 - end <= kMaxEndMove;
  auto row = [&](int r) { return ps.row(r); };
  if (blockIdx.x < n_tiles) {
    const int x0 = blockIdx.x * kTile;
    if (x0 >= W) return;
    if (!incremental) {
      load_weights(params, cache.frags, cw, f);
      __syncthreads();
      long long sum = 0;
      conv_all_rows(cw, f, sm.band, row, H, W, x0, [&](int r, int x, float v) {
        ps.s_of(r)[x] = v;
        if (!edge_row(r, H)) sum += fixed(v);
      });
      if (threadIdx.x < kTile && x0 + threadIdx.x < W) ps.sum()[x0 + threadIdx.x] = sum;
      return;
    }
    // Rows computed: the edge rows [0, 2) and [first, H) in bands of kMaxRows, two per pass,
    // [0, 2) with the last: every pass has bands of a constant number of rows, so conv_rows'
    // loops have constant trip counts. [first, H) holds the k rows that became interior
    // (s0 = H-2-k ..), the new edge rows and, rounding the bands up, a few rows that stayed
    // interior (recomputed to the same s; with k = 0, row H-3).
    // The first pass's loads are issued before any is used: its band inputs, the weights, and
    // what the sum loses: the s of the rows that left the interior (logical rows 2-k .. 1)
    // and the stored s of the recomputed rows [first, s0). Those are read before any store: a
    // row that became interior may take the ring slot of one that left.
    auto pass_inputs = [&](int i) {  // the pass starting at band i
      const int ra0 = i < bands ? first + i * kMaxRows : 0, rb0 = i < bands ? ra0 + kMaxRows : 2;
      const int ra1 = i + 1 < bands ? ra0 + kMaxRows : 0;
      const int rb1 = i + 1 < bands ? ra1 + kMaxRows : (i < bands ? 2 : 0);
      return load_band_inputs(row, H, W, x0, ra0, rb0, ra1, rb1);
    };
    BandInputs in = pass_inputs(0);
    const int x = x0 + threadIdx.x;
    if (threadIdx.x < kTile && x < W) {
      long long gone = 0;
      for (int r = 2 - k; r < 2; ++r) gone += fixed(ps.ring(r)[x]);
      for (int r = first; r < s0; ++r) gone += fixed(ps.ring(r)[x]);
      atomicAdd(ps.sum() + x, static_cast<unsigned long long>(-gone));
    }
    load_weights(params, cache.frags, cw, f);
    __syncthreads();
    auto store = [&](int r, int x, float v) {
      if (r >= first && r < H - 2)
        atomicAdd(ps.sum() + x, static_cast<unsigned long long>(fixed(v)));
      ps.s_of(r)[x] = v;
    };
    int i = 0;
    for (; i + 1 < bands; i += 2) {
      const int ra = first + i * kMaxRows;
      conv_rows(cw, f, sm.band, in, H, W, x0, ra, ra + kMaxRows, ra + kMaxRows, ra + 2 * kMaxRows,
                store);
      in = pass_inputs(i + 2);
    }
    if (i < bands) {
      const int ra = first + i * kMaxRows;
      conv_rows(cw, f, sm.band, in, H, W, x0, ra, ra + kMaxRows, 0, 2, store);
    } else {
      conv_rows(cw, f, sm.band, in, H, W, x0, 0, 2, 0, 0, store);
    }
    return;
  }
  if (!incremental || end == c1) return;
  // The interior rows that stay and are not recomputed: [2, first).
  const int ra = 2 + (blockIdx.x - n_tiles) * kFixRows, rb = min(ra + kFixRows, first);
  if (ra >= rb) return;
  load_weights(params, cache.frags, cw, f);
  __syncthreads();
  conv_points(cw, f, sm.fix, row, H, W, ra, rb, max(0, end - 2 - ps.c0), W,
              [&](int r, int x, float v) {
                float* dst = ps.s_of(r) + x;
                atomicAdd(ps.sum() + x, static_cast<unsigned long long>(fixed(v) - fixed(*dst)));
                *dst = v;
              });
}

// scores of sample (b, h) = b3 + (interior sum + the edge rows' fixed-point s) / H; commits
// the cache. It also zeroes the sums and stored s of the kMaxEndMove columns past the slice,
// which an incremental step may add to the slice: their stored rows and sum then agree.
__global__ void __launch_bounds__(kThreads)
    predict_sum_kernel(const float* __restrict__ params, HistoryState hist, CnnCache cache,
                       Geometry g, float* __restrict__ scores) {
  const PredictSample ps(hist, cache, g);
  if (blockIdx.x == 0 && ps.h == 0 && threadIdx.x == 0) {
    cache.count[ps.b] = ps.count;
    cache.end[ps.b] = ps.c0 + ps.W;
  }
  const int x = blockIdx.x * kThreads + threadIdx.x, H = ps.H;
  const int z0 = max(ps.W, 0);
  if (x >= z0 && x < z0 + kMaxEndMove && ps.c0 + x < hist.max_blocks) {
    ps.sum()[x] = 0;
    for (int slot = 0; slot < H; ++slot)
      cache.s[(int64_t(ps.s) * H + slot) * hist.max_blocks + ps.c0 + x] = 0.f;
    return;
  }
  if (x >= ps.W) return;
  long long sum = static_cast<long long>(ps.sum()[x]);
  for (int r = 0; r < min(2, H); ++r) sum += fixed(ps.s_of(r)[x]);
  for (int r = max(2, H - 2); r < H; ++r) sum += fixed(ps.s_of(r)[x]);
  scores[int64_t(ps.s) * hist.max_blocks + ps.c0 + x] =
      cnn_output(__ldg(params + kParamB3), sum, H);
}

__global__ void reset_cnn_cache_kernel(CnnCache cache, int batch) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < batch) cache.count[b] = -1;
}

// One CTA per (sequence, query head): the k-th largest key by a 4-pass 8-bit radix select
// (shared histogram, then one block scan over the bins from the top finds the digit), then the
// keys above it and the first `remaining` keys equal to it by index (a contiguous run per
// thread, one block scan of the runs' tie counts).
__global__ void __launch_bounds__(kSelThreads)
    select_kernel(const float* __restrict__ scores, HistoryState hist, int num_kv_heads, Geometry g,
                  int k, uint8_t* flags) {
  using Scan = cub::BlockScan<int, kSelThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int hist_bins[256];
  __shared__ unsigned s_prefix;
  __shared__ int s_remaining;
  const int s = blockIdx.x, tid = threadIdx.x;
  const int b = s / hist.num_heads, h = s % hist.num_heads;
  const int group = hist.num_heads / num_kv_heads;
  const int c0 = g.candidate_begin(), c1 = g.candidate_end(hist.tokens[b]);
  const int count = c1 - c0;
  if (count <= 0) return;
  const float* sc = scores + int64_t(s) * hist.max_blocks + c0;
  uint8_t* fl = flags + (int64_t(b) * num_kv_heads + h / group) * hist.max_blocks + c0;
  if (k >= count) {
    for (int j = tid; j < count; j += kSelThreads) fl[j] = 1;
    return;
  }
  if (k <= 0) return;
  // The first kSelCached keys of this thread (j = tid, tid + kSelThreads, ...) stay in
  // registers for the four passes; keys past them (contexts over 128K at block 16) are
  // reloaded each pass.
  unsigned cached[kSelCached];
#pragma unroll
  for (int i = 0; i < kSelCached; ++i) {
    const int j = tid + i * kSelThreads;
    cached[i] = j < count ? float_order_key(sc[j]) : 0u;
  }
  unsigned prefix = 0, mask = 0;
  int remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (tid < 256) hist_bins[tid] = 0;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kSelCached; ++i) {
      const unsigned key = cached[i];
      if (tid + i * kSelThreads < count && (key & mask) == prefix)
        atomicAdd(&hist_bins[(key >> shift) & 255u], 1);
    }
    for (int j = tid + kSelCached * kSelThreads; j < count; j += kSelThreads) {
      const unsigned key = float_order_key(sc[j]);
      if ((key & mask) == prefix) atomicAdd(&hist_bins[(key >> shift) & 255u], 1);
    }
    __syncthreads();
    // Thread i < 256 takes digit 255 - i: `above` keys have a larger digit.
    const int v = tid < 256 ? hist_bins[255 - tid] : 0;
    int above, total;
    Scan(scan).ExclusiveSum(v, above, total);
    if (tid < 256 && above < remaining && above + v >= remaining) {
      s_prefix = prefix | (unsigned(255 - tid) << shift);
      s_remaining = remaining - above;
    }
    __syncthreads();
    prefix = s_prefix;
    remaining = s_remaining;
    mask |= 255u << shift;
  }
  // prefix is the k-th largest key; `remaining` of the keys equal to it are taken, by index.
  const int per = (count + kSelThreads - 1) / kSelThreads;
  const int j0 = min(count, tid * per), j1 = min(count, j0 + per);
  int ties = 0;
  for (int j = j0; j < j1; ++j) ties += float_order_key(sc[j]) == prefix;
  int before, total;
  Scan(scan).ExclusiveSum(ties, before, total);
  for (int j = j0; j < j1; ++j) {
    const unsigned key = float_order_key(sc[j]);
    if (key > prefix) {
      fl[j] = 1;
    } else if (key == prefix) {
      if (before < remaining) fl[j] = 1;
      ++before;
    }
  }
}

// Tokens of block j that decode attends: all of them in the sink or when the block is flagged,
// else those in the recent window.
__device__ __forceinline__ int block_attended(const Geometry& g, int j, int n, bool flagged) {
  const int lo = j * g.block, hi = min(lo + g.block, n);
  if (lo >= n) return 0;
  if (lo < g.sink || flagged) return hi - lo;
  return max(0, hi - max(lo, n - g.recent));
}
__device__ __forceinline__ int block_attended(const Geometry& g, int j, int n, const uint8_t* fl) {
  return block_attended(g, j, n, j * g.block < n && j * g.block >= g.sink && fl[j] != 0);
}

// Grid (sequence x kv head, parts of kListBlocks blocks): thread t of part y owns block
// y * kListBlocks + t. A part finds where its tokens start by counting the attended tokens of
// every block before it (their flags, a block reduction), then one block scan places its own
// (ascending, as attended_token order). The parts of a list run side by side: one CTA per list
// walked 8 blocks per thread (128K: 17 us cold on an H200).
constexpr int kListBlocks = 256;
__global__ void __launch_bounds__(kListBlocks)
    build_selection_kernel(PagedKV kv, const uint8_t* __restrict__ flags, int max_blocks,
                           Geometry g, const int32_t* __restrict__ block_slot,
                           tactic::Selection sel, unsigned long long* counters) {
  using Scan = cub::BlockScan<int, kListBlocks>;
  using Reduce = cub::BlockReduce<int, kListBlocks>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  const int bh = blockIdx.x, tid = threadIdx.x;
  const int b = bh / kv.num_kv_heads, h = bh % kv.num_kv_heads;
  const int n = kv.seq_lens[b];
  const uint8_t* fl = flags + int64_t(bh) * max_blocks;
  const int nb = g.num_blocks(n), j0 = blockIdx.y * kListBlocks;
  if (j0 > 0 && j0 >= nb) return;  // part 0 also writes an empty list's count
  int before = 0;  // attended tokens of blocks [0, j0), this thread's share
#pragma unroll 8
  for (int j = tid; j < j0; j += kListBlocks) before += block_attended(g, j, n, fl);
  before = Reduce(tmp.reduce).Sum(before);  // valid in thread 0
  __shared__ int s_before;
  if (tid == 0) s_before = before;
  __syncthreads();  // s_before published, tmp free for the scan
  const int j = j0 + tid;
  const int mine = j < nb ? block_attended(g, j, n, fl) : 0;
  int p, total;
  Scan(tmp.scan).ExclusiveSum(mine, p, total);
  p += s_before;
  const int written = s_before + total;  // through this part
  int32_t* rows = sel.rows + int64_t(bh) * sel.max_tokens;
  int32_t* toks = sel.tokens + int64_t(bh) * sel.max_tokens;
  unsigned long long missing = 0;
  if (mine > 0 && p < sel.max_tokens) {
    const int hi = min(j * g.block + g.block, n), lo = hi - mine;
    const int slot = block_slot ? block_slot[int64_t(bh) * max_blocks + j] : 0;
    if (block_slot && slot < 0) missing += mine;
    // A run inside one page (the usual case: blocks no larger than pages) needs one page-table
    // load, not one per token, which the stores between them would serialize.
    const bool one_page = !block_slot && lo / kv.page_size == (hi - 1) / kv.page_size;
    const int64_t row0 = one_page ? kv.offset(b, lo, h) / kv.head_dim : 0;
    for (int t = lo; t < hi && p < sel.max_tokens; ++t, ++p) {
      toks[p] = t;
      rows[p] = block_slot ? max(slot, 0) * g.block + t % g.block
                : one_page ? int32_t(row0 + int64_t(t - lo) * kv.num_kv_heads)
                           : int32_t(kv.offset(b, t, h) / kv.head_dim);
    }
  }
  // The part holding the list's last block (part 0 for an empty list) writes its count.
  if (tid == 0 && (nb == 0 || (j0 <= nb - 1 && nb - 1 < j0 + kListBlocks))) {
    sel.counts[bh] = min(written, sel.max_tokens);
    if (counters) atomicAdd(counters, (unsigned long long)min(written, sel.max_tokens));
    if (counters && written > sel.max_tokens)
      atomicAdd(counters + 1, (unsigned long long)(written - sel.max_tokens));
  }
  if (counters && missing) atomicAdd(counters + 1, missing);
}

// Merges softmax partials (max, sum of exp(x - max)); an empty partial has max -inf.
__device__ __forceinline__ float2 merge_partial(float2 a, float2 b) {
  if (a.x == -INFINITY) return b;
  if (b.x == -INFINITY) return a;
  const float m = fmaxf(a.x, b.x);
  return make_float2(m, a.y * expf(a.x - m) + b.y * expf(b.x - m));
}

// The row scores' CTA (b, kv head h, chunk y) zeroes its share of the history slot the row goes
// to (row_pool_kernel's atomicMax needs a zeroed row, and row_pool_max_kernel leaves the
// columns past the row as they are; both run after the scores), and the first CTA the pool
// kernel's count of finished CTAs (finish_row).
__device__ __forceinline__ void zero_history_share(const HistoryState& hist, int b, int h, int g,
                                                   unsigned int* pool_done) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *pool_done = 0;
  const int per = (hist.max_blocks + gridDim.y - 1) / gridDim.y;
  const int j0 = blockIdx.y * per, j1 = min(hist.max_blocks, j0 + per);
  const int per_kv = g / hist.group;  // history heads of the kv head
  for (int j = 0; j < per_kv; ++j) {
    float* row = hist.slot(b, h * per_kv + j, hist.count[b] % hist.history);
    for (int c = j0 + threadIdx.x; c < j1; c += blockDim.x) row[c] = 0.f;
  }
}

// Adds score x to a running softmax partial (max, sum of exp(x - max)).
__device__ __forceinline__ void add_to_partial(float2& part, float x) {
  if (x > part.x) {
    part.y = part.y * expf(part.x - x) + 1.f;
    part.x = x;
  } else {
    part.y += expf(x - part.x);
  }
}

// Scores of the list positions [i0, i0 + kScoreChunk) of (b, kv head h) for its query heads,
// and per query head the chunk's softmax partial, on the bf16 tensor cores (the form for keys
// in device memory). Warp w takes positions i0 + 32w .. + 31 as 4 N tiles of 8 keys; lane
// (g = lane / 4, t = lane % 4) loads key g of each tile as the 16-byte pieces t, t + 4, ..., so
// a key is read by 4 lanes, 64 contiguous bytes per load, and all of the warp's 32 keys are in
// flight at once. The head dimension is permuted the same way in the query A fragments and
// the key B fragments: piece p's words 0-3 are k-step 2 (p / 4) + (w / 2), pairs 2t (even
// w) and 2t + 8 (odd w), so each product q . k still sums every dimension once. The group's
// query heads are the M rows (rows >= group and 8-15 zero). kPooled (full rows, blocks of
// pool_block = 8, 16 or 32 tokens): the scores are not written, only each block's largest
// (row_pool_max_kernel pools those); a form that wrote both took 115.6 us cold at 128K
// against 104.1 (H100), the per-token form 103.9.
template <int D, bool kPooled>
__global__ void __launch_bounds__(kThreads, 2)
    row_scores_mma_kernel(const bf16* __restrict__ q_raw, int num_q_heads, PagedKV view, bool sub,
                          int num_kv_heads, float scale, float* scores, int max_tokens,
                          float2* __restrict__ partials, int num_chunks, HistoryState hist,
                          int pool_block, unsigned int* pool_done) {
  constexpr int kWarps = kThreads / 32, kTiles = kScoreChunk / kWarps / 8;  // N tiles per warp
  constexpr int kPieces = D / 32;  // 16-byte pieces a lane loads per key
  static_assert(kScoreChunk == kWarps * 32 && kTiles == 4, "a warp takes 32 keys");
  __shared__ float2 warp_part[2][kWarps][kMaxGroup];  // by chunk parity: one barrier a chunk
  const int bh = blockIdx.x, tid = threadIdx.x;
  const int b = bh / num_kv_heads, h = bh % num_kv_heads;
  const int group = num_q_heads / num_kv_heads;
  zero_history_share(hist, b, h, group, pool_done);
  const int seq = sub ? bh : b, kvh = sub ? 0 : h;
  const int n = view.seq_lens[seq];
  if (int(blockIdx.y) * kScoreChunk >= n) return;
  const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  // The chunks blockIdx.y, + gridDim.y, ... (a full row's grid is one wave of CTAs that walk
  // its chunks). The key rows stream through the warp's registers: as soon as a tile's
  // products are taken, the next chunk's rows of that tile are requested into its registers,
  // so a warp always has about a chunk of rows in flight instead of none while it computes
  // and waits at the chunk's barrier. The page-table entries of the chunk after that are
  // requested once those rows are, a chunk ahead of their use.
  int64_t off[kTiles];
  auto key_offsets = [&](int i0) {
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt)
      off[nt] = view.offset(seq, min(i0 + warp * 32 + nt * 8 + g, n - 1), kvh);
  };
  key_offsets(blockIdx.y * kScoreChunk);
  uint4 qp[kPieces];
  {
    const bf16* q = q_raw + (int64_t(b) * num_q_heads + h * group + min(g, group - 1)) * D;
#pragma unroll
    for (int p = 0; p < kPieces; ++p)
      qp[p] = g < group ? reinterpret_cast<const uint4*>(q)[t + 4 * p] : make_uint4(0, 0, 0, 0);
  }
  uint4 kp[kTiles][kPieces];
  auto load_tile = [&](int nt) {
#pragma unroll
    for (int p = 0; p < kPieces; ++p)
      kp[nt][p] = reinterpret_cast<const uint4*>(view.k + off[nt])[t + 4 * p];
  };
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) load_tile(nt);
  const int stride = int(gridDim.y);
  if ((int(blockIdx.y) + stride) * kScoreChunk < n)
    key_offsets((int(blockIdx.y) + stride) * kScoreChunk);
  int parity = 0;
  for (int chunk = blockIdx.y; chunk * kScoreChunk < n; chunk += stride, parity ^= 1) {
    const int key0 = chunk * kScoreChunk + warp * 32;  // the warp's first position
    const bool more = (chunk + stride) * kScoreChunk < n;
    float2 part = make_float2(-INFINITY, 0.f);  // head g's partial over this lane's keys
    float tile_max[kTiles];                     // head g's largest score in each tile
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int p = 0; p < kPieces; ++p) {
        const uint32_t a0[4] = {qp[p].x, 0u, qp[p].y, 0u}, a1[4] = {qp[p].z, 0u, qp[p].w, 0u};
        const uint32_t b0[2] = {kp[nt][p].x, kp[nt][p].y}, b1[2] = {kp[nt][p].z, kp[nt][p].w};
        ptx::mma_bf16_16816(acc, a0, b0, acc);
        ptx::mma_bf16_16816(acc, a1, b1, acc);
      }
      if (more) load_tile(nt);  // the next chunk's rows of this tile
      tile_max[nt] = -INFINITY;
      if (g < group) {  // acc[0], acc[1]: head g x keys 2t, 2t + 1 of the tile
        float* row = scores + (int64_t(b) * num_q_heads + h * group + g) * max_tokens;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = key0 + nt * 8 + 2 * t + e;
          if (i < n) {
            const float x = acc[e] * scale;
            if (!kPooled) row[i] = x;
            if (kPooled) tile_max[nt] = fmaxf(tile_max[nt], x);
            add_to_partial(part, x);
          }
        }
      }
    }
    if ((chunk + 2 * stride) * kScoreChunk < n) key_offsets((chunk + 2 * stride) * kScoreChunk);
    if (kPooled) {
      // Pooled output (full rows, keys = tokens, pool_block 8, 16 or 32): the warp's 32
      // tokens are whole blocks, so each block's largest score is reduced here, over the
      // tiles and the 4 lanes of a key group, and stored once: scores is [rows,
      // hist.max_blocks] of block maxima, not the scores themselves (row_pool_max_kernel).
#pragma unroll
      for (int nt = 0; nt < kTiles; ++nt) {
        tile_max[nt] = fmaxf(tile_max[nt], __shfl_xor_sync(0xffffffffu, tile_max[nt], 1));
        tile_max[nt] = fmaxf(tile_max[nt], __shfl_xor_sync(0xffffffffu, tile_max[nt], 2));
      }
      if (t == 0 && g < group) {
        float* out = scores + (int64_t(b) * num_q_heads + h * group + g) * hist.max_blocks;
        const int per_tile = 8, tiles_per_block = pool_block / per_tile;
#pragma unroll
        for (int nt = 0; nt < kTiles; ++nt) {
          if (nt % tiles_per_block != 0 || key0 + nt * per_tile >= n) continue;
          float m = tile_max[nt];
#pragma unroll
          for (int u = 1; u < kTiles; ++u)
            if (u < tiles_per_block && nt + u < kTiles) m = fmaxf(m, tile_max[nt + u]);
          out[(key0 + nt * per_tile) / pool_block] = m;
        }
      }
    }
    part = merge_partial(part, make_float2(__shfl_xor_sync(0xffffffffu, part.x, 1),
                                           __shfl_xor_sync(0xffffffffu, part.y, 1)));
    part = merge_partial(part, make_float2(__shfl_xor_sync(0xffffffffu, part.x, 2),
                                           __shfl_xor_sync(0xffffffffu, part.y, 2)));
    if (t == 0 && g < group) warp_part[parity][warp][g] = part;
    __syncthreads();  // also orders this parity's reads before its reuse two chunks on
    if (tid < group) {
      float2 pt = make_float2(-INFINITY, 0.f);
      for (int w = 0; w < kWarps; ++w) pt = merge_partial(pt, warp_part[parity][w][tid]);
      partials[(int64_t(b) * num_q_heads + h * group + tid) * num_chunks + chunk] = pt;
    }
  }
}

// Scores of the list positions [i0, i0 + kScoreChunk) of (b, kv head h) for its query heads,
// and per query head the chunk's softmax partial, by CUDA-core dot products (the form for keys
// in mapped host memory, which it reads far better). A key row is read by D / 8 lanes (16 bytes
// each, coalesced), 4 keys per lane group in flight; each lane keeps its 8 elements of the
// group's queries in registers, and the dot products are reduced across the lane group.
template <int D>
__global__ void __launch_bounds__(kThreads)
    row_scores_kernel(const bf16* __restrict__ q_raw, int num_q_heads, PagedKV view, bool sub,
                      int num_kv_heads, float scale, float* scores, int max_tokens,
                      float2* __restrict__ partials, int num_chunks, HistoryState hist,
                      int /*pool_block: per-token scores only*/, unsigned int* pool_done) {
  constexpr int kLanes = D / 8, kGroups = 32 / kLanes;  // lanes per key, keys per warp step
  constexpr int kWarps = kThreads / 32, kBatch = 4;
  constexpr int kSteps = kScoreChunk / (kWarps * kGroups);  // key steps per warp
  static_assert(kSteps % kBatch == 0, "whole batches");
  __shared__ float2 warp_part[kWarps][kGroups][kMaxGroup];
  const int bh = blockIdx.x, tid = threadIdx.x, chunk = blockIdx.y;
  const int b = bh / num_kv_heads, h = bh % num_kv_heads;
  const int g = num_q_heads / num_kv_heads;
  zero_history_share(hist, b, h, g, pool_done);
  const int seq = sub ? bh : b, kvh = sub ? 0 : h;
  const int n = view.seq_lens[seq];
  const int i0 = chunk * kScoreChunk;
  if (i0 >= n) return;
  const int lane = tid & 31, warp = tid >> 5, sub_lane = lane % kLanes, grp = lane / kLanes;
  // This lane's 8 elements of each query head (bf16 pairs widened: high half = first shift).
  float qr[kMaxGroup][8];
  {
    const bf* q = reinterpret_cast<const bf*>(q_raw) + (int64_t(b) * num_q_heads + h * g) * D;
#pragma unroll
    for (int j = 0; j < kMaxGroup; ++j)
#pragma unroll
      for (int u = 0; u < 8; ++u)
        qr[j][u] = j < g ? __bfloat162float(q[j * D + sub_lane * 8 + u]) : 0.f;
  }
  float2 part = make_float2(-INFINITY, 0.f);  // query head sub_lane's partial (sub_lane < g)
  for (int step = 0; step < kSteps; step += kBatch) {
    uint4 kr[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = i0 + ((step + u) * kWarps + warp) * kGroups + grp;
      const bf16* k = view.k + view.offset(seq, min(i, n - 1), kvh);
      kr[u] = reinterpret_cast<const uint4*>(k)[sub_lane];
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int i = i0 + ((step + u) * kWarps + warp) * kGroups + grp;
      const uint32_t w[4] = {kr[u].x, kr[u].y, kr[u].z, kr[u].w};
      float kf[8];
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // bf16 -> fp32: a shift into the high half
        kf[2 * e] = __uint_as_float(w[e] << 16);
        kf[2 * e + 1] = __uint_as_float(w[e] & 0xffff0000u);
      }
#pragma unroll
      for (int j = 0; j < kMaxGroup; ++j) {
        if (j >= g) continue;
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot += qr[j][e] * kf[e];
#pragma unroll
        for (int o = kLanes / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        if (sub_lane == j && i < n) {
          const float x = dot * scale;
          scores[(int64_t(b) * num_q_heads + h * g + j) * max_tokens + i] = x;
          add_to_partial(part, x);
        }
      }
    }
  }
  if (sub_lane < g) warp_part[warp][grp][sub_lane] = part;
  __syncthreads();
  if (tid < g) {
    float2 p = make_float2(-INFINITY, 0.f);
    for (int w = 0; w < kWarps; ++w)
      for (int q = 0; q < kGroups; ++q) p = merge_partial(p, warp_part[w][q][tid]);
    partials[(int64_t(b) * num_q_heads + h * g + tid) * num_chunks + chunk] = p;
  }
}

// The full row's block maxima and softmax partials with the keys streamed through per-warp
// cp.async rings in shared memory (the dense decode kernel's loads, kernels/common/
// attend_tiles.cuh, for K alone): CTA (b, kv head h, part y) takes the tokens [y * per, ...)
// of the sequence, per = ceil(n / parts) rounded up to whole tiles, and its warps take the
// 16-token tiles in contiguous runs (tiles::warp_run), each keeping kRingStages tiles in flight,
// without a barrier until the end. The register form (row_scores_mma_kernel) had at most one chunk
// in flight a warp and read K at 3.5 TB/s on an H200. Blocks of 8 or 16 tokens (a tile is whole
// blocks); rows fit in int32 (the launcher checks). Writes block_max [rows, hist.max_blocks] and
// one partial a part (empty parts: (-inf, 0)), as row_pool_max_kernel reads them. A CTA's share
// is contiguous because that matters: tiles dealt over all the row's warps read DRAM 11 % slower.
// 4 warps of 3 stages (48 KB at head_dim 128; launched 2 an SM, ring_launch_smem) measured
// best on an H200 among 4 x 3, 4 x 4, 4 x 6 and 2 x 6 (docs/gpu.md).
constexpr int kRingWarps = 4, kRingStages = 3;
// The row runs as one CTA an SM (sms / (batch x kv heads) parts a kv head, at least one), a
// single wave: the engine runs it on a lane beside the later layers' sparse steps, and a
// thinner, longer row leaves them the SMs and DRAM while the last layers' rows no longer hold
// the step's end (AttnPredEngine::kDeferredLayers). 128K batch 1 over 32 layers on an H200 at
// P 4: 28.3 us a layer-step against 29.0 with four waves of 2 CTAs an SM; the row alone takes
// 93 us against 78 (docs/gpu.md, 2026-11-30, fourth session). Before the last layers deferred
// theirs, 128 CTAs gained 0.4-0.5 us and thinner rows lost (64 CTAs: 34.0 against 29.8).
// The e4m3 form (KeyCopy; append_full_row_from_copy_cuda) reads a 16-key tile as 2 KB of e4m3 and
// its 16 scales (half the bytes), so it keeps twice the stages in flight: the same bytes. The
// row alone is only 5 % faster (90 us against 95 at 128K, one CTA an SM: its warps' latency
// chain bounds it), but the steps beside it get back the DRAM it no longer takes: 128K grouped
// over 32 layers on an H200, P 4 25.5 / 25.6 us a layer-step against 28.2 / 28.2 with bf16
// keys (docs/gpu.md, 2026-11-30, fifth session).
// The int4 form reads a quarter of bf16's bytes (1 KB a tile) through four times the stages,
// and the steps beside it get back more DRAM again: P 4 23.7-23.8 us a layer-step against
// 25.0-25.1 with e4m3 keys, P 1 36.4 against 38.0 (docs/gpu.md, 2026-11-30, sixth session).
// Halving the e4m3 row's instructions instead (q in e4m3 too, 8 fp8 MMAs a tile, no
// conversion) made the row alone 5-8 % faster and the step no faster.
enum class RingKeys { Bf16, E4m3, Int4 };
template <int D, RingKeys K>
struct RingTile {
  static constexpr bool kCopy = K != RingKeys::Bf16;  // keys from a KeyCopy, with scales
  static constexpr int kKeyBytes = K == RingKeys::Bf16 ? 2 * D : K == RingKeys::E4m3 ? D : D / 2;
  static constexpr int kDataSlots = tiles::kTile * kKeyBytes / 16;                 // 16-byte slots
  static constexpr int kSlots = kDataSlots + (kCopy ? tiles::kTile * 4 / 16 : 0);  // + scales
  static constexpr int kStages = kRingStages * (2 * D / kKeyBytes);
};
template <int D, RingKeys K>
constexpr size_t ring_smem_bytes() {
  using T = RingTile<D, K>;
  return size_t(kRingWarps) * T::kStages * T::kSlots * sizeof(uint4);
}
// At most kRingCtasPerSm ring CTAs an SM, whatever their own rings need: each launch asks
// for just over 1 / (kRingCtasPerSm + 1) of the SM's shared memory, so that the last share is
// left to a CTA of a later layer's sparse step (about 69 KB at head_dim 128; 17K registers
// beside the two ring CTAs' 28K), which is launched at a greater priority and so starts at
// once instead of waiting for ring CTAs to end. At 4 an SM (their own 48 KB) the ring left no
// room. 128K batch 1 over 32 layers on an H200: 29.4-29.5 us a layer-step at P 4 against
// 29.8, and 25.9 against 27.3 at P 20 (docs/gpu.md, 2026-11-30, fourth session).
constexpr int kRingCtasPerSm = 2;
size_t ring_launch_smem(size_t own, const SmInfo& info) {
  const size_t share = size_t(info.smem_per_sm) / (kRingCtasPerSm + 1) - size_t(info.reserved) + 16;
  return std::max(own, share);
}
// An e4m3 key row in shared memory: its 16-byte pieces p at p ^ 4 (r & 1) at head dim 128, so
// that the 8 lanes of an LDS.128 phase (keys r, r + 1, pieces t4 + 4i) hit 8 bank groups.
template <int D>
__device__ __forceinline__ int e4m3_slot(int r, int piece) {
  return r * (D / 16) + (D == 128 ? piece ^ ((r & 1) << 2) : piece);
}
// The group's query rows as fp16 A fragments for keys whose head dims are read as e4m3
// pieces: k-step 4i + j of lane (g, t4) takes the dims 16 (t4 + 4i) + 4j + {0, 1} (a[0]) and
// + {2, 3} (a[2]), the dims the same lane holds of its key's piece t4 + 4i (the B fragments,
// e4m3_b_fragments), so every dim is summed once. Head g is scaled by 2^-e first, e such that
// its largest element lands in [2^14, 2^15): exact for bf16 values (fp16 has 3 more bits)
// down to 2^-24 of that element; returns 2^e (1 for a zero head or g >= group).
template <int D>
__device__ __forceinline__ float load_query_fragments_f16(const __nv_bfloat16* q_group, int group,
                                                          int lane, uint32_t (&qa)[D / 16][2]) {
  const int g = lane / 4, t4 = lane % 4;
  const bool has = g < group;
  float v[D / 16][4];  // this lane's 32 (D 128) or 16 dims, in k-step order
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < D / 64; ++i) {
    const uint4* piece =
        reinterpret_cast<const uint4*>(q_group + (has ? g : 0) * D) + 2 * (t4 + 4 * i);
    const uint4 w[2] = {piece[0], piece[1]};  // 16 bf16: dims 16 (t4 + 4i) .. + 15
    const uint32_t words[8] = {w[0].x, w[0].y, w[0].z, w[0].w, w[1].x, w[1].y, w[1].z, w[1].w};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint32_t word = words[2 * j + e];
        v[4 * i + j][2 * e] = has ? __uint_as_float(word << 16) : 0.f;
        v[4 * i + j][2 * e + 1] = has ? __uint_as_float(word & 0xffff0000u) : 0.f;
        amax = fmaxf(amax, fmaxf(fabsf(v[4 * i + j][2 * e]), fabsf(v[4 * i + j][2 * e + 1])));
      }
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const int e = amax > 0.f ? ilogbf(amax) - 14 : 0;
#pragma unroll
  for (int s = 0; s < D / 16; ++s) {
    const __half2 lo = __floats2half2_rn(ldexpf(v[s][0], -e), ldexpf(v[s][1], -e));
    const __half2 hi = __floats2half2_rn(ldexpf(v[s][2], -e), ldexpf(v[s][3], -e));
    qa[s][0] = *reinterpret_cast<const uint32_t*>(&lo);
    qa[s][1] = *reinterpret_cast<const uint32_t*>(&hi);
  }
  return ldexpf(1.f, e);
}
// The B fragments of k-steps 4i .. 4i + 3 from the 16 e4m3 dims of a key's piece t4 + 4i
// (load_query_fragments_f16): word j holds dims 4j .. 4j + 3, low byte first.
__device__ __forceinline__ void e4m3_b_fragments(const uint4& piece, uint32_t (&b)[4][2]) {
  const uint32_t w[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw x =
          __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t((w[j] >> (16 * h)) & 0xffffu), __NV_E4M3);
      b[j][h] = uint32_t(x.x) | (uint32_t(x.y) << 16);
    }
}
// The group's query rows in int8 for keys in int4 (kernels/common/int_rows.h: a scale a head,
// which it returns; 1 for g >= group), as the B fragments of m16n8k32 (column g = head g):
// lane (g, t4) holds head g's dims [D/4 t4, D/4 (t4 + 1)), and k-step j takes from them the
// dims of the key copy's word w = D/32 t4 + j (dims 8w .. 8w + 7, one a nibble, the lower dim
// in the low one): its even dims 8w + 2b as b0's bytes b (A's k 4 t4 + b, the low nibbles of
// the keys' words) and its odd ones 8w + 2b + 1 as b1's (k 16 + 4 t4 + b, the high ones).
template <int D>
__device__ __forceinline__ float load_query_int8(const __nv_bfloat16* q_group, int group, int lane,
                                                 uint32_t (&qb)[D / 32][2]) {
  constexpr int kDims = D / 4;
  const int g = lane / 4, t4 = lane % 4;
  const bool has = g < group;
  const uint4* src = reinterpret_cast<const uint4*>(q_group + (has ? g : 0) * D + kDims * t4);
  float v[kDims];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kDims / 8; ++i) {
    const uint4 w = src[i];
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      v[8 * i + 2 * e] = has ? __uint_as_float(words[e] << 16) : 0.f;
      v[8 * i + 2 * e + 1] = has ? __uint_as_float(words[e] & 0xffff0000u) : 0.f;
      amax = fmaxf(amax, fmaxf(fabsf(v[8 * i + 2 * e]), fabsf(v[8 * i + 2 * e + 1])));
    }
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const float s = int_row_scale(amax, kInt8Max);
#pragma unroll
  for (int j = 0; j < D / 32; ++j)
#pragma unroll
    for (int hb = 0; hb < 2; ++hb) {
      uint32_t word = 0;
#pragma unroll
      for (int bt = 0; bt < 4; ++bt)
        word |= (uint32_t(to_int_level(v[8 * j + 2 * bt + hb], s, kInt8Max)) & 0xffu) << (8 * bt);
      qb[j][hb] = word;
    }
  return s;
}
template <int D, RingKeys K>
__global__ void __launch_bounds__(kRingWarps * 32)
    row_max_ring_kernel(const bf16* __restrict__ q_raw, int num_q_heads, PagedKV view, KeyCopy copy,
                        int num_kv_heads, float scale, float* __restrict__ block_max,
                        float2* __restrict__ partials, int num_parts, HistoryState hist,
                        int pool_block, unsigned int* pool_done) {
  using T = RingTile<D, K>;
  constexpr bool kCopy = T::kCopy, kE4m3 = K == RingKeys::E4m3, kInt4 = K == RingKeys::Int4;
  constexpr int kStages = T::kStages, kPieces = T::kKeyBytes / 16;
  constexpr int kCopies = T::kDataSlots / 32;  // 16-byte copies of key data per lane per tile
  extern __shared__ uint4 ring_smem[];
  const int bh = blockIdx.x, b = bh / num_kv_heads, h = bh % num_kv_heads;
  const int group = num_q_heads / num_kv_heads;
  zero_history_share(hist, b, h, group, pool_done);
  // A copy's keys, which quantize_keys_kernel brought up to n before (never past max_tokens,
  // the engine's max_context).
  const int n = kCopy ? min(view.seq_lens[b], copy.max_tokens) : view.seq_lens[b];
  if (kCopy && blockIdx.y == 0 && h == 0 && threadIdx.x == 0) copy.len[b] = n;
  const int per =
      ((n + num_parts - 1) / num_parts + tiles::kTile - 1) / tiles::kTile * tiles::kTile;
  const int begin = min(n, int(blockIdx.y) * per), end = min(n, begin + per);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  const __nv_bfloat16* q_group =
      reinterpret_cast<const __nv_bfloat16*>(q_raw) + (int64_t(b) * num_q_heads + h * group) * D;
  uint32_t qa[D / 16][2];  // bf16, e4m3: head g's row as A fragments
  uint32_t qb[D / 32][2];  // int4: the heads as B's columns, in int8
  // The scores in the log2 domain (exp2f is one MUFU.EX2; expf adds its range reduction):
  // block maxima and partials go back to natural logs where they are stored. Fewer issue
  // slots taken from the steps beside the row: 128K grouped, 32 layers, e4m3 keys, P 4 on an
  // H200: 25.1 / 25.2 us a layer-step against 25.3 / 25.4 (docs/gpu.md, 2026-11-30, fifth
  // session). e4m3: the softmax scale times q's power of two, times each key's scale. int4:
  // times q's scale and 1 / 16 (each int4 sits in the high nibble of its int8), times each
  // key's scale.
  float head_scale = scale * tiles::kLog2e;
  if constexpr (kE4m3)
    head_scale *= load_query_fragments_f16<D>(q_group, group, lane, qa);
  else if constexpr (kInt4)
    head_scale *= load_query_int8<D>(q_group, group, lane, qb) * (1.f / 16.f);
  else
    tiles::load_query_fragments<D>(q_group, group, lane, qa);
  const tiles::WarpRun mine =
      tiles::warp_run((end - begin + tiles::kTile - 1) / tiles::kTile, kRingWarps, warp);
  const int my_tiles = mine.count;
  uint4* ring = ring_smem + warp * kStages * T::kSlots;
  // K streams through L2 once, beside the later layers' sparse steps (the row runs on its own
  // branch): its lines go first, so that the steps' flags, histories, page tables and KV rows stay.
  // 128K grouped on an H200, with the row forked before the layer's sparse step: 37.3-37.4 us
  // a step at P 4 against 38.5-38.7 with neither (docs/gpu.md, 2026-11-30).
  const uint64_t policy = ptx::l2_evict_first_policy();
  auto tile_begin_of = [&](int i) { return begin + (mine.first + i) * tiles::kTile; };
  // bf16: the cache's rows through the page table, each lane looking up its key (lane % 16) of
  // a tile a stage ahead. e4m3: the copy's keys, contiguous.
  const int32_t* table = view.page_table + int64_t(b) * view.max_pages_per_seq;
  auto tile_row = [&](int i) -> int {  // KV row of this lane's token (lane % 16) of tile i
    if (kCopy || i >= my_tiles) return -1;
    const int t = tile_begin_of(i) + lane % tiles::kTile;
    if (t >= end) return -1;
    return (table[t / view.page_size] * view.page_size + t % view.page_size) * num_kv_heads + h;
  };
  const int64_t key0 = kCopy ? copy.key_index(b, h, 0) : 0;
  auto issue = [&](int i, int row_of_lane) {
    uint4* ks = ring + (i % kStages) * T::kSlots;
    if constexpr (kCopy) {
      const int tb = tile_begin_of(i);
#pragma unroll
      for (int c = 0; c < kCopies; ++c) {  // int4: a key's pieces in order (no bank conflict)
        const int j = lane + 32 * c, r = j / kPieces, piece = j % kPieces;
        ptx::cp_async_16(ptx::smem_addr(ks + (kE4m3 ? e4m3_slot<D>(r, piece) : j)),
                         copy.k + (key0 + tb + r) * T::kKeyBytes + piece * 16, tb + r < end,
                         policy);
      }
      if (lane < 4)  // the tile's 16 scales (the copy holds whole tiles: max_tokens % 16 == 0)
        ptx::cp_async_16(ptx::smem_addr(ks + T::kDataSlots + lane),
                         copy.scale + key0 + tb + 4 * lane, tb + 4 * lane < end, policy);
    } else {
#pragma unroll
      for (int c = 0; c < kCopies; ++c) {
        const int j = lane + 32 * c, r = j / kPieces, piece = j % kPieces;
        const int row = __shfl_sync(0xffffffffu, row_of_lane, r);
        ptx::cp_async_16(ptx::smem_addr(ks + tiles::smem_slot<D>(r, piece)),
                         view.k + (row >= 0 ? int64_t(row) * D + piece * 8 : 0), row >= 0, policy);
      }
    }
  };
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < my_tiles) issue(st, tile_row(st));
    ptx::cp_async_commit();
  }
  int pending_row = tile_row(kStages - 1);
  float m = -INFINITY, l = 0.f;  // head row g's partial over this lane's tokens (log2)
  float* out =
      block_max + (int64_t(b) * num_q_heads + h * group + min(g, group - 1)) * hist.max_blocks;
  // int4: the C fragment's columns 2 t4 + e are the heads, its rows the tile's keys g, g + 8
  float m2[2] = {-INFINITY, -INFINITY}, l2[2] = {0.f, 0.f}, col_scale[2];
  float* out2[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int col = 2 * t4 + e;
    col_scale[e] = __shfl_sync(0xffffffffu, head_scale, 4 * col);
    out2[e] =
        block_max + (int64_t(b) * num_q_heads + h * group + min(col, group - 1)) * hist.max_blocks;
  }
  for (int i = 0; i < my_tiles; ++i) {
    if (i + kStages - 1 < my_tiles) issue(i + kStages - 1, pending_row);
    ptx::cp_async_commit();
    pending_row = tile_row(i + kStages);
    ptx::cp_async_wait<kStages - 1>();
    __syncwarp();
    const uint4* ks = ring + (i % kStages) * T::kSlots;
    if constexpr (kInt4) {
      // The tile's keys are A's rows and the group's heads B's columns (4 MMAs a tile at
      // head dim 128, where the fp16 forms' 16 leave three quarters of A's rows empty). A
      // word of 8 nibbles is two A registers by two masks: the even dims' nibbles shifted
      // into the high halves of their bytes, the odd ones' already there (16 x the int4, as
      // an int8; head_scale takes the 1 / 16).
      constexpr int kWords = D / 32;  // a lane's words of a key: its k-steps
      uint32_t w0[kWords], w1[kWords];
      if constexpr (D == 128) {
        const uint4 k0 = ks[g * 4 + t4], k1 = ks[(g + 8) * 4 + t4];
        w0[0] = k0.x, w0[1] = k0.y, w0[2] = k0.z, w0[3] = k0.w;
        w1[0] = k1.x, w1[1] = k1.y, w1[2] = k1.z, w1[3] = k1.w;
      } else {
        const uint2* k8 = reinterpret_cast<const uint2*>(ks);
        const uint2 k0 = k8[g * 4 + t4], k1 = k8[(g + 8) * 4 + t4];
        w0[0] = k0.x, w0[1] = k0.y, w1[0] = k1.x, w1[1] = k1.y;
      }
      int acc[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};  // two chains of exact int32 sums
#pragma unroll
      for (int j = 0; j < kWords; ++j) {
        const uint32_t a[4] = {(w0[j] << 4) & 0xf0f0f0f0u, (w1[j] << 4) & 0xf0f0f0f0u,
                               w0[j] & 0xf0f0f0f0u, w1[j] & 0xf0f0f0f0u};
        ptx::mma_s8_16832(acc[j & 1], a, qb[j], acc[j & 1]);
      }
      const float* kscale = reinterpret_cast<const float*>(ks + T::kDataSlots);
      const float s_lo = kscale[g], s_hi = kscale[g + 8];
      __syncwarp();  // every lane is done with this stage before it is refilled
      const int tb = tile_begin_of(i);
      const bool in_lo = tb + g < end, in_hi = tb + g + 8 < end;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x_lo = in_lo ? float(acc[0][e] + acc[1][e]) * s_lo * col_scale[e] : -INFINITY;
        const float x_hi =
            in_hi ? float(acc[0][2 + e] + acc[1][2 + e]) * s_hi * col_scale[e] : -INFINITY;
        // The maxima of the tile's 8-key halves (blocks of 8) or of the whole tile, over the
        // lanes that hold its rows.
        float lo = x_lo, hi = x_hi;
        if (pool_block != 8) lo = fmaxf(x_lo, x_hi);
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
          lo = fmaxf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
          if (pool_block == 8) hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
        }
        if (pool_block != 8) hi = lo;
        const float tile_max = fmaxf(lo, hi);  // finite: the tile's first token < end
        if (g == 0 && 2 * t4 + e < group) {
          if (pool_block == 8) {
            out2[e][tb / 8] = lo * tiles::kLn2;
            if (tb + 8 < end) out2[e][tb / 8 + 1] = hi * tiles::kLn2;
          } else {
            out2[e][tb / 16] = tile_max * tiles::kLn2;
          }
        }
        const float m_new = fmaxf(m2[e], tile_max);
        l2[e] = l2[e] * exp2f(m2[e] - m_new) + exp2f(x_lo - m_new) + exp2f(x_hi - m_new);
        m2[e] = m_new;
      }
      continue;
    }
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    float mul[2][2];  // what each score is multiplied by
    if constexpr (kE4m3) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int pi = 0; pi < D / 64; ++pi) {
          uint32_t kb[4][2];
          e4m3_b_fragments(ks[e4m3_slot<D>(nt * 8 + g, t4 + 4 * pi)], kb);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint32_t a[4] = {qa[4 * pi + j][0], 0u, qa[4 * pi + j][1], 0u};
            ptx::mma_f16_16816(sc[nt], a, kb[j], sc[nt]);
          }
        }
        const float2 ksc =
            reinterpret_cast<const float2*>(ks + T::kDataSlots)[(nt * 8 + 2 * t4) / 2];
        mul[nt][0] = head_scale * ksc.x;
        mul[nt][1] = head_scale * ksc.y;
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t kb[4];
        const int r = ((lane >> 4) << 3) + (lane & 7), piece = 2 * kk + ((lane >> 3) & 1);
        ptx::ldmatrix_x4(kb, ptx::smem_addr(ks + tiles::smem_slot<D>(r, piece)));
        const uint32_t a[4] = {qa[kk][0], 0u, qa[kk][1], 0u};
        const uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
        ptx::mma_bf16_16816(sc[0], a, b0, sc[0]);
        ptx::mma_bf16_16816(sc[1], a, b1, sc[1]);
      }
      mul[0][0] = mul[0][1] = mul[1][0] = mul[1][1] = head_scale;
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
    const int tb = tile_begin_of(i);
    float x[4], nt_max[2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int t = tb + nt * 8 + 2 * t4 + j;
        x[nt * 2 + j] = t < end ? sc[nt][j] * mul[nt][j] : -INFINITY;
      }
      nt_max[nt] = fmaxf(x[nt * 2], x[nt * 2 + 1]);
      nt_max[nt] = fmaxf(nt_max[nt], __shfl_xor_sync(0xffffffffu, nt_max[nt], 1));
      nt_max[nt] = fmaxf(nt_max[nt], __shfl_xor_sync(0xffffffffu, nt_max[nt], 2));
    }
    const float tile_max = fmaxf(nt_max[0], nt_max[1]);  // finite: the tile's first token < end
    if (t4 == 0 && g < group) {
      if (pool_block == 8) {
        out[tb / 8] = nt_max[0] * tiles::kLn2;
        if (tb + 8 < end) out[tb / 8 + 1] = nt_max[1] * tiles::kLn2;
      } else {
        out[tb / 16] = tile_max * tiles::kLn2;
      }
    }
    const float m_new = fmaxf(m, tile_max);
    l *= exp2f(m - m_new);
#pragma unroll
    for (int e = 0; e < 4; ++e) l += exp2f(x[e] - m_new);
    m = m_new;
  }
  ptx::cp_async_wait<0>();
  __syncthreads();  // the rings are free: the warps' partials go there
  float2* wp = reinterpret_cast<float2*>(ring_smem);  // [kRingWarps][kMaxGroup]
  if constexpr (kInt4) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) l2[e] += __shfl_xor_sync(0xffffffffu, l2[e], o);
      if (g == 0 && 2 * t4 + e < group)
        wp[warp * kMaxGroup + 2 * t4 + e] = make_float2(m2[e] * tiles::kLn2, l2[e]);
    }
  } else {
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (t4 == 0 && g < group) wp[warp * kMaxGroup + g] = make_float2(m * tiles::kLn2, l);
  }
  __syncthreads();
  if (threadIdx.x < group) {
    float2 pt = make_float2(-INFINITY, 0.f);
    for (int w = 0; w < kRingWarps; ++w) pt = merge_partial(pt, wp[w * kMaxGroup + threadIdx.x]);
    partials[(int64_t(b) * num_q_heads + h * group + threadIdx.x) * num_parts + blockIdx.y] = pt;
  }
}

// Brings a KeyCopy up to the current lengths: keys [len[b], min(n, max_tokens)) of every (b,
// kv head), a warp a key (grid-stride over the keys), each lane quantizing d / 32 elements
// after the warp's max (e4m3: a byte each; int4: a nibble each, the lower dim in the low
// nibble). len is advanced by the row kernel that reads the copy next.
template <int D, KeyFormat F>
__global__ void __launch_bounds__(kThreads) quantize_keys_kernel(PagedKV view, KeyCopy copy) {
  constexpr int kPer = D / 32;  // elements a lane
  const int bh = blockIdx.x, b = bh / copy.num_kv_heads, h = bh % copy.num_kv_heads;
  const int lane = threadIdx.x & 31, warps = kThreads / 32;
  const int n = min(view.seq_lens[b], copy.max_tokens);
  for (int t = copy.len[b] + int(blockIdx.y) * warps + int(threadIdx.x >> 5); t < n;
       t += int(gridDim.y) * warps) {
    const bf16* k = view.k + view.offset(b, t, h) + lane * kPer;
    float x[kPer];
    float amax = 0.f;
    if constexpr (kPer == 4) {
      const uint2 w = *reinterpret_cast<const uint2*>(k);
      x[0] = __uint_as_float(w.x << 16), x[1] = __uint_as_float(w.x & 0xffff0000u);
      x[2] = __uint_as_float(w.y << 16), x[3] = __uint_as_float(w.y & 0xffff0000u);
    } else {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(k);
      x[0] = __uint_as_float(w << 16), x[1] = __uint_as_float(w & 0xffff0000u);
    }
#pragma unroll
    for (int e = 0; e < kPer; ++e) amax = fmaxf(amax, fabsf(x[e]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const int64_t key = copy.key_index(b, h, t);
    float s;
    if constexpr (F == KeyFormat::E4m3) {
      s = e4m3_row_scale(amax);
      uint32_t packed = 0;
#pragma unroll
      for (int e = 0; e < kPer; ++e) packed |= uint32_t(to_e4m3(x[e], s)) << (8 * e);
      uint8_t* dst = copy.k + key * D + lane * kPer;
      if constexpr (kPer == 4)
        *reinterpret_cast<uint32_t*>(dst) = packed;
      else
        *reinterpret_cast<uint16_t*>(dst) = uint16_t(packed);
    } else {
      s = int_row_scale(amax, kInt4Max);
      uint32_t packed = 0;
#pragma unroll
      for (int e = 0; e < kPer; ++e)
        packed |= (uint32_t(to_int_level(x[e], s, kInt4Max)) & 0xfu) << (4 * e);
      uint8_t* dst = copy.k + key * (D / 2) + lane * (kPer / 2);
      if constexpr (kPer == 4)
        *reinterpret_cast<uint16_t*>(dst) = uint16_t(packed);
      else
        *dst = uint8_t(packed);
    }
    if (lane == 0) copy.scale[key] = s;
  }
}

using RowReduce = cub::BlockReduce<float, kThreads>;

// The log-sum-exp of a row from its score CTAs' `used` partials; every thread of the CTA calls
// it and gets it.
__device__ float row_lse(const float2* part, int used, RowReduce::TempStorage& red, float& s_val) {
  const int tid = threadIdx.x;
  float m = -INFINITY;
  for (int c = tid; c < used; c += kThreads) m = fmaxf(m, part[c].x);
  m = RowReduce(red).Reduce(m, MaxOp());
  if (tid == 0) s_val = m;
  __syncthreads();
  m = s_val;
  float z = 0.f;
  for (int c = tid; c < used; c += kThreads) z += part[c].y * expf(part[c].x - m);
  __syncthreads();
  z = RowReduce(red).Sum(z);
  if (tid == 0) s_val = m + logf(z);
  __syncthreads();
  return s_val;
}

// Every CTA of a pool kernel ends here: the last one out advances the histories (count[b] += 1,
// tokens[b] = the context length) once every CTA has read count, so that no kernel of its own
// is launched for it (a launch on the step's chain: 2.3 us cold on an H200). `done` was zeroed
// by the score kernel before.
__device__ __forceinline__ void finish_row(const HistoryState& hist, const int32_t* kv_lens,
                                           int batch, unsigned int* done) {
  __syncthreads();  // every thread of the CTA has used count
  if (threadIdx.x != 0) return;
  if (atomicAdd(done, 1u) != gridDim.x * gridDim.y - 1) return;
  for (int b = 0; b < batch; ++b) {
    hist.count[b] += 1;
    hist.tokens[b] = kv_lens[b];
  }
}

// Blocks [y * kPoolMaxBlocks, ...) of the full row of (b, query head), from the block maxima
// row_scores_mma_kernel pooled: a block's probability max_i exp(s_i - lse) is exp(max_i s_i -
// lse), exp being increasing, so it is row_pool_kernel's value without a pass over the
// scores (128K: 16 MB of scores neither written nor read back). Blocks past the row stay as
// the score kernel zeroed them. every_part: each of the num_chunks partials holds (the ring
// kernel's, whose empty CTAs write empty ones); else only the first ceil(n / kScoreChunk).
constexpr int kPoolMaxBlocks = 2048;
__global__ void __launch_bounds__(kThreads)
    row_pool_max_kernel(int num_q_heads, PagedKV view, const float* __restrict__ block_max,
                        const float2* __restrict__ partials, int num_chunks, bool every_part,
                        Geometry geo, HistoryState hist, const int32_t* kv_lens, int batch,
                        unsigned int* done) {
  __shared__ typename RowReduce::TempStorage red;
  __shared__ float s_val;
  const int s = blockIdx.x, b = s / num_q_heads, qh = s % num_q_heads;
  const int n = view.seq_lens[b];
  const int used_parts = every_part ? num_chunks : (n + kScoreChunk - 1) / kScoreChunk;
  const int j0 = blockIdx.y * kPoolMaxBlocks, j1 = min(geo.num_blocks(n), j0 + kPoolMaxBlocks);
  if (j0 < j1) {
    const float lse = row_lse(partials + int64_t(s) * num_chunks, used_parts, red, s_val);
    const float* mx = block_max + int64_t(s) * hist.max_blocks;
    float* row = hist.slot(b, qh / hist.group, hist.count[b] % hist.history);
    if (hist.group == 1) {
      for (int j = j0 + threadIdx.x; j < j1; j += kThreads) row[j] = expf(mx[j] - lse);
    } else {  // the group's largest: probabilities are >= 0, so their float bits order as ints
      for (int j = j0 + threadIdx.x; j < j1; j += kThreads)
        atomicMax(reinterpret_cast<int*>(row + j), __float_as_int(expf(mx[j] - lse)));
    }
  }
  finish_row(hist, kv_lens, batch, done);
}

// Chunk y of (b, query head): the log-sum-exp from all chunks' partials, then the softmax of
// the chunk's scores max-pooled into the history row (a warp segmented max + one atomicMax
// per block run; probabilities are >= 0, so their float bits order as ints).
__global__ void __launch_bounds__(kThreads)
    row_pool_kernel(int num_q_heads, PagedKV view, bool sub, const int32_t* __restrict__ ids,
                    int ids_stride, int num_kv_heads, const float* __restrict__ scores,
                    int max_tokens, const float2* __restrict__ partials, int num_chunks,
                    Geometry geo, HistoryState hist, const int32_t* kv_lens, int batch,
                    unsigned int* done) {
  __shared__ typename RowReduce::TempStorage red;
  __shared__ float s_val;
  const int s = blockIdx.x, tid = threadIdx.x, chunk = blockIdx.y;
  const int b = s / num_q_heads, qh = s % num_q_heads;
  const int g = num_q_heads / num_kv_heads, h = qh / g;
  const int seq = sub ? b * num_kv_heads + h : b;
  const int n = view.seq_lens[seq];
  const int i0 = chunk * kRowChunk;
  if (i0 >= n) {
    finish_row(hist, kv_lens, batch, done);
    return;
  }
  const float lse =
      row_lse(partials + int64_t(s) * num_chunks, (n + kScoreChunk - 1) / kScoreChunk, red, s_val);
  const float* sc = scores + int64_t(s) * max_tokens;
  const int32_t* id = ids ? ids + int64_t(seq) * ids_stride : nullptr;
  float* row = hist.slot(b, qh / hist.group, hist.count[b] % hist.history);
  const int lane = tid & 31, i1 = min(n, i0 + kRowChunk);
  for (int base = i0 + (tid & ~31); base < i1; base += kThreads) {
    const int i = base + lane;
    const bool ok = i < i1;
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
  finish_row(hist, kv_lens, batch, done);
}

__device__ __forceinline__ bool wanted(const Geometry& g, int j, int n_next, const uint8_t* fl,
                                       bool skip_tail) {
  const int nb = g.num_blocks(n_next);
  if (j >= nb) return false;
  if (skip_tail && j == nb - 1) return false;
  return j * g.block < g.sink || fl[j] || (j + 1) * g.block > n_next - g.recent;
}

__global__ void __launch_bounds__(kSelThreads)
    plan_resident_kernel(const int32_t* __restrict__ kv_lens, const uint8_t* __restrict__ flags,
                         Geometry g, int len_delta, bool skip_tail,
                         const int32_t* __restrict__ copied_lens, BlockCache cache,
                         unsigned long long* counters) {
  using Scan = cub::BlockScan<int, kSelThreads>;
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
  for (int s = tid; s < cache.slots_per_head; s += kSelThreads) {
    const int blk = slot_block[s];
    if (blk >= 0 && !wanted(g, blk, n_next, fl, skip_tail)) {
      slot_block[s] = -1;
      block_slot[blk] = -1;
    }
  }
  __syncthreads();
  // Free slots in ascending order: a contiguous run of slots per thread, one block scan.
  const int sper = (cache.slots_per_head + kSelThreads - 1) / kSelThreads;
  const int s0 = min(cache.slots_per_head, tid * sper);
  const int s1 = min(cache.slots_per_head, s0 + sper);
  int my_free = 0;
  for (int sl = s0; sl < s1; ++sl) my_free += slot_block[sl] < 0;
  int fpos, nfree;
  Scan(scan).ExclusiveSum(my_free, fpos, nfree);
  for (int sl = s0; sl < s1; ++sl)
    if (slot_block[sl] < 0) free_slots[fpos++] = sl;
  __syncthreads();
  // Blocks in ascending order, a contiguous run per thread: those wanted without a slot take
  // the free slots in order; those also copied (new or stale) go to the copy list in order.
  const int nb = g.num_blocks(n_next);
  const int bper = (nb + kSelThreads - 1) / kSelThreads;
  const int j0 = min(nb, tid * bper), j1 = min(nb, j0 + bper);
  auto needs = [&](int j, int* need_slot, int* need_copy) {
    const bool want = wanted(g, j, n_next, fl, skip_tail);
    *need_slot = want && block_slot[j] < 0;
    *need_copy = *need_slot || (want && (int64_t(j) + 1) * g.block > stale_from);
  };
  int my_slots = 0, my_copies = 0;
  for (int j = j0; j < j1; ++j) {
    int ns, nc;
    needs(j, &ns, &nc);
    my_slots += ns;
    my_copies += nc;
  }
  int spos, stotal, cpos, ctotal;
  Scan(scan).ExclusiveSum(my_slots, spos, stotal);
  __syncthreads();
  Scan(scan).ExclusiveSum(my_copies, cpos, ctotal);
  unsigned long long overflow = 0;
  for (int j = j0; j < j1; ++j) {
    int ns, nc;
    needs(j, &ns, &nc);
    int slot = block_slot[j];
    if (ns) {
      if (spos < nfree) {
        const int local = free_slots[spos];
        slot = slot0 + local;
        block_slot[j] = slot;
        slot_block[local] = j;
      } else {
        slot = -1;
        ++overflow;
      }
      ++spos;
    }
    if (nc) {  // slot -1 (no free slot: counted above) is skipped by the copy kernel
      list[2 * cpos] = j;
      list[2 * cpos + 1] = slot;
      ++cpos;
    }
  }
  if (tid == 0) cache.copy_count[bh] = min(ctotal, cache.slots_per_head);
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
  // Every (sequence, kv head, list entry) is one warp's item, so the copies of all heads are
  // in flight together (one host round trip, not one per head).
  const int bhs = min(cache.max_batch, host_kv.batch) * cache.num_kv_heads;
  const int64_t items = int64_t(bhs) * cache.slots_per_head;
  for (int64_t item = warp; item < items; item += nwarps) {
    const int bh = int(item / cache.slots_per_head), e = int(item % cache.slots_per_head);
    if (e >= cache.copy_count[bh]) continue;
    const int b = bh / cache.num_kv_heads, h = bh % cache.num_kv_heads;
    const int n = host_kv.seq_lens[b];
    const int32_t* list = cache.copy_list + int64_t(bh) * cache.slots_per_head * 2;
    const int j = list[2 * e], slot = list[2 * e + 1];
    if (slot < 0) continue;
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

// ---- sparse attention with its history row (GPU-resident decode) ---------------------------
//
// sparse_attend_kernel, grid (parts, batch x kv heads): every CTA of (b, kv head h) reads the
// block flags into a bit set of the attended blocks (sink, flagged, recent; 16-byte loads,
// one shared atomicOr per attended block: about 130 of 8,193 at 128K), ranks them by one
// block scan of the words' popcounts, and takes the ranks [K * part / parts, K * (part + 1) /
// parts). Its blocks' tokens go to a list in shared memory (their KV rows, through the page
// table, and each position's block), which attend_tiles reads as its page table, so a tile
// may span blocks. Its score hook keeps each (query head, block) maximum by shared atomicMax
// on order keys. The CTA writes its state (o, lse) per head, its blocks' maxima and ids, and
// the token list (Selection::tokens, for last_read). sparse_merge_kernel, one CTA per (b,
// query head), launched programmatically behind it: the parts' states merged (o and lse), and
// the history row: exp(block max - lse) at each attended block, 0 elsewhere (zeroed by the
// first kernel's CTAs), the group's largest by atomicMax when grouped. Two kernels replace
// the block list, the split-KV attention and its merge, and the sparse row's score and pool
// kernels (docs/gpu.md).
// Two stages: a warp attends one or two tiles (about 5 blocks a CTA at 128K), and the smaller
// ring (69 KB a CTA with d 128, against 101 KB with three) lets a third CTA onto an SM beside
// the branches' kernels: 0.6-0.9 us a step at 128K predicting every 4 steps (docs/gpu.md).
constexpr int kSparseWarps = 4, kSparseStages = 2;

// Position of the set bit of x that has k set bits below it (k < popc(x)): a binary search
// on the bit counts of halves.
__device__ __forceinline__ int nth_set_bit(uint32_t x, int k) {
  int pos = 0;
#pragma unroll
  for (int half = 16; half > 0; half /= 2) {
    const int low = __popc(x & ((1u << half) - 1u));
    if (k >= low) {
      k -= low;
      x >>= half;
      pos += half;
    }
  }
  return pos;
}

// Bit i (0..3) set where byte i of x is nonzero. __vcmpne4 leaves 0xff in each such byte; its
// top bits, at 8 i + 7, are gathered to bits 28 + i by one multiply (the partial products land
// on distinct bits, so nothing carries into 28..31).
__device__ __forceinline__ uint32_t nonzero_bytes(uint32_t x) {
  return (((__vcmpne4(x, 0u) >> 7) & 0x01010101u) * 0x10204080u) >> 28;
}
constexpr int kSparseMergeWarps = 8;
// Items (CTAs x heads' states) the workspace holds at least: parts shrink to fit at large
// batch, down to one CTA per (b, kv head).
constexpr int kSparseItemsCap = 1024;

struct SparseParams {
  const bf* q;
  tiles::KvSource kv;  // the paged cache (scale_log2 = scale * log2 e)
  const int32_t* seq_lens;
  int batch, num_q_heads, num_kv_heads, group;
  const uint8_t* flags;  // [.., Hkv, max_blocks]
  int max_blocks;
  Geometry geo;
  int parts;             // CTAs per (b, kv head)
  int share_cap;         // blocks one CTA holds at most: ceil(list_cap / parts)
  int list_cap;          // attended blocks per (b, kv head) at most: the stride of ids and maxima
  float* partial_lse;    // [(bh * parts + part) * group + hg]
  float* partial_o;      // [..., D]
  float* block_max;      // [b * Hq + query head][list_cap], log2 domain (scaled scores)
  int32_t* block_ids;    // [bh][list_cap]
  int32_t* block_count;  // [bh]
  int32_t* tokens;       // [bh][tokens_stride]: the attended tokens, ascending
  int32_t* token_count;  // [bh]
  int tokens_stride;
  unsigned long long* counters;  // may be null: [0] += tokens attended, [1] += blocks over cap
  HistoryState hist;
  bool append;     // the step's history row (not on calibration steps: the full row is theirs)
  bool row_apart;  // with append: the row's inputs into a SparseRow, its stores left to
                   // sparse_row_cuda
  float* row_lse;  // row_apart: [b * Hq + query head]
  unsigned int* done;
  __nv_bfloat16* o;
  float* lse;  // may be null
};

// Byte offsets of the first kernel's shared memory past the tile loop's (the rings must come
// first: attend_tiles.cuh).
struct SparseSmem {
  size_t words, masks, warp_sums, blocks, rows, tokens, pos_block, maxima, total;
};
__host__ __device__ inline SparseSmem sparse_smem(size_t tiles_bytes, int max_blocks, int share_cap,
                                                  int block) {
  auto up = [](size_t x) { return (x + 15) / 16 * 16; };
  const size_t tokens = size_t(share_cap) * block;
  SparseSmem s;
  s.words = up(tiles_bytes);
  s.masks = up(s.words + size_t((max_blocks + 31) / 32) * 4);
  s.warp_sums = up(s.masks + size_t((max_blocks + 31) / 16 + 1) * 2);  // a flag row's masks
  s.blocks = up(s.warp_sums + 32 * 4);
  s.rows = up(s.blocks + size_t(share_cap) * 4);
  s.tokens = up(s.rows + tokens * 4);
  s.pos_block = up(s.tokens + tokens * 4);
  s.maxima = up(s.pos_block + tokens * 2);
  s.total = up(s.maxima + size_t(kMaxGroup) * share_cap * 4);
  return s;
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads)
    sparse_attend_kernel(const __grid_constant__ SparseParams p) {
  constexpr int D = Cfg::kHeadDim, kT = Cfg::kThreads, kW = Cfg::kWarps;
  extern __shared__ uint4 smem[];
  // The merge kernel may get resident now; it waits for this grid before reading anything.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const Geometry& g = p.geo;
  const SparseSmem L = sparse_smem(Cfg::smem_bytes(), p.max_blocks, p.share_cap, g.block);
  char* base = reinterpret_cast<char*>(smem);
  uint32_t* words = reinterpret_cast<uint32_t*>(base + L.words);
  uint16_t* masks = reinterpret_cast<uint16_t*>(base + L.masks);
  int* warp_sums = reinterpret_cast<int*>(base + L.warp_sums);
  int32_t* blocks_s = reinterpret_cast<int32_t*>(base + L.blocks);
  int32_t* rows_s = reinterpret_cast<int32_t*>(base + L.rows);
  int32_t* tokens_s = reinterpret_cast<int32_t*>(base + L.tokens);
  uint16_t* pos_block = reinterpret_cast<uint16_t*>(base + L.pos_block);
  unsigned* maxima = reinterpret_cast<unsigned*>(base + L.maxima);

  const int part = blockIdx.x, bh = blockIdx.y;
  const int b = bh / p.num_kv_heads, h = bh % p.num_kv_heads;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int n = p.seq_lens[b];
  const int nb = g.num_blocks(n), nwords = (nb + 31) / 32;
  const uint8_t* fl = p.flags + int64_t(bh) * p.max_blocks;
  const int sink_blocks = min(nb, g.sink / g.block);
  // The first block holding a recent token (nb: no recent window).
  const int recent_first = g.recent > 0 ? max(0, n - g.recent) / g.block : nb;
  const int hist_slot = p.append ? p.hist.count[b] % p.hist.history : 0;
  uint32_t qa[D / 16][2];
  tiles::load_query_fragments<D>(p.q + (int64_t(b) * p.num_q_heads + h * p.group) * D, p.group,
                                 lane, qa);

  // 1. The attended blocks as bits. The flag row is read in aligned 16-byte vectors from
  // the one holding block sink_blocks to the one holding the last block, each turned into a
  // 16-bit mask of its nonzero bytes in `masks` (bit i of the stream: row byte i - skew). A
  // vector that reaches past either end of the row (its first or last, when the row is not
  // aligned) is read a byte at a time, so that no byte outside the row is touched.
  // Then each thread cuts its own words out of that stream and adds the sink and the recent
  // window. Branch-free and without atomics: the first form (a loop over each nonzero byte of
  // every flag word, a shared atomicOr per attended block) took 5.5 us of this kernel's 15 at
  // 128K on an H200, its 8 KB of conditional blocks run once per CTA (docs/gpu.md).
  const int skew = int(reinterpret_cast<uintptr_t>(fl) & 15);
  const uint4* fv = reinterpret_cast<const uint4*>(fl - skew);
  const int v_lo = (sink_blocks + skew) / 16, v_hi = (nb + skew + 15) / 16;
  // Vectors [v_in, v_out) lie inside the row; v_lo and v_hi - 1 may reach past it.
  auto whole = [&](int v) { return 16 * v >= skew && 16 * v + 16 - skew <= p.max_blocks; };
  const int v_in = v_lo < v_hi && !whole(v_lo) ? v_lo + 1 : v_lo;
  const int v_out = max(v_in, v_hi > v_lo && !whole(v_hi - 1) ? v_hi - 1 : v_hi);
  {
    constexpr int kLoads = 8;  // 16-byte loads in flight per thread: one round up to 128K
    for (int v0 = v_in; v0 < v_out; v0 += kT * kLoads) {
      uint4 x[kLoads];
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        const int v = v0 + k * kT + tid;
        x[k] = v < v_out ? fv[v] : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        const int v = v0 + k * kT + tid;
        if (v < v_out)
          masks[v - v_lo] = uint16_t(nonzero_bytes(x[k].x) | nonzero_bytes(x[k].y) << 4 |
                                     nonzero_bytes(x[k].z) << 8 | nonzero_bytes(x[k].w) << 12);
      }
    }
    // The edge vectors, a byte at a time: thread 0 the first, thread 1 the last.
    const int ve = tid == 0 ? v_lo : v_hi - 1;
    if (tid < 2 && ve >= v_lo && ve < v_hi && (ve < v_in || ve >= v_out) &&
        !(tid == 1 && ve == v_lo)) {
      uint32_t m = 0u;
      for (int i = 0; i < 16; ++i) {
        const int j = 16 * ve + i - skew;  // row byte
        if (j >= 0 && j < p.max_blocks && fl[j]) m |= 1u << i;
      }
      masks[ve - v_lo] = uint16_t(m);
    }
  }
  __syncthreads();
  // Flag of block j (sink_blocks <= j < nb) from the masks.
  auto flagged = [&](int j) { return (masks[(j + skew) / 16 - v_lo] >> ((j + skew) % 16)) & 1; };
  // Bits [lo, hi) of word w.
  auto range_bits = [](int w, int lo, int hi) {
    const int a = max(lo - 32 * w, 0), b = min(hi - 32 * w, 32);
    return a >= b ? 0u : (b - a == 32 ? ~0u : ((1u << (b - a)) - 1u) << a);
  };
  // 2. Ranks: thread t owns the words [t * per, ...); one block scan of their popcounts.
  const int per = (nwords + kT - 1) / kT;
  const int w0 = min(nwords, tid * per), w1 = min(nwords, w0 + per);
  int mine = 0;
  for (int w = w0; w < w1; ++w) {
    // Flags of the blocks [sink_blocks, recent_first) of word w: bits of stream positions
    // [32 w + skew, + 32), which span three masks.
    uint32_t bits = 0u;
    const int lo = max(sink_blocks, 32 * w), hi = min(recent_first, 32 * w + 32);
    if (lo < hi) {
      const int m0 = (32 * w + skew) / 16 - v_lo;  // masks outside [v_lo, v_hi) read as 0
      auto mask = [&](int i) { return i >= 0 && i < v_hi - v_lo ? uint64_t(masks[i]) : 0ull; };
      const uint64_t stream = mask(m0) | mask(m0 + 1) << 16 | mask(m0 + 2) << 32;
      bits = uint32_t(stream >> ((32 * w + skew) % 16)) & range_bits(w, lo, hi);
    }
    bits |= range_bits(w, 0, sink_blocks) | range_bits(w, recent_first, nb);
    words[w] = bits;
    mine += __popc(bits);
  }
  int incl = mine;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int x = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += x;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  int before = incl - mine, K = 0;
#pragma unroll
  for (int w = 0; w < kW; ++w) {
    before += w < warp ? warp_sums[w] : 0;
    K += warp_sums[w];
  }
  if (K > p.list_cap) {  // more blocks than the selection can flag: never, by construction
    if (part == 0 && tid == 0 && p.counters)
      atomicAdd(p.counters + 1, (unsigned long long)(K - p.list_cap));
    K = p.list_cap;
  }
  const int k0 = int(int64_t(K) * part / p.parts);
  const int cnt = int(int64_t(K) * (part + 1) / p.parts) - k0;  // <= share_cap
  const int k1 = k0 + cnt;
  // 3. This CTA's block ids, ascending: each rank of [k0, k1) in the thread's words found
  // by its position among the word's bits, so a thread steps over the CTA's few ranks, not
  // over every attended block before them (a thread holding full words of the recent window
  // walked up to 96 bits, one after another).
  {
    int r = before;
    for (int w = w0; w < w1 && r < k1; ++w) {
      const uint32_t bits = words[w];
      const int c = __popc(bits);
      const int q1 = min(r + c, k1);
#pragma unroll 1
      for (int q = max(r, k0); q < q1; ++q) blocks_s[q - k0] = w * 32 + nth_set_bit(bits, q - r);
      r += c;
    }
  }
  // Attended tokens of block j: [block_lo(j), block_hi(j)), block_attended's count of them
  // (the one place of the rule). Only two blocks can hold fewer than `block`: the first
  // recent block when it is not otherwise attended (cut on its left) and the last (cut on its
  // right, and last in every list). So a block's list position is block x its rank, less the
  // first recent block's shortfall when that block comes before it.
  auto block_hi = [&](int j) { return min((j + 1) * g.block, n); };
  auto block_lo = [&](int j) {
    return block_hi(j) - block_attended(g, j, n, j >= sink_blocks && flagged(j));
  };
  const int cut_block = recent_first < nb - 1 ? recent_first : -1;
  const int cut = cut_block >= 0 ? block_lo(cut_block) - cut_block * g.block : 0;
  __syncthreads();  // blocks_s complete
  const int first_block = cnt > 0 ? blocks_s[0] : 0;
  const int32_t* table = p.kv.page_table + int64_t(b) * p.kv.max_pages_per_seq;
  // A thread per token slot (block i, offset u), with only shared stores, so that all of the
  // CTA's page-table loads are in flight at once; the list goes out after the barrier. (A
  // thread per block, storing each token to the global list as it went, loaded its tokens'
  // entries one after another behind stores that might alias them; this form gained 0.5 us a
  // step at 128K: docs/gpu.md.)
  for (int x = tid; x < cnt * g.block; x += kT) {
    const int i = x / g.block, j = blocks_s[i];
    const int lo = block_lo(j), hi = block_hi(j), t = j * g.block + x % g.block;
    if (t >= lo && t < hi) {
      const bool after_cut = cut > 0 && cut_block < j && cut_block >= first_block;
      const int pos = i * g.block - (after_cut ? cut : 0) + t - lo;
      const int page = __ldg(table + t / p.kv.page_size);
      rows_s[pos] = (page * p.kv.page_size + t % p.kv.page_size) * p.num_kv_heads + h;
      tokens_s[pos] = t;
      pos_block[pos] = uint16_t(i);
      if (i == cnt - 1 && t == hi - 1) warp_sums[kW] = pos + 1;  // the CTA's token count
    }
  }
  if (cnt == 0 && tid == 0) warp_sums[kW] = 0;
  for (int i = tid; i < kMaxGroup * p.share_cap; i += kT) maxima[i] = 0u;  // below every key
  if (part == 0 && tid == 0) {
    // Tokens in the list: K whole blocks less the cut block's and the last block's shortfalls.
    int total = K * g.block - cut;
    if (nb > 0 && K > 0) {
      const int last = block_attended(g, nb - 1, n, nb - 1 >= sink_blocks && flagged(nb - 1));
      if (last > 0) total -= g.block - last;
    }
    p.token_count[bh] = min(total, p.tokens_stride);
    p.block_count[bh] = K;
    if (p.counters) atomicAdd(p.counters, (unsigned long long)total);
    if (blockIdx.y == 0 && p.done) *p.done = 0u;
  }
  if (p.append) {  // this part's share of the history slot, zeroed for the merge's stores
    const int per_kv = p.group / p.hist.group;
    const int span = (p.max_blocks + p.parts - 1) / p.parts;
    const int c0 = part * span, c1 = min(p.max_blocks, c0 + span);
    for (int k = 0; k < per_kv; ++k) {
      float* row = p.hist.slot(b, h * per_kv + k, hist_slot);
      for (int c = c0 + tid; c < c1; c += kT) row[c] = 0.f;
    }
  }
  __syncthreads();
  const int ntok = warp_sums[kW];
  {  // The CTA's tokens in the (b, kv head) list, from its first one's position on.
    const int first = k0 * g.block - (cut > 0 && cut_block < first_block ? cut : 0);
    int32_t* list = p.tokens + int64_t(bh) * p.tokens_stride + first;
    for (int i = tid; i < ntok && first + i < p.tokens_stride; i += kT) list[i] = tokens_s[i];
  }

  // 4. Attention over the list, with each (head, block) maximum of the scores.
  const tiles::KvSource src{p.kv.k, p.kv.v, rows_s, 1, 1, ntok, p.kv.scale_log2};
  const int group = p.group, cap = p.share_cap;
  tiles::attend_tiles<Cfg, false>(
      src, 0, 0, 0, ntok, 0, qa, smem, [&](const int(&pos)[4], int gr, const float(&x)[4]) {
        if (gr >= group) return;
#pragma unroll
        for (int k = 0; k < 4; ++k)
          if (x[k] != -INFINITY)
            atomicMax(&maxima[gr * cap + pos_block[pos[k]]], float_order_key(x[k]));
      });
  __syncthreads();
  const int64_t item = int64_t(bh) * p.parts + part;
  tiles::merge_warp_states<Cfg>(smem, group, [&](int hg, int d, float4 o, float lse) {
    const int64_t prow = item * group + hg;
    *reinterpret_cast<float4*>(p.partial_o + prow * D + d) = o;
    if (d == 0) p.partial_lse[prow] = lse;
  });
  for (int idx = tid; idx < group * cnt; idx += kT) {
    const int hg = idx / cnt, i = idx % cnt;
    p.block_max[(int64_t(b) * p.num_q_heads + h * group + hg) * p.list_cap + k0 + i] =
        float_from_order_key(maxima[hg * cap + i]);
    if (hg == 0) p.block_ids[int64_t(bh) * p.list_cap + k0 + i] = blocks_s[i];
  }
}

// Query head qh's part of sequence b's history row from its step: each of the K attended
// blocks' probability, exp(its largest scaled score - lse), the group's largest when the
// history is per kv head (the slot was zeroed by the step). Every thread of the CTA calls it.
__device__ __forceinline__ void store_sparse_row(const HistoryState& hist, int b, int qh, float lse,
                                                 const float* block_max, const int32_t* ids,
                                                 int K) {
  const float lse2 = lse * tiles::kLog2e;
  float* hrow = hist.slot(b, qh / hist.group, hist.count[b] % hist.history);
  for (int r = threadIdx.x; r < K; r += blockDim.x) {
    const float v = exp2f(block_max[r] - lse2);
    if (hist.group == 1)
      hrow[ids[r]] = v;
    else  // the group's largest: probabilities are >= 0, so their float bits order as ints
      atomicMax(reinterpret_cast<int*>(hrow + ids[r]), __float_as_int(v));
  }
}

template <int D>
__global__ void __launch_bounds__(kSparseMergeWarps * 32)
    sparse_merge_kernel(const __grid_constant__ SparseParams p) {
  __shared__ WarpAccumulators<kSparseMergeWarps, D> warp_acc;
  __shared__ float s_lse;
  const int row = blockIdx.x, b = row / p.num_q_heads, qh = row % p.num_q_heads;
  const int h = qh / p.group, hg = qh % p.group, bh = b * p.num_kv_heads + h;
  // Everything below reads what sparse_attend_kernel wrote.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  merge_row_states<D, kSparseMergeWarps>(p.partial_lse, p.partial_o,
                                         int64_t(bh) * p.parts * p.group + hg, p.group, p.parts,
                                         warp_acc, p.o + int64_t(row) * D, &s_lse);
  __syncthreads();
  const float lse = s_lse;
  if (threadIdx.x == 0 && p.lse) p.lse[row] = lse;
  if (!p.append) return;
  if (p.row_apart) {
    if (threadIdx.x == 0) p.row_lse[row] = lse;
    return;
  }
  store_sparse_row(p.hist, b, qh, lse, p.block_max + int64_t(row) * p.list_cap,
                   p.block_ids + int64_t(bh) * p.list_cap, min(p.block_count[bh], p.list_cap));
  finish_row(p.hist, p.seq_lens, p.batch, p.done);
}

// sparse_row_cuda's kernel: the merge kernel's history stores, a CTA per (b, query head), from
// a SparseRow the step wrote.
struct SparseRowParams {
  SparseRow row;
  HistoryState hist;
  const int32_t* seq_lens;
  int batch, num_q_heads, num_kv_heads, list_cap;
};
__global__ void __launch_bounds__(kSparseMergeWarps * 32)
    sparse_row_kernel(const __grid_constant__ SparseRowParams p) {
  const int row = blockIdx.x, b = row / p.num_q_heads, qh = row % p.num_q_heads;
  const int bh = b * p.num_kv_heads + qh / (p.num_q_heads / p.num_kv_heads);
  store_sparse_row(p.hist, b, qh, p.row.lse[row], p.row.block_max + int64_t(row) * p.list_cap,
                   p.row.block_ids + int64_t(bh) * p.list_cap,
                   min(p.row.block_count[bh], p.list_cap));
  finish_row(p.hist, p.seq_lens, p.batch, p.row.done);
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

cudaError_t reset_cnn_cache_cuda(const float* params, const CnnCache& cache, int batch,
                                 cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  if (!cache.count || !cache.frags) return cudaErrorInvalidValue;
  pack_frags_kernel<<<1, 4 * 32, 0, stream>>>(params, cache.frags);
  reset_cnn_cache_kernel<<<(batch + 127) / 128, 128, 0, stream>>>(cache, batch);
  return cudaGetLastError();
}

cudaError_t predict_cuda(const float* params, const HistoryState& hist, const CnnCache& cache,
                         int batch, const Geometry& g, float* scores, int rows_between,
                         cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  if (!cache.s || !cache.edge || !cache.count || !cache.end || !cache.sum || !cache.frags ||
      hist.history < 1)
    return cudaErrorInvalidValue;
  const int n_tiles = (hist.max_blocks + kTile - 1) / kTile;
  const int n_fix = (std::max(0, hist.history - 5) + kFixRows - 1) / kFixRows;
  const dim3 grid(n_tiles + n_fix, hist.num_heads, batch);
  if (rows_between > 1)
    predict_rows_kernel<true><<<grid, kCnnThreads, 0, stream>>>(params, hist, cache, g, n_tiles);
  else
    predict_rows_kernel<false><<<grid, kCnnThreads, 0, stream>>>(params, hist, cache, g, n_tiles);
  const dim3 sum_grid((hist.max_blocks + kThreads - 1) / kThreads, hist.num_heads, batch);
  predict_sum_kernel<<<sum_grid, kThreads, 0, stream>>>(params, hist, cache, g, scores);
  return cudaGetLastError();
}

cudaError_t select_blocks_cuda(const float* scores, const HistoryState& hist, int batch,
                               int num_kv_heads, const Geometry& g, int k_blocks,
                               uint8_t* block_flags, cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(block_flags, 0,
                                  size_t(hist.max_batch) * num_kv_heads * hist.max_blocks, stream);
  if (e != cudaSuccess || batch <= 0) return e;
  select_kernel<<<batch * hist.num_heads, kSelThreads, 0, stream>>>(scores, hist, num_kv_heads, g,
                                                                    k_blocks, block_flags);
  return cudaGetLastError();
}

cudaError_t build_selection_cuda(const PagedKV& kv, const uint8_t* block_flags, int max_blocks,
                                 const Geometry& g, const int32_t* block_slot,
                                 const tactic::Selection& sel, unsigned long long* counters,
                                 cudaStream_t stream) {
  if (kv.batch <= 0) return cudaSuccess;
  const dim3 grid(kv.batch * kv.num_kv_heads, (max_blocks + kListBlocks - 1) / kListBlocks);
  build_selection_kernel<<<grid, kListBlocks, 0, stream>>>(kv, block_flags, max_blocks, g,
                                                           block_slot, sel, counters);
  return cudaGetLastError();
}

// Scratch of append_row_cuda: scores [max_batch, Hq, max_tokens] | chunk partials
// [max_batch, Hq, chunks] (float2).
static int score_chunks(int max_tokens) { return (max_tokens + kScoreChunk - 1) / kScoreChunk; }

size_t row_scratch_bytes(int max_batch, int num_q_heads, int max_tokens) {
  const size_t heads = size_t(max_batch) * num_q_heads;
  const size_t score_bytes = (heads * size_t(max_tokens) * sizeof(float) + 255) / 256 * 256;
  return score_bytes + heads * size_t(score_chunks(max_tokens)) * sizeof(float2) +
         sizeof(unsigned int);
}
struct RowScratch {
  float* scores;
  float2* partials;
  unsigned int* pool_done;
};
static RowScratch row_scratch(void* scratch, int batch, int num_q_heads, int max_tokens) {
  const size_t heads = size_t(batch) * num_q_heads;
  float2* partials = reinterpret_cast<float2*>(
      static_cast<char*>(scratch) + (heads * max_tokens * sizeof(float) + 255) / 256 * 256);
  return {static_cast<float*>(scratch), partials,
          reinterpret_cast<unsigned int*>(partials + heads * score_chunks(max_tokens))};
}

// A full row by the ring kernel (bf16 keys from the cache, or e4m3 or int4 ones from a
// KeyCopy) and the pool: its CTAs over the batch's kv heads in one wave, its parts' partials in
// place of the chunks' (at most `chunks` of them).
template <RingKeys K>
static cudaError_t launch_full_row_ring(const bf16* q, int num_q_heads, const PagedKV& view,
                                        const KeyCopy& copy, const int32_t* kv_lens, int batch,
                                        float scale, const Geometry& g, const HistoryState& hist,
                                        float* scores, float2* partials, int chunks,
                                        unsigned int* pool_done, cudaStream_t stream) {
  const int num_kv_heads = view.num_kv_heads, d = view.head_dim;
  auto ring = d == 128 ? row_max_ring_kernel<128, K> : row_max_ring_kernel<64, K>;
  SmInfo info;
  if (const cudaError_t e = sm_info(&info); e != cudaSuccess) return e;
  const size_t smem =
      ring_launch_smem(d == 128 ? ring_smem_bytes<128, K>() : ring_smem_bytes<64, K>(), info);
  int per_sm = 0;  // also lets the kernel take its shared memory past 48 KB
  if (const cudaError_t e =
          resident_ctas_per_sm(reinterpret_cast<const void*>(ring), kRingWarps * 32, smem, &per_sm);
      e != cudaSuccess)
    return e;
  const int parts = std::max(1, std::min(chunks, info.sms / std::max(1, batch * num_kv_heads)));
  ring<<<dim3(batch * num_kv_heads, parts), kRingWarps * 32, smem, stream>>>(
      q, num_q_heads, view, copy, num_kv_heads, scale, scores, partials, parts, hist, g.block,
      pool_done);
  const int pool_parts = (hist.max_blocks + kPoolMaxBlocks - 1) / kPoolMaxBlocks;
  row_pool_max_kernel<<<dim3(batch * num_q_heads, pool_parts), kThreads, 0, stream>>>(
      num_q_heads, view, scores, partials, parts, true, g, hist, kv_lens, batch, pool_done);
  return cudaGetLastError();
}

cudaError_t append_row_cuda(const bf16* q, int num_q_heads, const PagedKV& view,
                            const int32_t* token_ids, int ids_stride, const int32_t* kv_lens,
                            int batch, int num_kv_heads, float scale, const Geometry& g,
                            const HistoryState& hist, void* scratch, size_t scratch_bytes,
                            bool keys_on_host, cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  const int group = num_q_heads / num_kv_heads;
  if (group > kMaxGroup || (view.head_dim != 64 && view.head_dim != 128) ||
      (hist.group != 1 && hist.group != group) || hist.num_heads * hist.group != num_q_heads)
    return cudaErrorInvalidValue;
  const bool sub = token_ids != nullptr;
  // List length bound: the sub-request stride, or the longest context the history holds.
  const int max_tokens = sub ? ids_stride : hist.max_blocks * g.block;
  if (scratch_bytes < row_scratch_bytes(batch, num_q_heads, max_tokens))
    return cudaErrorInvalidValue;
  const int chunks = score_chunks(max_tokens);
  const RowScratch rs = row_scratch(scratch, batch, num_q_heads, max_tokens);
  float* scores = rs.scores;
  float2* partials = rs.partials;
  unsigned int* pool_done = rs.pool_done;
  const dim3 chunk_grid(batch * num_kv_heads, chunks);
  // Mapped host memory is read far better by 16-byte lanes per key: offload mode's 128K step
  // measured 1273-1278 us with them against 1333-1335 with the tensor-core form. A full row
  // from device memory pools its block maxima in the score kernel (blocks of 8, 16 or 32
  // tokens: whole blocks in a warp's 32 keys); any other row writes every score, and
  // row_pool_kernel pools them.
  const bool pooled = !sub && !keys_on_host && (g.block == 8 || g.block == 16 || g.block == 32);
  int sms = 0;
  if (const cudaError_t e = sm_count(&sms); e != cudaSuccess) return e;
  // Blocks of 8 or 16 from device memory whose rows fit in int32: the ring kernel.
  if (pooled && g.block != 32 &&
      int64_t(view.num_pages) * view.page_size * view.num_kv_heads <= INT_MAX)
    return launch_full_row_ring<RingKeys::Bf16>(q, num_q_heads, view, KeyCopy{}, kv_lens, batch,
                                                scale, g, hist, scores, partials, chunks, pool_done,
                                                stream);
  auto kernel = view.head_dim == 128 ? (keys_on_host ? row_scores_kernel<128>
                                        : pooled     ? row_scores_mma_kernel<128, true>
                                                     : row_scores_mma_kernel<128, false>)
                                     : (keys_on_host ? row_scores_kernel<64>
                                        : pooled     ? row_scores_mma_kernel<64, true>
                                                     : row_scores_mma_kernel<64, false>);
  // The tensor-core form walks a full row's chunks in one wave of CTAs (2 per SM); the lane
  // form keeps a CTA per chunk.
  dim3 grid = chunk_grid;
  if (!keys_on_host) grid.y = std::min<unsigned>(grid.y, std::max(1u, unsigned(2 * sms) / grid.x));
  kernel<<<grid, kThreads, 0, stream>>>(q, num_q_heads, view, sub, num_kv_heads, scale, scores,
                                        max_tokens, partials, chunks, hist, pooled ? g.block : 0,
                                        pool_done);
  if (pooled) {
    const int parts = (hist.max_blocks + kPoolMaxBlocks - 1) / kPoolMaxBlocks;
    row_pool_max_kernel<<<dim3(batch * num_q_heads, parts), kThreads, 0, stream>>>(
        num_q_heads, view, scores, partials, chunks, false, g, hist, kv_lens, batch, pool_done);
  } else {
    const int pool_chunks = (max_tokens + kRowChunk - 1) / kRowChunk;
    row_pool_kernel<<<dim3(batch * num_q_heads, pool_chunks), kThreads, 0, stream>>>(
        num_q_heads, view, sub, token_ids, ids_stride, num_kv_heads, scores, max_tokens, partials,
        chunks, g, hist, kv_lens, batch, pool_done);
  }
  return cudaGetLastError();
}

// quantize_keys_kernel's grid: one CTA a kv head for the few keys since a row's last (its 8
// warps take 8 keys at once), or as wide as the device for a prompt.
static cudaError_t quantize_keys(const PagedKV& kv, const KeyCopy& copy, int batch, bool wide,
                                 cudaStream_t stream) {
  int ctas = 1;
  if (wide) {
    int sms = 0;
    if (const cudaError_t e = sm_count(&sms); e != cudaSuccess) return e;
    ctas = std::max(1, 4 * sms / (batch * kv.num_kv_heads));
  }
  const dim3 grid(batch * kv.num_kv_heads, ctas);
  const bool int4 = copy.format == KeyFormat::Int4;
  auto kernel = kv.head_dim == 128 ? (int4 ? quantize_keys_kernel<128, KeyFormat::Int4>
                                           : quantize_keys_kernel<128, KeyFormat::E4m3>)
                                   : (int4 ? quantize_keys_kernel<64, KeyFormat::Int4>
                                           : quantize_keys_kernel<64, KeyFormat::E4m3>);
  kernel<<<grid, kThreads, 0, stream>>>(kv, copy);
  return cudaGetLastError();
}

static bool copy_fits(const PagedKV& kv, const KeyCopy& copy, int batch) {
  return batch <= copy.max_batch && copy.num_kv_heads == kv.num_kv_heads &&
         copy.head_dim == kv.head_dim && (kv.head_dim == 64 || kv.head_dim == 128) &&
         copy.max_tokens % tiles::kTile == 0;
}

cudaError_t fill_key_copy_cuda(const PagedKV& kv, const KeyCopy& copy, int batch,
                               cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  if (!copy_fits(kv, copy, batch)) return cudaErrorInvalidValue;
  if (const cudaError_t e = cudaMemsetAsync(copy.len, 0, size_t(batch) * sizeof(int32_t), stream);
      e != cudaSuccess)
    return e;
  if (const cudaError_t e = quantize_keys(kv, copy, batch, true, stream); e != cudaSuccess)
    return e;
  return cudaMemcpyAsync(copy.len, kv.seq_lens, size_t(batch) * sizeof(int32_t),
                         cudaMemcpyDeviceToDevice, stream);
}

cudaError_t append_full_row_from_copy_cuda(const bf16* q, int num_q_heads, const PagedKV& kv,
                                           int batch, float scale, const Geometry& g,
                                           const HistoryState& hist, const KeyCopy& copy,
                                           void* scratch, size_t scratch_bytes,
                                           cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  const int hkv = kv.num_kv_heads, group = num_q_heads / hkv;
  if (group > kMaxGroup || !copy_fits(kv, copy, batch) || (g.block != 8 && g.block != 16) ||
      (hist.group != 1 && hist.group != group) || hist.num_heads * hist.group != num_q_heads ||
      copy.max_tokens < hist.max_blocks * g.block)
    return cudaErrorInvalidValue;
  const int max_tokens = hist.max_blocks * g.block;
  if (scratch_bytes < row_scratch_bytes(batch, num_q_heads, max_tokens))
    return cudaErrorInvalidValue;
  const RowScratch rs = row_scratch(scratch, batch, num_q_heads, max_tokens);
  if (const cudaError_t e = quantize_keys(kv, copy, batch, false, stream); e != cudaSuccess)
    return e;
  auto launch = copy.format == KeyFormat::Int4 ? launch_full_row_ring<RingKeys::Int4>
                                               : launch_full_row_ring<RingKeys::E4m3>;
  return launch(q, num_q_heads, kv, copy, kv.seq_lens, batch, scale, g, hist, rs.scores,
                rs.partials, score_chunks(max_tokens), rs.pool_done, stream);
}

// Workspace of sparse_attend_cuda: partial lse [items, group] | partial o [items, group, D] |
// block maxima [max_batch * Hq, list_cap] | block ids [max_batch * Hkv, list_cap] | block
// counts [max_batch * Hkv] | the merge's count of finished CTAs.
struct SparseWorkspace {
  size_t lse, o, max, ids, count, done, total;
};
static SparseWorkspace sparse_workspace(int max_batch, int num_q_heads, int num_kv_heads,
                                        int head_dim, int list_cap) {
  auto up = [](size_t x) { return (x + 255) / 256 * 256; };
  const size_t bh = size_t(max_batch) * num_kv_heads;
  const size_t states = std::max<size_t>(bh, kSparseItemsCap) * size_t(num_q_heads / num_kv_heads);
  SparseWorkspace w;
  w.lse = 0;
  w.o = up(states * sizeof(float));
  w.max = w.o + up(states * head_dim * sizeof(float));
  w.ids = w.max + up(size_t(max_batch) * num_q_heads * list_cap * sizeof(float));
  w.count = w.ids + up(bh * list_cap * sizeof(int32_t));
  w.done = w.count + up(bh * sizeof(int32_t));
  w.total = w.done + up(sizeof(unsigned int));
  return w;
}

size_t sparse_attend_workspace_bytes(int max_batch, int num_q_heads, int num_kv_heads, int head_dim,
                                     int list_cap) {
  if (max_batch < 1 || num_kv_heads < 1 || num_q_heads % num_kv_heads != 0 || list_cap < 1)
    throw std::invalid_argument("sparse_attend_workspace_bytes: max_batch " +
                                std::to_string(max_batch) + ", heads " +
                                std::to_string(num_q_heads) + " / " + std::to_string(num_kv_heads) +
                                ", list_cap " + std::to_string(list_cap));
  return sparse_workspace(max_batch, num_q_heads, num_kv_heads, head_dim, list_cap).total;
}

template <int D>
static cudaError_t launch_sparse_attend(SparseParams p, int sms, cudaStream_t stream) {
  using Cfg = tiles::TileConfig<D, kSparseWarps, kSparseStages>;
  const int bh = p.batch * p.num_kv_heads;
  // About two CTAs per SM over the batch's lists (the dense kernel's wave with the same tile
  // loop), a round of tiles (a block per warp) each at least, within the workspace's items.
  const int rounds = (p.list_cap + kSparseWarps - 1) / kSparseWarps;
  p.parts = std::max(1, std::min({rounds, 2 * sms / bh, kSparseItemsCap / bh}));
  p.share_cap = (p.list_cap + p.parts - 1) / p.parts;
  const size_t smem = sparse_smem(Cfg::smem_bytes(), p.max_blocks, p.share_cap, p.geo.block).total;
  auto kernel = sparse_attend_kernel<Cfg>;
  int per_sm = 0;
  if (const cudaError_t e =
          resident_ctas_per_sm(reinterpret_cast<const void*>(kernel), Cfg::kThreads, smem, &per_sm);
      e != cudaSuccess)
    return e;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  // Both kernels at the device's greatest priority: the engine's calibration rows and
  // predictions run beside them on branches, and the SMs their CTAs free go to the step first.
  // Over 32 layers in one graph (instantiated to honour node priorities) at 128K grouped, P 4,
  // on an H200: 32.2 us a step against 36.4, 31.7 with the calibration row then in four waves;
  // docs/gpu.md, 2026-11-30.
  if (const cudaError_t e =
          launch_ex(LaunchHow{false, true}, kernel, dim3(unsigned(p.parts), unsigned(bh)),
                    dim3(Cfg::kThreads), smem, stream, p);
      e != cudaSuccess)
    return e;
  return launch_ex(LaunchHow{true, true}, sparse_merge_kernel<D>,
                   dim3(unsigned(p.batch * p.num_q_heads)), dim3(kSparseMergeWarps * 32), 0, stream,
                   p);
}

cudaError_t sparse_attend_cuda(const bf16* q, int num_q_heads, const PagedKV& kv, float scale,
                               const uint8_t* block_flags, int max_blocks, const Geometry& g,
                               int list_cap, const HistoryState* hist, const tactic::Selection& sel,
                               unsigned long long* counters, bf16* out, float* lse, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream, const SparseRow* row) {
  if (kv.batch <= 0) return cudaSuccess;
  if (row && (!row->block_max || !row->block_ids || !row->block_count || !row->lse || !row->done))
    return cudaErrorInvalidValue;
  const int hkv = kv.num_kv_heads, d = kv.head_dim;
  if ((d != 64 && d != 128) || hkv < 1 || num_q_heads % hkv != 0 || num_q_heads / hkv > kMaxGroup ||
      list_cap < 1 || max_blocks < 1)
    return cudaErrorInvalidValue;
  const int group = num_q_heads / hkv;
  if (hist && ((hist->group != 1 && hist->group != group) ||
               hist->num_heads * hist->group != num_q_heads || hist->max_blocks != max_blocks))
    return cudaErrorInvalidValue;
  if (int64_t(kv.num_pages) * kv.page_size * hkv > INT_MAX) return cudaErrorInvalidValue;
  const SparseWorkspace w = sparse_workspace(kv.batch, num_q_heads, hkv, d, list_cap);
  if (workspace_bytes < w.total) return cudaErrorInvalidValue;
  int sms = 0;
  if (const cudaError_t e = sm_count(&sms); e != cudaSuccess) return e;
  char* ws = static_cast<char*>(workspace);
  SparseParams p{};
  p.q = reinterpret_cast<const bf*>(q);
  p.kv = tiles::KvSource{reinterpret_cast<const bf*>(kv.k),
                         reinterpret_cast<const bf*>(kv.v),
                         kv.page_table,
                         kv.page_size,
                         hkv,
                         kv.max_pages_per_seq,
                         scale * tiles::kLog2e};
  p.seq_lens = kv.seq_lens;
  p.batch = kv.batch;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = hkv;
  p.group = group;
  p.flags = block_flags;
  p.max_blocks = max_blocks;
  p.geo = g;
  p.list_cap = list_cap;
  p.partial_lse = reinterpret_cast<float*>(ws + w.lse);
  p.partial_o = reinterpret_cast<float*>(ws + w.o);
  p.block_max = reinterpret_cast<float*>(ws + w.max);
  p.block_ids = reinterpret_cast<int32_t*>(ws + w.ids);
  p.block_count = reinterpret_cast<int32_t*>(ws + w.count);
  p.tokens = sel.tokens;
  p.token_count = sel.counts;
  p.tokens_stride = sel.max_tokens;
  p.counters = counters;
  if (hist) p.hist = *hist;
  p.append = hist != nullptr;
  p.done = reinterpret_cast<unsigned int*>(ws + w.done);
  p.row_apart = hist && row;
  if (p.row_apart) {
    p.block_max = row->block_max;
    p.block_ids = row->block_ids;
    p.block_count = row->block_count;
    p.row_lse = row->lse;
    p.done = row->done;
  }
  p.o = reinterpret_cast<bf*>(out);
  p.lse = lse;
  return d == 128 ? launch_sparse_attend<128>(p, sms, stream)
                  : launch_sparse_attend<64>(p, sms, stream);
}

cudaError_t sparse_row_cuda(const SparseRow& row, const HistoryState& hist, const int32_t* seq_lens,
                            int batch, int num_q_heads, int num_kv_heads, int list_cap,
                            cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  if (num_kv_heads < 1 || num_q_heads % num_kv_heads != 0 || list_cap < 1 ||
      hist.num_heads * hist.group != num_q_heads || !row.block_max || !row.block_ids ||
      !row.block_count || !row.lse || !row.done)
    return cudaErrorInvalidValue;
  const SparseRowParams p{row, hist, seq_lens, batch, num_q_heads, num_kv_heads, list_cap};
  sparse_row_kernel<<<batch * num_q_heads, kSparseMergeWarps * 32, 0, stream>>>(p);
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
  plan_resident_kernel<<<host_kv.batch * cache.num_kv_heads, kSelThreads, smem, stream>>>(
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
