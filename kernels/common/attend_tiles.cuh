// The attention inner loop every split-KV decode kernel shares (dense decode, MAC's band +
// tail): one CTA attends the query heads of one kv group over a token range of one sequence
// of the paged bf16 KV cache, reading each K/V row once for the group.
//
// Each warp takes a contiguous run of the range's 16-token tiles (warp_run). Each warp streams its
// tiles through its own Stages-deep cp.async ring in shared memory (16-byte copies, swizzled rows),
// so warps never wait for each other until the end. Scores and P.V use the bf16 tensor cores
// (mma.m16n8k16): the group's query heads are the M rows (up to 8 of 16), tokens and head
// dims are N and K. Softmax is online in fp32 in the log2 domain. Each warp ends with its
// normalized state (o, lse) per head row in shared memory; merge_warp_states combines them.
//
// The dynamic shared memory of the kernel must be exactly this (TileConfig::smem_bytes()),
// with no static __shared__ variable in the kernel: static variables are placed ahead of the
// dynamic area and would shift the rows off their 128-byte alignment (the swizzle and the
// 16-byte copies then split into twice the wavefronts and sectors: ncu counted 50 % excess
// sectors on MAC's attention when it had one).
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "kernels/common/merge_states.cuh"
#include "kernels/common/ptx.cuh"

namespace kvs::kernels::tiles {

constexpr int kTile = 16;     // tokens per warp step: the K extent of one P.V mma
constexpr int kMaxGroup = 8;  // query heads per kv head: mma rows 0..7; rows 8..15 are zero
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The structural knobs of the loop (docs/gpu.md says how they were chosen).
//   Warps:  warps per CTA; each streams its own 16-token tiles.
//   Stages: depth of each warp's cp.async ring of K+V tiles in shared memory.
template <int D, int Warps, int Stages>
struct TileConfig {
  static constexpr int kHeadDim = D;
  static constexpr int kWarps = Warps;
  static constexpr int kStages = Stages;
  static constexpr int kThreads = Warps * 32;
  static constexpr int kPieces = D / 8;               // 16-byte pieces per row
  static constexpr int kTileSlots = kTile * kPieces;  // one K (or V) tile, in uint4
  static constexpr int kStageSlots = 2 * kTileSlots;  // K and V of one tile
  static constexpr int kChunkAlign = Warps * kTile;   // chunks start on whole rounds of tiles
  // Floats per head row of a warp's state in shared memory. The 8 padding floats put the 8
  // rows' float2 stores (4 lanes a row) on distinct banks: 2 wavefronts per store instead of
  // 8 with rows D floats apart.
  static constexpr int kStateStride = D + 8;
  static constexpr size_t ring_bytes() {
    return size_t(Warps) * Stages * kStageSlots * sizeof(uint4);
  }
  static constexpr size_t merge_bytes() {
    return (size_t(Warps) * kMaxGroup * kStateStride + (Warps + 1) * kMaxGroup) * sizeof(float);
  }
  static constexpr size_t smem_bytes() {
    return ring_bytes() > merge_bytes() ? ring_bytes() : merge_bytes();
  }
};

// Where the K/V rows come from: the paged cache [pages, page_size, Hkv, D] and its table.
struct KvSource {
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  const int32_t* page_table;  // [batch, max_pages_per_seq]
  int page_size;
  int num_kv_heads;
  int max_pages_per_seq;
  float scale_log2;  // softmax scale * log2(e)
};

// Rows are stored swizzled: piece c of row r at c ^ (r & 7), so that the 8 rows an
// ldmatrix phase reads hit 8 different 16-byte bank groups.
template <int D>
__device__ __forceinline__ int smem_slot(int r, int piece) {
  return r * (D / 8) + (piece ^ (r & 7));
}

// The A fragments of the group's query rows (rows >= group are zero): q_group points at the
// group's first query head, heads contiguous, D bf16 each.
template <int D>
__device__ __forceinline__ void load_query_fragments(const __nv_bfloat16* q_group, int group,
                                                     int lane, uint32_t (&qa)[D / 16][2]) {
  const int g = lane / 4, t4 = lane % 4;
  const bool has = g < group;
  const uint32_t* qrow = reinterpret_cast<const uint32_t*>(q_group + (has ? g : 0) * D);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    qa[ks][0] = has ? qrow[ks * 8 + t4] : 0u;
    qa[ks][1] = has ? qrow[ks * 8 + 4 + t4] : 0u;
  }
}

