// CUDA MAC-Attention decode (mac.h): match -> attend (band + tail, or everything on a miss)
// -> complete + rectify-append, three launches chained by programmatic dependent launch with
// no host sync, so a step is capturable.
//
// The step is short (a 100 % hit step reads ~1 % of a dense step's bytes), so its time is the
// number of dependent memory round trips, not bandwidth. The layout keeps that number small:
//   match: one thread-block cluster per (sequence, query head) scans the whole ring at once
//     (every slot's position and lse, then every valid ring row, all in flight), reduces
//     through distributed shared memory and decides hit / start in its first CTA. No
//     arrival counters.
//   attend: launched with programmatic dependent launch behind match. Every warp derives the
//     same plan from seq_lens and the heads' starts on its own (as dense_decode.cu does):
//     each (sequence, kv head)'s union span [min_h start_h, t] is cut into chunks whose length
//     spreads the total tokens over about one wave of CTAs. The chunk that holds E(t) inside
//     it runs as two segments, so that every state belongs either to `new` (tokens below
//     E(t)) or to the tail, and a pair needs no more CTAs than dense decode would give it.
//     The pair's first CTA publishes where the pair's states lie.
//   complete: one CTA per (sequence, query head), behind attend. Its warps split the head's
//     states (a missed pair at 128K has ~35), then one warp merges them with the reused entry,
//     writes entry(t) into the ring and the output. (Done by a pair's last attend CTA after an
//     arrival counter, one CTA staged and merged every state of the group: the longest step
//     of a miss; docs/gpu.md.)
//
// The attention is the tile loop dense decode uses (kernels/common/attend_tiles.cuh) with a
// per-row start: a head row masks tokens below its own start, so a group reads its KV once
// for the union of its heads' spans; and every chunk writes a partial state, since the
// completion merges states with the reused entries anyway.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>

#include "kernels/common/attend_tiles.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/merge_states.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/mac/mac.h"

