// SAAP (spec shared/specs/saap.md): asymmetric partitions of the keys. k-means centroids of
// pre-RoPE keys per (layer, kv head) are trained offline; at prefill every key outside the
// dense part (sink + recent window) is assigned to its nearest centroid and the assignments
// become a per-(sequence, kv head) CSR of token ids. At decode a per-query-head MLP maps the
// pre-RoPE query to a distribution over the C clusters; the group's distributions are summed,
// the top-l clusters are taken, and the kv head attends exactly to their members plus the
// dense part (or, with the nearest-centroid router, to the l clusters nearest the group's
// mean pre-RoPE query: the paper's symmetric baseline).
//
// Index state (IndexState), one layout for both backends (host memory for the CPU reference,
// device memory for CUDA), per (sequence b, kv head h) "slot":
//   offsets     [max_batch, Hkv, C + 1] int32: CSR of the tokens [sink, csr_len)
//   members     [max_batch, Hkv, max_tokens] int32 token ids, grouped by cluster, ascending
//               within a cluster
//   assign      [max_batch, Hkv, max_tokens] int32: cluster of token t for t in
//               [sink, indexed_len); tokens [csr_len, indexed_len) are only here (they left
//               the recent window after prefill) and the decode scans them
//   indexed_len, csr_len [max_batch, Hkv] int32
//   member_rows [max_batch, Hkv, max_tokens] int32, CUDA only and optional: the KV page row
//               (page * page_size + t % page_size) of each member, written with the members
//               from the page table of the call that wrote them, so that the attention
//               reads a member's KV row without a round trip through the page table. It
//               holds while the pages of a sequence's indexed tokens stay where they were:
//               pages appended, never moved (SaapConfig::member_rows says how to opt out).
// The fold: once fold_every post-prefill assignments have piled up (indexed_len - csr_len >=
// fold_every), the oldest fold_every of them, tokens [csr_len, csr_len + fold_every), are
// merged into the CSR (each after its cluster's members, so members stay ascending within a
// cluster) and csr_len moves past them. Both backends fold at that condition, checked at
// the end of every decode-time index step, so they keep the same CSR; a decode's scan of
// [csr_len, indexed_len) then never exceeds fold_every tokens however long the generation.
// fold_every 0 never folds.
// Tokens [indexed_len, n) of a sequence of n tokens are attended in full: the recent window
// and the tokens that have left it but are not indexed yet. Nothing is ever unreachable.
//
// Selection for a sequence of n tokens and kv head h (both backends):
//   [0, min(sink, n))  U  {t in [sink, indexed_len) : assign[t] in top-l}  U  [indexed_len, n)
// where prefill sets indexed_len = max(sink, n - recent) and each decode call, after its
// attention, indexes index_step_count(...) tokens from indexed_len on: none until index_every
// tokens have left the window unindexed, then all of them (at most kMaxIndexStep). So the
// index step does its work on one step in index_every (on CUDA, inside the attention's and
// the merge's kernels), and the dense part holds up to index_every more tokens than the
// window (the attention of the step that indexes them still reads them there).
//
// Assignment score of centroid c for a vector x: 2 x.c - |c|^2; its argmax is the nearest
// centroid in L2 and, for the unit-norm centroids of spherical k-means, the largest inner
// product. Ties go to the lowest c. Top-l ranks by score, ties to the lowest cluster id.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/common/bf16.h"
#include "kernels/common/host_device.h"
#include "kernels/common/paged_kv.h"
#include "kernels/tactic/tactic.h"

