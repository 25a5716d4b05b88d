// SAAP behind the Engine interface (spec shared/specs/saap.md; kernels/saap/saap.h).
//
// Construction loads the trained parts (make_engine reads them from the bundle's saap group:
// runtime/saap_parts.h): per indexed layer the centroids and the query MLPs with batch norm
// folded in (fp32 on the CPU backend, bf16 weights on CUDA). prefill(layer) de-RoPEs the
// cached keys, assigns those outside the dense part to their nearest centroid and builds the
// per-(sequence, kv head) CSR. decode(layer): routes the group's pre-RoPE queries (q_pre,
// required) to the top-l clusters, attends exactly to their members plus the sink and the
// recent window (CUDA: one kernel that resolves the members to KV rows and attends them,
// saap::attend_cuda), then indexes the tokens that have left the recent window (every
// index_every steps). Layers in SaapConfig::dense_layers are attended in full; any other
// layer must have an index in the parts, or prefill/decode throw naming it.
//
// CUDA: a layer's index step is part of its decode's kernels (saap::attend_cuda): its
// attention's parts score the keys to index against the centroids, and its merge kernel
// commits them and folds, so a decode leaves no work behind it and a step may be captured in
// a CUDA graph layer by layer. index_state, last_read and last_clusters read what the
// caller's stream has finished: synchronize it first.
//
// Memory: the router weights of every indexed layer live on the backend from construction
// (bf16: 2 bytes per MLP weight); a layer's index is allocated at its first prefill for
// (max_batch, max_context): CSR offsets (C + 1), members and assignments (4 bytes per token
// each) per (sequence, kv head), and on CUDA the index step's best per key (8 bytes each of
// kMaxIndexStep). Decode allocates nothing; its scratch is the workspace.
//
// Stats: kv_rows_read counts the attended rows per kv head (sink + clusters + window);
// selection_bytes_read the router weights (or centroids for the nearest-centroid router)
// read per kv head, the probed CSR offsets and the scanned post-prefill assignments.
#pragma once

#include <vector>

#include "kernels/saap/saap.h"
#include "runtime/engine.h"
#include "runtime/engine_support.h"
#include "runtime/saap_parts.h"

namespace kvs {

// Whether a CUDA SAAP engine stores the router's w2 in column blocks, whose GEMV skips zero
// hidden units (kernels/saap/saap.h, Router::w2_column_blocks): only for one sequence. At
// batch 2 and more the union of the rows' nonzero units is nearly all of w2, and the fragment
// order streams that faster (docs/gpu.md).
inline bool saap_w2_in_column_blocks(int max_batch) { return max_batch == 1; }

class SaapEngine : public Engine {
 public:
  SaapEngine(const ModelShape& shape, const EngineConfig& config, SaapParts parts);
  ~SaapEngine() override;
  SaapEngine(const SaapEngine&) = delete;
  SaapEngine& operator=(const SaapEngine&) = delete;

  Method method() const override { return Method::Saap; }
  Backend backend() const override { return config_.backend; }
  size_t workspace_bytes() const override;
  void prefill(int layer, const PagedKV& kv, cudaStream_t stream) override;
  void decode(int layer, const bf16* q, const bf16* q_pre, const PagedKV& kv, bf16* out, float* lse,
              cudaStream_t stream) override;
  EngineStats stats() const override;
  void reset_stats() override;
  std::vector<std::vector<int32_t>> last_read(int layer, int b) const override;

  const SaapConfig& saap_config() const { return config_.saap; }
  const SaapParts& parts() const { return parts_; }
  int max_context() const { return max_context_; }
  bool is_dense_layer(int layer) const;

  // The clusters selected for (b, kv head h) by the last decode of `layer` (CPU) or by the
  // last decode call (CUDA: copies from the workspace and synchronizes), in rank order.
  std::vector<int32_t> last_clusters(int layer, int b, int h) const;
  // The layer's index (host pointers on the CPU backend, device pointers on CUDA); throws
  // std::logic_error before the layer's first prefill.
  const kernels::saap::IndexState& index_state(int layer) const;
  // The phase of the layer's index steps (SaapConfig::index_phase; kernels/saap/saap.h,
  // index_step_count): it indexes on the steps where the tokens past the window + phase are a
  // multiple of index_every.
  int index_phase(int layer) const;

 private:
  struct LayerRouter {
    // CPU: host arrays (with fp8, w1 and w2 dequantized); CUDA: device buffers (w1 in the
    // first GEMV's fragment order; w2 in column blocks when max_batch is 1, else in fragment
    // order: w2_column_blocks).
    std::vector<float> centroids, norms, w1, b1, w2, b2;
    float* d_centroids = nullptr;
    float* d_norms = nullptr;
    bf16* d_w1 = nullptr;
    float* d_b1 = nullptr;
    bf16* d_w2 = nullptr;
    float* d_b2 = nullptr;
    // CUDA, SaapWeights::Fp8 (d_w1, d_w2 null): e4m3 rows and their scales.
    uint8_t* d_w1_e4m3 = nullptr;
    float* d_w1_scale = nullptr;
    uint8_t* d_w2_e4m3 = nullptr;
    float* d_w2_scale = nullptr;
    bool w2_column_blocks = false;
  };
  struct LayerIndex {
    kernels::saap::IndexState view;
    std::vector<int32_t> offsets, members, assign, indexed_len, csr_len;  // CPU storage
    bool allocated = false;
  };

  kernels::saap::Window window() const;
  kernels::saap::Router<float> cpu_router(int slot) const;
  kernels::saap::Router<bf16> cuda_router(int slot) const;
  int require_slot(int layer, const char* who) const;
  LayerIndex& allocate_index(int layer);
  void decode_cpu(int layer, const bf16* q, const bf16* q_pre, const PagedKV& kv, bf16* out,
                  float* lse);
  uint64_t router_bytes_per_kv_head() const;
  // Workspace (CUDA): selected clusters | token lists | router scratch | attention states or
  // dense decode.
  size_t selected_bytes() const;
  size_t lists_bytes() const;
  size_t route_bytes() const;       // decode_select_cuda's scratch
  size_t select_bytes() const;      // everything before the dense decode workspace
  int32_t* selected_ptr() const;
  kernels::tactic::Selection lists() const;

  SaapParts parts_;
  int max_context_ = 0;
  std::vector<LayerRouter> routers_;  // parallel to parts_.layers
  std::vector<LayerIndex> index_;     // per model layer
  std::vector<float> inv_freq_;
  float* d_inv_freq_ = nullptr;
  EngineStats host_stats_;
  // CPU backend: per layer, per (b * Hkv + h): the tokens attended and clusters selected.
  std::vector<std::vector<std::vector<int32_t>>> last_tokens_, last_clusters_;
  DeviceCounters device_counters_;  // CUDA: [rows read, selection bytes, context rows]
};

}  // namespace kvs