namespace kvs::kernels::mac {
namespace {

constexpr int kMatchWarps = 4;
constexpr int kRowsPerWarp = 16;
constexpr int kMatchTile = kMatchWarps * kRowsPerWarp;  // ring slots per match CTA and pass
constexpr int kMaxCluster = 8;                           // match CTAs per (sequence, head)
// The attention CTAs: dense decode's shipped shape (4 warps, 3-stage rings, 2 CTAs per SM).
template <int D>
using AttendConfig = tiles::TileConfig<D, 4, 3>;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
using tiles::kMaxGroup;
constexpr int kChunkAlign = kWarps * tiles::kTile;
// Cap on the chunks the planner aims for; with one chunk and one state per pair of slack it
// bounds the states, so the workspace size depends only on the shapes.
constexpr int kMaxChunks = 1024;
constexpr unsigned kFull = 0xffffffffu;

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

// Match CTAs per (sequence, query head): one thread-block cluster covers the ring.
int match_cluster(int window) {
  const int tiles = (window + kMatchTile - 1) / kMatchTile;
  return tiles < kMaxCluster ? tiles : kMaxCluster;
}

// Where a (sequence, kv head) pair's states lie, for the completion: n_r states of the part
// below E(t) from first_state on, then n_t states of the tail.
struct alignas(16) PairPlan {
  int32_t first_state, n_r, n_t, unused;
};

struct Layout {
  size_t head_start, head_slot, pair_plan, partial_lse, partial_o, total;
};

int max_states(int max_batch, int num_kv_heads) { return kMaxChunks + 2 * max_batch * num_kv_heads; }

Layout layout(int max_batch, int num_q_heads, int num_kv_heads, int head_dim) {
  const size_t rows = size_t(max_batch) * num_q_heads;
  const size_t states = size_t(max_states(max_batch, num_kv_heads));
  const size_t group = size_t(num_q_heads / num_kv_heads);
  Layout l;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at += align_up(bytes);
    return here;
  };
  l.head_start = take(rows * sizeof(int32_t));
  l.head_slot = take(rows * sizeof(int32_t));
  l.pair_plan = take(size_t(max_batch) * num_kv_heads * sizeof(PairPlan));
  l.partial_lse = take(states * group * sizeof(float));
  l.partial_o = take(states * group * head_dim * sizeof(float));
  l.total = at;
  return l;
}

struct Params {
  const __nv_bfloat16* q;
  const __nv_bfloat16* q_pre;
  tiles::KvSource kv;
  const int32_t* seq_lens;
  int batch;
  int num_kv_heads;
  int num_q_heads;
  int group;
  int chunks_target;
  RingState st;
  MatchParams mp;
  __nv_bfloat16* out;
  float* lse;  // may be null
  unsigned long long* counters;  // may be null
  int32_t* head_start;     // [batch * Hq] first token of the head's own read (0: miss)
  int32_t* head_slot;      // [batch * Hq] ring slot of the reused entry, -1: miss
  PairPlan* pair_plan;     // [batch * Hkv], written by each pair's first attend CTA
  float* partial_lse;      // [states, group]
  float* partial_o;        // [states, group, D]
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

// This lane's D/32 values of a bf16 row, rounded, in one store (8 bytes at D 128).
template <int D>
__device__ __forceinline__ void store_bf16(__nv_bfloat16* row, int lane, const float (&x)[D / 32]) {
  constexpr int kPer = D / 32;
  __nv_bfloat162 v[kPer / 2];
#pragma unroll
  for (int k = 0; k < kPer / 2; ++k) v[k] = __floats2bfloat162_rn(x[2 * k], x[2 * k + 1]);
  using Vec = typename std::conditional<kPer == 4, uint2, uint32_t>::type;
  *reinterpret_cast<Vec*>(row + lane * kPer) = *reinterpret_cast<const Vec*>(v);
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

// Folds query x (this lane's dims) into the running means of (b, h): one warp. mean, count
// and q_sq are their current values (the caller loads them early).
template <int D>
__device__ void update_running_means(const RingState& st, const MatchParams& mp, int b, int h,
                                     int lane, const float (&x)[D / 32],
                                     const float (&mean)[D / 32], int32_t count, float q_sq) {
  constexpr int kPer = D / 32;
  float sq = 0.f;
#pragma unroll
  for (int k = 0; k < kPer; ++k) sq += x[k] * x[k];
  sq = warp_sum(sq);
  const float w = stats_weight(&count, mp.stats_horizon);
  float next[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) next[k] = mean[k] + w * (x[k] - mean[k]);
  using Vec =
      typename std::conditional<kPer == 4, float4, float2>::type;  // q_mean: 16-byte aligned
  *reinterpret_cast<Vec*>(st.q_mean + st.head(b, h) * D + lane * kPer) =
      *reinterpret_cast<const Vec*>(next);
  if (lane == 0) {
    st.q_count[st.head(b, h)] = count;
    st.q_sq[st.head(b, h)] = q_sq + w * (sq - q_sq);
  }
}

// A candidate of the match: squared distance, position, its entry's lse, and the rows scanned
// by whoever found it (summed in the reduction).
struct Candidate {
  float d2, lse;
  int pos, scanned;
};

// Grid (cluster, Hq, batch) in clusters of gridDim.x CTAs: the cluster of (b, h) scans the
// ring together. CTA r's warp w takes 16 slots at (r * kMatchWarps + w) * 16 (+ one cluster's
// slots per further pass): lanes load the slots' positions and lses, then the warp loads the
// valid rows with all loads in flight (each lane D/32 dims of every row) and sums the squared
// distances with shuffles. Every warp's best goes into CTA 0's shared memory; after the
// cluster barrier, warp 0 of CTA 0 reduces them and decides. No global round trip.
template <int D>
__global__ void __launch_bounds__(kMatchWarps * 32) match_kernel(const __grid_constant__ Params p) {
  constexpr int kPer = D / 32;
  // The attend grid may get resident now: it waits (griddepcontrol.wait) for this whole grid
  // to finish and flush before it reads what this kernel writes.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank()), ranks = int(cluster.num_blocks());
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int W = p.st.window;
  const int64_t head_row = p.st.head(b, h);
  __shared__ Candidate s_best[kMaxCluster * kMatchWarps];  // CTA 0's copy is the one used
  // A CTA may write into CTA 0's shared memory only once every CTA of the cluster runs: the
  // arrival here, the wait before the write (the scan in between hides it).
  ptx::cluster_arrive_relaxed();

  // Independent loads first: the length, the query, and (the deciding warp) the head's
  // running means.
  const bool decider = rank == 0 && warp == 0;
  const int len = p.seq_lens[b];
  float qv[kPer], mean[kPer];
  load_bf16<D>(p.q_pre + head_row * D, lane, qv);
  float q_sq = 0.f;
  int q_count = 0;
  if (decider) {
    const float* m = p.st.q_mean + head_row * D + lane * kPer;
#pragma unroll
    for (int k = 0; k < kPer; ++k) mean[k] = m[k];
    q_sq = p.st.q_sq[head_row];
    q_count = p.st.q_count[head_row];
  }
  const int t = len - 1;
  const bool eligible = t >= 0 && t >= p.mp.min_context;  // else no scan (CPU: match_cpu)
  const int lo = t - W > 0 ? t - W : 0;

  Candidate best{INFINITY, -INFINITY, -1, 0};
  for (int slot0 = (rank * kMatchWarps + warp) * kRowsPerWarp; slot0 < W;
       slot0 += ranks * kMatchTile) {
    int my_pos = -1;
    float my_lse = -INFINITY;
    if (lane < kRowsPerWarp && slot0 + lane < W) {
      my_pos = p.st.pos[int64_t(b) * W + slot0 + lane];
      my_lse = p.st.lse[p.st.row(b, slot0 + lane, h)];
    }
    // The rows are loaded whether or not their slot is a candidate, so that these loads do
    // not wait for the positions and the length: the scan is one memory round trip. A row
    // that is no candidate (never written, too old, or the step is below min_context) is
    // dropped below; the counters count candidates only.
    uint32_t raw[kRowsPerWarp][kPer / 2];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      if (slot0 + i < W) {
        const uint32_t* row = reinterpret_cast<const uint32_t*>(
            p.st.q + p.st.row(b, slot0 + i, h) * D + lane * kPer);
#pragma unroll
        for (int k = 0; k < kPer / 2; ++k) raw[i][k] = row[k];
      }
    }
    const unsigned valid = __ballot_sync(kFull, eligible && my_pos >= lo && my_pos < t);
    best.scanned += __popc(valid);
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      if (!(valid >> i & 1u)) continue;  // warp-uniform
      float s = 0.f;
#pragma unroll
      for (int k = 0; k < kPer / 2; ++k) {
        const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[i][k]));
        const float d0 = qv[2 * k] - x.x, d1 = qv[2 * k + 1] - x.y;
        s = fmaf(d0, d0, s);
        s = fmaf(d1, d1, s);
      }
      s = warp_sum(s);
      const int pos = __shfl_sync(kFull, my_pos, i);
      const float e = __shfl_sync(kFull, my_lse, i);
      if (better(s, pos, best.d2, best.pos)) {
        best.d2 = s;
        best.pos = pos;
        best.lse = e;
      }
    }
  }
  ptx::cluster_wait();
  if (lane == 0) cluster.map_shared_rank(s_best, 0)[rank * kMatchWarps + warp] = best;
  cluster.sync();  // CTA 0 holds every warp's best; the others may leave
  if (!decider) return;

  Candidate c{INFINITY, -INFINITY, -1, 0};
  if (lane < ranks * kMatchWarps) c = s_best[lane];
  int rows = c.scanned;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float od = __shfl_xor_sync(kFull, c.d2, off);
    const float oe = __shfl_xor_sync(kFull, c.lse, off);
    const int op = __shfl_xor_sync(kFull, c.pos, off);
    rows += __shfl_xor_sync(kFull, rows, off);
    if (better(od, op, c.d2, c.pos)) {
      c.d2 = od;
      c.pos = op;
      c.lse = oe;
    }
  }
  float m2 = 0.f;
