// CUDA side of SAAP (see saap.h for the index layout and the selection rule).
//
// Prefill, per sequence: gather the keys to a contiguous scratch, de-RoPE them with
// rope_cuda (the one RoPE of the project), assign [sink, n - recent) with a tiled SIMT kernel
// (32 keys x 32 centroids per shared-memory tile, 4 centroids per thread in registers; at
// n = 128K, C = 1024, d = 128 that is 1.4e10 MACs per kv head, prefill-time work), then a
// stable CUB radix sort of (cluster, token) pairs gives the CSR with members ascending.
//
// Decode (fixed grids, lengths read on the device, no host sync: capturable):
//   index   per (b, h), after the attention: the tokens that left the window are de-RoPE'd
//           (rope_rotate_pair) and assigned by one kernel, a thread-block cluster of 8 CTAs
//           that split the centroids and reduce through distributed shared memory; every
//           fold_every assignments, the fold merges them into the CSR (copy, sort, move). The
//           engine runs it on a branch forked after the attention kernel and joined at the
//           step's last layer, so that no kernel of the route waits for it
//   mlp     two GEMV launches over all query heads of the batch, on the tensor cores, with
//           e4m3 (default) or bf16 weights (a warp per 16 output rows, 32 in the first, one
//           16-byte fragment load per lane and 256 or 512 weights, 8 batch rows of x from
//           shared memory per pass): the router's cost is one read of its weights per step up
//           to batch 8
//   route   one CTA per (b, h), launched programmatically behind the second GEMV: softmax
//           per query head, group sum (or mean-query centroid scores), top-l ids
//   attend  per (b, h) and part (attend_cuda), launched programmatically behind the route:
//           the token lists and the attention in one kernel. The parts split the members
//           and the window (sink + unindexed tail) by their sizes, the members estimated
//           from the index, so that the window parts attend before the route has chosen;
//           the member parts derive their rows from the selection, the last part scans the
//           post-prefill assignments; each resolves its tokens to KV rows in shared memory,
//           attends them with the shared tile loop (attend_tiles.cuh), and writes its state;
//           a merge kernel combines the parts. So the lists never make a round trip through
//           memory before the attention (H100, 128K: 56.6 -> 55.3 us; 512K: 89.5 -> 72.0 us;
//           docs/gpu.md)
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cub/cub.cuh>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "kernels/common/attend_tiles.cuh"
#include "kernels/common/float_key.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/merge_states.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/common/rope.cuh"
#include "kernels/common/rope.h"
#include "kernels/saap/saap.h"

namespace kvs::kernels::saap {
namespace {

using bf = __nv_bfloat16;

constexpr int kAssignTokens = 32;    // keys per tile of the prefill assignment
constexpr int kAssignCents = 32;     // centroids per shared-memory tile
constexpr int kAssignThreads = 256;  // 8 warps x 4 centroids of a tile
constexpr int kRouteThreads = 1024;
constexpr int kMaxRouteGroup = 8;  // query heads per kv head in route_mlp_score
constexpr int kScanIlp = 8;        // post-prefill assignments per thread and round of the scan

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

__device__ __forceinline__ bool better(float s, int c, float best_s, int best_c) {
  return s > best_s || (s == best_s && c < best_c);
}

// The last k in [0, n) with a[k] <= x, for ascending a with a[0] <= x: the list a position x
// of a concatenation of lists falls in, given the lists' start positions a.
__device__ __forceinline__ int last_at_most(const int* a, int n, int x) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a[mid] <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The first j in [0, n) with a[j] >= x (n when none), for a ascending as unsigned values: a
// key with no cluster (-1) counts as above every cluster, where the prefill's sort puts it.
__device__ __forceinline__ int lower_bound(const int* a, int n, int x) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (unsigned(a[mid]) < unsigned(x))
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// ---- prefill -----------------------------------------------------------------------------

__global__ void gather_keys_kernel(PagedKV kv, int b, int n, bf16* out) {
  const int d = kv.head_dim, hkv = kv.num_kv_heads;
  const int64_t vecs = int64_t(n) * hkv * (d / 8);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vecs;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / (d / 8);
    const int part = int(i % (d / 8));
    const int t = int(row / hkv), h = int(row % hkv);
    const uint4* src = reinterpret_cast<const uint4*>(kv.k + kv.offset(b, t, h)) + part;
    reinterpret_cast<uint4*>(out + row * d)[part] = *src;
  }
}

__global__ void iota_kernel(int32_t* x, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] = i;
}

// keys [n, Hkv, d] pre-RoPE bf16; assigns tokens [start, end) of head blockIdx.y. A key that
// no centroid may win (every score NaN or below -FLT_MAX) is assigned -1, counted in
// none[1] and, the first by (b, h, t), packed into none[0] (when none is given).
__global__ void __launch_bounds__(kAssignThreads)
    assign_tiled_kernel(const bf* keys, int hkv, int d, int start, int end, const float* centroids,
                        const float* norms, int C, IndexState st, int b, unsigned long long* none) {
  extern __shared__ float smem[];
  const int h = blockIdx.y;
  float* key_s = smem;                                    // [32][d + 1]
  float* cent_s = key_s + kAssignTokens * (d + 1);        // [32][d]
  float* best_s = cent_s + kAssignCents * d;              // [8][32]
  int* best_c = reinterpret_cast<int*>(best_s + 8 * 32);  // [8][32]
  const int t0 = start + blockIdx.x * kAssignTokens;
  for (int i = threadIdx.x; i < kAssignTokens * d; i += blockDim.x) {
    const int r = i / d, k = i % d;
    const int t = t0 + r;
    key_s[r * (d + 1) + k] =
        t < end ? __bfloat162float(keys[(int64_t(t) * hkv + h) * d + k]) : 0.0f;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float my_best = -FLT_MAX;
  int my_c = 0x7fffffff;
  const float* cent_h = centroids + int64_t(h) * C * d;
  for (int c0 = 0; c0 < C; c0 += kAssignCents) {
    __syncthreads();
    for (int i = threadIdx.x; i < kAssignCents * d; i += blockDim.x) {
      const int c = c0 + i / d;
      cent_s[i] = c < C ? cent_h[int64_t(c) * d + i % d] : 0.0f;
    }
    __syncthreads();
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const float* kr = key_s + lane * (d + 1);
    const float* cr = cent_s + warp * 4 * d;
    for (int k = 0; k < d; ++k) {
      const float kv = kr[k];
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[j] = fmaf(kv, cr[j * d + k], acc[j]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = c0 + warp * 4 + j;
      if (c < C) {
        const float s = centroid_score(acc[j], norms[int64_t(h) * C + c]);
        if (better(s, c, my_best, my_c)) {
          my_best = s;
          my_c = c;
        }
      }
    }
  }
  best_s[warp * 32 + lane] = my_best;
  best_c[warp * 32 + lane] = my_c;
  __syncthreads();
  if (warp == 0) {
    float bs = best_s[lane];
    int bc = best_c[lane];
    for (int w = 1; w < 8; ++w)
      if (better(best_s[w * 32 + lane], best_c[w * 32 + lane], bs, bc)) {
        bs = best_s[w * 32 + lane];
        bc = best_c[w * 32 + lane];
      }
    const int t = t0 + lane;
    if (t < end) {
      const int a = bc == 0x7fffffff ? -1 : bc;  // no score passed better(): no cluster
      st.assign_of(b, h)[t] = a;
      if (a < 0 && none) {
        atomicAdd(none + 1, 1ull);
        atomicMin(none, (static_cast<unsigned long long>(b * hkv + h) << 32) | unsigned(t));
      }
    }
  }
}

// rows[i] = page_row(members[i]) for the count members of a slot just sorted.
__global__ void member_rows_kernel(const int32_t* members, int count, const int32_t* table,
                                   int page_size, int32_t* rows) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x)
    rows[i] = page_row(table, page_size, members[i]);
}

// offsets[c] = first position of cluster c in the sorted labels (binary search).
__global__ void csr_offsets_kernel(const int32_t* sorted, int count, int C, int32_t* offsets) {
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c <= C; c += gridDim.x * blockDim.x) {
    offsets[c] = lower_bound(sorted, count, c);
  }
}

__global__ void set_lens_kernel(IndexState st, int b, int end) {
  const int h = threadIdx.x;
  if (h < st.num_kv_heads) {
    st.indexed_len[st.slot(b, h)] = end;
    st.csr_len[st.slot(b, h)] = end;
  }
}

struct PrefillLayout {
  size_t keys, iota, sorted, temp, none, total;
};

PrefillLayout prefill_layout(int max_len, int hkv, int d) {
  PrefillLayout l;
  l.keys = align_up(size_t(std::max(max_len, 1)) * hkv * d * sizeof(bf16));
  l.iota = align_up(size_t(std::max(max_len, 1)) * sizeof(int32_t));
  l.sorted = l.iota;
  size_t temp = 0;
  cub::DeviceRadixSort::SortPairs(
      nullptr, temp, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), std::max(max_len, 1));
  l.temp = align_up(temp);
  l.none = align_up(2 * sizeof(unsigned long long));  // assign_tiled_kernel's none
  l.total = l.keys + l.iota + l.sorted + l.temp + l.none;
  return l;
}

// ---- decode: indexing ----------------------------------------------------------------------
//
// The decode half of the index has no kernels of its own. On a step with n =
// index_step_count(...) > 0 tokens to index from t0 = indexed_len, every attention part of
// slot (b, h) scores an even share of the C centroids against the n keys (index_share, in
// attend_kernel: the member and scan parts before they wait for the route, the window parts
// after their rows) and leaves each key's best as a packed key (index_best_key) by atomicMax in
// IndexState::step_best. Once the whole attention grid has completed, a CTA per slot of the
// merge kernel commits the step (commit_index_step): assign[t0 + e] from step_best, which it
// zeroes again, and indexed_len; then it folds where fold_due. The index step used to be
// three kernels on a branch beside the next layers (a cluster kernel for the assignment, two
// for the fold), which launched every step to return at once on three in four: they found
// room only in the gaps of the step's grids, and the branch's join cost the 128K batch-1 step
// 2.4 us of its 33.8 on an H200 (docs/gpu.md).
constexpr int kStepPitch = 128 + 4;  // floats per staged centroid row or key: rows on other banks
constexpr int kStepKeys = 4;         // keys scored together, a thread each
static_assert(kMaxIndexStep % kStepKeys == 0, "keys are scored in groups of kStepKeys");

// A centroid's assignment score for a key as one ordered 64-bit key: the score's order key,
// then the id reversed, so that the largest is the best score with ties to the lowest id (the
// CPU's rule, `better`). 0 for a score that no centroid may win with: NaN, or below -FLT_MAX
// (the CPU starts from -FLT_MAX); a key whose best is 0 is assigned -1.
__device__ __forceinline__ unsigned long long index_best_key(float s, int c) {
  return s >= -FLT_MAX
             ? (static_cast<unsigned long long>(float_order_key(s)) << 32) | unsigned(~unsigned(c))
             : 0ull;
}

// ---- decode: the fold ----------------------------------------------------------------------
//
// When fold_due, slot (b, h) merges its oldest F = fold_every post-prefill assignments into
// the CSR (saap.h). With shift(c) = the number of them in clusters below c, old members of
// cluster c move up by shift(c), and the folded token of cluster c that is the r-th of its
// cluster in token order lands at old_offsets[c + 1] + shift(c) + r, right after cluster c's old
// members. One CTA per slot (of the merge kernel, once the attention has read the index)
// counts the tokens per cluster, moves the old members in place, in rounds from the top down (a
// member never moves down and the map is increasing, so a round writes only where members were
// read in that round or the rounds before), then writes the folded tokens. It runs on one step
// in fold_every per layer; at 128K on an H200 (the step that folds against one that only
// indexes, docs/gpu.md) it took about 0.33 ms when a round's loads and stores were blocked (a
// thread's run of consecutive members), 0.17 ms striped, 0.10 ms with a count in place of the
// radix sort it had; the merge kernel, which carries the fold on every step, lost 20 KB of
// code and 12 registers with the sort, and every step 0.3 us.

// The merge kernel's warps; its CTAs also commit the index step.
constexpr int kAttendMergeWarps = 8;
constexpr int kCommitThreads = kAttendMergeWarps * 32;
constexpr int kFoldIlp = 16;                           // members per thread and round of the moves
constexpr int kFoldRound = kCommitThreads * kFoldIlp;  // members per round of the moves
static_assert(kMaxFold <= 65535 && kMaxClustersCuda <= kFoldRound,
              "a round's shifts, then the clusters' running counts, are 16-bit, C of them");
using FoldScan = cub::BlockScan<int, kCommitThreads>;

// The fold's shared memory, the merge kernel's dynamic shared memory (none where nothing
// folds), sized by the index's C and F rather than their largest values, as every CTA of the
// merge kernel reserves it: the F folded clusters (then each token's place), the C + 1 old
// offsets, shift(c) for c in [0, C], a round's shifts (then the clusters' running counts),
// and the scan's storage.
struct FoldLayout {
  size_t keys = 0, off = 0, cshift = 0, shift = 0, scan = 0, bytes = 0;  // byte offsets, total
  KVS_HOST_DEVICE FoldLayout(int C, int F) {
    const auto up = [](size_t x) { return (x + 15) / 16 * 16; };
    off = up(sizeof(int) * size_t(F));
    cshift = off + up(sizeof(int) * (size_t(C) + 1));
    shift = cshift + up(sizeof(int) * (size_t(C) + 1));
    scan = shift + up(sizeof(uint16_t) * size_t(kFoldRound));
    bytes = F > 0 ? scan + sizeof(typename FoldScan::TempStorage) : 0;
  }
};

