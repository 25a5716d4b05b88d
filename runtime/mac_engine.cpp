#include "runtime/mac_engine.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/common/cuda_check.h"
#include "kernels/dense/dense_decode.h"

namespace kvs {
namespace {

namespace mk = kernels::mac;

std::string str(double x) { return std::to_string(x); }
std::string str(int64_t x) { return std::to_string(x); }

void validate(const MacConfig& m, const ModelShape& s) {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("MacConfig: " + what);
  };
  need(m.tau >= 0.0 && m.tau <= 1.0, "tau must be in [0, 1], got " + str(m.tau));
  need(m.window >= 1, "window must be >= 1, got " + str(int64_t(m.window)));
  need(m.band >= 1, "band must be >= 1, got " + str(int64_t(m.band)));
  need(m.min_context >= 0, "min_context must be >= 0, got " + str(int64_t(m.min_context)));
  need(m.min_queries >= 1, "min_queries must be >= 1, got " + str(int64_t(m.min_queries)));
  need(m.stats_horizon >= 1, "stats_horizon must be >= 1, got " + str(int64_t(m.stats_horizon)));
  if (m.threshold == MacThreshold::PerHead) {
    const size_t want = size_t(s.num_layers) * s.num_q_heads;
    need(m.per_head_threshold.size() == want,
         "threshold per-head needs per_head_threshold of num_layers * Hq = " +
             str(int64_t(want)) + " values, got " + str(int64_t(m.per_head_threshold.size())));
    for (size_t i = 0; i < want; ++i)
      need(std::isfinite(m.per_head_threshold[i]) && m.per_head_threshold[i] >= 0.f,
           "per_head_threshold[" + str(int64_t(i)) + "] (layer " +
               str(int64_t(i / s.num_q_heads)) + ", head " + str(int64_t(i % s.num_q_heads)) +
               ") must be finite and >= 0, got " + str(double(m.per_head_threshold[i])));
  }
}

mk::ThresholdRule rule_of(MacThreshold t) {
  switch (t) {
    case MacThreshold::Paper: return mk::ThresholdRule::Paper;
    case MacThreshold::Relative: return mk::ThresholdRule::Relative;
    case MacThreshold::PerHead: return mk::ThresholdRule::PerHead;
  }
  throw std::invalid_argument("MacConfig: unknown threshold rule");
}

}  // namespace

MacEngine::MacEngine(const ModelShape& shape, const EngineConfig& config)
    : Engine(shape, config) {
  validate(config_.mac, shape_);
  if (config_.backend == Backend::Cuda) {
    if (shape_.head_dim != 64 && shape_.head_dim != 128)
      throw std::invalid_argument("mac engine (cuda): head_dim " + str(int64_t(shape_.head_dim)) +
                                  " is not supported (64 or 128)");
    if (shape_.group_size() > 8)
      throw std::invalid_argument("mac engine (cuda): group size " +
                                  str(int64_t(shape_.group_size())) + " above 8");
    KVS_CUDA_CHECK(mk::prepare_cuda(shape_.head_dim));
    if (config_.mac.threshold == MacThreshold::PerHead) {
      const auto& t = config_.mac.per_head_threshold;
      head_thresholds_ = device_alloc<float>(int64_t(t.size()));
      copy_to_device(head_thresholds_, t.data(), t.size() * sizeof(float));
    }
    if (config_.collect_stats) device_counters_ = DeviceCounters(mk::kNumCounters);
  }
  layers_.resize(size_t(shape_.num_layers));
  allocated_.assign(size_t(shape_.num_layers), false);
}

MacEngine::~MacEngine() {
  if (config_.backend == Backend::Cuda) {
    for (size_t l = 0; l < layers_.size(); ++l) {
      if (!allocated_[l]) continue;
      const mk::RingState& v = layers_[l].view;
      for (void* p : {static_cast<void*>(v.q), static_cast<void*>(v.o), static_cast<void*>(v.lse),
                      static_cast<void*>(v.pos), static_cast<void*>(v.q_mean),
                      static_cast<void*>(v.q_sq), static_cast<void*>(v.q_count),
                      static_cast<void*>(v.last_start), static_cast<void*>(v.last_len)})
        cudaFree(p);
    }
  }
  if (head_thresholds_) cudaFree(head_thresholds_);
}

