// CUDA split-KV ("flash decoding") dense decode over the paged bf16 KV cache.
//
// Work split. One CTA handles one work item (sequence b, chunk of its tokens) for one kv
// head (blockIdx.y) and all `group` query heads of that kv head, so each K/V row is read
// from memory once per group. The chunk length is chosen on the device from seq_lens: every
// warp computes the same plan from the lengths on its own (find_work_item), so no separate
// plan launch or block barrier precedes the first loads and the call is graph-safe with
// seq_lens changing between replays. The chunk length spreads the total tokens over about
// one wave of CTAs (SMs x CTAs per SM), so that batch 1 fills the chip and large batches do
// not split needlessly.
//
// Inside a CTA, 4 warps (two CTAs per SM) take 16-token tiles of the chunk round-robin. Each warp
// streams its tiles through its own 3-stage cp.async ring in shared memory (16-byte copies,
// swizzled rows), so warps never wait for each other until the end. Scores and P.V use the bf16
// tensor cores (mma.m16n8k16): the query heads of the group are the M rows (up to 8 of 16),
// tokens and head dims are N and K. Softmax is online in fp32 in the log2 domain.
//
// A chunk's result is a state (o, lse). A sequence with a single chunk is written straight
// to o / lse; otherwise the CTA writes its state to the workspace and the merge kernel,
// launched right behind with programmatic dependent launch, combines the states through
// merge_states.cuh.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>

#include "kernels/common/launch.cuh"
#include "kernels/common/merge_states.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/dense/dense_decode.h"

