#include "runtime/magicpig_engine.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "artifacts/h5.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/kv_update.h"
#include "kernels/common/merge_states.h"
#include "kernels/dense/dense_decode.h"
#include "kernels/magicpig/magicpig_math.h"

namespace kvs {
namespace {

namespace mp = kernels::magicpig;

std::string str(int64_t x) { return std::to_string(x); }
size_t align_up(size_t x) { return (x + 255) / 256 * 256; }

// Host memory, pinned (cudaHostAlloc) for what the GPU copies to or from, plain otherwise.
template <typename T>
class HostArray {
 public:
  HostArray() = default;
  ~HostArray() { release(); }
  HostArray(const HostArray&) = delete;
  HostArray& operator=(const HostArray&) = delete;
  void allocate(size_t n, bool pinned) {
    release();
    n_ = n;
    pinned_ = pinned;
    const size_t bytes = std::max<size_t>(n, 1) * sizeof(T);
    if (pinned) {
      KVS_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&p_), bytes, cudaHostAllocDefault));
    } else {
      p_ = static_cast<T*>(::operator new(bytes));
    }
  }
  T* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  void release() {
    if (!p_) return;
    if (pinned_)
      cudaFreeHost(p_);
    else
      ::operator delete(p_);
    p_ = nullptr;
    n_ = 0;
  }
  T* p_ = nullptr;
  size_t n_ = 0;
  bool pinned_ = false;
};

template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  ~DeviceArray() {
    if (p_) cudaFree(p_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void allocate(size_t n) {
    if (p_) cudaFree(p_);
    p_ = nullptr;
    n_ = n;
    KVS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), std::max<size_t>(n, 1) * sizeof(T)));
  }
  T* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

void validate(const MagicPigConfig& c, const ModelShape& s) {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("MagicPigConfig: " + what);
  };
  need(c.bits >= 1 && c.bits <= mp::kMaxBits,
       "bits (K) must be in [1, " + str(mp::kMaxBits) + "], got " + str(c.bits));
  need(c.tables >= 2, "tables (L) must be >= 2 (candidates need 2 hits), got " + str(c.tables));
  need(c.sink_tokens >= 0, "sink_tokens must be >= 0, got " + str(c.sink_tokens));
  need(c.local_tokens >= 0, "local_tokens must be >= 0, got " + str(c.local_tokens));
  // 1 / epsilon bounds the importance weights, which the CPU path keeps in fp32.
  need(c.epsilon >= 1e-30 && c.epsilon <= 1.0,
       "epsilon must be in [1e-30, 1], got " + std::to_string(c.epsilon));
  need(c.threads >= 0, "threads must be >= 0, got " + str(c.threads));
  need(c.max_context >= 0, "max_context must be >= 0, got " + str(c.max_context));
  if (c.dense_layers)
    for (int l : *c.dense_layers)
      need(l >= 0 && l < s.num_layers,
           "dense_layers entry " + str(l) + " outside [0, " + str(s.num_layers) + ")");
}

mp::CpuIsa isa_from_string(const std::string& name) {
  if (name == "auto") return mp::CpuIsa::Auto;
  if (name == "portable") return mp::CpuIsa::Portable;
  if (name == "avx2") return mp::CpuIsa::Avx2;
  if (name == "avx512") return mp::CpuIsa::Avx512;
  throw std::invalid_argument("MagicPigConfig: cpu_isa '" + name +
                              "' is unknown (auto, portable, avx2, avx512)");
}

// Byte offsets of the CUDA workspace: dense rows | dense counts | o, lse of the dense part |
// o, lse of the sampled part (gpu mode: kMaxSplits partial states per row) | query codes |
// hit bitmaps (gpu mode) | dense decode workspace. The one place that lays it out
// (workspace_bytes, decode_cuda and last_read all read it from here).
struct WorkspaceLayout {
  size_t dense_rows = 0, dense_counts = 0, o_dense = 0, lse_dense = 0, o_sampled = 0,
         lse_sampled = 0, q_codes = 0, bitmap = 0, dense_ws = 0;
};

WorkspaceLayout workspace_layout(int max_batch, int num_kv_heads, int num_q_heads, int head_dim,
                                 int tables, int max_context, bool gpu_mode) {
  const size_t subs = size_t(max_batch) * num_kv_heads;
  const size_t rows = size_t(max_batch) * num_q_heads, d = size_t(head_dim);
  const size_t parts = rows * (gpu_mode ? size_t(mp::kMaxSplits) : 1);
  WorkspaceLayout w;
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t r = at;
    at += align_up(bytes);
    return r;
  };
  w.dense_rows = take(subs * size_t(max_context) * 4);
  w.dense_counts = take(subs * 4);
  w.o_dense = take(rows * d * 2);
  w.lse_dense = take(rows * 4);
  w.o_sampled = take(parts * d * 4);
  w.lse_sampled = take(parts * 4);
  w.q_codes = take(rows * size_t(tables) * 2);
  w.bitmap = gpu_mode ? take(rows * size_t(mp::bitmap_words(max_context)) * 4) : at;
  w.dense_ws = at;
  return w;
}

}  // namespace

const char* to_string(MagicPigMode mode) {
  return mode == MagicPigMode::CpuOffload ? "cpu_offload" : "gpu";
}