namespace kvs::kernels::saap {

KVS_HOST_DEVICE float centroid_score(float dot, float centroid_norm2) {
  return 2.0f * dot - centroid_norm2;
}

// The dense part: the first `sink` tokens and the last `recent` ones.
struct Window {
  int sink = 1;
  int recent = 2047;
};

// Tokens one decode-time index step assigns at most.
constexpr int kMaxIndexStep = 32;

// How many tokens the decode-time index step assigns for a sequence of n tokens: the
// pending ones, [indexed_len, n - recent), on the steps where n - recent + phase is a
// multiple of index_every or once index_every of them are pending (at most kMaxIndexStep),
// else none. After the prefill's first such step that is every index_every steps, with
// index_every tokens. phase (IndexState::index_phase, the layer's) puts the layers of a model
// on different steps, so that no token's step pays every layer's index work at once.
KVS_HOST_DEVICE int index_step_count(int n, int recent, int indexed_len, int index_every,
                                     int phase) {
  const int pending = n - recent - indexed_len;
  if (pending <= 0) return 0;
  const int every = index_every > 1 ? index_every : 1;
  if (pending < every && (n - recent + phase) % every != 0) return 0;
  return pending < kMaxIndexStep ? pending : kMaxIndexStep;
}

struct IndexState {
  int32_t* offsets = nullptr;
  int32_t* members = nullptr;
  int32_t* assign = nullptr;
  int32_t* indexed_len = nullptr;
  int32_t* csr_len = nullptr;
  int32_t* member_rows = nullptr;  ///< CUDA, optional (above); null: through the page table
  // CUDA: [max_batch, Hkv, kMaxIndexStep] each key's best centroid so far in a step that
  // indexes (attend_cuda's index step), zero between steps; zeroed by its allocator.
  unsigned long long* step_best = nullptr;
  int max_batch = 0;
  int num_kv_heads = 0;
  int num_clusters = 0;
  int max_tokens = 0;
  int fold_every = 0;   ///< see the fold above; 0 or up to kMaxFold
  int index_every = 1;  ///< see index_step_count; 1 to kMaxIndexStep
  int index_phase = 0;  ///< see index_step_count; 0 to index_every - 1

  KVS_HOST_DEVICE int64_t slot(int b, int h) const { return int64_t(b) * num_kv_heads + h; }
  KVS_HOST_DEVICE int32_t* offsets_of(int b, int h) const {
    return offsets + slot(b, h) * (num_clusters + 1);
  }
  KVS_HOST_DEVICE int32_t* members_of(int b, int h) const {
    return members + slot(b, h) * max_tokens;
  }
  KVS_HOST_DEVICE int32_t* member_rows_of(int b, int h) const {
    return member_rows + slot(b, h) * max_tokens;
  }
  KVS_HOST_DEVICE int32_t* assign_of(int b, int h) const {
    return assign + slot(b, h) * max_tokens;
  }
};

// Largest fold_every (the CUDA fold keeps the folded tokens' clusters and each member's shift,
// up to fold_every, in one CTA's shared memory, the shift in 16 bits).
constexpr int kMaxFold = 4096;

// Post-prefill assignments the CUDA attention's scan part reads per round (one CTA's threads
// times its loads in flight); a fold_every above it costs the steps past it a round more.
constexpr int kAttendScanRound = 1024;

KVS_HOST_DEVICE bool fold_due(int fold_every, int indexed_len, int csr_len) {
  return fold_every > 0 && indexed_len - csr_len >= fold_every;
}

// One layer's router: centroids and the query MLP with batch norm folded into the first
// linear layer: p = softmax(w2 relu(w1 q + b1) + b2). W is float (CPU reference, [heads,
// rows, K] as the shapes below say) or bf16 (CUDA: w1 in the tensor-core GEMV's fragment
// order, pack_mma_rows; w2 in that order or in column blocks, w2_column_blocks).
template <class W>
struct Router {
  const float* centroids = nullptr;       ///< [Hkv, C, d]
  const float* centroid_norms = nullptr;  ///< [Hkv, C] |c|^2
  const W* w1 = nullptr;                  ///< [Hq, hidden, d]
  const float* b1 = nullptr;              ///< [Hq, hidden]
  const W* w2 = nullptr;                  ///< [Hq, C, hidden]
  const float* b2 = nullptr;              ///< [Hq, C]
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int hidden = 0;
  int num_clusters = 0;
  bool use_mlp = true;  ///< false: nearest centroids of the group's mean pre-RoPE query
  /// CUDA with fp8 weights (SaapConfig::router_weights): w1 and w2 are null, and the MLP's
  /// weights are these e4m3 rows (quantize_rows_e4m3, in the orders of the bf16 ones) with
  /// their scales.
  const uint8_t* w1_e4m3 = nullptr;  ///< [Hq, hidden, d]
  const float* w1_scale = nullptr;   ///< [Hq, hidden]
  const uint8_t* w2_e4m3 = nullptr;  ///< [Hq, C, hidden]
  const float* w2_scale = nullptr;   ///< [Hq, C]
  /// CUDA: w2 (either format) in column blocks (pack_column_blocks), read by the GEMV that
  /// skips zero hidden units; false: in pack_mma_rows' order. The engine takes column blocks
  /// when max_batch is 1: at batch 1 about half of the hidden layer is zero, while a batch's
  /// union of nonzero units is nearly all of it, and the fragment order streams that faster
  /// (docs/gpu.md).
  bool w2_column_blocks = false;

