// CUDA MAC-Attention decode (mac.h): match -> attend (band + tail, or everything on a miss)
// -> complete + rectify-append, three launches with no host sync, so a step is capturable.
//
// Planning happens on the device inside the match launch: the CTA that finishes a (b, h)
// last (arrival counter) reduces the tiles and decides hit / start, and the CTA that
// finishes the grid last cuts each (sequence, kv head)'s union span [min_h start_h, t] into
// chunks whose length spreads the total tokens over about one wave of attention CTAs (a
// prefix sum over the pairs gives each chunk its item index). Chunks never straddle E(t), so
// every chunk's state belongs either to `new` (tokens below E(t)) or to the tail.
//
// The attention kernel follows dense_decode.cu (split-KV over 16-token tiles, per-warp
// cp.async rings, bf16 mma with the group's query heads as rows, online softmax in the log2
// domain) with two differences: a head row masks tokens below its own start, so a group
// reads its KV once for the union of its heads' spans; and every chunk writes a partial
// state, since the complete kernel merges states with the reused entries anyway. A row with
// every token of a tile masked keeps its state (the -inf max is replaced by 0 in the
// exponentials, so exp2(-inf - -inf) never happens).
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>

#include "kernels/common/merge_states.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/mac/mac.h"

namespace kvs::kernels::mac {
namespace {

constexpr int kMatchWarps = 4;
constexpr int kRowsPerWarp = 16;
constexpr int kMatchTile = kMatchWarps * kRowsPerWarp;  // ring slots per match CTA
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 16;
constexpr int kStages = 3;
constexpr int kMaxGroup = 8;
constexpr int kChunkAlign = kWarps * kTile;
// Cap on the chunks the planner aims for; with 2 chunks per pair of slack it bounds the
// items, so the workspace size depends only on the shapes.
constexpr int kMaxChunks = 1024;
constexpr int kMergeWarps = 4;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFull = 0xffffffffu;

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

struct Layout {
  size_t tile_d2, tile_pos, head_start, head_slot, pair_info, items, num_items, partial_lse,
      partial_o, total;
};

int match_tiles(int window) { return (window + kMatchTile - 1) / kMatchTile; }
int max_items(int max_batch, int num_kv_heads) { return kMaxChunks + 2 * max_batch * num_kv_heads; }

Layout layout(int max_batch, int num_q_heads, int num_kv_heads, int head_dim, int window) {
  const size_t rows = size_t(max_batch) * num_q_heads;
  const size_t tiles = rows * size_t(match_tiles(window));
  const size_t items = size_t(max_items(max_batch, num_kv_heads));
  const size_t group = size_t(num_q_heads / num_kv_heads);
  Layout l;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at += align_up(bytes);
    return here;
  };
  l.tile_d2 = take(tiles * sizeof(float));
  l.tile_pos = take(tiles * sizeof(int32_t));
  l.head_start = take(rows * sizeof(int32_t));
  l.head_slot = take(rows * sizeof(int32_t));
  l.pair_info = take(size_t(max_batch) * num_kv_heads * sizeof(int4));
  l.items = take(items * sizeof(int4));
  l.num_items = take(sizeof(int32_t));
  l.partial_lse = take(items * group * sizeof(float));
  l.partial_o = take(items * group * head_dim * sizeof(float));
  l.total = at;
  return l;
}

struct Params {
  const __nv_bfloat16* q;
  const __nv_bfloat16* q_pre;
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  const int32_t* page_table;
  const int32_t* seq_lens;
  int batch;
  int page_size;
  int num_kv_heads;
  int max_pages_per_seq;
  int num_q_heads;
  int group;
  int tiles;
  int chunks_target;
  float scale_log2;
  RingState st;
  MatchParams mp;
  __nv_bfloat16* out;
  float* lse;  // may be null
  unsigned long long* counters;  // may be null
  int32_t* row_arrivals;   // [batch * Hq], zero between launches
  int32_t* grid_arrival;   // [1], zero between launches
  float* tile_d2;
  int32_t* tile_pos;
  int32_t* head_start;
  int32_t* head_slot;
  int4* pair_info;  // {first item, R items, T items, span start}
  int4* items;      // {pair, begin, end, part (0: below E(t), 1: tail)}
  int32_t* num_items;
  float* partial_lse;  // [items, group]
  float* partial_o;    // [items, group, D]
};

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(kFull, x, off);
  return x;
}

// (d2, pos) order of the match: smaller distance, then the older position.
__device__ __forceinline__ bool better(float d2, int pos, float best_d2, int best_pos) {
  return pos >= 0 && (best_pos < 0 || d2 < best_d2 || (d2 == best_d2 && pos < best_pos));
}

__device__ __forceinline__ void warp_argmin(float* d2, int* pos) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float od = __shfl_xor_sync(kFull, *d2, off);
    const int op = __shfl_xor_sync(kFull, *pos, off);
    if (better(od, op, *d2, *pos)) {
      *d2 = od;
      *pos = op;
    }
  }
}

