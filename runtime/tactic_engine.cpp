#include "runtime/tactic_engine.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

#include "kernels/common/cuda_check.h"
#include "kernels/common/kv_update.h"
#include "kernels/dense/dense_decode.h"

namespace kvs {
namespace {

namespace tk = kernels::tactic;

std::string str(double x) { return std::to_string(x); }
std::string str(int64_t x) { return std::to_string(x); }

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

void validate(const TacticConfig& t, const ModelShape& s) {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("TacticConfig: " + what);
  };
  need(t.target > 0.0 && t.target <= 1.0, "target must be in (0, 1], got " + str(t.target));
  need(t.cluster_size >= 1, "cluster_size must be >= 1, got " + str(int64_t(t.cluster_size)));
  need(t.kmeans_iterations >= 1,
       "kmeans_iterations must be >= 1, got " + str(int64_t(t.kmeans_iterations)));
  need(t.exact_fraction > 0.0 && t.exact_fraction <= 1.0,
       "exact_fraction must be in (0, 1], got " + str(t.exact_fraction));
  need(t.window_centre1 > 0.0 && t.window_centre1 < t.window_centre2 && t.window_centre2 < 1.0,
       "window centres must satisfy 0 < window_centre1 < window_centre2 < 1, got " +
           str(t.window_centre1) + " and " + str(t.window_centre2));
  need(t.window_min >= 1, "window_min must be >= 1, got " + str(int64_t(t.window_min)));
  need(t.window_fraction >= 0.0 && t.window_fraction < 0.5,
       "window_fraction must be in [0, 0.5), got " + str(t.window_fraction));
  need(t.recluster_interval >= 0 && t.recluster_interval % t.cluster_size == 0,
       "recluster_interval must be 0 or a positive multiple of cluster_size " +
           str(int64_t(t.cluster_size)) + ", got " + str(int64_t(t.recluster_interval)));
  need(t.max_context >= 0, "max_context must be >= 0, got " + str(int64_t(t.max_context)));
  for (int l : t.dense_layers)
    need(l >= 0 && l < s.num_layers, "dense_layers entry " + str(int64_t(l)) + " outside [0, " +
                                         str(int64_t(s.num_layers)) + ")");
}

}  // namespace

TacticEngine::TacticEngine(const ModelShape& shape, const EngineConfig& config)
    : Engine(shape, config) {
  const TacticConfig& t = config_.tactic;
  validate(t, shape_);
  max_context_ = t.max_context > 0 ? t.max_context : shape_.max_position;
  if (max_context_ <= 0)
    throw std::invalid_argument(
        "TacticConfig: max_context is 0 and the model's max_position is 0: set max_context");
  max_clusters_ = tk::max_clusters_for(max_context_, t.cluster_size);
  if (config_.backend == Backend::Cuda) {
    if (shape_.head_dim != 64 && shape_.head_dim != 128)
      throw std::invalid_argument("tactic engine (cuda): head_dim " +
                                  str(int64_t(shape_.head_dim)) + " is not supported (64 or 128)");
    if (shape_.group_size() > 8)
      throw std::invalid_argument("tactic engine (cuda): group size " +
                                  str(int64_t(shape_.group_size())) + " above 8");
    if (t.recluster_interval > tk::recluster_block_max_tokens(shape_.head_dim, t.cluster_size))
      throw std::invalid_argument(
          "TacticConfig: recluster_interval " + str(int64_t(t.recluster_interval)) +
          " exceeds the largest block the re-clustering kernel holds in shared memory (" +
          str(int64_t(tk::recluster_block_max_tokens(shape_.head_dim, t.cluster_size))) + ")");
    KVS_CUDA_CHECK(tk::prepare_cuda(shape_.head_dim));
    if (config_.collect_stats) device_counters_ = DeviceCounters(3);
  }
  layers_.resize(size_t(shape_.num_layers));
  allocated_.assign(size_t(shape_.num_layers), false);
  last_tokens_.resize(size_t(shape_.num_layers));
}

TacticEngine::~TacticEngine() {
  if (config_.backend == Backend::Cuda) {
    for (size_t l = 0; l < layers_.size(); ++l) {
      if (!allocated_[l]) continue;
      const tk::ClusterState& v = layers_[l].view;
      cudaFree(v.centroids);
      cudaFree(v.offsets);
      cudaFree(v.members);
      cudaFree(v.num_clusters);
      cudaFree(v.clustered_len);
      cudaFree(v.member_rows);
    }
  }
}

bool TacticEngine::is_dense_layer(int layer) const {
  const auto& d = config_.tactic.dense_layers;
  return std::find(d.begin(), d.end(), layer) != d.end();
}

