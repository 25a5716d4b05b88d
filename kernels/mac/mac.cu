// CUDA MAC-Attention decode (mac.h): match -> attend (band + tail, or everything on a miss)
// with complete + rectify-append folded into the last CTA of each (sequence, kv head), two
// launches with no host sync, so a step is capturable.
//
// The step is short (a 100 % hit step reads ~1 % of a dense step's bytes), so its time is the
// number of dependent memory round trips, not bandwidth. The layout keeps that number small:
//   match: one CTA per (sequence, query head) scans the whole ring at once (16 warps x 32
//     slots: every slot's position and lse, then every valid ring row, all in flight) and
//     decides hit / start in the same CTA. No tiles, no arrival counters.
//   attend: launched with programmatic dependent launch behind match. Every warp derives the
//     same plan from seq_lens and the heads' starts on its own (as dense_decode.cu does):
//     each (sequence, kv head)'s union span [min_h start_h, t] is cut into chunks whose length
//     spreads the total tokens over about one wave of CTAs, chunks never straddling E(t), so
//     every chunk's state belongs either to `new` (tokens below E(t)) or to the tail. The CTA
//     that finishes a pair last (self-resetting arrival counter) merges the pair's states with
//     the reused entries, writes entry(t) into the ring and the output.
//
// The attention part follows dense_decode.cu (split-KV over 16-token tiles, per-warp cp.async
// rings, bf16 mma with the group's query heads as rows, online softmax in the log2 domain)
// with two differences: a head row masks tokens below its own start, so a group reads its KV
// once for the union of its heads' spans; and every chunk writes a partial state, since the
// completion merges states with the reused entries anyway. A row with every token of a tile
// masked keeps its state (the -inf max is replaced by 0 in the exponentials, so
// exp2(-inf - -inf) never happens).
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>

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
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 16;
constexpr int kStages = 3;
constexpr int kMaxGroup = 8;
constexpr int kChunkAlign = kWarps * kTile;
// Cap on the chunks the planner aims for; with 2 chunks per pair of slack it bounds the
// items, so the workspace size depends only on the shapes.
constexpr int kMaxChunks = 1024;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFull = 0xffffffffu;

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

// Match CTAs per (sequence, query head): one thread-block cluster covers the ring.
int match_cluster(int window) {
  const int tiles = (window + kMatchTile - 1) / kMatchTile;
  return tiles < kMaxCluster ? tiles : kMaxCluster;
}

struct Layout {
  size_t head_start, head_slot, partial_lse, partial_o, total;
};

int max_items(int max_batch, int num_kv_heads) { return kMaxChunks + 2 * max_batch * num_kv_heads; }

