#include "runtime/saap_engine.h"

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>

#include "kernels/common/cuda_check.h"
#include "kernels/common/kv_update.h"
#include "kernels/common/thread_pool.h"
#include "kernels/dense/dense_decode.h"

namespace kvs {
namespace {

namespace sk = kernels::saap;

std::string str(int64_t x) { return std::to_string(x); }

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

template <typename T>
T* device_upload(const T* src, size_t count) {
  void* p = nullptr;
  KVS_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
  copy_to_device(p, src, count * sizeof(T));
  return static_cast<T*>(p);
}

// A weight matrix [rows, K] in e4m3 (sk::quantize_rows_e4m3).
struct RowsE4m3 {
  std::vector<uint8_t> q;
  std::vector<float> scale, dequantized;
};

RowsE4m3 quantize(const std::vector<float>& w, int K) {
  RowsE4m3 r;
  const int64_t rows = int64_t(w.size()) / K;
  r.q.resize(w.size());
  r.scale.resize(size_t(rows));
  r.dequantized.resize(w.size());
  sk::quantize_rows_e4m3(w.data(), rows, K, r.q.data(), r.scale.data(), r.dequantized.data());
  return r;
}

// One layer's router as a backend takes it, built on the host: the centroids and their squared
// norms, and the MLP with batch norm folded into its first layer. With fp8 the weights are
// rounded to e4m3 (the CPU multiplies with their dequantized values); for CUDA they are packed
// in the GEMVs' orders (w1 in the first GEMV's fragment order, w2 in column blocks or in
// fragment order).
struct HostRouter {
  std::vector<float> centroids, norms, b1, b2;
  std::vector<float> w1, w2;              // CPU
  std::vector<uint8_t> w1_e4m3, w2_e4m3;  // CUDA, fp8
  std::vector<float> w1_scale, w2_scale;  // CUDA, fp8
  std::vector<bf16> w1_bf16, w2_bf16;     // CUDA, bf16
};

HostRouter prepare_router(const SaapParts& parts, int slot, bool fp8, bool cuda,
                          bool w2_column_blocks) {
  const int C = parts.num_clusters, d = parts.head_dim, hq = parts.num_q_heads,
            H = parts.hidden_dim;
  HostRouter r;
  r.centroids = parts.per_layer[size_t(slot)].centroids;
  r.norms.resize(size_t(parts.num_kv_heads) * C);
  for (size_t c = 0; c < r.norms.size(); ++c) {
    double s = 0.0;
    for (int k = 0; k < d; ++k) s += double(r.centroids[c * d + k]) * r.centroids[c * d + k];
    r.norms[c] = float(s);
  }
  FoldedMlp mlp = fold_batch_norm(parts, slot);
  // fp8: both backends multiply with the dequantized e4m3 weights.
  RowsE4m3 q1, q2;
  if (fp8) {
    q1 = quantize(mlp.w1, d);
    q2 = quantize(mlp.w2, H);
    mlp.w1 = std::move(q1.dequantized);
    mlp.w2 = std::move(q2.dequantized);
  }
  r.b1 = std::move(mlp.b1);
  r.b2 = std::move(mlp.b2);
  if (!cuda) {
    r.w1 = std::move(mlp.w1);
    r.w2 = std::move(mlp.w2);
  } else if (fp8) {
    r.w1_e4m3.resize(sk::mma_rows_bytes(hq, H, d, true));
    r.w2_e4m3.resize(w2_column_blocks ? sk::column_blocks_bytes(hq, C, H, true)
                                      : sk::mma_rows_bytes(hq, C, H, true));
    sk::pack_mma_rows_e4m3(q1.q.data(), hq, H, d, r.w1_e4m3.data());
    if (w2_column_blocks)
      sk::pack_column_blocks_e4m3(q2.q.data(), hq, C, H, r.w2_e4m3.data());
    else
      sk::pack_mma_rows_e4m3(q2.q.data(), hq, C, H, r.w2_e4m3.data());
    r.w1_scale = std::move(q1.scale);
    r.w2_scale = std::move(q2.scale);
  } else {
    r.w1_bf16.resize(sk::mma_rows_bytes(hq, H, d, false) / 2);
    r.w2_bf16.resize((w2_column_blocks ? sk::column_blocks_bytes(hq, C, H, false)
                                       : sk::mma_rows_bytes(hq, C, H, false)) /
                     2);
    sk::pack_mma_rows(mlp.w1.data(), hq, H, d, r.w1_bf16.data());
    if (w2_column_blocks)
      sk::pack_column_blocks(mlp.w2.data(), hq, C, H, r.w2_bf16.data());
    else
      sk::pack_mma_rows(mlp.w2.data(), hq, C, H, r.w2_bf16.data());
  }
  return r;
}

void validate(const SaapConfig& c, const SaapParts& p, const ModelShape& s) {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("SaapConfig: " + what);
  };
  need(c.probes >= 1 && c.probes <= p.num_clusters,
       "probes must be in [1, num_clusters = " + str(p.num_clusters) + " of the bundle], got " +
           str(c.probes));
  need(c.sink_tokens >= 0, "sink_tokens must be >= 0, got " + str(c.sink_tokens));
  need(c.recent_tokens >= 1,
       "recent_tokens must be >= 1 (the new token), got " + str(c.recent_tokens));
  need(c.max_context >= 0, "max_context must be >= 0, got " + str(c.max_context));
  need(c.index_every >= 1 && c.index_every <= sk::kMaxIndexStep,
       "index_every must be in [1, " + str(sk::kMaxIndexStep) + "], got " + str(c.index_every));
  need(c.index_phase >= -1 && c.index_phase < c.index_every,
       "index_phase must be -1 (a phase per layer) or in [0, index_every " + str(c.index_every) +
           "), got " + str(c.index_phase));
  need(c.fold_every >= 0 && c.fold_every <= sk::kMaxFold,
       "fold_every must be in [0, " + str(sk::kMaxFold) + "] (0: never), got " + str(c.fold_every));
  // One fold a step then keeps the scanned assignments below fold_every (saap.h).
  need(c.fold_every == 0 || c.index_every <= c.fold_every,
       "index_every (" + str(c.index_every) + ") must not exceed fold_every (" +
           str(c.fold_every) + ")");
  for (int l : c.dense_layers)
    need(l >= 0 && l < s.num_layers,
         "dense_layers entry " + str(l) + " outside [0, " + str(s.num_layers) + ")");
}

}  // namespace

