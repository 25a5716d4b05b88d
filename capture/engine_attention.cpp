#include "capture/engine_attention.h"

#include <stdexcept>

#include "kernels/common/rope.h"
#include "runtime/knobs.h"

namespace kvs {
namespace {

const bf16* bf16_ptr(const torch::Tensor& t) {
  return reinterpret_cast<const bf16*>(t.data_ptr<at::BFloat16>());
}

}  // namespace

PromptQueryRecorder::PromptQueryRecorder(int num_layers, int64_t prompt_tokens, int keep)
    : prompt_tokens_(prompt_tokens),
      first_(std::max<int64_t>(0, prompt_tokens - std::max(keep, 0))),
      parts_(size_t(num_layers)) {}

void PromptQueryRecorder::on_qkv(int layer, int64_t start, const torch::Tensor& q_pre,
                                 const torch::Tensor&, const torch::Tensor&) {
  const int64_t end = start + q_pre.size(0);
  const int64_t lo = std::max(start, first_), hi = std::min(end, prompt_tokens_);
  if (lo >= hi || layer < 0 || layer >= int(parts_.size())) return;
  parts_[size_t(layer)].push_back(
      q_pre.narrow(0, lo - start, hi - lo).to(torch::kCPU, torch::kBFloat16).clone());
}

torch::Tensor PromptQueryRecorder::queries(int layer) const {
  const auto& p = parts_.at(size_t(layer));
  if (p.empty()) return torch::Tensor();
  return p.size() == 1 ? p[0] : torch::cat(p, 0);
}

EngineAttention::EngineAttention(const LlamaModel& model, const std::string& method_spec,
                                 const EngineConfig& base, const Bundle* bundle, int max_tokens)
    : shape_(model.shape()),
      backend_(model.device().is_cuda() ? Backend::Cuda : Backend::Cpu),
      device_(model.device()),
      max_tokens_(max_tokens) {
  if (max_tokens < 2)
    throw std::invalid_argument("EngineAttention: max_tokens must be >= 2, got " +
                                std::to_string(max_tokens));
  const MethodSpec spec = parse_method_spec(method_spec);
  EngineConfig cfg = apply_knobs(base, spec);
  cfg.backend = backend_;
  cfg.max_batch = 1;
  cfg.collect_stats = true;
  engine_ = make_engine(spec.method, shape_, cfg, bundle);
  const size_t ws = engine_->workspace_bytes();
  if (ws > 0) {
    workspace_ = torch::empty({int64_t(ws)}, torch::TensorOptions().dtype(torch::kUInt8).device(device_));
    engine_->bind_workspace({workspace_.data_ptr(), ws});
  }
  KVCacheConfig kc;
  kc.num_layers = shape_.num_layers;
  kc.num_kv_heads = shape_.num_kv_heads;
  kc.head_dim = shape_.head_dim;
  kc.page_size = 16;
  kc.max_batch = 1;
  kc.max_seq_len = max_tokens;
  kc.device = backend_ == Backend::Cuda ? Device::Cuda : Device::Cpu;
  kv_ = std::make_unique<KVCache>(kc);
  kv_->reserve(0, max_tokens);
}

EngineAttention::~EngineAttention() = default;

torch::Tensor EngineAttention::to_backend_bf16(const torch::Tensor& x) const {
  return x.to(device_, torch::kBFloat16).contiguous();
}

void EngineAttention::start(const KvCache& cache, const PromptQueryRecorder* queries) {
  const int64_t S = cache.size();
  if (S < 1) throw std::invalid_argument("EngineAttention::start: the prompt cache is empty");
  if (S >= max_tokens_)
    throw std::invalid_argument("EngineAttention::start: the prompt has " + std::to_string(S) +
                                " tokens, max_tokens is " + std::to_string(max_tokens_) +
                                " (room for at least one decode step is needed)");
  if (cache.num_layers() != shape_.num_layers)
    throw std::invalid_argument("EngineAttention::start: the cache has " +
                                std::to_string(cache.num_layers()) + " layers, the model " +
                                std::to_string(shape_.num_layers));
  const int hq = shape_.num_q_heads, d = shape_.head_dim;
  const int wanted = int(std::min<int64_t>(engine_->prompt_queries_wanted(), S));
  if (wanted > 0 && (!queries || queries->first_position() > S - wanted))
    throw std::invalid_argument(
        std::string("EngineAttention::start: engine ") + to_string(engine_->method()) +
        " wants the prompt's last " + std::to_string(wanted) +
        " queries; record them with a PromptQueryRecorder during the prefill");
  const std::vector<float> inv_freq = rope_inv_freq(shape_.rope, d);
  kv_->set_lengths({int(S)});
  for (int layer = 0; layer < shape_.num_layers; ++layer) {
    const torch::Tensor k = to_backend_bf16(cache.keys(layer));
    const torch::Tensor v = to_backend_bf16(cache.values(layer));
    kv_->write(layer, 0, 0, int(S), bf16_ptr(k), bf16_ptr(v));
    engine_->prefill(layer, kv_->view(layer), nullptr);
    if (wanted == 0) continue;
    const torch::Tensor all = queries->queries(layer);
    if (!all.defined() || queries->first_position() + all.size(0) != S)
      throw std::invalid_argument("EngineAttention::start: the recorded prompt queries of layer " +
                                  std::to_string(layer) + " do not end at the prompt's end");
    const torch::Tensor q_pre = all.narrow(0, all.size(0) - wanted, wanted).contiguous();
    // Post-RoPE queries with the project's one RoPE, rounded to bf16 as the cache's keys.
    torch::Tensor qf = q_pre.to(torch::kFloat32).contiguous();
    std::vector<int32_t> positions(static_cast<size_t>(wanted));
    for (int i = 0; i < wanted; ++i) positions[size_t(i)] = int32_t(S - wanted + i);
    kernels::rope_cpu(qf.data_ptr<float>(), wanted, hq, d, positions.data(), inv_freq.data(),
                      false);
    const torch::Tensor qb = to_backend_bf16(qf), qpb = to_backend_bf16(q_pre);
    engine_->prefill_queries(layer, 0, bf16_ptr(qb), bf16_ptr(qpb), wanted, kv_->view(layer),
                             nullptr);
  }
  engine_->reset_stats();
  step_pos_ = S - 1;
  started_ = true;
}

torch::Tensor EngineAttention::attend(int layer, int64_t pos, const torch::Tensor& q,
                                      const torch::Tensor& q_pre, const torch::Tensor& k,
                                      const torch::Tensor& v) {
  if (!started_) throw std::logic_error("EngineAttention::attend before start()");
  if (pos != step_pos_) {
    // The first layer of a new decode step: the runtime cache grows by one token.
    if (pos != step_pos_ + 1 || layer != 0)
      throw std::invalid_argument("EngineAttention::attend: layer " + std::to_string(layer) +
                                  " at position " + std::to_string(pos) +
                                  ", expected layer 0 of position " +
                                  std::to_string(step_pos_ + 1) + " or position " +
                                  std::to_string(step_pos_));
    if (pos >= max_tokens_)
      throw std::out_of_range("EngineAttention::attend: position " + std::to_string(pos) +
                              " is past max_tokens " + std::to_string(max_tokens_));
    kv_->begin_step(nullptr);
    step_pos_ = pos;
  }
  const torch::Tensor kb = to_backend_bf16(k), vb = to_backend_bf16(v);
  kv_->append(layer, bf16_ptr(kb), bf16_ptr(vb), nullptr);
  const torch::Tensor qb = to_backend_bf16(q), qpb = to_backend_bf16(q_pre);
  torch::Tensor out = torch::empty({shape_.num_q_heads, shape_.head_dim},
                                   torch::TensorOptions().dtype(torch::kBFloat16).device(device_));
  engine_->decode(layer, bf16_ptr(qb), bf16_ptr(qpb), kv_->view(layer),
                  reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>()), nullptr, nullptr);
  return out;
}

}  // namespace kvs