// Attends tokens [begin, end) of sequence b in kv head kvh. With kRowStart, this lane's head
// row (lane / 4) skips tokens below row_start (a row with every token skipped keeps
// lse = -inf and o = 0); without it every row reads every token and row_start is ignored
// (dense decode: the per-token compare and the -inf guard cost it 1-2 % at 128K).
// Ends with each warp's state in shared memory and no barrier after it: the caller runs
// __syncthreads() before merge_warp_states. The caller also synchronizes before calling it
// again on the same shared memory.
// on_scores(pos, g, x) sees every tile's scores as they are computed: x[nt * 2 + j] is this
// lane's head row g score (log2 domain, scaled; -inf where masked) of range position
// pos[nt * 2 + j] = tile begin + nt * 8 + 2 * (lane % 4) + j (AttentionPredictor's sparse
// attention pools its history row from them). The default does nothing and costs no code.
struct NoScoreHook {
  __device__ __forceinline__ void operator()(const int (&)[4], int, const float (&)[4]) const {}
};

// A warp's tiles of a range of num_tiles: one contiguous run, the runs of a CTA's warps
// differing by at most one tile. Against tiles dealt round-robin (warp w: w, w + warps, ...),
// the runs spread a CTA's concurrent reads over `warps` places in the range instead of a few
// adjacent pages, and DRAM served them faster on an H200: the dense kernel 2.2 % at 32K batch
// 8, 2.7 % at 32K batch 1, 1.4 % at 128K batch 8, 0.8 % slower at 128K batch 1 (0.5 % faster
// there with a shuffled page table); the full row's K stream 2 % (docs/gpu.md, "Tile order
// inside a CTA").
struct WarpRun {
  int first, count;
};
__device__ __forceinline__ WarpRun warp_run(int num_tiles, int warps, int warp) {
  const int run = num_tiles / warps, extra = num_tiles % warps;
  return {warp * run + min(warp, extra), run + (warp < extra ? 1 : 0)};
}