// table: sequence b's page table, for the folded tokens' member_rows (when kept).
__device__ void fold_slot(const IndexState& st, int b, int h, int csr, const int32_t* table,
                          int page_size, unsigned char* smem) {
  const int C = st.num_clusters, F = st.fold_every;
  const int tid = int(threadIdx.x), lane = tid % 32;
  const FoldLayout lay(C, F);
  int* keys_s = reinterpret_cast<int*>(smem + lay.keys);      // [F] clusters, then places
  int* off_s = reinterpret_cast<int*>(smem + lay.off);        // [C + 1] the old offsets
  int* cshift_s = reinterpret_cast<int*>(smem + lay.cshift);  // [C + 1] counts, then shift(c)
  uint16_t* shift_s = reinterpret_cast<uint16_t*>(smem + lay.shift);
  auto& scan_storage = *reinterpret_cast<typename FoldScan::TempStorage*>(smem + lay.scan);
  const int32_t* assign = st.assign_of(b, h);
  int32_t* offsets = st.offsets_of(b, h);
  int32_t* members = st.members_of(b, h);
  int32_t* rows = st.member_rows ? st.member_rows_of(b, h) : nullptr;  // moved with members
  for (int c = tid; c <= C; c += kCommitThreads) {
    off_s[c] = offsets[c];
    cshift_s[c] = 0;
  }
  __syncthreads();
  // The folded tokens per cluster. A token of a NaN key (assigned -1, no cluster) stays out
  // of the CSR.
  for (int j = tid; j < F; j += kCommitThreads) {
    const int c = assign[csr + j];
    keys_s[j] = c;
    if (c >= 0) atomicAdd(&cshift_s[c], 1);
  }
  __syncthreads();
  int running = 0;  // shift(c): the counts' exclusive prefix sums, kCommitThreads at a time
  for (int c0 = 0; c0 <= C; c0 += kCommitThreads) {
    const int c = c0 + tid;
    int excl = 0, total = 0;
    FoldScan(scan_storage).ExclusiveSum(c <= C ? cshift_s[c] : 0, excl, total);
    if (c <= C) cshift_s[c] = running + excl;
    running += total;
    __syncthreads();  // the scan's storage is reused
  }
  // A round moves the kFoldRound members [hi - kFoldRound, hi). Its loads and stores are
  // striped (member lo + u * kCommitThreads + t for thread t), so that a warp's access covers
  // whole lines, and issued before the shifts are known; the shifts come from a walk over
  // blocked runs (thread t: members lo + t * kFoldIlp .., one search for the first one's
  // cluster, then a step to the next cluster where the run crosses into it) through shared
  // memory. Blocked loads and stores took about 10 us a round at 128K on an H200, striped ones
  // with a search per member about 15 (docs/gpu.md).
  const int count = off_s[C];
  for (int hi = count; hi > 0; hi -= kFoldRound) {
    const int lo = hi - kFoldRound;
    int v[kFoldIlp], r[kFoldIlp];
#pragma unroll
    for (int u = 0; u < kFoldIlp; ++u) {
      const int i = lo + u * kCommitThreads + tid;
      if (i >= 0) {
        v[u] = members[i];
        if (rows) r[u] = rows[i];
      }
    }
    const int first = lo + tid * kFoldIlp;
    int c = last_at_most(off_s, C, max(first, 0));
#pragma unroll
    for (int u = 0; u < kFoldIlp; ++u) {
      const int i = first + u;
      if (i >= 0) {
        while (off_s[c + 1] <= i) ++c;
        shift_s[tid * kFoldIlp + u] = static_cast<uint16_t>(cshift_s[c]);
      }
    }
    __syncthreads();  // the round's members are read and its shifts written
#pragma unroll
    for (int u = 0; u < kFoldIlp; ++u) {
      const int i = lo + u * kCommitThreads + tid;
      if (i >= 0) {
        const int to = i + shift_s[u * kCommitThreads + tid];
        members[to] = v[u];
        if (rows) rows[to] = r[u];
      }
    }
    __syncthreads();  // the shifts are read: the next round rewrites them
  }
  // The folded tokens' places, in token order within each cluster: one warp takes 32 tokens
  // at a time, ranks each among the chunk's tokens of its cluster, and adds the cluster's
  // running count (shift_s, free now); a place is written over the token's cluster.
  for (int c = tid; c < C; c += kCommitThreads) shift_s[c] = 0;
  __syncthreads();
  if (tid < 32) {
    for (int j0 = 0; j0 < F; j0 += 32) {
      const int j = j0 + lane;
      const int c = j < F ? keys_s[j] : -1;
      const unsigned peers = __match_any_sync(0xffffffffu, c);
      if (c >= 0) {
        const int rank = __popc(peers & ((1u << lane) - 1u));
        keys_s[j] = off_s[c + 1] + cshift_s[c] + shift_s[c] + rank;
      }
      __syncwarp();
      if (c >= 0 && lane == __ffs(int(peers)) - 1) shift_s[c] += __popc(peers);
      __syncwarp();
    }
  }
  __syncthreads();
  for (int j = tid; j < F; j += kCommitThreads) {
    const int to = keys_s[j];  // -1: no cluster
    if (to < 0) continue;
    members[to] = csr + j;
    if (rows) rows[to] = page_row(table, page_size, csr + j);
  }
  for (int c = tid; c <= C; c += kCommitThreads) offsets[c] = off_s[c] + cshift_s[c];
  if (tid == 0) st.csr_len[st.slot(b, h)] = csr + F;
}

// The merge kernel's CTA for slot (b, h), once every attention part has completed: the index
// step's assignments and indexed_len (none on steps with nothing to index), then the fold
// where due.
__device__ void commit_index_step(const IndexState& st, int b, int h, int seq_len, int recent,
                                  const int32_t* table, int page_size, unsigned char* smem) {
  const int64_t slot = st.slot(b, h);
  const int t0 = st.indexed_len[slot], csr = st.csr_len[slot];
  const int n = index_step_count(seq_len, recent, t0, st.index_every, st.index_phase);
  if (int(threadIdx.x) < n) {
    unsigned long long* best = st.step_best + slot * kMaxIndexStep + threadIdx.x;
    const unsigned long long key = *best;
    st.assign_of(b, h)[t0 + threadIdx.x] = key != 0ull ? int(~unsigned(key)) : -1;
    *best = 0ull;
  }
  if (n > 0 && threadIdx.x == 0) st.indexed_len[slot] = t0 + n;
  if (!fold_due(st.fold_every, t0 + n, csr)) return;
  __syncthreads();  // the assignments just written are visible to the whole CTA
  fold_slot(st, b, h, csr, table, page_size, smem);
}

// ---- decode: the token lists and the attention in one kernel --------------------------------

constexpr int kAttendRowsCap = 1024;  // KV rows staged in shared memory per attend_tiles pass
constexpr int kMinAttendParts = 3;    // at least a member part, a window part and the scan part
constexpr int kMaxAttendParts = 64;
using AttendCfg128 = tiles::TileConfig<128, 4, 3>;
using AttendCfg64 = tiles::TileConfig<64, 4, 3>;

struct AttendParams {
  const bf* q;  // [B, Hq, D], RoPE applied
  const bf* k;
  const bf* v;
  const int32_t* page_table;
  const int32_t* seq_lens;
  int page_size, max_pages_per_seq, num_kv_heads, group, num_q_heads;
  float scale_log2;
  Window w;
  IndexState st;
  const int32_t* selected;
  int probes;
  tactic::Selection lists;
  unsigned long long* counters;
  unsigned long long router_bytes;
  float* part_lse;  // [B * Hkv, parts, group]
  float* part_o;    // [B * Hkv, parts, group, D]
  // The index step's (index_share): rope's inverse frequencies [D / 2], the kv heads'
  // centroids [Hkv, C, D] and their squared norms [Hkv, C].
  const float* inv_freq;
  const float* centroids;
  const float* centroid_norms;
};

// acc + a . b over a float4, in x, y, z, w order: the index share's dot products.
__device__ __forceinline__ float fma4(float4 a, float4 b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

// An attention part's share of the index step (see "decode: indexing" above): centroids
// [c_begin, c_end) of kv head h scored against the n keys from token t0, each key's best over
// the share to st.step_best by atomicMax. The keys are de-RoPE'd as rope_cuda rounds them, and
// kStepKeys threads share a staged centroid row, each scoring it against every kStepKeys-th
// key, each key with the same sequential dot product as the CPU's, so a token's assignment
// does not depend on the share or on how many are indexed together. Rows are staged
// kThreads / kStepKeys at a time by 16-byte copies in flight with the keys' loads. s: the tile
// loop's rings, free here; ends with a barrier. Not inlined: it runs on one step in index_every,
// and the attention's own code and registers stay as they were without it.
template <int D, int kThreads>
__device__ __noinline__ void index_share(const AttendParams& p, int b, int h, int t0, int n,
                                         int c_begin, int c_end, float* s) {
  constexpr int kRows = kThreads / kStepKeys, kWarps = kThreads / 32, half = D / 2;
  static_assert(D <= 128 && kRows * kStepKeys == kThreads, "a thread per (staged row, key)");
  float* rows_s = s;                           // [kRows, kStepPitch]
  float* key_s = rows_s + kRows * kStepPitch;  // [kMaxIndexStep, kStepPitch]
  auto* red = reinterpret_cast<unsigned long long*>(key_s + kMaxIndexStep * kStepPitch);
  int64_t* key_row_s = reinterpret_cast<int64_t*>(red + kMaxIndexStep * kWarps);  // [kMaxIndexStep]
  const int C = p.st.num_clusters, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  auto stage = [&](int c0) {
    const int rows = min(kRows, c_end - c0);
    const float* src = p.centroids + (int64_t(h) * C + c0) * D;
#pragma unroll 1
    for (int i = threadIdx.x; i < rows * (D / 4); i += kThreads)
      ptx::cp_async_16(ptx::smem_addr(rows_s + (i / (D / 4)) * kStepPitch + (i % (D / 4)) * 4),
                       src + int64_t(i) * 4, true);
    ptx::cp_async_commit();
  };
  stage(c_begin);
  // The keys, in two round trips whatever n: each key's row offset through the page table to
  // shared memory, then every piece of every key loaded together (kLoads per thread), de-RoPE'd
  // and staged. A load of the page table and the key per pair, as before, cost two dependent
  // round trips per kThreads pairs: 4 at n = 4 and 32 at n = 32. Rows of a last, partial group
  // of kStepKeys are zero (their scores are never used).
  const int n_pad = (n + kStepKeys - 1) / kStepKeys * kStepKeys;
  const int32_t* table = p.page_table + int64_t(b) * p.max_pages_per_seq;
  if (int(threadIdx.x) < n) {
    const int t = t0 + int(threadIdx.x);
    key_row_s[threadIdx.x] = (int64_t(page_row(table, p.page_size, t)) * p.num_kv_heads + h) * D;
  }
#pragma unroll 1
  for (int i = threadIdx.x; i < kMaxIndexStep * kWarps; i += kThreads) red[i] = 0ull;
  __syncthreads();  // the keys' row offsets
  // A piece: dims j, j + 1 and j + half, j + half + 1 of a key; a thread's pieces all have the
  // same j, so one load of the inverse frequencies serves them.
  constexpr int kPieces = half / 2, kLoads = (kMaxIndexStep * kPieces + kThreads - 1) / kThreads;
  static_assert(half % 2 == 0 && kThreads % kPieces == 0, "a thread's pieces share their dims");
  static_assert(kMaxIndexStep <= kThreads, "a thread per key's row offset");
  const int j = 2 * (int(threadIdx.x) % kPieces);
  const float2 freq = *reinterpret_cast<const float2*>(p.inv_freq + j);
  // The loads together, unrolled; the pieces staged as they are, then de-RoPE'd in place by a
  // rolled loop (rope's sin and cos are about 30 FP64 instructions: 16 copies of them took the
  // share's code from 11.9 to 33.7 KB).
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    const int e = (int(threadIdx.x) + u * kThreads) / kPieces;
    if (e >= n_pad) break;
    float2 x = make_float2(0.f, 0.f), y = make_float2(0.f, 0.f);
    if (e < n) {
      const bf* key = p.k + key_row_s[e];
      x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(key + j));
      y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(key + j + half));
    }
    *reinterpret_cast<float2*>(key_s + e * kStepPitch + j) = x;
    *reinterpret_cast<float2*>(key_s + e * kStepPitch + j + half) = y;
  }
#pragma unroll 1
  for (int e = int(threadIdx.x) / kPieces; e < n; e += kThreads / kPieces) {
    float2* x = reinterpret_cast<float2*>(key_s + e * kStepPitch + j);
    float2* y = reinterpret_cast<float2*>(key_s + e * kStepPitch + j + half);
    const __nv_bfloat162 r0 = rope_rotate_pair(x->x, y->x, t0 + e, freq.x, true);
    const __nv_bfloat162 r1 = rope_rotate_pair(x->y, y->y, t0 + e, freq.y, true);
    *x = make_float2(__low2float(r0), __low2float(r1));
    *y = make_float2(__high2float(r0), __high2float(r1));
  }
  // A thread's keys: u, u + kStepKeys, .., scored kChunk at a time where there are that many
  // groups of them, else one at a time.
  constexpr int kChunk = 4;
  static_assert(kMaxIndexStep % (kChunk * kStepKeys) == 0, "a chunk's keys are staged rows");
  const int groups = n_pad / kStepKeys;
  const int row = threadIdx.x / kStepKeys, u = threadIdx.x % kStepKeys;
  for (int c0 = c_begin; c0 < c_end; c0 += kRows) {
    const int c = c0 + row;
    const float norm = c < c_end ? p.centroid_norms[int64_t(h) * C + c] : 0.f;
    ptx::cp_async_wait<0>();
    __syncthreads();  // the rows and the keys are staged
    const float4* row4 = reinterpret_cast<const float4*>(rows_s + row * kStepPitch);
    const auto score = [&](auto chunk) {
      constexpr int kC = decltype(chunk)::value;
#pragma unroll 1
      for (int g0 = 0; g0 < groups; g0 += kC) {
        // The row against kC keys, an accumulator each and no branch between them: one
        // load of the row serves kC keys, and the chains' FMAs overlap. The dot products look
        // bound by shared-memory loads (if a warp's 16-byte load takes the SM's shared memory 4
        // cycles, broadcast or not, the counts fit); one key at a time, two loads per 4 FMAs, they
        // took 7.3 us of the 14.5 that the step that indexes 32 tokens costs at 128K batch 1 on an
        // H200, and 51 us at batch 8. In chunks: 1.5 and 13 us less; a branch per key between the
        // chains lost 2.7 us instead. A chunk past the last key scores rows of key_s that no
        // key was staged to (scores dropped below): with index_every 4 (one group of keys)
        // that cost the step that indexes 2 us, hence one at a time there (37.1 us against
        // 39.0 with chunks; docs/gpu.md).
        float acc[kC];
#pragma unroll
        for (int x = 0; x < kC; ++x) acc[x] = 0.f;
        if (c < c_end) {
          const float4* key4 =
              reinterpret_cast<const float4*>(key_s + (g0 * kStepKeys + u) * kStepPitch);
#pragma unroll 4
          for (int k = 0; k < D / 4; ++k) {
            const float4 v = row4[k];
#pragma unroll
            for (int x = 0; x < kC; ++x) {
              const float4 q = key4[x * kStepKeys * (kStepPitch / 4) + k];
              acc[x] = fma4(v, q, acc[x]);
            }
          }
        }
#pragma unroll
        for (int x = 0; x < kC; ++x) {
          // The best row for key e over the warp's lanes of the same u.
          const int e = (g0 + x) * kStepKeys + u;
          unsigned long long best =
              c < c_end ? index_best_key(centroid_score(acc[x], norm), c) : 0ull;
          for (int off = 16; off >= kStepKeys; off /= 2)
            best = max(best, __shfl_xor_sync(0xffffffffu, best, off));
          if (lane < kStepKeys && e < n) red[e * kWarps + warp] = max(red[e * kWarps + warp], best);
        }
      }
    };
    // Every key row staged (n_pad = kMaxIndexStep: each step of index_every 32 once the
    // first has passed): a thread takes two rows and four keys, 6 shared loads per 32 FMAs
    // against a chunk's 5 per 16, with the rows' norms loaded here, behind the dot products.
    // On an H200 at 128K the step that indexes 32 tokens took 42.6 us against 44.8 in chunks
    // at batch 1, 132.4 against 146.8 at batch 8 (docs/gpu.md, 2026-11-30).
    const auto score_blocked = [&]() {
      constexpr int kLanes = 8, kKeys = kMaxIndexStep / kLanes;
      static_assert(kRows / 2 * kLanes == kThreads, "a thread per (pair of rows, key lane)");
      const int ra = 2 * (int(threadIdx.x) / kLanes), ul = int(threadIdx.x) % kLanes;
      const int ca = c0 + ra, cb = ca + 1;
      const float na = ca < c_end ? p.centroid_norms[int64_t(h) * C + ca] : 0.f;
      const float nb = cb < c_end ? p.centroid_norms[int64_t(h) * C + cb] : 0.f;
      const float4* a4 = reinterpret_cast<const float4*>(rows_s + ra * kStepPitch);
      const float4* b4 = reinterpret_cast<const float4*>(rows_s + (ra + 1) * kStepPitch);
      const float4* key4 = reinterpret_cast<const float4*>(key_s + ul * kStepPitch);
      float acc_a[kKeys], acc_b[kKeys];
#pragma unroll
      for (int x = 0; x < kKeys; ++x) acc_a[x] = acc_b[x] = 0.f;
#pragma unroll 2
      for (int k = 0; k < D / 4; ++k) {
        const float4 va = a4[k], vb = b4[k];
#pragma unroll
        for (int x = 0; x < kKeys; ++x) {
          const float4 q = key4[x * kLanes * (kStepPitch / 4) + k];
          acc_a[x] = fma4(va, q, acc_a[x]);
          acc_b[x] = fma4(vb, q, acc_b[x]);
        }
      }
#pragma unroll
      for (int x = 0; x < kKeys; ++x) {
        // The best of the two rows for key e, then over the warp's lanes of the same key.
        const int e = x * kLanes + ul;
        unsigned long long best =
            max(ca < c_end ? index_best_key(centroid_score(acc_a[x], na), ca) : 0ull,
                cb < c_end ? index_best_key(centroid_score(acc_b[x], nb), cb) : 0ull);
        for (int off = 16; off >= kLanes; off /= 2)
          best = max(best, __shfl_xor_sync(0xffffffffu, best, off));
        if (lane < kLanes && e < n) red[e * kWarps + warp] = max(red[e * kWarps + warp], best);
      }
    };
    if (n_pad == kMaxIndexStep)
      score_blocked();
    else if (groups >= kChunk)
      score(std::integral_constant<int, kChunk>{});
    else
      score(std::integral_constant<int, 1>{});
    __syncthreads();  // the rows are read: the next pass may restage them
    if (c0 + kRows < c_end) stage(c0 + kRows);
  }
  if (int(threadIdx.x) < n) {
    unsigned long long best = 0ull;
    for (int w = 0; w < kWarps; ++w) best = max(best, red[threadIdx.x * kWarps + w]);
    if (best != 0ull)
      atomicMax(p.st.step_best + p.st.slot(b, h) * kMaxIndexStep + threadIdx.x, best);
  }
  __syncthreads();  // red and the rows are read: the caller may reuse s
}

