// CUDA split-KV ("flash decoding") dense decode over the paged bf16 KV cache.
//
// Work split. One CTA handles one work item (sequence b, chunk of its tokens) for one kv
// head (blockIdx.y) and all `group` query heads of that kv head, so each K/V row is read
// from memory once per group. The chunk length is chosen on the device from seq_lens: every
// warp computes the same plan from the lengths on its own (find_work_item), so no separate
// plan launch or block barrier precedes the first loads and the call is graph-safe with
// seq_lens changing between replays. The chunk length spreads the total tokens over one
// wave of CTAs (SMs x CTAs per SM), partial last chunks included (plan_chunk), so that
// batch 1 fills the chip and large batches do not split needlessly. While the lengths load,
// the grid prefetches the page table into L2.
//
// Inside a CTA, 4 warps (two CTAs per SM) attend the chunk through the shared tile loop
// (kernels/common/attend_tiles.cuh: per-warp cp.async rings, bf16 mma, online softmax), then
// merge their states once per head row (merge_warp_states).
//
// A chunk's result is a state (o, lse). A sequence with a single chunk is written straight
// to o / lse; otherwise the CTA writes its state to the workspace and the merge kernel,
// launched right behind with programmatic dependent launch, combines the states through
// merge_states.cuh. It derives the same plan from seq_lens before it waits, so that after
// the decode grid ends it only loads the states. docs/gpu.md has the measured timeline.
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

#include "kernels/common/attend_tiles.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/merge_states.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/dense/dense_decode.h"
#include "kernels/dense/dense_plan.h"