Layout layout(int max_batch, int num_q_heads, int num_kv_heads, int head_dim) {
  const size_t rows = size_t(max_batch) * num_q_heads;
  const size_t items = size_t(max_items(max_batch, num_kv_heads));
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
  int chunks_target;
  float scale_log2;
  RingState st;
  MatchParams mp;
  __nv_bfloat16* out;
  float* lse;  // may be null
  unsigned long long* counters;  // may be null
  int32_t* pair_arrivals;  // [batch * Hkv], zero between launches
  int32_t* head_start;     // [batch * Hq] first token of the head's own read (0: miss)
  int32_t* head_slot;      // [batch * Hq] ring slot of the reused entry, -1: miss
  float* partial_lse;      // [items, group]
  float* partial_o;        // [items, group, D]
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
  float* dst = st.q_mean + st.head(b, h) * D + lane * kPer;
#pragma unroll
  for (int k = 0; k < kPer; ++k) dst[k] = mean[k] + w * (x[k] - mean[k]);
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

__device__ __forceinline__ int64_t plan_chunk(int64_t total, int target) {
  const int64_t c = (total + target - 1) / target;
  const int64_t aligned = (c + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  return aligned > kChunkAlign ? aligned : kChunkAlign;
}

// A (sequence, kv head) pair's span: its length, E(t), and the union start (the smallest
// start of its heads; E(t) when every head... never exceeds E(t)). len 0: an empty span.
struct PairSpan {
  int len, et, start;
};

__device__ __forceinline__ PairSpan pair_span(const Params& p, int pr) {
  const int b = pr / p.num_kv_heads, kvh = pr % p.num_kv_heads;
  PairSpan s;
  s.len = p.seq_lens[b];
  s.et = s.len > 0 ? cache_end(s.len - 1, p.mp.band) : 0;
  s.start = s.et;
  const int32_t* starts = p.head_start + int64_t(b) * p.num_q_heads + kvh * p.group;
  for (int g = 0; g < p.group; ++g) s.start = min(s.start, __ldcg(starts + g));
  return s;
}

// An attend CTA's chunk, and its pair's items [first_item, first_item + n_r + n_t): n_r
// chunks of [start, E(t)) then n_t chunks of the tail [E(t), len).
struct WorkItem {
  bool valid;
  int pair, begin, end, part;  // part 0: below E(t); 1: tail
  int first_item, n_r, n_t;
  PairSpan span;
};

// Maps item `item` to its chunk. Called by whole warps; every warp of every CTA derives the
// same plan from seq_lens and head_start (two passes over the pairs: the span tokens, then a
// prefix sum of the chunk counts). The chunk length spreads the span tokens over the wave.
// Cutting each span at E(t) costs up to one extra item per pair, so with few pairs (each cut
// into many chunks) one slot per pair is kept for that, which would otherwise push a handful
// of full chunks into a second wave. Items <= total / chunk + 2 pairs <= grid.
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
  const int target = 8 * pairs <= p.chunks_target ? p.chunks_target - pairs : p.chunks_target;
  const int64_t chunk = plan_chunk(total, target);

  WorkItem w{};
  w.valid = false;
  int base = 0;
  for (int pr0 = 0; pr0 < pairs; pr0 += 32) {
    const int pr = pr0 + lane;
    PairSpan s{0, 0, 0};
    int n_r = 0, n_t = 0;
    if (pr < pairs) {
      s = pr0 == 0 ? first_round : pair_span(p, pr);
      if (s.len > 0) {
        n_r = int((s.et - s.start + chunk - 1) / chunk);
        n_t = int((s.len - s.et + chunk - 1) / chunk);
      }
    }
    const int n = n_r + n_t;
    int incl = n;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int x = __shfl_up_sync(kFull, incl, off);
      if (lane >= off) incl += x;
    }
    const int first = base + incl - n;
    const unsigned hit = __ballot_sync(kFull, n > 0 && item >= first && item < first + n);
    if (hit) {
      const int src = __ffs(hit) - 1;
      w.valid = true;
      w.pair = pr0 + src;
      w.first_item = __shfl_sync(kFull, first, src);
      w.n_r = __shfl_sync(kFull, n_r, src);
      w.n_t = __shfl_sync(kFull, n_t, src);
      w.span.len = __shfl_sync(kFull, s.len, src);
      w.span.et = __shfl_sync(kFull, s.et, src);
      w.span.start = __shfl_sync(kFull, s.start, src);
      const int i = item - w.first_item;
      if (i < w.n_r) {
        w.part = 0;
        const int64_t lo = w.span.start + int64_t(i) * chunk;
        w.begin = int(lo);
        w.end = int(lo + chunk < w.span.et ? lo + chunk : w.span.et);
      } else {
        w.part = 1;
        const int64_t lo = w.span.et + int64_t(i - w.n_r) * chunk;
        w.begin = int(lo);
        w.end = int(lo + chunk < w.span.len ? lo + chunk : w.span.len);
      }
      return w;
    }
    base += __shfl_sync(kFull, incl, 31);
  }
  return w;
}

// What the completion of one query head reads besides the pair's states: the reused entry
// (slot_j, -1: none), q_pre and the running means; this lane's D/32 dims of each vector. The
// attend CTAs load it before they count their arrival, so that the last one has it at hand.
template <int D>
struct HeadInputs {
  float lse_j;
  float o_j[D / 32], qp[D / 32], mean[D / 32];
  int32_t count;
  float q_sq;
};

template <int D>
__device__ void load_head_inputs(const Params& p, int b, int h, int slot_j, int lane,
                                 HeadInputs<D>& in) {
  constexpr int kPer = D / 32;
  const int64_t row = int64_t(b) * p.num_q_heads + h;
  in.lse_j = -INFINITY;
  if (slot_j >= 0) {
    const int64_t r = p.st.row(b, slot_j, h);
    in.lse_j = p.st.lse[r];
    load_bf16<D>(reinterpret_cast<const __nv_bfloat16*>(p.st.o) + r * D, lane, in.o_j);
  }
  load_bf16<D>(p.q_pre + row * D, lane, in.qp);
  const float* m = p.st.q_mean + row * D + lane * kPer;
#pragma unroll
  for (int k = 0; k < kPer; ++k) in.mean[k] = m[k];
  in.count = p.st.q_count[row];
  in.q_sq = p.st.q_sq[row];
}