template <int D>
__device__ __forceinline__ void load_bf16(const __nv_bfloat16* row, int lane, float (&x)[D / 32]) {
  constexpr int kPer = D / 32;
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(row + lane * kPer);
#pragma unroll
  for (int k = 0; k < kPer / 2; ++k) {
    const float2 f = __bfloat1622float2(p[k]);
    x[2 * k] = f.x;
    x[2 * k + 1] = f.y;
  }
}

// Folds query x (this lane's dims) into the running means of (b, h): one warp.
template <int D>
__device__ void update_running_means(const RingState& st, const MatchParams& mp, int b, int h,
                                     int lane, const float (&x)[D / 32]) {
  constexpr int kPer = D / 32;
  float sq = 0.f;
#pragma unroll
  for (int k = 0; k < kPer; ++k) sq += x[k] * x[k];
  sq = warp_sum(sq);
  int32_t count = st.q_count[st.head(b, h)];
  const float w = stats_weight(&count, mp.stats_horizon);
  float* mean = st.q_mean + st.head(b, h) * D + lane * kPer;
#pragma unroll
  for (int k = 0; k < kPer; ++k) mean[k] += w * (x[k] - mean[k]);
  __syncwarp();  // every lane read the old count and q_sq before lane 0 writes them
  if (lane == 0) {
    st.q_count[st.head(b, h)] = count;
    float& s = st.q_sq[st.head(b, h)];
    s += w * (sq - s);
  }
}

