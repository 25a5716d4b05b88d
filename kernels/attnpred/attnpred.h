// AttentionPredictor (spec shared/specs/attnpred.md): a tiny CNN forecasts the next decode
// step's block-pooled attention row of every query head from the last `history` rows; the
// top-K predicted blocks plus sink and recent tokens are attended.
//
// The CNN (paper Table 5, 4,833 fp32 parameters, one model for every layer and head):
//   Conv2d 1->16 3x3 pad 1, ReLU, Conv2d 16->32 3x3 pad 1, ReLU, mean over time, Conv1d 32->1 k1
// over an input [H rows (time, oldest first), W columns (key blocks)]; output [W].
// Parameters are packed in PyTorch's order (conv1.weight [16,1,3,3], conv1.bias, conv2.weight
// [32,16,3,3], conv2.bias, conv3.weight [1,32,1], conv3.bias) at the kParam* offsets.
//
// Numerics, the same definition in both backends (the paper's own inference runs the CNN in
// fp16):
//   conv1: fp16 inputs times fp16 weights (exact products), summed in fp32 from the bias;
//          relu; rounded to fp16;
//   conv2: fp16 weights times those fp16 values, summed in fp32 from the bias. CUDA sums both
//          convs on the tensor cores, the CPU in (input channel, dy, dx) order: they differ by
//          fp32 rounding;
//   s_r[col] = sum over conv2 channels of w3[c] * relu(conv2[c, r, col]) (fp32);
//   y[col]   = b3 + (S[col] / 2^32) / H in double, rounded to fp32, where S is the exact
//              64-bit sum over the rows of each s_r[col] * 2^32 rounded to an integer.
// (The 1 x 1 conv3 is linear, so taking it per row before the time mean is the same CNN; it
// lets the CUDA predictor keep each row's s and recompute only the rows a step changes. The
// fixed-point time sum is exact whatever the order, so it can be kept as a running sum;
// 2^-32 is far below fp32's resolution at the scores' size.) The CUDA results are
// deterministic, and the incremental predictor equals its own full recompute bit for bit.
//
// History (per layer): fp32 rows [max_batch, heads, history, max_blocks], a ring over time per
// (sequence, head), where the heads are the query heads or, grouped (HistoryState::group), the
// kv heads; count[b] rows appended since the sequence's prefill. Logical row i
// (0 = oldest, history - 1 = newest) is ring slot (count - history + i) mod history, or a row of
// zeros while count - history + i < 0 (a short history is zero-padded in time, as the paper
// zero-pads short rows in width). Columns past a row's own context are 0.
//
// Selection for a step whose sequence has n tokens: token t < n is attended iff
//   t < sink  or  t >= n - recent  or  block_flags[t / block]
// (attended_token()). block_flags hold the union over a kv head's query heads of each head's
// top-K predicted blocks among the candidates [sink / block, candidate_end(n_hist)) of the
// history; n_hist is the length the newest history row covered. The CNN runs on the candidate slice
// alone, zero-padded at its edges, exactly as it was trained (train/attnpred_trainer.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/common/bf16.h"
#include "kernels/common/host_device.h"
#include "kernels/common/paged_kv.h"
#include "kernels/tactic/tactic.h"

namespace kvs::kernels::attnpred {

constexpr int kConv1Channels = 16;
constexpr int kConv2Channels = 32;
constexpr int kParamW1 = 0;                                               // [16, 1, 3, 3]
constexpr int kParamB1 = kParamW1 + kConv1Channels * 9;                   // [16]
constexpr int kParamW2 = kParamB1 + kConv1Channels;                       // [32, 16, 3, 3]
constexpr int kParamB2 = kParamW2 + kConv2Channels * kConv1Channels * 9;  // [32]
constexpr int kParamW3 = kParamB2 + kConv2Channels;                       // [1, 32, 1]
constexpr int kParamB3 = kParamW3 + kConv2Channels;                       // [1]
constexpr int kParamCount = kParamB3 + 1;                                 // 4,833
static_assert(kParamCount == 4833, "the paper's CNN has 4,833 parameters");

struct Geometry {
  int history = 64;  ///< H: rows the CNN sees
  int block = 16;    ///< b: keys per pooled block
  int sink = 64;     ///< S: first tokens always attended (a multiple of block)
  int recent = 64;   ///< R: last tokens always attended (a multiple of block)

