// AttentionPredictor behind the Engine interface (spec shared/specs/attnpred.md; kernels in
// kernels/attnpred/attnpred.h).
//
// Per compressed layer the engine keeps the block-pooled attention history of every query
// head (fp32 ring of `history` rows, on the device for CUDA). decode(layer) at a step whose
// sequence has n tokens:
//   1. attends the tokens selected at the previous step (sink, recent, the predicted blocks);
//      the first warmup_steps decodes after a prefill attend every token instead;
//   2. appends a history row: the softmax of q.k over the attended tokens, max-pooled (0 for
//      blocks not attended; GPU-resident, steps 1 and 2 are two kernels, the attention
//      keeping each block's largest score: kernels/attnpred/attnpred.h sparse_attend_cuda);
//      on warm-up steps and every calibration_period-th step the FULL
//      row over all n tokens instead (a separate score kernel over all keys: the output is
//      still the sparse attention, as the paper does; only the history is calibrated). Layer
//      l's calibration phase is shifted by l, so a step's full rows are spread over the
//      layers; GPU-resident, a full row runs on a calibration lane (a branch stream,
//      kCalibLanes of them) from a copy of the query, beside the later layers' steps, over
//      the cache's keys or (AttnPredConfig::calibration_keys e4m3) the layer's e4m3 copy;
//   3. predicts the next step's block scores with the CNN and takes each query head's top
//      (budget - sink - recent) / block candidate blocks; GPU-resident, on a prediction lane
//      (predict_lanes()) that the decode of the last sparse layer joins, so that it runs
//      beside the later layers' steps (the paper's cross-layer overlap: the selection for
//      step t+1 is needed only at step t+1); the last kDeferredLayers sparse layers defer
//      their calibration rows and predictions to the next step's start, so that the step's
//      end does not wait for them. On CUDA the CNN is incremental
//      (kernels/attnpred/attnpred.h CnnCache: 4 + k of the `history` conv rows for k rows
//      appended since the last prediction); its cache doubles the history's device memory
//      (one fp32 value per history cell). With predict_interval P > 1 this step runs on the
//      warm-up steps and every P-th step after them, layer l's phase shifted by l so that
//      each step predicts for about 1 / P of the layers; the steps between keep the block
//      flags, so they attend the same predicted blocks, with sink and recent tokens taken
//      from their own context length.
// The prefill gives the engine keys but no queries, so it cannot compute the paper's prefill
// history (the last 64 prompt queries' rows); the warm-up steps build it instead, and until
// `history` rows exist the older rows are zeros.
//
// GQA (the paper is silent; its code selects per query head), two forms:
//  - per query head (group_history 0): each query head keeps its history, predicts and
//    selects its own top-K, and the kv head attends the union of its group's blocks once, so
//    each KV block is read once per kv head; the read can reach group_size x the budget when
//    the heads disagree (the fidelity choice of spec 8.6a; stats report the rows read);
//  - per kv head (group_history 1): one history per kv head, whose row is the largest of its
//    query heads' pooled probabilities (a block matters when it matters to any head of the
//    group), one CNN input and one top-K per kv head: every query head attends exactly the
//    budget, and the predictor, the top-K and the history rows cost group_size times less.
//    A bundle trained that way (kvs-train attnpred --group-history) says so, and the engine
//    follows it unless the config overrides.
//
// Offload mode (AttnPredConfig::offload, CUDA): the caller's KV is in pinned mapped host
// memory. Each layer has a device block cache (slots of `block` tokens per kv head). At the
// end of decode(layer) at step t, after the selection for t+1 is made, an event is recorded
// and a side stream makes the blocks step t+1 needs resident (blocks no longer needed free
// their slots; missing ones are copied by a kernel reading the mapped host memory, so the
// block list never leaves the GPU). decode(layer) at t+1 waits on that layer's prefetch
// event (a wait only when it is late: a probe kernel counts those), then copies the block
// holding the newest token (it did not exist at prefetch time: every block at or past the
// prefetch's length snapshot, should the sequence have grown by more than one token) and any
// block still missing, on the main stream. The prefetch reuses slots the step-t attention
// read, so it waits on an event recorded after that attention and its history row. Calibration rows
// read the full K from host memory (1/M of a full-K transfer per step); warm-up steps attend the
// host KV directly (zero-copy dense). Offload decode keeps state across steps on two streams and is
// not meant for CUDA graph capture; GPU-resident decode is (one graph per phase of the step
// count modulo lcm(calibration_period, predict_interval): the phase is host state). A captured
// step must include the decode of the last sparse layer, which joins the branches.
#pragma once

