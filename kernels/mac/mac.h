// MAC-Attention (spec shared/specs/mac.md): per (sequence, layer, query head), reuse the
// rectified attention summary of a recent query whose pre-RoPE vector is close, and recompute
// only the band + tail under the current query.
//
// Index convention (spec 2.2): E(p) = max(p + 1 - B, 0); the ring entry of position p is
// entry(p) = A_p([0, E(p))): p's own query over every key but the last B. At step t (the query
// at position t, keys 0..t in the cache):
//   hit on j:  new = merge(entry(j), A_t([E(j), E(t))));  out = merge(new, A_t([E(t), t]))
//   miss:      new = A_t([0, E(t)));                      out = merge(new, A_t([E(t), t]))
// and entry(t) = new is written to slot t mod W ("rectify-append"). A miss is exact attention.
//
// Ring state (RingState), one layout for both backends (host memory for the CPU reference,
// device memory for CUDA), per layer:
//   q      [max_batch, W, Hq, d] bf16  pre-RoPE queries
//   o      [max_batch, W, Hq, d] bf16  rectified normalized partial outputs
//   lse    [max_batch, W, Hq]    fp32  natural-log sum-exp, -inf for an empty summary
//   pos    [max_batch, W]        int32 the position a slot holds (p mod W == slot), -1: none
//   q_mean [max_batch, Hq, d]    fp32  running mean of the head's pre-RoPE queries
//   q_sq   [max_batch, Hq]       fp32  running mean of their squared norms
//   q_count[max_batch, Hq]       int32 queries folded into the running means
//   last_start [max_batch, Hq]   int32 first token the last decode read per head (0: miss)
//   last_len   [max_batch]       int32 the sequence length at the last decode
// Candidates of step t are the slots whose pos lies in [max(0, t - W), t): exactly one slot
// per window position, so a slot that was never written (or holds an older sequence's data
// after a reset) is never matched.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/common/bf16.h"
#include "kernels/common/host_device.h"
#include "kernels/common/paged_kv.h"

namespace kvs::kernels::mac {

enum class ThresholdRule : int { Paper = 0, Relative = 1, PerHead = 2 };

struct MatchParams {
  int window = 512;
  int band = 256;
  int min_context = 2048;
  ThresholdRule rule = ThresholdRule::Relative;
  float tau = 0.45f;
  int min_queries = 64;
  int stats_horizon = 4096;
  /// PerHead: [Hq] squared-distance thresholds of this layer (memory of the backend).
  const float* head_threshold = nullptr;
};

struct RingState {
  bf16* q = nullptr;
  bf16* o = nullptr;
  float* lse = nullptr;
  int32_t* pos = nullptr;
  float* q_mean = nullptr;
  float* q_sq = nullptr;
  int32_t* q_count = nullptr;
  int32_t* last_start = nullptr;
  int32_t* last_len = nullptr;
  int max_batch = 0;
  int window = 0;
  int num_q_heads = 0;
  int head_dim = 0;