namespace kvs::kernels {
namespace {

using tiles::kMaxGroup;
// Chunks per (sequence set, kv head) are capped so that the workspace size depends only on
// (max_batch, num_q_heads, head_dim): items <= kMaxChunksPerHead + batch (see plan_chunk).
constexpr int kMaxChunksPerHead = 512;
constexpr int kMergeWarps = 8;

struct WorkspaceLayout {
  size_t lse_offset, o_offset, total;
};

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

WorkspaceLayout workspace_layout(int max_batch, int num_q_heads, int head_dim) {
  const size_t items = size_t(kMaxChunksPerHead) + size_t(max_batch);
  WorkspaceLayout w;
  w.lse_offset = 0;
  w.o_offset = w.lse_offset + align_up(sizeof(float) * items * num_q_heads, 256);
  w.total = w.o_offset + align_up(sizeof(float) * items * num_q_heads * head_dim, 256);
  return w;
}

struct DecodeParams {
  const __nv_bfloat16* q;
  tiles::KvSource kv;
  const int32_t* seq_lens;
  int batch;
  int num_q_heads;
  int group;
  int chunks_per_head;  // target chunks per kv head over the whole batch
  __nv_bfloat16* o;
  float* lse;          // may be null
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

// The plan, which both kernels derive from seq_lens on their own (whole warps; every lane
// gets the same answer), so that no plan launch or stored plan sits between them.

// A sequence's chunk count. An empty sequence gets one item (it writes o = 0, lse = -inf),
// so every sequence has a chunk 0.
__device__ __forceinline__ int chunks_of(int len, int chunk) {
  return len > 0 ? (len - 1) / chunk + 1 : 1;
}

// x rounded up to a multiple of align, a power of two (kChunkAlign: warps x tile tokens).
__device__ __forceinline__ int64_t round_up(int64_t x, int align) {
  return (x + align - 1) & -int64_t(align);
}

// Tokens per chunk, a whole number of rounds of tiles (align), so that the batch's items
// fill one wave (chunks_per_head per kv head). The first guess is the batch's total /
// chunks_per_head. With several sequences, each sequence's last chunk is partial, so the
// guess can need up to `batch` more items than a wave holds; those ran as a second wave
// (128K batch 2: 34 items per head for 33 slots, 11 % slower). So the chunk grows by the
// overshoot until the items fit, or for at most a few rounds. Either way
// sum_b max(1, ceil(len_b / chunk)) <= total / chunk + batch <= chunks_per_head + batch,
// which bounds the item count (grid.x) and the workspace. The arithmetic counts rounds of
// align tokens, in 32 bits (dense_plan.h).
__device__ int plan_chunk(const int32_t* seq_lens, int batch, int chunks_per_head, int align,
                          int lane) {
  const int my_len = lane < batch ? seq_lens[lane] : 0;  // kept for the fit check
  int64_t total = my_len;
  for (int i = lane + 32; i < batch; i += 32) total += seq_lens[i];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
  const int shift = __ffs(align) - 1;  // align is a power of two
  const int cap = dense_plan::kMaxChunkTokens >> shift;
  int chunk = dense_plan::rounds_per_chunk((total + align - 1) >> shift, chunks_per_head, cap);
  // One sequence: ceil(len / chunk) <= chunks_per_head.
  if (batch == 1) return chunk << shift;
  for (int round = 0; round < 4; ++round) {
    const int tokens = chunk << shift;
    int items = lane < batch ? chunks_of(my_len, tokens) : 0;
    for (int i = lane + 32; i < batch; i += 32) items += chunks_of(seq_lens[i], tokens);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) items += __shfl_xor_sync(0xffffffffu, items, off);
    // Done when the items fit, or when every sequence is one chunk already.
    if (items <= chunks_per_head || items == batch) break;
    chunk = dense_plan::rounds_per_chunk(int64_t(chunk) * items, chunks_per_head, cap);
  }
  return chunk << shift;
}

// A sequence's own chunk length: its plan_chunk(...) share of items, cut equally (up to a
// round of tiles), so that its last chunk is not a remainder. The item count stays
// chunks_of(len, chunk), as the merge kernel counts it, and no chunk grows past `chunk`.
// (Cut at `chunk`, 32K batch 8 ran CTAs of 9728 and 3584 tokens, and the long ones set the
// time; cut equally, every CTA gets 8192.)
__device__ __forceinline__ int seq_chunk(int len, int chunk, int align) {
  const int n = chunks_of(len, chunk);
  return len > 0 ? int(round_up((len + n - 1) / n, align)) : chunk;
}

// Maps work item `item` to its sequence and token range (items are numbered sequence by
// sequence).
__device__ WorkItem find_work_item(const DecodeParams& p, int align, int item, int lane) {
  const int chunk = plan_chunk(p.seq_lens, p.batch, p.chunks_per_head, align, lane);
  WorkItem w{};
  w.valid = false;
  int base = 0;  // items of the sequences before this round of 32
  for (int i0 = 0; i0 < p.batch; i0 += 32) {
    const int i = i0 + lane;
    const int len = i < p.batch ? p.seq_lens[i] : 0;
    const int n = i < p.batch ? chunks_of(len, chunk) : 0;
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
      const int chunk_b = seq_chunk(len_b, chunk, align);
      const int64_t begin = int64_t(item - w.first_item) * chunk_b;
      w.begin = int(begin);
      w.end = int(begin + chunk_b < len_b ? begin + chunk_b : len_b);
      return w;
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  return w;
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads)
    dense_decode_kernel(const __grid_constant__ DecodeParams p) {
  constexpr int D = Cfg::kHeadDim;
  extern __shared__ uint4 smem[];

  // Let the merge kernel get resident now; it waits (griddepcontrol.wait) for this whole
  // grid to finish and flush before reading anything.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  const int lane = threadIdx.x % 32;
  const int kvh = blockIdx.y;
  // While the lengths come in: an L2 prefetch of the page table, one 128-byte line per warp
  // of the grid from its start (the whole table at batch 1 up to ~500K tokens), so that the
  // chunk's first page lookups, which wait for the plan, hit L2 instead of going to DRAM.
  const int64_t table_line =
      (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * Cfg::kWarps + threadIdx.x / 32;
  if (lane == 0 && table_line * 32 < int64_t(p.batch) * p.kv.max_pages_per_seq)
    ptx::prefetch_l2(p.kv.page_table + table_line * 32);
  const WorkItem w = find_work_item(p, Cfg::kChunkAlign, blockIdx.x, lane);
  if (!w.valid) return;  // the same for every thread of the CTA

  const int64_t group_row = int64_t(w.b) * p.num_q_heads + kvh * p.group;
  uint32_t qa[D / 16][2];
  tiles::load_query_fragments<D>(p.q + group_row * D, p.group, lane, qa);
  tiles::attend_tiles<Cfg, false>(p.kv, w.b, kvh, w.begin, w.end, 0, qa, smem);
  __syncthreads();

  // The CTA's state per (head, dim): straight to o / lse for a single-chunk sequence, else
  // to the workspace for the merge kernel.
  const bool direct = w.num_items == 1;
  tiles::merge_warp_states<Cfg>(smem, p.group, [&](int hg, int d, float4 o, float lse) {
    const int64_t row = group_row + hg;
    if (direct) {
      const __nv_bfloat162 lo = __floats2bfloat162_rn(o.x, o.y),
                           hi = __floats2bfloat162_rn(o.z, o.w);
      uint2 packed;
      packed.x = *reinterpret_cast<const uint32_t*>(&lo);
      packed.y = *reinterpret_cast<const uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(p.o + row * D + d) = packed;
      if (d == 0 && p.lse) p.lse[row] = lse;
    } else {
      const int64_t prow = int64_t(blockIdx.x) * p.num_q_heads + kvh * p.group + hg;
      *reinterpret_cast<float4*>(p.partial_o + prow * D + d) = o;
      if (d == 0) p.partial_lse[prow] = lse;
    }
  });
}

struct MergeParams {
  const int32_t* seq_lens;
  int batch;
  int chunks_per_head;
  int align;  // the decode kernel's kChunkAlign, a power of two
  const float* partial_lse;
  const float* partial_o;
  int num_q_heads;
  __nv_bfloat16* o;
  float* lse;
};

// One CTA per (sequence, query head) row. Before the wait (while the decode grid runs) each
// warp derives the row's chunks from seq_lens. After it, merge_row_states (merge_states.cuh)
// combines the row's chunk states: the warps split them, each loading a batch at once and
// folding it with independent exponentials, then fold their accumulators in warp order. So
// a row costs one memory round trip after the wait, not one per chunk.
template <int D>
__global__ void __launch_bounds__(kMergeWarps * 32)
    dense_merge_kernel(const __grid_constant__ MergeParams p) {
  __shared__ WarpAccumulators<kMergeWarps, D> warp_acc;
  const int row = blockIdx.x;
  const int lane = threadIdx.x % 32;
  const int b = row / p.num_q_heads, h = row % p.num_q_heads;
  // seq_lens is not written by the decode kernel: the plan is read before the wait.
  const int chunk = plan_chunk(p.seq_lens, p.batch, p.chunks_per_head, p.align, lane);
  int first_item = 0;  // the chunks of the sequences before b
  for (int i = lane; i < b; i += 32) first_item += chunks_of(p.seq_lens[i], chunk);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    first_item += __shfl_xor_sync(0xffffffffu, first_item, off);
  const int num_items = chunks_of(p.seq_lens[b], chunk);
  // Everything below reads what dense_decode_kernel wrote. Every CTA waits, the ones with
  // nothing to merge included, so that this grid never ends before the decode grid.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (num_items <= 1) return;  // written directly by the decode kernel

  merge_row_states<D, kMergeWarps>(
      p.partial_lse, p.partial_o, int64_t(first_item) * p.num_q_heads + h, p.num_q_heads, num_items,
      warp_acc, p.o + int64_t(row) * D, p.lse ? p.lse + row : nullptr);
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
  using Cfg = tiles::TileConfig<D, Warps, Stages>;
  static_assert((Cfg::kChunkAlign & (Cfg::kChunkAlign - 1)) == 0,
                "the plan rounds chunks with masks and shifts: kChunkAlign must be a power of two");
  return {dense_decode_kernel<Cfg>, Warps, int(Cfg::smem_bytes())};
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
  p.kv = tiles::KvSource{reinterpret_cast<const __nv_bfloat16*>(kv.k),
                         reinterpret_cast<const __nv_bfloat16*>(kv.v),
                         kv.page_table,
                         kv.page_size,
                         kv.num_kv_heads,
                         kv.max_pages_per_seq,
                         scale * tiles::kLog2e};
  p.seq_lens = kv.seq_lens;
  p.batch = kv.batch;
  p.num_q_heads = num_q_heads;
  p.group = num_q_heads / kv.num_kv_heads;
  p.chunks_per_head = chunks_per_head;
  p.o = reinterpret_cast<__nv_bfloat16*>(o);
  p.lse = lse;
  p.partial_lse = reinterpret_cast<float*>(ws + layout.lse_offset);
  p.partial_o = reinterpret_cast<float*>(ws + layout.o_offset);

  const dim3 grid(unsigned(chunks_per_head + kv.batch), unsigned(kv.num_kv_heads));
  kernel.fn<<<grid, kernel.warps * 32, kernel.smem_bytes, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;

  MergeParams mp;
  mp.seq_lens = kv.seq_lens;
  mp.batch = kv.batch;
  mp.chunks_per_head = chunks_per_head;
  mp.align = kernel.warps * tiles::kTile;
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