  KVS_HOST_DEVICE int num_blocks(int tokens) const { return (tokens + block - 1) / block; }
  KVS_HOST_DEVICE int candidate_begin() const { return sink / block; }
  // Candidate columns end (exclusive) for a history whose newest row covered n_hist tokens:
  // every block with a token before the next step's recent window [n_hist + 1 - recent, ...),
  // so candidates and recent tokens cover the whole next context (the paper's code slices at
  // ceil(n_hist / block) - recent / block, one block short when n_hist is a multiple of the
  // block). <= candidate_begin() means no candidates.
  KVS_HOST_DEVICE int candidate_end(int n_hist) const {
    return num_blocks(n_hist + 1) - recent / block;
  }
  KVS_HOST_DEVICE bool attended_token(int t, int n, const uint8_t* block_flags) const {
    return t < sink || t >= n - recent || block_flags[t / block] != 0;
  }
};

// Throws std::invalid_argument naming the field unless history >= 1, block >= 1, and sink
// and recent are non-negative multiples of block.
void validate(const Geometry& g);

struct HistoryState {
  float* rows = nullptr;      ///< [max_batch, num_heads, history, max_blocks]
  int32_t* count = nullptr;   ///< [max_batch] rows appended since prefill
  int32_t* tokens = nullptr;  ///< [max_batch] context length the newest row covered
  int max_batch = 0;
  int num_heads = 0;  ///< histories per sequence: query heads / group
  int history = 0;
  int max_blocks = 0;
  /// Query heads per history: 1, a history (and a prediction) per query head; the kv group
  /// size, one per kv head, whose row is the largest of its query heads' pooled probabilities.
  int group = 1;