// Completion of one query head (one warp) once every chunk of its pair is in:
// new = merge(states below E(t), reused entry j); rectify-append; out = merge(new, tail
// states). The states are read through L2 (other CTAs wrote them), 8 in flight per lane.
template <int D>
__device__ void complete_head(const Params& p, const WorkItem& w, int b, int h,
                              const HeadInputs<D>& in, int lane) {
  constexpr int kPer = D / 32;
  constexpr int kBatch = 8;  // states in flight per lane
  using Vec = typename std::conditional<kPer == 4, float4, float2>::type;
  const int hg = h % p.group;
  const int64_t row = int64_t(b) * p.num_q_heads + h;
  const int t = w.span.len - 1, W = p.st.window;
  const int n = w.n_r + w.n_t;
  const float* plse = p.partial_lse + int64_t(w.first_item) * p.group + hg;
  const float* po = p.partial_o + (int64_t(w.first_item) * p.group + hg) * D + lane * kPer;
  const int64_t step = int64_t(p.group) * D;
  const float lse_j = in.lse_j;

  // Lane i holds the lse of states i, i + 32, ...: merged lse of each part by shuffles.
  LseAccumulator acc_r, acc_t;
  for (int i = lane; i < n; i += 32) {
    const float x = __ldcg(plse + int64_t(i) * p.group);
    if (i < w.n_r) acc_r.add(x); else acc_t.add(x);
  }
  const float lse_r = warp_merge_lse(acc_r).lse(), lse_t = warp_merge_lse(acc_t).lse();
  float o_r[kPer], o_t[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) o_r[k] = o_t[k] = 0.f;
  for (int i0 = 0; i0 < n; i0 += kBatch) {
    Vec x[kBatch];
    float e[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (i0 + u < n) {
        e[u] = __ldcg(plse + int64_t(i0 + u) * p.group);
        x[u] = __ldcg(reinterpret_cast<const Vec*>(po + (i0 + u) * step));
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (i0 + u >= n) break;
      const bool r = i0 + u < w.n_r;
      const float wt = merge_weight(e[u], r ? lse_r : lse_t);
      if (wt == 0.f) continue;  // an empty state's o may hold anything
      const float* xs = reinterpret_cast<const float*>(&x[u]);
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        if (r) o_r[k] = fmaf(wt, xs[k], o_r[k]); else o_t[k] = fmaf(wt, xs[k], o_t[k]);
      }
    }
  }

  LseAccumulator acc;
  acc.add(lse_r);
  acc.add(lse_j);
  const float lse_new = acc.lse();
  const float w_r = merge_weight(lse_r, lse_new), w_j = merge_weight(lse_j, lse_new);
  float o_new[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    o_new[k] = (w_r > 0.f ? w_r * o_r[k] : 0.f) + (w_j > 0.f ? w_j * in.o_j[k] : 0.f);

  // Rectify-append: entry(t) = new. Slot t mod W may be the matched slot (j = t - W): every
  // lane has read it above.
  __syncwarp();
  const int slot_t = t % W;
  const int64_t rt = p.st.row(b, slot_t, h);
  {
    __nv_bfloat16* ro = reinterpret_cast<__nv_bfloat16*>(p.st.o) + rt * D + lane * kPer;
    __nv_bfloat16* rq = reinterpret_cast<__nv_bfloat16*>(p.st.q) + rt * D + lane * kPer;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      ro[k] = __float2bfloat16_rn(o_new[k]);
      rq[k] = __float2bfloat16_rn(in.qp[k]);  // exact: qp holds bf16 values
    }
    if (lane == 0) {
      p.st.lse[rt] = lse_new;
      if (h == 0) p.st.pos[int64_t(b) * W + slot_t] = t;
    }
  }
  update_running_means<D>(p.st, p.mp, b, h, lane, in.qp, in.mean, in.count, in.q_sq);

  LseAccumulator acc2;
  acc2.add(lse_new);
  acc2.add(lse_t);
  const float lse_out = acc2.lse();
  const float w_n = merge_weight(lse_new, lse_out), w_t = merge_weight(lse_t, lse_out);
  __nv_bfloat16* out = p.out + row * D + lane * kPer;
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    out[k] = __float2bfloat16_rn((w_n > 0.f ? w_n * o_new[k] : 0.f) + (w_t > 0.f ? w_t * o_t[k] : 0.f));
  if (lane == 0 && p.lse) p.lse[row] = lse_out;
}