template <class Cfg, bool kRowStart, class ScoreHook = NoScoreHook>
__device__ void attend_tiles(const KvSource& src, int b, int kvh, int begin, int end, int row_start,
                             const uint32_t (&qa)[Cfg::kHeadDim / 16][2], uint4* smem,
                             ScoreHook&& on_scores = ScoreHook()) {
  constexpr int D = Cfg::kHeadDim;
  constexpr int kWarps = Cfg::kWarps, kStages = Cfg::kStages;
  constexpr int kPieces = Cfg::kPieces;
  constexpr int kTileSlots = Cfg::kTileSlots;
  constexpr int kCopies = kTile * kPieces / 32;  // 16-byte copies per lane per tile
  constexpr int kKSteps = D / 16;                // mma K steps over the head dim
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;

  const WarpRun mine = warp_run((end - begin + kTile - 1) / kTile, kWarps, warp);
  const int my_tiles = mine.count;
  uint4* ring = smem + warp * (kStages * Cfg::kStageSlots);
  auto tile_begin_of = [&](int i) { return begin + (mine.first + i) * kTile; };

  // KV row (page slot * Hkv + kv head) of this lane's token (lane % 16) in the warp's i-th
  // tile; -1 past the range. Rows fit in int32 (the launchers check).
  const int32_t* table = src.page_table + int64_t(b) * src.max_pages_per_seq;
  auto tile_row = [&](int i) -> int {
    if (i >= my_tiles) return -1;
    const int t = tile_begin_of(i) + lane % kTile;
    if (t >= end) return -1;
    const int page = table[t / src.page_size];
    return (page * src.page_size + t % src.page_size) * src.num_kv_heads + kvh;
  };
  auto issue = [&](int i, int row_of_lane) {
    uint4* ks = ring + (i % kStages) * Cfg::kStageSlots;
    uint4* vs = ks + kTileSlots;
#pragma unroll
    for (int c = 0; c < kCopies; ++c) {
      const int j = lane + 32 * c;
      const int r = j / kPieces, piece = j % kPieces;
      const int row = __shfl_sync(0xffffffffu, row_of_lane, r);
      const bool valid = row >= 0;
      const int64_t off = valid ? int64_t(row) * D + piece * 8 : 0;
      const int slot = smem_slot<D>(r, piece);
      ptx::cp_async_16(ptx::smem_addr(ks + slot), src.k + off, valid);
      ptx::cp_async_16(ptx::smem_addr(vs + slot), src.v + off, valid);
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < my_tiles) issue(s, tile_row(s));
    ptx::cp_async_commit();
  }
  int pending_row = tile_row(kStages - 1);

  float m = -INFINITY;  // running max of this lane's head row, log2 domain
  // This lane's part (its 4 token columns) of the running sum of exp2(x - m): l for the
  // lse, in fp32; l_bf16 of the bf16-rounded weights that P.V actually used, to normalize o
  // so that it stays an exact convex combination of the V rows.
  float l = 0.f, l_bf16 = 0.f;
  float acc[D / 8][2];  // O rows 0..7: dims nd * 8 + 2 * t4 + {0, 1}
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) acc[nd][0] = acc[nd][1] = 0.f;

  for (int i = 0; i < my_tiles; ++i) {
    if (i + kStages - 1 < my_tiles) issue(i + kStages - 1, pending_row);
    ptx::cp_async_commit();
    pending_row = tile_row(i + kStages);  // its latency hides behind this tile's work
    ptx::cp_async_wait<kStages - 1>();
    __syncwarp();

    const uint4* ks = ring + (i % kStages) * Cfg::kStageSlots;
    const uint4* vs = ks + kTileSlots;
    const int tile_begin = tile_begin_of(i);

    // S^T = Q K^T: 16 head rows x 16 tokens as two n-tiles of 8 tokens.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t kb[4];
      const int r = ((lane >> 4) << 3) + (lane & 7);
      const int piece = 2 * kk + ((lane >> 3) & 1);
      ptx::ldmatrix_x4(kb, ptx::smem_addr(ks + smem_slot<D>(r, piece)));
      const uint32_t a[4] = {qa[kk][0], 0u, qa[kk][1], 0u};
      const uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
      ptx::mma_bf16_16816(s[0], a, b0, s[0]);
      ptx::mma_bf16_16816(s[1], a, b1, s[1]);
    }
    // Online softmax over this lane's 4 token columns of its head row.
    float x[4];
    float tile_max = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int t = tile_begin + nt * 8 + 2 * t4 + j;
        const bool in = t < end && (!kRowStart || t >= row_start);
        const float v = in ? s[nt][j] * src.scale_log2 : -INFINITY;
        x[nt * 2 + j] = v;
        tile_max = fmaxf(tile_max, v);
      }
    }
    {
      const int pos[4] = {tile_begin + 2 * t4, tile_begin + 2 * t4 + 1, tile_begin + 8 + 2 * t4,
                          tile_begin + 9 + 2 * t4};
      on_scores(pos, g, x);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float m_new = fmaxf(m, tile_max);
    // A row skipped so far has m_new = -inf: exponentiate against 0 instead (all terms are
    // 0), so that exp2(-inf - -inf) never happens. Without skipping, the tile's first token
    // is always read, so the quad's max is finite.
    const float m_ref = kRowStart && m_new == -INFINITY ? 0.f : m_new;
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
    // A fragment of P: {row g tokens 0..7, row g+8 (zero), row g tokens 8..15, row g+8}.
    const uint32_t a[4] = {pa[0], 0u, pa[2], 0u};

    // O += P V: V rows come transposed from ldmatrix as the B operand, two n-tiles per load.
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      uint32_t vb[4];
      const int r = (((lane >> 3) & 1) << 3) + (lane & 7);
      const int piece = 2 * np + (lane >> 4);
      ptx::ldmatrix_x4_trans(vb, ptx::smem_addr(vs + smem_slot<D>(r, piece)));
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
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  ptx::cp_async_wait<0>();

  // Each warp's state (o normalized, natural-log lse) goes to shared memory, reusing the
  // rings.
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  l_bf16 += __shfl_xor_sync(0xffffffffu, l_bf16, 1);
  l_bf16 += __shfl_xor_sync(0xffffffffu, l_bf16, 2);
  const float warp_lse = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
  const float inv_l = l_bf16 > 0.f ? 1.f / l_bf16 : 0.f;
  constexpr int S = Cfg::kStateStride;
  float* so = reinterpret_cast<float*>(smem);  // [kWarps][kMaxGroup][S], D used
  float* sl = so + kWarps * kMaxGroup * S;     // [kWarps][kMaxGroup]
  __syncthreads();
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) {
    float2 val = make_float2(acc[nd][0] * inv_l, acc[nd][1] * inv_l);
    *reinterpret_cast<float2*>(so + (warp * kMaxGroup + g) * S + nd * 8 + 2 * t4) = val;
  }
  if (t4 == 0) sl[warp * kMaxGroup + g] = warp_lse;
}