#include <memory>
#include <vector>

#include "kernels/attnpred/attnpred.h"
#include "runtime/engine.h"
#include "runtime/engine_support.h"

namespace kvs {

// The stored parts of the method (the bundle's attnpred group; a trained file's group).
//   dataset cnn_params float32 [4833] (packed as kernels/attnpred/attnpred.h kParam*)
//   attrs   history, block, sink, recent, budget_tokens, calibration_period (int),
//           dense_layers (int list), param_layout (string), group_history (int 0/1;
//           absent in bundles written before it: 0)
struct AttnPredParams {
  std::vector<float> cnn;
  int history = 64;
  int block = 16;
  int sink = 64;
  int recent = 64;
  int budget_tokens = 1024;
  int calibration_period = 5;
  std::vector<int> dense_layers = {0, 1};
  /// The CNN was trained on rows of the group's largest probabilities (a history per kv
  /// head, AttnPredConfig::group_history), not on each query head's.
  bool group_history = false;
};

// Reads and checks (shape, knob ranges, finite weights) a group; throws naming the group.
AttnPredParams load_attnpred_params(const h5::Group& group, const ModelShape& shape);
void write_attnpred_params(const h5::Group& group, const AttnPredParams& params);

class AttnPredEngine : public Engine {
 public:
  AttnPredEngine(const ModelShape& shape, const EngineConfig& config, const AttnPredParams& params);
  ~AttnPredEngine() override;
  AttnPredEngine(const AttnPredEngine&) = delete;
  AttnPredEngine& operator=(const AttnPredEngine&) = delete;

  /// GPU-resident: the sparse step launches at the device's greatest priority
  /// (sparse_attend_cuda) and the calibration rows at the least. Up to this predict_interval
  /// the predictions are what a step waits for at its join, and they run at the greatest
  /// priority too (over 32 layers at 128K grouped on an H200, 55.6-55.8 us a step at P 1
  /// against 57.2-57.4 at the least). Above it they run kPredictRaise levels above the least,
  /// ahead of the calibration rows: 29.7 us at P 4 against 30.1 at the least (any raise of 1
  /// to 4 the same; docs/gpu.md, 2026-11-30).
  static constexpr int kUrgentPredictInterval = 2;
  static constexpr int kPredictRaise = 2;
  /// GPU-resident: the calibration rows and the predictions each run on lanes of branches,
  /// a layer's on lane (layer / period or interval) % lanes, so that the layers that calibrate
  /// (or predict) in one step, `period` (`interval`) apart, alternate lanes and the lanes'
  /// chains run side by side rather than one after another. Over 32 layers at 128K grouped on
  /// an H200, against one branch each: P 4 29.7 us a step against 31.6 (3 or 4 lanes
  /// 29.8), P 2 41.3 against 44.7 (4 lanes 42.5), P 1 with 4 prediction lanes 43.7 against
  /// 55.7 (2 lanes 46.4, 3 lanes 44.1).
  static constexpr int kCalibLanes = 2;
  static int predict_lanes(int interval) { return interval == 1 ? 4 : 2; }
  /// GPU-resident: the last this many sparse layers (never the first) defer their calibration
  /// row and prediction to the next step, launched by its first sparse layer's decode. Every
  /// lane a step forks is joined at that step's end (a captured step must be whole), so the
  /// branches forked by the last layers held the step's end until they finished, while their
  /// results are needed only by the same layer's next decode, near the next step's end. A
  /// deferred row reads the query copy and a snapshot of the lengths taken in its own step.
  /// Over 32 layers at 128K grouped on an H200: P 4 29.0 us a layer-step against 29.3 (and
  /// 29.2-29.3 against 29.3-29.4 on another card), P 1 43.0 against 43.4, P 20 25.7 against
  /// 25.9; deferring 6 or 8 layers lost (29.6, 30.1), 2 the same as 4. It is what lets the
  /// calibration row run thin, in one wave (attnpred.cu, row_max_ring_kernel): 28.3 at P 4.
  static constexpr int kDeferredLayers = 4;