tk::FitParams TacticEngine::fit_params() const {
  const TacticConfig& t = config_.tactic;
  tk::FitParams f;
  f.target = t.target;
  f.exact_fraction = t.exact_fraction;
  f.centre1 = t.window_centre1;
  f.centre2 = t.window_centre2;
  f.window_min = t.window_min;
  f.window_fraction = t.window_fraction;
  return f;
}

tk::KMeansParams TacticEngine::kmeans_params() const {
  tk::KMeansParams k;
  k.cluster_size = config_.tactic.cluster_size;
  k.iterations = config_.tactic.kmeans_iterations;
  k.seed = config_.tactic.seed;
  return k;
}

// Workspace layout (CUDA): Selection {rows, tokens, counts, selected} | selection scratch |
// dense decode workspace of the sub-request view.
size_t TacticEngine::selection_output_bytes() const {
  const size_t subs = size_t(config_.max_batch) * shape_.num_kv_heads;
  return 2 * align_up(subs * size_t(max_context_) * sizeof(int32_t)) +  // rows, tokens
         align_up(subs * sizeof(int32_t)) +                             // counts
         align_up(size_t(config_.max_batch) * shape_.num_q_heads * sizeof(int32_t));
}

size_t TacticEngine::select_bytes() const {
  return selection_output_bytes() +
         align_up(tk::select_workspace_bytes(config_.max_batch, shape_.num_q_heads,
                                             shape_.num_kv_heads, shape_.head_dim, max_clusters_,
                                             max_context_, fit_params()));
}

size_t TacticEngine::workspace_bytes() const {
  if (config_.backend == Backend::Cpu) return 0;
  return select_bytes() +
         kernels::dense_decode_workspace_bytes(config_.max_batch * shape_.num_kv_heads,
                                               shape_.group_size(), shape_.head_dim);
}

tk::Selection TacticEngine::last_selection() const {
  if (config_.backend != Backend::Cuda || workspace_.ptr == nullptr)
    throw std::logic_error("tactic engine: last_selection needs the CUDA backend and a workspace");
  const size_t subs = size_t(config_.max_batch) * shape_.num_kv_heads;
  char* p = static_cast<char*>(workspace_.ptr);
  tk::Selection s;
  s.max_tokens = max_context_;
  s.rows = reinterpret_cast<int32_t*>(p);
  p += align_up(subs * size_t(max_context_) * sizeof(int32_t));
  s.tokens = reinterpret_cast<int32_t*>(p);
  p += align_up(subs * size_t(max_context_) * sizeof(int32_t));
  s.counts = reinterpret_cast<int32_t*>(p);
  p += align_up(subs * sizeof(int32_t));
  s.selected = reinterpret_cast<int32_t*>(p);
  return s;
}

const tk::ClusterState& TacticEngine::cluster_state(int layer) const {
  if (layer < 0 || layer >= shape_.num_layers || !allocated_[size_t(layer)])
    throw std::logic_error("tactic engine: layer " + str(int64_t(layer)) +
                           " has no cluster state (prefill it first)");
  return layers_[size_t(layer)].view;
}

TacticEngine::LayerState& TacticEngine::allocate_layer(int layer) {
  LayerState& ls = layers_[size_t(layer)];
  if (allocated_[size_t(layer)]) return ls;
  tk::ClusterState& v = ls.view;
  v.max_batch = config_.max_batch;
  v.num_kv_heads = shape_.num_kv_heads;
  v.head_dim = shape_.head_dim;
  v.max_clusters = max_clusters_;
  v.max_tokens = max_context_;
  const int64_t slots = int64_t(v.max_batch) * v.num_kv_heads;
  const int64_t n_cent = slots * v.max_clusters * v.head_dim;
  const int64_t n_off = slots * (int64_t(v.max_clusters) + 1);
  const int64_t n_mem = slots * v.max_tokens;
  if (config_.backend == Backend::Cpu) {
    ls.host_centroids.assign(size_t(n_cent), bf16{0});
    ls.host_offsets.assign(size_t(n_off), 0);
    ls.host_members.assign(size_t(n_mem), 0);
    ls.host_num_clusters.assign(size_t(slots), 0);
    ls.host_clustered_len.assign(size_t(slots), 0);
    v.centroids = ls.host_centroids.data();
    v.offsets = ls.host_offsets.data();
    v.members = ls.host_members.data();
    v.num_clusters = ls.host_num_clusters.data();
    v.clustered_len = ls.host_clustered_len.data();
  } else {
    v.centroids = device_alloc<bf16>(n_cent);
    v.offsets = device_alloc<int32_t>(n_off);
    v.members = device_alloc<int32_t>(n_mem);
    v.num_clusters = device_alloc<int32_t>(slots);
    v.clustered_len = device_alloc<int32_t>(slots);
    if (config_.tactic.member_rows) v.member_rows = device_alloc<int32_t>(n_mem);
    zero_on_device(v.num_clusters, size_t(slots) * sizeof(int32_t));
    zero_on_device(v.clustered_len, size_t(slots) * sizeof(int32_t));
  }
  allocated_[size_t(layer)] = true;
  return ls;
}