namespace kvs::kernels {
namespace {

constexpr int kTile = 16;     // tokens per warp step: the K extent of one P.V mma
constexpr int kMaxGroup = 8;  // query heads per kv head: mma rows 0..7; rows 8..15 are zero
// Chunks per (sequence set, kv head) are capped so that the workspace size depends only on
// (max_batch, num_q_heads, head_dim): items <= kMaxChunksPerHead + batch (see plan_chunk).
constexpr int kMaxChunksPerHead = 512;
constexpr int kMergeWarps = 8;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Written by the CTA of chunk 0 of each sequence; read by the merge kernel.
struct SequencePlan {
  int32_t first_item;
  int32_t num_items;
};

struct WorkspaceLayout {
  size_t plan_offset, lse_offset, o_offset, total;
};

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

WorkspaceLayout workspace_layout(int max_batch, int num_q_heads, int head_dim) {
  const size_t items = size_t(kMaxChunksPerHead) + size_t(max_batch);
  WorkspaceLayout w;
  w.plan_offset = 0;
  w.lse_offset = align_up(sizeof(SequencePlan) * size_t(max_batch), 256);
  w.o_offset = w.lse_offset + align_up(sizeof(float) * items * num_q_heads, 256);
  w.total = w.o_offset + align_up(sizeof(float) * items * num_q_heads * head_dim, 256);
  return w;
}

struct DecodeParams {
  const __nv_bfloat16* q;
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
  int chunks_per_head;  // target chunks per kv head over the whole batch
  float scale_log2;     // softmax scale * log2(e)
  __nv_bfloat16* o;
  float* lse;  // may be null
  SequencePlan* plan;
  float* partial_lse;  // [items, num_q_heads]
  float* partial_o;    // [items, num_q_heads, head_dim]
};

struct WorkItem {
  bool valid;
  int b;
  int first_item;  // this sequence's first item
  int num_items;   // this sequence's chunk count
  int begin, end;  // token range of this chunk
};

// Tokens per chunk: total / chunks_per_head rounded up to whole rounds of tiles (align).
// Then sum_b max(1, ceil(len_b / chunk)) <= total / chunk + batch
// <= chunks_per_head + batch, which bounds the item count (grid.x) and the workspace.
__device__ __forceinline__ int64_t plan_chunk(int64_t total_tokens, int chunks_per_head,
                                              int align) {
  const int64_t c = (total_tokens + chunks_per_head - 1) / chunks_per_head;
  const int64_t aligned = (c + align - 1) / align * align;
  return aligned > align ? aligned : align;
}

// Maps work item `item` to its sequence and token range. Called by whole warps; every warp
// of every CTA derives the same plan from seq_lens. An empty sequence gets one item (it
// writes o = 0, lse = -inf), so every sequence has a chunk 0.
__device__ WorkItem find_work_item(const DecodeParams& p, int align, int item, int lane) {
  int64_t total = 0;
  for (int i = lane; i < p.batch; i += 32) total += p.seq_lens[i];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
  const int64_t chunk = plan_chunk(total, p.chunks_per_head, align);

  WorkItem w{};
  w.valid = false;
  int base = 0;  // items of the sequences before this round of 32
  for (int i0 = 0; i0 < p.batch; i0 += 32) {
    const int i = i0 + lane;
    const int len = i < p.batch ? p.seq_lens[i] : 0;
    const int n = i < p.batch ? int(len > 0 ? (len + chunk - 1) / chunk : 1) : 0;
    int incl = n;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int x = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += x;
    }
    const int first = base + incl - n;
    const unsigned hit = __ballot_sync(0xffffffffu, n > 0 && item >= first && item < first + n);
    if (hit) {
      const int src = __ffs(hit) - 1;
      w.valid = true;
      w.b = i0 + src;
      w.first_item = __shfl_sync(0xffffffffu, first, src);
      w.num_items = __shfl_sync(0xffffffffu, n, src);
      const int len_b = __shfl_sync(0xffffffffu, len, src);
      const int64_t begin = int64_t(item - w.first_item) * chunk;
      w.begin = int(begin);
      w.end = int(begin + chunk < len_b ? begin + chunk : len_b);
      return w;
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  return w;
}

// The structural knobs of the decode kernel (docs/gpu.md says how they were chosen).
//   Warps:  warps per CTA; each streams its own 16-token tiles of one kv head.
//   Stages: depth of each warp's cp.async ring of K+V tiles in shared memory.
template <int D, int Warps, int Stages>
struct DecodeConfig {
  static constexpr int kWarps = Warps;
  static constexpr int kStages = Stages;
  static constexpr int kThreads = Warps * 32;
  static constexpr int kPieces = D / 8;               // 16-byte pieces per row
  static constexpr int kTileSlots = kTile * kPieces;  // one K (or V) tile, in uint4
  static constexpr int kStageSlots = 2 * kTileSlots;  // K and V of one tile
  static constexpr int kChunkAlign = Warps * kTile;   // chunks start on whole rounds of tiles
  static constexpr size_t ring_bytes() {
    return size_t(Warps) * Stages * kStageSlots * sizeof(uint4);
  }
  static constexpr size_t merge_bytes() {
    return (size_t(Warps) * kMaxGroup * D + Warps * kMaxGroup) * sizeof(float);
  }
  static constexpr size_t smem_bytes() {
    return ring_bytes() > merge_bytes() ? ring_bytes() : merge_bytes();
  }
};

// Rows are stored swizzled: piece c of row r at c ^ (r & 7), so that the 8 rows an
// ldmatrix phase reads hit 8 different 16-byte bank groups.
template <int D>
__device__ __forceinline__ int smem_slot(int r, int piece) {
  return r * (D / 8) + (piece ^ (r & 7));
}

template <int D, class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads)
    dense_decode_kernel(const __grid_constant__ DecodeParams p) {
  constexpr int kWarps = Cfg::kWarps, kStages = Cfg::kStages, kThreads = Cfg::kThreads;
  constexpr int kPieces = Cfg::kPieces;
  constexpr int kTileSlots = Cfg::kTileSlots;
  constexpr int kCopies = kTile * kPieces / 32;  // 16-byte copies per lane per tile
  constexpr int kKSteps = D / 16;                // mma K steps over the head dim
  extern __shared__ uint4 smem[];

  // Let the merge kernel get resident now; it waits (griddepcontrol.wait) for this whole
  // grid to finish and flush before reading anything.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kvh = blockIdx.y;
  const WorkItem w = find_work_item(p, Cfg::kChunkAlign, blockIdx.x, lane);
  if (!w.valid) return;  // the same for every thread of the CTA
  if (blockIdx.y == 0 && threadIdx.x == 0 && blockIdx.x == w.first_item)
    p.plan[w.b] = SequencePlan{w.first_item, w.num_items};

  const int num_tiles = (w.end - w.begin + kTile - 1) / kTile;
  const int my_tiles = warp < num_tiles ? (num_tiles - 1 - warp) / kWarps + 1 : 0;
  uint4* ring = smem + warp * (kStages * Cfg::kStageSlots);
  // Warp w takes tiles w, w + kWarps, ... of the chunk.
  auto tile_begin_of = [&](int i) { return w.begin + (warp + i * kWarps) * kTile; };

  // KV row (page slot * Hkv + kv head) of this lane's token (lane % 16) in the warp's i-th
  // tile; -1 past the chunk. Rows fit in int32 (checked on the host).
  const int32_t* table = p.page_table + int64_t(w.b) * p.max_pages_per_seq;
  auto tile_row = [&](int i) -> int {
    if (i >= my_tiles) return -1;
    const int t = tile_begin_of(i) + lane % kTile;
    if (t >= w.end) return -1;
    const int page = table[t / p.page_size];
    return (page * p.page_size + t % p.page_size) * p.num_kv_heads + kvh;
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

  // Query fragments (A operand, rows = query heads of the group; rows >= group are zero).
  const int g = lane / 4, t4 = lane % 4;
  const int q_head = kvh * p.group + g;
  uint32_t qa[kKSteps][2];
  {
    const bool has = g < p.group;
    const uint32_t* qrow = reinterpret_cast<const uint32_t*>(
        p.q + (int64_t(w.b) * p.num_q_heads + (has ? q_head : 0)) * D);
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      qa[ks][0] = has ? qrow[ks * 8 + t4] : 0u;
      qa[ks][1] = has ? qrow[ks * 8 + 4 + t4] : 0u;
    }
  }

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
    // Online softmax over this lane's 4 token columns of its head row. The tile's first
    // token is always valid, so the quad's max is finite and exp2(-inf - m) never sees
    // -inf - (-inf).
    float x[4];
    float tile_max = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int t = tile_begin + nt * 8 + 2 * t4 + j;
        const float v = t < w.end ? s[nt][j] * p.scale_log2 : -INFINITY;
        x[nt * 2 + j] = v;
        tile_max = fmaxf(tile_max, v);
      }
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float m_new = fmaxf(m, tile_max);
    const float alpha = exp2f(m - m_new);
    m = m_new;
    uint32_t pa[4];
    float tile_sum = 0.f, tile_sum_bf16 = 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float p0 = exp2f(x[nt * 2] - m_new), p1 = exp2f(x[nt * 2 + 1] - m_new);
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
  // rings; then the CTA merges the warps' states per (head, dim).
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  l_bf16 += __shfl_xor_sync(0xffffffffu, l_bf16, 1);
  l_bf16 += __shfl_xor_sync(0xffffffffu, l_bf16, 2);
  const float warp_lse = l > 0.f ? (m + log2f(l)) * kLn2 : -INFINITY;
  const float inv_l = l_bf16 > 0.f ? 1.f / l_bf16 : 0.f;
  float* so = reinterpret_cast<float*>(smem);  // [kWarps][kMaxGroup][D]
  float* sl = so + kWarps * kMaxGroup * D;     // [kWarps][kMaxGroup]
  __syncthreads();
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) {
    float2 val = make_float2(acc[nd][0] * inv_l, acc[nd][1] * inv_l);
    *reinterpret_cast<float2*>(so + (warp * kMaxGroup + g) * D + nd * 8 + 2 * t4) = val;
  }
  if (t4 == 0) sl[warp * kMaxGroup + g] = warp_lse;
  __syncthreads();