size_t MacEngine::workspace_bytes() const {
  if (config_.backend == Backend::Cpu) return 0;
  return mk::decode_workspace_bytes(config_.max_batch, shape_.num_q_heads, shape_.num_kv_heads,
                                    shape_.head_dim, config_.mac.window);
}

mk::MatchParams MacEngine::match_params(int layer) const {
  const MacConfig& m = config_.mac;
  mk::MatchParams p;
  p.window = m.window;
  p.band = m.band;
  p.min_context = m.min_context;
  p.rule = rule_of(m.threshold);
  p.tau = float(m.tau);
  p.min_queries = m.min_queries;
  p.stats_horizon = m.stats_horizon;
  if (m.threshold == MacThreshold::PerHead) {
    const size_t at = size_t(layer) * shape_.num_q_heads;
    p.head_threshold = config_.backend == Backend::Cuda ? head_thresholds_ + at
                                                        : m.per_head_threshold.data() + at;
  }
  return p;
}

const mk::RingState& MacEngine::ring_state(int layer) const {
  if (layer < 0 || layer >= shape_.num_layers || !allocated_[size_t(layer)])
    throw std::logic_error("mac engine: layer " + str(int64_t(layer)) +
                           " has no rings (prefill it first)");
  return layers_[size_t(layer)].view;
}

void MacEngine::check_layer(int layer, const char* who) const {
  if (layer < 0 || layer >= shape_.num_layers)
    throw std::out_of_range(std::string("mac engine ") + who + ": layer " + str(int64_t(layer)) +
                            " outside [0, " + str(int64_t(shape_.num_layers)) + ")");
}

MacEngine::LayerState& MacEngine::allocate_layer(int layer) {
  LayerState& ls = layers_[size_t(layer)];
  if (allocated_[size_t(layer)]) return ls;
  mk::RingState& v = ls.view;
  v.max_batch = config_.max_batch;
  v.window = config_.mac.window;
  v.num_q_heads = shape_.num_q_heads;
  v.head_dim = shape_.head_dim;
  const int64_t heads = int64_t(v.max_batch) * v.num_q_heads;
  const int64_t rows = int64_t(v.max_batch) * v.window * v.num_q_heads;
  const int64_t slots = int64_t(v.max_batch) * v.window;
  if (config_.backend == Backend::Cpu) {
    ls.host_q.assign(size_t(rows * v.head_dim), bf16{0});
    ls.host_o.assign(size_t(rows * v.head_dim), bf16{0});
    ls.host_lse.assign(size_t(rows), -INFINITY);
    ls.host_pos.assign(size_t(slots), -1);
    ls.host_mean.assign(size_t(heads * v.head_dim), 0.f);
    ls.host_sq.assign(size_t(heads), 0.f);
    ls.host_count.assign(size_t(heads), 0);
    ls.host_start.assign(size_t(heads), 0);
    ls.host_len.assign(size_t(v.max_batch), 0);
    v.q = ls.host_q.data();
    v.o = ls.host_o.data();
    v.lse = ls.host_lse.data();
    v.pos = ls.host_pos.data();
    v.q_mean = ls.host_mean.data();
    v.q_sq = ls.host_sq.data();
    v.q_count = ls.host_count.data();
    v.last_start = ls.host_start.data();
    v.last_len = ls.host_len.data();
  } else {
    v.q = device_alloc<bf16>(rows * v.head_dim);
    v.o = device_alloc<bf16>(rows * v.head_dim);
    v.lse = device_alloc<float>(rows);
    v.pos = device_alloc<int32_t>(slots);
    v.q_mean = device_alloc<float>(heads * v.head_dim);
    v.q_sq = device_alloc<float>(heads);
    v.q_count = device_alloc<int32_t>(heads);
    v.last_start = device_alloc<int32_t>(heads);
    v.last_len = device_alloc<int32_t>(v.max_batch);
    KVS_CUDA_CHECK(mk::reset_cuda(v, v.max_batch, nullptr));
    KVS_CUDA_CHECK(cudaDeviceSynchronize());
  }
  allocated_[size_t(layer)] = true;
  return ls;
}

std::vector<int32_t> MacEngine::host_lengths(const PagedKV& kv, cudaStream_t stream) const {
  return host_seq_lens(kv, config_.backend, stream);
}