MagicPigMode magicpig_mode_from_string(const std::string& name) {
  if (name == "cpu_offload") return MagicPigMode::CpuOffload;
  if (name == "gpu") return MagicPigMode::Gpu;
  throw std::invalid_argument("unknown MagicPIG mode '" + name + "' (known: cpu_offload, gpu)");
}

void save_magicpig_projection(const h5::Group& group, const mp::Projection& p) {
  mp::check_projection(p, p.head_dim, p.bits, p.tables);
  h5::write_dataset(group, "projection", p.w, {p.head_dim, p.columns()});
  group.set_attr_int("bits", p.bits);
  group.set_attr_int("tables", p.tables);
  group.set_attr_int("head_dim", p.head_dim);
  // The seed is informational (the matrix is what counts); stored as its bit pattern.
  int64_t seed;
  std::memcpy(&seed, &p.seed, sizeof seed);
  group.set_attr_int("seed", seed);
}

mp::Projection load_magicpig_projection(const h5::Group& group) {
  mp::Projection p;
  p.bits = int(group.attr_int("bits"));
  p.tables = int(group.attr_int("tables"));
  p.head_dim = int(group.attr_int("head_dim"));
  const int64_t seed = group.attr_int("seed");
  std::memcpy(&p.seed, &seed, sizeof seed);
  if (p.bits < 1 || p.bits > mp::kMaxBits || p.tables < 1 || p.head_dim < 1)
    throw std::invalid_argument(group.describe() + ": bits " + str(p.bits) + ", tables " +
                                str(p.tables) + ", head_dim " + str(p.head_dim) +
                                " are not a valid MagicPIG projection");
  p.w = h5::open_dataset(group, "projection", h5::DType::F32, {p.head_dim, p.columns()})
            .read<float>();
  return p;
}

void check_magicpig_projection(const h5::Group& group, const ModelShape& shape) {
  const mp::Projection p = load_magicpig_projection(group);
  if (p.head_dim != shape.head_dim)
    throw std::invalid_argument(group.describe() + ": projection for head_dim " + str(p.head_dim) +
                                ", the model has " + str(shape.head_dim));
}

std::unique_ptr<Engine> make_magicpig_engine(const ModelShape& shape, const EngineConfig& config,
                                             const Bundle* bundle) {
  if (!bundle || !config.magicpig.projection.empty() || !bundle->has_method("magicpig"))
    return std::make_unique<MagicPigEngine>(shape, config);
  const mp::Projection p =
      load_magicpig_projection(require_bundle_group(bundle, "magicpig", shape));
  if (p.bits != config.magicpig.bits || p.tables != config.magicpig.tables)
    throw std::invalid_argument(
        "bundle " + bundle->path() + ": the magicpig projection is for (K, L) = (" + str(p.bits) +
        ", " + str(p.tables) + "), the config asks for (" + str(config.magicpig.bits) + ", " +
        str(config.magicpig.tables) + ") (set MagicPigConfig bits and tables to match)");
  EngineConfig c = config;
  c.magicpig.projection = p.w;
  c.magicpig.seed = p.seed;
  return std::make_unique<MagicPigEngine>(shape, c);
}

// One layer's state. Layouts: kernels/magicpig/magicpig.h.
struct MagicPigEngine::Layer {
  int batch = 0, capacity = 0;
  std::vector<int32_t> starts, lens;  // hashed ranges per sequence
  HostArray<float> centre, norms;     // Cpu backend and cpu_offload
  HostArray<uint16_t> codes;          // Cpu backend: [B, Hkv, L, cap]
  HostArray<int32_t> offsets, ids;    // cpu_offload
  HostArray<bf16> k, v;               // cpu_offload
  DeviceArray<int32_t> starts_d, lens_d;
  DeviceArray<float> centre_d, norms_d;    // gpu mode
  DeviceArray<int32_t> offsets_d, ids_d;   // gpu mode
  std::vector<std::vector<int32_t>> last;  // CPU paths: [batch * Hq] ids of the last decode
  std::vector<int> last_seq;               // Cpu backend: sequence lengths of the last decode
  struct Task {
    MagicPigEngine* engine;
    int layer;
    int batch;
  } task{};

  mp::HeadTables head(int b, int h, int hkv, int d, const mp::Params& p) const {
    const int64_t bh = int64_t(b) * hkv + h;
    mp::HeadTables t;
    t.k = k.data() + bh * capacity * d;
    t.v = v.data() + bh * capacity * d;
    t.norms = norms.data() + bh * capacity;
    t.centre = centre.data() + bh * d;
    t.offsets = offsets.data() + bh * p.tables * p.offsets_per_table();
    t.ids = ids.data() + bh * p.tables * capacity;
    t.table_stride = capacity;
    t.n = lens[size_t(b)];
    t.head_dim = d;
    return t;
  }
};

// cpu_offload: pinned staging of the per-step copies, the side stream and its events.
struct MagicPigEngine::Staging {
  HostArray<bf16> q;
  HostArray<uint16_t> codes;
  HostArray<float> o, lse;
  cudaStream_t side = nullptr;
  cudaEvent_t in = nullptr, out = nullptr;
  std::string error;  // an exception of the host function, rethrown by the next call
  std::vector<std::vector<float>> qf;      // per worker
  std::vector<std::vector<int32_t>> cand;  // per worker
  ~Staging() {
    if (in) cudaEventDestroy(in);
    if (out) cudaEventDestroy(out);
    if (side) cudaStreamDestroy(side);
  }
};