// The floats of index_share's shared memory.
template <int kThreads>
constexpr size_t index_share_floats() {
  return size_t(kThreads / kStepKeys + kMaxIndexStep) * kStepPitch +
         2 * size_t(kMaxIndexStep) * (kThreads / 32 + 1);
}

template <int kThreads>
constexpr size_t attend_scan_bytes() {
  return (sizeof(typename cub::BlockScan<int, kThreads>::TempStorage) + 15) / 16 * 16;
}

// CSR offsets staged in attend_kernel's shared memory up to this many clusters (8 KB: two
// CTAs per SM still fit); beyond it the CTAs read them from global memory.
constexpr int kStagedOffsetsMax = 2048;

__host__ __device__ constexpr bool attend_stages_offsets(int C) { return C <= kStagedOffsetsMax; }

// attend_kernel's dynamic shared memory: the tile loop's rings (first, 128-byte aligned; see
// attend_tiles.cuh), the block scan, the staged rows, the selection's prefix and first
// members, the chosen-cluster bitmap and the staged CSR offsets.
template <class Cfg>
size_t attend_smem_bytes(int probes, int C) {
  return Cfg::smem_bytes() + attend_scan_bytes<Cfg::kThreads>() +
         sizeof(int) * (size_t(kAttendRowsCap) + 2 * size_t(probes) + (C + 31) / 32 +
                        (attend_stages_offsets(C) ? size_t(C) + 1 : 0));
}

// One CTA per (sub-request (b, h), part), launched programmatically behind the route. The
// parts split the slot's rows: Pm member parts take even shares of M, the members of the
// selected clusters; the window parts take even shares of the window W = sink + the
// unindexed tail [max(indexed_len, sink), n); the last part scans the post-prefill
// assignments. The split follows the sizes, with M estimated from the index
// (attend_member_parts, saap.h), so that a window part knows its rows before the route has chosen:
// it resolves and attends them before griddepcontrol.wait, beside the route, and writes their
// token-list entries (whose positions need M) after it. Before the wait every CTA reads only
// what the route does not write: q, the lengths, the page table, the KV and the index (the
// index step of the call before is complete), with the CSR offsets staged in shared memory. A
// part resolves its tokens to KV rows (members, then pages, loaded kKvIlp at a time) into
// shared memory, attends them with the shared tile loop, and keeps a running state across
// passes of kAttendRowsCap rows; its state goes to part_lse / part_o for attend_merge_kernel.
// It also writes the token list ([sink | members | tail | post-prefill hits], for the stats
// and last_read) and the count. So the token lists never make a round trip through memory
// before the attention reads them.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads)
    attend_kernel(const __grid_constant__ AttendParams p) {
  constexpr int D = Cfg::kHeadDim, kThreads = Cfg::kThreads;
  constexpr int kKvIlp = kAttendRowsCap / kThreads;
  static_assert(kThreads * kScanIlp <= kAttendRowsCap, "a scan round's hits must fit the rows");
  static_assert(kThreads * kScanIlp == kAttendScanRound, "saap.h names the scan's round");
  using Scan = cub::BlockScan<int, kThreads>;
  extern __shared__ uint4 attend_s[];
  uint4* smem = attend_s;
  char* extra = reinterpret_cast<char*>(smem) + Cfg::smem_bytes();
  auto& scan_tmp = *reinterpret_cast<typename Scan::TempStorage*>(extra);
  int* rows_s = reinterpret_cast<int*>(extra + attend_scan_bytes<kThreads>());  // [cap]
  int* prefix = rows_s + kAttendRowsCap;                                        // [probes]
  int* first = prefix + p.probes;                                               // [probes]
  unsigned* chosen = reinterpret_cast<unsigned*>(first + p.probes);             // [C / 32]
  const int hkv = p.num_kv_heads, C = p.st.num_clusters, probes = p.probes;
  int* off_s = reinterpret_cast<int*>(chosen + (C + 31) / 32);  // [C + 1] when staged
  const int sv = blockIdx.x, b = sv / hkv, h = sv % hkv;
  const int64_t slot = p.st.slot(b, h);
  const int n = p.seq_lens[b];
  const int indexed = p.st.indexed_len[slot], csr = p.st.csr_len[slot];
  const int32_t* sel = p.selected + int64_t(sv) * probes;
  const int32_t* table = p.page_table + int64_t(b) * p.max_pages_per_seq;
  int32_t* tokens = p.lists.tokens + int64_t(sv) * p.lists.max_tokens;
  const int part = blockIdx.y, scan_part = gridDim.y - 1;
  uint32_t qa[D / 16][2];
  tiles::load_query_fragments<D>(p.q + (int64_t(b) * p.num_q_heads + h * p.group) * D, p.group,
                                 threadIdx.x % 32, qa);
  const int32_t* offsets = p.st.offsets_of(b, h);
  if (attend_stages_offsets(C)) {
    for (int c = threadIdx.x; c <= C; c += kThreads) off_s[c] = offsets[c];
    offsets = off_s;
  }
  if (part == scan_part)
    for (int i = threadIdx.x; i < (C + 31) / 32; i += kThreads) chosen[i] = 0u;
  __syncthreads();
  const int sink = min(p.w.sink, n);
  const int tail0 = max(indexed, sink), T = max(0, n - tail0), W = sink + T;
  const int shared_parts = scan_part;  // members and window
  const int Pm = attend_member_parts(shared_parts, probes, C, offsets[C], W);
  const bool window_part = part >= Pm && part < shared_parts;

  // Prefix sums of the selected clusters' sizes (after the wait: the route writes sel).
  auto select = [&]() {
    int running = 0;
    for (int i0 = 0; i0 < probes; i0 += kThreads) {
      const int i = i0 + threadIdx.x;
      int size = 0;
      if (i < probes) {
        const int c = sel[i];
        first[i] = offsets[c];
        size = offsets[c + 1] - first[i];
        if (part == scan_part) atomicOr(&chosen[c / 32], 1u << (c % 32));
      }
      int excl, total;
      Scan(scan_tmp).ExclusiveSum(size, excl, total);
      if (i < probes) prefix[i] = running + excl;
      running += total;
      __syncthreads();
    }
    return running;
  };
  // This part's share of the index step (index_share), on steps with tokens to index: before
  // the wait in the member and scan parts, which have nothing to do until the route is done;
  // after their rows in the window parts, which attend while the route runs.
  const int n_index = index_step_count(n, p.w.recent, indexed, p.st.index_every, p.st.index_phase);
  const int share0 = int(int64_t(C) * part / gridDim.y);
  const int share1 = int(int64_t(C) * (part + 1) / gridDim.y);
  const bool shares = n_index > 0 && share0 < share1;
  static_assert(index_share_floats<kThreads>() * sizeof(float) <= Cfg::smem_bytes(),
                "the index step's share fits the rings");
  if (shares && !window_part)
    index_share<D, kThreads>(p, b, h, indexed, n_index, share0, share1,
                             reinterpret_cast<float*>(smem));
  int M = 0;
  if (!window_part) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    M = select();
  }

  // The part's running state: this thread's float4s of merge_warp_states' rows.
  constexpr int kRun = (tiles::kMaxGroup * D / 4 + kThreads - 1) / kThreads;
  float4 run_o[kRun];
  float run_lse[kRun];
#pragma unroll
  for (int r = 0; r < kRun; ++r) {
    run_o[r] = make_float4(0.f, 0.f, 0.f, 0.f);
    run_lse[r] = -INFINITY;
  }
  const tiles::KvSource src{p.k, p.v, rows_s, 1, 1, kAttendRowsCap, p.scale_log2};
  // Attends rows_s[0, count) (written before a barrier) and merges the result into the
  // running state; ends with a barrier, so that rows_s and the rings may be rewritten.
  auto attend_rows = [&](int count) {
    tiles::attend_tiles<Cfg, false>(src, 0, 0, 0, count, 0, qa, smem);
    __syncthreads();
    tiles::merge_warp_states<Cfg>(smem, p.group, [&](int hg, int d, float4 o, float lse) {
      const int r_of = (hg * (D / 4) + d / 4 - int(threadIdx.x)) / kThreads;
#pragma unroll
      for (int r = 0; r < kRun; ++r) {
        if (r != r_of) continue;
        LseAccumulator acc;
        acc.add(run_lse[r]);
        acc.add(lse);
        const float merged = acc.lse();
        const float wa = merge_weight(run_lse[r], merged), wb = merge_weight(lse, merged);
        float4& ro = run_o[r];
        ro.x = (wa > 0.f ? wa * ro.x : 0.f) + (wb > 0.f ? wb * o.x : 0.f);
        ro.y = (wa > 0.f ? wa * ro.y : 0.f) + (wb > 0.f ? wb * o.y : 0.f);
        ro.z = (wa > 0.f ? wa * ro.z : 0.f) + (wb > 0.f ? wb * o.z : 0.f);
        ro.w = (wa > 0.f ? wa * ro.w : 0.f) + (wb > 0.f ? wb * o.w : 0.f);
        run_lse[r] = merged;
      }
    });
    __syncthreads();
  };
  // Window position i (of [sink tokens | tail tokens]) as a token.
  auto window_token = [&](int i) { return i < sink ? i : tail0 + (i - sink); };
  // The part's rows, a round of at most kAttendRowsCap at a time into rows_s, all attended at
  // the one call of attend_rows below (one copy of the tile loop in the kernel's code).
  // Members: positions [lo, hi) of the concatenated member lists of the selected clusters.
  // Window: positions [lo, hi) of the window. Scan part: the post-prefill assignments of the
  // chosen clusters, in token order, kThreads * kScanIlp (<= kAttendRowsCap) at a time.
  const bool scanning = part == scan_part;
  const int j = window_part ? part - Pm : part;
  const int parts_here = window_part ? shared_parts - Pm : Pm, size = window_part ? W : M;
  const int lo = scanning ? 0 : int(int64_t(size) * j / parts_here),
            hi = scanning ? 0 : int(int64_t(size) * (j + 1) / parts_here);
  const int32_t* assign = p.st.assign_of(b, h);
  int hits = 0;
  for (int c0 = scanning ? csr : lo; c0 < (scanning ? indexed : hi);) {
    int count;
    if (!scanning) {
      const int c1 = min(hi, c0 + kAttendRowsCap);
      int t[kKvIlp];
#pragma unroll
      for (int u = 0; u < kKvIlp; ++u) {
        const int i = c0 + int(threadIdx.x) + u * kThreads;
        t[u] = -1;
        if (i < c1) {
          if (!window_part) {
            const int k = last_at_most(prefix, probes, i);
            t[u] = first[k] + (i - prefix[k]);  // an index into members, loaded below
          } else {
            t[u] = window_token(i);
          }
        }
      }
      // A member's KV row: kept with the index (member_rows, loaded with the token), or
      // through the page table (a round trip after the token's).
      int pr[kKvIlp];  // page rows
      const bool kept = !window_part && p.st.member_rows;
      if (!window_part) {
        const int32_t* members = p.st.members_of(b, h);
        const int32_t* member_rows = p.st.member_rows_of(b, h);
#pragma unroll
        for (int u = 0; u < kKvIlp; ++u) {
          pr[u] = kept && t[u] >= 0 ? member_rows[t[u]] : 0;
          t[u] = t[u] >= 0 ? members[t[u]] : -1;
        }
      }
      if (!kept) {
#pragma unroll
        for (int u = 0; u < kKvIlp; ++u) pr[u] = t[u] >= 0 ? page_row(table, p.page_size, t[u]) : 0;
      }
#pragma unroll
      for (int u = 0; u < kKvIlp; ++u) {
        if (t[u] < 0) continue;
        const int i = c0 + int(threadIdx.x) + u * kThreads;
        rows_s[i - c0] = pr[u] * hkv + h;
        if (!window_part) tokens[sink + i] = t[u];
      }
      count = c1 - c0;
      c0 = c1;
    } else {
      const int tb = c0 + int(threadIdx.x) * kScanIlp;
      int c[kScanIlp];
#pragma unroll
      for (int u = 0; u < kScanIlp; ++u) c[u] = tb + u < indexed ? assign[tb + u] : -1;
      unsigned flags = 0u;
#pragma unroll
      for (int u = 0; u < kScanIlp; ++u)
        if (c[u] >= 0 && ((chosen[c[u] / 32] >> (c[u] % 32)) & 1u)) flags |= 1u << u;
      int excl;
      Scan(scan_tmp).ExclusiveSum(__popc(flags), excl, count);
      int page[kScanIlp];
#pragma unroll
      for (int u = 0; u < kScanIlp; ++u)
        page[u] = (flags >> u) & 1u ? table[(tb + u) / p.page_size] : 0;
#pragma unroll
      for (int u = 0; u < kScanIlp; ++u) {
        if (!((flags >> u) & 1u)) continue;
        rows_s[excl] = page_row_on(page[u], p.page_size, tb + u) * hkv + h;
        tokens[sink + M + T + hits + excl] = tb + u;
        ++excl;
      }
      hits += count;
      c0 += kThreads * kScanIlp;
    }
    __syncthreads();  // rows_s is written (and the scan's scan_tmp may be reused)
    // The merge, launched programmatically behind this grid, may launch once every CTA has
    // triggered (later calls have no effect; a part with no rows triggers at its end, below).
    // A CTA triggers only once it runs, so when all have, no part is left waiting for room
    // (the last ones run on the SMs the route held), the merge's CTAs can take only the room
    // of parts that have left, and their launch overlaps the last parts' tiles instead of
    // following them: 31.8-31.9 -> 31.2 us at 128K batch 1 over 32 layers on an H200
    // (docs/gpu.md). They wait for the whole grid before they read a state.
    if (count > 0) {
      asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
      attend_rows(count);
    }
  }
  if (window_part) {
    if (shares)
      index_share<D, kThreads>(p, b, h, indexed, n_index, share0, share1,
                               reinterpret_cast<float*>(smem));
    // The token-list entries of the window's rows: the tail's follow the members.
    asm volatile("griddepcontrol.wait;" ::: "memory");
    M = select();
    for (int i = lo + int(threadIdx.x); i < hi; i += kThreads)
      tokens[i < sink ? i : sink + M + (i - sink)] = window_token(i);
  }
  if (scanning && threadIdx.x == 0) {
    const int count = sink + M + T + hits;
    p.lists.counts[sv] = count;
    if (p.counters) {
      atomicAdd(p.counters, (unsigned long long)count);
      atomicAdd(p.counters + 1, p.router_bytes + 8ull * probes + 4ull * max(0, indexed - csr));
    }
  }
  // A part that attended nothing triggers the merge here. (At the kernel's start the trigger
  // cost the step 3.5-4 us in an earlier form of this kernel; docs/gpu.md.)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  // The part's state.
  const int64_t prow0 = (int64_t(sv) * gridDim.y + part) * p.group;