__device__ __forceinline__ int64_t plan_chunk(int64_t total, int target) {
  const int64_t c = (total + target - 1) / target;
  const int64_t aligned = (c + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  return aligned > kChunkAlign ? aligned : kChunkAlign;
}

// Block-wide exclusive scan of one int per thread (blockDim.x = kThreads); *total gets the sum.
__device__ int block_exclusive_scan(int x, int* total) {
  __shared__ int warp_sums[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int incl = x;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(kFull, incl, off);
    if (lane >= off) incl += y;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  int before = 0, sum = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    before += w < warp ? warp_sums[w] : 0;
    sum += warp_sums[w];
  }
  __syncthreads();  // warp_sums is reused by the next call
  *total = sum;
  return before + incl - x;
}

// The start of the union span of pair (b, kv head): the smallest start of its heads.
__device__ int span_start(const Params& p, int b, int kvh, int et) {
  int s = et;
  for (int g = 0; g < p.group; ++g)
    s = min(s, __ldcg(p.head_start + int64_t(b) * p.num_q_heads + kvh * p.group + g));
  return s;
}

// The last CTA of the match grid: chunks of every pair's span (see the file comment).
__device__ void plan(const Params& p) {
  __shared__ unsigned long long s_total;
  const int pairs = p.batch * p.num_kv_heads;
  unsigned long long total = 0, context = 0;
  for (int pr = threadIdx.x; pr < pairs; pr += kThreads) {
    const int b = pr / p.num_kv_heads, kvh = pr % p.num_kv_heads;
    const int len = p.seq_lens[b];
    if (len == 0) continue;
    total += len - span_start(p, b, kvh, cache_end(len - 1, p.mp.band));
    context += len;
  }
  if (threadIdx.x == 0) s_total = 0;
  __syncthreads();
  atomicAdd(&s_total, total);
  if (p.counters) {
    atomicAdd(p.counters + kRowsRead, total);
    atomicAdd(p.counters + kRowsContext, context);
  }
  __syncthreads();
  const int64_t chunk = plan_chunk(int64_t(s_total), p.chunks_target);
  int carry = 0;
  for (int base = 0; base < pairs; base += kThreads) {
    const int pr = base + threadIdx.x;
    int n_r = 0, n_t = 0, s = 0, et = 0, len = 0;
    if (pr < pairs) {
      const int b = pr / p.num_kv_heads, kvh = pr % p.num_kv_heads;
      len = p.seq_lens[b];
      if (len > 0) {
        et = cache_end(len - 1, p.mp.band);
        s = span_start(p, b, kvh, et);
        n_r = int((et - s + chunk - 1) / chunk);
        n_t = int((len - et + chunk - 1) / chunk);
      }
    }
    int round_total = 0;
    const int first = carry + block_exclusive_scan(n_r + n_t, &round_total);
    if (pr < pairs) {
      p.pair_info[pr] = make_int4(first, n_r, n_t, s);
      for (int i = 0; i < n_r; ++i) {
        const int64_t lo = s + int64_t(i) * chunk;
        p.items[first + i] = make_int4(pr, int(lo), int(lo + chunk < et ? lo + chunk : et), 0);
      }
      for (int i = 0; i < n_t; ++i) {
        const int64_t lo = et + int64_t(i) * chunk;
        p.items[first + n_r + i] = make_int4(pr, int(lo), int(lo + chunk < len ? lo + chunk : len), 1);
      }
    }
    carry += round_total;
  }
  if (threadIdx.x == 0) {
    *p.num_items = carry;
    *p.grid_arrival = 0;  // ready for the next launch
  }
}

// Grid (tiles, Hq, batch). Each warp scores 16 ring slots of the tile against the query.
template <int D>
__global__ void __launch_bounds__(kMatchWarps * 32) match_kernel(const __grid_constant__ Params p) {
  constexpr int kPer = D / 32;
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int W = p.st.window;
  const int len = p.seq_lens[b];
  const int t = len - 1;
  const int64_t head_row = p.st.head(b, h);
  __shared__ float s_d2[kMatchWarps];
  __shared__ int s_pos[kMatchWarps];
  __shared__ int s_scanned[kMatchWarps];
  __shared__ bool s_last, s_plan;

  float best = INFINITY;
  int best_pos = -1, scanned = 0;
  if (t >= 0 && t >= p.mp.min_context) {  // ineligible steps skip the scan (CPU: match_cpu)
    float qv[kPer];
    load_bf16<D>(p.q_pre + head_row * D, lane, qv);
    const int lo = t - W > 0 ? t - W : 0;
    const int slot0 = tile * kMatchTile + warp * kRowsPerWarp;
    int my_pos = -1;
    if (lane < kRowsPerWarp && slot0 + lane < W) my_pos = p.st.pos[int64_t(b) * W + slot0 + lane];
    const unsigned valid = __ballot_sync(kFull, my_pos >= lo && my_pos < t) & 0xffffu;
    scanned = __popc(valid);
    // All loads first, so that 16 rows are in flight per warp.
    uint32_t raw[kRowsPerWarp][kPer / 2];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      if (valid >> i & 1u) {
        const uint32_t* row = reinterpret_cast<const uint32_t*>(
            p.st.q + p.st.row(b, slot0 + i, h) * D + lane * kPer);
#pragma unroll
        for (int k = 0; k < kPer / 2; ++k) raw[i][k] = row[k];
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      float s = 0.f;
      if (valid >> i & 1u) {
#pragma unroll
        for (int k = 0; k < kPer / 2; ++k) {
          const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[i][k]));
          const float d0 = qv[2 * k] - x.x, d1 = qv[2 * k + 1] - x.y;
          s = fmaf(d0, d0, s);
          s = fmaf(d1, d1, s);
        }
      }
      s = warp_sum(s);  // warp-uniform branch: every lane takes part
      const int pos = __shfl_sync(kFull, my_pos, i);
      if ((valid >> i & 1u) && better(s, pos, best, best_pos)) {
        best = s;
        best_pos = pos;
      }
    }
  }
  if (lane == 0) {
    s_d2[warp] = best;
    s_pos[warp] = best_pos;
    s_scanned[warp] = scanned;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int rows = 0;
    for (int w = 0; w < kMatchWarps; ++w) {
      rows += s_scanned[w];
      if (better(s_d2[w], s_pos[w], best, best_pos)) {
        best = s_d2[w];
        best_pos = s_pos[w];
      }
    }
    const int64_t at = head_row * p.tiles + tile;
    p.tile_d2[at] = best;
    p.tile_pos[at] = best_pos;
    if (p.counters && rows > 0)
      atomicAdd(p.counters + kSelectionBytes, (unsigned long long)rows * D * 2);
    __threadfence();  // the tile is visible before the arrival is counted
    s_last = atomicAdd(p.row_arrivals + head_row, 1) == p.tiles - 1;
  }
  __syncthreads();
  if (!s_last) return;

  // Last tile of (b, h): decide.
  __threadfence();
  if (warp == 0) {
    float d2 = INFINITY;
    int pos = -1;
    for (int i = lane; i < p.tiles; i += 32) {
      const float td = __ldcg(p.tile_d2 + head_row * p.tiles + i);
      const int tp = __ldcg(p.tile_pos + head_row * p.tiles + i);
      if (better(td, tp, d2, pos)) {
        d2 = td;
        pos = tp;
      }
    }
    warp_argmin(&d2, &pos);
    float mean[kPer];
    {
      const float* m = p.st.q_mean + head_row * D + lane * kPer;
#pragma unroll
      for (int k = 0; k < kPer; ++k) mean[k] = m[k];
    }
    float m2 = 0.f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) m2 += mean[k] * mean[k];
    m2 = warp_sum(m2);
    const float thr =
        match_threshold(p.mp, h, D, p.st.q_sq[head_row] - m2, p.st.q_count[head_row]);
    const bool hit = t >= p.mp.min_context && pos >= 0 && d2 < thr &&
                     isfinite(p.st.lse[p.st.row(b, pos % W, h)]);
    if (lane == 0) {
      const int start = hit ? cache_end(pos, p.mp.band) : 0;
      p.head_start[head_row] = start;
      p.head_slot[head_row] = hit ? pos % W : -1;
      p.st.last_start[head_row] = start;
      if (h == 0) p.st.last_len[b] = len;
      if (p.counters && len > 0) {
        atomicAdd(p.counters + kHeadSteps, 1ull);
        if (hit) {
          atomicAdd(p.counters + kHeadHits, 1ull);
          atomicAdd(p.counters + kSelectionBytes, (unsigned long long)(D * 2 + 4));
        }
      }
      p.row_arrivals[head_row] = 0;  // ready for the next launch
      __threadfence();
      s_plan = atomicAdd(p.grid_arrival, 1) == p.batch * p.num_q_heads - 1;
    }
  }
  __syncthreads();
  if (!s_plan) return;
  __threadfence();
  plan(p);
}