  KVS_HOST_DEVICE float* slot(int b, int h, int s) const {
    return rows + ((int64_t(b) * num_heads + h) * history + s) * int64_t(max_blocks);
  }
  // Logical row i of (b, h) for a ring that has seen `appended` rows; nullptr: a zero row.
  KVS_HOST_DEVICE const float* logical_row(int b, int h, int i, int appended) const {
    const int r = appended - history + i;
    return r < 0 ? nullptr : slot(b, h, r % history);
  }
};

// ---- CPU reference ------------------------------------------------------------------------

// y [n, W] = CNN(x [n, H, W]) for n independent inputs (contiguous, fp32).
void cnn_forward_cpu(const float* params, const float* x, int n, int H, int W, float* y);

// Gathers the CNN input of (b, h) from history: the candidate slice [c0, c1) of its H
// logical rows into x [H, c1 - c0].
void gather_input_cpu(const HistoryState& hist, int b, int h, int c0, int c1, float* x);

// Appends one pooled row (num_blocks values; the rest of the slot is zeroed) to (b, h).
// Does not touch count: the caller advances it once per sequence after all heads.
void append_row_cpu(const HistoryState& hist, int b, int h, const float* pooled, int num_blocks);

// Top-k of scores[0, count) by (score descending, index ascending): flags[offset + j] = 1 for
// every chosen j (existing 1s are kept, so calling it for each head of a group gives the
// union). k >= count selects everything.
void select_top_blocks_cpu(const float* scores, int count, int k, int offset, uint8_t* flags);

// How a KeyCopy holds a key (AttnPredConfig::calibration_keys).
enum class KeyFormat : uint8_t {
  E4m3,  ///< d e4m3 values and a float scale (kernels/common/e4m3.h)
  Int4,  ///< d int4 values, two a byte (the lower dim in the low nibble), and a float scale
         ///< (kernels/common/int_rows.h); the rows score q rounded to int8 against them
};

// A key as the calibration rows see it from a KeyCopy: out[e] = s * e4m3(k[e] / s) or
// s * int4(k[e] / s), with the scale s of the key's d values, as quantize_keys_kernel rounds it.
void round_key_cpu(KeyFormat f, const bf16* k, int d, float* out);

// A query head as the calibration rows score it against a KeyCopy: exact for E4m3 (the
// kernel's fp16 takes it whole, scaled by a power of two), s * int8(q[e] / s) for Int4.
void round_query_cpu(KeyFormat f, const float* q, int d, float* out);

// The tokens attended by a sequence of n tokens under block_flags, ascending.
std::vector<int32_t> selected_tokens_cpu(const Geometry& g, int n, const uint8_t* block_flags);

// ---- CUDA ----------------------------------------------------------------------------------

// y [n, W] = CNN(x [n, H, W]) on the device (params: kParamCount device floats).
cudaError_t cnn_forward_cuda(const float* params, const float* x, int n, int H, int W, float* y,
                             cudaStream_t stream);

// The CUDA predictor's per-row cache (per layer, beside a HistoryState), which makes a decode
// step's prediction cost about 5 conv2 rows instead of `history` (4 + k after k appends).
//
// Conv2 row r of the CNN input depends on input rows r-2 .. r+2 and on the zero padding only
// when r < 2 or r > H-3 ("edge rows"). An interior row's s (attnpred.h top) is therefore a
// function of its ring slot's content alone, and once computed it stays valid while the
// history slides, except in the two columns next to the candidate slice's right end
// candidate_end(tokens), which moves as the context grows. So per prediction, with k rows
// appended since the last one (1 when the engine predicts every step):
//   - the edge rows 0, 1, H-2, H-1 are recomputed into `edge`;
//   - the k rows that became interior (H-2-k .. H-3) are computed into their slots of `s`;
//   - when candidate_end moved (by at most 2 blocks), the stored interior rows are recomputed
//     in columns [old end - 2, new end);
//   - `sum` keeps the interior rows' fixed-point time sum, adjusted by exact integer atomics
//     as rows enter, leave or are fixed up; y adds the edge rows to it.
// Anything else (the first prediction after a prefill, more than H - 4 rows appended, the end
// moving back or by more than 2 blocks, H < 5) recomputes every row. Either way the result is
// bit for bit the full recompute's.
constexpr int kCnnFragWords = 4 * 32 * 22;  // 4 conv2 N tiles x 32 lanes x 22 words

struct CnnCache {
  float* s = nullptr;         ///< [max_batch, heads, history, max_blocks]: s of each ring slot
  float* edge = nullptr;      ///< [max_batch, heads, 4, max_blocks]: s of the edge rows
  int32_t* count = nullptr;   ///< [max_batch] history count s was last brought up to (-1: none)
  int32_t* end = nullptr;     ///< [max_batch] candidate_end s's right columns were computed for
  long long* sum = nullptr;   ///< [max_batch, heads, max_blocks]: interior rows' fixed-point sum
  uint32_t* frags = nullptr;  ///< [kCnnFragWords]: the CNN's weights as MMA fragments