const char* to_string(SaapRouter r) { return r == SaapRouter::Mlp ? "mlp" : "nearest_centroid"; }

SaapRouter saap_router_from_string(const std::string& name) {
  if (name == "mlp") return SaapRouter::Mlp;
  if (name == "nearest_centroid") return SaapRouter::NearestCentroid;
  throw std::invalid_argument("unknown SAAP query router '" + name +
                              "' (known: mlp, nearest_centroid)");
}

const char* to_string(SaapWeights w) { return w == SaapWeights::Bf16 ? "bf16" : "fp8"; }

SaapWeights saap_weights_from_string(const std::string& name) {
  if (name == "bf16") return SaapWeights::Bf16;
  if (name == "fp8") return SaapWeights::Fp8;
  throw std::invalid_argument("unknown SAAP router weight format '" + name +
                              "' (known: bf16, fp8)");
}

SaapEngine::SaapEngine(const ModelShape& shape, const EngineConfig& config, SaapParts parts)
    : Engine(shape, config), parts_(std::move(parts)) {
  parts_.validate(&shape_);
  const SaapConfig& c = config_.saap;
  validate(c, parts_, shape_);
  max_context_ = c.max_context > 0 ? c.max_context : shape_.max_position;
  if (max_context_ <= 0)
    throw std::invalid_argument(
        "SaapConfig: max_context is 0 and the model's max_position is 0: set max_context");
  inv_freq_ = rope_inv_freq(shape_.rope, shape_.head_dim);
  const bool cuda = config_.backend == Backend::Cuda;
  if (cuda) {
    if (shape_.head_dim != 64 && shape_.head_dim != 128)
      throw std::invalid_argument("saap engine (cuda): head_dim " + str(shape_.head_dim) +
                                  " is not supported (64 or 128)");
    if (shape_.group_size() > 8)
      throw std::invalid_argument("saap engine (cuda): group size " + str(shape_.group_size()) +
                                  " above 8");
    if (parts_.num_clusters > sk::kMaxClustersCuda)
      throw std::invalid_argument("saap engine (cuda): num_clusters " + str(parts_.num_clusters) +
                                  " above " + str(sk::kMaxClustersCuda));
    if (c.query_router == SaapRouter::Mlp && parts_.hidden_dim > sk::kMaxHiddenCuda)
      throw std::invalid_argument("saap engine (cuda): hidden_dim " + str(parts_.hidden_dim) +
                                  " above " + str(sk::kMaxHiddenCuda));
    KVS_CUDA_CHECK(sk::prepare_cuda(parts_.hidden_dim));
    d_inv_freq_ = device_upload(inv_freq_.data(), inv_freq_.size());
    if (config_.collect_stats) device_counters_ = DeviceCounters(3);
  }
  const bool fp8 = c.router_weights == SaapWeights::Fp8;
  // w1 in the first GEMV's fragment order, w2 by saap_w2_in_column_blocks.
  const bool w2_column_blocks = cuda && saap_w2_in_column_blocks(config_.max_batch);
  // The layers' host work (prepare_router: about 2 s a layer at C 1024, hidden 1024 and 32
  // query heads on one core) is independent, so it runs on a pool of the machine's threads;
  // the uploads follow in layer order. An error is the lowest failing layer's.
  std::vector<HostRouter> host(parts_.layers.size());
  {
    const int threads =
        std::max(1, std::min(int(host.size()), int(std::thread::hardware_concurrency())));
    kernels::ThreadPool pool(threads);
    std::vector<std::exception_ptr> errors(host.size());
    pool.parallel_for(int64_t(host.size()), [&](int64_t i, int) {
      try {
        host[size_t(i)] = prepare_router(parts_, int(i), fp8, cuda, w2_column_blocks);
      } catch (...) {
        errors[size_t(i)] = std::current_exception();
      }
    });
    for (const std::exception_ptr& e : errors)
      if (e) std::rethrow_exception(e);
  }
  for (HostRouter& h : host) {
    LayerRouter r;
    if (cuda) {
      r.d_centroids = device_upload(h.centroids.data(), h.centroids.size());
      r.d_norms = device_upload(h.norms.data(), h.norms.size());
      r.w2_column_blocks = w2_column_blocks;
      if (fp8) {
        r.d_w1_e4m3 = device_upload(h.w1_e4m3.data(), h.w1_e4m3.size());
        r.d_w1_scale = device_upload(h.w1_scale.data(), h.w1_scale.size());
        r.d_w2_e4m3 = device_upload(h.w2_e4m3.data(), h.w2_e4m3.size());
        r.d_w2_scale = device_upload(h.w2_scale.data(), h.w2_scale.size());
      } else {
        r.d_w1 = device_upload(h.w1_bf16.data(), h.w1_bf16.size());
        r.d_w2 = device_upload(h.w2_bf16.data(), h.w2_bf16.size());
      }
      r.d_b1 = device_upload(h.b1.data(), h.b1.size());
      r.d_b2 = device_upload(h.b2.data(), h.b2.size());
    } else {
      r.centroids = std::move(h.centroids);
      r.norms = std::move(h.norms);
      r.w1 = std::move(h.w1);
      r.b1 = std::move(h.b1);
      r.w2 = std::move(h.w2);
      r.b2 = std::move(h.b2);
    }
    routers_.push_back(std::move(r));
    h = HostRouter{};  // its host copies are no longer needed
  }
  index_.resize(size_t(shape_.num_layers));
  last_tokens_.resize(size_t(shape_.num_layers));
  last_clusters_.resize(size_t(shape_.num_layers));
}