void MacEngine::prefill(int layer, const PagedKV& kv, cudaStream_t stream) {
  check_layer(layer, "prefill");
  const std::string who = "mac engine prefill: ";
  if (kv.batch <= 0 || kv.batch > config_.max_batch)
    throw std::invalid_argument(who + "batch " + str(int64_t(kv.batch)) + " outside [1, " +
                                str(int64_t(config_.max_batch)) + "] (EngineConfig.max_batch)");
  if (kv.num_kv_heads != shape_.num_kv_heads || kv.head_dim != shape_.head_dim)
    throw std::invalid_argument(who + "KV cache has " + str(int64_t(kv.num_kv_heads)) +
                                " kv heads of dim " + str(int64_t(kv.head_dim)) +
                                ", the model has " + str(int64_t(shape_.num_kv_heads)) +
                                " of dim " + str(int64_t(shape_.head_dim)));
  LayerState& ls = allocate_layer(layer);
  if (config_.backend == Backend::Cpu) {
    mk::reset_cpu(ls.view, kv.batch);
  } else {
    KVS_CUDA_CHECK(mk::reset_cuda(ls.view, kv.batch, stream));
  }
}

void MacEngine::prefill_queries(int layer, int b, const bf16* q, const bf16* q_pre, int n,
                                const PagedKV& kv, cudaStream_t stream) {
  check_layer(layer, "prefill_queries");
  const std::string who = "mac engine prefill_queries: ";
  if (!allocated_[size_t(layer)])
    throw std::logic_error(who + "layer " + str(int64_t(layer)) +
                           " was not prefilled (call prefill first)");
  if (b < 0 || b >= kv.batch)
    throw std::out_of_range(who + "sequence " + str(int64_t(b)) + " outside the batch of " +
                            str(int64_t(kv.batch)));
  if (kv.num_kv_heads != shape_.num_kv_heads || kv.head_dim != shape_.head_dim)
    throw std::invalid_argument(who + "KV cache shape does not match the model");
  if (!q || !q_pre) throw std::invalid_argument(who + "null q or q_pre");
  const int len = host_lengths(kv, stream)[size_t(b)];
  if (n < 1 || n > std::min(config_.mac.window, len))
    throw std::out_of_range(who + "n = " + str(int64_t(n)) + " queries for sequence " +
                            str(int64_t(b)) + " of length " + str(int64_t(len)) +
                            "; expected 1..min(window " + str(int64_t(config_.mac.window)) +
                            ", length)");
  const mk::RingState& st = layers_[size_t(layer)].view;
  const mk::MatchParams mp = match_params(layer);
  const int hq = shape_.num_q_heads, d = shape_.head_dim;
  if (config_.backend == Backend::Cpu) {
    mk::fill_entries_cpu(st, mp, b, q, q_pre, n, hq, kv, shape_.scale());
    return;
  }
  // Entry p = dense attention of q_p over [0, E(p)): n "sequences" that share b's pages,
  // sequence i of length E(p0 + i).
  const int p0 = len - n;
  std::vector<int32_t> lens(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) lens[size_t(i)] = mk::cache_end(p0 + i, config_.mac.band);
  int32_t* d_lens = device_alloc<int32_t>(n);
  int32_t* d_table = device_alloc<int32_t>(int64_t(n) * kv.max_pages_per_seq);
  bf16* d_o = device_alloc<bf16>(int64_t(n) * hq * d);
  float* d_lse = device_alloc<float>(int64_t(n) * hq);
  const size_t ws_bytes = kernels::dense_decode_workspace_bytes(n, hq, d);
  void* ws = nullptr;
  cudaError_t err = cudaMalloc(&ws, ws_bytes);
  if (err == cudaSuccess)
    err = cudaMemcpyAsync(d_lens, lens.data(), lens.size() * sizeof(int32_t),
                          cudaMemcpyHostToDevice, stream);
  const size_t row_bytes = size_t(kv.max_pages_per_seq) * sizeof(int32_t);
  for (int i = 0; i < n && err == cudaSuccess; ++i)
    err = cudaMemcpyAsync(d_table + int64_t(i) * kv.max_pages_per_seq,
                          kv.page_table + int64_t(b) * kv.max_pages_per_seq, row_bytes,
                          cudaMemcpyDeviceToDevice, stream);
  if (err == cudaSuccess) {
    PagedKV view = kv;
    view.batch = n;
    view.page_table = d_table;
    view.seq_lens = d_lens;
    err = kernels::dense_decode_cuda(q, hq, view, float(shape_.scale()), d_o, d_lse, ws, ws_bytes,
                                     stream);
  }
  if (err == cudaSuccess) err = mk::fill_entries_cuda(st, mp, b, p0, n, q_pre, d_o, d_lse, stream);
  const cudaError_t sync = cudaStreamSynchronize(stream);  // the temporaries die here
  cudaFree(ws);
  cudaFree(d_lens);
  cudaFree(d_table);
  cudaFree(d_o);
  cudaFree(d_lse);
  KVS_CUDA_CHECK(err);
  KVS_CUDA_CHECK(sync);
}

