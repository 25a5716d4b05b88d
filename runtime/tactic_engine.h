// Tactic behind the Engine interface (spec shared/specs/tactic.md; kernels/tactic/tactic.h).
//
// prefill(layer) clusters the keys of every sequence of the batch per kv head (replacing
// what the layer held for those slots). decode(layer): re-clusters a block of recent tokens
// where one is due (TacticConfig::recluster_interval), selects clusters per query head
// (q.centroid order, y = a/x + b fit, budget K rounded up to whole clusters), unites the
// group's selections with the recent tokens, and attends them once per kv head (CUDA: the
// dense split-KV kernel over the "sub-request" view, one sequence per (b, kv head)).
//
// Memory: the cluster state of a layer is allocated at its first prefill, sized for
// (max_batch, max_context): bf16 centroids (1/cluster_size of the K bytes), CSR offsets and
// member ids (4 bytes per token). Decode allocates nothing; its scratch is the workspace.
//
// Choices where the paper is silent (spec section 8):
// - Budgets are whole clusters: K tokens round up to the clusters that cover them (8.2), so
//   the group's union is a bitmap OR of cluster ids.
// - K is computed on the clustered tokens only; recent tokens are attended on top (8.4, the
//   paper-faithful minimum): their mass only raises the achieved fraction.
// - Re-clustering (8.3): when a (sequence, kv head) has recluster_interval unclustered tokens,
//   the oldest recluster_interval of them are clustered on their own and appended to the CSR;
//   earlier clusters never change. At most one block per decode() call (one token arrives per
//   step). On CUDA this is one launch per layer and step that exits at once when nothing is
//   due, so it lives inside a captured step.
// - Window width w = max(32, 0.5 % of n), N = 1.5 % of n (8.1); short lists are computed
//   exactly; a <= 0 falls back to a flat tail, b < 0 cuts the tail at zero (8.7); exponentials
//   relative to the largest sampled logit (8.8).
//
// Stats: kv_rows_read counts the attended rows (selected union + recent tokens, per kv head);
// selection_bytes_read the centroids (once per kv head) and the sampled keys (per query
// head) read by the selection.
#pragma once

#include <vector>

#include "kernels/tactic/tactic.h"
#include "runtime/engine.h"
#include "runtime/engine_support.h"

namespace kvs {

class TacticEngine : public Engine {
 public:
  TacticEngine(const ModelShape& shape, const EngineConfig& config);
  ~TacticEngine() override;
  TacticEngine(const TacticEngine&) = delete;
  TacticEngine& operator=(const TacticEngine&) = delete;

  Method method() const override { return Method::Tactic; }
  Backend backend() const override { return config_.backend; }
  size_t workspace_bytes() const override;
  void prefill(int layer, const PagedKV& kv, cudaStream_t stream) override;
  void decode(int layer, const bf16* q, const bf16* q_pre, const PagedKV& kv, bf16* out, float* lse,
              cudaStream_t stream) override;
  EngineStats stats() const override;
  void reset_stats() override;
  std::vector<std::vector<int32_t>> last_read(int layer, int b) const override;

  const TacticConfig& tactic_config() const { return config_.tactic; }
  int max_context() const { return max_context_; }
  int max_clusters() const { return max_clusters_; }
  bool is_dense_layer(int layer) const;

  // The layer's cluster state (host pointers on the CPU backend, device pointers on CUDA);
  // throws std::logic_error before the layer's first prefill.
  const kernels::tactic::ClusterState& cluster_state(int layer) const;
  // CUDA backend: the last decode's selection (device pointers into the workspace).
  kernels::tactic::Selection last_selection() const;

 private:
  struct LayerState {
    kernels::tactic::ClusterState view;
    std::vector<bf16> host_centroids;  // CPU backend storage
    std::vector<int32_t> host_offsets, host_members, host_num_clusters, host_clustered_len;
  };

  kernels::tactic::FitParams fit_params() const;
  kernels::tactic::KMeansParams kmeans_params() const;
  LayerState& allocate_layer(int layer);
  void decode_cpu(int layer, const bf16* q, const PagedKV& kv, bf16* out, float* lse);
  size_t selection_output_bytes() const;  // workspace: the Selection arrays
  size_t select_bytes() const;            // workspace: selection output + selection scratch

  int max_context_ = 0;
  int max_clusters_ = 0;
  std::vector<LayerState> layers_;
  std::vector<bool> allocated_;
  EngineStats host_stats_;
  // CPU backend: the tokens each (sequence, kv head) attended in the layer's last decode.
  std::vector<std::vector<std::vector<int32_t>>> last_tokens_;  // [layer][b * Hkv + h]
  DeviceCounters device_counters_;  // CUDA: [rows read, selection bytes, context rows]
};

}  // namespace kvs
