// MagicPIG kernels (spec shared/specs/magicpig.md): SimHash LSH sampling with importance
// weights. The engine (runtime/magicpig_engine.h) documents the design; this is the layer
// of raw pointers and sizes under it.
//
// Per (layer, sequence b, kv head h) the prefill hashes the keys of the "hashed range"
// [start, start + n) (everything but the sink and the local window), centred by c = their
// mean. The layouts, shared by host and device copies (cap = the layer's capacity, the
// largest n over the batch):
//   centre   [B, Hkv, d]             fp32, c = mean of the hashed keys (fp64 sums, chunked)
//   norms    [B, Hkv, cap]           fp32, |k_i - c|
//   codes    [Hkv, L, cap]           uint16, per table the code of each hashed key (prefill
//                                    temporary; the CPU reference keeps [B, Hkv, L, cap])
//   offsets  [B, Hkv, L, 2^K + 1]    int32 CSR: bucket x of table l holds
//   ids      [B, Hkv, L, cap]        ids[offsets[x] .. offsets[x + 1]), ascending
//   k, v     [B, Hkv, cap, d]        bf16 copies of the hashed rows (CPU-offload mode)
// Ids are 0..n-1 within the hashed range (token = start + id). A key is a candidate for a
// query when they share a bucket in at least 2 of the L tables; it is attended with its
// logit shifted by -log(u + epsilon), u = sampling_probability(cos(q, k - c), K, L).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/common/bf16.h"
#include "kernels/common/paged_kv.h"

namespace kvs::kernels::magicpig {

// Fixed-size blocks of the centre's fp64 sums, added in block order: the same summation
// order on the host and the device, so both get the same fp32 centre.
constexpr int kCentreChunk = 1024;

struct Params {
  int bits = 10;          ///< K
  int tables = 150;       ///< L
  double epsilon = 1e-4;  ///< logit shift -log(u + epsilon): caps the weight at 1/epsilon
  int buckets() const { return 1 << bits; }
  int64_t offsets_per_table() const { return int64_t(buckets()) + 1; }
};

// The random hyperplanes: one [head_dim, K * L] fp32 matrix for every head and layer,
// i.i.d. N(0, 1) from `seed` (splitmix64 + Box-Muller: the same on every platform).
struct Projection {
  int head_dim = 0;
  int bits = 0;
  int tables = 0;
  uint64_t seed = 0;
  std::vector<float> w;  ///< [head_dim, bits * tables] row-major
  int columns() const { return bits * tables; }
};
Projection make_projection(int head_dim, int bits, int tables, uint64_t seed);
// Throws std::invalid_argument naming what does not match (sizes, w.size()).
void check_projection(const Projection& p, int head_dim, int bits, int tables);

// ---- CPU building blocks ------------------------------------------------------------------

// Centre of rows [start, start + n) of (b, h): fp64 sums over kCentreChunk blocks, blocks
// added in order, divided by n, rounded to fp32. n = 0 gives zeros.
void centre_cpu(const PagedKV& kv, int b, int h, int start, int n, float* centre);
// Norm |x - c| of one bf16 row, fp64 sum rounded to fp32 (the device computes the same).
float centred_norm_cpu(const bf16* row, const float* centre, int d);
// Codes of rows [start, start + n) of (b, h) centred by `centre`: codes[l * stride + i];
// norms[i] (may be null). The reference hashing: slow, exact same bits as the device.
void hash_keys_cpu(const PagedKV& kv, int b, int h, int start, int n, const float* centre,
                   const Projection& proj, uint16_t* codes, int64_t stride, float* norms);
// L codes of one query (not centred, spec 2.6).
void hash_query_cpu(const float* q, const Projection& proj, uint16_t* codes);
// Counting sort of one table's codes [n] into CSR offsets [2^K + 1] and ids [n] (ascending
// within a bucket).
void build_table_cpu(const uint16_t* codes, int n, int bits, int32_t* offsets, int32_t* ids);

// One (sequence, kv head) of a layer, as the CPU decode path reads it.
struct HeadTables {
  const bf16* k = nullptr;           ///< [n, d] hashed rows (not centred)
  const bf16* v = nullptr;           ///< [n, d]
  const float* norms = nullptr;      ///< [n]
  const float* centre = nullptr;     ///< [d]
  const int32_t* offsets = nullptr;  ///< [L, 2^K + 1]
  const int32_t* ids = nullptr;      ///< [L, table_stride]
  int64_t table_stride = 0;          ///< elements between tables in ids (the capacity)
  int n = 0;
  int head_dim = 0;
};

// Which vector unit the CPU sampled attention uses. Auto picks the widest the CPU has
// (__builtin_cpu_supports), falling back to Portable; asking for one it lacks throws.
enum class CpuIsa { Auto, Portable, Avx2, Avx512 };
const char* to_string(CpuIsa isa);
CpuIsa resolve_isa(CpuIsa wanted, int head_dim);  // the ISA that will actually run
bool cpu_supports(CpuIsa isa);

// Per-thread scratch of the CPU path: hit counters (all zero between calls) and scores.
class HeadScratch {
 public:
  void reserve(int n);
  uint8_t* counters() { return counters_.data(); }
  float* scores() { return scores_.data(); }