  // Element offset of (b, slot, h, dim 0) in q and o; (b, slot, h) in lse.
  KVS_HOST_DEVICE int64_t row(int b, int slot, int h) const {
    return (int64_t(b) * window + slot) * num_q_heads + h;
  }
  KVS_HOST_DEVICE int64_t head(int b, int h) const { return int64_t(b) * num_q_heads + h; }
};

// Counters the decode adds to (both backends; CUDA: device memory, may be null).
enum Counter : int {
  kRowsRead = 0,        ///< KV rows read: per (sequence, kv head) the union span of its heads
  kRowsContext = 1,     ///< rows a dense read would read
  kSelectionBytes = 2,  ///< ring bytes read by the match, plus reused summaries
  kHeadHits = 3,        ///< query heads that reused a summary
  kHeadSteps = 4,       ///< query heads decoded
  kNumCounters = 5,
};

// E(p): the end (exclusive) of what entry(p) covers.
KVS_HOST_DEVICE int cache_end(int p, int band) { return p + 1 - band > 0 ? p + 1 - band : 0; }

// Squared-distance threshold of a query head: hit iff d2 < threshold. variance is the
// running total variance of the head's queries (q_sq - ||q_mean||^2), count the queries seen.
// -inf (never a hit) for Relative before min_queries queries.
KVS_HOST_DEVICE float match_threshold(const MatchParams& p, int h, int head_dim, float variance,
                                      int count) {
  const float f = 2.f * (1.f - p.tau) * (1.f - p.tau);
  switch (p.rule) {
    case ThresholdRule::Paper: return f * float(head_dim);
    case ThresholdRule::Relative:
      return count >= p.min_queries ? f * (variance > 0.f ? variance : 0.f) : -INFINITY;
    case ThresholdRule::PerHead: return p.head_threshold[h];
  }
  return -INFINITY;
}

// Weight of the next query in the running means: 1/n for the first `horizon` queries, then
// 1/horizon. *count becomes the count after the update.
KVS_HOST_DEVICE float stats_weight(int32_t* count, int horizon) {
  const int n = *count < horizon ? *count + 1 : horizon;
  *count = n;
  return 1.f / float(n);
}

// ---- CPU reference ------------------------------------------------------------------------

struct MatchResult {
  bool hit = false;
  int pos = -1;         ///< nearest candidate position (-1: none)
  float d2 = INFINITY;  ///< its squared distance (fp32)
  float threshold = -INFINITY;
};

// Nearest candidate of query head h of sequence b at step t (q_pre: d bf16 values), ties to
// the older position, and the decision (every hit condition of the spec, 2.3).
MatchResult match_cpu(const RingState& st, const MatchParams& p, int b, int h, int t,
                      const bf16* q_pre);

// Resets sequences [0, batch) of the ring: no slot valid, running means empty.
void reset_cpu(const RingState& st, int batch);

// One decode step of every sequence of kv (the new token already appended): match, amend +
// complete (fp64 through attend_cpu and merge_state_cpu), rectify-append. q, q_pre
// [batch, Hq, d]; out [batch, Hq, d]; lse [batch, Hq] (may be null); counters
// [kNumCounters] (may be null).
void decode_cpu(const RingState& st, const MatchParams& p, const bf16* q, const bf16* q_pre,
                int num_q_heads, const PagedKV& kv, double scale, bf16* out, float* lse,
                uint64_t* counters);

// Prefill: the ring entries of the last n prompt positions of sequence b (p0 = len - n ..
// len - 1, n <= W): q, q_pre [n, Hq, d] their post- and pre-RoPE queries. entry(p) is
// computed exactly (A_p([0, E(p)))); the running means take the n queries in order.
void fill_entries_cpu(const RingState& st, const MatchParams& p, int b, const bf16* q,
                      const bf16* q_pre, int n, int num_q_heads, const PagedKV& kv,
                      double scale);

// ---- CUDA ---------------------------------------------------------------------------------

// Decode step on the GPU, graph-capturable (no host sync, allocation or copy), three launches:
//   1. match: one thread-block cluster per (sequence, query head) scans the whole ring
//      (every valid row in flight at once, bf16 reads, fp32 accumulation, warp-shuffle sums)
//      and decides hit / start in its first CTA.
//   2. attend (programmatic dependent launch behind match): every CTA derives the plan from
//      the lengths and the heads' starts (per (sequence, kv head) the union span
//      [min_h start_h, t] cut into chunks of a length chosen from the total work; the chunk
//      holding E(t) runs as two segments), then attends its chunk: bf16 tensor cores, each KV
//      tile loaded once for the group, head rows below their own start masked, partial
//      states (o, lse) out.
//   3. complete (programmatic dependent launch behind attend): one CTA per (sequence, query
//      head) merges the head's [start, E(t)) states with the reused entry into `new`, writes
//      entry(t) and q_pre into the rings, and merges `new` with the [E(t), t] states into out.
// Everything between the launches lives in `workspace`; it needs no initialisation. Supports
// head_dim 64 and 128, group sizes 1..8.
size_t decode_workspace_bytes(int max_batch, int num_q_heads, int num_kv_heads, int head_dim,
                              int window);
cudaError_t prepare_cuda(int head_dim);
cudaError_t decode_cuda(const RingState& st, const MatchParams& p, const bf16* q, const bf16* q_pre,
                        int num_q_heads, const PagedKV& kv, float scale, bf16* out, float* lse,
                        unsigned long long* counters, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);

cudaError_t reset_cuda(const RingState& st, int batch, cudaStream_t stream);

// Prefill write of sequence b's last n positions: q_pre [n, Hq, d], and their entries
// o [n, Hq, d] bf16, lse [n, Hq] fp32 computed by the caller (dense attention over [0, E(p))).
// p0 = first position. Updates the running means in order.
cudaError_t fill_entries_cuda(const RingState& st, const MatchParams& p, int b, int p0, int n,
                              const bf16* q_pre, const bf16* o, const float* lse,
                              cudaStream_t stream);

}  // namespace kvs::kernels::mac