#pragma unroll
  for (int k = 0; k < kPer; ++k) m2 += mean[k] * mean[k];
  m2 = warp_sum(m2);
  const float thr = match_threshold(p.mp, h, D, q_sq - m2, q_count);
  const bool hit = eligible && c.pos >= 0 && c.d2 < thr && isfinite(c.lse);
  if (len == 0) {  // nothing to attend: o = 0, lse = -inf (no attend CTA covers this row)
    __nv_bfloat16* out = p.out + head_row * D + lane * kPer;
#pragma unroll
    for (int k = 0; k < kPer; ++k) out[k] = __float2bfloat16_rn(0.f);
    if (lane == 0 && p.lse) p.lse[head_row] = -INFINITY;
  }
  if (lane == 0) {
    const int start = hit ? cache_end(c.pos, p.mp.band) : 0;
    p.head_start[head_row] = start;
    p.head_slot[head_row] = hit ? c.pos % W : -1;
    p.st.last_start[head_row] = start;
    if (h == 0) p.st.last_len[b] = len;
    if (p.counters && len > 0) {
      unsigned long long bytes = (unsigned long long)rows * D * 2;
      if (hit) bytes += D * 2 + 4;
      if (bytes) atomicAdd(p.counters + kSelectionBytes, bytes);
      atomicAdd(p.counters + kHeadSteps, 1ull);
      if (hit) atomicAdd(p.counters + kHeadHits, 1ull);
    }
  }
}

