#include "runtime/attnpred_engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "artifacts/capture_file.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/kv_update.h"
#include "kernels/dense/dense_decode.h"

namespace kvs {
namespace {

namespace ap = kernels::attnpred;
namespace tk = kernels::tactic;

std::string str(int64_t x) { return std::to_string(x); }
size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

// Device counters: what each kernel adds to (pairs are [count, errors] of one call site).
enum Counter {
  kRowsRead = 0,          // build_selection, sparse_attend: rows attended
  kSelectionErrors = 1,   // build_selection, sparse_attend: non-resident or over-capacity
  kContextRows = 2,       // kv_count_rows: a dense read's rows
  kBlocksPrefetched = 3,  // make_resident on the side stream
  kPrefetchErrors = 4,    //   (slots exhausted: never, by construction)
  kBlocksOnDemand = 5,    // make_resident inside decode
  kOnDemandErrors = 6,
  kLate = 7,             // prefetch probe
  kFullRowKeyBytes = 8,  // calibration rows: K bytes read
  kNumCounters = 9,
};

void need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

}  // namespace

// ---- stored parts ---------------------------------------------------------------------------

AttnPredParams load_attnpred_params(const h5::Group& g, const ModelShape& shape) {
  const std::string who = g.describe() + ": ";
  AttnPredParams p;
  const h5::Dataset d = h5::open_dataset(g, "cnn_params", h5::DType::F32, {ap::kParamCount});
  p.cnn = d.read<float>();
  for (size_t i = 0; i < p.cnn.size(); ++i)
    need(std::isfinite(p.cnn[i]), who + "cnn_params[" + str(int64_t(i)) + "] is not finite");
  p.history = int(g.attr_int("history"));
  p.block = int(g.attr_int("block"));
  p.sink = int(g.attr_int("sink"));
  p.recent = int(g.attr_int("recent"));
  p.budget_tokens = int(g.attr_int("budget_tokens"));
  p.calibration_period = int(g.attr_int("calibration_period"));
  p.dense_layers.clear();
  for (int64_t l : g.attr_ints("dense_layers")) p.dense_layers.push_back(int(l));
  try {
    ap::validate(ap::Geometry{p.history, p.block, p.sink, p.recent});
  } catch (const std::exception& e) {
    throw std::invalid_argument(who + e.what());
  }
  need(p.budget_tokens >= p.sink + p.recent && (p.budget_tokens - p.sink - p.recent) % p.block == 0,
       who + "budget_tokens " + str(p.budget_tokens) + " must be sink + recent (" +
           str(p.sink + p.recent) + ") plus a multiple of block " + str(p.block));
  need(p.calibration_period >= 1,
       who + "calibration_period must be >= 1, got " + str(p.calibration_period));
  for (int l : p.dense_layers)
    need(l >= 0 && l < shape.num_layers,
         who + "dense_layers entry " + str(l) + " outside [0, " + str(shape.num_layers) + ")");
  if (g.has_attr("group_history")) {
    const int64_t gh = g.attr_int("group_history");
    need(gh == 0 || gh == 1, who + "group_history " + str(gh) + " is not 0 or 1");
    p.group_history = gh == 1;
  }
  if (g.has_attr("param_layout"))
    need(g.attr_string("param_layout") == "conv1.w,conv1.b,conv2.w,conv2.b,conv3.w,conv3.b",
         who + "param_layout '" + g.attr_string("param_layout") + "' is not the packed order");
  return p;
}

void write_attnpred_params(const h5::Group& g, const AttnPredParams& p) {
  if (p.cnn.size() != size_t(ap::kParamCount))
    throw std::invalid_argument("write_attnpred_params: " + str(int64_t(p.cnn.size())) +
                                " CNN parameters, expected " + str(ap::kParamCount));
  h5::write_dataset(g, "cnn_params", p.cnn, {ap::kParamCount});
  g.set_attr_string("param_layout", "conv1.w,conv1.b,conv2.w,conv2.b,conv3.w,conv3.b");
  g.set_attr_int("history", p.history);
  g.set_attr_int("block", p.block);
  g.set_attr_int("sink", p.sink);
  g.set_attr_int("recent", p.recent);
  g.set_attr_int("budget_tokens", p.budget_tokens);
  g.set_attr_int("calibration_period", p.calibration_period);
  std::vector<int64_t> dl(p.dense_layers.begin(), p.dense_layers.end());
  g.set_attr_ints("dense_layers", dl);
  g.set_attr_int("group_history", p.group_history ? 1 : 0);
}

// ---- engine -------------------------------------------------------------------------------

const char* to_string(CalibrationKeys k) {
  return k == CalibrationKeys::Bf16 ? "bf16" : k == CalibrationKeys::E4m3 ? "e4m3" : "int4";
}

CalibrationKeys calibration_keys_from_string(const std::string& name) {
  if (name == "bf16") return CalibrationKeys::Bf16;
  if (name == "e4m3") return CalibrationKeys::E4m3;
  if (name == "int4") return CalibrationKeys::Int4;
  throw std::invalid_argument("unknown AttentionPredictor calibration key format '" + name +
                              "' (known: bf16, e4m3, int4)");
}

struct AttnPredEngine::LayerState {
  bool allocated = false;
  int calls = 0;  // decodes since the layer's prefill
  ap::HistoryState hist;
  ap::CnnCache cnn;          // CUDA: the predictor's per-row cache beside the history
  uint8_t* flags = nullptr;  // [max_batch, Hkv, max_blocks]
  float* scores = nullptr;   // CUDA: the CNN's scores [max_batch, history heads, max_blocks]
  // CPU storage
  std::vector<float> host_rows;
  std::vector<int32_t> host_count, host_tokens;
  std::vector<uint8_t> host_flags;
  std::vector<std::vector<int32_t>> last_tokens;  // [b * Hkv + h]
  // CUDA offload (and GPU-resident, a deferred calibration row's lengths)
  ap::BlockCache cache;
  int32_t* len_snapshot = nullptr;
  unsigned int* done = nullptr;
  unsigned int expected_done = 0;
  bool prefetch_pending = false;
  cudaEvent_t selected = nullptr, prefetched = nullptr;
  // CUDA GPU-resident: this layer's calibration row and prediction on their lanes, not yet
  // joined; the copy of the query its calibration row reads (the caller's buffer may
  // hold the next layer's by then).
  bool calibration_pending = false, prediction_pending = false;
  cudaEvent_t calibrated = nullptr, predicted = nullptr;
  bf16* q_copy = nullptr;
  // GPU-resident: the sparse step's history row, written on the row lane from these inputs.
  ap::SparseRow row;
  bool row_pending = false;
  cudaEvent_t rowed = nullptr;
  ap::KeyCopy keys;  // CUDA, calibration_keys e4m3 or int4: the calibration rows' keys
};

AttnPredEngine::AttnPredEngine(const ModelShape& shape, const EngineConfig& config,
                               const AttnPredParams& params)
    : Engine(shape, config) {
  const AttnPredConfig& c = config_.attnpred;
  need(params.cnn.size() == size_t(ap::kParamCount),
       "attnpred engine: " + str(int64_t(params.cnn.size())) + " CNN parameters, expected " +
           str(ap::kParamCount));
  geo_.history = params.history;
  geo_.block = params.block;
  geo_.sink = c.sink_tokens >= 0 ? c.sink_tokens : params.sink;
  geo_.recent = c.recent_tokens >= 0 ? c.recent_tokens : params.recent;
  try {
    ap::validate(geo_);
  } catch (const std::exception& e) {
    throw std::invalid_argument(std::string("AttnPredConfig: ") + e.what() +
                                " (sink_tokens / recent_tokens)");
  }
  budget_ = c.budget_tokens > 0 ? c.budget_tokens : params.budget_tokens;
  need(budget_ >= geo_.sink + geo_.recent && (budget_ - geo_.sink - geo_.recent) % geo_.block == 0,
       "AttnPredConfig: budget_tokens " + str(budget_) + " must be sink + recent (" +
           str(geo_.sink + geo_.recent) + ") plus a multiple of the block " + str(geo_.block));
  k_blocks_ = (budget_ - geo_.sink - geo_.recent) / geo_.block;
  period_ = c.calibration_period > 0 ? c.calibration_period : params.calibration_period;
  need(period_ >= 1, "AttnPredConfig: calibration_period must be >= 1, got " + str(period_));
  interval_ = c.predict_interval;
  need(interval_ >= 1, "AttnPredConfig: predict_interval must be >= 1, got " + str(interval_));
  warmup_ = c.warmup_steps;
  need(warmup_ >= 1,
       "AttnPredConfig: warmup_steps must be >= 1 (the first decode has no "
       "history to predict from), got " +
           str(warmup_));
  dense_layers_ = c.dense_layers ? *c.dense_layers : params.dense_layers;
  for (int l : dense_layers_)
    need(l >= 0 && l < shape_.num_layers, "AttnPredConfig: dense_layers entry " + str(l) +
                                              " outside [0, " + str(shape_.num_layers) + ")");
  max_context_ = c.max_context > 0 ? c.max_context : shape_.max_position;
  need(max_context_ > 0, "AttnPredConfig: max_context is 0 and the model's max_position is 0");
  // One more than the context's blocks when it is a multiple of the block: the candidates
  // reach the block of the next step's token (Geometry::candidate_end).
  max_blocks_ = geo_.num_blocks(max_context_ + 1);
  const int g = shape_.group_size();
  // A kv head attends the union of its histories' top-K: group_size of them per query head,
  // one when grouped.
  need(c.group_history >= -1 && c.group_history <= 1,
       "AttnPredConfig: group_history must be -1 (the bundle's), 0 or 1, got " +
           str(c.group_history));
  hist_group_ = (c.group_history < 0 ? params.group_history : c.group_history == 1) ? g : 1;
  const int tops = g / hist_group_;
  max_tokens_ = int(std::min<int64_t>(max_context_, int64_t(geo_.sink) + geo_.recent + geo_.block +
                                                        int64_t(tops) * k_blocks_ * geo_.block));
  // Blocks a kv head attends at most: sink blocks, the tops' flagged blocks, and the recent
  // window's (one more when it does not start on a block).
  list_cap_ = int(std::min<int64_t>(
      max_blocks_,
      int64_t(geo_.sink / geo_.block) + int64_t(tops) * k_blocks_ + geo_.recent / geo_.block + 1));
  slots_per_head_ = geo_.sink / geo_.block + tops * k_blocks_ + geo_.recent / geo_.block + 2;
  host_params_ = params.cnn;
  need(!c.offload || config_.backend == Backend::Cuda,
       "AttnPredConfig: offload needs the CUDA backend");
  copy_keys_ = c.calibration_keys != CalibrationKeys::Bf16;
  copy_format_ =
      c.calibration_keys == CalibrationKeys::Int4 ? ap::KeyFormat::Int4 : ap::KeyFormat::E4m3;
  need(!(copy_keys_ && c.offload), std::string("AttnPredConfig: calibration_keys ") +
                                       to_string(c.calibration_keys) +
                                       " needs GPU-resident mode (offload's calibration "
                                       "rows read the keys in host memory)");
  need(!copy_keys_ || config_.backend != Backend::Cuda || geo_.block == 8 || geo_.block == 16,
       std::string("attnpred engine (cuda): calibration_keys ") + to_string(c.calibration_keys) +
           " needs a block of 8 or 16 tokens, the "
           "bundle's is " +
           str(geo_.block));
  if (config_.backend == Backend::Cuda) {
    need(
        shape_.head_dim == 64 || shape_.head_dim == 128,
        "attnpred engine (cuda): head_dim " + str(shape_.head_dim) + " is not supported (64, 128)");
    need(g <= 8, "attnpred engine (cuda): group size " + str(g) + " above 8");
    need(slots_per_head_ * sizeof(int) <= 48 * 1024,
         "attnpred engine (cuda): budget " + str(budget_) + " needs " + str(slots_per_head_) +
             " cache slots per kv head, above 12288");
    device_params_ = device_alloc<float>(ap::kParamCount);
    copy_to_device(device_params_, host_params_.data(), host_params_.size() * sizeof(float));
    counters_ = DeviceCounters(kNumCounters);
    if (c.offload) KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
    if (!c.offload) {
      for (int i = 0; i < kCalibLanes; ++i)
        calib_lanes_.push_back(std::make_unique<OwnedStreamFork>());
      for (int i = 0; i < predict_lanes(interval_); ++i)
        predict_lanes_.push_back(
            std::make_unique<OwnedStreamFork>(interval_ <= kUrgentPredictInterval, kPredictRaise));
      row_lane_ = std::make_unique<OwnedStreamFork>(true);
      calib_forked_.assign(calib_lanes_.size(), 0);
      predict_forked_.assign(predict_lanes_.size(), 0);
    }
  }
  layers_.resize(size_t(shape_.num_layers));
  for (int l = 0; l < shape_.num_layers; ++l)
    if (!is_dense_layer(l)) {
      last_sparse_ = l;
      if (first_sparse_ < 0) first_sparse_ = l;
    }
}

bool AttnPredEngine::defers(int layer) const {
  if (calib_lanes_.empty() || layer == first_sparse_) return false;
  int later = 0;  // sparse layers after this one
  for (int l = layer + 1; l <= last_sparse_; ++l) later += !is_dense_layer(l);
  return later < deferred_layers_;
}

AttnPredEngine::~AttnPredEngine() {
  if (config_.backend != Backend::Cuda) return;
  // A prefetch may still be copying into a layer's block cache on the side stream.
  if (side_stream_) cudaStreamSynchronize(side_stream_);
  calib_lanes_.clear();  // their streams drain first
  predict_lanes_.clear();
  row_lane_.reset();
  for (LayerState& ls : layers_) {
    if (!ls.allocated) continue;
    if (ls.predicted) cudaEventDestroy(ls.predicted);
    if (ls.calibrated) cudaEventDestroy(ls.calibrated);
    if (ls.rowed) cudaEventDestroy(ls.rowed);
    cudaFree(ls.row.block_max);
    cudaFree(ls.row.block_ids);
    cudaFree(ls.row.block_count);
    cudaFree(ls.row.lse);
    cudaFree(ls.row.done);
    cudaFree(ls.q_copy);
    cudaFree(ls.keys.k);
    cudaFree(ls.keys.scale);
    cudaFree(ls.keys.len);
    cudaFree(ls.len_snapshot);
    cudaFree(ls.hist.rows);
    cudaFree(ls.hist.count);
    cudaFree(ls.hist.tokens);
    cudaFree(ls.cnn.s);
    cudaFree(ls.cnn.edge);
    cudaFree(ls.cnn.count);
    cudaFree(ls.cnn.end);
    cudaFree(ls.cnn.sum);
    cudaFree(ls.cnn.frags);
    cudaFree(ls.flags);
    cudaFree(ls.scores);
    if (ls.cache.k) {
      cudaFree(ls.cache.k);
      cudaFree(ls.cache.v);
      cudaFree(ls.cache.block_slot);
      cudaFree(ls.cache.slot_block);
      cudaFree(ls.cache.copy_list);
      cudaFree(ls.cache.copy_count);
      cudaFree(ls.done);
      cudaEventDestroy(ls.selected);
      cudaEventDestroy(ls.prefetched);
    }
  }
  if (side_stream_) cudaStreamDestroy(side_stream_);
  cudaFree(device_params_);
}

bool AttnPredEngine::is_dense_layer(int layer) const {
  return std::find(dense_layers_.begin(), dense_layers_.end(), layer) != dense_layers_.end();
}

void AttnPredEngine::wait_for_branches(LayerState& ls, cudaStream_t stream) {
  if (ls.calibration_pending) KVS_CUDA_CHECK(cudaStreamWaitEvent(stream, ls.calibrated, 0));
  if (ls.prediction_pending) KVS_CUDA_CHECK(cudaStreamWaitEvent(stream, ls.predicted, 0));
  if (ls.row_pending) KVS_CUDA_CHECK(cudaStreamWaitEvent(stream, ls.rowed, 0));
  ls.calibration_pending = ls.prediction_pending = ls.row_pending = false;
}

void AttnPredEngine::full_row_cuda(const LayerState& ls, const bf16* q, const PagedKV& kv,
                                   void* scratch, size_t scratch_bytes, cudaStream_t stream) const {
  const int hkv = shape_.num_kv_heads;
  if (ls.keys.k)
    KVS_CUDA_CHECK(ap::append_full_row_from_copy_cuda(q, shape_.num_q_heads, kv, kv.batch,
                                                      float(shape_.scale()), geo_, ls.hist, ls.keys,
                                                      scratch, scratch_bytes, stream));
  else
    KVS_CUDA_CHECK(ap::append_row_cuda(q, shape_.num_q_heads, kv, nullptr, 0, kv.seq_lens, kv.batch,
                                       hkv, float(shape_.scale()), geo_, ls.hist, scratch,
                                       scratch_bytes, ls.cache.k != nullptr, stream));
  // A copy's bytes (a key and its scale); the few keys quantized are not counted.
  const int key_bytes =
      ls.keys.k ? ls.keys.key_bytes() + int(sizeof(float)) : shape_.head_dim * int(sizeof(bf16));
  if (config_.collect_stats)
    KVS_CUDA_CHECK(kernels::kv_count_rows_cuda(kv.seq_lens, kv.batch, hkv * key_bytes,
                                               counters_.get() + kFullRowKeyBytes, stream));
}

void AttnPredEngine::launch_branches(const LayerState& ls, int layer, const PagedKV& kv,
                                     bool full_row, bool predicting, cudaEvent_t row_done,
                                     cudaStream_t from) const {
  const int hq = shape_.num_q_heads, hkv = shape_.num_kv_heads;
  if (full_row) {
    const int lane = calib_lane(layer);
    const kernels::StreamFork& f = calib_lanes_[size_t(lane)]->get();
    KVS_CUDA_CHECK(kernels::fork_from(f, from));
    // The calibration rows of a lane share its scratch, so they run in order on it.
    const size_t scratch_bytes =
        align_up(ap::row_scratch_bytes(config_.max_batch, hq, max_blocks_ * geo_.block));
    void* scratch =
        static_cast<char*>(workspace_.ptr) + selection_bytes() + size_t(lane) * scratch_bytes;
    full_row_cuda(ls, ls.q_copy, kv, scratch, scratch_bytes, f.side);
    KVS_CUDA_CHECK(cudaEventRecord(ls.calibrated, f.side));
  }
  if (predicting) {
    const kernels::StreamFork& f = predict_lanes_[size_t(predict_lane(layer))]->get();
    KVS_CUDA_CHECK(kernels::fork_from(f, from));
    if (row_done) KVS_CUDA_CHECK(cudaStreamWaitEvent(f.side, row_done, 0));
    KVS_CUDA_CHECK(ap::predict_cuda(device_params_, ls.hist, ls.cnn, kv.batch, geo_, ls.scores,
                                    interval_, f.side));
    KVS_CUDA_CHECK(ap::select_blocks_cuda(ls.scores, ls.hist, kv.batch, hkv, geo_, k_blocks_,
                                          ls.flags, f.side));
    KVS_CUDA_CHECK(cudaEventRecord(ls.predicted, f.side));
  }
}

void AttnPredEngine::launch_deferred(cudaStream_t stream) {
  for (const Deferred& d : deferred_) {
    LayerState& ls = layers_[size_t(d.layer)];
    launch_branches(ls, d.layer, d.kv, d.full_row, d.predicting,
                    d.full_row ? ls.calibrated : nullptr, stream);
    if (d.full_row) calib_forked_[size_t(calib_lane(d.layer))] = 1;
    if (d.predicting) predict_forked_[size_t(predict_lane(d.layer))] = 1;
    ls.calibration_pending |= d.full_row;
    ls.prediction_pending |= d.predicting;
  }
  deferred_.clear();
}

void AttnPredEngine::complete_deferred(cudaStream_t stream) {
  if (deferred_.empty()) return;
  launch_deferred(stream);
  join_lanes(stream);
}

void AttnPredEngine::join_lanes(cudaStream_t stream) {
  // Only the lanes forked since the last join: a captured step that joined a lane it had not
  // forked would wait on an event recorded outside the capture.
  for (size_t i = 0; i < calib_lanes_.size(); ++i)
    if (calib_forked_[i]) KVS_CUDA_CHECK(kernels::join_into(calib_lanes_[i]->get(), stream));
  for (size_t i = 0; i < predict_lanes_.size(); ++i)
    if (predict_forked_[i]) KVS_CUDA_CHECK(kernels::join_into(predict_lanes_[i]->get(), stream));
  if (row_forked_) KVS_CUDA_CHECK(kernels::join_into(row_lane_->get(), stream));
  std::fill(calib_forked_.begin(), calib_forked_.end(), 0);
  std::fill(predict_forked_.begin(), predict_forked_.end(), 0);
  row_forked_ = false;
  for (LayerState& other : layers_)
    other.prediction_pending = other.calibration_pending = other.row_pending = false;
}

AttnPredEngine::LayerState& AttnPredEngine::allocate_layer(int layer) {
  LayerState& ls = layers_[size_t(layer)];
  if (ls.allocated) return ls;
  const int B = config_.max_batch, hq = shape_.num_q_heads, hkv = shape_.num_kv_heads;
  ap::HistoryState& h = ls.hist;
  h.max_batch = B;
  h.num_heads = hq / hist_group_;
  h.group = hist_group_;
  h.history = geo_.history;
  h.max_blocks = max_blocks_;
  const int64_t n_rows = int64_t(B) * h.num_heads * geo_.history * max_blocks_;
  const int64_t n_flags = int64_t(B) * hkv * max_blocks_;
  if (config_.backend == Backend::Cpu) {
    ls.host_rows.assign(size_t(n_rows), 0.f);
    ls.host_count.assign(size_t(B), 0);
    ls.host_tokens.assign(size_t(B), 0);
    ls.host_flags.assign(size_t(n_flags), 0);
    h.rows = ls.host_rows.data();
    h.count = ls.host_count.data();
    h.tokens = ls.host_tokens.data();
    ls.flags = ls.host_flags.data();
  } else {
    h.rows = device_alloc<float>(n_rows);
    h.count = device_alloc<int32_t>(B);
    h.tokens = device_alloc<int32_t>(B);
    ls.cnn.s = device_alloc<float>(int64_t(ap::CnnCache::s_floats(h)));
    ls.cnn.edge = device_alloc<float>(int64_t(ap::CnnCache::edge_floats(h)));
    ls.cnn.count = device_alloc<int32_t>(B);
    ls.cnn.end = device_alloc<int32_t>(B);
    ls.cnn.sum = device_alloc<long long>(int64_t(ap::CnnCache::sum_values(h)));
    ls.cnn.frags = device_alloc<uint32_t>(ap::kCnnFragWords);
    ls.flags = device_alloc<uint8_t>(n_flags);
    // A layer's own: predictions of different layers run side by side on the lanes.
    ls.scores = device_alloc<float>(int64_t(B) * h.num_heads * max_blocks_);
    if (!predict_lanes_.empty()) {
      KVS_CUDA_CHECK(cudaEventCreateWithFlags(&ls.predicted, cudaEventDisableTiming));
      KVS_CUDA_CHECK(cudaEventCreateWithFlags(&ls.calibrated, cudaEventDisableTiming));
      ls.q_copy = device_alloc<bf16>(int64_t(B) * hq * shape_.head_dim);
      ls.len_snapshot = device_alloc<int32_t>(B);
      KVS_CUDA_CHECK(cudaEventCreateWithFlags(&ls.rowed, cudaEventDisableTiming));
      ls.row.block_max = device_alloc<float>(int64_t(B) * hq * list_cap_);
      ls.row.block_ids = device_alloc<int32_t>(int64_t(B) * hkv * list_cap_);
      ls.row.block_count = device_alloc<int32_t>(int64_t(B) * hkv);
      ls.row.lse = device_alloc<float>(int64_t(B) * hq);
      ls.row.done = device_alloc<unsigned int>(1);
      zero_on_device(ls.row.done, sizeof(unsigned int));
    }
    if (copy_keys_) {
      ap::KeyCopy& k = ls.keys;
      k.format = copy_format_;
      k.max_batch = B;
      k.num_kv_heads = hkv;
      k.head_dim = shape_.head_dim;
      // Every block's tokens, in whole 16-token tiles (an odd count of 8-token blocks rounds up).
      k.max_tokens = (max_blocks_ * geo_.block + 15) / 16 * 16;
      const int64_t keys = int64_t(B) * hkv * k.max_tokens;
      k.k = device_alloc<uint8_t>(keys * k.key_bytes());
      k.scale = device_alloc<float>(keys);
      k.len = device_alloc<int32_t>(B);
      zero_on_device(k.len, size_t(B) * sizeof(int32_t));
    }
    if (config_.attnpred.offload) {
      ap::BlockCache& c = ls.cache;
      c.max_batch = B;
      c.num_kv_heads = hkv;
      c.head_dim = shape_.head_dim;
      c.max_blocks = max_blocks_;
      c.slots_per_head = slots_per_head_;
      const int64_t slots = int64_t(B) * hkv * slots_per_head_;
      c.k = device_alloc<bf16>(slots * geo_.block * shape_.head_dim);
      c.v = device_alloc<bf16>(slots * geo_.block * shape_.head_dim);
      c.block_slot = device_alloc<int32_t>(int64_t(B) * hkv * max_blocks_);
      c.slot_block = device_alloc<int32_t>(slots);
      c.copy_list = device_alloc<int32_t>(slots * 2);
      c.copy_count = device_alloc<int32_t>(int64_t(B) * hkv);
      ls.len_snapshot = device_alloc<int32_t>(B);
      ls.done = device_alloc<unsigned int>(1);
      zero_on_device(ls.done, sizeof(unsigned int));
      KVS_CUDA_CHECK(cudaEventCreateWithFlags(&ls.selected, cudaEventDisableTiming));
      KVS_CUDA_CHECK(cudaEventCreateWithFlags(&ls.prefetched, cudaEventDisableTiming));
    }
  }
  ls.last_tokens.assign(size_t(B) * hkv, {});
  ls.allocated = true;
  return ls;
}

// Workspace (CUDA): Selection {rows, tokens, counts} | a full-row scratch [B, Hq, max_context]
// per calibration lane (one in offload mode) | the sparse step's (sparse_step_bytes) | dense
// decode workspace. The full rows' scratch is apart: a layer's calibration row runs on its
// lane while later layers take their sparse steps, and the rows of one lane in order.
size_t AttnPredEngine::selection_bytes() const {
  const size_t subs = size_t(config_.max_batch) * shape_.num_kv_heads;
  return 2 * align_up(subs * size_t(max_tokens_) * sizeof(int32_t)) +
         align_up(subs * sizeof(int32_t));
}

size_t AttnPredEngine::workspace_bytes() const {
  if (config_.backend == Backend::Cpu) return 0;
  const int B = config_.max_batch, hq = shape_.num_q_heads;
  const size_t dense = std::max(kernels::dense_decode_workspace_bytes(
                                    B * shape_.num_kv_heads, shape_.group_size(), shape_.head_dim),
                                kernels::dense_decode_workspace_bytes(B, hq, shape_.head_dim));
  const size_t lanes = std::max<size_t>(1, calib_lanes_.size());
  return selection_bytes() +
         lanes * align_up(ap::row_scratch_bytes(B, hq, max_blocks_ * geo_.block)) +
         align_up(sparse_step_bytes()) + dense;
}

size_t AttnPredEngine::sparse_step_bytes() const {
  const int B = config_.max_batch, hq = shape_.num_q_heads;
  return config_.attnpred.offload ? ap::row_scratch_bytes(B, hq, max_tokens_)
                                  : ap::sparse_attend_workspace_bytes(B, hq, shape_.num_kv_heads,
                                                                      shape_.head_dim, list_cap_);
}

tk::Selection AttnPredEngine::selection() const {
  if (config_.backend != Backend::Cuda || workspace_.ptr == nullptr)
    throw std::logic_error("attnpred engine: the selection lives in a CUDA workspace");
  const size_t subs = size_t(config_.max_batch) * shape_.num_kv_heads;
  char* p = static_cast<char*>(workspace_.ptr);
  tk::Selection s;
  s.max_tokens = max_tokens_;
  s.rows = reinterpret_cast<int32_t*>(p);
  p += align_up(subs * size_t(max_tokens_) * sizeof(int32_t));
  s.tokens = reinterpret_cast<int32_t*>(p);
  p += align_up(subs * size_t(max_tokens_) * sizeof(int32_t));
  s.counts = reinterpret_cast<int32_t*>(p);
  return s;
}

void AttnPredEngine::prefill(int layer, const PagedKV& kv, cudaStream_t stream) {
  const std::string who = "attnpred engine prefill: ";
  check_prefill_args(who, layer, kv, shape_, config_.max_batch);
  if (is_dense_layer(layer)) return;
  // The history, its CNN cache and the key copy are sized for max_context; a CUDA decode
  // cannot check the device lengths without a sync, so the prompt is checked here.
  const std::vector<int32_t> lens = host_seq_lens(kv, config_.backend, stream);
  for (int b = 0; b < kv.batch; ++b)
    if (lens[size_t(b)] > max_context_)
      throw std::out_of_range(who + "sequence " + str(b) + " has " + str(lens[size_t(b)]) +
                              " tokens, above max_context " + str(max_context_) +
                              " (AttnPredConfig.max_context)");
  LayerState& ls = allocate_layer(layer);
  ls.calls = 0;
  const ap::HistoryState& h = ls.hist;
  const size_t row_elems = size_t(h.num_heads) * h.history * h.max_blocks;
  if (config_.backend == Backend::Cpu) {
    for (int b = 0; b < kv.batch; ++b) {
      std::fill_n(h.rows + size_t(b) * row_elems, row_elems, 0.f);
      h.count[b] = 0;
      h.tokens[b] = kv.seq_lens[b];
    }
    std::fill(ls.host_flags.begin(), ls.host_flags.end(), uint8_t(0));
    return;
  }
  if (ls.prefetch_pending) KVS_CUDA_CHECK(cudaStreamWaitEvent(stream, ls.prefetched, 0));
  wait_for_branches(ls, stream);
  // A deferred row or prediction belongs to the sequence this prefill replaces.
  deferred_.erase(std::remove_if(deferred_.begin(), deferred_.end(),
                                 [&](const Deferred& d) { return d.layer == layer; }),
                  deferred_.end());
  ls.prefetch_pending = false;
  KVS_CUDA_CHECK(cudaMemsetAsync(h.rows, 0, size_t(kv.batch) * row_elems * sizeof(float), stream));
  KVS_CUDA_CHECK(cudaMemsetAsync(h.count, 0, size_t(kv.batch) * sizeof(int32_t), stream));
  KVS_CUDA_CHECK(ap::reset_cnn_cache_cuda(device_params_, ls.cnn, kv.batch, stream));
  KVS_CUDA_CHECK(cudaMemcpyAsync(h.tokens, kv.seq_lens, size_t(kv.batch) * sizeof(int32_t),
                                 cudaMemcpyDefault, stream));
  KVS_CUDA_CHECK(cudaMemsetAsync(
      ls.flags, 0, size_t(config_.max_batch) * shape_.num_kv_heads * max_blocks_, stream));
  if (ls.cache.k) KVS_CUDA_CHECK(ap::reset_block_cache_cuda(ls.cache, kv.batch, stream));
  if (ls.keys.k) KVS_CUDA_CHECK(ap::fill_key_copy_cuda(kv, ls.keys, kv.batch, stream));
}

void AttnPredEngine::decode(int layer, const bf16* q, const bf16* q_pre, const PagedKV& kv,
                            bf16* out, float* lse, cudaStream_t stream) {
  (void)q_pre;
  check_decode_args(layer, kv, q, out);
  ++host_stats_.decode_calls;
  const bool dense = is_dense_layer(layer);
  if (!dense && !layers_[size_t(layer)].allocated)
    throw std::logic_error("attnpred engine decode: layer " + str(layer) +
                           " was never prefilled (no history)");
  if (config_.backend == Backend::Cpu) {
    decode_cpu(layer, q, kv, out, lse);
    return;
  }
  const float scale = float(shape_.scale());
  const int hq = shape_.num_q_heads, hkv = shape_.num_kv_heads;
  char* ws = static_cast<char*>(workspace_.ptr);
  const size_t scratch_off = selection_bytes();
  const size_t scratch_bytes =
      align_up(ap::row_scratch_bytes(config_.max_batch, hq, max_blocks_ * geo_.block));
  const size_t sparse_off = scratch_off + std::max<size_t>(1, calib_lanes_.size()) * scratch_bytes;
  const size_t dense_off = sparse_off + align_up(sparse_step_bytes());
  void* sparse_ws = ws + sparse_off;
  const size_t sparse_bytes = dense_off - sparse_off;
  void* dense_ws = ws + dense_off;
  const size_t dense_bytes = workspace_.bytes - dense_off;
  if (config_.collect_stats)
    KVS_CUDA_CHECK(kernels::kv_count_rows_cuda(kv.seq_lens, kv.batch, hkv,
                                               counters_.get() + kContextRows, stream));
  if (dense) {
    KVS_CUDA_CHECK(
        kernels::dense_decode_cuda(q, hq, kv, scale, out, lse, dense_ws, dense_bytes, stream));
    if (config_.collect_stats)
      KVS_CUDA_CHECK(kernels::kv_count_rows_cuda(kv.seq_lens, kv.batch, hkv,
                                                 counters_.get() + kRowsRead, stream));
    return;
  }
  LayerState& ls = layers_[size_t(layer)];
  const bool offload = ls.cache.k != nullptr;
  const int c = ls.calls++;
  const bool warm = c < warmup_;
  const bool full_row = calibrates(c, layer);
  // The previous step's late layers' branches, launched by this step's first sparse layer (or
  // by a deferred layer's own next decode, should the caller skip the first).
  if (!calib_lanes_.empty() &&
      (layer == first_sparse_ || std::any_of(deferred_.begin(), deferred_.end(),
                                             [&](const Deferred& d) { return d.layer == layer; })))
    launch_deferred(stream);
  wait_for_branches(ls, stream);  // its flags, history and CNN cache
  if (offload && ls.prefetch_pending) {
    KVS_CUDA_CHECK(
        ap::prefetch_probe_cuda(ls.done, ls.expected_done, counters_.get() + kLate, stream));
    KVS_CUDA_CHECK(cudaStreamWaitEvent(stream, ls.prefetched, 0));
    ls.prefetch_pending = false;
  }
  const tk::Selection sel = selection();
  PagedKV view;
  // GPU-resident: the attention over the selected tokens and the step's history row in two
  // kernels (sparse_attend_cuda), which read the block flags themselves.
  const bool fused = !warm && !offload;
  // GPU-resident: the calibration row and the prediction run on branches of their own, so
  // that a layer's read of all of K and its CNN overlap each other and the later layers' steps
  // (the layers' calibration and prediction phases are staggered: calibrates(), predicts()).
  // The calibration row reads the cache's keys below the current length, which no later layer
  // of the step writes, and a copy of the query (the caller's buffer holds the next layer's by
  // the time the branch runs); the calibration rows of a lane share a scratch, so they run in
  // order on it. It forks before the layer's own sparse step, which does not touch the history
  // on a calibration step: 128K grouped at P 4 on an H200 took 37.9-38.1 us a step against
  // 38.5-38.6 forked after it (docs/gpu.md, 2026-11-30). Offload mode calibrates on the caller's
  // stream, after the attention. The prediction reads only this layer's history (after its
  // calibration row when the step has one) and writes its own CNN cache, flags and scores: on
  // a prediction lane. The layer's next decode waits for both. The last sparse layers
  // (defers()) leave both to the next step: a query copy and the lengths now, the launch by
  // the next step's first sparse layer.
  const bool branches = !calib_lanes_.empty();
  const bool defer = defers(layer);
  const bool predicting = predicts(c, layer);
  if (full_row && branches) {
    KVS_CUDA_CHECK(cudaMemcpyAsync(ls.q_copy, q,
                                   size_t(kv.batch) * hq * shape_.head_dim * sizeof(bf16),
                                   cudaMemcpyDefault, stream));
    if (defer)  // the lengths of this step: the next one's first kernel advances them
      KVS_CUDA_CHECK(cudaMemcpyAsync(ls.len_snapshot, kv.seq_lens,
                                     size_t(kv.batch) * sizeof(int32_t), cudaMemcpyDefault,
                                     stream));
    else {
      launch_branches(ls, layer, kv, true, false, nullptr, stream);
      calib_forked_[size_t(calib_lane(layer))] = 1;
    }
  }
  if (warm) {
    // No prediction yet: every token (from host memory in offload mode, zero-copy).
    KVS_CUDA_CHECK(
        kernels::dense_decode_cuda(q, hq, kv, scale, out, lse, dense_ws, dense_bytes, stream));
    if (config_.collect_stats)
      KVS_CUDA_CHECK(kernels::kv_count_rows_cuda(kv.seq_lens, kv.batch, hkv,
                                                 counters_.get() + kRowsRead, stream));
  } else if (offload) {
    // The newest token arrived after the prefetch: the block holding it (and any the sequence
    // grew into since) is copied again, as are blocks still missing.
    KVS_CUDA_CHECK(ap::make_resident_cuda(kv, ls.flags, geo_, 0, false, ls.len_snapshot, ls.cache,
                                          counters_.get() + kBlocksOnDemand, nullptr,
                                          ap::default_copy_ctas(), stream));
    KVS_CUDA_CHECK(ap::build_selection_cuda(kv, ls.flags, max_blocks_, geo_, ls.cache.block_slot,
                                            sel, counters_.get() + kRowsRead, stream));
    view = tk::subrequest_view(ls.cache.as_view(geo_.block), sel);
    KVS_CUDA_CHECK(kernels::dense_decode_cuda(q, shape_.group_size(), view, scale, out, lse,
                                              dense_ws, dense_bytes, stream));
  } else {
    // A calibration step's history row is the full row, appended below. Otherwise, on lanes,
    // the step's row is written on the row lane: only the layer's prediction and next decode
    // read it.
    const bool row_apart = !full_row && branches;
    KVS_CUDA_CHECK(ap::sparse_attend_cuda(q, hq, kv, scale, ls.flags, max_blocks_, geo_, list_cap_,
                                          full_row ? nullptr : &ls.hist, sel,
                                          counters_.get() + kRowsRead, out, lse, sparse_ws,
                                          sparse_bytes, stream, row_apart ? &ls.row : nullptr));
    if (row_apart) {
      const kernels::StreamFork& f = row_lane_->get();
      KVS_CUDA_CHECK(kernels::fork_from(f, stream));
      KVS_CUDA_CHECK(
          ap::sparse_row_cuda(ls.row, ls.hist, kv.seq_lens, kv.batch, hq, hkv, list_cap_, f.side));
      KVS_CUDA_CHECK(cudaEventRecord(ls.rowed, f.side));
      ls.row_pending = true;
      row_forked_ = true;
    }
  }
  if (!full_row && !fused)  // the prediction reads this row
    KVS_CUDA_CHECK(ap::append_row_cuda(q, hq, view, sel.tokens, sel.max_tokens, kv.seq_lens,
                                       kv.batch, hkv, scale, geo_, ls.hist, sparse_ws, sparse_bytes,
                                       false, stream));
  if (full_row && !branches)  // offload mode: on the caller's stream
    full_row_cuda(ls, q, kv, ws + scratch_off, scratch_bytes, stream);
  if (predicting && !branches) {
    KVS_CUDA_CHECK(ap::predict_cuda(device_params_, ls.hist, ls.cnn, kv.batch, geo_, ls.scores,
                                    interval_, stream));
    KVS_CUDA_CHECK(ap::select_blocks_cuda(ls.scores, ls.hist, kv.batch, hkv, geo_, k_blocks_,
                                          ls.flags, stream));
  }
  if (branches && (full_row || predicting)) {
    if (defer) {
      PagedKV snap = kv;
      snap.seq_lens = ls.len_snapshot;
      deferred_.push_back({layer, full_row, predicting, snap});
    } else if (predicting) {
      launch_branches(ls, layer, kv, false, true,
                      full_row         ? ls.calibrated
                      : ls.row_pending ? ls.rowed
                                       : nullptr,
                      stream);
      predict_forked_[size_t(predict_lane(layer))] = 1;
    }
    ls.calibration_pending = full_row && !defer;
    ls.prediction_pending = predicting && !defer;
  }
  if (branches && layer == last_sparse_) join_lanes(stream);  // the end of a decode step
  if (offload) {
    // Cross-token prefetch of the blocks step t+1 needs. The lengths are snapshotted on the
    // main stream: the caller may advance kv.seq_lens for the next step while the copy runs.
    KVS_CUDA_CHECK(cudaMemcpyAsync(ls.len_snapshot, kv.seq_lens, size_t(kv.batch) * sizeof(int32_t),
                                   cudaMemcpyDefault, stream));
    KVS_CUDA_CHECK(cudaEventRecord(ls.selected, stream));
    KVS_CUDA_CHECK(cudaStreamWaitEvent(side_stream_, ls.selected, 0));
    PagedKV snap = kv;
    snap.seq_lens = ls.len_snapshot;
    // The prefetch frees the slots of blocks step t+1 does not need and copies new blocks
    // into them: it must not start before this step's attention and history row have read
    // the cache (the `selected` event is recorded after them).
    KVS_CUDA_CHECK(ap::make_resident_cuda(snap, ls.flags, geo_, 1, true, nullptr, ls.cache,
                                          counters_.get() + kBlocksPrefetched, ls.done,
                                          ap::default_copy_ctas(), side_stream_));
    KVS_CUDA_CHECK(cudaEventRecord(ls.prefetched, side_stream_));
    ls.expected_done += unsigned(ap::default_copy_ctas());
    ls.prefetch_pending = true;
    ++prefetches_;
  }
}

std::vector<float> AttnPredEngine::pooled_row_cpu(const float* q, const PagedKV& kv, int b, int qh,
                                                  const int32_t* tokens, int count,
                                                  double scale) const {
  const int d = shape_.head_dim, h = qh / shape_.group_size(), n = kv.seq_lens[b];
  std::vector<double> s(static_cast<size_t>(count));
  double m = -std::numeric_limits<double>::infinity();
  // A full row with calibration_keys e4m3 or int4 scores the keys as the CUDA rows' copy holds
  // them, and the query as those rows take it.
  const bool copy = tokens == nullptr && copy_keys_;
  std::vector<float> kr(static_cast<size_t>(d)), qr(q, q + d);
  if (copy) ap::round_query_cpu(copy_format_, q, d, qr.data());
  for (int i = 0; i < count; ++i) {
    const int t = tokens ? tokens[i] : i;
    const bf16* k = kv.k + kv.offset(b, t, h);
    if (copy) {
      ap::round_key_cpu(copy_format_, k, d, kr.data());
    } else {
      for (int e = 0; e < d; ++e) kr[size_t(e)] = bf16_to_float(k[e]);
    }
    double dot = 0;
    for (int e = 0; e < d; ++e) dot += double(qr[size_t(e)]) * double(kr[size_t(e)]);
    s[size_t(i)] = dot * scale;
    m = std::max(m, s[size_t(i)]);
  }
  double z = 0;
  for (double v : s) z += std::exp(v - m);
  const double lse = m + std::log(z);
  std::vector<float> probs(size_t(n), 0.f);
  for (int i = 0; i < count; ++i)
    probs[size_t(tokens ? tokens[i] : i)] = float(std::exp(s[size_t(i)] - lse));
  const int nb = geo_.num_blocks(n);
  if (geo_.block != kAttnBlockSize)
    throw std::logic_error("attnpred engine: block " + str(geo_.block) +
                           " differs from the capture pooling block " + str(kAttnBlockSize));
  std::vector<float> pooled(static_cast<size_t>(nb));
  pool_attention_row(probs.data(), n, n, pooled.data());
  return pooled;
}

void AttnPredEngine::predict_cpu(LayerState& ls, int batch) {
  const int hkv = shape_.num_kv_heads, g = shape_.group_size();
  std::fill(ls.host_flags.begin(), ls.host_flags.end(), uint8_t(0));
  std::vector<float> x, y;
  for (int b = 0; b < batch; ++b) {
    const int c0 = geo_.candidate_begin(), c1 = geo_.candidate_end(ls.hist.tokens[b]);
    const int w = c1 - c0;
    if (w <= 0) continue;
    for (int hh = 0; hh < ls.hist.num_heads; ++hh) {  // query heads, or kv heads when grouped
      uint8_t* flags = ls.flags + (size_t(b) * hkv + hh * ls.hist.group / g) * max_blocks_;
      if (k_blocks_ >= w) {  // every candidate fits the budget: no prediction needed
        std::fill(flags + c0, flags + c1, uint8_t(1));
        continue;
      }
      x.resize(size_t(geo_.history) * w);
      y.resize(size_t(w));
      ap::gather_input_cpu(ls.hist, b, hh, c0, c1, x.data());
      ap::cnn_forward_cpu(host_params_.data(), x.data(), 1, geo_.history, w, y.data());
      ap::select_top_blocks_cpu(y.data(), w, k_blocks_, c0, flags);
      host_stats_.selection_bytes_read += uint64_t(geo_.history) * w * sizeof(float);
    }
  }
}

void AttnPredEngine::decode_cpu(int layer, const bf16* q, const PagedKV& kv, bf16* out,
                                float* lse) {
  const int d = shape_.head_dim, g = shape_.group_size(), hq = shape_.num_q_heads;
  const int hkv = shape_.num_kv_heads;
  const double scale = shape_.scale();
  std::vector<float> qf(static_cast<size_t>(d));
  std::vector<double> o(static_cast<size_t>(d));
  for (int b = 0; b < kv.batch; ++b) {
    if (kv.seq_lens[b] > max_context_)
      throw std::out_of_range("attnpred engine decode: sequence " + str(b) + " has " +
                              str(kv.seq_lens[b]) + " tokens, above max_context " +
                              str(max_context_) + " (AttnPredConfig.max_context)");
    host_stats_.kv_rows_context += uint64_t(kv.seq_lens[b]) * hkv;
  }
  auto load_q = [&](int b, int qh) {
    const int64_t row = int64_t(b) * hq + qh;
    for (int i = 0; i < d; ++i) qf[size_t(i)] = bf16_to_float(q[row * d + i]);
  };
  auto attend = [&](int b, int qh, const int32_t* tokens, int count) {
    const int64_t row = int64_t(b) * hq + qh;
    double l;
    kernels::attend_cpu(qf.data(), kv, b, qh / g, tokens, count, scale, o.data(), &l);
    for (int i = 0; i < d; ++i) out[row * d + i] = float_to_bf16(float(o[size_t(i)]));
    if (lse) lse[row] = float(l);
  };
  if (is_dense_layer(layer)) {
    for (int b = 0; b < kv.batch; ++b) {
      for (int qh = 0; qh < hq; ++qh) {
        load_q(b, qh);
        attend(b, qh, nullptr, 0);
      }
      host_stats_.kv_rows_read += uint64_t(kv.seq_lens[b]) * hkv;
    }
    return;
  }
  LayerState& ls = layers_[size_t(layer)];
  const int c = ls.calls++;
  const bool warm = c < warmup_;
  const bool full_row = calibrates(c, layer);
  for (int b = 0; b < kv.batch; ++b) {
    const int n = kv.seq_lens[b];
    for (int h = 0; h < hkv; ++h) {
      std::vector<int32_t> tokens;
      if (warm) {
        tokens.resize(size_t(n));
        for (int t = 0; t < n; ++t) tokens[size_t(t)] = t;
      } else {
        tokens = ap::selected_tokens_cpu(geo_, n, ls.flags + (size_t(b) * hkv + h) * max_blocks_);
      }
      std::vector<float> grouped;  // the group's largest pooled probabilities (hist.group > 1)
      for (int j = 0; j < g; ++j) {
        const int qh = h * g + j;
        load_q(b, qh);
        attend(b, qh, tokens.data(), int(tokens.size()));
        std::vector<float> pooled =
            full_row
                ? pooled_row_cpu(qf.data(), kv, b, qh, nullptr, n, scale)
                : pooled_row_cpu(qf.data(), kv, b, qh, tokens.data(), int(tokens.size()), scale);
        if (ls.hist.group == 1) {
          ap::append_row_cpu(ls.hist, b, qh, pooled.data(), int(pooled.size()));
        } else if (grouped.empty()) {
          grouped = std::move(pooled);
        } else {
          for (size_t i = 0; i < grouped.size(); ++i) grouped[i] = std::max(grouped[i], pooled[i]);
        }
      }
      if (ls.hist.group > 1) ap::append_row_cpu(ls.hist, b, h, grouped.data(), int(grouped.size()));
      if (full_row) host_stats_.selection_bytes_read += uint64_t(n) * d * sizeof(bf16);
      host_stats_.kv_rows_read += tokens.size();
      ls.last_tokens[size_t(b) * hkv + h] = std::move(tokens);
    }
    ls.hist.count[b] += 1;
    ls.hist.tokens[b] = n;
  }
  if (predicts(c, layer)) predict_cpu(ls, kv.batch);
}

std::vector<std::vector<int32_t>> AttnPredEngine::last_read(int layer, int b) const {
  if (layer < 0 || layer >= shape_.num_layers || is_dense_layer(layer)) return {};
  const LayerState& ls = layers_[size_t(layer)];
  if (!ls.allocated || b < 0 || b >= config_.max_batch) return {};
  const int hkv = shape_.num_kv_heads, g = shape_.group_size();
  std::vector<std::vector<int32_t>> per_kv(static_cast<size_t>(hkv));
  if (config_.backend == Backend::Cpu) {
    for (int h = 0; h < hkv; ++h) per_kv[size_t(h)] = ls.last_tokens[size_t(b) * hkv + h];
    if (ls.calls <= warmup_) return {};  // the last decode read every token
  } else {
    // The selection in the workspace belongs to the last decode call, whichever layer it was;
    // a warm-up decode (dense) leaves it untouched, so report dense for those.
    if (ls.calls <= warmup_) return {};
    KVS_CUDA_CHECK(cudaDeviceSynchronize());
    per_kv = read_kv_head_lists(selection(), b, hkv);
  }
  return per_query_head_lists(std::move(per_kv), g, false);
}

std::vector<uint8_t> AttnPredEngine::block_flags(int layer) const {
  const LayerState& ls = layers_.at(size_t(layer));
  if (!ls.allocated)
    throw std::logic_error("attnpred engine: layer " + str(layer) + " has no state");
  if (config_.backend == Backend::Cpu) return ls.host_flags;
  std::vector<uint8_t> f(size_t(config_.max_batch) * shape_.num_kv_heads * max_blocks_);
  KVS_CUDA_CHECK(cudaDeviceSynchronize());
  KVS_CUDA_CHECK(cudaMemcpy(f.data(), ls.flags, f.size(), cudaMemcpyDeviceToHost));
  return f;
}

std::vector<float> AttnPredEngine::history_rows(int layer) const {
  const LayerState& ls = layers_.at(size_t(layer));
  if (!ls.allocated)
    throw std::logic_error("attnpred engine: layer " + str(layer) + " has no state");
  if (config_.backend == Backend::Cpu) return ls.host_rows;
  std::vector<float> r(size_t(config_.max_batch) * ls.hist.num_heads * geo_.history * max_blocks_);
  KVS_CUDA_CHECK(cudaDeviceSynchronize());
  KVS_CUDA_CHECK(
      cudaMemcpy(r.data(), ls.hist.rows, r.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return r;
}

std::vector<int32_t> AttnPredEngine::history_count(int layer) const {
  const LayerState& ls = layers_.at(size_t(layer));
  if (!ls.allocated)
    throw std::logic_error("attnpred engine: layer " + str(layer) + " has no state");
  if (config_.backend == Backend::Cpu) return ls.host_count;
  std::vector<int32_t> c(size_t(config_.max_batch));
  KVS_CUDA_CHECK(cudaDeviceSynchronize());
  KVS_CUDA_CHECK(
      cudaMemcpy(c.data(), ls.hist.count, c.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  return c;
}

std::vector<int32_t> AttnPredEngine::resident_blocks(int layer, int b, int h) const {
  const LayerState& ls = layers_.at(size_t(layer));
  if (!ls.cache.k) throw std::logic_error("attnpred engine: resident_blocks needs offload mode");
  KVS_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int32_t> slots(static_cast<size_t>(max_blocks_));
  KVS_CUDA_CHECK(cudaMemcpy(
      slots.data(), ls.cache.block_slot + (size_t(b) * shape_.num_kv_heads + h) * max_blocks_,
      slots.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  std::vector<int32_t> out;
  for (int j = 0; j < max_blocks_; ++j)
    if (slots[size_t(j)] >= 0) out.push_back(j);
  return out;
}

void AttnPredEngine::resident_rows(int layer, int b, int h, std::vector<int32_t>* blocks,
                                   std::vector<bf16>* keys, std::vector<bf16>* values) const {
  const LayerState& ls = layers_.at(size_t(layer));
  if (!ls.cache.k) throw std::logic_error("attnpred engine: resident_rows needs offload mode");
  if (b < 0 || b >= config_.max_batch || h < 0 || h >= shape_.num_kv_heads)
    throw std::out_of_range("attnpred engine resident_rows: (sequence " + str(b) + ", kv head " +
                            str(h) + ") outside [0, " + str(config_.max_batch) + ") x [0, " +
                            str(shape_.num_kv_heads) + ")");
  KVS_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int32_t> slots(static_cast<size_t>(max_blocks_));
  KVS_CUDA_CHECK(cudaMemcpy(
      slots.data(), ls.cache.block_slot + (size_t(b) * shape_.num_kv_heads + h) * max_blocks_,
      slots.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  const size_t rows = size_t(geo_.block) * shape_.head_dim;
  blocks->clear();
  keys->clear();
  values->clear();
  for (int j = 0; j < max_blocks_; ++j) {
    const int slot = slots[size_t(j)];
    if (slot < 0) continue;
    blocks->push_back(j);
    keys->resize(keys->size() + rows);
    values->resize(values->size() + rows);
    KVS_CUDA_CHECK(cudaMemcpy(keys->data() + keys->size() - rows, ls.cache.k + size_t(slot) * rows,
                              rows * sizeof(bf16), cudaMemcpyDeviceToHost));
    KVS_CUDA_CHECK(cudaMemcpy(values->data() + values->size() - rows,
                              ls.cache.v + size_t(slot) * rows, rows * sizeof(bf16),
                              cudaMemcpyDeviceToHost));
  }
}

AttnPredEngine::OffloadStats AttnPredEngine::offload_stats() const {
  OffloadStats s;
  s.prefetches = prefetches_;
  if (!counters_) return s;
  KVS_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint64_t> c = counters_.read();
  s.late_prefetches = c[kLate];
  s.blocks_prefetched = c[kBlocksPrefetched];
  s.blocks_on_demand = c[kBlocksOnDemand];
  s.selection_errors = c[kSelectionErrors] + c[kPrefetchErrors] + c[kOnDemandErrors];
  return s;
}

EngineStats AttnPredEngine::stats() const {
  EngineStats s = host_stats_;
  if (counters_) {
    // The counters are added to on the caller's stream and on the non-blocking prefetch
    // stream, neither of which a plain cudaMemcpy waits for.
    KVS_CUDA_CHECK(cudaDeviceSynchronize());
    counters_.read_into(&s, kRowsRead, kFullRowKeyBytes, kContextRows);
  }
  return s;
}

void AttnPredEngine::reset_stats() {
  host_stats_ = EngineStats{};
  prefetches_ = 0;
  if (counters_) {
    KVS_CUDA_CHECK(cudaDeviceSynchronize());  // no kernel of any stream still adding
    counters_.reset();
  }
}

}  // namespace kvs