SaapEngine::~SaapEngine() {
  if (config_.backend != Backend::Cuda) return;
  for (LayerRouter& r : routers_) {
    cudaFree(r.d_centroids);
    cudaFree(r.d_norms);
    cudaFree(r.d_w1);
    cudaFree(r.d_b1);
    cudaFree(r.d_w2);
    cudaFree(r.d_b2);
    cudaFree(r.d_w1_e4m3);
    cudaFree(r.d_w1_scale);
    cudaFree(r.d_w2_e4m3);
    cudaFree(r.d_w2_scale);
  }
  for (LayerIndex& li : index_) {
    if (!li.allocated) continue;
    cudaFree(li.view.offsets);
    cudaFree(li.view.members);
    cudaFree(li.view.assign);
    cudaFree(li.view.indexed_len);
    cudaFree(li.view.csr_len);
    cudaFree(li.view.member_rows);
    cudaFree(li.view.step_best);
  }
  cudaFree(d_inv_freq_);
}

bool SaapEngine::is_dense_layer(int layer) const {
  const auto& d = config_.saap.dense_layers;
  return std::find(d.begin(), d.end(), layer) != d.end();
}

sk::Window SaapEngine::window() const {
  sk::Window w;
  w.sink = config_.saap.sink_tokens;
  w.recent = config_.saap.recent_tokens;
  return w;
}