// One CTA per chunk item (grid.x bounds the items; the planned count is read on the device).
template <int D>
__global__ void __launch_bounds__(kThreads) attend_kernel(const __grid_constant__ Params p) {
  constexpr int kPieces = D / 8;
  constexpr int kTilePieces = kTile * kPieces;
  constexpr int kCopies = kTilePieces / 32;
  constexpr int kKSteps = D / 16;
  extern __shared__ uint4 smem[];

  const int item = blockIdx.x;
  if (item >= *p.num_items) return;
  const int4 it = p.items[item];
  const int b = it.x / p.num_kv_heads, kvh = it.x % p.num_kv_heads;
  const int begin = it.y, end = it.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  // Tokens below the start of this lane's head row are not its to read (a hit head reuses
  // them); the tail part holds no such tokens.
  const int row_start = it.w == 0 && g < p.group
                            ? p.head_start[int64_t(b) * p.num_q_heads + kvh * p.group + g]
                            : 0;

  const int num_tiles = (end - begin + kTile - 1) / kTile;
  const int my_tiles = warp < num_tiles ? (num_tiles - 1 - warp) / kWarps + 1 : 0;
  uint4* ring = smem + warp * (kStages * 2 * kTilePieces);
  const int32_t* table = p.page_table + int64_t(b) * p.max_pages_per_seq;
  auto tile_row = [&](int i) -> int {
    if (i >= my_tiles) return -1;
    const int t = begin + (warp + i * kWarps) * kTile + lane % kTile;
    if (t >= end) return -1;
    const int page = table[t / p.page_size];
    return (page * p.page_size + t % p.page_size) * p.num_kv_heads + kvh;
  };
  auto issue = [&](int i, int row_of_lane) {
    uint4* ks = ring + (i % kStages) * 2 * kTilePieces;
    uint4* vs = ks + kTilePieces;
#pragma unroll
    for (int c = 0; c < kCopies; ++c) {
      const int j = lane + 32 * c;
      const int r = j / kPieces, piece = j % kPieces;
      const int row = __shfl_sync(kFull, row_of_lane, r);
      const bool valid = row >= 0;
      const int64_t off = valid ? int64_t(row) * D + piece * 8 : 0;
      const int slot = r * kPieces + (piece ^ (r & 7));
      ptx::cp_async_16(ptx::smem_addr(ks + slot), p.k + off, valid);
      ptx::cp_async_16(ptx::smem_addr(vs + slot), p.v + off, valid);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < my_tiles) issue(s, tile_row(s));
    ptx::cp_async_commit();
  }
  int pending_row = tile_row(kStages - 1);

  uint32_t qa[kKSteps][2];
  {
    const bool has = g < p.group;
    const uint32_t* qrow = reinterpret_cast<const uint32_t*>(
        p.q + (int64_t(b) * p.num_q_heads + (has ? kvh * p.group + g : 0)) * D);
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      qa[ks][0] = has ? qrow[ks * 8 + t4] : 0u;
      qa[ks][1] = has ? qrow[ks * 8 + 4 + t4] : 0u;
    }
  }

  float m = -INFINITY, l = 0.f, l_bf16 = 0.f;
  float acc[D / 8][2];
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) acc[nd][0] = acc[nd][1] = 0.f;

  for (int i = 0; i < my_tiles; ++i) {
    if (i + kStages - 1 < my_tiles) issue(i + kStages - 1, pending_row);
    ptx::cp_async_commit();
    pending_row = tile_row(i + kStages);
    ptx::cp_async_wait<kStages - 1>();
    __syncwarp();

    const uint4* ks = ring + (i % kStages) * 2 * kTilePieces;
    const uint4* vs = ks + kTilePieces;
    const int tile_begin = begin + (warp + i * kWarps) * kTile;

    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t kb[4];
      const int r = ((lane >> 4) << 3) + (lane & 7);
      const int piece = 2 * kk + ((lane >> 3) & 1);
      ptx::ldmatrix_x4(kb, ptx::smem_addr(ks + r * kPieces + (piece ^ (r & 7))));
      const uint32_t a[4] = {qa[kk][0], 0u, qa[kk][1], 0u};
      const uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
      ptx::mma_bf16_16816(s[0], a, b0, s[0]);
      ptx::mma_bf16_16816(s[1], a, b1, s[1]);
    }

    float x[4];
    float tile_max = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int t = tile_begin + nt * 8 + 2 * t4 + j;
        const float v = t < end && t >= row_start ? s[nt][j] * p.scale_log2 : -INFINITY;
        x[nt * 2 + j] = v;
        tile_max = fmaxf(tile_max, v);
      }
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFull, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFull, tile_max, 2));
    const float m_new = fmaxf(m, tile_max);
    // A row masked so far has m_new = -inf: exponentiate against 0 instead (all terms 0).
    const float m_ref = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2f(m - m_ref);
    m = m_new;
    uint32_t pa[4];
    float tile_sum = 0.f, tile_sum_bf16 = 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float p0 = exp2f(x[nt * 2] - m_ref), p1 = exp2f(x[nt * 2 + 1] - m_ref);
      const __nv_bfloat162 pb = __floats2bfloat162_rn(p0, p1);
      pa[nt * 2] = *reinterpret_cast<const uint32_t*>(&pb);
      pa[nt * 2 + 1] = 0u;
      tile_sum += p0 + p1;
      tile_sum_bf16 += __low2float(pb) + __high2float(pb);
    }
    l = l * alpha + tile_sum;
    l_bf16 = l_bf16 * alpha + tile_sum_bf16;
    const uint32_t a[4] = {pa[0], 0u, pa[2], 0u};
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      uint32_t vb[4];
      const int r = (((lane >> 3) & 1) << 3) + (lane & 7);
      const int piece = 2 * np + (lane >> 4);
      ptx::ldmatrix_x4_trans(vb, ptx::smem_addr(vs + r * kPieces + (piece ^ (r & 7))));
      const uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
      float c0[4] = {acc[2 * np][0] * alpha, acc[2 * np][1] * alpha, 0.f, 0.f};
      float c1[4] = {acc[2 * np + 1][0] * alpha, acc[2 * np + 1][1] * alpha, 0.f, 0.f};
      float d0[4], d1[4];
      ptx::mma_bf16_16816(d0, a, b0, c0);
      ptx::mma_bf16_16816(d1, a, b1, c1);
      acc[2 * np][0] = d0[0];
      acc[2 * np][1] = d0[1];
      acc[2 * np + 1][0] = d1[0];
      acc[2 * np + 1][1] = d1[1];
    }
    __syncwarp();
  }
  ptx::cp_async_wait<0>();

  l += __shfl_xor_sync(kFull, l, 1);
  l += __shfl_xor_sync(kFull, l, 2);
  l_bf16 += __shfl_xor_sync(kFull, l_bf16, 1);
  l_bf16 += __shfl_xor_sync(kFull, l_bf16, 2);
  const float warp_lse = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
  const float inv_l = l_bf16 > 0.f ? 1.f / l_bf16 : 0.f;
  float* so = reinterpret_cast<float*>(smem);
  float* sl = so + kWarps * kMaxGroup * D;
  __syncthreads();
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) {
    const float2 val = make_float2(acc[nd][0] * inv_l, acc[nd][1] * inv_l);
    *reinterpret_cast<float2*>(so + (warp * kMaxGroup + g) * D + nd * 8 + 2 * t4) = val;
  }
  if (t4 == 0) sl[warp * kMaxGroup + g] = warp_lse;
  __syncthreads();
  for (int idx = threadIdx.x; idx < p.group * D; idx += kThreads) {
    const int hg = idx / D, d = idx % D;
    LseAccumulator lacc;
#pragma unroll
    for (int ww = 0; ww < kWarps; ++ww) lacc.add(sl[ww * kMaxGroup + hg]);
    const float lse = lacc.lse();
    float o = 0.f;
#pragma unroll
    for (int ww = 0; ww < kWarps; ++ww) {
      const float wt = merge_weight(sl[ww * kMaxGroup + hg], lse);
      if (wt > 0.f) o = fmaf(wt, so[(ww * kMaxGroup + hg) * D + d], o);
    }
    const int64_t prow = int64_t(item) * p.group + hg;
    p.partial_o[prow * D + d] = o;
    if (d == 0) p.partial_lse[prow] = lse;
  }
}