// The plan below runs on every CTA's critical path right after the wait on match, one
// dependent chain per warp (ncu: ~490 instructions per warp before the first mma), so it
// keeps to 32-bit divisions and one scan where it can.
//
// Tokens per chunk: total / target rounded up to whole rounds of tiles, at most 2^30 (spans
// are int32; the cap binds only if sequences share pages).
__device__ __forceinline__ int plan_chunk(int64_t total, int target) {
  const int64_t c = total < INT32_MAX - target
                        ? int64_t((uint32_t(total) + uint32_t(target) - 1) / uint32_t(target))
                        : (total + target - 1) / target;
  const int64_t aligned = (c + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  const int64_t kCap = int64_t(1) << 30;
  return int(aligned < kChunkAlign ? kChunkAlign : aligned > kCap ? kCap : aligned);
}

// A (sequence, kv head) pair's span [start, len): its length, E(t), and the union start,
// the smallest start of its heads (at most E(t): a hit's start E(j) is below E(t)). len 0:
// an empty span.
struct PairSpan {
  int len, et, start;
};

// The group's starts are loaded unrolled and predicated (up to kMaxGroup), no loop.
__device__ __forceinline__ PairSpan pair_span(const Params& p, int pr) {
  const int b = pr / p.num_kv_heads, kvh = pr - b * p.num_kv_heads;
  const int32_t* starts = p.head_start + int64_t(b) * p.num_q_heads + kvh * p.group;
  int start[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) start[g] = g < p.group ? __ldcg(starts + g) : INT32_MAX;
  PairSpan s;
  s.len = p.seq_lens[b];
  s.et = s.len > 0 ? cache_end(s.len - 1, p.mp.band) : 0;
  s.start = s.et;
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) s.start = min(s.start, start[g]);
  return s;
}

// An attend CTA's chunk of its pair's span [start, len), and where its states go. A pair's
// span is cut into n chunks of `chunk` tokens from its start, like dense decode's sequences.
// The chunk k holding E(t) is processed as two segments when E(t) falls inside it: its
// tokens below E(t) give a state of `new`, the rest a state of the tail. So a pair has
// n_r = k (+1 if the chunk straddles) states below E(t), then n_t = n - k tail states, at
// first_state on; chunk c's first state is c, or c + 1 past a straddling chunk k.
struct WorkItem {
  bool valid;
  bool split;  // the chunk straddles E(t): two segments, states `state` and `state + 1`
  int pair, begin, end;
  int state;   // the chunk's (first) state
  int chunks;  // the pair's chunks (CTAs)
  int first_state, n_r, n_t;
  PairSpan span;
};

// Chunks and states of a pair: n chunks, the index k of the chunk holding E(t), straddle.
struct PairCuts {
  int n, k;
  bool straddle;
};

__device__ __forceinline__ PairCuts pair_cuts(const PairSpan& s, int chunk) {
  PairCuts c{0, 0, false};
  if (s.len == 0) return c;
  const uint32_t below = uint32_t(s.et - s.start), span = uint32_t(s.len - s.start);
  c.n = int((span + uint32_t(chunk) - 1) / uint32_t(chunk));
  c.k = int(below / uint32_t(chunk));
  c.straddle = below != uint32_t(c.k) * uint32_t(chunk);
  return c;
}

// Inclusive prefix sum of x over the warp's lanes.
__device__ __forceinline__ int warp_inclusive_scan(int x, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(kFull, x, off);
    if (lane >= off) x += y;
  }
  return x;
}