sk::Router<float> SaapEngine::cpu_router(int slot) const {
  const LayerRouter& lr = routers_[size_t(slot)];
  sk::Router<float> r;
  r.centroids = lr.centroids.data();
  r.centroid_norms = lr.norms.data();
  r.w1 = lr.w1.data();
  r.b1 = lr.b1.data();
  r.w2 = lr.w2.data();
  r.b2 = lr.b2.data();
  r.num_q_heads = parts_.num_q_heads;
  r.num_kv_heads = parts_.num_kv_heads;
  r.head_dim = parts_.head_dim;
  r.hidden = parts_.hidden_dim;
  r.num_clusters = parts_.num_clusters;
  r.use_mlp = config_.saap.query_router == SaapRouter::Mlp;
  return r;
}

sk::Router<bf16> SaapEngine::cuda_router(int slot) const {
  const LayerRouter& lr = routers_[size_t(slot)];
  sk::Router<bf16> r;
  r.centroids = lr.d_centroids;
  r.centroid_norms = lr.d_norms;
  r.w1 = lr.d_w1;
  r.b1 = lr.d_b1;
  r.w2 = lr.d_w2;
  r.b2 = lr.d_b2;
  r.w1_e4m3 = lr.d_w1_e4m3;
  r.w1_scale = lr.d_w1_scale;
  r.w2_e4m3 = lr.d_w2_e4m3;
  r.w2_scale = lr.d_w2_scale;
  r.w2_column_blocks = lr.w2_column_blocks;
  r.num_q_heads = parts_.num_q_heads;
  r.num_kv_heads = parts_.num_kv_heads;
  r.head_dim = parts_.head_dim;
  r.hidden = parts_.hidden_dim;
  r.num_clusters = parts_.num_clusters;
  r.use_mlp = config_.saap.query_router == SaapRouter::Mlp;
  return r;
}

int SaapEngine::require_slot(int layer, const char* who) const {
  const int slot = parts_.layer_slot(layer);
  if (slot < 0) {
    std::string have;
    for (int l : parts_.layers) have += (have.empty() ? "" : ",") + str(l);
    throw std::invalid_argument(
        std::string("saap engine ") + who + ": layer " + str(layer) +
        " has no SAAP index in the bundle (indexed layers: " + (have.empty() ? "none" : have) +
        "); train it or add it to SaapConfig::dense_layers");
  }
  return slot;
}