  static size_t s_floats(const HistoryState& h) {
    return size_t(h.max_batch) * h.num_heads * h.history * h.max_blocks;
  }
  static size_t edge_floats(const HistoryState& h) {
    return size_t(h.max_batch) * h.num_heads * 4 * h.max_blocks;
  }
  static size_t sum_values(const HistoryState& h) {
    return size_t(h.max_batch) * h.num_heads * h.max_blocks;
  }
};

// Marks the cache of sequences [0, batch) empty (prefill): the next prediction recomputes all.
// Also packs `params` (the weights predict_cuda will be called with) into cache.frags.
cudaError_t reset_cnn_cache_cuda(const float* params, const CnnCache& cache, int batch,
                                 cudaStream_t stream);

// CNN over every (b < batch, h) history's candidate slice: scores [max_batch, heads, max_blocks]
// get the predictions at their absolute column indices (columns outside the slice untouched).
// Updates `cache` (see CnnCache). rows_between: the history rows the caller appends between
// two predictions (1: a prediction every step), which picks the kernel's form; any count is
// computed exactly, the others more slowly.
cudaError_t predict_cuda(const float* params, const HistoryState& hist, const CnnCache& cache,
                         int batch, const Geometry& g, float* scores, int rows_between,
                         cudaStream_t stream);

// Per (b, history head): top-k of the candidate scores, OR-ed into block_flags [max_batch, Hkv,
// max_blocks] (zeroed here first). Same order as select_top_blocks_cpu.
cudaError_t select_blocks_cuda(const float* scores, const HistoryState& hist, int batch,
                               int num_kv_heads, const Geometry& g, int k_blocks,
                               uint8_t* block_flags, cudaStream_t stream);

// Where the attended rows live: the paged cache itself (GPU-resident mode: block_slot null)
// or a block cache of slots of `block` tokens (offload mode): block j of (b, h) is in slot
// block_slot[(b * Hkv + h) * max_blocks + j], rows slot * block + t % block of `cache`.
// Offload decode's block list. Builds the sub-request selection (kernels/tactic/tactic.h Selection: rows, tokens, counts;
// `selected` unused) of every (b, kv head) for the current lengths kv.seq_lens.
// counters (may be null): [0] += rows attended.
cudaError_t build_selection_cuda(const PagedKV& kv, const uint8_t* block_flags, int max_blocks,
                                 const Geometry& g, const int32_t* block_slot,
                                 const tactic::Selection& sel, unsigned long long* counters,
                                 cudaStream_t stream);

// Appends one history row per (b, history head): the softmax of q.k * scale of each query head
// over the tokens of `view`, max-pooled into blocks (and over the group's query heads when
// hist.group > 1). Two forms:
//  - full row: view = the layer's cache, token_ids null: every token [0, seq_lens[b]);
//  - sparse row: view = a sub-request view (one sequence per (b, kv head), group-size query
//    heads each), token_ids = Selection::tokens (max_tokens per sequence). Offload decode's;
//    GPU-resident decode's comes out of its attention (sparse_attend_cuda below).
// Then count[b] += 1 and tokens[b] = context length (kv_lens[b]). scratch: row_scratch_bytes.
// keys_on_host: view's keys are mapped pinned host memory (offload mode's full row), which is
// read with 16-byte lanes per key instead of the tensor-core form; the scores agree to fp32
// rounding.
size_t row_scratch_bytes(int max_batch, int num_q_heads, int max_tokens);
cudaError_t append_row_cuda(const bf16* q, int num_q_heads, const PagedKV& view,
                            const int32_t* token_ids, int ids_stride, const int32_t* kv_lens,
                            int batch, int num_kv_heads, float scale, const Geometry& g,
                            const HistoryState& hist, void* scratch, size_t scratch_bytes,
                            bool keys_on_host, cudaStream_t stream);

// The calibration rows' keys in e4m3 or int4 (AttnPredConfig::calibration_keys): a per-layer
// copy of K that the full rows read instead of the bf16 cache, half (e4m3) or a quarter (int4)
// of its bytes and no page table. Key t of (b, kv head h) is key_bytes() of values with a
// scale (KeyFormat: one key is one row), contiguous per (b, kv head). The rows keep the copy
// themselves: a row first quantizes the keys [len[b], n) from the cache (the few a decode loop
// appended since the layer's last row, by a grid of one CTA a kv head), then reads every key from
// the copy and sets len[b] = n. A prefill fills it with the prompt's keys (fill_key_copy_cuda, a
// grid as wide as the device). So keys must not change once copied, until the next prefill: a
// decode loop's cache only appends.
struct KeyCopy {
  uint8_t* k = nullptr;    ///< [max_batch, Hkv, max_tokens, key_bytes()]
  float* scale = nullptr;  ///< [max_batch, Hkv, max_tokens]
  int32_t* len = nullptr;  ///< [max_batch] keys copied
  int max_batch = 0;
  int num_kv_heads = 0;
  int max_tokens = 0;  ///< a multiple of 16 (the row reads whole 16-key tiles)
  int head_dim = 0;
  KeyFormat format = KeyFormat::E4m3;