  const bool direct = w.num_items == 1;
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
    const int64_t row = int64_t(w.b) * p.num_q_heads + kvh * p.group + hg;
    if (direct) {
      p.o[row * D + d] = __float2bfloat16_rn(o);
      if (d == 0 && p.lse) p.lse[row] = lse;
    } else {
      const int64_t prow = int64_t(blockIdx.x) * p.num_q_heads + kvh * p.group + hg;
      p.partial_o[prow * D + d] = o;
      if (d == 0) p.partial_lse[prow] = lse;
    }
  }
}

struct MergeParams {
  const SequencePlan* plan;
  const float* partial_lse;
  const float* partial_o;
  int num_q_heads;
  __nv_bfloat16* o;
  float* lse;
};

// One CTA per (sequence, query head) row. Every warp computes the merged lse on its own
// (lanes over the chunk states), then the warps split the states, each summing its share
// of weight * o with all its loads independent, and the warps' sums add up in shared
// memory: a row costs a few memory round trips, not one per chunk.
template <int D>
__global__ void __launch_bounds__(kMergeWarps * 32)
    dense_merge_kernel(const __grid_constant__ MergeParams p) {
  constexpr int kPer = D / 32;  // dims per lane: one 16-byte (D 128) or 8-byte load
  using Vec = typename std::conditional<kPer == 4, float4, float2>::type;
  __shared__ float red[kMergeWarps][D];
  // Everything below reads what dense_decode_kernel wrote.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int row = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = row / p.num_q_heads, h = row % p.num_q_heads;
  const SequencePlan plan = p.plan[b];
  if (plan.num_items <= 1) return;  // written directly by the decode kernel
  const float* lse_col = p.partial_lse + int64_t(plan.first_item) * p.num_q_heads + h;

  LseAccumulator lacc;
  for (int i = lane; i < plan.num_items; i += 32) lacc.add(lse_col[int64_t(i) * p.num_q_heads]);
  const float lse = warp_merge_lse(lacc).lse();

  float o[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) o[j] = 0.f;
#pragma unroll 4
  for (int i = warp; i < plan.num_items; i += kMergeWarps) {
    const int64_t prow = int64_t(plan.first_item + i) * p.num_q_heads + h;
    const float wt = merge_weight(p.partial_lse[prow], lse);
    const Vec x = *reinterpret_cast<const Vec*>(p.partial_o + prow * D + lane * kPer);
    const float* xs = reinterpret_cast<const float*>(&x);
#pragma unroll
    for (int j = 0; j < kPer; ++j) o[j] = wt > 0.f ? fmaf(wt, xs[j], o[j]) : o[j];
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) red[warp][lane * kPer + j] = o[j];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    float sum = 0.f;
#pragma unroll
    for (int ww = 0; ww < kMergeWarps; ++ww) sum += red[ww][lane * kPer + j];
    o[j] = sum;
  }
  __nv_bfloat16* dst = p.o + int64_t(row) * D + lane * kPer;