// Maps CTA `item` to its chunk. Called by whole warps; every warp of every CTA derives the
// same plan from seq_lens and head_start (two passes over the pairs: the span tokens, then
// prefix sums of the chunk and state counts). The chunk length spreads the span tokens over
// about one wave; chunks <= total / chunk + pairs <= grid, states <= chunks + pairs.
__device__ WorkItem find_work_item(const Params& p, int item, int lane) {
  const int pairs = p.batch * p.num_kv_heads;
  long long total = 0;
  PairSpan first_round{0, 0, 0};  // pair `lane`, kept for the second pass (no reload)
  for (int pr = lane; pr < pairs; pr += 32) {
    const PairSpan s = pair_span(p, pr);
    if (pr == lane) first_round = s;
    if (s.len > 0) total += s.len - s.start;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(kFull, total, off);
  const int chunk = plan_chunk(total, p.chunks_target);

  WorkItem w{};
  w.valid = false;
  int item_base = 0, state_base = 0;
  for (int pr0 = 0; pr0 < pairs; pr0 += 32) {
    const int pr = pr0 + lane;
    PairSpan s{0, 0, 0};
    if (pr < pairs) s = pr0 == 0 ? first_round : pair_span(p, pr);
    const PairCuts c = pair_cuts(s, chunk);
    const int states = c.n + (c.straddle ? 1 : 0);
    // One scan for both counts: a round's chunks and states stay below 2^16 (chunks <=
    // chunks_target + pairs <= kMaxChunks + 32 per round of 32 pairs).
    const int both_incl = warp_inclusive_scan(c.n | states << 16, lane);
    const int items_incl = both_incl & 0xffff, states_incl = both_incl >> 16;
    const int first = item_base + items_incl - c.n;
    const unsigned hit = __ballot_sync(kFull, c.n > 0 && item >= first && item < first + c.n);
    if (hit) {
      const int src = __ffs(hit) - 1;
      w.valid = true;
      w.pair = pr0 + src;
      const int ci = item - __shfl_sync(kFull, first, src);
      w.first_state = state_base + __shfl_sync(kFull, states_incl - states, src);
      const int k = __shfl_sync(kFull, c.k, src);
      const bool straddle = __shfl_sync(kFull, int(c.straddle), src) != 0;
      w.split = straddle && ci == k;
      w.state = w.first_state + ci + (straddle && ci > k ? 1 : 0);
      w.n_r = k + (straddle ? 1 : 0);
      w.chunks = __shfl_sync(kFull, c.n, src);
      w.n_t = w.chunks - k;
      w.span.len = __shfl_sync(kFull, s.len, src);
      w.span.et = __shfl_sync(kFull, s.et, src);
      w.span.start = __shfl_sync(kFull, s.start, src);
      const int64_t lo = w.span.start + int64_t(ci) * chunk;
      w.begin = int(lo);
      w.end = int(lo + chunk < w.span.len ? lo + chunk : w.span.len);
      return w;
    }
    item_base += __shfl_sync(kFull, items_incl, 31);
    state_base += __shfl_sync(kFull, states_incl, 31);
  }
  return w;
}

// What the completion of one query head reads besides the pair's states: q_pre and the
// running means (written only by completions, so loaded before the wait), and the reused
// entry (slot_j, -1: none); this lane's D/32 dims of each vector.
template <int D>
struct HeadInputs {
  float lse_j;
  float o_j[D / 32], qp[D / 32], mean[D / 32];
  int32_t count;
  float q_sq;
};

template <int D>
__device__ void load_head_own(const Params& p, int64_t row, int lane, HeadInputs<D>& in) {
  constexpr int kPer = D / 32;
  load_bf16<D>(p.q_pre + row * D, lane, in.qp);
  const float* m = p.st.q_mean + row * D + lane * kPer;
#pragma unroll
  for (int k = 0; k < kPer; ++k) in.mean[k] = m[k];
  in.count = p.st.q_count[row];
  in.q_sq = p.st.q_sq[row];
}

template <int D>
__device__ void load_entry(const Params& p, int b, int h, int slot_j, int lane, HeadInputs<D>& in) {
  in.lse_j = -INFINITY;
  if (slot_j < 0) return;
  const int64_t r = p.st.row(b, slot_j, h);
  in.lse_j = p.st.lse[r];
  load_bf16<D>(reinterpret_cast<const __nv_bfloat16*>(p.st.o) + r * D, lane, in.o_j);
}

// Completion of one query head (one warp) from its two parts, as unnormalized merges (part
// r: the states below E(t); part t: the tail) at step t: new = merge(part r, reused entry j)
// is written into the ring (rectify-append), and out = merge(part r, entry j, tail). out is
// merged from the parts directly, not from new, so that the two merges (one warp, each a
// chain of dependent steps) run side by side.
template <int D>
__device__ __forceinline__ void finish_head(const Params& p, int t, int b, int h,
                                            const HeadInputs<D>& in,
                                            const StateAccumulator<D / 32>& part_r,
                                            const StateAccumulator<D / 32>& part_t, int lane) {
  constexpr int kPer = D / 32;
  const int64_t row = int64_t(b) * p.num_q_heads + h;
  const int W = p.st.window;
  StateAccumulator<kPer> entry;  // empty on a miss (o_j is not loaded then)
  if (in.lse_j != -INFINITY) {
    entry.lse.m = in.lse_j;
    entry.lse.sum = 1.f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) entry.o[k] = in.o_j[k];
  }
  StateAccumulator<kPer> merged_new, merged_out;
  {
    const StateAccumulator<kPer> parts[2] = {part_r, entry};
    merged_new.add_batch(parts);
  }
  {
    const StateAccumulator<kPer> parts[3] = {part_r, entry, part_t};
    merged_out.add_batch(parts);
  }
  float o_new[kPer], o_out[kPer];
  merged_new.normalized(o_new);
  merged_out.normalized(o_out);

  // Rectify-append: entry(t) = new. Slot t mod W may be the matched slot (j = t - W): every
  // lane has read it above.
  __syncwarp();
  const int slot_t = t % W;
  const int64_t rt = p.st.row(b, slot_t, h);
  store_bf16<D>(reinterpret_cast<__nv_bfloat16*>(p.st.o) + rt * D, lane, o_new);
  store_bf16<D>(reinterpret_cast<__nv_bfloat16*>(p.st.q) + rt * D, lane, in.qp);  // exact
  store_bf16<D>(p.out + row * D, lane, o_out);
  if (lane == 0) {
    p.st.lse[rt] = merged_new.lse.lse();
    if (h == 0) p.st.pos[int64_t(b) * W + slot_t] = t;
    if (p.lse) p.lse[row] = merged_out.lse.lse();
  }
  update_running_means<D>(p.st, p.mp, b, h, lane, in.qp, in.mean, in.count, in.q_sq);
}