// Merges the partial states of items [first, first + n) of head row hg: every warp builds
// the merged lse, the warps split the items, warp 0 ends with this lane's dims in o.
template <int D>
__device__ float merge_items(const Params& p, int first, int n, int hg, float (&o)[D / 32],
                             float (*red)[D]) {
  constexpr int kPer = D / 32;
  using Vec = typename std::conditional<kPer == 4, float4, float2>::type;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  LseAccumulator lacc;
  for (int i = lane; i < n; i += 32) lacc.add(p.partial_lse[int64_t(first + i) * p.group + hg]);
  const float lse = warp_merge_lse(lacc).lse();
#pragma unroll
  for (int k = 0; k < kPer; ++k) o[k] = 0.f;
  for (int i = warp; i < n; i += kMergeWarps) {
    const int64_t prow = int64_t(first + i) * p.group + hg;
    const float wt = merge_weight(p.partial_lse[prow], lse);
    if (wt > 0.f) {
      const Vec x = *reinterpret_cast<const Vec*>(p.partial_o + prow * D + lane * kPer);
      const float* xs = reinterpret_cast<const float*>(&x);
#pragma unroll
      for (int k = 0; k < kPer; ++k) o[k] = fmaf(wt, xs[k], o[k]);
    }
  }
  __syncthreads();  // red is free (a previous call's warp 0 has read it)
#pragma unroll
  for (int k = 0; k < kPer; ++k) red[warp][lane * kPer + k] = o[k];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kMergeWarps; ++w) sum += red[w][lane * kPer + k];
      o[k] = sum;
    }
  }
  return lse;
}