#pragma unroll
  for (int j = 0; j < kPer; j += 2)
    *reinterpret_cast<__nv_bfloat162*>(dst + j) = __floats2bfloat162_rn(o[j], o[j + 1]);
  if (lane == 0 && p.lse) p.lse[row] = lse;
}

// The decode kernels: w4.s3 (4 warps, 2 CTAs per SM) serves every call; w8.s3 (8 warps,
// 1 CTA per SM: the same warps, ring depth and bytes in flight per SM) is selectable for
// benchmarks only. It streams 3-5% faster at batch 8, but its 16 chunks per kv head split
// most batch sizes into a second, mostly empty wave (docs/gpu.md, "Dense decode kernel").
using DecodeKernel = void (*)(DecodeParams);

struct KernelInfo {
  DecodeKernel fn;
  int warps;
  int smem_bytes;
};

template <int D, int Warps, int Stages>
KernelInfo kernel_info() {
  using Cfg = DecodeConfig<D, Warps, Stages>;
  return {dense_decode_kernel<D, Cfg>, Warps, int(Cfg::smem_bytes())};
}

enum Variant { kW4S3 = 0, kW8S3 = 1, kNumVariants = 2 };

template <int D>
const KernelInfo& variant_kernel(int variant) {
  static const KernelInfo table[kNumVariants] = {kernel_info<D, 4, 3>(), kernel_info<D, 8, 3>()};
  return table[variant];
}