MagicPigEngine::MagicPigEngine(const ModelShape& shape, const EngineConfig& config)
    : Engine(shape, config) {
  const MagicPigConfig& c = config_.magicpig;
  validate(c, shape_);
  params_.bits = c.bits;
  params_.tables = c.tables;
  params_.epsilon = c.epsilon;
  dense_layers_ = c.dense_layers ? *c.dense_layers : std::vector<int>{0, shape_.num_layers / 2};
  max_context_ = c.max_context > 0 ? c.max_context : shape_.max_position;
  if (max_context_ <= 0)
    throw std::invalid_argument(
        "MagicPigConfig: max_context is 0 and the model's max_position is 0: set max_context");
  if (c.projection.empty()) {
    projection_ = mp::make_projection(shape_.head_dim, c.bits, c.tables, c.seed);
  } else {
    projection_.head_dim = shape_.head_dim;
    projection_.bits = c.bits;
    projection_.tables = c.tables;
    projection_.seed = c.seed;
    projection_.w = c.projection;
    mp::check_projection(projection_, shape_.head_dim, c.bits, c.tables);
  }
  isa_ = mp::resolve_isa(isa_from_string(c.cpu_isa), shape_.head_dim);
  pool_ = std::make_unique<kernels::ThreadPool>(c.threads);
  scratch_.resize(size_t(pool_->size()));
  layers_.resize(size_t(shape_.num_layers));

  if (config_.backend == Backend::Cuda) {
    const int d = shape_.head_dim;
    if (d != 64 && d != 128)
      throw std::invalid_argument("magicpig engine (cuda): head_dim " + str(d) +
                                  " is not supported (64 or 128)");
    if (c.tables > mp::kMaxTablesCuda)
      throw std::invalid_argument("magicpig engine (cuda): tables (L) " + str(c.tables) +
                                  " above " + str(mp::kMaxTablesCuda));
    if (shape_.group_size() > 8)
      throw std::invalid_argument("magicpig engine (cuda): group size " + str(shape_.group_size()) +
                                  " above 8");
    int dev = 0;
    KVS_CUDA_CHECK(cudaGetDevice(&dev));
    KVS_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, dev));
    KVS_CUDA_CHECK(
        cudaMalloc(reinterpret_cast<void**>(&device_w_), projection_.w.size() * sizeof(float)));
    copy_to_device(device_w_, projection_.w.data(), projection_.w.size() * sizeof(float));
    if (config_.collect_stats) device_counters_ = DeviceCounters(4);
    if (c.mode == MagicPigMode::CpuOffload) {
      staging_ = std::make_unique<Staging>();
      const size_t rows = size_t(config_.max_batch) * shape_.num_q_heads;
      staging_->q.allocate(rows * d, true);
      staging_->codes.allocate(rows * c.tables, true);
      staging_->o.allocate(rows * d, true);
      staging_->lse.allocate(rows, true);
      KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&staging_->side, cudaStreamNonBlocking));
      KVS_CUDA_CHECK(cudaEventCreateWithFlags(&staging_->in, cudaEventDisableTiming));
      KVS_CUDA_CHECK(cudaEventCreateWithFlags(&staging_->out, cudaEventDisableTiming));
      staging_->qf.assign(size_t(pool_->size()), std::vector<float>(size_t(d)));
      staging_->cand.resize(size_t(pool_->size()));
    }
  }
}

MagicPigEngine::~MagicPigEngine() {
  if (staging_ && staging_->side) cudaStreamSynchronize(staging_->side);
  if (device_w_) cudaFree(device_w_);
}

bool MagicPigEngine::is_dense_layer(int layer) const {
  return std::find(dense_layers_.begin(), dense_layers_.end(), layer) != dense_layers_.end();
}

MagicPigEngine::Layer& MagicPigEngine::checked_layer(int layer, const char* who) const {
  if (layer < 0 || layer >= shape_.num_layers || !layers_[size_t(layer)])
    throw std::logic_error(std::string("magicpig engine ") + who + ": layer " + str(layer) +
                           " has no hash tables (prefill it first)");
  return *layers_[size_t(layer)];
}

size_t MagicPigEngine::table_bytes(int layer) const {
  if (layer < 0 || layer >= shape_.num_layers || !layers_[size_t(layer)]) return 0;
  const Layer& l = *layers_[size_t(layer)];
  const size_t heads = size_t(l.batch) * shape_.num_kv_heads * params_.tables;
  return heads * (size_t(l.capacity) + size_t(params_.offsets_per_table())) * sizeof(int32_t);
}

std::pair<int, int> MagicPigEngine::hashed_range(int layer, int b) const {
  const Layer& l = checked_layer(layer, "hashed_range");
  if (b < 0 || b >= l.batch)
    throw std::out_of_range("magicpig engine hashed_range: sequence " + str(b) + " outside [0, " +
                            str(l.batch) + ")");
  return {l.starts[size_t(b)], l.lens[size_t(b)]};
}

size_t MagicPigEngine::workspace_bytes() const {
  if (config_.backend == Backend::Cpu) return 0;
  const int subs = config_.max_batch * shape_.num_kv_heads, d = shape_.head_dim;
  const WorkspaceLayout w =
      workspace_layout(config_.max_batch, shape_.num_kv_heads, shape_.num_q_heads, d,
                       params_.tables, max_context_, config_.magicpig.mode == MagicPigMode::Gpu);
  return w.dense_ws +
         std::max(kernels::dense_decode_workspace_bytes(config_.max_batch, shape_.num_q_heads, d),
                  kernels::dense_decode_workspace_bytes(subs, shape_.group_size(), d));
}