uint64_t SaapEngine::router_bytes_per_kv_head() const {
  const uint64_t C = uint64_t(parts_.num_clusters), H = uint64_t(parts_.hidden_dim);
  const uint64_t d = uint64_t(parts_.head_dim), g = uint64_t(shape_.group_size());
  if (config_.saap.query_router == SaapRouter::NearestCentroid) return C * d * sizeof(float);
  const bool fp8 = config_.saap.router_weights == SaapWeights::Fp8;
  const uint64_t wbytes = fp8 ? 1 : config_.backend == Backend::Cuda ? sizeof(bf16) : sizeof(float);
  // bias (and with fp8 the scale) per output row
  const uint64_t per_row = (fp8 ? 2 : 1) * sizeof(float);
  return g * ((H * d + C * H) * wbytes + (H + C) * per_row);
}

size_t SaapEngine::selected_bytes() const {
  return align_up(size_t(config_.max_batch) * shape_.num_kv_heads * config_.saap.probes *
                  sizeof(int32_t));
}

// The token lists attend_cuda writes (tokens and counts; no rows: the attention resolves
// its rows in shared memory).
size_t SaapEngine::lists_bytes() const {
  const size_t subs = size_t(config_.max_batch) * shape_.num_kv_heads;
  return align_up(subs * size_t(max_context_) * sizeof(int32_t)) + align_up(subs * sizeof(int32_t));
}

size_t SaapEngine::route_bytes() const {
  return align_up(sk::route_workspace_bytes(config_.max_batch, shape_.num_q_heads,
                                            parts_.hidden_dim, parts_.num_clusters));
}

// [selected | lists | route scratch], then the attention's states.
size_t SaapEngine::select_bytes() const { return selected_bytes() + lists_bytes() + route_bytes(); }

size_t SaapEngine::workspace_bytes() const {
  if (config_.backend == Backend::Cpu) return 0;
  // The attention of a sparse layer (its parts' states) or of a dense layer (the whole
  // batch), whichever is larger.
  const int d = shape_.head_dim;
  return select_bytes() +
         std::max(sk::attend_workspace_bytes(config_.max_batch, shape_.num_q_heads,
                                             shape_.num_kv_heads, d),
                  kernels::dense_decode_workspace_bytes(config_.max_batch, shape_.num_q_heads, d));
}

int32_t* SaapEngine::selected_ptr() const { return static_cast<int32_t*>(workspace_.ptr); }

kernels::tactic::Selection SaapEngine::lists() const {
  const size_t subs = size_t(config_.max_batch) * shape_.num_kv_heads;
  char* p = static_cast<char*>(workspace_.ptr) + selected_bytes();
  kernels::tactic::Selection s;
  s.max_tokens = max_context_;
  s.tokens = reinterpret_cast<int32_t*>(p);
  p += align_up(subs * size_t(max_context_) * sizeof(int32_t));
  s.counts = reinterpret_cast<int32_t*>(p);
  return s;
}

const sk::IndexState& SaapEngine::index_state(int layer) const {
  if (layer < 0 || layer >= shape_.num_layers || !index_[size_t(layer)].allocated)
    throw std::logic_error("saap engine: layer " + str(layer) + " has no index (prefill it first)");
  return index_[size_t(layer)].view;
}

int SaapEngine::index_phase(int layer) const {
  const int every = config_.saap.index_every;
  return config_.saap.index_phase < 0 ? layer % every : config_.saap.index_phase;
}