// Benchmarks select the kernel through the environment variable KVS_DENSE_VARIANT=w4.s3 or
// w8.s3 (read once per process; scripts/dense_sweep.sh). Unset: w4.s3.
int selected_variant() {
  static const int selected = [] {
    const char* text = std::getenv("KVS_DENSE_VARIANT");
    if (!text || !*text) return int(kW4S3);
    const std::string s(text);
    if (s == "w4.s3") return int(kW4S3);
    if (s == "w8.s3") return int(kW8S3);
    throw std::invalid_argument("KVS_DENSE_VARIANT='" + s + "': expected w4.s3 or w8.s3");
  }();
  return selected;
}

// Per (device, head dim, variant): SM count and resident CTAs per SM of the decode kernel,
// read once (the attribute and occupancy calls are not stream work, so a captured call may
// also do it).
struct DeviceInfo {
  int sms = 0;
  int ctas_per_sm = 0;
};

cudaError_t device_info(const KernelInfo& kernel, int head_dim, int variant, DeviceInfo* out) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int>, DeviceInfo> cache;
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(dev, head_dim, variant);
  auto it = cache.find(key);
  if (it != cache.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  DeviceInfo info;
  err = cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  err = cudaFuncSetAttribute(kernel.fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             kernel.smem_bytes);
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&info.ctas_per_sm, kernel.fn,
                                                      kernel.warps * 32, kernel.smem_bytes);
  if (err != cudaSuccess) return err;
  if (info.ctas_per_sm < 1) return cudaErrorInvalidConfiguration;
  cache.emplace(key, info);
  *out = info;
  return cudaSuccess;
}

template <int D>
cudaError_t launch_dense_decode(const bf16* q, int num_q_heads, const PagedKV& kv, float scale,
                                bf16* o, float* lse, void* workspace, cudaStream_t stream) {
  const int variant = selected_variant();
  const KernelInfo& kernel = variant_kernel<D>(variant);
  DeviceInfo info;
  cudaError_t err = device_info(kernel, D, variant, &info);
  if (err != cudaSuccess) return err;
  // About one wave of CTAs over the whole batch, rounded down: with 1 CTA per SM, 132 SMs
  // and 8 kv heads, 17 chunks per head would leave 4 CTAs alone in a second wave (twice the
  // time); 16 leave 4 SMs idle instead.
  const int wave = info.sms * info.ctas_per_sm;
  int chunks_per_head = wave / kv.num_kv_heads > 1 ? wave / kv.num_kv_heads : 1;
  if (chunks_per_head > kMaxChunksPerHead) chunks_per_head = kMaxChunksPerHead;

  const WorkspaceLayout layout = workspace_layout(kv.batch, num_q_heads, D);
  char* ws = static_cast<char*>(workspace);
  DecodeParams p;
  p.q = reinterpret_cast<const __nv_bfloat16*>(q);
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
  p.chunks_per_head = chunks_per_head;
  p.scale_log2 = scale * kLog2e;
  p.o = reinterpret_cast<__nv_bfloat16*>(o);
  p.lse = lse;
  p.plan = reinterpret_cast<SequencePlan*>(ws + layout.plan_offset);
  p.partial_lse = reinterpret_cast<float*>(ws + layout.lse_offset);
  p.partial_o = reinterpret_cast<float*>(ws + layout.o_offset);

  const dim3 grid(unsigned(chunks_per_head + kv.batch), unsigned(kv.num_kv_heads));
  kernel.fn<<<grid, kernel.warps * 32, kernel.smem_bytes, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  MergeParams mp;
  mp.plan = p.plan;
  mp.partial_lse = p.partial_lse;
  mp.partial_o = p.partial_o;
  mp.num_q_heads = num_q_heads;
  mp.o = p.o;
  mp.lse = lse;
  return launch_programmatic(dense_merge_kernel<D>, dim3(unsigned(kv.batch * num_q_heads)),
                             dim3(kMergeWarps * 32), 0, stream, mp);
}