constexpr int kCompleteWarps = 8;
constexpr int kCompleteBatch = 8;  // states per warp in flight at once

// One CTA per (sequence, query head), behind attend. Warp w takes the head's states w, w + 8,
// ..., kCompleteBatch at a time (all loads in flight, then one batched fold), into two
// accumulators, the part below E(t) and the tail; warp 0 folds the warps' accumulators in
// warp order (the result does not depend on timing) and finishes the head. A missed pair
// among hits at batch 1 gets most of the wave's chunks (~256 states at 128K), so the fold is
// batched rather than chained.
template <int D>
__global__ void __launch_bounds__(kCompleteWarps * 32)
    complete_kernel(const __grid_constant__ Params p) {
  constexpr int kPer = D / 32;
  using Vec = typename std::conditional<kPer == 4, float4, float2>::type;
  // Each warp's two accumulators: below E(t), and the tail.
  __shared__ WarpAccumulators<kCompleteWarps, D> warp_acc[2];
  const int row = blockIdx.x;
  const int b = row / p.num_q_heads, h = row % p.num_q_heads;
  const int kvh = h / p.group, hg = h % p.group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Before the wait, everything that attend does not write: the length, this head's query
  // and running means, and the reused entry (from match's decision: this grid starts only
  // after every attend CTA passed its own wait on match, see attend_kernel).
  const int len = p.seq_lens[b];
  HeadInputs<D> in;
  if (len > 0 && warp == 0) {
    load_head_own<D>(p, row, lane, in);
    load_entry<D>(p, b, h, __ldcg(p.head_slot + row), lane, in);
  }
  // Every CTA waits, the ones with nothing to do included, so that this grid never ends
  // before the attend grid.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (len == 0) return;  // match wrote o = 0, lse = -inf; no state, no entry
  const int4 plan = __ldcg(reinterpret_cast<const int4*>(p.pair_plan + b * p.num_kv_heads + kvh));
  const PairPlan ps{plan.x, plan.y, plan.z, plan.w};
  const int n = ps.n_r + ps.n_t;
  StateAccumulator<kPer> acc[2];  // below E(t), tail
  for (int j0 = warp; j0 < n; j0 += kCompleteWarps * kCompleteBatch) {
    // The batch's states of each part; a state of the other part (or past n) is empty there.
    float lse[2][kCompleteBatch], o[kCompleteBatch][kPer];
#pragma unroll
    for (int k = 0; k < kCompleteBatch; ++k) {
      const int j = j0 + k * kCompleteWarps;
      float l = -INFINITY;
      if (j < n) {
        const int64_t prow = int64_t(ps.first_state + j) * p.group + hg;
        l = __ldcg(p.partial_lse + prow);
        const Vec v = __ldcg(reinterpret_cast<const Vec*>(p.partial_o + prow * D + lane * kPer));
        const float* vs = reinterpret_cast<const float*>(&v);
#pragma unroll
        for (int e = 0; e < kPer; ++e) o[k][e] = vs[e];
      }
      lse[0][k] = j < ps.n_r ? l : -INFINITY;
      lse[1][k] = j < ps.n_r ? -INFINITY : l;
    }
    acc[0].add_batch(lse[0], o);
    acc[1].add_batch(lse[1], o);
  }
  warp_acc[0].put(acc[0], warp, lane);
  warp_acc[1].put(acc[1], warp, lane);
  __syncthreads();
  if (warp != 0) return;
  finish_head<D>(p, len - 1, b, h, in, warp_acc[0].fold(lane), warp_acc[1].fold(lane), lane);
}