  Method method() const override { return Method::AttnPred; }
  Backend backend() const override { return config_.backend; }
  size_t workspace_bytes() const override;
  void prefill(int layer, const PagedKV& kv, cudaStream_t stream) override;
  void decode(int layer, const bf16* q, const bf16* q_pre, const PagedKV& kv, bf16* out, float* lse,
              cudaStream_t stream) override;
  EngineStats stats() const override;
  void reset_stats() override;
  std::vector<std::vector<int32_t>> last_read(int layer, int b) const override;

  const kernels::attnpred::Geometry& geometry() const { return geo_; }
  int budget_tokens() const { return budget_; }
  int k_blocks() const { return k_blocks_; }
  int calibration_period() const { return period_; }
  int predict_interval() const { return interval_; }
  int max_context() const { return max_context_; }
  int max_blocks() const { return max_blocks_; }
  int max_selected_tokens() const { return max_tokens_; }
  int max_list_blocks() const { return list_cap_; }  ///< blocks a kv head attends at most
  int slots_per_head() const { return slots_per_head_; }
  bool is_dense_layer(int layer) const;

  struct OffloadStats {
    uint64_t prefetches = 0;         ///< side-stream prefetches issued (one per layer step)
    uint64_t late_prefetches = 0;    ///< of them, not finished when decode reached them
    uint64_t blocks_prefetched = 0;  ///< blocks copied on the side stream
    uint64_t blocks_on_demand = 0;   ///< blocks copied inside decode (newest-token blocks, misses)
    uint64_t selection_errors = 0;   ///< tokens selected but not resident or over capacity (0)
  };
  OffloadStats offload_stats() const;

  /// GPU-resident: launches, on `stream`, the calibration rows and predictions the last decode
  /// step deferred (kDeferredLayers), which otherwise run with the next step, and makes
  /// `stream` wait for them: for the end of an eager decode loop, before inspecting the
  /// history or reading stats() (which count what has run). Never between replays of a
  /// captured loop: the next replay's first step launches them, and they would run twice.
  void complete_deferred(cudaStream_t stream);

  // Inspection (tests, tools): host copies of a layer's state; on CUDA they synchronize. A
  // layer that deferred its row and prediction shows them once they have run
  // (complete_deferred, or the next step).
  std::vector<uint8_t> block_flags(int layer) const;    ///< [max_batch, Hkv, max_blocks], next step
  std::vector<float> history_rows(int layer) const;     ///< [max_batch, Hq, history, max_blocks]
  std::vector<int32_t> history_count(int layer) const;  ///< [max_batch]
  // Offload: the blocks resident for (b, kv head h) of `layer`, ascending; waits for the
  // layer's prefetch.
  std::vector<int32_t> resident_blocks(int layer, int b, int h) const;
  // Offload: the K and V rows (row-major [blocks, block, d]) of every block resident for
  // (b, kv head h) of `layer`, with the block ids ascending; waits for the layer's prefetch.
  // This is the state the NEXT decode starts from: the prefetch frees and reuses the slots
  // the last decode attended, so that decode's rows cannot be inspected afterwards (its
  // attention is checked through its output and history row instead).
  void resident_rows(int layer, int b, int h, std::vector<int32_t>* blocks, std::vector<bf16>* keys,
                     std::vector<bf16>* values) const;

 private:
  struct LayerState;
  LayerState& allocate_layer(int layer);
  // Makes `stream` wait for the layer's calibration row and prediction while they are still on
  // their branches.
  void wait_for_branches(LayerState& ls, cudaStream_t stream);
  // CUDA: the layer's calibration row from q over all of kv's keys (host keys in offload
  // mode), appended to its history, and its bytes counted.
  void full_row_cuda(const LayerState& ls, const bf16* q, const PagedKV& kv, void* scratch,
                     size_t scratch_bytes, cudaStream_t stream) const;
  // GPU-resident: a layer's calibration row (from its query copy, over `kv`) and prediction on
  // their lanes (calib_lane(), predict_lane()), forked from `from`, the prediction after
  // row_done (the event of the step's history row on another lane, or null). Records the
  // layer's events; the caller marks the lanes forked.
  void launch_branches(const LayerState& ls, int layer, const PagedKV& kv, bool full_row,
                       bool predicting, cudaEvent_t row_done, cudaStream_t from) const;
  // The branches the last step deferred (deferred_), launched: forked from `stream` by the
  // first sparse layer's decode, the step's lanes then joined as usual.
  void launch_deferred(cudaStream_t stream);
  // `stream` waits for the lanes forked since the last join (the end of a step).
  void join_lanes(cudaStream_t stream);
  bool defers(int layer) const;
  void decode_cpu(int layer, const bf16* q, const PagedKV& kv, bf16* out, float* lse);
  // Query head qh's history row: the softmax of q.k over `tokens` (all n when null),
  // max-pooled into blocks.
  std::vector<float> pooled_row_cpu(const float* q, const PagedKV& kv, int b, int qh,
                                    const int32_t* tokens, int count, double scale) const;
  void predict_cpu(LayerState& ls, int batch);
  kernels::tactic::Selection selection() const;  // CUDA: the workspace's selection arrays
  size_t selection_bytes() const;
  // CUDA: the sparse step's workspace (GPU-resident: sparse_attend_cuda's; offload: the
  // sparse history row's scratch).
  size_t sparse_step_bytes() const;