// One CTA per chunk item (grid.x bounds the items; the planned count comes from the plan).
template <int D>
__global__ void __launch_bounds__(kThreads) attend_kernel(const __grid_constant__ Params p) {
  constexpr int kPieces = D / 8;
  constexpr int kTilePieces = kTile * kPieces;
  constexpr int kCopies = kTilePieces / 32;
  constexpr int kKSteps = D / 16;
  // The only shared memory is the dynamic ring: a static variable would be placed ahead of it
  // and shift the rows off their 128-byte alignment (the swizzle and the 16-byte copies then
  // split into twice the wavefronts and sectors: ncu counted 50 % excess sectors, and the
  // kernel ran about 7 % slower at 0 % hits).
  extern __shared__ uint4 smem[];

  const int item = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  // The match grid's decisions (head_start, head_slot) are read only after this.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const WorkItem w = find_work_item(p, item, lane);
  if (!w.valid) return;  // the same for every thread of the CTA
  const int b = w.pair / p.num_kv_heads, kvh = w.pair % p.num_kv_heads;
  const int begin = w.begin, end = w.end;
  // The reused slots of the group's heads (lane g: head g), for the completion.
  const int group_slot = lane < p.group
                             ? __ldcg(p.head_slot + int64_t(b) * p.num_q_heads + kvh * p.group + lane)
                             : -1;
  // Tokens below the start of this lane's head row are not its to read (a hit head reuses
  // them); the tail part holds no such tokens.
  const int row_start = w.part == 0 && g < p.group
                            ? __ldcg(p.head_start + int64_t(b) * p.num_q_heads + kvh * p.group + g)
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
  // The completion's inputs of this warp's heads, in flight while the CTA merges its warps and
  // counts its arrival (only the pair's last CTA uses them).
  constexpr int kHeadsPerWarp = kMaxGroup / kWarps;
  HeadInputs<D> in[kHeadsPerWarp];
#pragma unroll
  for (int i = 0; i < kHeadsPerWarp; ++i) {
    const int hg = warp + i * kWarps;
    const int slot_j = __shfl_sync(kFull, group_slot, hg < p.group ? hg : 0);
    if (hg < p.group) load_head_inputs<D>(p, b, kvh * p.group + hg, slot_j, lane, in[i]);
  }
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

  // The CTA that brings the pair's last state completes the pair's heads. The counter goes
  // back to zero for the next launch.
  __threadfence();  // this CTA's states are visible before its arrival is counted
  __syncthreads();
  bool last = false;
  if (threadIdx.x == 0) {
    last = atomicAdd(p.pair_arrivals + w.pair, 1) == w.n_r + w.n_t - 1;
    if (last) {
      p.pair_arrivals[w.pair] = 0;
      if (p.counters) {
        atomicAdd(p.counters + kRowsRead, (unsigned long long)(w.span.len - w.span.start));
        atomicAdd(p.counters + kRowsContext, (unsigned long long)w.span.len);
      }
    }
  }
  if (!__syncthreads_or(last)) return;
  __threadfence();
#pragma unroll
  for (int i = 0; i < kHeadsPerWarp; ++i) {
    const int hg = warp + i * kWarps;
    if (hg < p.group) complete_head<D>(p, w, b, kvh * p.group + hg, in[i], lane);
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
  const unsigned grid = unsigned(max_items(p.batch, p.num_kv_heads) - kMaxChunks + p.chunks_target);
  return launch_programmatic(attend_kernel<D>, dim3(grid), dim3(kThreads), attend_smem_bytes<D>(),
                             stream, p);
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

size_t decode_sync_ints(int max_batch, int num_q_heads) {
  return size_t(max_batch) * num_q_heads;  // >= the (sequence, kv head) pairs
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
  const Layout l = layout(kv.batch, num_q_heads, kv.num_kv_heads, d);
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
  p.chunks_target = 0;
  p.scale_log2 = scale * kLog2e;
  p.st = st;
  p.mp = mp;
  p.out = reinterpret_cast<__nv_bfloat16*>(out);
  p.lse = lse;
  p.counters = counters;
  p.pair_arrivals = sync;
  p.head_start = reinterpret_cast<int32_t*>(ws + l.head_start);
  p.head_slot = reinterpret_cast<int32_t*>(ws + l.head_slot);
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