SaapEngine::LayerIndex& SaapEngine::allocate_index(int layer) {
  LayerIndex& li = index_[size_t(layer)];
  if (li.allocated) return li;
  sk::IndexState& v = li.view;
  v.max_batch = config_.max_batch;
  v.num_kv_heads = shape_.num_kv_heads;
  v.num_clusters = parts_.num_clusters;
  v.max_tokens = max_context_;
  v.fold_every = config_.saap.fold_every;
  v.index_every = config_.saap.index_every;
  v.index_phase = index_phase(layer);
  const int64_t slots = int64_t(v.max_batch) * v.num_kv_heads;
  const int64_t n_off = slots * (int64_t(v.num_clusters) + 1);
  const int64_t n_tok = slots * v.max_tokens;
  if (config_.backend == Backend::Cpu) {
    li.offsets.assign(size_t(n_off), 0);
    li.members.assign(size_t(n_tok), 0);
    li.assign.assign(size_t(n_tok), 0);
    li.indexed_len.assign(size_t(slots), 0);
    li.csr_len.assign(size_t(slots), 0);
    v.offsets = li.offsets.data();
    v.members = li.members.data();
    v.assign = li.assign.data();
    v.indexed_len = li.indexed_len.data();
    v.csr_len = li.csr_len.data();
  } else {
    v.offsets = device_alloc<int32_t>(n_off);
    v.members = device_alloc<int32_t>(n_tok);
    v.assign = device_alloc<int32_t>(n_tok);
    v.indexed_len = device_alloc<int32_t>(slots);
    v.csr_len = device_alloc<int32_t>(slots);
    if (config_.saap.member_rows) v.member_rows = device_alloc<int32_t>(n_tok);
    zero_on_device(v.offsets, size_t(n_off) * sizeof(int32_t));
    zero_on_device(v.indexed_len, size_t(slots) * sizeof(int32_t));
    zero_on_device(v.csr_len, size_t(slots) * sizeof(int32_t));
    v.step_best = device_alloc<unsigned long long>(slots * sk::kMaxIndexStep);
    zero_on_device(v.step_best, size_t(slots) * sk::kMaxIndexStep * sizeof(unsigned long long));
  }
  li.allocated = true;
  return li;
}

void SaapEngine::prefill(int layer, const PagedKV& kv, cudaStream_t stream) {
  const std::string who = "saap engine prefill: ";
  check_prefill_args(who, layer, kv, shape_, config_.max_batch);
  if (is_dense_layer(layer)) return;
  const int slot = require_slot(layer, "prefill");
  const std::vector<int32_t> lens = host_seq_lens(kv, config_.backend, stream);
  int max_len = 0;
  for (int b = 0; b < kv.batch; ++b) {
    if (lens[size_t(b)] > max_context_)
      throw std::out_of_range(who + "sequence " + str(b) + " has " + str(lens[size_t(b)]) +
                              " tokens, above max_context " + str(max_context_) +
                              " (SaapConfig.max_context)");
    max_len = std::max(max_len, int(lens[size_t(b)]));
  }
  LayerIndex& li = allocate_index(layer);
  sk::Unassigned none;
  if (config_.backend == Backend::Cpu) {
    const sk::Router<float> r = cpu_router(slot);
    for (int b = 0; b < kv.batch; ++b)
      for (int h = 0; h < shape_.num_kv_heads; ++h) {
        const sk::Unassigned u =
            sk::index_prefill_cpu(kv, b, h, inv_freq_.data(), window(), r, li.view);
        if (none.count == 0)
          none = u;
        else
          none.count += u.count;
      }
  } else {
    const size_t ws_bytes =
        sk::index_prefill_workspace_bytes(max_len, shape_.num_kv_heads, shape_.head_dim);
    with_temporary_workspace(ws_bytes, stream, [&](void* ws) {
      return sk::index_prefill_cuda(kv, lens.data(), d_inv_freq_, window(), cuda_router(slot),
                                    li.view, ws, ws_bytes, stream, &none);
    });
  }
  // The index is whole either way (those keys are in no cluster); the caller learns of them.
  if (none.count > 0)
    throw std::invalid_argument(
        who + "layer " + str(layer) + ": " + str(none.count) +
        " keys score NaN against every centroid (a NaN or inf in the KV cache), the first at "
        "sequence " +
        str(none.b) + ", kv head " + str(none.h) + ", token " + str(none.t) +
        "; they are in no cluster and would be attended only inside the dense window");
}