void TacticEngine::prefill(int layer, const PagedKV& kv, cudaStream_t stream) {
  const std::string who = "tactic engine prefill: ";
  check_prefill_args(who, layer, kv, shape_, config_.max_batch);
  if (is_dense_layer(layer)) return;
  const std::vector<int32_t> lens = host_seq_lens(kv, config_.backend, stream);
  int max_len = 0;
  for (int b = 0; b < kv.batch; ++b) {
    if (lens[size_t(b)] > max_context_)
      throw std::out_of_range(who + "sequence " + str(int64_t(b)) + " has " +
                              str(int64_t(lens[size_t(b)])) + " tokens, above max_context " +
                              str(int64_t(max_context_)) + " (TacticConfig.max_context)");
    max_len = std::max(max_len, int(lens[size_t(b)]));
  }
  LayerState& ls = allocate_layer(layer);
  const tk::ClusterState& st = ls.view;
  const tk::KMeansParams km = kmeans_params();
  if (config_.backend == Backend::Cpu) {
    for (int b = 0; b < kv.batch; ++b)
      for (int h = 0; h < shape_.num_kv_heads; ++h) {
        st.num_clusters[st.slot(b, h)] = 0;
        st.clustered_len[st.slot(b, h)] = 0;
        if (lens[size_t(b)] > 0) tk::cluster_range_cpu(kv, layer, b, h, lens[size_t(b)], km, st);
      }
    return;
  }
  const size_t ws_bytes =
      tk::cluster_prefill_workspace_bytes(kv.batch, kv.num_kv_heads, max_len, km.cluster_size);
  with_temporary_workspace(ws_bytes, stream, [&](void* ws) {
    return tk::cluster_prefill_cuda(kv, lens.data(), layer, km, st, ws, ws_bytes, stream);
  });
}

void TacticEngine::decode(int layer, const bf16* q, const bf16* q_pre, const PagedKV& kv, bf16* out,
                          float* lse, cudaStream_t stream) {
  check_decode_args(layer, kv, q, out);
  ++host_stats_.decode_calls;
  const bool dense = is_dense_layer(layer);
  if (!dense && !allocated_[size_t(layer)])
    throw std::logic_error("tactic engine decode: layer " + str(int64_t(layer)) +
                           " was never prefilled (no clusters)");
  if (config_.backend == Backend::Cpu) {
    decode_cpu(layer, q, kv, out, lse);
    return;
  }
  const float scale = float(shape_.scale());
  char* ws = static_cast<char*>(workspace_.ptr);
  if (dense) {
    KVS_CUDA_CHECK(kernels::dense_decode_cuda(q, shape_.num_q_heads, kv, scale, out, lse,
                                              ws + select_bytes(),
                                              workspace_.bytes - select_bytes(), stream));
    if (device_counters_)
      KVS_CUDA_CHECK(kernels::kv_count_rows_cuda(kv.seq_lens, kv.batch, kv.num_kv_heads,
                                                 device_counters_.get(), stream));
  } else {
    const tk::ClusterState& st = layers_[size_t(layer)].view;
    const tk::KMeansParams km = kmeans_params();
    if (config_.tactic.recluster_interval > 0)
      KVS_CUDA_CHECK(
          tk::recluster_blocks_cuda(kv, layer, config_.tactic.recluster_interval, km, st, stream));
    const tk::Selection sel = last_selection();
    const size_t outputs = selection_output_bytes();
    KVS_CUDA_CHECK(tk::select_tokens_cuda(q, shape_.num_q_heads, kv, scale, fit_params(), st, sel,
                                          device_counters_.get(), ws + outputs,
                                          select_bytes() - outputs, stream));
    KVS_CUDA_CHECK(kernels::dense_decode_cuda(q, shape_.group_size(), tk::subrequest_view(kv, sel),
                                              scale, out, lse, ws + select_bytes(),
                                              workspace_.bytes - select_bytes(), stream));
  }
  if (device_counters_)
    KVS_CUDA_CHECK(kernels::kv_count_rows_cuda(kv.seq_lens, kv.batch, kv.num_kv_heads,
                                               device_counters_.get() + 2, stream));
}