  KVS_HOST_DEVICE int key_bytes() const {
    return format == KeyFormat::Int4 ? head_dim / 2 : head_dim;
  }
  KVS_HOST_DEVICE int64_t key_index(int b, int h, int t) const {
    return (int64_t(b) * num_kv_heads + h) * max_tokens + t;
  }
};

// The copy of sequences [0, batch) becomes kv's keys (a prefill): len[b] = kv.seq_lens[b].
// cudaErrorInvalidValue: a copy of another shape.
cudaError_t fill_key_copy_cuda(const PagedKV& kv, const KeyCopy& copy, int batch,
                               cudaStream_t stream);

// append_row_cuda's full row (view = the layer's cache in device memory, blocks of 8 or 16)
// with the keys taken from `copy`, which it brings up to the current lengths first. E4m3:
// the scores are fp32 sums of exact products of q in fp16 and the keys' e4m3 values, times
// the keys' scales: each query head is scaled by a power of two into fp16's range first, so q
// enters exactly (but for bits 2^24 below its largest element) and K through its e4m3
// rounding alone. Int4: exact int32 sums of q rounded to int8 (round_query_cpu) times the
// keys' int4 values, times both scales. cudaErrorInvalidValue: another block size or head
// dim, a copy of another shape, or a sequence longer than the copy.
cudaError_t append_full_row_from_copy_cuda(const bf16* q, int num_q_heads, const PagedKV& kv,
                                           int batch, float scale, const Geometry& g,
                                           const HistoryState& hist, const KeyCopy& copy,
                                           void* scratch, size_t scratch_bytes,
                                           cudaStream_t stream);

// GPU-resident decode's sparse step in two kernels: the attention of every (b, kv head) over
// the tokens block_flags select (attended_token(): sink, flagged blocks, recent), from the
// paged cache, out / lse [batch, Hq(, D)] as dense_decode_cuda would give over those tokens;
// with hist non-null also that step's history row (the sparse row of append_row_cuda: each
// query head's softmax over the attended tokens, max-pooled into blocks, over the group when
// hist->group > 1; 0 at blocks not attended), then count[b] += 1 and tokens[b] = seq_lens[b].
// sel.tokens / sel.counts get each (b, kv head)'s attended tokens, ascending (rows and
// selected untouched). list_cap: attended blocks per (b, kv head) at most (sink blocks + the
// group's flagged blocks + recent blocks + 1); more count as errors and the highest are
// dropped. counters (may be null): [0] += tokens attended, [1] += blocks over list_cap.
// cudaErrorInvalidValue (before any launch): head_dim not 64 or 128, group above 8 or not a
// divisor, a history of another group, rows past int32, a short workspace.
// With hist and row both given, the step zeroes the history slot and keeps what the row needs
// in `row` (caller-owned, so that it outlives the workspace's next use), and sparse_row_cuda
// writes the row and advances count and tokens later, on any stream ordered after the step:
// the engine takes it off the step's chain. The row is the same, bit for bit.
struct SparseRow {
  float* block_max = nullptr;      ///< [max_batch * Hq, list_cap] largest scaled score per block
  int32_t* block_ids = nullptr;    ///< [max_batch * Hkv, list_cap] the attended blocks
  int32_t* block_count = nullptr;  ///< [max_batch * Hkv]
  float* lse = nullptr;            ///< [max_batch * Hq]
  unsigned int* done = nullptr;    ///< one counter: sparse_row_cuda's CTAs that finished
};
size_t sparse_attend_workspace_bytes(int max_batch, int num_q_heads, int num_kv_heads, int head_dim,
                                     int list_cap);
cudaError_t sparse_attend_cuda(const bf16* q, int num_q_heads, const PagedKV& kv, float scale,
                               const uint8_t* block_flags, int max_blocks, const Geometry& g,
                               int list_cap, const HistoryState* hist, const tactic::Selection& sel,
                               unsigned long long* counters, bf16* out, float* lse, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream,
                               const SparseRow* row = nullptr);
// The history row of a sparse_attend_cuda call given `row` (same batch, heads and list_cap):
// count[b] += 1 and tokens[b] = seq_lens[b] after it. cudaErrorInvalidValue on shapes that do
// not match the history or a SparseRow with a null array.
cudaError_t sparse_row_cuda(const SparseRow& row, const HistoryState& hist, const int32_t* seq_lens,
                            int batch, int num_q_heads, int num_kv_heads, int list_cap,
                            cudaStream_t stream);

// ---- Offload: the per-layer device block cache ---------------------------------------------
//
// Slots of `block` tokens of one kv head (K and V [num_slots, block, d] bf16); each (b, kv
// head) owns slots [(b * Hkv + h) * slots_per_head, ... + slots_per_head). block_slot
// [max_batch * Hkv, max_blocks] maps a block to its (global) slot (-1: not resident);
// slot_block [max_batch * Hkv, slots_per_head] the reverse, by the slot's index within the head.
struct BlockCache {
  bf16* k = nullptr;
  bf16* v = nullptr;
  int32_t* block_slot = nullptr;
  int32_t* slot_block = nullptr;
  int32_t* copy_list = nullptr;   ///< [max_batch * Hkv, slots_per_head, 2] (block, slot)
  int32_t* copy_count = nullptr;  ///< [max_batch * Hkv]
  int max_batch = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int max_blocks = 0;
  int slots_per_head = 0;

