#include "runtime/eval/replay.h"

#include <algorithm>
#include <map>
#include <memory>
#include <numeric>
#include <stdexcept>

#include "kernels/common/cuda_check.h"
#include "kernels/common/rope.h"
#include "runtime/knobs.h"
#include "runtime/kv_cache.h"

namespace kvs::eval {
namespace {

// Device or host buffer of bytes for the engines' backend.
class Buffer {
 public:
  Buffer(Backend backend, size_t bytes) : backend_(backend), bytes_(bytes) {
    if (bytes == 0) return;
    if (backend == Backend::Cuda) {
      KVS_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
    } else {
      host_.resize(bytes);
      ptr_ = host_.data();
    }
  }
  ~Buffer() {
    if (backend_ == Backend::Cuda && ptr_) cudaFree(ptr_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  void upload(const void* src, size_t n) {
    if (backend_ == Backend::Cuda) {
      KVS_CUDA_CHECK(cudaMemcpy(ptr_, src, n, cudaMemcpyHostToDevice));
    } else {
      std::memcpy(ptr_, src, n);
    }
  }
  void download(void* dst, size_t n) const {
    if (backend_ == Backend::Cuda) {
      KVS_CUDA_CHECK(cudaMemcpy(dst, ptr_, n, cudaMemcpyDeviceToHost));
    } else {
      std::memcpy(dst, ptr_, n);
    }
  }

 private:
  Backend backend_;
  size_t bytes_;
  void* ptr_ = nullptr;
  std::vector<unsigned char> host_;
};

std::vector<float> to_float(const bf16* x, size_t n) {
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = bf16_to_float(x[i]);
  return out;
}

// Every token for every query head: what a dense read attends.
Selection all_tokens(int num_q_heads, int len) {
  Selection s;
  s.tokens.assign(size_t(num_q_heads), std::vector<int32_t>(size_t(len)));
  for (auto& t : s.tokens) std::iota(t.begin(), t.end(), 0);
  return s;
}

}  // namespace

Aggregator replay_capture(const CaptureFile& capture, const ReplayConfig& config,
                          const ReplayProgress& progress) {
  // Engines see the captured heads: the model's shape when every head was captured (a
  // bundle for the model then fits); with a head subset, a bundle's fingerprint check refuses.
  const ModelShape shape = capture.meta().captured_shape();
  const int hq = shape.num_q_heads, hkv = shape.num_kv_heads, d = shape.head_dim;
  std::vector<int> layers = config.layers.empty() ? capture.meta().layers : config.layers;
  for (int l : layers)
    if (!capture.has_layer(l))
      throw std::invalid_argument(capture.path() + ": layer " + std::to_string(l) +
                                  " was not captured (captured layers are in its 'layers' attribute)");
  const Backend backend = config.engine.backend;
  EngineConfig ecfg = config.engine;
  ecfg.max_batch = 1;

  struct Run {
    std::string name, knobs;
    std::unique_ptr<Engine> engine;
    std::unique_ptr<Buffer> workspace;
  };
  std::unique_ptr<Bundle> bundle;
  if (!config.bundle.empty()) bundle = std::make_unique<Bundle>(Bundle::open(config.bundle));
  std::vector<Run> runs;
  for (const std::string& text : config.methods) {
    const MethodSpec spec = parse_method_spec(text);
    Run r;
    r.name = spec.name;
    r.knobs = spec.label();
    r.engine = make_engine(spec.method, shape, apply_knobs(ecfg, spec), bundle.get());
    r.workspace = std::make_unique<Buffer>(backend, r.engine->workspace_bytes());
    r.engine->bind_workspace({r.workspace->get(), r.workspace->bytes()});
    runs.push_back(std::move(r));
  }

  const std::vector<float> inv_freq = rope_inv_freq(shape.rope, d);
  const double scale = shape.scale();
  Buffer q_dev(backend, size_t(hq) * d * sizeof(bf16));
  Buffer qpre_dev(backend, size_t(hq) * d * sizeof(bf16));
  Buffer out_dev(backend, size_t(hq) * d * sizeof(bf16));
  Aggregator agg;

  const int num_seq = config.max_sequences > 0
                          ? std::min<int>(config.max_sequences, int(capture.sequences().size()))
                          : int(capture.sequences().size());
  for (int si = 0; si < num_seq; ++si) {
    const CaptureSequence& seq = capture.sequences()[size_t(si)];
    const int T = seq.num_tokens;
    const int steps = config.max_steps > 0 ? std::min(config.max_steps, seq.num_steps())
                                           : seq.num_steps();
    KVCacheConfig cc;
    cc.num_layers = shape.num_layers;
    cc.num_kv_heads = hkv;
    cc.head_dim = d;
    cc.page_size = 16;
    cc.max_batch = 1;
    cc.max_seq_len = T;
    cc.device = backend == Backend::Cuda ? Device::Cuda : Device::Cpu;
    KVCache cache(cc);
    cache.reserve(0, T);
    std::vector<int32_t> positions(static_cast<size_t>(T));
    std::iota(positions.begin(), positions.end(), 0);

    for (int layer : layers) {
      if (progress)
        progress(seq.name + " layer " + std::to_string(layer) + ": " + std::to_string(steps) +
                 " steps at context " + std::to_string(seq.decode_start) + ".." +
                 std::to_string(seq.decode_start + steps));
      const std::vector<bf16> q_pre = capture.q_pre(si, layer);
      const std::vector<bf16> k_pre = capture.k_pre(si, layer);
      const std::vector<bf16> v = capture.v(si, layer);
      // The cache holds post-RoPE keys rounded to bf16, as a model's KV cache does.
      std::vector<float> kf = to_float(k_pre.data(), k_pre.size());
      kernels::rope_cpu(kf.data(), T, hkv, d, positions.data(), inv_freq.data(), false);
      std::vector<bf16> k(kf.size());
      for (size_t i = 0; i < kf.size(); ++i) k[i] = float_to_bf16(kf[i]);
      {
        Buffer kb(backend, k.size() * sizeof(bf16)), vb(backend, v.size() * sizeof(bf16));
        kb.upload(k.data(), k.size() * sizeof(bf16));
        vb.upload(v.data(), v.size() * sizeof(bf16));
        cache.write(layer, 0, 0, T, static_cast<const bf16*>(kb.get()),
                    static_cast<const bf16*>(vb.get()));
      }
      // The fp64 references read a host view of the same keys: one contiguous page.
      const int32_t table = 0;
      int32_t host_len = 0;
      PagedKV host_kv;
      host_kv.k = k.data();
      host_kv.v = v.data();
      host_kv.page_table = &table;
      host_kv.seq_lens = &host_len;
      host_kv.batch = 1;
      host_kv.num_pages = 1;
      host_kv.page_size = T;
      host_kv.num_kv_heads = hkv;
      host_kv.head_dim = d;
      host_kv.max_pages_per_seq = 1;

      cache.set_lengths({seq.decode_start});
      for (Run& r : runs) {
        r.engine->prefill(layer, cache.view(layer), nullptr);
        const int n = std::min(r.engine->prompt_queries_wanted(), seq.decode_start);
        if (n > 0) {
          // The prompt's last n queries, pre-RoPE as captured and rotated at their positions.
          const size_t first = size_t(seq.decode_start - n) * hq * d, count = size_t(n) * hq * d;
          std::vector<float> qf = to_float(q_pre.data() + first, count);
          kernels::rope_cpu(qf.data(), n, hq, d, positions.data() + (seq.decode_start - n),
                            inv_freq.data(), false);
          std::vector<bf16> qb(count);
          for (size_t i = 0; i < count; ++i) qb[i] = float_to_bf16(qf[i]);
          Buffer qd(backend, count * sizeof(bf16)), qpd(backend, count * sizeof(bf16));
          qd.upload(qb.data(), count * sizeof(bf16));
          qpd.upload(q_pre.data() + first, count * sizeof(bf16));
          r.engine->prefill_queries(layer, 0, static_cast<const bf16*>(qd.get()),
                                    static_cast<const bf16*>(qpd.get()), n, cache.view(layer),
                                    nullptr);
        }
      }

      // Query p rotated at its position and rounded to bf16 like the engines' (qb), and the
      // same values as floats (qf) for the fp64 reference.
      std::vector<float> qf;
      std::vector<bf16> qb;
      auto load_query = [&](int p) {
        qf = to_float(q_pre.data() + size_t(p) * hq * d, size_t(hq) * d);
        kernels::rope_cpu(qf.data(), 1, hq, d, &p, inv_freq.data(), false);
        qb.resize(qf.size());
        for (size_t i = 0; i < qf.size(); ++i) {
          qb[i] = float_to_bf16(qf[i]);
          qf[i] = bf16_to_float(qb[i]);
        }
      };
      StepInput step;
      step.num_q_heads = hq;
      step.kv = host_kv;
      step.seq = 0;
      step.scale = scale;

      // H2O follows the sequence: one selector per baseline row (each fixed budget, each
      // method's read), seeded with the dense attention of the prompt's last h2o_warmup
      // queries (H2O accumulates over the prefill too; the replay has no earlier ones).
      std::map<std::string, H2OSelector> h2o;
      auto h2o_of = [&](const std::string& suffix, const std::string& knob) -> H2OSelector& {
        return h2o.try_emplace(suffix + "|" + knob, hq, hkv, config.h2o).first->second;
      };
      for (double f : config.budget_fractions) h2o_of("", Budget::of_fraction(f).describe());
      if (config.baselines_at_method_read)
        for (const Run& r : runs)
          if (r.engine->method() != Method::Dense) h2o_of("@" + r.name, r.knobs);
      const int warm_from = h2o.empty() ? seq.decode_start : seq.decode_start - config.h2o_warmup;
      for (int p = std::max(0, warm_from); p < seq.decode_start; ++p) {
        load_query(p);
        host_len = p + 1;
        step.q = qf.data();
        const DenseReference warm = dense_reference(step);
        for (auto& [key, sel] : h2o) sel.observe(warm);
      }

      // Each run's read at the previous step (for read_reuse).
      std::vector<Selection> prev_read(runs.size());
      for (int s = 0; s < steps; ++s) {
        const int p = seq.decode_start + s;
        cache.set_lengths({p + 1});
        host_len = p + 1;
        load_query(p);
        step.q = qf.data();
        const DenseReference dense = dense_reference(step);

        auto baselines = [&](const std::string& suffix, const std::string& knob,
                             const Budget& budget) {
          const int tokens = budget.resolve(p + 1);
          if (tokens >= config.streaming.sink_tokens)
            agg.add("streaming" + suffix, knob, layer,
                    evaluate_selection(step, dense, select_streaming(step, budget, config.streaming)));
          if (tokens >= config.quest.page_tokens)
            agg.add("quest" + suffix, knob, layer,
                    evaluate_selection(step, dense, select_quest(step, budget, config.quest)));
          agg.add("h2o" + suffix, knob, layer,
                  evaluate_selection(step, dense, h2o_of(suffix, knob).select(p + 1, budget)));
          agg.add("topk" + suffix, knob, layer,
                  evaluate_selection(step, dense, select_topk(dense, budget)));
        };

        q_dev.upload(qb.data(), qb.size() * sizeof(bf16));
        qpre_dev.upload(q_pre.data() + size_t(p) * hq * d, size_t(hq) * d * sizeof(bf16));
        for (size_t ri = 0; ri < runs.size(); ++ri) {
          Run& r = runs[ri];
          r.engine->decode(layer, static_cast<const bf16*>(q_dev.get()),
                           static_cast<const bf16*>(qpre_dev.get()), cache.view(layer),
                           static_cast<bf16*>(out_dev.get()), nullptr, nullptr);
          std::vector<bf16> ob(size_t(hq) * d);
          out_dev.download(ob.data(), ob.size() * sizeof(bf16));
          const std::vector<float> of = to_float(ob.data(), ob.size());
          Selection read;
          read.tokens = r.engine->last_read(layer, 0);
          if (read.tokens.empty()) read = all_tokens(hq, p + 1);
          StepMetrics m = evaluate_output(step, dense, of.data(), read);
          if (s > 0) m.read_reuse = read_reuse(read, prev_read[ri], p, hkv);
          prev_read[ri] = std::move(read);
          agg.add(r.name, r.knobs, layer, m);
          if (config.baselines_at_method_read && r.engine->method() != Method::Dense) {
            const int per_head = int(std::max<int64_t>(1, m.rows_read / hkv));
            baselines("@" + r.name, r.knobs, Budget::of_tokens(per_head));
          }
        }
        for (double f : config.budget_fractions) {
          const Budget b = Budget::of_fraction(f);
          baselines("", b.describe(), b);
        }
        // Every H2O row has selected for this step; now its attention joins their history.
        for (auto& [key, sel] : h2o) sel.observe(dense);
      }
    }
  }
  return agg;
}

}  // namespace kvs::eval