void SaapEngine::decode(int layer, const bf16* q, const bf16* q_pre, const PagedKV& kv, bf16* out,
                        float* lse, cudaStream_t stream) {
  check_decode_args(layer, kv, q, out);
  ++host_stats_.decode_calls;
  const bool dense = is_dense_layer(layer);
  if (!dense) {
    require_slot(layer, "decode");
    if (!index_[size_t(layer)].allocated)
      throw std::logic_error("saap engine decode: layer " + str(layer) +
                             " was never prefilled (no index)");
    if (q_pre == nullptr)
      throw std::invalid_argument(
          "saap engine decode: q_pre is null; SAAP routes the pre-RoPE "
          "queries (layer " +
          str(layer) + ")");
  }
  if (config_.backend == Backend::Cpu) {
    decode_cpu(layer, q, q_pre, kv, out, lse);
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
    const int slot = parts_.layer_slot(layer);
    const sk::Router<bf16> router = cuda_router(slot);
    const sk::IndexState& st = index_[size_t(layer)].view;
    const kernels::tactic::Selection sel = lists();
    char* route_ws = ws + selected_bytes() + lists_bytes();
    KVS_CUDA_CHECK(sk::decode_select_cuda(q_pre, kv.batch, router, config_.saap.probes,
                                          selected_ptr(), route_ws, route_bytes(), stream, &st));
    // The attention, then the index step (its share in the attention's parts, its commit and
    // the fold in the merge kernel's).
    KVS_CUDA_CHECK(sk::attend_cuda(q, kv, scale, window(), st, router, d_inv_freq_, selected_ptr(),
                                   config_.saap.probes, sel, device_counters_.get(),
                                   router_bytes_per_kv_head(), shape_.num_q_heads, out, lse,
                                   ws + select_bytes(), workspace_.bytes - select_bytes(), stream));
  }
  if (device_counters_)
    KVS_CUDA_CHECK(kernels::kv_count_rows_cuda(kv.seq_lens, kv.batch, kv.num_kv_heads,
                                               device_counters_.get() + 2, stream));
}