// The two head dims served; one instantiation each.
template cudaError_t launch_dense_decode<64>(const bf16*, int, const PagedKV&, float, bf16*, float*,
                                             void*, cudaStream_t);
template cudaError_t launch_dense_decode<128>(const bf16*, int, const PagedKV&, float, bf16*,
                                              float*, void*, cudaStream_t);

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

size_t dense_decode_workspace_bytes(int max_batch, int num_q_heads, int head_dim) {
  if (max_batch < 1 || num_q_heads < 1)
    throw std::invalid_argument("dense_decode_workspace_bytes: max_batch (" +
                                std::to_string(max_batch) + ") and num_q_heads (" +
                                std::to_string(num_q_heads) + ") must be >= 1");
  if (head_dim != 64 && head_dim != 128)
    throw std::invalid_argument("dense_decode_workspace_bytes: head_dim " +
                                std::to_string(head_dim) + " is not supported (64 or 128)");
  return workspace_layout(max_batch, num_q_heads, head_dim).total;
}

// Returns cudaErrorInvalidValue, before any launch, when: head_dim is not 64 or 128;
// num_kv_heads < 1, num_q_heads not a multiple of it, or the group size above 8; page_size,
// num_pages or max_pages_per_seq < 1; num_pages * page_size * num_kv_heads >= 2^31 (KV rows
// are indexed in int32); a pointer is null (lse excepted) or q, k, v, o or workspace is not
// 16-byte aligned; workspace_bytes < dense_decode_workspace_bytes(batch, num_q_heads,
// head_dim). batch == 0 is a no-op. seq_lens must lie in [0, max_pages_per_seq * page_size]
// and the page table entries of those tokens in [0, num_pages): they live in device memory
// and are not checked.
cudaError_t dense_decode_cuda(const bf16* q, int num_q_heads, const PagedKV& kv, float scale,
                              bf16* o, float* lse, void* workspace, size_t workspace_bytes,
                              cudaStream_t stream) {
  const int d = kv.head_dim;
  if (d != 64 && d != 128) return cudaErrorInvalidValue;
  if (kv.batch < 0 || kv.num_kv_heads < 1 || num_q_heads < 1) return cudaErrorInvalidValue;
  if (num_q_heads % kv.num_kv_heads != 0 || num_q_heads / kv.num_kv_heads > kMaxGroup)
    return cudaErrorInvalidValue;
  if (kv.page_size < 1 || kv.num_pages < 1 || kv.max_pages_per_seq < 1)
    return cudaErrorInvalidValue;
  if (int64_t(kv.num_pages) * kv.page_size * kv.num_kv_heads >= (int64_t(1) << 31))
    return cudaErrorInvalidValue;
  if (kv.batch == 0) return cudaSuccess;
  if (!q || !kv.k || !kv.v || !kv.page_table || !kv.seq_lens || !o || !workspace)
    return cudaErrorInvalidValue;
  if (!aligned16(q) || !aligned16(kv.k) || !aligned16(kv.v) || !aligned16(o) ||
      !aligned16(workspace))
    return cudaErrorInvalidValue;
  if (workspace_bytes < workspace_layout(kv.batch, num_q_heads, d).total)
    return cudaErrorInvalidValue;
  return d == 64 ? launch_dense_decode<64>(q, num_q_heads, kv, scale, o, lse, workspace, stream)
                 : launch_dense_decode<128>(q, num_q_heads, kv, scale, o, lse, workspace, stream);
}

}  // namespace kvs::kernels