 private:
  std::vector<uint8_t> counters_;
  std::vector<float> scores_;
};

// Keys of `t` that share a bucket with q_codes in >= 2 tables, in discovery order (tables
// 0..L-1, bucket order): written to out (capacity t.n), count returned. *scanned (may be
// null) gets the number of table entries read. counters: t.n zeros, left zeroed.
int retrieve_cpu(const uint16_t* q_codes, const HeadTables& t, const Params& p, uint8_t* counters,
                 int32_t* out, int64_t* scanned);

struct HeadResult {
  int candidates = 0;
  int64_t scanned = 0;  ///< table entries read by the retrieval
};

// The production CPU path for one query head: retrieval, then attention over the
// candidates with logits q.k * scale - log(u + epsilon). o [d] fp32 and *lse (natural log;
// -inf and o = 0 without candidates). candidates: capacity t.n, gets the ids. fp32
// throughout, vectorised by `isa` (from resolve_isa).
HeadResult sampled_attention_cpu(const float* q, const uint16_t* q_codes, const HeadTables& t,
                                 const Params& p, float scale, CpuIsa isa, HeadScratch& scratch,
                                 int32_t* candidates, float* o, float* lse);

// Reference of the same estimator, simply, in fp64 (attend_cpu_shifted): candidates are
// counted from the key codes ([L, code_stride], no tables); the keys are read from kv rows
// start + id of (b, h). Returns the candidate ids (ascending); o [d], *lse as above.
std::vector<int32_t> sampled_attention_reference(const float* q, const uint16_t* q_codes,
                                                 const PagedKV& kv, int b, int h, int start, int n,
                                                 const uint16_t* codes, int64_t code_stride,
                                                 const float* norms, const float* centre,
                                                 const Params& p, double scale, double* o,
                                                 double* lse);

// ---- CUDA ---------------------------------------------------------------------------------
// All launchers are asynchronous on `stream` and return the launch error. starts/lens are
// device arrays [batch] of the hashed ranges.

// centre [batch, Hkv, d] of each (b, h)'s hashed range; partial: device scratch of
// centre_partial_elems(...) doubles.
int64_t centre_partial_elems(int batch, int num_kv_heads, int head_dim, int capacity);
cudaError_t centre_cuda(const PagedKV& kv, const int32_t* starts, const int32_t* lens, int capacity,
                        double* partial, float* centre, cudaStream_t stream);
// Codes [Hkv, L, capacity] and norms [Hkv, capacity] of sequence b's hashed range (host
// start/len; centre_b [Hkv, d] on the device). w: the projection on the device. L <= 768
// (the CTA's codes live in 48 KB of shared memory).
constexpr int kMaxTablesCuda = 768;
cudaError_t hash_keys_cuda(const PagedKV& kv, int b, int start, int len, const float* centre_b,
                           const float* w, const Params& p, int capacity, uint16_t* codes,
                           float* norms, cudaStream_t stream);
// Rows [start, start + len) of (b, every h) copied to k_out/v_out [Hkv, capacity, d].
cudaError_t gather_rows_cuda(const PagedKV& kv, int b, int start, int len, int capacity,
                             bf16* k_out, bf16* v_out, cudaStream_t stream);
// L codes of each of `rows` queries q [rows, d] bf16 (w on the device) -> codes [rows, L].
cudaError_t hash_queries_cuda(const bf16* q, int rows, int head_dim, const float* w,
                              const Params& p, uint16_t* codes, cudaStream_t stream);
// The dense part's sub-request view (as Tactic's): one sequence per (b, h), page size 1,
// rows[(b * Hkv + h) * max_tokens + i] = physical row of the i-th dense token * Hkv + h;
// dense tokens are [0, starts[b]) and [starts[b] + lens[b], seq_len). counts [batch * Hkv].
// counter (may be null) += the dense rows.
cudaError_t dense_rows_cuda(const PagedKV& kv, const int32_t* starts, const int32_t* lens,
                            int max_tokens, int32_t* rows, int32_t* counts,
                            unsigned long long* counter, cudaStream_t stream);
PagedKV dense_view(const PagedKV& kv, int32_t* rows, int32_t* counts, int max_tokens);

// GPU-only mode. The hashed ids [0, n) of each (b, query head) are split into `splits`
// contiguous ranges of whole bitmap words, one CTA each (grid rows x splits): a CTA scans
// the part of each of its L buckets that falls in its range (ids ascend within a bucket,
// so a warp-wide search finds it), counts hits in 2-bit hit maps of its range in shared
// memory and attends the keys hit twice (read from the paged cache). A key's hits all land
// in the CTA owning its id, so the ">= 2 tables" rule is exact per CTA. Writes the partial
// states o [batch * Hq, splits, d] fp32 and lse [batch * Hq, splits] (merged by
// merge_parts_cuda) and the candidate bitmap [batch * Hq, words] (words =
// bitmap_words(capacity)). counters (may be null): [0] += candidates, [1] += table entries
// scanned. Tables/norms/centre in the layouts above, on the device.
struct DeviceTables {
  const float* centre = nullptr;
  const float* norms = nullptr;
  const int32_t* offsets = nullptr;
  const int32_t* ids = nullptr;
  const int32_t* starts = nullptr;
  const int32_t* lens = nullptr;
  int capacity = 0;
};
constexpr int kMaxSplits = 32;  ///< most CTAs per (b, query head) in GPU-only mode
int bitmap_words(int capacity);
// Splits for `rows` query rows of a layer of `capacity` hashed ids on a device of sm_count
// SMs: enough CTAs to fill the device (4 per SM), at most kMaxSplits, at most one per word.
int sampled_attention_splits(int rows, int capacity, int sm_count);
// Dynamic shared memory of one CTA at the largest split (splits = 1): the opt-in bound.
size_t sampled_attention_smem_bytes(int capacity);
cudaError_t prepare_sampled_attention_cuda(int head_dim, int capacity);  // smem opt-in
cudaError_t sampled_attention_cuda(const bf16* q, const uint16_t* q_codes, int num_q_heads,
                                   const PagedKV& kv, const DeviceTables& t, const Params& p,
                                   float scale, int splits, float* o, float* lse, uint32_t* bitmap,
                                   unsigned long long* counters, cudaStream_t stream);

// out = merge of (o_dense bf16 [rows, d], lse_dense [rows]) and the `splits` sampled
// partial states (o_sampled fp32 [rows, splits, d], lse_sampled [rows, splits]), rows x d,
// through merge_states.cuh; lse_out may be null.
cudaError_t merge_parts_cuda(const bf16* o_dense, const float* lse_dense, const float* o_sampled,
                             const float* lse_sampled, int splits, int rows, int head_dim,
                             bf16* out, float* lse_out, cudaStream_t stream);

}  // namespace kvs::kernels::magicpig