#pragma unroll
  for (int r = 0; r < kRun; ++r) {
    const int idx = int(threadIdx.x) + r * kThreads;
    if (idx >= p.group * (D / 4)) break;
    const int hg = idx / (D / 4), d = (idx % (D / 4)) * 4;
    *reinterpret_cast<float4*>(p.part_o + (prow0 + hg) * D + d) = run_o[r];
    if (d == 0) p.part_lse[prow0 + hg] = run_lse[r];
  }
}

// One CTA per output row (b, query head) of the `rows` = B * Hq: the row's part states merged
// (merge_row_states); then one CTA per slot (b, kv head) that commits the index step and
// folds (commit_index_step). Each waits for the whole attention grid.
template <int D>
__global__ void __launch_bounds__(kAttendMergeWarps * 32)
    attend_merge_kernel(const float* part_lse, const float* part_o, int parts, int hkv, int group,
                        int rows, bf* o, float* lse, const __grid_constant__ IndexState st,
                        const int32_t* seq_lens, int recent, const int32_t* page_table,
                        int page_size, int max_pages_per_seq) {
  __shared__ WarpAccumulators<kAttendMergeWarps, D> warp_acc;
  extern __shared__ __align__(16) unsigned char fold_smem[];  // FoldLayout
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the parts' states are written
  if (int(blockIdx.x) >= rows) {
    const int slot = int(blockIdx.x) - rows, b = slot / hkv;
    commit_index_step(st, b, slot % hkv, seq_lens[b], recent,
                      page_table + int64_t(b) * max_pages_per_seq, page_size, fold_smem);
    return;
  }
  const int row = blockIdx.x, hq = hkv * group;
  const int b = row / hq, head = row % hq;
  const int sv = b * hkv + head / group, hg = head % group;
  merge_row_states<D, kAttendMergeWarps>(part_lse, part_o, int64_t(sv) * parts * group + hg, group,
                                         parts, warp_acc, o + int64_t(row) * D,
                                         lse ? lse + row : nullptr);
}

// ---- decode: router ------------------------------------------------------------------------

template <class In>
__device__ __forceinline__ float to_f(In x);
template <>
__device__ __forceinline__ float to_f<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_f<bf>(bf x) {
  return __bfloat162float(x);
}

// The router's weight formats as the tensor-core GEMV reads them (pack_mma_rows, saap.h):
// bf16 (one 16-column tile per 16-byte lane load, bf16 mma, x in bf16) or e4m3 with a scale
// per row (two tiles per load, converted to fp16 in registers, fp16 mma, x in fp16).
struct Bf16Mma {
  static constexpr int kTiles = 1;  // 16-column tiles per lane load
  static constexpr bool kScaled = false;
  __device__ __forceinline__ static uint32_t pack_x(float lo, float hi) {
    return ptx::pack_bf16x2(lo, hi);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint4& a, int tile,
                                             const uint32_t (&b)[2]) {
    const uint32_t af[4] = {a.x, a.y, a.z, a.w};
    ptx::mma_bf16_16816(d, af, b, d);
  }
};
struct E4m3Mma {
  static constexpr int kTiles = 2;
  static constexpr bool kScaled = true;
  // x in fp16, saturated: a hidden unit beyond fp16's range would otherwise become inf.
  __device__ __forceinline__ static uint32_t pack_x(float lo, float hi) {
    const __half2 v =
        __floats2half2_rn(fminf(fmaxf(lo, -65504.f), 65504.f), fminf(fmaxf(hi, -65504.f), 65504.f));
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  // Tile `tile` is bytes 8 tile .. 8 tile + 7 of the load: the fragment's four words as e4m3
  // pairs, the lower byte the lower column.
  __device__ __forceinline__ static void mma(float (&d)[4], const uint4& a, int tile,
                                             const uint32_t (&b)[2]) {
    const uint32_t lo = tile == 0 ? a.x : a.z, hi = tile == 0 ? a.y : a.w;
    uint32_t af[4];
    const __nv_fp8x2_storage_t pairs[4] = {
        __nv_fp8x2_storage_t(lo & 0xffffu), __nv_fp8x2_storage_t(lo >> 16),
        __nv_fp8x2_storage_t(hi & 0xffffu), __nv_fp8x2_storage_t(hi >> 16)};
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pairs[p], __NV_E4M3);
      af[p] = uint32_t(h.x) | (uint32_t(h.y) << 16);
    }
    ptx::mma_f16_16816(d, af, b, d);
  }
};

// y[b, head, r] = act(scale[head, r] * (w[head, r, :] . x[b, head, :]) + bias[head, r]) for b <
// batch (scale 1 for bf16 weights), on the tensor cores: a warp owns kRb blocks of 16 rows (one
// mma's M each), walks their K one 16-byte lane load at a time (Fmt::kTiles tiles of 16 columns
// each, kMmaInFlight loads in flight over the blocks before any is used), and takes 8 batch rows at
// a time as the mma's N (x converted in shared memory; B rows past the batch are zero, not loaded).
// w is in pack_mma_rows' order. The weights are nearly all the bytes (75 MB per layer at d 128,
// hidden 1024, C 1024, 32 heads in bf16, half that in e4m3), read once per 8 batch rows. A SIMT
// form (per-lane FMAs on 16-byte pieces, a warp per 8 rows) took as long in bf16 at batch 1 (~29 us
// for the 1024-wide GEMV, about 2.3 TB/s; a split of K over 4 warps did not move that either), 1.6x
// longer at batch 8, where every piece fed 8 rows of FMAs, and in e4m3 it was bound by instruction
// issue (2.5 per weight in bf16, twice that per byte in e4m3).
constexpr int kMmaWarps = 4;
constexpr int kMmaInFlight = 8;
// The first GEMV's 16-row blocks per warp (hidden 1024: 256 CTAs instead of 512). Its CTAs
// then hold fewer of each SM's registers, so that more of the second GEMV's CTAs (116
// registers each, launched programmatically behind it) get resident and request their dense
// prefix while it runs; with one block per warp the last quarter got resident only as the
// first GEMV's CTAs left, and ended last. At d 128 in e4m3 the two blocks' 8 loads are still
// one round. 128K batch 1 on an H200: 35.1-35.9 -> 34.9 us a step (two calls); 4 blocks per warp
// (one or two rounds) gained nothing (docs/gpu.md).
constexpr int kGemv1Rb = 2;
constexpr int kMmaN = 8;      // batch rows per pass over the weights
constexpr int kStageIlp = 4;  // pairs of x per thread and round of the staging

// Lane load `load` of a warp's 16 weight rows (Fmt::kTiles tiles of 16 columns, in
// pack_mma_rows' order) against 8 batch rows of x staged in shared memory as pairs: xb is
// batch row g's pairs from pair c on (row_in: that row exists). d[q] accumulates weight row
// g + 8 (q / 2) times batch row 2c + q % 2.
template <class Fmt>
__device__ __forceinline__ void rows_load_mma(float (&d)[4], const uint4& a, int load,
                                              const uint32_t* xb, bool row_in) {
#pragma unroll
  for (int t = 0; t < Fmt::kTiles; ++t) {
    const int s = load * Fmt::kTiles + t;  // the tile: columns 16 s ..
    const uint32_t b[2] = {row_in ? xb[s * 8] : 0u, row_in ? xb[s * 8 + 4] : 0u};
    Fmt::mma(d, a, t, b);
  }
}

template <class In, class Fmt, bool kRelu, int kRb>
__global__ void __launch_bounds__(kMmaWarps * 32)
    gemv_kernel(const In* x, const uint4* w, const float* scale, const float* bias, float* y,
                int batch, int heads, int rows, int K) {
  extern __shared__ uint32_t x_s[];  // [kMmaN][stride] pairs of x
  // The second GEMV is launched behind the first with programmatic dependent launch (see
  // launch_gemv): let it get resident now.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  constexpr int kc = 16 * Fmt::kTiles;  // columns per lane load
  constexpr int kIf = kMmaInFlight / kRb;  // loads per row block in flight together
  const int loads = (K + kc - 1) / kc, blocks = (rows + 15) / 16;
  // Words per batch row: K / 2 padded by 4, so that the 8 rows of a B fragment load (g) fall
  // on different banks.
  const int half_k = loads * kc / 2, stride = half_k + 4;
  const int head = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const int rb0 = (blockIdx.x * kMmaWarps + warp) * kRb;
  // The grid's last CTA may hold warps and blocks past the rows.
  const bool active = rb0 < blocks;
  // What does not depend on x is requested first, so that its memory latency overlaps the
  // staging of x: the epilogue's row scales and biases (rows g and g + 8) and the first
  // round of weights. At batch 1 that took 2.3-2.6 us off the 128K step (docs/gpu.md).
  float row_scale[kRb][2], row_bias[kRb][2];
  uint4 a[kRb][kIf];
  const auto load_round = [&](int l0) {
#pragma unroll
    for (int j = 0; j < kRb; ++j) {
      const bool in = rb0 + j < blocks;
      const uint4* wl = w + (int64_t(head) * blocks + (in ? rb0 + j : 0)) * loads * 32 + lane;
#pragma unroll
      for (int u = 0; u < kIf; ++u)
        a[j][u] = in && l0 + u < loads ? wl[(l0 + u) * 32] : make_uint4(0u, 0u, 0u, 0u);
    }
  };
#pragma unroll
  for (int j = 0; j < kRb; ++j)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = (rb0 + j) * 16 + g + 8 * i;
      row_scale[j][i] = 1.f;
      row_bias[j][i] = 0.f;
      if (r < rows) {
        const int64_t hr = int64_t(head) * rows + r;
        if (Fmt::kScaled) row_scale[j][i] = scale[hr];
        row_bias[j][i] = bias[hr];
      }
    }
  if (active) load_round(0);
  // x may be the previous grid's output (the first GEMV's hidden layer for the second; q_pre,
  // for the first, from whatever kernel wrote it): wait for that grid here, after the loads
  // above are in flight (a no-op for a launch without the attribute).
  asm volatile("griddepcontrol.wait;" ::: "memory");
  for (int b0 = 0; b0 < batch; b0 += kMmaN) {
    const int nb = min(kMmaN, batch - b0);
    __syncthreads();  // the previous pass's x_s is read
    // kStageIlp pairs per thread and round, all loaded before any is stored: the compiler
    // cannot move a load of x above a store to x_s itself (x is a generic pointer), and one
    // pair at a time made the staging a chain of L2 round trips (4 at K 1024).
    for (int i0 = threadIdx.x; i0 < nb * half_k; i0 += blockDim.x * kStageIlp) {
      float lo[kStageIlp], hi[kStageIlp];
#pragma unroll
      for (int u = 0; u < kStageIlp; ++u) {
        const int i = i0 + u * blockDim.x, n = i / half_k, k = (i % half_k) * 2;
        const In* xr = x + (int64_t(b0 + n) * heads + head) * K;
        const bool in = i < nb * half_k;
        lo[u] = in && k < K ? to_f(xr[k]) : 0.f;
        hi[u] = in && k + 1 < K ? to_f(xr[k + 1]) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kStageIlp; ++u) {
        const int i = i0 + u * blockDim.x;
        if (i < nb * half_k) x_s[(i / half_k) * stride + i % half_k] = Fmt::pack_x(lo[u], hi[u]);
      }
    }
    __syncthreads();
    if (!active) continue;
    float d[kRb][4] = {};
    const uint32_t* xb = x_s + g * stride + c;
    for (int l0 = 0; l0 < loads; l0 += kIf) {
      if (l0 > 0 || b0 > 0) load_round(l0);  // the first pass's first round is in already
#pragma unroll
      for (int j = 0; j < kRb; ++j)
#pragma unroll
        for (int u = 0; u < kIf; ++u) {
          if (l0 + u >= loads) break;
          rows_load_mma<Fmt>(d[j], a[j][u], l0 + u, xb, g < nb);
        }
    }
    // d[j][q]: row 16 (rb0 + j) + g + 8 (q / 2), batch column 2c + q % 2.
#pragma unroll
    for (int j = 0; j < kRb; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int r = (rb0 + j) * 16 + g + 8 * (q / 2), n = 2 * c + q % 2;
        if (r < rows && n < nb) {
          const float v = row_scale[j][q / 2] * d[j][q] + row_bias[j][q / 2];
          y[(int64_t(b0 + n) * heads + head) * rows + r] = kRelu ? fmaxf(v, 0.f) : v;
        }
      }
  }
}

// x_s of gemv_kernel: kMmaN rows of K (rounded up to 32) / 2 + 4 words.
size_t gemv_smem_bytes(int K) { return size_t(kMmaN) * ((K + 31) / 32 * 16 + 4) * 4; }

template <class In, class Fmt, bool kRelu, int kRb>
cudaError_t launch_gemv(const In* x, const void* w, const float* scale, const float* bias, float* y,
                        int batch, int heads, int rows, int K, bool programmatic,
                        cudaStream_t stream) {
  const int blocks = (rows + 15) / 16;
  const dim3 grid(unsigned((blocks + kMmaWarps * kRb - 1) / (kMmaWarps * kRb)), unsigned(heads));
  if (programmatic)
    return launch_programmatic(gemv_kernel<In, Fmt, kRelu, kRb>, grid, dim3(kMmaWarps * 32),
                               gemv_smem_bytes(K), stream, x, static_cast<const uint4*>(w), scale,
                               bias, y, batch, heads, rows, K);
  gemv_kernel<In, Fmt, kRelu, kRb><<<grid, kMmaWarps * 32, gemv_smem_bytes(K), stream>>>(
      x, static_cast<const uint4*>(w), scale, bias, y, batch, heads, rows, K);
  return cudaGetLastError();
}