// The CTA's state: the warps' states of each head row merged, after attend_tiles and a
// __syncthreads(); every thread of the CTA calls it. Warp 0 turns the warps' lse values into
// each head row's merged lse and the warps' weights (in place): a lane per (warp, head row),
// the reductions over warps by shuffles, so the chain is one exp, one log and one exp. Then
// every thread combines 4 dims of a row at a time: emit(hg, d, o, lse) gets row hg's dims
// d..d+3 as a float4. (When every thread recomputed the lse and the weights for each dim it
// wrote, this step took 2.7 us of every dense decode CTA on an H100; with one thread per head
// row folding its warps in turn, 1.0 us, of which 0.8 was that fold.)
template <class Cfg, class Emit>
__device__ __forceinline__ void merge_warp_states(uint4* smem, int group, Emit&& emit) {
  constexpr int D = Cfg::kHeadDim, kWarps = Cfg::kWarps, S = Cfg::kStateStride;
  static_assert(32 % kMaxGroup == 0, "a lane per (warp, head row)");
  constexpr int kRowsLanes = 32 / kMaxGroup;                    // warps one pass of lanes covers
  constexpr int kPer = (kWarps + kRowsLanes - 1) / kRowsLanes;  // (warp, row) entries per lane
  const float* so = reinterpret_cast<const float*>(smem);
  float* sl = reinterpret_cast<float*>(smem) + kWarps * kMaxGroup * S;  // lse, then weight
  float* s_lse = sl + kWarps * kMaxGroup;                               // [kMaxGroup]
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x, hg = lane % kMaxGroup;
    float v[kPer];
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int w = lane / kMaxGroup + k * kRowsLanes;
      v[k] = w < kWarps && hg < group ? sl[w * kMaxGroup + hg] : -INFINITY;
      m = fmaxf(m, v[k]);
    }
#pragma unroll
    for (int off = kMaxGroup; off < 32; off <<= 1)
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float sum = 0.f;  // empty warp states (lse = -inf) add nothing
#pragma unroll
    for (int k = 0; k < kPer; ++k) sum += v[k] == -INFINITY ? 0.f : expf(v[k] - m);
#pragma unroll
    for (int off = kMaxGroup; off < 32; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const float lse = m == -INFINITY ? -INFINITY : m + logf(sum);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int w = lane / kMaxGroup + k * kRowsLanes;
      if (w < kWarps && hg < group) sl[w * kMaxGroup + hg] = merge_weight(v[k], lse);
    }
    if (lane < group) s_lse[lane] = lse;
  }
  __syncthreads();
#pragma unroll 1  // one pass in the common shapes; unrolled, MAC's d-64 kernel spilled
  for (int idx = threadIdx.x; idx < group * (D / 4); idx += Cfg::kThreads) {
    const int hg = idx / (D / 4), d = (idx % (D / 4)) * 4;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = sl[w * kMaxGroup + hg];
      if (wt > 0.f) {  // an empty warp state (weight 0) is skipped, never multiplied
        const float4 x = *reinterpret_cast<const float4*>(so + (w * kMaxGroup + hg) * S + d);
        o.x = fmaf(wt, x.x, o.x);
        o.y = fmaf(wt, x.y, o.y);
        o.z = fmaf(wt, x.z, o.z);
        o.w = fmaf(wt, x.w, o.w);
      }
    }
    emit(hg, d, o, s_lse[hg]);
  }
}

}  // namespace kvs::kernels::tiles