  int group_size() const { return num_q_heads / num_kv_heads; }
};

// The CUDA router's weight layout. Its GEMVs run on the tensor cores (mma m16n8k16: 16
// weight rows x 16 columns by 16 columns x 8 batch rows), and each lane loads its A
// fragments as one 16-byte word: one 16 x 16 tile in bf16, two consecutive ones in e4m3. So
// a matrix [heads, rows, K] is stored as [heads, rows / 16, K / kc, 32 lanes, 16 bytes]
// (kc = 16 for bf16, 32 for e4m3; rows and K rounded up, the padding zero), lane g * 4 + c
// holding rows g and g + 8 at columns 2c, 2c + 1 and 2c + 8, 2c + 9 of each of its tiles
// (ptx.cuh has the fragment layout). mma_rows_bytes gives the size.
size_t mma_rows_bytes(int heads, int rows, int K, bool e4m3);
void pack_mma_rows(const float* w, int heads, int rows, int K, bf16* out);
void pack_mma_rows_e4m3(const uint8_t* q, int heads, int rows, int K, uint8_t* out);

// The layout of the MLP's second matrix (w2, [heads, C, hidden]), whose input is a ReLU:
// about half of a query's hidden units are zero (0.44-0.51 on kvs-tiny-a's trained router),
// and their columns of w2 need not be read. So the matrix is stored in blocks of
// kColumnBlock rows, each block column by column: [heads, ceil(rows / 64), K, 64] (rows
// padded with zeros), one hidden unit's weights for the block's 64 outputs contiguous
// (64 bytes in e4m3: two DRAM sectors). The CUDA GEMV gathers the columns of the hidden
// units that are nonzero in any of its batch rows (docs/gpu.md). Inside a column, position
// i holds block row column_block_row(i): the 8 positions 8g .. 8g + 7 that a lane loads are
// rows g, g + 8, .., g + 56, the rows of its mma A fragments across the block's four m-tiles.
constexpr int kColumnBlock = 64;
constexpr int column_block_row(int i) { return i % 8 * 8 + i / 8; }
size_t column_blocks_bytes(int heads, int rows, int K, bool e4m3);
void pack_column_blocks(const float* w, int heads, int rows, int K, bf16* out);
void pack_column_blocks_e4m3(const uint8_t* q, int heads, int rows, int K, uint8_t* out);

// fp8 router weights: each row of K weights (one output of one head) becomes K e4m3 values
// q and a float scale, w = scale * e4m3(q), by the rule of kernels/common/e4m3.h. dequantized gets
// the weights the CUDA kernel multiplies with, so that the CPU reference routes with the same
// weights. Halves the bytes of the batch-1 router, which streams its weights. Throws
// std::invalid_argument naming the row when a weight is not finite.
void quantize_rows_e4m3(const float* w, int64_t rows, int K, uint8_t* q, float* scale,
                        float* dequantized);

// ---- CPU reference ------------------------------------------------------------------------

// The nearest centroid of x (d values) among C centroids [C, d] with norms |c|^2 [C]; fp64.
// -1 when no centroid scores a number at least -FLT_MAX (a NaN or inf in x): such a key gets
// no cluster, here and on the GPU, and stays out of the CSR (attended only in the dense window).
int nearest_centroid_cpu(const float* x, const float* centroids, const float* norms, int C, int d);

// The keys of a prefill that got no cluster (nearest_centroid_cpu's -1): how many, and the
// first as (sequence b, kv head h, token t), for the engine's error.
struct Unassigned {
  int count = 0;
  int b = -1, h = -1, t = -1;
};

// Key t of (b, h) taken back before RoPE (inverse rotation at position t, then rounded to
// bf16 as rope_cuda rounds it): out gets d values.
void deroped_key_cpu(const PagedKV& kv, int b, int h, int t, const float* inv_freq, float* out);

// Prefill of slot (b, h) from the first n = kv.seq_lens[b] tokens: assigns [sink, n - recent)
// and builds the CSR (replacing what the slot held). Returns the keys that got no cluster.
Unassigned index_prefill_cpu(const PagedKV& kv, int b, int h, const float* inv_freq,
                             const Window& w, const Router<float>& router, const IndexState& state);

// Decode-time indexing of slot (b, h), after the step's attention: assigns the
// index_step_count(...) tokens from indexed_len on (as the GPU does), then folds when
// fold_due. Returns whether it indexed any.
bool index_step_cpu(const PagedKV& kv, int b, int h, const float* inv_freq, const Window& w,
                    const Router<float>& router, const IndexState& state);

// The fold of slot (b, h) (see the header comment), whether or not it is due.
void fold_cpu(int b, int h, const IndexState& state);

// The MLP's distribution for query head `q_head` (its pre-RoPE query q, d values): probs [C].
void mlp_probs_cpu(const Router<float>& router, int q_head, const float* q, double* probs);

// Cluster scores of kv head h from its group's pre-RoPE queries q_group [g, d]: the summed
// MLP distributions, or the nearest-centroid score of the group's mean query. scores [C].
void route_scores_cpu(const Router<float>& router, int kv_head, const float* q_group,
                      double* scores);

// The l best clusters by score (descending, ties to the lowest id). l <= C.
void top_clusters_cpu(const double* scores, int C, int l, int32_t* out);

// The tokens slot (b, h) attends with the clusters `clusters` [l] selected (see the header
// comment): sink, the selected clusters' members (CSR then the scanned assignments), the
// unindexed tail. Not sorted.
std::vector<int32_t> selected_tokens_cpu(const PagedKV& kv, int b, int h, const Window& w,
                                         const IndexState& state, const int32_t* clusters, int l);

// ---- CUDA ---------------------------------------------------------------------------------

// Prefill of every (b < kv.batch, h), replacing what the slots held. seq_lens_host are the
// lengths of kv.seq_lens on the host; inv_freq (d/2) is a device array. The workspace is
// caller-owned device memory of index_prefill_workspace_bytes(max over b of seq_lens_host[b]).
// Keys are gathered and de-RoPE'd with rope_cuda, assigned by a tiled kernel, and sorted
// into the CSR with a stable radix sort (members ascending within a cluster, as on the CPU).
// Keys that get no cluster (-1) sort after every cluster and stay out of it. With unassigned
// given, counts them and synchronizes the stream to return that count and the first of them
// (the first sequence, then kv head, then token).
size_t index_prefill_workspace_bytes(int max_len, int num_kv_heads, int head_dim);
cudaError_t index_prefill_cuda(const PagedKV& kv, const int32_t* seq_lens_host,
                               const float* inv_freq, const Window& w, const Router<bf16>& router,
                               const IndexState& state, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream, Unassigned* unassigned = nullptr);

// Decode step, graph-capturable (fixed grids, device-side lengths, no host sync), two calls
// in this order:
// 1. route (decode_select_cuda): selected [batch * Hkv, l] cluster ids from q_pre [batch, Hq,
//    d], by the MLP (mlp_logits_cuda) or the nearest centroids, then the top l. Workspace:
//    route_workspace_bytes(max_batch, ...).
// 2. attend (attend_cuda, below), which also does the decode half of the index: for every
//    (b < kv.batch, h) with index_step_count(...) > 0 it de-RoPEs those tokens' keys and
//    assigns them, once its attention has read the index, then folds where fold_due. A step
//    therefore attends the tokens it indexes through the window, as every step before it did,
//    and the next step through their clusters.
// Each returns cudaErrorInvalidValue, before any launch, on shapes it cannot serve (among them
// Hkv < 1 or Hq not a multiple of Hkv).
size_t route_workspace_bytes(int max_batch, int num_q_heads, int hidden, int num_clusters);

// The router MLP's logits [batch, Hq, C] (before the softmax) for q_pre [batch, Hq, d]: the
// route's two GEMVs, hidden [batch, Hq, router.hidden] = relu(w1 q_pre + b1) and logits = w2
// hidden + b2, with x rounded to the weights' 16-bit type (fp16 for e4m3 weights, saturated;
// bf16) and fp32 accumulation. The second GEMV reads only the columns of w2 whose hidden
// unit is nonzero in some row of its pass of up to 16 batch rows when w2 is in column blocks
// (router.w2_column_blocks), and all of w2 otherwise. Graph-capturable; returns
// cudaErrorInvalidValue, before any launch, on shapes it cannot serve.
cudaError_t mlp_logits_cuda(const bf16* q_pre, const Router<bf16>& router, int batch, float* hidden,
                            float* logits, cudaStream_t stream);
// index (optional): the layer's index that attend_cuda reads next. With the MLP router, the
// route then requests the members of the clusters it selects into L2.
cudaError_t decode_select_cuda(const bf16* q_pre, int batch, const Router<bf16>& router, int probes,
                               int32_t* selected, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream, const IndexState* index = nullptr);

// The dynamic shared memory that keeps every attention CTA off the SMs of the route's
// route_ctas CTAs (an SM of smem_per_sm bytes, reserved_per_cta more per resident CTA, at most
// max_per_cta a CTA; attend_smem an attention CTA's), or 0 where the route should not ask for
// it. A route CTA that shares its SM with an attention part runs beside that part's tile loop
// (the window parts attend while the route runs), and the member parts wait for the slowest
// route CTA: alone on their SMs the 8 route CTAs of a batch-1 Llama-3 step end sooner
// (docs/gpu.md). The price is the attention CTAs those SMs would have held, which get resident
// only as the route ends: worth it only while the route's CTAs are few, at most one SM in 16
// (at batch 8, 64 route CTAs on 132 SMs, the step lost 3 %).
inline size_t route_alone_smem_bytes(int route_ctas, int sms, size_t smem_per_sm,
                                     size_t reserved_per_cta, size_t max_per_cta,
                                     size_t attend_smem) {
  if (route_ctas < 1 || 16 * int64_t(route_ctas) > sms) return 0;
  // No attention CTA fits beside the route's anyway.
  if (attend_smem + 2 * reserved_per_cta >= smem_per_sm) return 0;
  // The route's and an attention CTA's, with their reservations, just over the SM's.
  const size_t alone = smem_per_sm - 2 * reserved_per_cta - attend_smem + 128;
  return alone <= max_per_cta ? alone : 0;
}

// 2. attend (directly after decode_select_cuda on the same stream, nothing between): the
//    token lists and the attention in one kernel, then a merge kernel. It is launched
//    programmatically behind the route and reads q, the lengths, the page table, the KV and
//    the index before it waits for the route's selection, so q must be written before
//    decode_select_cuda. One CTA per (sub-request (b, h), part):
//    the parts split the selected clusters' members and the window (sink + unindexed tail)
//    evenly, the last part takes the post-prefill assignments of the chosen clusters; each
//    resolves its tokens to KV rows in shared memory and attends them, and a merge kernel
//    combines the parts into o (bf16, [B, Hq, D]) and lse ([B, Hq], may be null). The token
//    lists (lists.tokens, [sink | members | tail | hits]; lists.rows unused) and counts are
//    written for the stats. When counters is non-null: counters[0] += rows attended,
//    counters[1] += router_bytes (the router's reads per (b, h), the caller's figure) plus the
//    index reads (CSR offsets of the probed clusters and the scanned post-prefill
//    assignments). q is post-RoPE; head_dim 64 or 128. Workspace:
//    attend_workspace_bytes(max_batch, ...).
//    The index step (saap.cu, "decode: indexing"): the parts score shares of router's
//    centroids against the keys to index (de-RoPE'd with inv_freq, d/2 floats on the device)
//    into state.step_best, and a CTA per slot of the merge kernel commits them and folds. The
//    router must be the index's: the same kv heads, C and head_dim.
size_t attend_workspace_bytes(int max_batch, int num_q_heads, int num_kv_heads, int head_dim);

// How attend_cuda splits a slot's shared_parts CTAs (all but the scan part) between the
// members and the window (W rows: the sink and the unindexed tail): returns the member parts,
// the window gets the rest. The split follows the sizes, with the members estimated from the
// index alone (probes clusters of the CSR's average size, in_csr / C tokens), so that the
// window parts know their rows before the route has chosen the clusters, and a window row
// weighted as kWindowRowWeightTenths / 10 member rows (below). The estimate is at
// least one member while the CSR holds any (in_csr > 0): the clusters the route chooses may
// have members however small the average, and they need a part. Each side that has rows gets
// at least one part.
//
// Why a window row weighs more: the window parts resolve and attend their rows before the
// route ends, while the router's GEMVs and the route leave DRAM idle, so each goes at one
// CTA's streaming rate and its time follows its rows; the member parts start only after the
// route and their own round trips, all together, and share DRAM, so their end follows the
// members' total more than their count. Fewer, longer member parts and more, shorter window
// parts end the step sooner, up to a point. 128K batch 1 on an H200 (docs/gpu.md, "the
// attention's parts split by weighted rows"), the step that does not index, against weight 1
// (32.1 us):
// 0.25 39.9, 0.6 34.9, 1.3 31.8-31.9, 1.7 31.7-31.8, 2.5 32.0-32.1 us; at batch 8 2.5 left a
// slot's three shared parts one member part (99.5 -> 127 us), 1.7 changes nothing there.
constexpr int kWindowRowWeightTenths = 17;
KVS_HOST_DEVICE int attend_member_parts(int shared_parts, int probes, int num_clusters, int in_csr,
                                        int W) {
  if (in_csr <= 0) return 0;
  if (W <= 0) return shared_parts;
  int64_t m = int64_t(probes) * in_csr / num_clusters;
  if (m < 1) m = 1;
  const int64_t w = int64_t(W) * kWindowRowWeightTenths / 10;  // >= 1: W >= 1
  const int64_t pm = (int64_t(shared_parts) * m + (m + w) / 2) / (m + w);
  return pm < 1 ? 1 : pm > shared_parts - 1 ? shared_parts - 1 : int(pm);
}
cudaError_t attend_cuda(const bf16* q, const PagedKV& kv, float scale, const Window& w,
                        const IndexState& st, const Router<bf16>& router, const float* inv_freq,
                        const int32_t* selected, int probes, const tactic::Selection& lists,
                        unsigned long long* counters, unsigned long long router_bytes,
                        int num_q_heads, bf16* o, float* lse, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream);

// Sets the router kernels' shared-memory limits for MLP width `hidden`, once per
// process; engines call it at construction so that a captured decode step does nothing but
// launches.
cudaError_t prepare_cuda(int hidden);

// Largest C the CUDA top-l supports (one CTA sorts the C scores in shared memory).
constexpr int kMaxClustersCuda = 4096;

// Largest MLP width the CUDA router supports: its second GEMV stages up to 16 batch rows of
// the hidden layer in shared memory.
constexpr int kMaxHiddenCuda = 4096;

}  // namespace kvs::kernels::saap