// The second GEMV's weight formats, in column blocks (pack_column_blocks, saap.h): a lane's
// load is 8 rows of one column, g + 8e for e = 0 .. 7 (column_block_row), and `fragments`
// turns the loads of a tile's 4 columns (k 2c, 2c + 1, 2c + 8, 2c + 9 of the mma) into 8
// pairs of A fragment words: pair e is row g + 8e of each column, its first word the columns
// 2c and 2c + 1 (low half the first), its second 2c + 8 and 2c + 9. m-tile mt takes pairs
// 2 mt (rows 16 mt + g) and 2 mt + 1 (16 mt + g + 8).
//
// e4m3: one byte permute puts pairs e and e + 1 of two columns side by side, and each half
// of it converts to one fragment word: 16 conversions and 8 permutes a tile. At batch 1 the
// step is sensitive to this loop's instruction count (an H200 at 128K, docs/gpu.md,
// 2026-11-30): converting each column's pairs of rows first and pairing the fp16 halves after
// (16 permutes) took 0.1 us more, and four integer operations a word in place of the
// conversion 1.3 us more.
struct E4m3Columns : E4m3Mma {
  using Load = uint2;
  static constexpr int kInFlight = 4;  // k-tiles per warp whose loads are in flight together
  __device__ __forceinline__ static uint32_t to_half2(uint32_t e4m3x2) {
    const __half2_raw x = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(e4m3x2), __NV_E4M3);
    return uint32_t(x.x) | (uint32_t(x.y) << 16);
  }
  __device__ __forceinline__ static void fragments(const Load (&v)[4], uint32_t (&pairs)[8][2]) {
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      // Bytes j, j + 1 of the lo and hi columns' words: pairs e, e + 1.
      const uint32_t j = e % 4, sel = j | (4u + j) << 4 | (j + 1u) << 8 | (5u + j) << 12;
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        const uint32_t lo = e < 4 ? v[2 * w].x : v[2 * w].y;
        const uint32_t hi = e < 4 ? v[2 * w + 1].x : v[2 * w + 1].y;
        const uint32_t p = __byte_perm(lo, hi, sel);
        pairs[e][w] = to_half2(p & 0xffffu);
        pairs[e + 1][w] = to_half2(p >> 16);
      }
    }
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    ptx::mma_f16_16816(d, a, b, d);
  }
};
struct Bf16Columns : Bf16Mma {
  using Load = uint4;
  static constexpr int kInFlight = 2;  // the same bytes in flight as E4m3Columns
  // A load is 4 words of bf16 pairs, word i pairs 2i (low half) and 2i + 1.
  __device__ __forceinline__ static void fragments(const Load (&v)[4], uint32_t (&pairs)[8][2]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const uint32_t sel = e % 2 ? 0x7632u : 0x5410u;
      const auto word = [&](const Load& x) {
        const int i = e / 2;
        return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w;
      };
      pairs[e][0] = __byte_perm(word(v[0]), word(v[1]), sel);
      pairs[e][1] = __byte_perm(word(v[2]), word(v[3]), sel);
    }
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    ptx::mma_bf16_16816(d, a, b, d);
  }
};

// The MLP's second GEMV, y[b, head, r] = scale[head, r] * (w[head, r, :] . x[b, head, :]) +
// bias[head, r], reading only the columns k where x[b, head, k] is nonzero for some b of the
// pass. x is the ReLU of the first GEMV: at batch 1 about half of it is zero, so about half of
// the 32 MB of fp8 weights per layer (hidden 1024, C 1024, 32 heads) need not be read. A CTA
// owns one column block (kColumnBlock rows of one head) as the mma's M, 4 m-tiles, and takes
// up to kNzRows batch rows per pass as its N, one n-tile of 8 up to 8 rows and two above (the
// rows past the pass are zero registers, not loaded). Up to batch 8 the kernel is compiled
// for one n-tile (kNt): without the second tile's accumulators it holds 116 registers
// against 124, and on an H200 at 128K the batch-1 step took 31.1-31.2 us against 31.4, the
// average step over 32 layers 32.1 against 32.2 (docs/gpu.md, 2026-11-30). Each warp owns a
// quarter of the columns, and lists and reads them without the other warps:
// 1. Before griddepcontrol.wait, the first Fmt::kInFlight tiles of 16 columns of its range are
//    requested, whatever x holds: the dense prefix. The weights' latency then overlaps the
//    first GEMV, as in gemv_kernel, and the prefix costs at most its own bytes.
// 2. After the wait, it lists its columns in order (a warp scan of per-lane counts): every
//    column of the prefix, then the nonzero ones. x at them goes to shared memory in 16-bit
//    pairs, and the list is padded to whole tiles with column 0 at x = 0.
// 3. Tile by tile: lane (g, c) loads rows g, g + 8, .., g + 56 of listed columns 2c, 2c + 1,
//    2c + 8, 2c + 9 (a warp's load is four 64-byte pieces in e4m3), Fmt::kInFlight tiles'
//    loads in flight together, and pairs the columns' words by byte permutes into the A
//    fragments of the block's 4 m-tiles; x at the tile is the B fragment. With the block's
//    rows as M, a batch-1 tile takes 4 mma where the batch rows as M took 8 (15 of 16 of
//    their rows zero): on an H200 at 128K the average step over 32 layers took 32.3 us
//    against 32.6, batch 8 0.2 us more (docs/gpu.md, 2026-11-30).
// 4. The warps' accumulators are added in warp order through shared memory.
// Launched programmatically behind the first GEMV, whose CTAs trigger at their start.
constexpr int kNzWarps = 4;
constexpr int kNzRows = 16;                     // batch rows per pass: the mma's N, two n-tiles
constexpr int kNzColsPerLane = 8;               // columns a lane lists per round of the scan
constexpr int kNzScanRows = 4;                  // batch rows whose x a lane loads together
constexpr int kNzRedStride = kColumnBlock + 4;  // floats per batch row of the warp partials
// Softmax pairs per (batch row, head) that the second GEMV in column blocks leaves for the
// route: one per 32 outputs, so C <= 32 * kRoutePairs (every route_in_registers shape).
constexpr int kRoutePairs = 32;

// A warp's list capacity: its range of whole tiles (a quarter of K's, rounded up).
__host__ __device__ inline int nz_warp_capacity(int K) {
  return 16 * (((K + 15) / 16 + kNzWarps - 1) / kNzWarps);
}

// Dynamic shared memory of gemv_nonzero_kernel for `batch` rows and K columns, per warp: the
// column list and x in 16-bit pairs ([pass rows][capacity / 2 + 4] words; the padding keeps
// an A fragment's 8 rows on different banks); and the warps' partials.
size_t gemv_nonzero_smem_bytes(int batch, int K) {
  const size_t rows = size_t(std::min(batch, kNzRows)), cap = size_t(nz_warp_capacity(K));
  return size_t(kNzWarps) * (cap * 4 + rows * (cap / 2 + 4) * 4 + rows * kNzRedStride * 4);
}

// kNt: the mma's n-tiles, 1 for passes of up to 8 batch rows (batch <= 8), 2 above.
template <class Fmt, int kNt>
__global__ void __launch_bounds__(kNzWarps * 32, 4)
    gemv_nonzero_kernel(const float* x, const typename Fmt::Load* w, const float* scale,
                        const float* bias, float* y, int batch, int heads, int rows, int K,
                        float2* pairs) {
  using Load = typename Fmt::Load;
  constexpr int kThreads = kNzWarps * 32, kInFlight = Fmt::kInFlight;
  static_assert(kNt == 1 || kNt * 8 == kNzRows, "one n-tile, or as many as a pass's rows");
  extern __shared__ uint32_t nz_smem[];
  // The route (programmatic, behind this grid) may get resident as this grid's CTAs leave.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int head = blockIdx.y, blk = blockIdx.x, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int pass_rows = min(batch, kNzRows), cap = nz_warp_capacity(K), stride = cap / 2 + 4;
  int32_t* cols = reinterpret_cast<int32_t*>(nz_smem) + warp * cap;      // [cap] the warp's list
  uint32_t* x_s = nz_smem + kNzWarps * cap + warp * pass_rows * stride;  // [pass_rows][stride]
  uint16_t* x_h = reinterpret_cast<uint16_t*>(x_s);  // the same, as 16-bit values
  float* red = reinterpret_cast<float*>(nz_smem + kNzWarps * (cap + pass_rows * stride));
  // The warp's columns [c0, c1): a quarter of K's tiles (K % 8 == 0, so a lane's 8 columns
  // are all in or all out).
  const int tiles_k = (K + 15) / 16;
  const int c0 = 16 * (warp * tiles_k / kNzWarps);
  const int c1 = min(16 * ((warp + 1) * tiles_k / kNzWarps), K);
  // Column k of the block: kColumnBlock rows, 8 per lane load. Columns past K (a short
  // range's last tile) are read as column 0, at x = 0.
  const Load* wb = w + (int64_t(head) * gridDim.x + blk) * K * (kColumnBlock / 8) + g;
  const auto load_col = [&](int col) {
    return wb[int64_t(col < K ? col : 0) * (kColumnBlock / 8)];
  };
  // A thread's epilogue outputs are all row o of the block (kThreads is a multiple of it).
  const int o = tid % kColumnBlock, row = blk * kColumnBlock + o;
  float out_scale = 1.f, out_bias = 0.f;
  if (row < rows) {
    if (Fmt::kScaled) out_scale = scale[int64_t(head) * rows + row];
    out_bias = bias[int64_t(head) * rows + row];
  }
  // 1. The dense prefix: list positions p < kInFlight * 16 hold columns c0 + p.
  Load v[kInFlight][4];
#pragma unroll
  for (int u = 0; u < kInFlight; ++u)
#pragma unroll
    for (int i = 0; i < 4; ++i) v[u][i] = load_col(c0 + 16 * u + 2 * c + (i & 1) + 8 * (i >> 1));
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the first GEMV's output
  for (int b0 = 0; b0 < batch; b0 += kNzRows) {
    const int nb = min(kNzRows, batch - b0);
    // 2. The warp's list: the prefix, then its nonzero columns, in order; x at them.
    int listed = 0;
    for (int k0 = c0; k0 < c1; k0 += 32 * kNzColsPerLane) {
      const int kb = k0 + lane * kNzColsPerLane;
      const bool in = kb < c1;
      const auto row_x = [&](int n) { return x + (int64_t(b0 + n) * heads + head) * K + kb; };
      uint32_t nz = 0;  // bit j: column kb + j is listed
      for (int n0 = 0; n0 < nb; n0 += kNzScanRows) {
        float xv[kNzScanRows][kNzColsPerLane];  // loaded together: one L2 round trip
#pragma unroll
        for (int u = 0; u < kNzScanRows; ++u)
#pragma unroll
          for (int j = 0; j < kNzColsPerLane; ++j)
            xv[u][j] = in && n0 + u < nb ? row_x(n0 + u)[j] : 0.f;
#pragma unroll
        for (int u = 0; u < kNzScanRows; ++u)
#pragma unroll
          for (int j = 0; j < kNzColsPerLane; ++j) nz |= uint32_t(xv[u][j] != 0.f) << j;
      }
      if (in && kb < c0 + kInFlight * 16) nz = (1u << kNzColsPerLane) - 1;  // the prefix
      const int count = __popc(nz);
      int incl = count;  // inclusive scan over the warp
#pragma unroll
      for (int off = 1; off < 32; off *= 2) {
        const int t = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += t;
      }
      const int pos = listed + incl - count;
      for (int j = 0, p = pos; j < kNzColsPerLane; ++j)
        if (nz >> j & 1u) cols[p++] = kb + j;
      // A row at a time: its 8 loads (L1 hits now) together, then the stores.
      for (int n = 0; n < pass_rows; ++n) {
        float xv[kNzColsPerLane];
#pragma unroll
        for (int j = 0; j < kNzColsPerLane; ++j) xv[j] = in && n < nb ? row_x(n)[j] : 0.f;
        uint16_t* xn = x_h + size_t(n) * stride * 2;
#pragma unroll
        for (int j = 0, p = pos; j < kNzColsPerLane; ++j)
          if (nz >> j & 1u) xn[p++] = uint16_t(Fmt::pack_x(xv[j], 0.f));  // the low half
      }
      listed += __shfl_sync(0xffffffffu, incl, 31);
    }
    // The last tile's padding: column 0 at x = 0. A short range's prefix loads (past c1) fall
    // on these positions, at x = 0 too.
    const int tiles = (listed + 15) / 16;
    for (int p = listed + lane; p < tiles * 16; p += 32) {
      cols[p] = 0;
      for (int n = 0; n < pass_rows; ++n) x_h[size_t(n) * stride * 2 + p] = 0;
    }
    __syncwarp();
    // 3. The warp's tiles; the first pass's first round is the prefix, in flight already.
    float d[4][kNt][4] = {};  // [m-tile][n-tile][fragment]
    for (int t0 = 0; t0 < tiles; t0 += kInFlight) {
      if (t0 > 0 || b0 > 0) {
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
          // Listed columns are below K (the padding is column 0), so unlike the prefix's they
          // need no check; a lane's columns 2c, 2c + 1 and 2c + 8, 2c + 9 are two 8-byte loads.
          const int t = min(t0 + u, tiles - 1);
          const int2 lo = *reinterpret_cast<const int2*>(cols + t * 16 + 2 * c);
          const int2 hi = *reinterpret_cast<const int2*>(cols + t * 16 + 2 * c + 8);
          const int col[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
          for (int i = 0; i < 4; ++i) v[u][i] = wb[int64_t(col[i]) * (kColumnBlock / 8)];
        }
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int t = t0 + u;
        if (t >= tiles) break;
        // B: batch rows g (n-tile 0) and 8 + g (n-tile 1) at list positions 16t + 2c, + 1
        // and 16t + 2c + 8, + 9.
        const uint32_t* xb = x_s + t * 8 + c;
        uint32_t b[kNt][2];
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
          const bool in = 8 * nt + g < nb;
          b[nt][0] = in ? xb[(8 * nt + g) * stride] : 0u;
          b[nt][1] = in ? xb[(8 * nt + g) * stride + 4] : 0u;
        }
        uint32_t w[8][2];
        Fmt::fragments(v[u], w);
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
          const uint32_t a[4] = {w[2 * mt][0], w[2 * mt + 1][0], w[2 * mt][1], w[2 * mt + 1][1]};
          Fmt::mma(d[mt][0], a, b[0]);
          if (kNt > 1 && nb > 8) Fmt::mma(d[mt][kNt - 1], a, b[kNt - 1]);
        }
      }
    }
    // 4. d[mt][nt][q]: block row 16 mt + g + 8 (q / 2), batch row 8 nt + 2c + q % 2. The
    // warps' partials are added in warp order.
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int n = 8 * nt + 2 * c + q % 2;
          if (n < nb)
            red[(warp * pass_rows + n) * kNzRedStride + 16 * mt + g + 8 * (q / 2)] = d[mt][nt][q];
        }
    __syncthreads();
    for (int i = tid; i < nb * kColumnBlock; i += kThreads) {
      const int n = i / kColumnBlock;
      float acc = red[n * kNzRedStride + o];
      for (int w2 = 1; w2 < kNzWarps; ++w2) acc += red[(w2 * pass_rows + n) * kNzRedStride + o];
      const float v = out_scale * acc + out_bias;
      if (row < rows) y[(int64_t(b0 + n) * heads + head) * rows + row] = v;
      // The softmax pair of the warp's 32 outputs (one n; kThreads and kColumnBlock are
      // multiples of 32), for the route (route_pairs_score).
      if (pairs) {
        const float m = float_from_order_key(
            __reduce_max_sync(0xffffffffu, float_order_key(row < rows ? v : -INFINITY)));
        float e = row < rows ? __expf(v - m) : 0.f;
        for (int off = 16; off > 0; off /= 2) e += __shfl_xor_sync(0xffffffffu, e, off);
        if (lane == 0)
          pairs[(int64_t(b0 + n) * heads + head) * kRoutePairs + row / 32] = make_float2(m, e);
      }
    }
    __syncthreads();  // red is rewritten by the next pass
  }
}

