// MAC-Attention behind the Engine interface (spec shared/specs/mac.md; kernels/mac/mac.h).
//
// Per (sequence, layer): a ring of the last W pre-RoPE queries and a ring of their rectified
// summaries entry(p) = A_p([0, E(p))), E(p) = max(p + 1 - B, 0) (o in bf16, lse in fp32).
// decode(layer) per query head: match (nearest ring query by squared L2, ties to the older
// position); on a hit at j recompute [E(j), t] under the current query and merge it with
// entry(j); on a miss attend [0, t] (exact); in both cases write entry(t) = the part below
// E(t) (rectify-append). The CUDA step is three launches with device-side planning and no
// host sync, capturable in a CUDA graph; the CPU backend is the fp64 reference.
//
// What the paper leaves open, and what this engine does:
// - Threshold (spec 8.3). The paper's d2 < 2d(1 - tau)^2 is absolute (unit-variance
//   queries). On kvs-tiny-a it accepts nearly every candidate. Default
//   MacThreshold::Relative keeps the paper's null model but fits it to the head:
//   d2 < 2(1 - tau)^2 v, v a running estimate (per sequence, layer, query head) of the total
//   variance E||q - mean||^2 of the head's pre-RoPE queries (two independent queries are
//   2v apart in expectation; v = d for the paper's unit-variance queries, so the rules agree
//   there). Centring matters: real heads have a large mean query, and a rule relative to
//   E||q||^2 would again accept almost everything. MacThreshold::Paper is the paper's rule;
//   MacThreshold::PerHead takes calibrated thresholds per (layer, head). All three are
//   MacConfig knobs.
// - Index convention: E(p) above (spec 2.2, repo HEAD): an entry covers every key but the
//   last B, which include p's own key; the band of a hit is [E(j), j], the recompute
//   [E(j), t] is B + (t - j) keys.
// - New entries on a hit are merge(entry(j), A_t([E(j), E(t)))) (spec 8.7, no downdate), so
//   reuse chains; misses write exact entries. No forced refresh.
// - Hit conditions (spec 2.3): t >= min_context, d2 < threshold, entry(j) non-empty
//   (finite lse), j in [t - W, t) and present in the ring. Relative also needs min_queries
//   queries seen by the head.
// - GQA (spec 8.10): matching is per query head; each (sequence, kv head) reads its KV once
//   over the union span [min_h start_h, t], each head masking below its own start. A mixed
//   group costs the full read, but its hit heads still reuse (no forced miss).
// - Prefill (spec 8.9): prefill(layer) resets the layer's rings for the batch's sequences.
//   The prompt's pre-RoPE queries are not in the KV cache, so ring entries of prompt tokens
//   come from prefill_queries() when the caller has them: it computes entry(p) exactly
//   (dense attention of q_p over [0, E(p)) - a full read per query, so it costs about W dense
//   decodes; no downdate of a prefill output, which this library does not own). Without it,
//   the rings fill during decode: every step writes its entry, so after W steps the window
//   is full (misses before that are exact).
// - Planning is on the device (spec 8.13): the last CTA of the match launch splits each
//   union span into chunks sized from the total work (prefix sums over the pairs), so the
//   step never syncs with the host.
//
// Memory per layer, allocated at its first prefill: max_batch * W * Hq * (2d * 2 + 4) bytes
// of rings plus the running means (Hq * (d + 2) * 4 bytes per sequence). The workspace
// (decode scratch: tile minima, plan, partial states) is the caller's.
//
// Stats: kv_rows_read counts per (sequence, kv head) the union span read; mac_stats() adds
// the hit rate over decoded query heads. selection_bytes_read: ring queries scanned by the
// match plus reused summaries.
#pragma once

#include <vector>

#include "kernels/mac/mac.h"
#include "runtime/engine.h"
#include "runtime/engine_support.h"

namespace kvs {

struct MacStats {
  uint64_t head_steps = 0;  ///< query heads decoded (one per head, sequence and layer call)
  uint64_t head_hits = 0;   ///< of which reused a summary
  uint64_t kv_rows_read = 0;
  uint64_t kv_rows_context = 0;
  double hit_rate() const { return head_steps ? double(head_hits) / double(head_steps) : 0.0; }
};

class MacEngine : public Engine {
 public:
  MacEngine(const ModelShape& shape, const EngineConfig& config);
  ~MacEngine() override;
  MacEngine(const MacEngine&) = delete;
  MacEngine& operator=(const MacEngine&) = delete;

  Method method() const override { return Method::Mac; }
  Backend backend() const override { return config_.backend; }
  size_t workspace_bytes() const override;

  // Resets the rings of sequences [0, kv.batch) of `layer` (allocating the layer's state at
  // its first call). Reads nothing from kv but its shape.
  void prefill(int layer, const PagedKV& kv, cudaStream_t stream) override;

  // Optional, after prefill(layer): fills sequence b's ring with its last n prompt tokens
  // (positions len - n .. len - 1, len = kv.seq_lens[b]; 1 <= n <= min(W, len)). q, q_pre
  // [n, Hq, d]: their post-RoPE and pre-RoPE queries (memory of the backend). Each entry is
  // computed exactly. Not graph-capturable (CUDA: temporary allocations and a sync).
  int prompt_queries_wanted() const override { return config_.mac.window; }
  void prefill_queries(int layer, int b, const bf16* q, const bf16* q_pre, int n,
                       const PagedKV& kv, cudaStream_t stream) override;

  // q_pre is required.
  void decode(int layer, const bf16* q, const bf16* q_pre, const PagedKV& kv, bf16* out,
              float* lse, cudaStream_t stream) override;

  EngineStats stats() const override;
  void reset_stats() override;
  MacStats mac_stats() const;

  // Per query head of sequence b: [start, len) of the last decode of `layer` (start = E(j)
  // on a hit, 0 on a miss). CUDA: copies from the device and synchronizes.
  std::vector<std::vector<int32_t>> last_read(int layer, int b) const override;

  const MacConfig& mac_config() const { return config_.mac; }
  // The layer's rings (host memory on the CPU backend, device memory on CUDA); throws
  // std::logic_error before the layer's first prefill.
  const kernels::mac::RingState& ring_state(int layer) const;
  kernels::mac::MatchParams match_params(int layer) const;

 private:
  struct LayerState {
    kernels::mac::RingState view;
    std::vector<bf16> host_q, host_o;  // CPU backend storage
    std::vector<float> host_lse, host_mean, host_sq;
    std::vector<int32_t> host_pos, host_count, host_start, host_len;
  };

  LayerState& allocate_layer(int layer);
  void check_layer(int layer, const char* who) const;
  std::vector<int32_t> host_lengths(const PagedKV& kv, cudaStream_t stream) const;
  void read_counters(uint64_t* counters) const;  // [kNumCounters] from either backend

  std::vector<LayerState> layers_;
  std::vector<bool> allocated_;
  float* head_thresholds_ = nullptr;  // CUDA, PerHead: [num_layers * Hq]
  uint64_t host_counters_[kernels::mac::kNumCounters] = {};
  uint64_t decode_calls_ = 0;
  DeviceCounters device_counters_;  // CUDA with collect_stats
};

}  // namespace kvs