// L2 prefetch of the page-table entries of every sequence's tokens, spread over the grid:
// lane j of warp 0 takes sequences j, j + 32, ..., and CTA i lines i, i + grid, ... of each.
__device__ void prefetch_page_tables(const Params& p) {
  if (threadIdx.x >= 32) return;
  constexpr int kPerLine = 128 / sizeof(int32_t);
  for (int b = threadIdx.x; b < p.batch; b += 32) {
    const int pages = (p.seq_lens[b] + p.kv.page_size - 1) / p.kv.page_size;
    const int lines = (pages + kPerLine - 1) / kPerLine;
    const int32_t* table = p.kv.page_table + int64_t(b) * p.kv.max_pages_per_seq;
    for (int l = blockIdx.x; l < lines; l += gridDim.x) ptx::prefetch_l2(table + l * kPerLine);
  }
}

// One CTA per chunk (grid.x bounds the chunks; the plan says how many there are).
template <int D>
__global__ void __launch_bounds__(kThreads) attend_kernel(const __grid_constant__ Params p) {
  extern __shared__ uint4 smem[];  // the tile loop's, and nothing static (attend_tiles.cuh)

  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  // While match runs: pull the batch's page tables into L2 (seq_lens and the tables were
  // written before match started, so they may be read before the wait), one 128-byte line
  // per CTA and round, so that the chunk's first page lookups do not go to DRAM.
  prefetch_page_tables(p);
  // The match grid's decisions (head_start, head_slot) are read only after this.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // The completion grid may get resident now. Only now: it reads match's decision (the
  // reused slot) before its own wait, which orders it after this grid only, and every CTA
  // of this grid triggers or exits only after match has completed and flushed.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const WorkItem w = find_work_item(p, blockIdx.x, lane);
  if (!w.valid) return;  // the same for every thread of the CTA
  const int b = w.pair / p.num_kv_heads, kvh = w.pair % p.num_kv_heads;
  const int64_t group_row = int64_t(b) * p.num_q_heads + kvh * p.group;
  if (threadIdx.x == 0 && w.state == w.first_state) {  // the pair's first chunk
    p.pair_plan[w.pair] = PairPlan{w.first_state, w.n_r, w.n_t, 0};
    if (p.counters) {
      atomicAdd(p.counters + kRowsRead, (unsigned long long)(w.span.len - w.span.start));
      atomicAdd(p.counters + kRowsContext, (unsigned long long)w.span.len);
    }
  }
  // Tokens below the start of this lane's head row are not its to read (a hit head reuses
  // them); the tail holds no such tokens.
  const int head_start = g < p.group ? __ldcg(p.head_start + group_row + g) : 0;

  uint32_t qa[D / 16][2];
  tiles::load_query_fragments<D>(p.q + group_row * D, p.group, lane, qa);

  // The chunk's segments: below E(t) with the heads' own starts, and the tail unmasked; one
  // call site of the tile loop, so that its code is in the kernel once.
  using Cfg = AttendConfig<D>;
  const int segments = w.split ? 2 : 1;
  for (int sg = 0; sg < segments; ++sg) {
    const int begin = sg == 0 ? w.begin : w.span.et;
    const int end = w.split && sg == 0 ? w.span.et : w.end;
    const bool below = end <= w.span.et;
    if (sg > 0) __syncthreads();  // the merge area is read before the ring is refilled
    tiles::attend_tiles<Cfg, true>(p.kv, b, kvh, begin, end, below ? head_start : 0, qa, smem);
    __syncthreads();
    tiles::merge_warp_states<Cfg>(smem, p.group, [&](int hg, int d, float4 o, float lse) {
      const int64_t prow = int64_t(w.state + sg) * p.group + hg;
      *reinterpret_cast<float4*>(p.partial_o + prow * D + d) = o;
      if (d == 0) p.partial_lse[prow] = lse;
    });
  }
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
    float mean[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) mean[k] = st.q_mean[st.head(b, h) * D + lane * kPer + k];
    const int32_t count = st.q_count[st.head(b, h)];
    const float q_sq = st.q_sq[st.head(b, h)];
    __syncwarp();  // every lane read count and q_sq before lane 0 rewrites them
    update_running_means<D>(st, mp, b, h, lane, qp, mean, count, q_sq);
    __syncwarp();
  }
}