  kernels::attnpred::Geometry geo_;
  // Whether decode call c (0-based since the prefill) of `layer` predicts the next selection:
  // every warm-up step, then every interval-th step, the layers' phases staggered so that
  // each step predicts for about 1 / interval of them.
  bool predicts(int c, int layer) const {
    return c < warmup_ || (c - warmup_ + 1 + layer) % interval_ == 0;
  }
  // Whether decode call c of `layer` appends a full (calibration) row: every warm-up step, then
  // every period-th step, the layers' phases staggered like the predictions', so that a step's
  // reads of all of K are spread over the steps (GPU-resident, they run on the predictor's
  // branch beside the other layers).
  bool calibrates(int c, int layer) const {
    return c < warmup_ || (c + 1 + layer) % period_ == 0;
  }

  int budget_ = 0, k_blocks_ = 0, period_ = 0, warmup_ = 1, interval_ = 1;
  int hist_group_ = 1;  // query heads per history (AttnPredConfig::group_history)
  // AttnPredConfig::calibration_keys: a key copy for the rows (e4m3 or int4), and its format
  bool copy_keys_ = false;
  kernels::attnpred::KeyFormat copy_format_ = kernels::attnpred::KeyFormat::E4m3;
  int max_context_ = 0, max_blocks_ = 0, max_tokens_ = 0, slots_per_head_ = 0;
  int list_cap_ = 0;  // blocks a kv head attends at most (the sparse step's lists)
  std::vector<int> dense_layers_;
  std::vector<float> host_params_;
  float* device_params_ = nullptr;
  std::vector<LayerState> layers_;
  EngineStats host_stats_;
  DeviceCounters counters_;             // CUDA (see attnpred_engine.cpp)
  cudaStream_t side_stream_ = nullptr;  // offload prefetch stream
  // CUDA, GPU-resident mode: the calibration rows' branches and the predictor's (prediction
  // and top-K of a layer run there after its history row), beside the later layers' steps and
  // each other: lanes of each kind (kCalibLanes, predict_lanes(); calib_lane(), predict_lane()).
  // decode(last_sparse_) joins those the step forked.
  std::vector<std::unique_ptr<OwnedStreamFork>> calib_lanes_, predict_lanes_;
  std::vector<char> calib_forked_, predict_forked_;  // lanes forked in the step under way
  // The sparse steps' history rows (sparse_row_cuda), at the greatest priority: each layer's
  // row is read only by its prediction and its next decode, so it leaves the step's chain.
  // Over 32 layers at 128K grouped on an H200: P 4 28.1 / 28.1 us a layer-step against
  // 28.6 / 28.4, P 1 40.5 against 42.0, P 20 / M 20 19.7 against 20.0 (docs/gpu.md,
  // 2026-11-30, fifth session).
  std::unique_ptr<OwnedStreamFork> row_lane_;
  bool row_forked_ = false;
  int calib_lane(int layer) const { return layer / period_ % int(calib_lanes_.size()); }
  int predict_lane(int layer) const { return layer / interval_ % int(predict_lanes_.size()); }
  int last_sparse_ = -1;   // the highest layer that is not dense
  int first_sparse_ = -1;  // the lowest
  int deferred_layers_ = kDeferredLayers;
  // GPU-resident: the branches of the last step's late layers (defers()), not yet launched:
  // the layer, what it deferred, and its KV view with the lengths of its step (len_snapshot).
  struct Deferred {
    int layer = 0;
    bool full_row = false, predicting = false;
    PagedKV kv;
  };
  std::vector<Deferred> deferred_;
  uint64_t prefetches_ = 0;
};

}  // namespace kvs