void MagicPigEngine::prefill(int layer, const PagedKV& kv, cudaStream_t stream) {
  check_prefill_args("magicpig engine prefill: ", layer, kv, shape_, config_.max_batch);
  if (is_dense_layer(layer)) return;
  if (config_.backend == Backend::Cpu)
    prefill_cpu(layer, kv);
  else
    prefill_cuda(layer, kv, stream);
}

namespace {

// Hashed range of a prompt of n tokens: after the sink, before the local window.
void hashed_ranges(const std::vector<int32_t>& seq, int sink, int local, int max_context,
                   std::vector<int32_t>* starts, std::vector<int32_t>* lens, int* capacity) {
  starts->resize(seq.size());
  lens->resize(seq.size());
  *capacity = 1;
  for (size_t b = 0; b < seq.size(); ++b) {
    if (seq[b] > max_context)
      throw std::out_of_range("magicpig engine prefill: sequence " + str(int64_t(b)) + " has " +
                              str(seq[b]) + " tokens, above max_context " + str(max_context) +
                              " (MagicPigConfig.max_context)");
    (*starts)[b] = std::min(sink, int(seq[b]));
    (*lens)[b] = std::max(0, int(seq[b]) - sink - local);
    *capacity = std::max(*capacity, int((*lens)[b]));
  }
}

}  // namespace

void MagicPigEngine::prefill_cpu(int layer, const PagedKV& kv) {
  const MagicPigConfig& c = config_.magicpig;
  const int hkv = shape_.num_kv_heads, d = shape_.head_dim, L = params_.tables;
  auto ls = std::make_unique<Layer>();
  ls->batch = kv.batch;
  hashed_ranges(std::vector<int32_t>(kv.seq_lens, kv.seq_lens + kv.batch), c.sink_tokens,
                c.local_tokens, max_context_, &ls->starts, &ls->lens, &ls->capacity);
  const size_t cap = size_t(ls->capacity), bh = size_t(kv.batch) * hkv;
  ls->centre.allocate(bh * d, false);
  ls->norms.allocate(bh * cap, false);
  ls->codes.allocate(bh * L * cap, false);
  Layer& l = *ls;
  pool_->parallel_for(int64_t(bh), [&](int64_t i, int) {
    const int b = int(i / hkv), h = int(i % hkv);
    float* centre = l.centre.data() + i * d;
    mp::centre_cpu(kv, b, h, l.starts[size_t(b)], l.lens[size_t(b)], centre);
    mp::hash_keys_cpu(kv, b, h, l.starts[size_t(b)], l.lens[size_t(b)], centre, projection_,
                      l.codes.data() + i * L * int64_t(cap), int64_t(cap),
                      l.norms.data() + i * int64_t(cap));
  });
  ls->last.assign(size_t(kv.batch) * shape_.num_q_heads, {});
  layers_[size_t(layer)] = std::move(ls);
}