template <int D>
constexpr size_t attend_smem_bytes() {
  return AttendConfig<D>::smem_bytes();
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
  const int cluster = match_cluster(p.st.window);
  cudaLaunchConfig_t mcfg = {};
  mcfg.gridDim = dim3(unsigned(cluster), unsigned(p.num_q_heads), unsigned(p.batch));
  mcfg.blockDim = dim3(kMatchWarps * 32);
  mcfg.stream = stream;
  cudaLaunchAttribute mattr[1];
  mattr[0].id = cudaLaunchAttributeClusterDimension;
  mattr[0].val.clusterDim.x = unsigned(cluster);
  mattr[0].val.clusterDim.y = 1;
  mattr[0].val.clusterDim.z = 1;
  mcfg.attrs = mattr;
  mcfg.numAttrs = 1;
  err = cudaLaunchKernelEx(&mcfg, match_kernel<D>, p);
  if (err != cudaSuccess) return err;
  // Programmatic dependent launch: attend CTAs get resident while match runs and wait for it
  // (griddepcontrol.wait) before reading its decisions.
  const unsigned grid = unsigned(p.chunks_target + p.batch * p.num_kv_heads);  // >= chunks
  err = launch_programmatic(attend_kernel<D>, dim3(grid), dim3(kThreads), attend_smem_bytes<D>(),
                            stream, p);
  if (err != cudaSuccess) return err;
  return launch_programmatic(complete_kernel<D>, dim3(unsigned(p.batch * p.num_q_heads)),
                             dim3(kCompleteWarps * 32), 0, stream, p);
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
  return layout(max_batch, num_q_heads, num_kv_heads, head_dim).total;
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
                        bf16* out, float* lse, unsigned long long* counters, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream) {
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
  if (!q || !q_pre || !kv.k || !kv.v || !kv.page_table || !kv.seq_lens || !out || !workspace)
    return cudaErrorInvalidValue;
  if (!aligned16(q) || !aligned16(q_pre) || !aligned16(kv.k) || !aligned16(kv.v) ||
      !aligned16(out) || !aligned16(workspace))
    return cudaErrorInvalidValue;
  const Layout l = layout(kv.batch, num_q_heads, kv.num_kv_heads, d);
  if (workspace_bytes < l.total) return cudaErrorInvalidValue;

  char* ws = static_cast<char*>(workspace);
  Params p;
  p.q = reinterpret_cast<const __nv_bfloat16*>(q);
  p.q_pre = reinterpret_cast<const __nv_bfloat16*>(q_pre);
  p.kv = tiles::KvSource{reinterpret_cast<const __nv_bfloat16*>(kv.k),
                          reinterpret_cast<const __nv_bfloat16*>(kv.v), kv.page_table,
                          kv.page_size, kv.num_kv_heads, kv.max_pages_per_seq,
                          scale * tiles::kLog2e};
  p.seq_lens = kv.seq_lens;
  p.batch = kv.batch;
  p.num_kv_heads = kv.num_kv_heads;
  p.num_q_heads = num_q_heads;
  p.group = num_q_heads / kv.num_kv_heads;
  p.chunks_target = 0;
  p.st = st;
  p.mp = mp;
  p.out = reinterpret_cast<__nv_bfloat16*>(out);
  p.lse = lse;
  p.counters = counters;
  p.head_start = reinterpret_cast<int32_t*>(ws + l.head_start);
  p.head_slot = reinterpret_cast<int32_t*>(ws + l.head_slot);
  p.pair_plan = reinterpret_cast<PairPlan*>(ws + l.pair_plan);
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