// The MLP's two GEMVs, hidden = relu(w1 q_pre + b1) and logits = w2 hidden + b2, in the
// router's weight format; the second by w2's layout (Router::w2_column_blocks). Both are
// programmatic dependent launches. The second's CTAs get resident while the first runs and
// put their first round of weights in flight before they wait for the hidden layer (128K
// batch 1: 0.4-1 us off 57.4; docs/gpu.md). The first's do the same behind whatever kernel
// precedes the call: before their wait they read only the weights, scales and biases, which
// no kernel of a decode step writes, and q_pre after it (128K batch 1 on an H200: 38.0 ->
// 36.5 us on the steps that do not index, 39.0 -> 39.3 on the one that does).
template <class Mma, class Columns>
cudaError_t launch_mlp(const bf* q_pre, const void* w1, const float* s1, const void* w2,
                       const float* s2, const Router<bf16>& r, float* hidden, float* logits,
                       float2* pairs, int batch, cudaStream_t stream) {
  const int hq = r.num_q_heads;
  const cudaError_t e = launch_gemv<bf, Mma, true, kGemv1Rb>(q_pre, w1, s1, r.b1, hidden, batch, hq,
                                                             r.hidden, r.head_dim, true, stream);
  if (e != cudaSuccess || !r.w2_column_blocks)
    return e != cudaSuccess
               ? e
               : launch_gemv<float, Mma, false, 1>(hidden, w2, s2, r.b2, logits, batch, hq,
                                                   r.num_clusters, r.hidden, true, stream);
  const dim3 grid(unsigned((r.num_clusters + kColumnBlock - 1) / kColumnBlock), unsigned(hq));
  return launch_programmatic(
      batch <= 8 ? gemv_nonzero_kernel<Columns, 1> : gemv_nonzero_kernel<Columns, kNzRows / 8>,
      grid, dim3(kNzWarps * 32), gemv_nonzero_smem_bytes(batch, r.hidden), stream, hidden,
      static_cast<const typename Columns::Load*>(w2), s2, r.b2, logits, batch, hq, r.num_clusters,
      r.hidden, pairs);
}

template <class Op>
__device__ float block_reduce(float v, float* red, Op op) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  for (int off = 16; off > 0; off /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = red[0];
  for (int i = 1; i < nw; ++i) v = op(v, red[i]);
  return v;
}

// One compare-exchange of a bitonic network: (s, id) becomes the better of itself and its
// partner (ps, pid) when keep_better, else the worse.
__device__ __forceinline__ void compare_exchange(float& s, int& id, float ps, int pid,
                                                 bool keep_better) {
  if (keep_better == better(ps, pid, s, id)) {
    s = ps;
    id = pid;
  }
}

// The bitonic network of route_kernel's shared-memory sort for C <= kRouteThreads, one element
// per thread (s: thread i's score, -FLT_MAX past C, so padding sorts last): strides below 32 are
// exchanged by warp shuffles, larger ones through a double-buffered shared array (a buffer is
// rewritten only two barriers after it was read), so 1024 elements take 15 barriers instead of 55.
// Returns the id of the element of rank threadIdx.x: the same order as the shared-memory sort.
__device__ int route_sort_registers(float s, float* xs, int* xi) {
  const int i = threadIdx.x;
  int id = i;
  int buf = 0;
  for (int size = 2; size <= kRouteThreads; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      float ps;
      int pid;
      if (stride >= 32) {  // uniform over the block
        xs[buf * kRouteThreads + i] = s;
        xi[buf * kRouteThreads + i] = id;
        __syncthreads();
        ps = xs[buf * kRouteThreads + (i ^ stride)];
        pid = xi[buf * kRouteThreads + (i ^ stride)];
        buf ^= 1;
      } else {
        ps = __shfl_xor_sync(0xffffffffu, s, stride);
        pid = __shfl_xor_sync(0xffffffffu, id, stride);
      }
      // The lower element of a pair keeps the better one in descending blocks (bit `size`
      // clear), the worse one otherwise; the upper element the opposite.
      compare_exchange(s, id, ps, pid, ((i & size) == 0) == ((i & stride) == 0));
    }
  }
  return id;
}

// The best 32 of the block's kRouteThreads elements (one per thread: s, id; -FLT_MAX past C),
// in the order of route_sort_registers (descending score, ascending id): each warp sorts its
// 32 elements with shuffles, then five rounds halve the lists: warp w keeps the better of
// its element i and element 31 - i of warp w + 2^(r-1)'s list (a bitonic sequence holding the
// pair's best 32) and sorts it with five shuffle stages. 5 barriers instead of the full
// network's 15 and 20 compare-exchange stages instead of 55. Warp 0 ends with the best 32:
// lane i holds the element of rank i (returned through *id); other warps' results are unused.
__device__ void route_top32(float s, int id, float* xs, int* xi, int* out_id) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // One compare-exchange stage of a bitonic sort inside the warp: lanes i and i ^ stride,
  // the lower keeping the better in a descending block (bit `size` of the lane clear).
  auto stage = [&](int size, int stride) {
    const float ps = __shfl_xor_sync(0xffffffffu, s, stride);
    const int pid = __shfl_xor_sync(0xffffffffu, id, stride);
    compare_exchange(s, id, ps, pid, ((lane & size) == 0) == ((lane & stride) == 0));
  };
  for (int size = 2; size <= 32; size *= 2)
    for (int stride = size / 2; stride > 0; stride /= 2) stage(size, stride);
  // size 64: lane bit 5 is clear for every lane, so every stage of a merge sorts descending.
  constexpr int kWarps = kRouteThreads / 32;
  int buf = 0;
  for (int span = 1; span < kWarps; span *= 2) {
    const bool active = warp % (2 * span) == 0;
    const bool source = warp % (2 * span) == span;
    if (source) {
      xs[buf * kRouteThreads + warp * 32 + lane] = s;
      xi[buf * kRouteThreads + warp * 32 + lane] = id;
    }
    __syncthreads();  // a buffer is rewritten two rounds after it was read
    if (active) {
      const int j = (warp + span) * 32 + (31 - lane);
      const float ps = xs[buf * kRouteThreads + j];
      compare_exchange(s, id, ps, xi[buf * kRouteThreads + j], true);
      for (int stride = 16; stride > 0; stride /= 2) stage(64, stride);
    }
    buf ^= 1;
  }
  *out_id = id;
}

// Softmax of each of the group's g query heads over the C <= kRouteThreads cluster logits,
// summed over the group, for cluster threadIdx.x (-FLT_MAX past C). Each warp reduces its 32
// logits of a head to a pair (max m_w by one redux.sync, sum s_w of exponentials relative to
// it by shuffles); after a barrier warp 0 combines the 32 pairs of each head (lane w holds
// warp w's): M = max m_w, S = sum_w s_w exp(m_w - M), and leaves every warp its factors
// exp(m_w - M) / S; a second barrier, and a cluster's score is the sum over heads of its
// relative exponential times its warp's factor. The shuffles are the cost in a CTA of 1024
// threads (an SM shuffles one warp a cycle): the form with a block-wide max, then a
// block-wide sum took 1.6 us of the route's 6 on an H200, and every warp combining the
// pairs itself 2.5 (docs/gpu.md). kG (4 or 8) bounds g: the unrolled per-head arrays, their
// code and registers, take kG heads.
template <int kG>
__device__ float route_mlp_score(const float* logits, int row0, int g, int C, float* red) {
  static_assert(kG <= kMaxRouteGroup, "red holds kMaxRouteGroup heads per warp");
  static_assert(kRouteThreads == 32 * 32, "a lane of warp 0 per warp when the pairs combine");
  const int c = threadIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float z[kG], e[kG];
#pragma unroll
  for (int j = 0; j < kG; ++j) z[j] = j < g && c < C ? logits[int64_t(row0 + j) * C + c] : -FLT_MAX;
  float* pair_m = red;                        // [32 warps][kMaxRouteGroup]
  float* pair_s = red + 32 * kMaxRouteGroup;  // [32 warps][kMaxRouteGroup]; then the factors
#pragma unroll
  for (int j = 0; j < kG; ++j) {
    const float m = float_from_order_key(__reduce_max_sync(0xffffffffu, float_order_key(z[j])));
    e[j] = j < g && c < C ? __expf(z[j] - m) : 0.f;
    if (lane == 0) pair_m[warp * kMaxRouteGroup + j] = m;
  }
  float sum[kG];
#pragma unroll
  for (int j = 0; j < kG; ++j) sum[j] = e[j];
  for (int off = 16; off > 0; off /= 2)
#pragma unroll
    for (int j = 0; j < kG; ++j) sum[j] += __shfl_xor_sync(0xffffffffu, sum[j], off);
  if (lane == 0)
#pragma unroll
    for (int j = 0; j < kG; ++j) pair_s[warp * kMaxRouteGroup + j] = sum[j];
  __syncthreads();
  if (warp == 0) {
    // A warp with no logits of the head (past C, or j >= g) has s_w = 0 and adds nothing.
#pragma unroll
    for (int j = 0; j < kG; ++j) {
      const float m = pair_m[lane * kMaxRouteGroup + j];
      const float big = float_from_order_key(__reduce_max_sync(0xffffffffu, float_order_key(m)));
      const float w = __expf(m - big);
      float total = pair_s[lane * kMaxRouteGroup + j] * w;
      for (int off = 16; off > 0; off /= 2) total += __shfl_xor_sync(0xffffffffu, total, off);
      pair_s[lane * kMaxRouteGroup + j] = j < g ? w * (1.f / total) : 0.f;
    }
  }
  __syncthreads();
  float score = 0.f;
#pragma unroll
  for (int j = 0; j < kG; ++j)
    if (j < g) score += e[j] * pair_s[warp * kMaxRouteGroup + j];
  return c < C ? score : -FLT_MAX;
}

// route_mlp_score from the second GEMV's softmax pairs (gemv_nonzero_kernel with pairs; C
// <= 32 * kRoutePairs): warp j < g loads head j's pairs (lane l pair l) while every thread
// loads its logits, one round trip; the warp combines them into the head's max M and the
// inverse of its sum S into red, and after one barrier every thread's score is sum_j exp(z_j
// - M_j) / S_j. Every warp combining every head itself (no barrier) had all 32 warps do the
// same reductions and exponentials; this form took 0.1-0.4 us off the step on an H200
// (docs/gpu.md). The route's own reductions (two barriers of 32 warps) had taken 1.7 us of
// its 4 before the pairs.
template <int kG>
__device__ float route_pairs_score(const float* logits, const float2* pairs, int row0, int g, int C,
                                   float* red) {
  const int c = threadIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int groups = (C + 31) / 32;
  float z[kG];
#pragma unroll
  for (int j = 0; j < kG; ++j) z[j] = j < g && c < C ? logits[int64_t(row0 + j) * C + c] : -FLT_MAX;
  float* head_m = red;                     // [kG]
  float* head_inv = red + kMaxRouteGroup;  // [kG]
  if (warp < g) {
    const float2 p = lane < groups ? pairs[int64_t(row0 + warp) * kRoutePairs + lane]
                                   : make_float2(-INFINITY, 0.f);
    const float m = float_from_order_key(__reduce_max_sync(0xffffffffu, float_order_key(p.x)));
    float sum = p.x == -INFINITY ? 0.f : p.y * __expf(p.x - m);
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) {
      head_m[warp] = m;
      head_inv[warp] = 1.f / sum;
    }
  }
  __syncthreads();
  float score = 0.f;
#pragma unroll
  for (int j = 0; j < kG; ++j)
    if (j < g) score += __expf(z[j] - head_m[j]) * head_inv[j];
  return c < C ? score : -FLT_MAX;
}

// The best `probes` <= 32 of the block's C <= kRouteThreads scores (thread c holds cluster
// c's, s >= 0), in route_sort_registers' order (descending score, ascending id), to
// out[rank]; or false, with nothing written, when the candidates below overflow (then the
// caller takes route_top32). Only elements scoring at least the 32nd best can be among the
// best 32, so any t with 32 elements at or above it bounds the candidates. Each warp offers
// two keys: its best, which stands for one element, and its second best (its best again when
// two lanes hold that), which stands for two; t is the largest offered key that at least 32
// of the 64 reach, so at least 32 elements score t or more. (The smallest of the 32 warp
// maxima, the bound before, let 91-186 of 1024 clusters through at 128K, and the slowest
// route CTA spent 2 us ranking them; docs/gpu.md. Padding, past C, has key 0 and never
// offers more than 0, so for C < 32 every cluster is a candidate.) The candidates are
// compacted into shared memory, and each is ranked by counting the candidates better than
// it, up to 8 threads sharing the count. Four barriers and no sorting network: route_top32's
// warp sorts and five merge rounds took 3.3 us of the route's 6 on an H200 (docs/gpu.md).
constexpr int kRouteCandidates = 256;
constexpr int kRouteRankParts = 8;  // threads at most that share a candidate's count
__device__ bool route_top_candidates(float s, int C, int probes, unsigned long long* cand,
                                     int* cand_rank, unsigned* warp_keys, int* cand_count,
                                     int32_t* out) {
  const int c = threadIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // Scores as ordered keys: a nonnegative float's bits grow with it; 1 + them for clusters
  // (0 and NaN scores: 1), 0 past C, so that padding ranks below every cluster.
  const unsigned key = c < C ? (s > 0.f ? __float_as_uint(s) + 1u : 1u) : 0u;
  const unsigned best = __reduce_max_sync(0xffffffffu, key);
  const unsigned below = __reduce_max_sync(0xffffffffu, key < best ? key : 0u);
  const unsigned second = __popc(__ballot_sync(0xffffffffu, key == best)) > 1 ? best : below;
  unsigned* bound = warp_keys + 64;  // warp_keys: [32] best, [32] second, the bound
  if (lane == 0) {
    warp_keys[warp] = best;
    warp_keys[32 + warp] = second;
  }
  if (c == 0) {
    *cand_count = 0;
    *bound = 0u;
  }
  if (c < kRouteCandidates) cand_rank[c] = 0;
  __syncthreads();
  {
    const unsigned wb = warp_keys[lane], ws = warp_keys[32 + lane];
    const auto reach = [&](unsigned x) {
      return __popc(__ballot_sync(0xffffffffu, wb >= x)) +
             __popc(__ballot_sync(0xffffffffu, ws >= x));
    };
    // This warp's offer (second <= best, so it reaches at least as many).
    const unsigned offer = reach(best) >= 32 ? best : reach(second) >= 32 ? second : 0u;
    if (lane == 0 && offer > 0u) atomicMax(bound, offer);
  }
  __syncthreads();
  const unsigned t = *bound;
  const bool is = key >= t && c < C;
  const unsigned ballot = __ballot_sync(0xffffffffu, is);
  int base = 0;
  if (lane == 0 && ballot != 0u) base = atomicAdd(cand_count, __popc(ballot));
  base = __shfl_sync(0xffffffffu, base, 0);
  const int slot = base + __popc(ballot & ((1u << lane) - 1u));
  // The full order as one 64-bit key: the score's key, then the id reversed (lower id better).
  if (is && slot < kRouteCandidates)
    cand[slot] = (static_cast<unsigned long long>(key) << 32) | unsigned(~unsigned(c));
  __syncthreads();
  const int K = *cand_count;               // >= 1: the best cluster scores t or more
  if (K > kRouteCandidates) return false;  // uniform over the block
  {
    static_assert(kRouteThreads >= 4 * kRouteCandidates, "at least 4 threads a candidate");
    const int parts = min(kRouteRankParts, kRouteThreads / K), i = c % K, part = c / K;
    if (part < parts) {
      const unsigned long long mine = cand[i];
      int better_count = 0;
      const int u0 = part * K / parts, u1 = (part + 1) * K / parts;
#pragma unroll 4
      for (int u = u0; u < u1; ++u) better_count += cand[u] > mine;
      if (better_count > 0) atomicAdd(&cand_rank[i], better_count);
    }
  }
  __syncthreads();
  if (c < K) {
    const int rank = cand_rank[c];
    if (rank < probes) out[rank] = int(~unsigned(cand[c] & 0xffffffffull));
  }
  return true;
}