void TacticEngine::decode_cpu(int layer, const bf16* q, const PagedKV& kv, bf16* out, float* lse) {
  const int d = shape_.head_dim, g = shape_.group_size(), Hq = shape_.num_q_heads;
  const double scale = shape_.scale();
  std::vector<float> qf(static_cast<size_t>(d));
  std::vector<double> o(static_cast<size_t>(d));
  auto attend = [&](int b, int h, const int32_t* tokens, int count) {
    for (int j = 0; j < g; ++j) {
      const int64_t row = int64_t(b) * Hq + h * g + j;
      for (int i = 0; i < d; ++i) qf[size_t(i)] = bf16_to_float(q[row * d + i]);
      double l;
      kernels::attend_cpu(qf.data(), kv, b, h, tokens, count, scale, o.data(), &l);
      for (int i = 0; i < d; ++i) out[row * d + i] = float_to_bf16(float(o[size_t(i)]));
      if (lse) lse[row] = float(l);
    }
  };
  for (int b = 0; b < kv.batch; ++b)
    host_stats_.kv_rows_context += uint64_t(kv.seq_lens[b]) * kv.num_kv_heads;
  if (is_dense_layer(layer)) {
    last_tokens_[size_t(layer)].clear();  // empty: every token
    for (int b = 0; b < kv.batch; ++b)
      for (int h = 0; h < shape_.num_kv_heads; ++h) {
        attend(b, h, nullptr, 0);
        host_stats_.kv_rows_read += uint64_t(kv.seq_lens[b]);
      }
    return;
  }
  const tk::ClusterState& st = layers_[size_t(layer)].view;
  const tk::FitParams fit = fit_params();
  const tk::KMeansParams km = kmeans_params();
  const int interval = config_.tactic.recluster_interval;
  std::vector<uint8_t> flags;
  for (int b = 0; b < kv.batch; ++b) {
    if (kv.seq_lens[b] > max_context_)
      throw std::out_of_range("tactic engine decode: sequence " + str(int64_t(b)) + " has " +
                              str(int64_t(kv.seq_lens[b])) + " tokens, above max_context " +
                              str(int64_t(max_context_)));
    for (int h = 0; h < shape_.num_kv_heads; ++h) {
      const int64_t s = st.slot(b, h);
      // At most one block per call, as on the GPU (one token arrives per step).
      if (interval > 0 && kv.seq_lens[b] - st.clustered_len[s] >= interval)
        tk::cluster_range_cpu(kv, layer, b, h, interval, km, st);
      flags.assign(size_t(st.num_clusters[s]), 0);
      for (int j = 0; j < g; ++j) {
        const int64_t row = int64_t(b) * Hq + h * g + j;
        for (int i = 0; i < d; ++i) qf[size_t(i)] = bf16_to_float(q[row * d + i]);
        tk::select_clusters_cpu(qf.data(), kv, b, h, scale, fit, st, flags.data(), nullptr);
        host_stats_.selection_bytes_read +=
            uint64_t(tk::make_fit_plan(st.clustered_len[s], fit).num_samples()) * d * sizeof(bf16);
      }
      host_stats_.selection_bytes_read += uint64_t(st.num_clusters[s]) * d * sizeof(bf16);
      std::vector<int32_t> tokens = tk::selected_tokens_cpu(kv, b, h, st, flags.data());
      attend(b, h, tokens.data(), int(tokens.size()));
      host_stats_.kv_rows_read += tokens.size();
      auto& last = last_tokens_[size_t(layer)];
      if (last.size() < size_t(kv.batch) * shape_.num_kv_heads)
        last.resize(size_t(kv.batch) * shape_.num_kv_heads);
      last[size_t(b) * shape_.num_kv_heads + h] = std::move(tokens);
    }
  }
}

std::vector<std::vector<int32_t>> TacticEngine::last_read(int layer, int b) const {
  if (layer < 0 || layer >= shape_.num_layers || is_dense_layer(layer)) return {};
  const int hkv = shape_.num_kv_heads, g = shape_.group_size();
  std::vector<std::vector<int32_t>> per_kv_head(static_cast<size_t>(hkv));
  if (config_.backend == Backend::Cpu) {
    const auto& last = last_tokens_[size_t(layer)];
    if (size_t(b + 1) * hkv > last.size()) return {};
    for (int h = 0; h < hkv; ++h) per_kv_head[size_t(h)] = last[size_t(b) * hkv + h];
  } else {
    // The selection in the workspace belongs to the last decode call, whichever layer it was.
    per_kv_head = read_kv_head_lists(last_selection(), b, hkv);
  }
  return per_query_head_lists(std::move(per_kv_head), g, true);
}

EngineStats TacticEngine::stats() const {
  EngineStats s = host_stats_;
  if (device_counters_) device_counters_.read_into(&s, 0, 1, 2);
  return s;
}

void TacticEngine::reset_stats() {
  host_stats_ = EngineStats{};
  device_counters_.reset();
}

}  // namespace kvs