// One CTA per (b, h): new = merge(states below E(t), reused entry); rectify-append;
// out = merge(new, tail states).
template <int D>
__global__ void __launch_bounds__(kMergeWarps * 32) complete_kernel(const __grid_constant__ Params p) {
  constexpr int kPer = D / 32;
  __shared__ float red[kMergeWarps][D];
  const int row = blockIdx.x;
  const int b = row / p.num_q_heads, h = row % p.num_q_heads;
  const int kvh = h / p.group, hg = h % p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int len = p.seq_lens[b];
  __nv_bfloat16* out = p.out + int64_t(row) * D + lane * kPer;
  if (len == 0) {
    if (warp == 0) {
#pragma unroll
      for (int k = 0; k < kPer; ++k) out[k] = __float2bfloat16_rn(0.f);
      if (lane == 0 && p.lse) p.lse[row] = -INFINITY;
    }
    return;
  }
  const int t = len - 1, W = p.st.window;
  const int4 info = p.pair_info[b * p.num_kv_heads + kvh];
  float o_r[kPer], o_t[kPer];
  const float lse_r = merge_items<D>(p, info.x, info.y, hg, o_r, red);
  const float lse_t = merge_items<D>(p, info.x + info.y, info.z, hg, o_t, red);
  if (warp != 0) return;

  const int slot_j = p.head_slot[row];
  LseAccumulator acc;
  acc.add(lse_r);
  float lse_j = -INFINITY, o_j[kPer];
  if (slot_j >= 0) {
    const int64_t r = p.st.row(b, slot_j, h);
    lse_j = p.st.lse[r];
    load_bf16<D>(reinterpret_cast<const __nv_bfloat16*>(p.st.o) + r * D, lane, o_j);
    acc.add(lse_j);
  }
  const float lse_new = acc.lse();
  const float w_r = merge_weight(lse_r, lse_new), w_j = merge_weight(lse_j, lse_new);
  float o_new[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    o_new[k] = (w_r > 0.f ? w_r * o_r[k] : 0.f) + (w_j > 0.f ? w_j * o_j[k] : 0.f);

  // Rectify-append: entry(t) = new. Slot t mod W may be the matched slot (j = t - W): every
  // lane has read it above.
  __syncwarp();
  const int slot_t = t % W;
  const int64_t rt = p.st.row(b, slot_t, h);
  float qp[kPer];
  load_bf16<D>(p.q_pre + int64_t(row) * D, lane, qp);
  {
    __nv_bfloat16* ro = reinterpret_cast<__nv_bfloat16*>(p.st.o) + rt * D + lane * kPer;
    __nv_bfloat16* rq = reinterpret_cast<__nv_bfloat16*>(p.st.q) + rt * D + lane * kPer;
    const __nv_bfloat16* qsrc = p.q_pre + int64_t(row) * D + lane * kPer;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      ro[k] = __float2bfloat16_rn(o_new[k]);
      rq[k] = qsrc[k];
    }
    if (lane == 0) {
      p.st.lse[rt] = lse_new;
      if (h == 0) p.st.pos[int64_t(b) * W + slot_t] = t;
    }
  }
  update_running_means<D>(p.st, p.mp, b, h, lane, qp);

  LseAccumulator acc2;
  acc2.add(lse_new);
  acc2.add(lse_t);
  const float lse_out = acc2.lse();
  const float w_n = merge_weight(lse_new, lse_out), w_t = merge_weight(lse_t, lse_out);
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    out[k] = __float2bfloat16_rn((w_n > 0.f ? w_n * o_new[k] : 0.f) + (w_t > 0.f ? w_t * o_t[k] : 0.f));
  if (lane == 0 && p.lse) p.lse[row] = lse_out;
}

// Prefill: one warp per query head writes positions p0 .. p0 + n - 1 in order.
template <int D>
__global__ void fill_kernel(RingState st, MatchParams mp, int b, int p0, int n,
                            const __nv_bfloat16* q_pre, const __nv_bfloat16* o, const float* lse) {
  constexpr int kPer = D / 32;
  const int h = blockIdx.x, lane = threadIdx.x;
  const int Hq = st.num_q_heads, W = st.window;
  for (int i = 0; i < n; ++i) {
    const int pos = p0 + i, slot = pos % W;
    const int64_t src = int64_t(i) * Hq + h, dst = st.row(b, slot, h);
    float qp[kPer];
    load_bf16<D>(q_pre + src * D, lane, qp);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      reinterpret_cast<__nv_bfloat16*>(st.q)[dst * D + lane * kPer + k] = q_pre[src * D + lane * kPer + k];
      reinterpret_cast<__nv_bfloat16*>(st.o)[dst * D + lane * kPer + k] = o[src * D + lane * kPer + k];
    }
    if (lane == 0) {
      st.lse[dst] = lse[src];
      if (h == 0) st.pos[int64_t(b) * W + slot] = pos;
    }
    update_running_means<D>(st, mp, b, h, lane, qp);
    __syncwarp();
  }
}