// The route kernels' shared memory for C rounded up to pow2 (route_smem_bytes): the top
// candidates (first: 8-byte keys), scores and ids, the reduction scratch, the mean query, the
// register sort's exchange buffers, the candidates' ranks, the warp keys and their count.
struct RouteSmem {
  unsigned long long* cand;  // [kRouteCandidates]
  float* score;              // [pow2]
  int* ids;                  // [pow2]
  float* red;                // [2 * 32 * kMaxRouteGroup]
  float* qmean;              // [128]
  float* exchange;
  int* exchange_ids;   // [2 * kRouteThreads] each
  int* cand_rank;      // [kRouteCandidates]
  unsigned* warp_keys;  // [65] route_top_candidates' warp keys and bound
  int* cand_count;     // [1]
  int* off;            // [kRouteThreads + 1] the slot's CSR offsets (route_mlp_kernel)
  int* sel;            // [kRouteThreads] the selection (route_mlp_kernel)

  static constexpr size_t bytes(int pow2) {
    return kRouteCandidates * sizeof(unsigned long long) +
           size_t(pow2) * (sizeof(float) + sizeof(int)) +
           (2 * 32 * kMaxRouteGroup + 128) * sizeof(float) +
           2 * size_t(kRouteThreads) * (sizeof(float) + sizeof(int)) +
           (kRouteCandidates + 65 + 1 + 2 * kRouteThreads + 1) * sizeof(int);
  }
  __device__ RouteSmem(float* base, int pow2) {
    cand = reinterpret_cast<unsigned long long*>(base);
    score = reinterpret_cast<float*>(cand + kRouteCandidates);
    ids = reinterpret_cast<int*>(score + pow2);
    red = reinterpret_cast<float*>(ids + pow2);
    qmean = red + 2 * 32 * kMaxRouteGroup;
    exchange = qmean + 128;
    exchange_ids = reinterpret_cast<int*>(exchange + 2 * kRouteThreads);
    cand_rank = exchange_ids + 2 * kRouteThreads;
    warp_keys = reinterpret_cast<unsigned*>(cand_rank + kRouteCandidates);
    cand_count = reinterpret_cast<int*>(warp_keys + 65);
    off = cand_count + 1;
    sel = off + kRouteThreads + 1;
  }
};

// The route is launched programmatically behind the second GEMV, which releases it at its
// start. It reads nothing before this wait; only then does it let the attention launch. The
// index step used to be joined before the route, as a second predecessor: a kernel node with
// two predecessors got resident only after both had completed, even with both edges
// programmatic (the route entered 2 us after the GEMV's last CTA at 128K on an H200), and the
// index branch beside the GEMVs cost the step 2.8 us in all (docs/gpu.md). It is now part of
// the attention and its merge ("decode: indexing").
__device__ __forceinline__ void route_wait_then_release() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Whether a route takes route_mlp_kernel: the MLP router with C <= kRouteThreads and a group
// of at most kMaxRouteGroup query heads (every shipped shape).
bool route_in_registers(const Router<bf16>& r, int pow2) {
  return r.use_mlp && pow2 <= kRouteThreads && r.num_q_heads / r.num_kv_heads <= kMaxRouteGroup;
}

// The route of route_in_registers shapes for (b, h): the group's softmax-summed scores in
// registers (a group of at most kG heads), then the best `probes` by route_top_candidates
// (kTop32: probes <= 32; route_top32 when its candidates overflow) or the register sort, to
// selected[(b * Hkv + h) * probes ...]. A kernel apart from route_kernel's general paths so
// that their code is not in its instructions: in these one-wave kernels that run their code
// once, code that no thread executes still cost time (docs/gpu.md, device facts).
template <bool kTop32, int kG, bool kPairs>
__global__ void __launch_bounds__(kRouteThreads)
    route_mlp_kernel(const float* logits, const float2* pairs, Router<bf16> r, int probes, int pow2,
                     IndexState st, int32_t* selected) {
  extern __shared__ float route_s[];
  const RouteSmem sm(route_s, pow2);
  const int hkv = r.num_kv_heads, g = r.num_q_heads / hkv, C = r.num_clusters;
  const int b = blockIdx.x / hkv, h = blockIdx.x % hkv, tid = threadIdx.x;
  // The slot's CSR offsets, for the prefetch at the end, before the wait: the index is
  // complete once this grid launches (decode_select_cuda).
  const bool prefetch = st.members != nullptr;
  if (prefetch) {
    const int32_t* offsets = st.offsets_of(b, h);
    for (int c = tid; c <= C; c += kRouteThreads) sm.off[c] = offsets[c];
  }
  route_wait_then_release();
  int32_t* out = selected + int64_t(blockIdx.x) * probes;
  const int row0 = b * r.num_q_heads + h * g;
  const float s = kPairs ? route_pairs_score<kG>(logits, pairs, row0, g, C, sm.red)
                         : route_mlp_score<kG>(logits, row0, g, C, sm.red);
  if (!kTop32 || !route_top_candidates(s, C, probes, sm.cand, sm.cand_rank, sm.warp_keys,
                                       sm.cand_count, sm.sel)) {
    int id;
    if (kTop32)
      route_top32(s, tid, sm.exchange, sm.exchange_ids, &id);
    else
      id = route_sort_registers(s, sm.exchange, sm.exchange_ids);
    if (tid < probes) sm.sel[tid] = id;
  }
  __syncthreads();
  if (tid < probes) out[tid] = sm.sel[tid];
  // The members of the selected clusters into L2, a warp per cluster: they are the first
  // thing the attention's member parts load after their wait (1.5-1.8 us of their 3.4 from
  // the wait to their first rows). With the bound above, the 128K step on an H200 was 0.3 us
  // shorter with this than without, though the timeline's members step was not (docs/gpu.md).
  // The route ends without waiting for these requests.
  // Their KV page rows too where the index keeps them (member_rows), loaded beside them.
  if (prefetch) {
    const auto request = [&](const int32_t* list) {
      for (int k = tid / 32; k < probes; k += kRouteThreads / 32) {
        const int c = sm.sel[k];
        const uintptr_t lo = reinterpret_cast<uintptr_t>(list + sm.off[c]) & ~uintptr_t(127);
        const uintptr_t hi = reinterpret_cast<uintptr_t>(list + sm.off[c + 1]);
        for (uintptr_t line = lo + 128 * (tid % 32); line < hi; line += 32 * 128)
          ptx::prefetch_l2(reinterpret_cast<const void*>(line));
      }
    };
    request(st.members_of(b, h));
    if (st.member_rows) request(st.member_rows_of(b, h));
  }
}

using RouteMlpKernel = void (*)(const float*, const float2*, Router<bf16>, int, int, IndexState,
                                int32_t*);
template <bool kPairs>
RouteMlpKernel route_mlp_kernel_for(bool top32, bool small_group) {
  return top32 ? (small_group ? route_mlp_kernel<true, 4, kPairs>
                              : route_mlp_kernel<true, kMaxRouteGroup, kPairs>)
               : (small_group ? route_mlp_kernel<false, 4, kPairs>
                              : route_mlp_kernel<false, kMaxRouteGroup, kPairs>);
}

// Scores of the C clusters for (b, h), bitonic-sorted (descending score, ascending id), top l
// to selected[b * Hkv + h]: every shape that route_mlp_kernel does not take.
__global__ void __launch_bounds__(kRouteThreads)
    route_kernel(const float* logits, const bf* q_pre, Router<bf16> r, int probes, int pow2,
                 int32_t* selected) {
  route_wait_then_release();
  extern __shared__ float route_s[];
  const RouteSmem sm(route_s, pow2);
  float *score = sm.score, *red = sm.red, *qmean = sm.qmean;
  int* ids = sm.ids;
  const int hkv = r.num_kv_heads, g = r.num_q_heads / hkv, C = r.num_clusters, d = r.head_dim;
  const int b = blockIdx.x / hkv, h = blockIdx.x % hkv;
  const int row0 = b * r.num_q_heads + h * g;
  for (int c = threadIdx.x; c < pow2; c += blockDim.x) {
    score[c] = c < C ? 0.f : -FLT_MAX;
    ids[c] = c;
  }
  if (r.use_mlp) {
    for (int j = 0; j < g; ++j) {
      const float* z = logits + int64_t(row0 + j) * C;
      float m = -FLT_MAX;
      for (int c = threadIdx.x; c < C; c += blockDim.x) m = fmaxf(m, z[c]);
      m = block_reduce(m, red, [](float a, float x) { return fmaxf(a, x); });
      float s = 0.f;
      for (int c = threadIdx.x; c < C; c += blockDim.x) s += __expf(z[c] - m);
      s = block_reduce(s, red, [](float a, float x) { return a + x; });
      const float inv = 1.f / s;
      for (int c = threadIdx.x; c < C; c += blockDim.x) score[c] += __expf(z[c] - m) * inv;
    }
  } else {
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
      float s = 0.f;
      for (int j = 0; j < g; ++j) s += __bfloat162float(q_pre[int64_t(row0 + j) * d + i]);
      qmean[i] = s / float(g);
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      const float* row = r.centroids + (int64_t(h) * C + c) * d;
      float acc = 0.f;
      for (int k = 0; k < d; ++k) acc = fmaf(row[k], qmean[k], acc);
      score[c] = centroid_score(acc, r.centroid_norms[int64_t(h) * C + c]);
    }
  }
  __syncthreads();
  if (pow2 <= kRouteThreads) {
    const int id = route_sort_registers(int(threadIdx.x) < C ? score[threadIdx.x] : -FLT_MAX,
                                        sm.exchange, sm.exchange_ids);
    if (int(threadIdx.x) < probes) selected[int64_t(blockIdx.x) * probes + threadIdx.x] = id;
    return;
  }
  for (int size = 2; size <= pow2; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int i = threadIdx.x; i < pow2 / 2; i += blockDim.x) {
        const int lo = 2 * i - (i & (stride - 1));
        const int hi = lo + stride;
        // Descending order in blocks whose bit `size` is clear: the final pass is descending.
        const bool desc = (lo & size) == 0;
        const bool hi_first = better(score[hi], ids[hi], score[lo], ids[lo]);
        if (hi_first == desc) {
          const float ts = score[lo];
          score[lo] = score[hi];
          score[hi] = ts;
          const int ti = ids[lo];
          ids[lo] = ids[hi];
          ids[hi] = ti;
        }
      }
      __syncthreads();
    }
  }
  for (int i = threadIdx.x; i < probes; i += blockDim.x)
    selected[int64_t(blockIdx.x) * probes + i] = ids[i];
}

// ---- decode: workspace and launchers -------------------------------------------------------

// The router's scratch: the hidden layer and the logits.
struct RouteLayout {
  size_t hidden, logits, pairs, total;
};

RouteLayout route_layout(int max_batch, int hq, int hidden, int C) {
  RouteLayout l;
  l.hidden = align_up(size_t(max_batch) * hq * hidden * sizeof(float));
  l.logits = align_up(size_t(max_batch) * hq * C * sizeof(float));
  l.pairs = align_up(size_t(max_batch) * hq * kRoutePairs * sizeof(float2));
  l.total = l.hidden + l.logits + l.pairs;
  return l;
}

// The route kernels' shared memory for C rounded up to pow2 (the layout of RouteSmem).
size_t route_smem_bytes(int pow2) { return RouteSmem::bytes(pow2); }

int next_pow2(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

}  // namespace

size_t index_prefill_workspace_bytes(int max_len, int num_kv_heads, int head_dim) {
  return prefill_layout(max_len, num_kv_heads, head_dim).total;
}

cudaError_t index_prefill_cuda(const PagedKV& kv, const int32_t* seq_lens_host,
                               const float* inv_freq, const Window& w, const Router<bf16>& r,
                               const IndexState& st, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream, Unassigned* unassigned) {
  const int hkv = kv.num_kv_heads, d = kv.head_dim, C = st.num_clusters;
  if (d % 8 != 0 || d > 128 || hkv != st.num_kv_heads || C != r.num_clusters ||
      kv.batch > st.max_batch)
    return cudaErrorInvalidValue;
  int max_len = 0;
  for (int b = 0; b < kv.batch; ++b) {
    if (seq_lens_host[b] > st.max_tokens) return cudaErrorInvalidValue;
    max_len = std::max(max_len, int(seq_lens_host[b]));
  }
  const PrefillLayout lay = prefill_layout(max_len, hkv, d);
  if (!workspace || workspace_bytes < lay.total) return cudaErrorInvalidValue;
  char* p = static_cast<char*>(workspace);
  bf16* keys = reinterpret_cast<bf16*>(p);
  int32_t* iota = reinterpret_cast<int32_t*>(p + lay.keys);
  int32_t* sorted = reinterpret_cast<int32_t*>(p + lay.keys + lay.iota);
  void* temp = p + lay.keys + lay.iota + lay.sorted;
  auto* none =
      unassigned
          ? reinterpret_cast<unsigned long long*>(p + lay.keys + lay.iota + lay.sorted + lay.temp)
          : nullptr;
  if (none) {
    cudaError_t e = cudaMemsetAsync(none, 0xff, sizeof(unsigned long long), stream);  // first
    if (e == cudaSuccess) e = cudaMemsetAsync(none + 1, 0, sizeof(unsigned long long), stream);
    if (e != cudaSuccess) return e;
  }
  iota_kernel<<<std::max(1, std::min(1024, (max_len + 255) / 256)), 256, 0, stream>>>(iota,
                                                                                      max_len);
  const size_t smem =
      (size_t(kAssignTokens) * (d + 1) + size_t(kAssignCents) * d + 2 * 8 * 32) * sizeof(float);
  // Bits of the sort's keys: 2^bits > C, so that a key with no cluster (-1, all bits set)
  // sorts after every cluster.
  int bits = 1;
  while ((1 << bits) <= C) ++bits;
  for (int b = 0; b < kv.batch; ++b) {
    const int n = seq_lens_host[b];
    const int end = std::max(w.sink, n - w.recent);
    if (n > 0) {
      const int64_t vecs = int64_t(n) * hkv * (d / 8);
      gather_keys_kernel<<<int(std::min<int64_t>((vecs + 255) / 256, 65536)), 256, 0, stream>>>(
          kv, b, n, keys);
      cudaError_t e = rope_cuda(keys, n, hkv, d, int64_t(hkv) * d, iota, inv_freq, true, stream);
      if (e != cudaSuccess) return e;
    }
    const int count = end - w.sink;
    if (count > 0) {
      dim3 grid((count + kAssignTokens - 1) / kAssignTokens, hkv);
      assign_tiled_kernel<<<grid, kAssignThreads, smem, stream>>>(reinterpret_cast<const bf*>(keys),
                                                                  hkv, d, w.sink, end, r.centroids,
                                                                  r.centroid_norms, C, st, b, none);
    }
    for (int h = 0; h < hkv; ++h) {
      if (count > 0) {
        size_t temp_bytes = lay.temp;
        cudaError_t e = cub::DeviceRadixSort::SortPairs(
            temp, temp_bytes, st.assign_of(b, h) + w.sink, sorted, iota + w.sink,
            st.members_of(b, h), count, 0, bits, stream);
        if (e != cudaSuccess) return e;
        if (st.member_rows)
          member_rows_kernel<<<std::min(1024, (count + 255) / 256), 256, 0, stream>>>(
              st.members_of(b, h), count, kv.page_table + int64_t(b) * kv.max_pages_per_seq,
              kv.page_size, st.member_rows_of(b, h));
      }
      csr_offsets_kernel<<<(C + 256) / 256, 256, 0, stream>>>(sorted, std::max(count, 0), C,
                                                              st.offsets_of(b, h));
    }
    set_lens_kernel<<<1, std::max(32, hkv), 0, stream>>>(st, b, end);
  }
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || !none) return e;
  unsigned long long host[2];
  e = cudaMemcpyAsync(host, none, sizeof(host), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return e;
  *unassigned = Unassigned{};
  unassigned->count = int(host[1]);
  if (host[1] > 0) {
    const int bh = int(host[0] >> 32);
    unassigned->b = bh / hkv;
    unassigned->h = bh % hkv;
    unassigned->t = int(host[0] & 0xffffffffu);
  }
  return cudaSuccess;
}