void MagicPigEngine::prefill_cuda(int layer, const PagedKV& kv, cudaStream_t stream) {
  const MagicPigConfig& c = config_.magicpig;
  const bool offload = c.mode == MagicPigMode::CpuOffload;
  const int hkv = shape_.num_kv_heads, d = shape_.head_dim, L = params_.tables;
  if (staging_) KVS_CUDA_CHECK(cudaStreamSynchronize(staging_->side));  // no host task in flight
  std::vector<int32_t> seq(size_t(kv.batch));
  KVS_CUDA_CHECK(cudaMemcpyAsync(seq.data(), kv.seq_lens, seq.size() * sizeof(int32_t),
                                 cudaMemcpyDeviceToHost, stream));
  KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
  layers_[size_t(layer)].reset();  // frees the previous prompt's state first
  auto ls = std::make_unique<Layer>();
  Layer& l = *ls;
  l.batch = kv.batch;
  hashed_ranges(seq, c.sink_tokens, c.local_tokens, max_context_, &l.starts, &l.lens, &l.capacity);
  const int64_t cap = l.capacity, bh = int64_t(kv.batch) * hkv;
  const int64_t per_table = params_.offsets_per_table();
  if (!offload) {
    int optin = 0, dev = 0;
    KVS_CUDA_CHECK(cudaGetDevice(&dev));
    KVS_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    if (mp::sampled_attention_smem_bytes(int(cap)) > size_t(optin))
      throw std::invalid_argument("magicpig engine (gpu mode): a hashed range of " + str(cap) +
                                  " tokens needs " +
                                  str(int64_t(mp::sampled_attention_smem_bytes(int(cap)))) +
                                  " bytes of shared memory for its hit maps, the device allows " +
                                  str(optin) + " (use mode cpu_offload)");
    KVS_CUDA_CHECK(mp::prepare_sampled_attention_cuda(d, int(cap)));
  }
  l.starts_d.allocate(size_t(kv.batch));
  l.lens_d.allocate(size_t(kv.batch));
  copy_to_device(l.starts_d.data(), l.starts.data(), l.starts.size() * 4);
  copy_to_device(l.lens_d.data(), l.lens.data(), l.lens.size() * 4);

  l.centre_d.allocate(size_t(bh * d));
  l.norms_d.allocate(size_t(bh * cap));
  {
    DeviceArray<double> partial;
    partial.allocate(size_t(mp::centre_partial_elems(kv.batch, hkv, d, int(cap))));
    KVS_CUDA_CHECK(mp::centre_cuda(kv, l.starts_d.data(), l.lens_d.data(), int(cap), partial.data(),
                                   l.centre_d.data(), stream));
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  DeviceArray<uint16_t> codes_d;
  codes_d.allocate(size_t(hkv * L * cap));
  HostArray<uint16_t> codes_h;
  codes_h.allocate(size_t(hkv * L * cap), true);
  DeviceArray<bf16> k_d, v_d;
  HostArray<int32_t> off_h, ids_h;  // gpu mode: one sequence's tables before the upload
  if (offload) {
    l.offsets.allocate(size_t(bh * L * per_table), true);
    l.ids.allocate(size_t(bh * L * cap), true);
    l.k.allocate(size_t(bh * cap * d), true);
    l.v.allocate(size_t(bh * cap * d), true);
    l.norms.allocate(size_t(bh * cap), true);
    l.centre.allocate(size_t(bh * d), true);
    k_d.allocate(size_t(hkv * cap * d));
    v_d.allocate(size_t(hkv * cap * d));
  } else {
    l.offsets_d.allocate(size_t(bh * L * per_table));
    l.ids_d.allocate(size_t(bh * L * cap));
    off_h.allocate(size_t(hkv * L * per_table), true);
    ids_h.allocate(size_t(hkv * L * cap), true);
  }
  for (int b = 0; b < kv.batch; ++b) {
    const int start = l.starts[size_t(b)], n = l.lens[size_t(b)];
    const int64_t first = int64_t(b) * hkv;  // first (b, h) slot
    KVS_CUDA_CHECK(mp::hash_keys_cuda(kv, b, start, n, l.centre_d.data() + first * d, device_w_,
                                      params_, int(cap), codes_d.data(),
                                      l.norms_d.data() + first * cap, stream));
    KVS_CUDA_CHECK(cudaMemcpyAsync(codes_h.data(), codes_d.data(), codes_h.size() * 2,
                                   cudaMemcpyDeviceToHost, stream));
    if (offload) {
      KVS_CUDA_CHECK(
          mp::gather_rows_cuda(kv, b, start, n, int(cap), k_d.data(), v_d.data(), stream));
      KVS_CUDA_CHECK(cudaMemcpyAsync(l.k.data() + first * cap * d, k_d.data(), k_d.size() * 2,
                                     cudaMemcpyDeviceToHost, stream));
      KVS_CUDA_CHECK(cudaMemcpyAsync(l.v.data() + first * cap * d, v_d.data(), v_d.size() * 2,
                                     cudaMemcpyDeviceToHost, stream));
    }
    KVS_CUDA_CHECK(cudaStreamSynchronize(stream));
    int32_t* off = offload ? l.offsets.data() + first * L * per_table : off_h.data();
    int32_t* ids = offload ? l.ids.data() + first * L * cap : ids_h.data();
    pool_->parallel_for(int64_t(hkv) * L, [&](int64_t i, int) {
      mp::build_table_cpu(codes_h.data() + i * cap, n, params_.bits, off + i * per_table,
                          ids + i * cap);
    });
    if (!offload) {
      copy_to_device(l.offsets_d.data() + first * L * per_table, off_h.data(), off_h.size() * 4);
      copy_to_device(l.ids_d.data() + first * L * cap, ids_h.data(), ids_h.size() * 4);
    }
  }
  if (offload) {
    KVS_CUDA_CHECK(cudaMemcpy(l.centre.data(), l.centre_d.data(), l.centre.size() * 4,
                              cudaMemcpyDeviceToHost));
    KVS_CUDA_CHECK(
        cudaMemcpy(l.norms.data(), l.norms_d.data(), l.norms.size() * 4, cudaMemcpyDeviceToHost));
    l.centre_d.allocate(0);  // the CPU path reads the host copies
    l.norms_d.allocate(0);
  }
  l.last.assign(size_t(kv.batch) * shape_.num_q_heads, {});
  l.task = {this, layer, 0};
  layers_[size_t(layer)] = std::move(ls);
}

void MagicPigEngine::decode(int layer, const bf16* q, const bf16* q_pre, const PagedKV& kv,
                            bf16* out, float* lse, cudaStream_t stream) {
  check_decode_args(layer, kv, q, out);
  if (staging_ && !staging_->error.empty()) {
    const std::string e = staging_->error;
    staging_->error.clear();
    throw std::runtime_error("magicpig engine: the CPU part of an earlier decode failed: " + e);
  }
  ++host_stats_.decode_calls;
  if (!is_dense_layer(layer)) {
    const Layer& l = checked_layer(layer, "decode");
    if (kv.batch > l.batch)
      throw std::invalid_argument("magicpig engine decode: batch " + str(kv.batch) + " but layer " +
                                  str(layer) + " was prefilled for " + str(l.batch) + " sequences");
  }
  if (config_.backend == Backend::Cpu)
    decode_cpu(layer, q, kv, out, lse);
  else
    decode_cuda(layer, q, kv, out, lse, stream);
}

void MagicPigEngine::decode_cpu(int layer, const bf16* q, const PagedKV& kv, bf16* out,
                                float* lse) {
  const int d = shape_.head_dim, g = shape_.group_size(), Hq = shape_.num_q_heads;
  const int hkv = shape_.num_kv_heads, L = params_.tables;
  const double scale = shape_.scale();
  const bool dense = is_dense_layer(layer);
  Layer* l = dense ? nullptr : &checked_layer(layer, "decode");
  if (l) l->last_seq.assign(kv.seq_lens, kv.seq_lens + kv.batch);
  for (int b = 0; b < kv.batch; ++b) {
    const int seq = kv.seq_lens[b];
    host_stats_.kv_rows_context += uint64_t(seq) * hkv;
    const int start = dense ? 0 : l->starts[size_t(b)];
    const int skip_end = dense ? 0 : start + l->lens[size_t(b)];
    if (!dense && seq < skip_end)
      throw std::invalid_argument("magicpig engine decode: sequence " + str(b) + " has " +
                                  str(seq) + " tokens, fewer than its prefill hashed (up to " +
                                  str(skip_end) + ")");
    if (seq > max_context_)
      throw std::out_of_range("magicpig engine decode: sequence " + str(b) + " has " + str(seq) +
                              " tokens, above max_context " + str(max_context_));
    std::vector<int32_t> dense_tokens;
    for (int t = 0; t < start; ++t) dense_tokens.push_back(t);
    for (int t = skip_end; t < seq; ++t) dense_tokens.push_back(t);
    if (!dense) host_stats_.kv_rows_read += uint64_t(dense_tokens.size()) * hkv;
    pool_->parallel_for(Hq, [&](int64_t qh, int) {
      const int h = int(qh) / g;
      const int64_t row = int64_t(b) * Hq + qh;
      std::vector<float> qf(static_cast<size_t>(d));
      for (int i = 0; i < d; ++i) qf[size_t(i)] = bf16_to_float(q[row * d + i]);
      std::vector<double> o(static_cast<size_t>(d)), os(static_cast<size_t>(d));
      double lo = 0.0;
      if (dense) {
        kernels::attend_cpu(qf.data(), kv, b, h, nullptr, 0, scale, o.data(), &lo);
      } else {
        if (dense_tokens.empty()) {  // a null token list would mean "every token"
          lo = -std::numeric_limits<double>::infinity();
        } else {
          kernels::attend_cpu(qf.data(), kv, b, h, dense_tokens.data(), int(dense_tokens.size()),
                              scale, o.data(), &lo);
        }
        std::vector<uint16_t> codes(static_cast<size_t>(L));
        mp::hash_query_cpu(qf.data(), projection_, codes.data());
        const int64_t slot = int64_t(b) * hkv + h, cap = l->capacity;
        double ls = 0.0;
        l->last[size_t(row)] = mp::sampled_attention_reference(
            qf.data(), codes.data(), kv, b, h, start, l->lens[size_t(b)],
            l->codes.data() + slot * L * cap, cap, l->norms.data() + slot * cap,
            l->centre.data() + slot * d, params_, scale, os.data(), &ls);
        kernels::merge_state_cpu<double>(o.data(), &lo, os.data(), ls, d);
      }
      for (int i = 0; i < d; ++i) out[row * d + i] = float_to_bf16(float(o[size_t(i)]));
      if (lse) lse[row] = float(lo);
    });
    if (dense) {
      host_stats_.kv_rows_read += uint64_t(seq) * hkv;
      continue;
    }
    for (int qh = 0; qh < Hq; ++qh) {
      const uint64_t c = l->last[size_t(b) * Hq + qh].size();
      host_mp_.candidates += c;
      host_stats_.kv_rows_read += c;
      host_mp_.hashed_keys += uint64_t(l->lens[size_t(b)]);
    }
  }
}

void MagicPigEngine::decode_cuda(int layer, const bf16* q, const PagedKV& kv, bf16* out, float* lse,
                                 cudaStream_t stream) {
  const int d = shape_.head_dim, Hq = shape_.num_q_heads, hkv = shape_.num_kv_heads;
  const float scale = float(shape_.scale());
  const bool gpu_mode = config_.magicpig.mode == MagicPigMode::Gpu;
  const WorkspaceLayout w =
      workspace_layout(config_.max_batch, hkv, Hq, d, params_.tables, max_context_, gpu_mode);
  char* base = static_cast<char*>(workspace_.ptr);
  auto* dense_rows = reinterpret_cast<int32_t*>(base + w.dense_rows);
  auto* dense_counts = reinterpret_cast<int32_t*>(base + w.dense_counts);
  auto* o_dense = reinterpret_cast<bf16*>(base + w.o_dense);
  auto* lse_dense = reinterpret_cast<float*>(base + w.lse_dense);
  auto* o_sampled = reinterpret_cast<float*>(base + w.o_sampled);
  auto* lse_sampled = reinterpret_cast<float*>(base + w.lse_sampled);
  auto* q_codes = reinterpret_cast<uint16_t*>(base + w.q_codes);
  auto* bitmap = gpu_mode ? reinterpret_cast<uint32_t*>(base + w.bitmap) : nullptr;
  void* dense_ws = base + w.dense_ws;
  const size_t dense_ws_bytes = workspace_.bytes - w.dense_ws;
  unsigned long long* counters = device_counters_.get();
  if (counters)
    KVS_CUDA_CHECK(kernels::kv_count_rows_cuda(kv.seq_lens, kv.batch, hkv, counters + 3, stream));

  if (is_dense_layer(layer)) {
    KVS_CUDA_CHECK(
        kernels::dense_decode_cuda(q, Hq, kv, scale, out, lse, dense_ws, dense_ws_bytes, stream));
    if (counters)
      KVS_CUDA_CHECK(kernels::kv_count_rows_cuda(kv.seq_lens, kv.batch, hkv, counters, stream));
    return;
  }
  Layer& l = checked_layer(layer, "decode");
  const int rows = kv.batch * Hq;
  KVS_CUDA_CHECK(mp::hash_queries_cuda(q, rows, d, device_w_, params_, q_codes, stream));
  const bool offload = !gpu_mode;
  // The sampled part's partial states per row: one from the CPU, `splits` CTAs on the GPU.
  const int splits = offload ? 1 : mp::sampled_attention_splits(rows, l.capacity, sm_count_);
  if (offload) {
    Staging& s = *staging_;
    KVS_CUDA_CHECK(cudaMemcpyAsync(s.codes.data(), q_codes, size_t(rows) * params_.tables * 2,
                                   cudaMemcpyDeviceToHost, stream));
    KVS_CUDA_CHECK(
        cudaMemcpyAsync(s.q.data(), q, size_t(rows) * d * 2, cudaMemcpyDeviceToHost, stream));
    KVS_CUDA_CHECK(cudaEventRecord(s.in, stream));
    KVS_CUDA_CHECK(cudaStreamWaitEvent(s.side, s.in, 0));
    // The previous step's host task of this layer may still be queued: change its
    // arguments only after it ran.
    if (l.task.batch != kv.batch) KVS_CUDA_CHECK(cudaStreamSynchronize(s.side));
    l.task = {this, layer, kv.batch};
    KVS_CUDA_CHECK(cudaLaunchHostFunc(s.side, host_entry, &l.task));
    KVS_CUDA_CHECK(cudaMemcpyAsync(o_sampled, s.o.data(), size_t(rows) * d * 4,
                                   cudaMemcpyHostToDevice, s.side));
    KVS_CUDA_CHECK(cudaMemcpyAsync(lse_sampled, s.lse.data(), size_t(rows) * 4,
                                   cudaMemcpyHostToDevice, s.side));
    KVS_CUDA_CHECK(cudaEventRecord(s.out, s.side));
  }
  // The dense part runs on the main stream while the CPU works.
  KVS_CUDA_CHECK(mp::dense_rows_cuda(kv, l.starts_d.data(), l.lens_d.data(), max_context_,
                                     dense_rows, dense_counts, counters, stream));
  KVS_CUDA_CHECK(kernels::dense_decode_cuda(
      q, shape_.group_size(), mp::dense_view(kv, dense_rows, dense_counts, max_context_), scale,
      o_dense, lse_dense, dense_ws, dense_ws_bytes, stream));
  if (offload) {
    KVS_CUDA_CHECK(cudaStreamWaitEvent(stream, staging_->out, 0));
  } else {
    mp::DeviceTables t;
    t.centre = l.centre_d.data();
    t.norms = l.norms_d.data();
    t.offsets = l.offsets_d.data();
    t.ids = l.ids_d.data();
    t.starts = l.starts_d.data();
    t.lens = l.lens_d.data();
    t.capacity = l.capacity;
    KVS_CUDA_CHECK(mp::sampled_attention_cuda(q, q_codes, Hq, kv, t, params_, scale, splits,
                                              o_sampled, lse_sampled, bitmap,
                                              counters ? counters + 1 : nullptr, stream));
    last_gpu_layer_ = layer;
    for (int b = 0; b < kv.batch; ++b) host_mp_.hashed_keys += uint64_t(l.lens[size_t(b)]) * Hq;
  }
  KVS_CUDA_CHECK(mp::merge_parts_cuda(o_dense, lse_dense, o_sampled, lse_sampled, splits, rows, d,
                                      out, lse, stream));
}

void CUDART_CB MagicPigEngine::host_entry(void* task) {
  auto* t = static_cast<Layer::Task*>(task);
  try {
    t->engine->run_cpu_part(t->layer, t->batch);
  } catch (const std::exception& e) {
    t->engine->staging_->error = e.what();
  }
}

void MagicPigEngine::run_cpu_part(int layer, int batch) {
  Layer& l = *layers_[size_t(layer)];
  Staging& s = *staging_;
  const int d = shape_.head_dim, Hq = shape_.num_q_heads, g = shape_.group_size();
  const int hkv = shape_.num_kv_heads, L = params_.tables;
  const float scale = float(shape_.scale());
  std::atomic<uint64_t> candidates{0}, scanned{0};
  pool_->parallel_for(int64_t(batch) * Hq, [&](int64_t row, int worker) {
    const int b = int(row / Hq), h = int(row % Hq) / g;
    float* qf = s.qf[size_t(worker)].data();
    const bf16* qb = s.q.data() + row * d;
    for (int i = 0; i < d; ++i) qf[i] = bf16_to_float(qb[i]);
    const mp::HeadTables t = l.head(b, h, hkv, d, params_);
    std::vector<int32_t>& cand = s.cand[size_t(worker)];
    if (int(cand.size()) < t.n) cand.resize(size_t(t.n));
    const mp::HeadResult r = mp::sampled_attention_cpu(
        qf, s.codes.data() + row * L, t, params_, scale, isa_, scratch_[size_t(worker)],
        cand.data(), s.o.data() + row * d, s.lse.data() + row);
    l.last[size_t(row)].assign(cand.data(), cand.data() + r.candidates);
    candidates += uint64_t(r.candidates);
    scanned += uint64_t(r.scanned);
  });
  host_mp_.candidates += candidates.load();
  host_mp_.table_entries += scanned.load();
  for (int b = 0; b < batch; ++b) host_mp_.hashed_keys += uint64_t(l.lens[size_t(b)]) * Hq;
}

std::vector<std::vector<int32_t>> MagicPigEngine::last_read(int layer, int b) const {
  if (is_dense_layer(layer)) return {};
  const Layer& l = checked_layer(layer, "last_read");
  if (b < 0 || b >= l.batch)
    throw std::out_of_range("magicpig engine last_read: sequence " + str(b) + " outside [0, " +
                            str(l.batch) + ")");
  const int Hq = shape_.num_q_heads, hkv = shape_.num_kv_heads;
  const int start = l.starts[size_t(b)], n = l.lens[size_t(b)];
  int seq = 0;
  std::vector<std::vector<int32_t>> ids(static_cast<size_t>(Hq));
  if (config_.backend == Backend::Cpu) {
    seq = l.last_seq.empty() ? 0 : l.last_seq[size_t(b)];
    for (int qh = 0; qh < Hq; ++qh) ids[size_t(qh)] = l.last[size_t(b) * Hq + qh];
  } else {
    if (!workspace_.ptr)
      throw std::logic_error(
          "magicpig engine last_read: no workspace bound (it reads the last "
          "decode's dense counts and hit maps there: keep it bound)");
    KVS_CUDA_CHECK(cudaDeviceSynchronize());
    const WorkspaceLayout w =
        workspace_layout(config_.max_batch, hkv, Hq, shape_.head_dim, params_.tables, max_context_,
                         config_.magicpig.mode == MagicPigMode::Gpu);
    const char* base = static_cast<const char*>(workspace_.ptr);
    // The dense part's count of (b, head 0) is start + (seq - start - n).
    int32_t count = 0;
    KVS_CUDA_CHECK(
        cudaMemcpy(&count, base + w.dense_counts + size_t(b) * hkv * 4, 4, cudaMemcpyDeviceToHost));
    seq = count + n;
    if (config_.magicpig.mode == MagicPigMode::CpuOffload) {
      for (int qh = 0; qh < Hq; ++qh) ids[size_t(qh)] = l.last[size_t(b) * Hq + qh];
    } else {
      if (last_gpu_layer_ != layer)
        throw std::logic_error("magicpig engine last_read (gpu mode): layer " + str(layer) +
                               " is not the last decoded layer (" + str(last_gpu_layer_) +
                               "); the hit maps of earlier layers are overwritten");
      const char* bm = base + w.bitmap;
      const int words = mp::bitmap_words(l.capacity);
      std::vector<uint32_t> host(size_t(Hq) * words);
      KVS_CUDA_CHECK(cudaMemcpy(host.data(), bm + size_t(b) * Hq * words * 4, host.size() * 4,
                                cudaMemcpyDeviceToHost));
      for (int qh = 0; qh < Hq; ++qh)
        for (int wd = 0; wd < words; ++wd)
          for (uint32_t bits = host[size_t(qh) * words + wd]; bits; bits &= bits - 1)
            ids[size_t(qh)].push_back(wd * 32 + __builtin_ctz(bits));
    }
  }
  std::vector<std::vector<int32_t>> tokens(static_cast<size_t>(Hq));
  for (int qh = 0; qh < Hq; ++qh) {
    std::vector<int32_t>& t = tokens[size_t(qh)];
    std::vector<int32_t> sampled = ids[size_t(qh)];
    std::sort(sampled.begin(), sampled.end());
    for (int i = 0; i < start; ++i) t.push_back(i);
    for (int32_t id : sampled) t.push_back(start + id);
    for (int i = start + n; i < seq; ++i) t.push_back(i);
  }
  return tokens;
}

MagicPigStats MagicPigEngine::magicpig_stats() const {
  if (staging_) KVS_CUDA_CHECK(cudaStreamSynchronize(staging_->side));
  MagicPigStats m = host_mp_;
  if (device_counters_) {
    const std::vector<uint64_t> c = device_counters_.read();
    m.candidates += c[1];
    m.table_entries += c[2];
  }
  return m;
}

EngineStats MagicPigEngine::stats() const {
  const MagicPigStats m = magicpig_stats();
  EngineStats s = host_stats_;
  if (config_.backend == Backend::Cpu) {
    s.selection_bytes_read = m.table_entries * sizeof(int32_t);
    return s;
  }
  s.selection_bytes_read = m.table_entries * sizeof(int32_t);
  s.kv_rows_read = m.candidates;
  if (device_counters_) {
    const std::vector<uint64_t> c = device_counters_.read();
    s.kv_rows_read += c[0];
    s.kv_rows_context = c[3];
  }
  return s;
}

void MagicPigEngine::reset_stats() {
  if (staging_) KVS_CUDA_CHECK(cudaStreamSynchronize(staging_->side));
  host_stats_ = EngineStats{};
  host_mp_ = MagicPigStats{};
  device_counters_.reset();
}

}  // namespace kvs