template <int D>
constexpr size_t attend_smem_bytes() {
  constexpr size_t ring = size_t(kWarps) * kStages * 2 * kTile * D * sizeof(__nv_bfloat16);
  constexpr size_t merge = (size_t(kWarps) * kMaxGroup * D + kWarps * kMaxGroup) * sizeof(float);
  return ring > merge ? ring : merge;
}

struct DeviceInfo {
  int sms = 0;
  int ctas_per_sm = 0;
};

template <int D>
cudaError_t device_info(DeviceInfo* out) {
  static std::mutex mu;
  static std::map<int, DeviceInfo> cache;
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dev);
  if (it != cache.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  DeviceInfo info;
  err = cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  constexpr int smem = int(attend_smem_bytes<D>());
  err = cudaFuncSetAttribute(attend_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&info.ctas_per_sm, attend_kernel<D>,
                                                      kThreads, smem);
  if (err != cudaSuccess) return err;
  if (info.ctas_per_sm < 1) return cudaErrorInvalidConfiguration;
  cache.emplace(dev, info);
  *out = info;
  return cudaSuccess;
}

template <int D>
cudaError_t launch_decode(Params& p, cudaStream_t stream) {
  DeviceInfo info;
  cudaError_t err = device_info<D>(&info);
  if (err != cudaSuccess) return err;
  const int wave = info.sms * info.ctas_per_sm;
  p.chunks_target = wave < kMaxChunks ? wave : kMaxChunks;
  match_kernel<D><<<dim3(unsigned(p.tiles), unsigned(p.num_q_heads), unsigned(p.batch)),
                    kMatchWarps * 32, 0, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const unsigned items = unsigned(p.chunks_target + 2 * p.batch * p.num_kv_heads);
  attend_kernel<D><<<items, kThreads, attend_smem_bytes<D>(), stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  complete_kernel<D><<<unsigned(p.batch * p.num_q_heads), kMergeWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

bool valid_state(const RingState& st, int num_q_heads, int head_dim) {
  return st.q && st.o && st.lse && st.pos && st.q_mean && st.q_sq && st.q_count &&
         st.last_start && st.last_len && st.window >= 1 && st.max_batch >= 1 &&
         st.num_q_heads == num_q_heads && st.head_dim == head_dim && aligned16(st.q) &&
         aligned16(st.o) && aligned16(st.q_mean);
}

}  // namespace

size_t decode_workspace_bytes(int max_batch, int num_q_heads, int num_kv_heads, int head_dim,
                              int window) {
  if (max_batch < 1 || num_q_heads < 1 || num_kv_heads < 1 || num_q_heads % num_kv_heads != 0 ||
      window < 1)
    return 0;
  return layout(max_batch, num_q_heads, num_kv_heads, head_dim, window).total;
}

size_t decode_sync_ints(int max_batch, int num_q_heads) {
  return size_t(max_batch) * num_q_heads + 1;
}

cudaError_t prepare_cuda(int head_dim) {
  DeviceInfo info;
  if (head_dim == 64) return device_info<64>(&info);
  if (head_dim == 128) return device_info<128>(&info);
  return cudaErrorInvalidValue;
}