namespace {

// mlp_logits_cuda, and with w2 in column blocks and pairs non-null, the softmax pairs of
// every 32 outputs to pairs [batch, Hq, kRoutePairs] (C <= 32 * kRoutePairs).
cudaError_t mlp_logits(const bf16* q_pre, const Router<bf16>& r, int batch, float* hidden,
                       float* logits, float2* pairs, cudaStream_t stream) {
  if (batch < 1 || r.num_q_heads < 1 || r.head_dim < 1 || r.head_dim > 128 || r.hidden % 8 != 0 ||
      r.hidden < 8 || r.hidden > kMaxHiddenCuda || r.num_clusters < 1 || !q_pre || !hidden ||
      !logits || !(r.w1_e4m3 ? r.w2_e4m3 && r.w1_scale && r.w2_scale : r.w1 && r.w2) ||
      (pairs && (!r.w2_column_blocks || r.num_clusters > 32 * kRoutePairs)))
    return cudaErrorInvalidValue;
  const bf* q = reinterpret_cast<const bf*>(q_pre);
  return r.w1_e4m3
             ? launch_mlp<E4m3Mma, E4m3Columns>(q, r.w1_e4m3, r.w1_scale, r.w2_e4m3, r.w2_scale, r,
                                                hidden, logits, pairs, batch, stream)
             : launch_mlp<Bf16Mma, Bf16Columns>(q, r.w1, nullptr, r.w2, nullptr, r, hidden, logits,
                                                pairs, batch, stream);
}

}  // namespace

cudaError_t mlp_logits_cuda(const bf16* q_pre, const Router<bf16>& r, int batch, float* hidden,
                            float* logits, cudaStream_t stream) {
  return mlp_logits(q_pre, r, batch, hidden, logits, nullptr, stream);
}

size_t route_workspace_bytes(int max_batch, int num_q_heads, int hidden, int num_clusters) {
  return route_layout(max_batch, num_q_heads, hidden, num_clusters).total;
}

namespace {

// The shared memory of a route CTA of `route_ctas` for an attention of head_dim d, probes and
// C clusters: its own, or route_alone_smem_bytes with this device's figures.
cudaError_t route_smem_for(int route_ctas, int pow2, int d, int probes, int C, size_t* bytes) {
  SmInfo info;
  const cudaError_t e = sm_info(&info);
  if (e != cudaSuccess) return e;
  const size_t attend = d == 128 ? attend_smem_bytes<AttendCfg128>(probes, C)
                                 : attend_smem_bytes<AttendCfg64>(probes, C);
  *bytes = std::max(route_smem_bytes(pow2),
                    route_alone_smem_bytes(route_ctas, info.sms, size_t(info.smem_per_sm),
                                           size_t(info.reserved), size_t(info.optin), attend));
  return cudaSuccess;
}

}  // namespace

cudaError_t decode_select_cuda(const bf16* q_pre, int batch, const Router<bf16>& r, int probes,
                               int32_t* selected, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream, const IndexState* index) {
  const int B = batch, hkv = r.num_kv_heads, hq = r.num_q_heads, d = r.head_dim;
  const int C = r.num_clusters, H = r.hidden;
  if (B < 1 || hkv < 1 || hq < 1 || hq % hkv != 0 || d % 8 != 0 || d > 128 || H % 8 != 0 ||
      (r.use_mlp && H > kMaxHiddenCuda) || C > kMaxClustersCuda || probes < 1 || probes > C ||
      !q_pre || !selected ||
      (index && (index->num_kv_heads != hkv || index->num_clusters != C || index->max_batch < B ||
                 !index->offsets || !index->members)))
    return cudaErrorInvalidValue;
  const RouteLayout lay = route_layout(B, hq, H, C);
  if (!workspace || workspace_bytes < lay.total) return cudaErrorInvalidValue;
  char* p = static_cast<char*>(workspace);
  float* hidden = reinterpret_cast<float*>(p);
  float* logits = reinterpret_cast<float*>(p + lay.hidden);
  const int pow2 = next_pow2(C);
  // The second GEMV in column blocks leaves the route its softmax pairs.
  const bool pairs = route_in_registers(r, pow2) && r.w2_column_blocks && C <= 32 * kRoutePairs;
  float2* pair_buf = pairs ? reinterpret_cast<float2*>(p + lay.hidden + lay.logits) : nullptr;
  cudaError_t e = cudaSuccess;
  if (r.use_mlp) {
    e = mlp_logits(q_pre, r, B, hidden, logits, pair_buf, stream);
    if (e != cudaSuccess) return e;
  }
  size_t route_smem = 0;
  e = route_smem_for(B * hkv, pow2, d, probes, C, &route_smem);
  if (e != cudaSuccess) return e;
  // The route, programmatic behind the MLP's last grid, waits for it before it releases the
  // attention (route_wait_then_release), whose code before its own wait reads the index: the
  // index step of the call before (its commit and fold, in that call's merge kernel, which
  // releases nothing early) has completed then, and so has it when the route launches:
  // route_mlp_kernel reads the index's offsets before its own wait.
  if (!route_in_registers(r, pow2)) {
    e = launch_programmatic(route_kernel, dim3(unsigned(B * hkv)), dim3(kRouteThreads), route_smem,
                            stream, logits, reinterpret_cast<const bf*>(q_pre), r, probes, pow2,
                            selected);
  } else {
    // Llama-3's groups of 4 (and smaller) take the kernel unrolled for 4 heads.
    const bool top32 = probes <= 32, small_group = hq / hkv <= 4;
    const RouteMlpKernel fn = pairs ? route_mlp_kernel_for<true>(top32, small_group)
                                    : route_mlp_kernel_for<false>(top32, small_group);
    e = launch_programmatic(fn, dim3(unsigned(B * hkv)), dim3(kRouteThreads), route_smem, stream,
                            logits, static_cast<const float2*>(pair_buf), r, probes, pow2,
                            index ? *index : IndexState{}, selected);
  }
  return e;
}

size_t attend_workspace_bytes(int max_batch, int num_q_heads, int num_kv_heads, int head_dim) {
  const size_t states = size_t(max_batch) * num_kv_heads * kMaxAttendParts *
                        size_t(num_q_heads / std::max(1, num_kv_heads));
  return align_up(states * sizeof(float)) + align_up(states * head_dim * sizeof(float));
}

namespace {

// Raises kernel fn's dynamic shared-memory limit on the current device to at least smem, once
// per (device, kernel, size) as a process may drive several devices. Attribute calls are not
// stream work, so a captured call may make them.
cudaError_t raise_smem_limit(const void* fn, size_t smem) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, size_t> smem_set;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  size_t& set = smem_set[{dev, fn}];
  if (smem <= set) return cudaSuccess;
  e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e == cudaSuccess) set = smem;
  return e;
}

template <class Cfg>
cudaError_t launch_attend(const AttendParams& p, int batch, size_t smem, bf* o, float* lse,
                          cudaStream_t stream) {
  constexpr int D = Cfg::kHeadDim;
  // The fold's storage (FoldLayout) exceeds the default 48 KiB only at the largest C and F.
  const size_t fold_smem = FoldLayout(p.st.num_clusters, p.st.fold_every).bytes;
  cudaError_t e = raise_smem_limit(reinterpret_cast<const void*>(attend_kernel<Cfg>), smem);
  if (e == cudaSuccess)
    e = raise_smem_limit(reinterpret_cast<const void*>(attend_merge_kernel<D>), fold_smem);
  if (e != cudaSuccess) return e;
  SmInfo info;
  e = sm_info(&info);
  if (e != cudaSuccess) return e;
  const int sms = info.sms;
  int per_sm = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, attend_kernel<Cfg>, Cfg::kThreads,
                                                    smem);
  if (e != cudaSuccess) return e;
  // About one wave of CTAs over the batch's sub-requests.
  const int subrequests = batch * p.num_kv_heads;
  const int parts =
      std::min(kMaxAttendParts, std::max(kMinAttendParts, sms * std::max(1, per_sm) / subrequests));
  e = launch_programmatic(attend_kernel<Cfg>, dim3(unsigned(subrequests), unsigned(parts)),
                          dim3(Cfg::kThreads), smem, stream, p);
  if (e != cudaSuccess) return e;
  // Launched programmatically: each attention CTA triggers before its tiles, so the merge
  // launches once every CTA of the grid has run that far (none is left waiting for room), and
  // its launch overlaps the last parts' tiles. Its rows, then a CTA per slot for the index
  // step's commit and the fold.
  const int rows = batch * p.num_q_heads;
  return launch_programmatic(
      attend_merge_kernel<D>, dim3(unsigned(rows + subrequests)), dim3(kAttendMergeWarps * 32),
      fold_smem, stream, static_cast<const float*>(p.part_lse), static_cast<const float*>(p.part_o),
      parts, p.num_kv_heads, p.group, rows, o, lse, p.st, p.seq_lens, p.w.recent, p.page_table,
      p.page_size, p.max_pages_per_seq);
}

}  // namespace

cudaError_t attend_cuda(const bf16* q, const PagedKV& kv, float scale, const Window& w,
                        const IndexState& st, const Router<bf16>& router, const float* inv_freq,
                        const int32_t* selected, int probes, const tactic::Selection& lists,
                        unsigned long long* counters, unsigned long long router_bytes,
                        int num_q_heads, bf16* o, float* lse, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream) {
  const int B = kv.batch, hkv = kv.num_kv_heads, d = kv.head_dim, C = st.num_clusters;
  if ((d != 64 && d != 128) || hkv < 1 || num_q_heads % hkv != 0 ||
      num_q_heads / hkv > tiles::kMaxGroup || B > st.max_batch || hkv != st.num_kv_heads ||
      probes < 1 || probes > C || C > kMaxClustersCuda || !q || !o || !selected || !lists.tokens ||
      !lists.counts || lists.max_tokens < st.max_tokens || !inv_freq ||
      router.num_kv_heads != hkv || router.num_clusters != C || router.head_dim != d ||
      !router.centroids || !router.centroid_norms || !st.step_best || st.fold_every < 0 ||
      st.fold_every > kMaxFold || st.index_every < 1 || st.index_every > kMaxIndexStep)
    return cudaErrorInvalidValue;
  if (B == 0) return cudaSuccess;
  const size_t need = attend_workspace_bytes(B, num_q_heads, hkv, d);
  if (!workspace || workspace_bytes < need) return cudaErrorInvalidValue;
  AttendParams p;
  p.q = reinterpret_cast<const bf*>(q);
  p.k = reinterpret_cast<const bf*>(kv.k);
  p.v = reinterpret_cast<const bf*>(kv.v);
  p.page_table = kv.page_table;
  p.seq_lens = kv.seq_lens;
  p.page_size = kv.page_size;
  p.max_pages_per_seq = kv.max_pages_per_seq;
  p.num_kv_heads = hkv;
  p.group = num_q_heads / hkv;
  p.num_q_heads = num_q_heads;
  p.scale_log2 = scale * tiles::kLog2e;
  p.w = w;
  p.st = st;
  p.selected = selected;
  p.probes = probes;
  p.lists = lists;
  p.counters = counters;
  p.router_bytes = router_bytes;
  p.inv_freq = inv_freq;
  p.centroids = router.centroids;
  p.centroid_norms = router.centroid_norms;
  const size_t states = size_t(B) * hkv * kMaxAttendParts * p.group;
  char* ws = static_cast<char*>(workspace);
  p.part_lse = reinterpret_cast<float*>(ws);
  p.part_o = reinterpret_cast<float*>(ws + align_up(states * sizeof(float)));
  bf* out = reinterpret_cast<bf*>(o);
  return d == 128 ? launch_attend<AttendCfg128>(p, B, attend_smem_bytes<AttendCfg128>(probes, C),
                                                out, lse, stream)
                  : launch_attend<AttendCfg64>(p, B, attend_smem_bytes<AttendCfg64>(probes, C), out,
                                               lse, stream);
}

cudaError_t prepare_cuda(int hidden) {
  // The router's dynamic shared memory: the GEMVs' x rows (up to hidden wide; 16 batch rows
  // in the column-block GEMV) and the route sort (C up to kMaxClustersCuda) may exceed the 48
  // KiB default.
  const int h = std::min(std::max(hidden, 256), kMaxHiddenCuda);
  const int gemv = int(gemv_smem_bytes(h)), nonzero = int(gemv_nonzero_smem_bytes(kNzRows, h));
  using GemvKernel =
      void (*)(const float*, const uint4*, const float*, const float*, float*, int, int, int, int);
  using GemvKernelBf =
      void (*)(const bf*, const uint4*, const float*, const float*, float*, int, int, int, int);
  cudaError_t e = cudaSuccess;
  for (GemvKernel fn :
       {gemv_kernel<float, Bf16Mma, false, 1>, gemv_kernel<float, E4m3Mma, false, 1>})
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, gemv);
  for (GemvKernelBf fn :
       {gemv_kernel<bf, Bf16Mma, true, kGemv1Rb>, gemv_kernel<bf, E4m3Mma, true, kGemv1Rb>})
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, gemv);
  for (const void* fn :
       {reinterpret_cast<const void*>(gemv_nonzero_kernel<Bf16Columns, 1>),
        reinterpret_cast<const void*>(gemv_nonzero_kernel<Bf16Columns, kNzRows / 8>),
        reinterpret_cast<const void*>(gemv_nonzero_kernel<E4m3Columns, 1>),
        reinterpret_cast<const void*>(gemv_nonzero_kernel<E4m3Columns, kNzRows / 8>)})
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, nonzero);
  if (e != cudaSuccess) return e;
  // The route's kernels may ask for up to the device's limit (route_alone_smem_bytes).
  SmInfo info;
  e = sm_info(&info);
  const int optin = info.optin;
  for (bool top32 : {true, false})
    for (bool small_group : {true, false})
      for (RouteMlpKernel fn : {route_mlp_kernel_for<true>(top32, small_group),
                                route_mlp_kernel_for<false>(top32, small_group)})
        if (e == cudaSuccess)
          e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(route_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
}

}  // namespace kvs::kernels::saap