  // The cache as a paged view (one kv head, page = slot of `block` rows) for
  // tactic::subrequest_view over it (which replaces the page table, lengths and batch).
  PagedKV as_view(int block) const;
};

// Makes every block a sequence of n_next = kv_lens[b] + len_delta tokens attends resident:
// sink blocks, flagged blocks and recent blocks, except block `skip_tail` blocks of the end
// (the not-yet-complete block: skip_tail = 1 at prefetch time). Frees slots of blocks no
// longer needed, then copies the missing blocks from `host_kv` (pinned, mapped host memory:
// device code reads it directly, so the selection never leaves the GPU) in one grid-stride
// copy kernel. copied_lens (may be null): per sequence, the length the resident blocks were
// copied at (the prefetch's); resident blocks holding a token at or past it were partial then
// and are copied again (the newest-token block; every block the sequence grew into when it
// advanced more than one token since the prefetch).
// counters (may be null): [0] += blocks copied; done (may be null): += 1 by every copying CTA
// when finished (late-copy detection: see prefetch_probe_cuda).
cudaError_t make_resident_cuda(const PagedKV& host_kv, const uint8_t* block_flags,
                               const Geometry& g, int len_delta, bool skip_tail,
                               const int32_t* copied_lens, const BlockCache& cache,
                               unsigned long long* counters, unsigned int* done, int copy_ctas,
                               cudaStream_t stream);
// Empties the cache of sequences [0, batch) (prefill).
cudaError_t reset_block_cache_cuda(const BlockCache& cache, int batch, cudaStream_t stream);
// CTAs make_resident_cuda's copy kernel uses (done advances by this per call).
int default_copy_ctas();

// counter[0] += 1 when *done < expected when the probe runs (the prefetch was late).
cudaError_t prefetch_probe_cuda(const unsigned int* done, unsigned int expected,
                                unsigned long long* counter, cudaStream_t stream);

}  // namespace kvs::kernels::attnpred