// Returns cudaErrorInvalidValue, before any launch, when: head_dim is not 64 or 128; the
// group size is not in 1..8; the ring state does not match (Hq, d) or kv.batch exceeds its
// max_batch; band < 1; a pointer is null (lse, counters excepted) or q, q_pre, k, v, out or
// workspace is not 16-byte aligned; the workspace is smaller than decode_workspace_bytes;
// PerHead without thresholds; KV rows overflow int32 (as dense_decode_cuda).
cudaError_t decode_cuda(const RingState& st, const MatchParams& mp, const bf16* q,
                        const bf16* q_pre, int num_q_heads, const PagedKV& kv, float scale,
                        bf16* out, float* lse, unsigned long long* counters, int32_t* sync,
                        void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const int d = kv.head_dim;
  if (d != 64 && d != 128) return cudaErrorInvalidValue;
  if (kv.batch < 0 || kv.num_kv_heads < 1 || num_q_heads < 1) return cudaErrorInvalidValue;
  if (num_q_heads % kv.num_kv_heads != 0 || num_q_heads / kv.num_kv_heads > kMaxGroup)
    return cudaErrorInvalidValue;
  if (kv.page_size < 1 || kv.num_pages < 1 || kv.max_pages_per_seq < 1)
    return cudaErrorInvalidValue;
  if (int64_t(kv.num_pages) * kv.page_size * kv.num_kv_heads >= (int64_t(1) << 31))
    return cudaErrorInvalidValue;
  if (!valid_state(st, num_q_heads, d) || kv.batch > st.max_batch || mp.band < 1 ||
      mp.window != st.window || mp.stats_horizon < 1)
    return cudaErrorInvalidValue;
  if (mp.rule == ThresholdRule::PerHead && !mp.head_threshold) return cudaErrorInvalidValue;
  if (kv.batch == 0) return cudaSuccess;
  if (!q || !q_pre || !kv.k || !kv.v || !kv.page_table || !kv.seq_lens || !out || !sync ||
      !workspace)
    return cudaErrorInvalidValue;
  if (!aligned16(q) || !aligned16(q_pre) || !aligned16(kv.k) || !aligned16(kv.v) ||
      !aligned16(out) || !aligned16(workspace))
    return cudaErrorInvalidValue;
  const Layout l = layout(kv.batch, num_q_heads, kv.num_kv_heads, d, st.window);
  if (workspace_bytes < l.total) return cudaErrorInvalidValue;

  char* ws = static_cast<char*>(workspace);
  Params p;
  p.q = reinterpret_cast<const __nv_bfloat16*>(q);
  p.q_pre = reinterpret_cast<const __nv_bfloat16*>(q_pre);
  p.k = reinterpret_cast<const __nv_bfloat16*>(kv.k);
  p.v = reinterpret_cast<const __nv_bfloat16*>(kv.v);
  p.page_table = kv.page_table;
  p.seq_lens = kv.seq_lens;
  p.batch = kv.batch;
  p.page_size = kv.page_size;
  p.num_kv_heads = kv.num_kv_heads;
  p.max_pages_per_seq = kv.max_pages_per_seq;
  p.num_q_heads = num_q_heads;
  p.group = num_q_heads / kv.num_kv_heads;
  p.tiles = match_tiles(st.window);
  p.chunks_target = 0;
  p.scale_log2 = scale * kLog2e;
  p.st = st;
  p.mp = mp;
  p.out = reinterpret_cast<__nv_bfloat16*>(out);
  p.lse = lse;
  p.counters = counters;
  p.row_arrivals = sync;
  p.grid_arrival = sync + size_t(st.max_batch) * num_q_heads;
  p.tile_d2 = reinterpret_cast<float*>(ws + l.tile_d2);
  p.tile_pos = reinterpret_cast<int32_t*>(ws + l.tile_pos);
  p.head_start = reinterpret_cast<int32_t*>(ws + l.head_start);
  p.head_slot = reinterpret_cast<int32_t*>(ws + l.head_slot);
  p.pair_info = reinterpret_cast<int4*>(ws + l.pair_info);
  p.items = reinterpret_cast<int4*>(ws + l.items);
  p.num_items = reinterpret_cast<int32_t*>(ws + l.num_items);
  p.partial_lse = reinterpret_cast<float*>(ws + l.partial_lse);
  p.partial_o = reinterpret_cast<float*>(ws + l.partial_o);
  return d == 64 ? launch_decode<64>(p, stream) : launch_decode<128>(p, stream);
}

cudaError_t reset_cuda(const RingState& st, int batch, cudaStream_t stream) {
  if (batch < 0 || batch > st.max_batch) return cudaErrorInvalidValue;
  if (batch == 0) return cudaSuccess;
  const size_t heads = size_t(batch) * st.num_q_heads;
  cudaError_t err = cudaMemsetAsync(st.pos, 0xff, size_t(batch) * st.window * sizeof(int32_t), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(st.q_mean, 0, heads * st.head_dim * sizeof(float), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(st.q_sq, 0, heads * sizeof(float), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(st.q_count, 0, heads * sizeof(int32_t), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(st.last_start, 0, heads * sizeof(int32_t), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(st.last_len, 0, size_t(batch) * sizeof(int32_t), stream);
  return err;
}

cudaError_t fill_entries_cuda(const RingState& st, const MatchParams& mp, int b, int p0, int n,
                              const bf16* q_pre, const bf16* o, const float* lse,
                              cudaStream_t stream) {
  if (b < 0 || b >= st.max_batch || p0 < 0 || n < 0 || n > st.window || mp.stats_horizon < 1)
    return cudaErrorInvalidValue;
  if (!valid_state(st, st.num_q_heads, st.head_dim)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (!q_pre || !o || !lse) return cudaErrorInvalidValue;
  const auto* qp = reinterpret_cast<const __nv_bfloat16*>(q_pre);
  const auto* ob = reinterpret_cast<const __nv_bfloat16*>(o);
  if (st.head_dim == 64) {
    fill_kernel<64><<<unsigned(st.num_q_heads), 32, 0, stream>>>(st, mp, b, p0, n, qp, ob, lse);
  } else if (st.head_dim == 128) {
    fill_kernel<128><<<unsigned(st.num_q_heads), 32, 0, stream>>>(st, mp, b, p0, n, qp, ob, lse);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace kvs::kernels::mac