void MacEngine::decode(int layer, const bf16* q, const bf16* q_pre, const PagedKV& kv, bf16* out,
                       float* lse, cudaStream_t stream) {
  check_decode_args(layer, kv, q, out);
  if (!q_pre)
    throw std::invalid_argument("mac engine decode: q_pre is null (MAC matches pre-RoPE queries)");
  if (!allocated_[size_t(layer)])
    throw std::logic_error("mac engine decode: layer " + str(int64_t(layer)) +
                           " was never prefilled (no rings)");
  ++decode_calls_;
  const mk::RingState& st = layers_[size_t(layer)].view;
  const mk::MatchParams mp = match_params(layer);
  if (config_.backend == Backend::Cpu) {
    mk::decode_cpu(st, mp, q, q_pre, shape_.num_q_heads, kv, shape_.scale(), out, lse,
                   host_counters_);
    return;
  }
  KVS_CUDA_CHECK(mk::decode_cuda(st, mp, q, q_pre, shape_.num_q_heads, kv, float(shape_.scale()),
                                 out, lse, device_counters_.get(), workspace_.ptr, workspace_.bytes,
                                 stream));
}

void MacEngine::read_counters(uint64_t* c) const {
  std::copy(host_counters_, host_counters_ + mk::kNumCounters, c);
  if (device_counters_) {
    const std::vector<uint64_t> d = device_counters_.read();
    std::copy(d.begin(), d.end(), c);
  }
}

MacStats MacEngine::mac_stats() const {
  uint64_t c[mk::kNumCounters];
  read_counters(c);
  MacStats s;
  s.head_steps = c[mk::kHeadSteps];
  s.head_hits = c[mk::kHeadHits];
  s.kv_rows_read = c[mk::kRowsRead];
  s.kv_rows_context = c[mk::kRowsContext];
  return s;
}

EngineStats MacEngine::stats() const {
  uint64_t c[mk::kNumCounters];
  read_counters(c);
  EngineStats s;
  s.decode_calls = decode_calls_;
  s.kv_rows_read = c[mk::kRowsRead];
  s.kv_rows_context = c[mk::kRowsContext];
  s.selection_bytes_read = c[mk::kSelectionBytes];
  return s;
}

void MacEngine::reset_stats() {
  decode_calls_ = 0;
  std::fill(host_counters_, host_counters_ + mk::kNumCounters, 0);
  device_counters_.reset();
}

std::vector<std::vector<int32_t>> MacEngine::last_read(int layer, int b) const {
  const mk::RingState& st = ring_state(layer);
  if (b < 0 || b >= config_.max_batch)
    throw std::out_of_range("mac engine last_read: sequence " + str(int64_t(b)) +
                            " outside [0, max_batch " + str(int64_t(config_.max_batch)) + ")");
  const int hq = shape_.num_q_heads;
  std::vector<int32_t> start(static_cast<size_t>(hq));
  int32_t len = 0;
  if (config_.backend == Backend::Cuda) {
    copy_to_host(start.data(), st.last_start + st.head(b, 0), hq * sizeof(int32_t));
    copy_to_host(&len, st.last_len + b, sizeof len);
  } else {
    std::copy(st.last_start + st.head(b, 0), st.last_start + st.head(b, hq), start.begin());
    len = st.last_len[b];
  }
  std::vector<std::vector<int32_t>> read(static_cast<size_t>(hq));
  for (int h = 0; h < hq; ++h)
    for (int32_t t = start[size_t(h)]; t < len; ++t) read[size_t(h)].push_back(t);
  return read;
}

}  // namespace kvs