void SaapEngine::decode_cpu(int layer, const bf16* q, const bf16* q_pre, const PagedKV& kv,
                            bf16* out, float* lse) {
  const int d = shape_.head_dim, g = shape_.group_size(), hq = shape_.num_q_heads;
  const int hkv = shape_.num_kv_heads;
  const double scale = shape_.scale();
  std::vector<float> qf(static_cast<size_t>(d));
  std::vector<double> o(static_cast<size_t>(d));
  auto attend = [&](int b, int h, const int32_t* tokens, int count) {
    for (int j = 0; j < g; ++j) {
      const int64_t row = int64_t(b) * hq + h * g + j;
      for (int i = 0; i < d; ++i) qf[size_t(i)] = bf16_to_float(q[row * d + i]);
      double l;
      kernels::attend_cpu(qf.data(), kv, b, h, tokens, count, scale, o.data(), &l);
      for (int i = 0; i < d; ++i) out[row * d + i] = float_to_bf16(float(o[size_t(i)]));
      if (lse) lse[row] = float(l);
    }
  };
  for (int b = 0; b < kv.batch; ++b) host_stats_.kv_rows_context += uint64_t(kv.seq_lens[b]) * hkv;
  auto& last_t = last_tokens_[size_t(layer)];
  auto& last_c = last_clusters_[size_t(layer)];
  last_t.assign(size_t(kv.batch) * hkv, {});
  last_c.assign(size_t(kv.batch) * hkv, {});
  if (is_dense_layer(layer)) {
    last_t.clear();  // empty: every token
    for (int b = 0; b < kv.batch; ++b)
      for (int h = 0; h < hkv; ++h) {
        attend(b, h, nullptr, 0);
        host_stats_.kv_rows_read += uint64_t(kv.seq_lens[b]);
      }
    return;
  }
  const int slot = parts_.layer_slot(layer);
  const sk::Router<float> r = cpu_router(slot);
  const sk::IndexState& st = index_[size_t(layer)].view;
  const int C = parts_.num_clusters, l = config_.saap.probes;
  std::vector<float> qg(size_t(g) * d);
  std::vector<double> scores(static_cast<size_t>(C));
  for (int b = 0; b < kv.batch; ++b) {
    if (kv.seq_lens[b] > max_context_)
      throw std::out_of_range("saap engine decode: sequence " + str(b) + " has " +
                              str(kv.seq_lens[b]) + " tokens, above max_context " +
                              str(max_context_));
    for (int h = 0; h < hkv; ++h) {
      for (size_t i = 0; i < qg.size(); ++i)
        qg[i] = bf16_to_float(q_pre[(int64_t(b) * hq + h * g) * d + int64_t(i)]);
      sk::route_scores_cpu(r, h, qg.data(), scores.data());
      std::vector<int32_t> clusters(static_cast<size_t>(l));
      sk::top_clusters_cpu(scores.data(), C, l, clusters.data());
      std::vector<int32_t> tokens =
          sk::selected_tokens_cpu(kv, b, h, window(), st, clusters.data(), l);
      attend(b, h, tokens.data(), int(tokens.size()));
      const int64_t s = st.slot(b, h);
      host_stats_.kv_rows_read += tokens.size();
      host_stats_.selection_bytes_read += router_bytes_per_kv_head() + 8ull * l +
                                          4ull * uint64_t(st.indexed_len[s] - st.csr_len[s]);
      last_t[size_t(b) * hkv + h] = std::move(tokens);
      last_c[size_t(b) * hkv + h] = std::move(clusters);
      // The index step after the attention, as on CUDA (kernels/saap/saap.h).
      sk::index_step_cpu(kv, b, h, inv_freq_.data(), window(), r, st);
    }
  }
}

std::vector<int32_t> SaapEngine::last_clusters(int layer, int b, int h) const {
  const int hkv = shape_.num_kv_heads, l = config_.saap.probes;
  if (layer < 0 || layer >= shape_.num_layers || is_dense_layer(layer)) return {};
  if (config_.backend == Backend::Cpu) {
    const auto& last = last_clusters_[size_t(layer)];
    const size_t i = size_t(b) * hkv + h;
    return i < last.size() ? last[i] : std::vector<int32_t>{};
  }
  std::vector<int32_t> out(static_cast<size_t>(l));
  copy_to_host(out.data(), selected_ptr() + (size_t(b) * hkv + h) * l, out.size() * sizeof(int32_t));
  return out;
}

std::vector<std::vector<int32_t>> SaapEngine::last_read(int layer, int b) const {
  if (layer < 0 || layer >= shape_.num_layers || is_dense_layer(layer)) return {};
  const int hkv = shape_.num_kv_heads, g = shape_.group_size();
  std::vector<std::vector<int32_t>> per_kv_head(static_cast<size_t>(hkv));
  if (config_.backend == Backend::Cpu) {
    const auto& last = last_tokens_[size_t(layer)];
    if (size_t(b + 1) * hkv > last.size()) return {};
    for (int h = 0; h < hkv; ++h) per_kv_head[size_t(h)] = last[size_t(b) * hkv + h];
  } else {
    // The lists in the workspace belong to the last decode call, whichever layer it was.
    per_kv_head = read_kv_head_lists(lists(), b, hkv);
  }
  return per_query_head_lists(std::move(per_kv_head), g, true);
}

EngineStats SaapEngine::stats() const {
  EngineStats s = host_stats_;
  if (device_counters_) device_counters_.read_into(&s, 0, 1, 2);
  return s;
}

void SaapEngine::reset_stats() {
  host_stats_ = EngineStats{};
  device_counters_.reset();
}

}  // namespace kvs
